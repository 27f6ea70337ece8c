"""A probe that reads each predicted frame's scene from the DiT's hidden states.

`train pusht --state-weight W` trains it beside the DiT on the recorded scenes
(`data.py`, `states.npy`), or on their change since the frame before each chunk
(`--state-target change`), and adds W times its squared error to the loss, so that the
DiT's hidden states have to hold where the block and the agent will be and which way the
block points, which the pixel loss asks for only weakly: a blurred T costs it little more
than a sharp one at a slightly wrong angle. Only the training uses the probe; it is kept
in the training checkpoint and exported beside the weights (`train.state_probe_path`),
which serve as before without it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# What the probe predicts per frame: the agent's x, y and the block's x, y, mapped from
# world units [0, 512] to [-1, 1], then the cosine and sine of the block's angle.
STATE_DIM = 6
WORLD_HALF = 256.0
CHANGE_SCALE = 32.0  # world units (4 px of the 64 px frame) per unit of `change_targets`


def state_targets(scenes: torch.Tensor) -> torch.Tensor:
    """Scenes [..., 5] (agent x, y, block x, y in world units, angle in radians) as the
    probe's targets [..., STATE_DIM]."""
    positions = scenes[..., :4] / WORLD_HALF - 1.0
    angle = scenes[..., 4:5]
    return torch.cat([positions, angle.cos(), angle.sin()], -1)


class StateProbe(nn.Module):
    """Each frame's hidden states [B, F * P, D] (P tokens per frame) to its state [B, F, STATE_DIM].

    Every token is normalised and narrowed to `width` features, and the frame's tokens,
    in their grid order (the position of a token is where it is in the frame), go through
    a small MLP."""

    def __init__(self, dim: int, tokens_per_frame: int, width: int = 16, hidden: int = 256) -> None:
        super().__init__()
        self.tokens_per_frame = tokens_per_frame
        self.norm = nn.LayerNorm(dim)
        self.narrow = nn.Linear(dim, width)
        self.mlp = nn.Sequential(
            nn.Linear(tokens_per_frame * width, hidden), nn.GELU(), nn.Linear(hidden, STATE_DIM)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, n, _ = hidden.shape
        x = self.narrow(self.norm(hidden.float()))
        return self.mlp(x.reshape(b, n // self.tokens_per_frame, -1))


def change_targets(scenes: torch.Tensor, before: torch.Tensor, turn_weight: float = 1.0) -> torch.Tensor:
    """The change of scenes [..., 5] since `before` (broadcast against them) as targets
    [..., STATE_DIM]: the positions' change over CHANGE_SCALE world units, then the cosine and
    sine of the block's turn, both times `turn_weight`, so that a squared error weighs the
    turn `turn_weight` squared times as much (the angle `state_errors` reads is the same). A
    model that predicts each chunk's change (`delta`) draws a still block as no change
    wherever it is, so its last hidden states need not hold where the block is, only how it
    moves (`benchmarks/state_probe_check.py`)."""
    change = scenes - before
    turn = change[..., 4:5]
    return torch.cat([change[..., :4] / CHANGE_SCALE, turn_weight * turn.cos(), turn_weight * turn.sin()], -1)


def state_errors(
    pred: torch.Tensor, target: torch.Tensor, scale: float = WORLD_HALF
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's position error (world units) and angle error (degrees, in [0, 180]) per
    frame [...], from predictions and targets [..., STATE_DIM] whose positions are in units
    of `scale` world units (`state_targets`; CHANGE_SCALE for `change_targets`)."""
    position = ((pred[..., 2:4] - target[..., 2:4]) * scale).norm(dim=-1)
    angle = torch.atan2(pred[..., 5], pred[..., 4]) - torch.atan2(target[..., 5], target[..., 4])
    angle = torch.remainder(angle + math.pi, 2 * math.pi) - math.pi
    return position, angle.abs() * (180.0 / math.pi)
