"""Action conditioning: one action vector per video frame, injected per latent frame.

Convention (PROTOCOL.md): the action of video frame n conditions frame n+1. With temporal
compression r, latent frame 0 covers video frame 0 and latent frame j >= 1 covers video
frames r(j-1)+1 .. rj, so latent frame j >= 1 is conditioned by the r actions of video
frames r(j-1) .. rj-1, and latent frame 0 by nothing (zeros).

The adapter maps those r actions (concatenated) to a vector of the DiT width that is added
to the frame's timestep embedding. The timestep embedding drives the adaptive layer-norm
modulation (shift, scale, gate) of every block and of the output head, so the action steers
every block of that frame's tokens and nothing else: the injection is per frame, causal,
and costs one small MLP per latent frame.
"""

from __future__ import annotations

import torch
from torch import nn


def latent_action_window(latent_frame: int, temporal_ratio: int) -> tuple[int, int]:
    """Video-frame range [start, stop) of the actions that condition a latent frame."""
    if latent_frame == 0:
        return (0, 0)
    return (temporal_ratio * (latent_frame - 1), temporal_ratio * latent_frame)


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


class ActionAdapter(nn.Module):
    """Actions in `action_range` (the model's own units, e.g. PushT's world coordinates) are
    mapped linearly to [-1, 1] before the MLP."""

    def __init__(
        self, action_dim: int, temporal_ratio: int, dim: int, action_range: tuple[float, float] = (-1.0, 1.0)
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

    def forward(self, latent_actions: torch.Tensor) -> torch.Tensor:
        """[..., r * action_dim] -> [..., dim]."""
        return self.net((latent_actions - self.centre) / self.half_range)
