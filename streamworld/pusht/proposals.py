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

Variants turn the push a little or push off-centre (the block then turns). A block whose
middle is near its goal's but turned away from it gets **turns** first: the agent goes to
one of the T's three ends (a bar tip or the stem's tip), beside it, and pushes it across
the line from the middle, about the arc the end must travel, then goes to its goal place;
legs that would touch the block go round it by one waypoint where one is clear. They are
only proposals: they join the first iteration's candidates, the world model predicts them
like any other, and the cost decides
(`cem(..., proposals=...)`). Nothing here looks at the true state: the scenes come from
the frames, and a frame whose block is not a T (`MAX_MISMATCH`) gives no proposal.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from ..planning import CEMConfig, colored_noise
from .pose import T_CENTROID_Y, block_distance, estimate_scene
from .world import WORLD_SIZE, Scene

AGENT_RADIUS = 15.0  # world units (gym-pusht's agent circle)
CLEARANCE = 12.0  # between the agent and the block while it goes behind it
STILL = 10.0  # a goal block's middle within this of the block's needs no push
NEAR = 30.0  # within this, a turned block gets turns before pushes
TURN = np.radians(10.0)  # a block turned less than this from its goal needs no turn
# The T's three ends in body coordinates (the bar's tips, the stem's tip) that turns push.
ENDS = ((-60.0, 15.0), (60.0, 15.0), (0.0, 120.0))
# (turn of the push direction in radians, offset across it in world units), in the order
# they are proposed.
VARIANTS = ((0.0, 0.0), (0.0, 20.0), (0.0, -20.0), (0.35, 0.0), (-0.35, 0.0), (0.0, 40.0), (0.0, -40.0))


