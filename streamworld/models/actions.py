"""Action conditioning: one action vector per video frame, injected per latent frame.

Convention (docs/protocol.md): the action of video frame n conditions frame n+1. With temporal
compression r, latent frame 0 covers video frame 0 and latent frame j >= 1 covers video
frames r(j-1)+1 .. rj, so latent frame j >= 1 is conditioned by the r actions of video
frames r(j-1) .. rj-1, and latent frame 0 by nothing (zeros).

The adapter maps those r actions (concatenated) to a vector of the DiT width that is added
to the frame's timestep embedding. The timestep embedding drives the adaptive layer-norm
modulation (shift, scale, gate) of every block and of the output head, so the action steers
every block of that frame's tokens and nothing else: the injection is per frame, causal,
and costs one small MLP per latent frame.

Models whose actions are positions in the frame (PushT's agent target) can also take them
spatially (`spatial_grid`): every token of a latent frame gets features of its offset from
each action's position (Fourier features and a bump one patch wide), mapped by a small MLP
and added to the token after the patch embedding. A global modulation has to learn to turn
two numbers into a place on the grid; the offset features give every token its distance to
the target directly. The MLP's output layer starts at zero, so adding the spatial path to
trained weights changes nothing until it is trained.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .frames import latent_action_window


def gather_latent_actions(
    actions: torch.Tensor,
    first_latent_frame: int,
    num_latent_frames: int,
    temporal_ratio: int,
    offset: int = 0,
) -> torch.Tensor:
    """Per-latent-frame action features [F, r * action_dim] from per-video-frame actions.

    `actions` is [N, action_dim]; row i is the action of video frame `offset + i`. It must
    cover every frame needed.
    """
    action_dim = actions.shape[-1]
    rows = []
    for j in range(first_latent_frame, first_latent_frame + num_latent_frames):
        start, stop = latent_action_window(j, temporal_ratio)
        if start == stop:
            rows.append(actions.new_zeros(temporal_ratio * action_dim))
            continue
        if start < offset or stop > offset + actions.shape[0]:
            raise ValueError(
                f"actions cover video frames {offset}..{offset + actions.shape[0] - 1}; "
                f"latent frame {j} needs {start}..{stop - 1}"
            )
        rows.append(actions[start - offset : stop - offset].reshape(-1))
    return torch.stack(rows)


class SpatialActionEmbedding(nn.Module):
    """Per-token features of where each action points, relative to the token.

    Actions are (x, y) positions already mapped to [-1, 1], x along the frame's width and y
    down its height; token (row, col) of a gh x gw grid sits at the centre of its patch.
    """

    def __init__(self, temporal_ratio: int, dim: int, grid: tuple[int, int], num_freqs: int = 6) -> None:
        super().__init__()
        gh, gw = grid
        ys = (torch.arange(gh, dtype=torch.float32) + 0.5) / gh * 2 - 1
        xs = (torch.arange(gw, dtype=torch.float32) + 0.5) / gw * 2 - 1
        centres = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1).reshape(-1, 2)  # [P, (x, y)]
        self.register_buffer("centres", centres, persistent=False)
        self.register_buffer(
            "freqs", math.pi * 2.0 ** torch.arange(num_freqs, dtype=torch.float32), persistent=False
        )
        self.sigma = 2.0 / max(gh, gw)  # one patch
        self.temporal_ratio = temporal_ratio
        features = temporal_ratio * (4 * num_freqs + 1)
        self.net = nn.Sequential(nn.Linear(features, dim), nn.SiLU(), nn.Linear(dim, dim))
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, F, r * 2] in [-1, 1] -> token features [B, F * P, dim]."""
        b, f, _ = positions.shape
        pos = positions.float().view(b, f, 1, self.temporal_ratio, 2)
        offset = pos - self.centres.view(1, 1, -1, 1, 2)  # [B, F, P, r, 2]
        bump = torch.exp(-offset.square().sum(-1, keepdim=True) / (2 * self.sigma**2))
        angles = (offset.unsqueeze(-1) * self.freqs).flatten(-2)  # [B, F, P, r, 2 * K]
        feats = torch.cat([angles.sin(), angles.cos(), bump], dim=-1).flatten(-2)
        dtype = self.net[0].weight.dtype
        return self.net(feats.to(dtype)).flatten(1, 2)


class ActionAdapter(nn.Module):
    """Actions in `action_range` (the model's own units, e.g. PushT's world coordinates) are
    mapped linearly to [-1, 1] before the MLP. With `spatial_grid` (2-d actions that are
    positions in the frame) the adapter also embeds them per token (`spatial_tokens`)."""

    def __init__(
        self,
        action_dim: int,
        temporal_ratio: int,
        dim: int,
        action_range: tuple[float, float] = (-1.0, 1.0),
        spatial_grid: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.action_dim = action_dim
        self.temporal_ratio = temporal_ratio
        low, high = action_range
        if not high > low:
            raise ValueError(f"action_range must be (low, high) with high > low, got {action_range}")
        self.centre = (low + high) / 2.0
        self.half_range = (high - low) / 2.0
        self.net = nn.Sequential(nn.Linear(action_dim * temporal_ratio, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.spatial: SpatialActionEmbedding | None = None
        if spatial_grid is not None:
            if action_dim != 2:
                raise ValueError(f"spatial actions are (x, y) positions; action_dim is {action_dim}")
            self.spatial = SpatialActionEmbedding(temporal_ratio, dim, spatial_grid)

    def normalise(self, latent_actions: torch.Tensor) -> torch.Tensor:
        return (latent_actions - self.centre) / self.half_range

    def forward(self, latent_actions: torch.Tensor) -> torch.Tensor:
        """[..., r * action_dim] -> [..., dim]."""
        return self.net(self.normalise(latent_actions))

    def spatial_tokens(self, latent_actions: torch.Tensor) -> torch.Tensor | None:
        """[B, F, r * 2] -> per-token features [B, F * P, dim], or None without `spatial_grid`."""
        if self.spatial is None:
            return None
        return self.spatial(self.normalise(latent_actions.float()))
