"""The PushT environment as StreamWorld sees it: frames, actions, and where things are.

`PushTWorld` wraps `gym-pusht`'s `PushTEnv` (pymunk physics at 10 Hz, a PD-controlled round
agent pushing a T-shaped block toward a fixed goal pose). Actions are the agent's target
position in world units ([0, 512] on both axes), one per frame, as in the environment.

Frames are rendered from the environment's own 512x512 drawing and box-filtered down to the
model's frame size (so edges are anti-aliased, and the pixels do not depend on OpenCV's
resize). `locate` finds the agent and the block in a frame (true or predicted) by unmixing
every pixel into the scene's palette, which is how the evaluation measures position errors.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import numpy as np

os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")

WORLD_SIZE = 512
FPS = 10

# The scene's colours (pygame names in gym-pusht), RGB.
WHITE = (255.0, 255.0, 255.0)
GOAL = (144.0, 238.0, 144.0)  # LightGreen, the goal pose
BLOCK = (131.0, 149.0, 168.0)  # LightSlateGray fill and its lighter outline, averaged
AGENT = (71.0, 115.0, 240.0)  # RoyalBlue fill and outline, averaged
_PALETTE = np.array([WHITE, GOAL, BLOCK, AGENT]).T  # [3, 4]
# Unmixing: [r, g, b, 1] = [palette; 1 1 1 1] @ weights.
_UNMIX = np.linalg.inv(np.vstack([_PALETTE, np.ones((1, 4))]))
_FLOOR = 0.2


def _import_env():
    try:
        from gym_pusht.envs.pusht import PushTEnv
    except ImportError as e:  # pragma: no cover - gym-pusht is a dependency
        raise ImportError(
            f"the PushT environment needs the gym-pusht package (pip install 'gym-pusht==0.1.8'): {e}"
        ) from e
    return PushTEnv


@dataclass(frozen=True)
class Scene:
    """Positions in world units: the agent (x, y) and the block (x, y, angle in radians)."""

    agent: tuple[float, float]
    block: tuple[float, float, float]

    def to_json(self) -> dict:
        return {"agent": list(self.agent), "block": list(self.block)}


def angle_error(a, b):
    """|a - b| in degrees for two angles in radians (floats or arrays), the short way round
    (nan if either is)."""
    return np.abs(np.degrees((a - b + math.pi) % (2 * math.pi) - math.pi))


class PushTWorld:
    """One PushT environment rendering `size` x `size` RGB frames (uint8)."""

    def __init__(self, size: int = 64) -> None:
        if WORLD_SIZE % size:
            raise ValueError(f"frame size must divide {WORLD_SIZE}, got {size}")
        self.size = size
        self.env = _import_env()(obs_type="state")
        self.seed: int | None = None
        # Every action since reset, to replay the episode (`replica`); about 130 bytes a step.
        self.actions: list[np.ndarray] = []

    def reset(self, seed: int) -> np.ndarray:
        """Start the episode of `seed` (the environment's own random initial state)."""
        self.env.reset(seed=int(seed))
        self.seed = int(seed)
        self.actions = []
        return self.render()

    def step(self, action) -> np.ndarray:
        """One step of `action` (the agent's target, world units), and the frame after it."""
        self.advance(action)
        return self.render()

    def advance(self, action) -> None:
        """`step` without drawing the frame, which takes most of a step's time (about 1.7
        of 2.0 ms on a 2-core CPU): for steps whose frame nobody looks at."""
        if self.seed is None:
            raise RuntimeError("call reset(seed) before step()")
        a = np.asarray(action, dtype=np.float64).reshape(2)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"action must be finite, got {a}")
        a = np.clip(a, 0.0, WORLD_SIZE)
        self.env.step(a)
        self.actions.append(a)

    def replica(self) -> PushTWorld:
        """A second environment in exactly this one's state: the episode replayed from its
        seed, without drawing (the physics is deterministic; pymunk's state cannot be
        copied directly)."""
        if self.seed is None:
            raise RuntimeError("call reset(seed) before replica()")
        twin = PushTWorld(self.size)
        twin.env.reset(seed=self.seed)
        for a in self.actions:
            twin.env.step(a)
        twin.seed, twin.actions = self.seed, list(self.actions)
        return twin

    @property
    def scene(self) -> Scene:
        agent = self.env.agent.position
        block = self.env.block
        return Scene(
            (float(agent[0]), float(agent[1])),
            (float(block.position[0]), float(block.position[1]), float(block.angle)),
        )

    @property
    def coverage(self) -> float:
        """Share of the goal area the block covers (the task's success measure)."""
        return float(self.env._get_coverage())

    def render(self) -> np.ndarray:
        import pygame

        surface = self.env._draw()
        full = pygame.surfarray.pixels3d(surface)  # [x, y, 3] view of the 512x512 drawing
        f = WORLD_SIZE // self.size
        edges = np.arange(0, WORLD_SIZE, f)
        sums = np.add.reduceat(
            np.add.reduceat(full, edges, axis=0, dtype=np.uint32), edges, axis=1, dtype=np.uint32
        )
        del full  # releases the surface lock
        return ((sums + f * f // 2) // (f * f)).astype(np.uint8).transpose(1, 0, 2).copy()

    def close(self) -> None:
        self.env.close()


def initial_frame(seed: int, size: int = 64) -> tuple[np.ndarray, Scene]:
    """The first frame and scene of the episode of `seed`."""
    world = PushTWorld(size)
    try:
        frame = world.reset(seed)
        return frame, world.scene
    finally:
        world.close()


@dataclass(frozen=True)
class Located:
    """Centroids in frame pixels (x, y), or None where the object is not visible."""

    agent: tuple[float, float] | None
    block: tuple[float, float] | None


def locate(frame: np.ndarray, weights: np.ndarray | None = None) -> Located:
    """Where the agent and the block are in an RGB frame [H, W, 3] (uint8). `weights`:
    the frame's `palette_weights`, where the caller has them already.

    Each pixel is unmixed into white, goal green, block grey and agent blue (weights that
    sum to 1). An object is found at the peak of its locally averaged weight, and its
    position is the weight-averaged pixel centre within the object's radius around that
    peak, so stray pixels elsewhere in a predicted frame (noise, smears) do not pull it. An
    object whose peak weight is below one half counts as not visible. The two outermost
    pixel rows and columns (the walls) are ignored.
    """
    h, w, _ = frame.shape
    weights = palette_weights(frame) if weights is None else weights
    ys, xs = _pixel_centres(h, w)
    scale = h / 64

    def find(k: int, box: int, radius: float) -> tuple[float, float] | None:
        m = weights[..., k]
        local = box_mean(m, box)
        if local.max() < 0.5:
            return None
        py, px = np.unravel_index(int(np.argmax(local)), local.shape)
        near = np.hypot(xs - (px + 0.5), ys - (py + 0.5)) <= radius
        mass = (m * near).sum()
        return (float((m * near * xs).sum() / mass), float((m * near * ys).sum() / mass))

    # The agent is a disc of radius 15 world units (1.9 px at 64 px); the T spans 120 units.
    return Located(agent=find(3, 3, 4.0 * scale), block=find(2, 3, 10.0 * scale))


@functools.lru_cache(maxsize=8)
def _pixel_centres(h: int, w: int) -> np.ndarray:
    """[2, h, w]: the y and x of each pixel's centre (read-only, shared between calls)."""
    centres = np.mgrid[0:h, 0:w] + 0.5
    centres.flags.writeable = False
    return centres


def palette_weights(frame: np.ndarray) -> np.ndarray:
    """[H, W, 4]: how much of each pixel is white, goal green, block grey and agent blue
    (0 to 1), with the two outermost rows and columns (the walls) set to 0."""
    h, w, _ = frame.shape
    x = frame.astype(np.float64).reshape(-1, 3)
    weights = (np.c_[x, np.ones(len(x))] @ _UNMIX.T).reshape(h, w, 4)
    # The block's two shades unmix with a little of every colour; weights below the floor
    # are that leakage, not the object.
    weights = np.clip((weights - _FLOOR) / (1.0 - _FLOOR), 0.0, 1.0)
    border = max(1, round(2 * h / 64))
    weights[:border] = weights[-border:] = 0.0
    weights[:, :border] = weights[:, -border:] = 0.0
    return weights


def block_mask(frames, threshold: float = 0.5):
    """Where the block is in frames: a torch tensor [..., 3, T, H, W] in [-1, 1] (training
    layout) -> bool [..., 1, T, H, W], True where the block's weight (`palette_weights`,
    walls included) exceeds `threshold`."""
    import torch

    row = torch.as_tensor(_UNMIX[2], dtype=frames.dtype, device=frames.device)
    rgb = (frames + 1.0) * 127.5
    weight = torch.einsum("...cthw,c->...thw", rgb, row[:3]) + row[3]
    return ((weight - _FLOOR) / (1.0 - _FLOOR) > threshold).unsqueeze(-4)


def box_mean(m: np.ndarray, size: int) -> np.ndarray:
    """Mean over a size x size neighbourhood (zero padding), same shape as m."""
    pad = size // 2
    h, w = m.shape
    # Summed-area table with a leading zero row and column; the same sums, in the same
    # order, as cumulative sums of the zero-padded map, without np.pad's overhead.
    c = np.zeros((h + 2 * pad + 1, w + 2 * pad + 1), m.dtype if m.dtype.kind == "f" else np.float64)
    c[1 + pad : 1 + pad + h, 1 + pad : 1 + pad + w] = m
    c = c.cumsum(0).cumsum(1)
    total = c[size : size + h, size : size + w] - c[:h, size : size + w] - c[size : size + h, :w] + c[:h, :w]
    return total / (size * size)
