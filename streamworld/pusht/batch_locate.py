"""The PushT locator and frame cost for many frames at once, in PyTorch on any device.

`world.locate` reads one frame at a time with NumPy, which is the fastest way on a CPU: a
frame's maps fit in the cache. Planning on a GPU scores thousands of predicted frames per
plan (`--cost-frames best`: every frame of 48 candidates of 24 frames), and one host thread
reading them one by one took longer than the rollouts. The same steps here run on a whole
stack of frames in a few kernels, in float64 as on the host, so the answers match
`world.locate` up to the rounding of the sums (and, rarely, a tie between two equal peaks
broken the other way).
"""

from __future__ import annotations

import numpy as np
import torch

from .world import _FLOOR, _UNMIX


def palette_weights_batch(frames: torch.Tensor) -> torch.Tensor:
    """`world.palette_weights` of frames [N, H, W, 3] (uint8): [N, H, W, 4] float64."""
    n, h, w, _ = frames.shape
    unmix = torch.as_tensor(_UNMIX, dtype=torch.float64, device=frames.device)
    x = frames.reshape(-1, 3).to(torch.float64)
    weights = torch.addmm(unmix[:, 3], x, unmix[:, :3].T).reshape(n, h, w, 4)
    weights = ((weights - _FLOOR) / (1.0 - _FLOOR)).clamp_(0.0, 1.0)
    border = max(1, round(2 * h / 64))
    weights[:, :border] = 0.0
    weights[:, -border:] = 0.0
    weights[:, :, :border] = 0.0
    weights[:, :, -border:] = 0.0
    return weights


def box_mean_batch(m: torch.Tensor, size: int) -> torch.Tensor:
    """`world.box_mean` of maps [N, H, W]: the mean over each size x size neighbourhood
    (zero padding), from a summed-area table as there."""
    pad = size // 2
    n, h, w = m.shape
    c = m.new_zeros(n, h + 2 * pad + 1, w + 2 * pad + 1)
    c[:, 1 + pad : 1 + pad + h, 1 + pad : 1 + pad + w] = m
    c = c.cumsum(1).cumsum(2)
    total = c[:, size : size + h, size : size + w] - c[:, :h, size : size + w]
    total = total - c[:, size : size + h, :w] + c[:, :h, :w]
    return total / (size * size)


def locate_batch(
    frames: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`world.locate` of frames [N, H, W, 3] (uint8): (agent, block), centroids [N, 2] in
    frame pixels (x, y), NaN in a frame where the object is not seen. `weights`: the
    frames' `palette_weights_batch`, where the caller has them."""
    _, h, w, _ = frames.shape
    weights = palette_weights_batch(frames) if weights is None else weights
    ys = torch.arange(h, dtype=torch.float64, device=frames.device)[:, None] + 0.5
    xs = torch.arange(w, dtype=torch.float64, device=frames.device)[None, :] + 0.5
    scale = h / 64

    def find(k: int, box: int, radius: float) -> torch.Tensor:
        m = weights[..., k]
        peak, index = box_mean_batch(m, box).flatten(1).max(1)
        py, px = (index // w).to(torch.float64), (index % w).to(torch.float64)
        near = torch.hypot(xs - (px + 0.5)[:, None, None], ys - (py + 0.5)[:, None, None]) <= radius
        mass = m * near
        centre = (
            torch.stack([(mass * xs).sum((1, 2)), (mass * ys).sum((1, 2))], 1) / mass.sum((1, 2))[:, None]
        )
        return torch.where((peak >= 0.5)[:, None], centre, torch.full_like(centre, float("nan")))

    # The agent is a disc of radius 15 world units (1.9 px at 64 px); the T spans 120 units.
    return find(3, 3, 4.0 * scale), find(2, 3, 10.0 * scale)


class BatchFrameCost:
    """`planning.frame_cost`'s terms for a stack of frames at once on `device`: per frame,
    the agent's and the block's pixel distances from the goal frame's (the frame's size
    where either is not seen) plus `shape_weight` times the mean squared difference of the
    blurred block maps."""

    def __init__(self, goal_frame: np.ndarray, shape_weight: float, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.shape_weight = shape_weight
        self.size = float(goal_frame.shape[0])
        goal = torch.from_numpy(np.ascontiguousarray(goal_frame))[None].to(self.device)
        weights = palette_weights_batch(goal)
        self.goal_agent, self.goal_block = locate_batch(goal, weights)
        self.goal_map = box_mean_batch(weights[..., 2], 5)

    def frames(self, frames: np.ndarray, slice_frames: int = 512) -> np.ndarray:
        """The cost of each frame of [..., S, S, 3] (uint8), in the same shape [...]. The
        frames go `slice_frames` at a time, which bounds the float64 maps on the device
        (about 0.5 MB a frame at 64x64)."""
        lead = frames.shape[:-3]
        stack = np.ascontiguousarray(frames).reshape(-1, *frames.shape[-3:])
        costs = [self._costs(stack[i : i + slice_frames]) for i in range(0, len(stack), slice_frames)]
        return np.concatenate(costs).reshape(lead)

    def _costs(self, frames: np.ndarray) -> np.ndarray:
        stack = torch.from_numpy(frames).to(self.device)
        weights = palette_weights_batch(stack)
        agent, block = locate_batch(stack, weights)
        shape = ((box_mean_batch(weights[..., 2], 5) - self.goal_map) ** 2).mean((1, 2))
        cost = self._distance(agent, self.goal_agent) + self._distance(block, self.goal_block)
        return (cost + self.shape_weight * shape).cpu().numpy()

    def _distance(self, found: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        apart = torch.hypot(found[:, 0] - goal[0, 0], found[:, 1] - goal[0, 1])
        return torch.nan_to_num(apart, nan=self.size)
