"""Goal-reaching on PushT with the world model: tasks, cost, success and the model-predictive
episode, following the protocol of DINO-WM and stable-worldmodel (docs/planning.md).

- **Task.** A start state and a goal: the state a recorded trajectory reaches
  `GOAL_STEPS` (25) environment steps later. DINO-WM takes its trajectories from its PushT
  dataset's validation split (goal_H 5 x frameskip 5); ours come from the scripted
  controller that made the model's training data, on evaluation seeds, from a random step of
  the trajectory.
- **Success.** DINO-WM's test on the true state: the distance between (agent x, agent y,
  block x, block y) and the goal's below 20 world units and the block's angle within pi/9.
- **Budget.** 50 environment steps (stable-worldmodel's fixed budget); the plan is replanned
  after `execute` steps (model-predictive control), from the newly observed frame, or
  (`replan_error`) as soon as the real block strays that far from where the plan predicted it.
- **Cost.** How far the candidate's last predicted frame is from the goal frame: the pixel
  distances of the agent and of the block from their places in the goal frame (the
  project's locator), which fall smoothly as a candidate ends nearer, plus the squared
  difference of the block's blurred colour weights, which compares the whole T shape and
  so carries its angle. The world model predicts frames only, and this cost reads frames
  only.
  With `cost_frames="best"` a candidate is scored on its frame nearest the goal instead of
  its last, since the success test holds at whichever step the environment reaches it.
  `cost="pose"` (`PoseCost`) scores the success test itself instead: how far the agent's
  and the block's positions and the block's angle are from the pose read off the goal
  frame, each over its tolerance, from the poses the rollouts predict (a scene model's,
  the true environment's) or read off their frames.
- **Proposals.** Optionally (`run_episode(proposals=N)`, `--proposals N`), push and turn
  paths laid out from the observed and goal frames (`proposals.py`) join each plan's first
  iteration.

Actions are the agent's target position in world units, as in gym-pusht (DINO-WM moves the
target relative to the agent instead).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from ..planning import CEMConfig, Plan, Rollouts, cem, close_rollouts
from .data import scene_row
from .evaluate import POLICY_SEED_OFFSET
from .policy import ScriptedPolicy
from .pose import estimate_scene, read_scene_row
from .proposals import PushProposals
from .world import WORLD_SIZE, PushTWorld, Scene, angle_error, box_mean, locate, palette_weights

GOAL_STEPS = 25
BUDGET = 50
POSITION_TOLERANCE = 20.0  # world units, over agent and block positions together
ANGLE_TOLERANCE = math.pi / 9
MAX_START_STEP = 40  # the start is a random step 0..39 of the recorded trajectory


@dataclass
class Task:
    seed: int
    start_step: int
    actions: np.ndarray  # the recorded actions up to the goal [start_step + goal_steps, 2]
    goal_frame: np.ndarray
    goal: Scene
    goal_steps: int = GOAL_STEPS

    def start(self, size: int) -> tuple[PushTWorld, np.ndarray]:
        """The environment at the start state (the recorded actions replayed) and its frame."""
        world = PushTWorld(size)
        frame = world.reset(self.seed)
        for a in self.actions[: self.start_step]:
            world.advance(a)  # drawn once, at the end
        return world, world.render() if self.start_step else frame


def make_task(seed: int, size: int, goal_steps: int = GOAL_STEPS) -> Task:
    """The task of evaluation seed `seed` (reproducible)."""
    start_step = int(np.random.default_rng(seed).integers(0, MAX_START_STEP))
    world = PushTWorld(size)
    policy = ScriptedPolicy(seed + POLICY_SEED_OFFSET)
    frame = world.reset(seed)
    actions = []
    for _ in range(start_step + goal_steps):
        actions.append(policy(world.scene))
        world.advance(actions[-1])  # the policy reads the scene; only the goal is drawn
    if actions:
        frame = world.render()
    task = Task(seed, start_step, np.asarray(actions, np.float32), frame, world.scene, goal_steps)
    world.close()
    return task


def reached(scene: Scene, goal: Scene) -> bool:
    """DINO-WM's success test on the true state."""
    position, degrees = state_error(scene, goal)
    return position < POSITION_TOLERANCE and math.radians(degrees) < ANGLE_TOLERANCE


def state_error(scene: Scene, goal: Scene) -> tuple[float, float]:
    """(position distance in world units, absolute angle difference in degrees)."""
    position = math.dist((*scene.agent, *scene.block[:2]), (*goal.agent, *goal.block[:2]))
    return position, angle_error(scene.block[2], goal.block[2])


