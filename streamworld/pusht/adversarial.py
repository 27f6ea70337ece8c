"""An adversarial term for the unrolled objective (`train pusht --adversarial-weight`).

A squared (or absolute) error against the true frames is least, where the block's future is
uncertain given the model's own earlier chunks, for a blur (or the median, which drops the
block): neither rewards drawing one sharp future (docs/pusht.md, "An objective over whole
rollouts"). A discriminator does. `ClipDiscriminator` judges a stream clip, the frames after
its sink, given the sink frame and the clip's actions: true clips from the data set against
the one-step sampler's own rollouts of the same sinks and actions (`Trainer.unrolled`). The
sampler is then trained on the regression error plus a weight of the discriminator's verdict
on its rollouts, the weight set each step so that the two gradients on the rollouts' frames
have a fixed ratio (`adaptive_weight`), as VQGAN weighs its adversarial term (there at the
decoder's last layer). The losses are
the hinge losses of SAGAN; the discriminator's convolutions are spectrally normalised.

The discriminator is conditioned on the actions so that a sharp block moving the wrong way is
as false as a blur: each frame gets a map of its action's target (`action_maps`), a bump at
the pixel the agent is driven to. It sees the sink frame and each frame's change from it (the
anchored latents themselves), so it judges motion, not only the look of one frame.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from .world import WORLD_SIZE

# A latent pixel whose true and rolled-out values differ by more than this (latents span
# [-1, 1], or [-2, 2] as a change) makes its discriminator patch count in the losses.
DIFFERENCE = 0.05


def action_maps(actions: torch.Tensor, size: int, sigma: float = 1.5) -> torch.Tensor:
    """A bump at each action's target: [B, L, 2] world (x, y) -> [B, 1, L, size, size].

    Pixel (row, column) of world (x, y) is (y, x) * size / 512, at the pixel's centre."""
    scale = size / WORLD_SIZE
    centre = torch.arange(size, device=actions.device, dtype=torch.float32) + 0.5
    x = actions[..., 0].float() * scale  # [B, L]
    y = actions[..., 1].float() * scale
    dx = (centre[None, None, None, :] - x[..., None, None]) ** 2  # [B, L, 1, W]
    dy = (centre[None, None, :, None] - y[..., None, None]) ** 2  # [B, L, H, 1]
    return torch.exp(-(dx + dy) / (2 * sigma * sigma))[:, None]