def check_count(count: int, samples: int) -> None:
    """ValueError unless `count` proposals fit a search of `samples` candidates: 0 to the
    number of pushes and turns (`VARIANTS`, `ENDS`), and fewer than the samples (the mean
    takes one place)."""
    most = min(len(VARIANTS) + len(ENDS), samples - 1)
    if not 0 <= count <= most:
        raise ValueError(
            f"--proposals must be 0 to {most} (at most {len(VARIANTS) + len(ENDS)} paths, and fewer than the "
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


def _clear(block: tuple[float, float, float], a: np.ndarray, b: np.ndarray, leaving: float = 0.0) -> bool:
    """Whether the agent walks from `a` to `b` without touching the block (1 unit slack),
    checked every 2 units at most (a distance changes by no more than the step, so a leg
    cannot dip between two checks by more than the slack). The first `leaving` units are
    not checked: an agent that starts against the block may touch it while it leaves."""
    length = float(np.linalg.norm(b - a))
    steps = np.linspace(0.0, 1.0, max(int(np.ceil(length / 2.0)) + 1, 2))
    steps = steps[steps * length >= min(leaving, length)]
    points = a + steps[:, None] * (b - a)
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


def _via(block: tuple[float, float, float], a: np.ndarray, b: np.ndarray) -> list[np.ndarray] | None:
    """No waypoint ([]) when the agent walks from `a` to `b` clear of the block; else the
    one waypoint round it (on rings about its middle, inside the world) with the shortest
    way whose two legs stay clear; None when there is none. The agent may start against
    the block (after a push): the first `CLEARANCE` units from `a` are not checked."""
    if _clear(block, a, b, leaving=CLEARANCE):
        return []
    angles = np.linspace(0.0, 2 * np.pi, 24, endpoint=False)
    ring = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    points = block_middle(block) + np.concatenate([ring * r for r in (100.0, 130.0, 160.0)])
    inside = ((points >= AGENT_RADIUS) & (points <= WORLD_SIZE - AGENT_RADIUS)).all(axis=1)
    ways = [
        (float(np.linalg.norm(p - a) + np.linalg.norm(b - p)), i)
        for i, p in enumerate(points)
        if inside[i] and _clear(block, a, p, leaving=CLEARANCE) and _clear(block, p, b)
    ]
    return [points[min(ways)[1]]] if ways else None


def angle_to(now: Scene, goal: Scene) -> float:
    """The turn (radians, -pi to pi) that brings the block of `now` to the goal's angle."""
    return float(np.angle(np.exp(1j * (goal.block[2] - now.block[2]))))


def turn_path(now: Scene, goal: Scene, end: int) -> list[np.ndarray] | None:
    """Waypoints (world units) of one turn of the block toward the goal's angle by its end
    `ENDS[end]`: behind the end across the line from the block's middle, on the side the
    turn needs, then on about the arc the end must travel, then the agent's goal place
    (module docstring); None when the block needs no turn (`TURN`) or the push line misses
    it."""
    turn = angle_to(now, goal)
    if abs(turn) < TURN:
        return None
    tip = np.array(now.block[:2]) + _turned(np.array(ENDS[end]), now.block[2])
    lever = tip - block_middle(now.block)
    arm = float(np.linalg.norm(lever))
    direction = np.sign(turn) * np.array([-lever[1], lever[0]]) / arm
    touch = _contact(now.block, tip, direction)
    if touch is None:
        return None
    behind = tip + direction * (touch - CLEARANCE)
    through = tip + direction * (touch + arm * abs(turn))
    agent_goal = np.asarray(goal.agent, np.float64)
    # No clear way behind the end: straight, as a push goes then.
    there = _via(now.block, np.asarray(now.agent, np.float64), behind) or []
    back = _via(turned_in_place(now.block, goal.block[2]), through, agent_goal) or []
    return [*there, behind, through, *back, agent_goal]


def turned_in_place(block: tuple[float, float, float], angle: float) -> tuple[float, float, float]:
    """The pose of `block` turned to `angle` about its middle (where a turn means to leave
    it, for the way on to the agent's goal place)."""
    middle = block_middle(block)
    return (middle[0] + np.sin(angle) * T_CENTROID_Y, middle[1] - np.cos(angle) * T_CENTROID_Y, angle)


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
    """Up to `count` paths toward one goal frame: the pushes of `VARIANTS` and the turns of
    `ENDS`, turns first where the block's middle is within `NEAR` of the goal's; paths that
    miss the block or coincide are left out. The goal's scene is read once;
    `proposals(frame, knots)` lays them out from each observed frame."""

    def __init__(self, goal_frame: np.ndarray | None, count: int, goal: Scene | None = None) -> None:
        self.count = count
        if goal is None and count > 0:
            goal = estimate_scene(goal_frame)
        self.goal = goal if count > 0 else None

    @classmethod
    def toward(cls, goal: Scene, count: int) -> PushProposals:
        """Proposals toward a goal scene known exactly (no goal frame to read)."""
        return cls(None, count, goal)

    def paths(self, now: Scene) -> Iterator[list[np.ndarray]]:
        """The push and turn paths from scene `now` toward the goal scene, in the order they
        are proposed, each laid out only when asked for."""
        pushes = (push_path(now, self.goal, turn, offset) for turn, offset in VARIANTS)
        turns = (turn_path(now, self.goal, end) for end in range(len(ENDS)))
        near = np.linalg.norm(block_middle(self.goal.block) - block_middle(now.block)) < NEAR
        return (p for p in itertools.chain(*((turns, pushes) if near else (pushes, turns))) if p is not None)

    def laid(self, now: Scene, knots: int) -> np.ndarray:
        """The first `count` distinct paths from scene `now`, held over `knots` knots
        [P, knots, 2] (world units, within the world)."""
        unique: dict[tuple, None] = {}
        for path in self.paths(now):
            if len(unique) == self.count:
                break
            unique.setdefault(tuple(map(tuple, _knots(path, knots).round(3))), None)
        return np.clip(np.array(list(unique), np.float64).reshape(-1, knots, 2), 0.0, WORLD_SIZE)

    def __call__(self, frame: np.ndarray, knots: int) -> np.ndarray:
        """Proposals [P, knots, 2] from an observed frame (`laid`), P <= count; none
        [0, knots, 2] when either frame's scene cannot be read (`estimate_scene`)."""
        now = estimate_scene(frame) if self.goal is not None else None
        if now is None:
            return np.empty((0, knots, 2))
        return self.laid(now, knots)


class CandidatePolicy:
    """Actions like the planner's candidates, to record training data with: each
    `horizon`-step stretch is one candidate drawn as `cem` draws them, from the true scene
    (the planner reads it off a frame). With probability `proposal_share` its mean is one of
    the push and turn paths (`PushProposals`, all of them, one at random) toward a goal like
    the tasks' (the block moved up to `GOAL_MOVE` units and turned by about `GOAL_TURN`, the
    agent anywhere), else the agent's place held, as the first iteration's mean is. Around
    the mean, `colored_noise` of exponent `noise_beta` with a spread drawn from
    `PROPOSAL_SPREADS` (a proposal as proposed, or refitted in a later iteration) or
    `init_std` (around the agent). Each knot is held `knot_frames` steps. Everything is a
    function of the seed and the scenes seen, so episodes are reproducible. Call it as a
    `ScriptedPolicy`: the next action for the scene."""

    GOAL_MOVE = 150.0
    GOAL_TURN = np.radians(35.0)
    PROPOSAL_SPREADS = (0.0, 10.0, 25.0, 50.0)

    def __init__(
        self,
        seed: int,
        horizon: int = 24,
        knot_frames: int = 4,
        proposal_share: float = 0.5,
        init_std: float = 80.0,
        noise_beta: float = 2.0,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.config = CEMConfig(
            horizon=horizon, knot_frames=knot_frames, init_std=init_std, noise_beta=noise_beta
        )
        self.proposal_share = proposal_share
        self._queue: list[np.ndarray] = []

    def goal_like_tasks(self, now: Scene) -> Scene:
        """A goal scene drawn near `now`: the block moved and turned, the agent anywhere."""
        rng = self.rng
        x, y, angle = now.block
        direction = rng.uniform(-np.pi, np.pi)
        distance = rng.uniform(0.0, self.GOAL_MOVE)
        bx = float(np.clip(x + distance * np.cos(direction), 60.0, WORLD_SIZE - 60.0))
        by = float(np.clip(y + distance * np.sin(direction), 60.0, WORLD_SIZE - 60.0))
        agent = tuple(float(v) for v in rng.uniform(40.0, WORLD_SIZE - 40.0, 2))
        return Scene(agent, (bx, by, float(angle + rng.normal(0.0, self.GOAL_TURN))))

    def candidate(self, now: Scene, goal: Scene | None = None) -> np.ndarray:
        """One candidate's actions [horizon, 2] from scene `now`, toward `goal` (default: a
        goal drawn with `goal_like_tasks` when a proposal is the mean)."""
        rng, config = self.rng, self.config
        mean, spread = np.repeat(np.asarray(now.agent, np.float64)[None], config.knots, 0), config.init_std
        if rng.random() < self.proposal_share:
            goal = goal if goal is not None else self.goal_like_tasks(now)
            toward = PushProposals.toward(goal, len(VARIANTS) + len(ENDS))
            laid = toward.laid(now, config.knots)
            if len(laid):
                mean = laid[rng.integers(len(laid))]
                spread = float(rng.choice(self.PROPOSAL_SPREADS))
        noise = colored_noise(rng, (1, config.knots, 2), config.noise_beta)[0]
        return config.held(np.clip(mean + spread * noise, config.low, config.high))

    def __call__(self, scene: Scene) -> np.ndarray:
        """The next action (agent target, world units) for the current scene."""
        if not self._queue:
            self._queue = list(self.candidate(scene))
        return self._queue.pop(0)