def _block_map(weights: np.ndarray) -> np.ndarray:
    """The block's weight (`palette_weights` of a frame), blurred over 5 pixels."""
    return box_mean(weights[..., 2], 5)


COST_FRAMES = ("last", "best")
# What a candidate is scored on (`run_episode`'s `cost`): its frames (`frame_cost`) or its
# poses (`PoseCost`).
COSTS = ("frame", "pose")
# What a plan after the first samples around (`run_episode`'s `warm_start`).
WARM_STARTS = ("mean", "plan")


SHAPE_WEIGHT = 200.0  # the shape term's weight in the frame cost (`--shape-weight`)


def frame_cost(
    goal_frame: np.ndarray,
    shape_weight: float = SHAPE_WEIGHT,
    frames: str = "last",
    device: str | None = None,
) -> FrameCost:
    """Cost of a candidate's predicted frames [H, S, S, 3] against the goal frame (module
    docstring): the pixel distances of the agent and of the block from where they are in
    the goal frame (`locate`; an object not seen costs the frame's size), plus the mean
    squared difference of the block's blurred weight maps, which carries its angle.

    `frames="last"` scores the last frame; `"best"` the frame nearest the goal, as the
    success test is met by any step the environment passes through (`run_episode`).
    `device` (e.g. "cuda"): score a whole fork's frames at once there (`FrameCost.many`,
    `batch_locate.py`) instead of one frame at a time with NumPy, the faster way on a CPU."""
    if frames not in COST_FRAMES:
        raise ValueError(f"frames must be one of {', '.join(COST_FRAMES)}, got {frames!r}")
    return FrameCost(goal_frame, shape_weight, frames, device)


class FrameCost:
    """`frame_cost`'s answer: `cost(candidate)` for one candidate, `cost.many(candidates)`
    for a fork's [K, H, S, S, 3] at once (`cem` uses it)."""

    def __init__(self, goal_frame: np.ndarray, shape_weight: float, frames: str, device: str | None) -> None:
        self.size, self.shape_weight, self.mode = goal_frame.shape[0], shape_weight, frames
        self.batch = None
        if device is not None:  # the goal is located there too
            from .batch_locate import BatchFrameCost

            self.batch = BatchFrameCost(goal_frame, shape_weight, device)
        else:
            self.goal = locate(goal_frame)
            self.goal_block = _block_map(palette_weights(goal_frame))

    def __call__(self, candidate: np.ndarray) -> float:
        if self.batch is not None:
            return float(self.many(candidate[None])[0])
        return self._one(candidate[-1]) if self.mode == "last" else min(self._one(f) for f in candidate)

    def many(self, candidates: np.ndarray) -> np.ndarray:
        """The costs [K] of candidates [K, H, S, S, 3]."""
        candidates = np.asarray(candidates)
        if self.batch is None:
            return np.array([self(c) for c in candidates])
        if self.mode == "last":
            return self.batch.frames(candidates[:, -1])
        return self.batch.frames(candidates).min(1)

    def _one(self, frame: np.ndarray) -> float:
        weights = palette_weights(frame)
        seen = locate(frame, weights)
        shape = float(((_block_map(weights) - self.goal_block) ** 2).mean())
        return (
            self._distance(seen.agent, self.goal.agent)
            + self._distance(seen.block, self.goal.block)
            + (self.shape_weight * shape)
        )

    def _distance(self, p: tuple[float, float] | None, q: tuple[float, float] | None) -> float:
        return float(self.size) if p is None or q is None else math.dist(p, q)