class ClipDiscriminator(nn.Module):
    """Patch logits [B, 1, L', h', w'] for clips: sink frame [B, 3, 1, S, S], latents of the
    frames after it [B, 3, L, S, S] (their change from the sink, for anchored pixels) and
    actions [B, L, 2]. A 3-d convolutional net over 7 channels (sink, change, action map),
    strided in space 64 -> 8 and in time by 2, spectrally normalised."""

    def __init__(self, size: int, width: int = 32) -> None:
        super().__init__()
        self.size = size

        def conv(cin: int, cout: int, stride: tuple[int, int, int]) -> nn.Module:
            return spectral_norm(nn.Conv3d(cin, cout, (3, 4, 4), stride, (1, 1, 1)))

        self.net = nn.Sequential(
            conv(7, width, (1, 2, 2)),
            nn.LeakyReLU(0.2),
            conv(width, 2 * width, (1, 2, 2)),
            nn.LeakyReLU(0.2),
            conv(2 * width, 4 * width, (2, 2, 2)),
            nn.LeakyReLU(0.2),
            spectral_norm(nn.Conv3d(4 * width, 1, 3, 1, 1)),
        )

    def grid(self, length: int) -> tuple[int, int, int]:
        """The patch logits' grid (L', h', w') for clips of `length` frames."""
        return ((length - 1) // 2 + 1, self.size // 8, self.size // 8)

    def forward(self, sink: torch.Tensor, latents: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        length, s = latents.shape[2], latents.shape[-1]
        if s != self.size:
            raise ValueError(f"the discriminator judges {self.size}px frames, got {s}px")
        x = torch.cat([sink.expand(-1, -1, length, -1, -1), latents, action_maps(actions, s)], 1).float()
        return self.net(x)


def differing_patches(real: torch.Tensor, fake: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """Which of the discriminator's patches (its logits' grid [L', h', w']) see a difference
    between a true clip's latents and the rollout's [B, C, L, S, S]: those whose cell of
    frames holds a pixel that differs by more than `DIFFERENCE` in some channel. A float
    mask [B, 1, L', h', w'] of ones and zeros."""
    diff = (real.detach().float() - fake.detach().float()).abs().amax(1, keepdim=True)
    return (F.adaptive_max_pool3d(diff, tuple(grid)) > DIFFERENCE).float()


def patch_weights(differing: torch.Tensor, background: float) -> torch.Tensor:
    """The patches' weights in the hinge losses: 1 where clip and rollout differ
    (`differing_patches`), `background` elsewhere. With 0 the discriminator never learns
    the still background, and a strong pull on the rollouts can change the background to
    raise its untrained verdict there (round 20, docs/pusht.md)."""
    return differing + background * (1 - differing) if background else differing


def patch_mean(x: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
    """The mean of `x`, weighed by `where` if given (a mask, or `patch_weights`)."""
    if where is None:
        return x.mean()
    return (x * where).sum() / where.sum().clamp_min(1e-6)


def discriminator_loss(
    real: torch.Tensor, fake: torch.Tensor, where: torch.Tensor | None = None
) -> torch.Tensor:
    """Hinge loss: true clips' logits above 1, rollouts' below -1; with `where`
    (`differing_patches`, or `patch_weights`), over those patches (weighed)."""
    return patch_mean(torch.relu(1 - real), where) + patch_mean(torch.relu(1 + fake), where)


def generator_loss(fake: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """The rollouts' side of the hinge: raise the discriminator's logits on them (with
    `where`, on those patches, weighed)."""
    return -patch_mean(fake, where)


def discriminator_optimizer(disc: ClipDiscriminator, lr: float) -> torch.optim.Optimizer:
    """The discriminator's AdamW: a low first-moment decay (0.5), as GAN discriminators train,
    and no weight decay."""
    return torch.optim.AdamW(disc.parameters(), lr=lr, betas=(0.5, 0.99), weight_decay=0.0)


def discriminator_update(
    disc: ClipDiscriminator,
    opt: torch.optim.Optimizer,
    sink: torch.Tensor,
    real: torch.Tensor,
    fake: torch.Tensor,
    actions: torch.Tensor,
    where: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimiser step of `disc`: true clips `real` against rollouts `fake` (detached by
    the caller) of the same sinks and actions, the hinge losses over the patches `where`
    (weighed). Returns the loss and the two sides' logits, detached."""
    d_real = disc(sink, real, actions)
    d_fake = disc(sink, fake, actions)
    loss = discriminator_loss(d_real, d_fake, where)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach(), d_real.detach(), d_fake.detach()


# The most the adversarial term's adaptive weight may be, as VQGAN caps it: a near-zero
# adversarial gradient would otherwise give an unbounded weight.
ADAPTIVE_WEIGHT_CAP = 1e4


def adaptive_weight(
    regression: torch.Tensor,
    adversarial: torch.Tensor,
    at: torch.Tensor,
    ratio: float,
    cap: float = ADAPTIVE_WEIGHT_CAP,
) -> torch.Tensor:
    """The adversarial term's weight so that its gradient with respect to `at` (the rollouts'
    frames) has `ratio` times the regression's gradient norm there, at most `cap`
    (detached). Taken at the frames rather than at a layer of the DiT, so that it costs the
    two losses' own backward passes only, not the DiT's. A discriminator whose verdict goes
    flat has a small gradient and so gets a large weight: `cap` bounds how far that goes
    (`train pusht --adversarial-max-scale`)."""
    g_reg = torch.autograd.grad(regression, at, retain_graph=True)[0]
    g_adv = torch.autograd.grad(adversarial, at, retain_graph=True)[0]
    return (ratio * g_reg.norm() / (g_adv.norm() + 1e-8)).clamp(max=cap).detach()
