"""Scripted PushT controllers: the actions of the training data, the evaluation and the robot loop.

`ScriptedPolicy` alternates, by its own seeded random draws, between two behaviours:

- *push*: walk to a point behind the block (as seen from a push direction, mostly toward the
  goal), then push through the block along that direction;
- *explore*: wander between random waypoints at a random speed, sometimes pausing.

The action (the agent's target) moves toward the current waypoint at a limited speed, as a
hand dragging a mouse would, so consecutive actions are close and the agent's motion is
smooth. With `jump_share` > 0 that share of the moves instead jumps the target toward the
waypoint, by up to a step size drawn from 40-160 units (the last hop can be shorter), and
holds it `JUMP_HOLD` steps after each jump (instead of any exploring pause), as the
planner's candidates hold targets that jump (`planning.CEMConfig.held`), so a model
trained on such data has seen the fast agent and hard contacts they make. Everything is
a function of the seed and the observed scene, so episodes are reproducible; with
`jump_share` 0 the draws are those of a policy without it.
"""

from __future__ import annotations

import numpy as np

from .world import WORLD_SIZE, Scene

GOAL_XY = np.array([256.0, 256.0])
PUSH_SHARE = 0.6  # of the moves, by default (the shipped weights were trained on it)
JUMP_HOLD = 4  # steps a jumped-to target is held: `eval pusht --plan`'s default --knot-frames
_MARGIN = 40.0


class ScriptedPolicy:
    def __init__(self, seed: int, push_share: float = PUSH_SHARE, jump_share: float = 0.0) -> None:
        self.rng = np.random.default_rng(seed)
        self.push_share = push_share
        self.jump_share = jump_share
        self._jump = False
        self.target: np.ndarray | None = None
        self._plan: list[np.ndarray] = []
        self._speed = 20.0
        self._pause = 0

    def _block_centre(self, scene: Scene) -> np.ndarray:
        # The T's geometric middle sits 45 units along its stem from the body origin
        # (gym-pusht's block shape: a 120x30 bar on top of a 30x90 stem).
        x, y, angle = scene.block
        return np.array([x, y]) + 45.0 * np.array([-np.sin(angle), np.cos(angle)])

    def _new_plan(self, scene: Scene) -> None:
        rng = self.rng
        self._speed = float(rng.uniform(8.0, 35.0))
        if rng.random() < self.push_share:
            centre = self._block_centre(scene)
            to_goal = GOAL_XY - centre
            if np.linalg.norm(to_goal) > 20 and rng.random() < 0.7:
                direction = to_goal / np.linalg.norm(to_goal)
            else:
                a = rng.uniform(-np.pi, np.pi)
                direction = np.array([np.cos(a), np.sin(a)])
            # Rotate a little and hit off-centre sometimes, so the block also turns.
            a = rng.normal(0.0, 0.35)
            direction = np.array(
                [
                    direction[0] * np.cos(a) - direction[1] * np.sin(a),
                    direction[0] * np.sin(a) + direction[1] * np.cos(a),
                ]
            )
            side = np.array([-direction[1], direction[0]]) * rng.normal(0.0, 25.0)
            behind = centre - direction * rng.uniform(90.0, 130.0) + side
            through = centre + direction * rng.uniform(20.0, 90.0) + side
            self._plan = [behind, through]
        else:
            self._plan = [rng.uniform(_MARGIN, WORLD_SIZE - _MARGIN, 2) for _ in range(rng.integers(1, 4))]
            if rng.random() < 0.2:
                self._pause = int(rng.integers(2, 8))
        self._plan = [np.clip(p, _MARGIN / 2, WORLD_SIZE - _MARGIN / 2) for p in self._plan]
        # Drawn only when jumps are on, so that jump_share 0 records what it always did.
        self._jump = self.jump_share > 0 and rng.random() < self.jump_share
        if self._jump:
            self._speed = float(rng.uniform(40.0, 160.0))

    def __call__(self, scene: Scene) -> np.ndarray:
        """The next action (agent target, world units) for the current scene."""
        if self.target is None:
            self.target = np.array(scene.agent, dtype=np.float64)
        if self._pause > 0:
            self._pause -= 1
            return self.target.copy()
        if not self._plan:
            self._new_plan(scene)
        goal = self._plan[0]
        delta = goal - self.target
        dist = float(np.linalg.norm(delta))
        if dist <= self._speed:
            self.target = goal.copy()
            self._plan.pop(0)
        else:
            self.target = self.target + delta / dist * self._speed
        if self._jump:
            self._pause = JUMP_HOLD - 1
        jitter = self.rng.normal(0.0, 1.5, 2)
        return np.clip(self.target + jitter, 0.0, WORLD_SIZE)