class PoseCost:
    """Cost of a candidate against the goal in the success test's own terms: the larger of
    the distance of (agent x, agent y, block x, block y) from the goal's over
    `POSITION_TOLERANCE` and the block's angle error over `ANGLE_TOLERANCE`. A pose passes
    the success test exactly where it costs less than 1, and the cost says by how much.

    The goal's pose is read off the goal frame (`pose.read_scene_row`), as the planner is
    given the goal as a frame. Where the goal frame does not show the agent or the block
    (a block pushed out of the arena's view: 2 of seeds 0-799), `goal` holds NaN there and
    the cost scores what it shows, as the frame cost does. A candidate is poses [H, 5]
    (agent x, y, block x, y, angle: what `SceneModelRollouts` and `SimulatorRollouts`
    predict with `poses=True`) or frames [H, S, S, 3], whose poses are read the same way; a
    frame that shows no agent or no block costs `UNSEEN`.
    `frames` (`COST_FRAMES`): the last pose is scored, or the one nearest the goal."""

    # More than any pose in the arena can cost: positions at most 512 * 2 units apart, angles pi.
    UNSEEN = 2 * 512 / POSITION_TOLERANCE

    def __init__(self, goal_frame: np.ndarray, frames: str = "last") -> None:
        if frames not in COST_FRAMES:
            raise ValueError(f"frames must be one of {', '.join(COST_FRAMES)}, got {frames!r}")
        self.goal, self.mode = read_scene_row(goal_frame), frames

    def __call__(self, candidate: np.ndarray) -> float:
        return float(self.many(np.asarray(candidate)[None])[0])

    def many(self, candidates: np.ndarray) -> np.ndarray:
        """The costs [K] of candidates: poses [K, H, 5] or frames [K, H, S, S, 3]."""
        candidates = np.asarray(candidates)
        if self.mode == "last":
            candidates = candidates[:, -1:]
        poses = candidates.astype(np.float64)
        if candidates.ndim == 5:  # frames: read
            poses = np.array([[self._read(frame) for frame in frames] for frames in candidates])
        shown = ~np.isnan(self.goal)  # what the goal frame shows is scored; a NaN pose stays NaN
        position = np.linalg.norm(np.where(shown[:4], poses[..., :4] - self.goal[:4], 0.0), axis=-1)
        turned = np.where(shown[4], angle_error(poses[..., 4], self.goal[4]), 0.0)
        costs = np.maximum(position / POSITION_TOLERANCE, turned / math.degrees(ANGLE_TOLERANCE))
        return np.where(np.isnan(costs), self.UNSEEN, costs).min(1)

    @staticmethod
    def _read(frame: np.ndarray) -> np.ndarray:
        row = read_scene_row(frame)
        return np.full(5, math.nan) if np.isnan(row).any() else row  # all or nothing: `UNSEEN`


class SimulatorRollouts:
    """Rollouts in the true environment instead of the model: each candidate runs in a
    replica of `world` as it is now, and its frames are drawn as the model's would be, or
    (`poses=True`, for `PoseCost`) its true poses [K, H, 5] are given instead. With the same
    search and cost, planning with these is what a perfect model would reach, so it
    separates what the model costs from what the search and the cost cost (`eval pusht
    --plan --simulator`)."""

    def __init__(self, world: PushTWorld, poses: bool = False) -> None:
        self.world = world.replica()  # a snapshot: the real world moves on after the plan
        self.poses = poses

    async def __call__(self, candidates: np.ndarray) -> np.ndarray:
        size = self.world.size
        if self.poses:
            out = np.empty((*candidates.shape[:2], 5))
        else:
            out = np.empty((*candidates.shape[:2], size, size, 3), np.uint8)
        for k, actions in enumerate(candidates):
            twin = self.world.replica()
            try:
                for h, action in enumerate(actions):
                    if self.poses:
                        twin.advance(action)
                        out[k, h] = scene_row(twin.scene)
                    else:
                        out[k, h] = twin.step(action)
            finally:
                twin.close()
            await asyncio.sleep(0)  # seconds of physics: let the event loop breathe
        return out

    def close(self) -> None:
        self.world.close()


@dataclass
class EpisodeResult:
    seed: int
    success: bool
    steps: int  # environment steps taken (success ends the episode early)
    plans: int
    plan_seconds: list[float] = field(default_factory=list)
    branches: int = 0
    replans_early: int = 0  # plans cut short because the real block strayed from the prediction
    executed: list[int] = field(default_factory=list)  # steps run of each plan, in order
    final_error: tuple[float, float] = (math.nan, math.nan)  # world units, degrees
    frames: list[np.ndarray] = field(default_factory=list)  # the real frames, start first
    # With record=True: each plan in order, with the frames of the candidates it was chosen from.
    recorded_plans: list[Plan] = field(default_factory=list)

    def add_plan(self, plan: Plan, record: bool) -> None:
        """Count a plan made for this episode (and keep it, when recording)."""
        self.plans += 1
        self.plan_seconds.append(plan.seconds)
        self.branches += plan.branches
        if record:
            self.recorded_plans.append(plan)

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "success": self.success,
            "steps": self.steps,
            "plans": self.plans,
            "plan_seconds": [round(s, 3) for s in self.plan_seconds],
            "branches": self.branches,
            "replans_early": self.replans_early,
            "final_position_error": round(self.final_error[0], 2),
            "final_angle_error_deg": round(self.final_error[1], 2),
        }


