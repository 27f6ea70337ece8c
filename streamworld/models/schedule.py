"""Few-step flow-matching schedule of CausVid / Self-Forcing.

Timesteps live on the 0..1000 scale the DiT was trained with; sigma = t / 1000. The model
predicts the flow v, so the clean estimate is x0 = x_t - sigma * v (or x0 itself, or x0's
change since the last latent frame before the chunk: `PREDICTIONS`), and the next step
re-noises it: x_t' = (1 - sigma') * x0 + sigma' * noise.

Noise is a pure function of (seed, chunk, step, shape), never of the order in which work
runs, so that a pipelined or batched engine draws exactly the noise the sequential
reference draws.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .transfer import to_device

NUM_TRAIN_TIMESTEPS = 1000


def shift_sigma(sigma: float, shift: float) -> float:
    """The shifted flow-matching grid: sigma' = shift * s / (1 + (shift - 1) * s)."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


# What a DiT may output: the flow v = noise - x0; the clean sample x0; or "delta", x0's change
# since the last latent frame before the chunk (x0 = last + output), so that a chunk where
# nothing moves is the all-zero output wherever the scene stood before it.
PREDICTIONS = ("flow", "x0", "delta")


@dataclass(frozen=True)
class FlowSchedule:
    timesteps: tuple[float, ...]
    # What the DiT outputs: the flow v (Wan, CausVid, Self-Forcing), the clean sample x0
    # (better for pixel-space models with large patches, whose flow is mostly noise), or
    # x0's change since the last frame before the chunk ("delta").
    prediction: str = "flow"

    @classmethod
    def build(
        cls,
        steps: tuple[float, ...] | list[float],
        shift: float = 5.0,
        warp: bool = True,
        prediction: str = "flow",
    ) -> FlowSchedule:
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
        if not steps:
            raise ValueError("the denoising step list is empty")
        if any(not 0 < s <= NUM_TRAIN_TIMESTEPS for s in steps):
            raise ValueError(f"denoising steps must lie in (0, {NUM_TRAIN_TIMESTEPS}]: {list(steps)}")
        if list(steps) != sorted(steps, reverse=True):
            raise ValueError(f"denoising steps must decrease: {list(steps)}")
        if warp:
            steps = [NUM_TRAIN_TIMESTEPS * shift_sigma(s / NUM_TRAIN_TIMESTEPS, shift) for s in steps]
        return cls(tuple(float(s) for s in steps), prediction)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @staticmethod
    def sigma(t: float) -> float:
        return t / NUM_TRAIN_TIMESTEPS

    def x0_from_flow(
        self, x_t: torch.Tensor, flow: torch.Tensor, step: int, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The clean estimate from the DiT's output at `step` (a flow, x0 itself, or x0's
        change since `last`, the latent frame [C, 1, h, w] before the chunk: None is zero)."""
        if self.prediction == "x0":
            return flow
        if self.prediction == "delta":
            return flow if last is None else flow + last
        return x_t - self.sigma(self.timesteps[step]) * flow

    def renoise(self, x0: torch.Tensor, noise: torch.Tensor, step: int) -> torch.Tensor:
        """x at `step` (> 0) from the clean estimate of the previous step."""
        s = self.sigma(self.timesteps[step])
        return (1.0 - s) * x0 + s * noise

    def step_input(
        self,
        seed: int,
        chunk: int,
        step: int,
        x0_prev: torch.Tensor | None,
        shape: tuple[int, ...],
        device: torch.device | str,
    ) -> torch.Tensor:
        """x_t fed to denoising `step` of a chunk: pure noise at step 0, re-noised x0 after."""
        return self.noised(to_device(chunk_noise(seed, chunk, step, shape), device), step, x0_prev)

    def noised(self, noise: torch.Tensor, step: int, x0_prev: torch.Tensor | None) -> torch.Tensor:
        """`step_input` given the chunk's noise for the step (never written to)."""
        if step == 0:
            return noise
        if x0_prev is None:
            raise ValueError("steps after the first need the previous step's x0")
        return self.renoise(x0_prev, noise, step)


def noise_seed(seed: int, chunk: int, step: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{chunk}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def chunk_noise(seed: int, chunk: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Gaussian noise for one chunk and step, float32 on the CPU (move it where needed)."""
    gen = torch.Generator(device="cpu").manual_seed(noise_seed(seed, chunk, step))
    return torch.randn(shape, generator=gen, dtype=torch.float32)
