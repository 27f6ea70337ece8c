"""Push proposals: a few candidate plans drawn from the scene, for the planner to weigh.

The cross-entropy method starts from noise around the agent's position. A push needs the
agent to go round to the far side of the block first and then walk through it toward the
goal, a long, narrow path that three iterations of 16 samples rarely find
(`docs/planning.md`). Here the observed frame and the goal frame are read with the pose
fit (`pose.estimate_scene`), and a few such paths are laid out:

1. if the agent stands on the block's goal side, a detour round the block's side;
2. the point behind the block, opposite the direction it must move, clear of it;
3. a straight push along that direction, ending where the block's middle meets the goal's;
4. the agent's place in the goal frame.

Variants turn the direction a little or push off-centre (the block then turns). They are
only proposals: they join the first iteration's candidates, the world model predicts them
like any other, and the cost decides (`cem(..., proposals=...)`). Nothing here looks at
the true state: the scenes come from the frames, and a frame whose block is not a T
(`MAX_MISMATCH`) gives no proposal.
"""

from __future__ import annotations

import numpy as np

from .pose import T_CENTROID_Y, estimate_scene
from .world import WORLD_SIZE, Scene

AGENT_RADIUS = 15.0  # world units (gym-pusht's agent circle)
CLEARANCE = 12.0  # between the agent and the block while it goes behind it
STILL = 10.0  # a goal block within this of the block's middle needs no push
# The T's corners in body coordinates (gym-pusht: a 120 x 30 bar above a 30 x 90 stem).
_CORNERS = np.array(
    [[-60, 0], [60, 0], [60, 30], [15, 30], [15, 120], [-15, 120], [-15, 30], [-60, 30]], np.float64
)
# (turn of the push direction in radians, offset across it in world units), in the order
# they are proposed.
VARIANTS = ((0.0, 0.0), (0.0, 20.0), (0.0, -20.0), (0.35, 0.0), (-0.35, 0.0), (0.0, 40.0), (0.0, -40.0))


def block_middle(block: tuple[float, float, float]) -> np.ndarray:
    """The T's area centroid (world units) of a block pose (x, y, angle)."""
    x, y, a = block
    return np.array([x - np.sin(a) * T_CENTROID_Y, y + np.cos(a) * T_CENTROID_Y])


def _reach(block: tuple[float, float, float], direction: np.ndarray) -> float:
    """How far the block reaches from its middle along `direction` (a unit vector)."""
    x, y, a = block
    c, s = np.cos(a), np.sin(a)
    corners = _CORNERS @ np.array([[c, s], [-s, c]]) + np.array([x, y])
    return float(((corners - block_middle(block)) @ direction).max())


def _turned(v: np.ndarray, angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([c * v[0] - s * v[1], s * v[0] + c * v[1]])


def push_path(now: Scene, goal: Scene, turn: float = 0.0, offset: float = 0.0) -> list[np.ndarray]:
    """Waypoints (world units) of one push from scene `now` toward scene `goal` (module
    docstring), or the goal's agent place alone when the block need not move."""
    start, end = block_middle(now.block), block_middle(goal.block)
    distance = float(np.linalg.norm(end - start))
    agent_goal = np.asarray(goal.agent, np.float64)
    if distance < STILL:
        return [agent_goal]
    direction = _turned((end - start) / distance, turn)
    across = np.array([-direction[1], direction[0]])
    back = _reach(now.block, -direction) + AGENT_RADIUS + CLEARANCE
    behind = start - direction * back + across * offset
    through = end - direction * (_reach(goal.block, -direction) + AGENT_RADIUS) + across * offset
    path = []
    agent = np.asarray(now.agent, np.float64)
    if (agent - start) @ direction > -back / 2:  # on the goal's side: go round the block
        side = 1.0 if (agent - start) @ across >= 0 else -1.0
        wide = max(_reach(now.block, across * side), back) + AGENT_RADIUS + CLEARANCE
        path.append(start + across * side * wide)
    path += [behind, (behind + through) / 2, through, agent_goal]
    return path


def _knots(path: list[np.ndarray], knots: int) -> np.ndarray:
    """The waypoints held in turn over `knots` knots: each gets an equal share, the last the
    rest; a path longer than the knots keeps its first ones."""
    if len(path) >= knots:
        return np.stack(path[:knots])
    share = knots // len(path)
    held = [p for p in path for _ in range(share)]
    held += [path[-1]] * (knots - len(held))
    return np.stack(held)


def push_proposals(frame: np.ndarray, goal_frame: np.ndarray, knots: int, count: int) -> np.ndarray:
    """Up to `count` proposals [P, knots, 2] (world units, within the world) for a plan of
    `knots` held targets from `frame` toward `goal_frame`; none [0, knots, 2] when either
    frame's scene cannot be read (`estimate_scene`)."""
    now, goal = estimate_scene(frame), estimate_scene(goal_frame)
    if now is None or goal is None or count < 1:
        return np.empty((0, knots, 2))
    paths = [push_path(now, goal, turn, offset) for turn, offset in VARIANTS[:count]]
    unique = dict.fromkeys(tuple(map(tuple, _knots(p, knots).round(3))) for p in paths)  # in order
    return np.clip(np.array(list(unique), np.float64), 0.0, WORLD_SIZE)