async def run_episode(
    rollouts_for: Callable[[np.ndarray, PushTWorld], Rollouts | Awaitable[Rollouts]],
    task: Task,
    config: CEMConfig,
    size: int,
    budget: int = BUDGET,
    execute: int | None = None,
    seed: int = 0,
    record: bool = False,
    cost_frames: str = "last",
    cost_device: str | None = None,
    proposals: int = 0,
    replan_error: float = 0.0,
    shape_weight: float = SHAPE_WEIGHT,
    warm_start: str = "mean",
    cost: str = "frame",
) -> EpisodeResult:
    """Model-predictive control: plan with `cem` from the observed frame, run the plan's
    first `execute` actions (default: the whole horizon) in the real environment, and again,
    until the goal is reached or `budget` steps are spent.

    Each plan gets new rollouts from `rollouts_for(frame, world)` (the observed frame and
    the real environment, which `SimulatorRollouts` copies), or from the awaitable it
    returns; their `close()`, if any, is called after the plan, and awaited if it returns an
    awaitable. `cost_frames`: which predicted frames the cost reads, and `cost_device`
    where it reads them (`frame_cost`). `proposals`: this many push and turn paths read
    from the observed and goal frames join each plan's first iteration (`proposals.PushProposals`;
    the time they take counts in the plan's). `shape_weight`: the weight of the cost's shape
    term (`frame_cost`). `replan_error` (pixels; 0: off): stop executing a
    plan and replan as soon as the block in the real frame is further than this from the block
    in the frame the plan predicted for that step (`surprised`), so a push the model got wrong
    is corrected at once while a plan that goes as predicted runs on. `warm_start`: what each
    plan after the first samples around, moved past the executed steps (`_shifted`): the last
    plan's final distribution (`mean`: the mean of its last elites) or the plan it chose
    (`plan`: its own knots), which `cem` tries first either way. `cost` (`COSTS`): what a
    candidate is scored on, its frames (`frame_cost`, with `shape_weight` and
    `cost_device`) or its poses (`PoseCost`: rollouts made with `poses=True`, or frames
    whose poses are read)."""
    _check_options(replan_error, shape_weight, warm_start, cost)
    execute = execute or config.horizon
    rng = np.random.default_rng(seed)
    world, frame = task.start(size)
    scorer = _episode_cost(task.goal_frame, cost, cost_frames, shape_weight, cost_device)
    result = EpisodeResult(task.seed, reached(world.scene, task.goal), 0, 0, frames=[frame] if record else [])
    mean = None
    propose = PushProposals(task.goal_frame, proposals) if proposals else None
    try:
        while not result.success and result.steps < budget:
            plan = await _plan(rollouts_for, frame, world, scorer, config, rng, mean, record, propose)
            result.add_plan(plan, record)
            actions = plan.actions[: min(execute, budget - result.steps)]
            frame = _execute(world, frame, actions, task, result, record, plan.frames, replan_error)
            kept = plan.mean if warm_start == "mean" else plan.knots
            mean = _shifted(kept, result.executed[-1], config.knot_frames)
        result.final_error = state_error(world.scene, task.goal)
    finally:
        world.close()
    return result


def _episode_cost(
    goal_frame: np.ndarray, cost: str, frames: str, shape_weight: float, device: str | None
) -> FrameCost | PoseCost:
    """`run_episode`'s cost: `PoseCost` for `cost="pose"`, else `frame_cost`."""
    if cost == "pose":
        return PoseCost(goal_frame, frames)
    return frame_cost(goal_frame, shape_weight, frames=frames, device=device)


def _check_options(replan_error: float, shape_weight: float, warm_start: str, cost: str) -> None:
    """`run_episode`'s checks of its options: ValueError naming the one that is wrong."""
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {', '.join(COSTS)}, got {cost!r}")
    if not replan_error >= 0:  # also refuses nan
        raise ValueError(f"replan_error must be >= 0, got {replan_error}")
    if not shape_weight >= 0:
        raise ValueError(f"shape_weight must be >= 0, got {shape_weight}")
    if warm_start not in WARM_STARTS:
        raise ValueError(f"warm_start must be one of {', '.join(WARM_STARTS)}, got {warm_start!r}")


