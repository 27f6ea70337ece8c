"""Push proposals: a few candidate plans drawn from the scene, for the planner to weigh.

The cross-entropy method starts from noise around the agent's position. A push needs the
agent to go round to the far side of the block first and then walk through it toward the
goal, a long, narrow path that three iterations of 16 samples rarely find
(`docs/planning.md`). Here the observed frame and the goal frame are read with the pose
fit (`pose.estimate_scene`), and a few such paths are laid out:

1. if the straight way to the point behind the block would touch the block, a detour
   beside it, clear of it;
2. the point behind the block where the agent, walking along the push, would first touch
   it, less a clearance;
3. a straight push along that line, until the block's middle has moved as far along it
   as the goal's middle lies;
4. the agent's place in the goal frame.

Variants turn the push a little or push off-centre (the block then turns). A block that
only needs turning, its middle already in place, gets the agent's goal place alone: these
paths do not turn blocks on the spot. They are only proposals: they join the first
iteration's candidates, the world model predicts them like any other, and the cost decides
(`cem(..., proposals=...)`). Nothing here looks at the true state: the scenes come from
the frames, and a frame whose block is not a T (`MAX_MISMATCH`) gives no proposal.
"""

from __future__ import annotations

import numpy as np

from .pose import T_CENTROID_Y, block_distance, estimate_scene
from .world import WORLD_SIZE, Scene

AGENT_RADIUS = 15.0  # world units (gym-pusht's agent circle)
CLEARANCE = 12.0  # between the agent and the block while it goes behind it
STILL = 10.0  # a goal block's middle within this of the block's needs no push
# (turn of the push direction in radians, offset across it in world units), in the order
# they are proposed.
VARIANTS = ((0.0, 0.0), (0.0, 20.0), (0.0, -20.0), (0.35, 0.0), (-0.35, 0.0), (0.0, 40.0), (0.0, -40.0))


def check_count(count: int, samples: int) -> None:
    """ValueError unless `count` proposals fit a search of `samples` candidates: 0 to the
    number of `VARIANTS`, and fewer than the samples (the mean takes one place)."""
    most = min(len(VARIANTS), samples - 1)
    if not 0 <= count <= most:
        raise ValueError(
            f"--proposals must be 0 to {most} (at most {len(VARIANTS)} paths, and fewer than the "
            f"{samples} samples), got {count}"
        )


def block_middle(block: tuple[float, float, float]) -> np.ndarray:
    """The T's area centroid (world units) of a block pose (x, y, angle)."""
    x, y, a = block
    return np.array([x - np.sin(a) * T_CENTROID_Y, y + np.cos(a) * T_CENTROID_Y])


def _turned(v: np.ndarray, angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([c * v[0] - s * v[1], s * v[0] + c * v[1]])


def _contact(block: tuple[float, float, float], line: np.ndarray, direction: np.ndarray) -> float | None:
    """How far along `direction` from the point `line` the agent, walking from far behind,
    first touches the block (1-unit steps; negative: behind `line`), or None if it passes."""
    steps = np.arange(-200.0, 201.0)
    touching = block_distance(block, line + steps[:, None] * direction) <= AGENT_RADIUS
    return float(steps[np.argmax(touching)]) if touching.any() else None


def _clear(block: tuple[float, float, float], a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the agent walks from `a` to `b` without touching the block (1 unit slack)."""
    points = a + np.linspace(0.0, 1.0, 64)[:, None] * (b - a)
    return bool(block_distance(block, points).min() > AGENT_RADIUS - 1.0)


def _detour(now: Scene, direction: np.ndarray, behind: np.ndarray) -> list[np.ndarray]:
    """Waypoints beside the block, on the agent's side of the push line, from level with
    the agent to level with `behind`, far enough out that neither leg touches the block."""
    start, agent = block_middle(now.block), np.asarray(now.agent, np.float64)
    across = np.array([-direction[1], direction[0]])
    side = 1.0 if (agent - start) @ across >= 0 else -1.0
    for wide in np.arange(60.0, 201.0, 10.0):
        beside = start + across * side * wide
        level = beside + direction * ((agent - start) @ direction)
        back = beside + direction * ((behind - start) @ direction)
        legs = ((agent, level), (level, back), (back, behind))
        if all(_clear(now.block, a, b) for a, b in legs):
            return [level, back]
    return []


def push_path(now: Scene, goal: Scene, turn: float = 0.0, offset: float = 0.0) -> list[np.ndarray] | None:
    """Waypoints (world units) of one push from scene `now` toward scene `goal` (module
    docstring); the goal's agent place alone when the block's middle need not move; None
    when the push line misses the block (an offset wider than the block)."""
    start, end = block_middle(now.block), block_middle(goal.block)
    distance = float(np.linalg.norm(end - start))
    agent_goal = np.asarray(goal.agent, np.float64)
    if distance < STILL:
        return [agent_goal]
    direction = _turned((end - start) / distance, turn)
    line = start + np.array([-direction[1], direction[0]]) * offset
    touch = _contact(now.block, line, direction)
    if touch is None:
        return None
    behind = line + direction * (touch - CLEARANCE)
    through = line + direction * (touch + (end - start) @ direction)
    agent = np.asarray(now.agent, np.float64)
    detour = [] if _clear(now.block, agent, behind) else _detour(now, direction, behind)
    return [*detour, behind, (behind + through) / 2, through, agent_goal]


def _knots(path: list[np.ndarray], knots: int) -> np.ndarray:
    """The waypoints held in turn over `knots` knots: each gets an equal share, the last the
    rest; a path longer than the knots keeps its first ones."""
    if len(path) >= knots:
        return np.stack(path[:knots])
    share = knots // len(path)
    held = [p for p in path for _ in range(share)]
    held += [path[-1]] * (knots - len(held))
    return np.stack(held)


class PushProposals:
    """Up to `count` push paths (the first `count` of `VARIANTS`, fewer where two coincide or
    an offset misses the block) toward one goal frame: its scene is read once;
    `proposals(frame, knots)` lays them out from each observed frame."""

    def __init__(self, goal_frame: np.ndarray, count: int) -> None:
        self.count = count
        self.goal = estimate_scene(goal_frame) if self.count > 0 else None

    def __call__(self, frame: np.ndarray, knots: int) -> np.ndarray:
        """Proposals [P, knots, 2] (world units, within the world), P <= count; none
        [0, knots, 2] when either frame's scene cannot be read (`estimate_scene`)."""
        now = estimate_scene(frame) if self.goal is not None else None
        if now is None:
            return np.empty((0, knots, 2))
        paths = [push_path(now, self.goal, turn, offset) for turn, offset in VARIANTS[: self.count]]
        laid = [tuple(map(tuple, _knots(p, knots).round(3))) for p in paths if p is not None]
        unique = dict.fromkeys(laid)  # in order
        return np.clip(np.array(list(unique), np.float64).reshape(-1, knots, 2), 0.0, WORLD_SIZE)