async def _plan(
    rollouts_for: Callable[[np.ndarray, PushTWorld], Rollouts | Awaitable[Rollouts]],
    frame: np.ndarray,
    world: PushTWorld,
    cost: FrameCost | PoseCost,
    config: CEMConfig,
    rng: np.random.Generator,
    mean: np.ndarray | None,
    record: bool,
    propose: PushProposals | None,
) -> Plan:
    """One `cem` plan from the observed `frame` on rollouts opened for it and closed after;
    the time the proposals took counts in the plan's `seconds`."""
    t0 = time.perf_counter()
    proposed = propose(frame, config.knots) if propose else None
    proposing = time.perf_counter() - t0
    start = np.array(world.scene.agent)
    rollouts = await _opened(rollouts_for(frame, world))
    try:
        plan = await cem(rollouts, cost, start, config, rng, mean, keep_candidates=record, proposals=proposed)
    finally:
        await close_rollouts(rollouts)
    plan.seconds += proposing
    return plan


def _execute(
    world: PushTWorld,
    frame: np.ndarray,
    actions: np.ndarray,
    task: Task,
    result: EpisodeResult,
    record: bool,
    predicted: np.ndarray,
    replan_error: float,
) -> np.ndarray:
    """Run `actions` in the real environment from `frame` until the goal is reached, or, with
    `replan_error`, until the real frame is `surprised` by the `predicted` one for that step
    (with actions left), counting the steps in `result` (and in `result.executed`, the
    plan's); the last frame observed. Only
    the frames something reads are drawn: every step's when recording or checking for
    surprise, else the last one (the next plan's observation)."""
    every_frame = record or bool(replan_error)
    before = result.steps
    for h, action in enumerate(actions):
        if every_frame:
            frame = world.step(action)
        else:
            world.advance(action)
        result.steps += 1
        if record:
            result.frames.append(frame)
        if reached(world.scene, task.goal):
            result.success = True
            break
        if replan_error and h + 1 < len(actions) and surprised(frame, predicted[h], replan_error):
            result.replans_early += 1
            break
    result.executed.append(result.steps - before)
    return frame if every_frame or not len(actions) else world.render()


def surprised(real: np.ndarray, predicted: np.ndarray, tolerance: float) -> bool:
    """Whether the block in the `real` frame lies more than `tolerance` pixels from the block
    in the `predicted` one (`locate`), or is seen in only one of them. A `predicted` pose
    [5] (`PoseCost`'s rollouts) is compared with the pose read off the real frame."""
    if predicted.ndim == 1:
        scene = estimate_scene(real, max_mismatch=math.inf)
        unit = WORLD_SIZE / real.shape[1]
        return scene is None or math.dist(scene.block[:2], predicted[2:4]) / unit > tolerance
    seen, expected = locate(real).block, locate(predicted).block
    if seen is None or expected is None:
        return (seen is None) != (expected is None)
    return math.dist(seen, expected) > tolerance


async def _opened(rollouts: Rollouts | Awaitable[Rollouts]) -> Rollouts:
    """`rollouts_for`'s answer, awaited when it is awaitable (e.g. `ClientRollouts.start`,
    a session to open)."""
    return await rollouts if inspect.isawaitable(rollouts) else rollouts


def _shifted(mean: np.ndarray | None, executed: int, knot_frames: int) -> np.ndarray | None:
    """The last plan's mean (or knots) moved past the executed steps, its last knot held (a
    warm start)."""
    if mean is None:
        return None
    drop = min(executed // knot_frames, len(mean) - 1)
    return np.concatenate([mean[drop:], np.repeat(mean[-1:], drop, 0)])


def summary(results: list[EpisodeResult], seconds: float) -> dict:
    plans = [s for r in results for s in r.plan_seconds]
    branches = sum(r.branches for r in results)
    return {
        "episodes": len(results),
        "success_rate": sum(r.success for r in results) / max(len(results), 1),
        "mean_steps": float(np.mean([r.steps for r in results])) if results else math.nan,
        "plan_seconds_mean": float(np.mean(plans)) if plans else math.nan,
        "plan_seconds_p90": float(np.percentile(plans, 90)) if plans else math.nan,
        "branches_per_second": branches / sum(plans) if plans else math.nan,
        # Over the whole run, environment steps included; above `branches_per_second` when
        # several episodes plan at once (`eval pusht --plan --concurrent`).
        "branches_per_wall_second": branches / seconds if seconds > 0 else math.nan,
        "wall_seconds": seconds,
    }
