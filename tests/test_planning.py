"""The planner: the cross-entropy method on a known cost, and goal-reaching on PushT with the
shipped model through engine forks (CPU)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamworld.engine import AsyncEngine, EngineConfig, SchedulerConfig
from streamworld.models import get_preset
from streamworld.models.world_model import WorldModel
from streamworld.planning import CEMConfig, cem, rate_limited
from streamworld.pusht.planning import (
    EpisodeResult,
    PoseCost,
    Task,
    _execute,
    frame_cost,
    make_task,
    reached,
    run_episode,
    state_error,
    surprised,
)
from streamworld.pusht.world import PushTWorld, Scene
from tests.conftest import load_script


def test_cem_finds_the_action_sequence_a_known_cost_wants():
    """Fake rollouts whose 'frames' are the actions themselves; the cost is the distance of
    the last one from a target: CEM must end near it, its last iteration better than its first."""
    target = np.array([300.0, 120.0])

    async def rollouts(candidates: np.ndarray) -> np.ndarray:
        return candidates[:, :, None, None, :]  # [K, H, 1, 1, 2] as "frames"

    def cost(frames: np.ndarray) -> float:
        return float(np.linalg.norm(frames[-1, 0, 0] - target))

    config = CEMConfig(horizon=6, samples=64, elites=8, iterations=6, knot_frames=2, init_std=150.0)
    plan = asyncio.run(cem(rollouts, cost, np.array([256.0, 256.0]), config, np.random.default_rng(0)))
    assert plan.cost < 10.0
    assert plan.actions.shape == (6, 2)
    assert plan.branches == 64 * 6 and len(plan.costs) == 6
    assert plan.cost == min(plan.costs) and plan.costs[-1] < plan.costs[0]


def test_an_ensemble_scores_each_candidate_by_its_cost_averaged_over_the_members():
    """Two fake models that disagree: one predicts the agent where the action puts it, the
    other 100 units further. The cost wants the agent's last frame at 300: alone each model
    would lead to 300 or to 200; their ensemble's mean cost is least at 250. Both members see
    the same candidates, are closed after the plan, and the plan shows the first one's frames."""
    from streamworld.planning import EnsembleRollouts, close_rollouts

    seen, closed = [], []

    class Member:
        def __init__(self, shift: float) -> None:
            self.shift = shift

        async def __call__(self, candidates: np.ndarray) -> np.ndarray:
            seen.append((self.shift, candidates.copy()))
            return candidates[:, :, None, None, :1] + self.shift  # [K, H, 1, 1, 1]

        def close(self) -> None:
            closed.append(self.shift)

    def cost(frames: np.ndarray) -> float:
        return float((frames[-1, 0, 0, 0] - 300.0) ** 2)

    ensemble = EnsembleRollouts([Member(0.0), Member(100.0)])
    config = CEMConfig(horizon=4, samples=64, elites=8, iterations=6, knot_frames=2, init_std=100.0)
    start = np.array([256.0, 256.0])
    plan = asyncio.run(cem(ensemble, cost, start, config, np.random.default_rng(0), keep_candidates=True))
    assert plan.candidates.shape == (64, 4, 1, 1, 1)  # the first member's frames of the fork
    assert abs(plan.actions[-1, 0] - 250.0) < 10.0
    assert plan.cost == pytest.approx(
        ((plan.actions[-1, 0] - 300) ** 2 + (plan.actions[-1, 0] - 200) ** 2) / 2
    )
    np.testing.assert_array_equal(plan.frames[:, 0, 0, 0], plan.actions[:, 0])  # member 0's frames
    assert len(seen) == 12 and all(
        np.array_equal(a[1], b[1]) for a, b in zip(seen[::2], seen[1::2], strict=True)
    )
    asyncio.run(close_rollouts(ensemble))
    assert closed == [0.0, 100.0]

    class Broken(Member):
        def close(self) -> None:
            raise OSError("gone")

    closed.clear()
    with pytest.raises(OSError, match="gone"):
        asyncio.run(close_rollouts(EnsembleRollouts([Broken(1.0), Member(2.0)])))
    assert closed == [2.0]  # the member after the broken one is still closed
    with pytest.raises(ValueError, match="at least one member"):
        EnsembleRollouts([])


def test_cem_refuses_a_bad_configuration():
    with pytest.raises(ValueError, match="elites"):
        CEMConfig(samples=4, elites=5).check()
    with pytest.raises(ValueError, match="keep_elites"):
        CEMConfig(elites=4, keep_elites=5).check()
    with pytest.raises(ValueError, match="noise_beta"):
        CEMConfig(noise_beta=-1.0).check()
    with pytest.raises(ValueError, match="max_speed"):
        CEMConfig(max_speed=-1.0).check()


def test_rate_limited_actions_head_for_their_targets_at_most_max_speed_a_step():
    start = np.array([100.0, 100.0])
    targets = np.array([[[400.0, 500.0]] * 3 + [[110.0, 90.0]] * 3, [[103.0, 104.0]] * 6])
    actions = rate_limited(targets, start, 30.0)
    steps = np.linalg.norm(
        np.diff(np.concatenate([np.broadcast_to(start, (2, 1, 2)), actions], 1), axis=1), axis=-1
    )
    assert steps.max() <= 30.0 + 1e-9
    # Far targets: full-speed steps straight at them; a target within reach is reached.
    np.testing.assert_allclose(steps[0, :3], 30.0)
    np.testing.assert_allclose(actions[0, 2], start + 90.0 * np.array([0.6, 0.8]))
    np.testing.assert_allclose(actions[1], [[103.0, 104.0]] * 6)
    # Back toward the second target from where the first three steps left it.
    np.testing.assert_allclose(steps[0, 3:5], 30.0)
    assert (
        np.linalg.norm(actions[0, 5] - targets[0, 5]) < np.linalg.norm(actions[0, 2] - targets[0, 5]) - 89.0
    )


def test_cem_with_max_speed_rolls_out_and_returns_the_limited_actions():
    """The candidates rolled out are the knots held and speed-limited from the start, so the
    plan's actions (the ones executed) are what the model predicted; without a limit they
    are the knots held."""
    rolled = []

    async def rollouts(candidates: np.ndarray) -> np.ndarray:
        rolled.append(candidates)
        return candidates[:, :, None, None, :]

    def cost(frames: np.ndarray) -> float:
        return float(np.linalg.norm(frames[-1, 0, 0] - np.array([400.0, 100.0])))

    start = np.array([100.0, 300.0])
    for speed in (0.0, 20.0):
        rolled.clear()
        config = CEMConfig(horizon=8, samples=16, elites=4, iterations=2, knot_frames=2, max_speed=speed)
        plan = asyncio.run(cem(rollouts, cost, start, config, np.random.default_rng(0)))
        first = np.concatenate([np.broadcast_to(start, (16, 1, 2)), rolled[0]], 1)
        moves = np.linalg.norm(np.diff(first, axis=1), axis=-1)
        if speed:
            assert moves.max() <= speed + 1e-3 and moves.max() > speed - 1e-3
        else:
            assert moves.max() > 100.0  # held targets jump
            assert np.all(rolled[0][:, 0::2] == rolled[0][:, 1::2])
        assert any(np.array_equal(plan.actions, c) for c in np.concatenate(rolled))


def test_kept_elites_join_the_next_refit_with_their_costs_and_are_not_rolled_out_again():
    """An iteration whose candidates are all worse than the last iteration's elites: with
    every elite kept the distribution stays the last elites' mean; without, it moves to the
    new worse candidates."""
    seen = []

    async def rollouts(candidates: np.ndarray) -> np.ndarray:
        seen.append(len(candidates))
        return np.full((len(candidates), 1), len(seen), np.float64)  # "frames": the iteration

    def cost(frames: np.ndarray) -> float:
        return float(frames[-1]) * 1000.0 + np.random.default_rng(len(seen)).random()

    def plan(keep: int):
        seen.clear()
        config = CEMConfig(horizon=2, samples=8, elites=4, iterations=2, knot_frames=1, keep_elites=keep)
        return asyncio.run(cem(rollouts, cost, np.array([100.0, 100.0]), config, np.random.default_rng(1)))

    first = plan(0)  # the reference: the same draws, nothing kept
    kept = plan(4)
    assert seen == [8, 8]  # kept elites cost no rollouts
    assert not np.allclose(first.mean, kept.mean)
    # The cost is the same for every candidate of an iteration, so the stable sort keeps the
    # first 4 of iteration 1 (the mean and the first three samples around it).
    rng = np.random.default_rng(1)
    mu = np.full((2, 2), 100.0)
    samples = np.clip(mu + 80.0 * rng.standard_normal((8, 2, 2)), 0.0, 512.0)
    samples[0] = mu
    np.testing.assert_allclose(kept.mean, samples[:4].mean(0))
    assert kept.costs[1] > kept.costs[0]  # iteration 2 was worse, as built


def test_colored_noise_has_unit_variance_and_grows_smoother_with_beta():
    from streamworld.planning import colored_noise

    rng = np.random.default_rng(0)
    neighbours = []
    for beta in (0.0, 1.0, 2.0, 3.0):
        x = colored_noise(rng, (40000, 6, 2), beta)
        np.testing.assert_allclose(x.var(axis=0), 1.0, atol=0.05)
        assert abs(np.corrcoef(x[:, 0, 0], x[:, 0, 1])[0, 1]) < 0.03  # dimensions independent
        neighbours.append(np.corrcoef(x[:, 2, 0], x[:, 3, 0])[0, 1])
    assert abs(neighbours[0]) < 0.03 and neighbours[1] < neighbours[2] < neighbours[3]
    assert neighbours[2] > 0.3


def test_success_is_dino_wms_test_on_the_true_state():
    goal = Scene((100.0, 100.0), (200.0, 200.0, 0.5))
    assert reached(Scene((110.0, 100.0), (205.0, 200.0, 0.6)), goal)
    assert not reached(Scene((115.0, 100.0), (215.0, 200.0, 0.5)), goal)  # 21.2 units apart
    assert not reached(Scene((100.0, 100.0), (200.0, 200.0, 0.5 + math.pi / 8)), goal)
    assert reached(Scene((100.0, 100.0), (200.0, 200.0, 0.5 + 2 * math.pi)), goal)  # angles wrap
    assert state_error(Scene((103.0, 104.0), (200.0, 200.0, 0.5)), goal) == pytest.approx((5.0, 0.0))


def test_a_task_starts_where_its_recording_passed_and_its_goal_is_goal_steps_later():
    task = make_task(3, 64, goal_steps=5)
    world, _ = task.start(64)
    try:
        for action in task.actions[task.start_step :]:
            world.step(action)
        assert state_error(world.scene, task.goal) == pytest.approx((0.0, 0.0), abs=1e-3)
    finally:
        world.close()
    assert isinstance(task, Task) and len(task.actions) == task.start_step + 5


def test_steps_drawn_only_at_the_end_draw_what_every_step_draws():
    """`advance` steps without drawing and leaves the physics as `step` does. A task's start
    frame and an executed plan's last frame (also when it stops early at the goal) are the
    frames of stepping with every frame drawn; `_execute` draws every frame when it records."""
    task = make_task(3, 64, goal_steps=8)
    assert task.start_step > 0
    drawn, undrawn = PushTWorld(64), PushTWorld(64)
    try:
        drawn.reset(3), undrawn.reset(3)
        for action in task.actions:
            frame = drawn.step(action)
            undrawn.advance(action)
        assert np.array_equal(frame, undrawn.render()) and drawn.scene == undrawn.scene
    finally:
        drawn.close(), undrawn.close()
    wander = np.random.default_rng(0).uniform(150.0, 350.0, (12, 2))
    to_goal = np.concatenate([task.actions[task.start_step :], wander])  # reaches it, then stops
    for actions, success in ((wander, False), (to_goal, True)):
        ends = []
        for record in (False, True):
            world, start = task.start(64)
            try:
                result = EpisodeResult(task.seed, False, 0, 0, frames=[])
                ends.append((start, _execute(world, start, actions, task, result, record, None, 0.0), result))
            finally:
                world.close()
        reference = PushTWorld(64)
        try:
            reference.reset(3)
            for action in task.actions[: task.start_step]:
                first = reference.step(action)
            for action in actions[: ends[0][2].steps]:
                last = reference.step(action)
        finally:
            reference.close()
        (quiet_start, quiet, quiet_result), (_, recorded, recorded_result) = ends
        assert np.array_equal(quiet_start, first)
        assert np.array_equal(quiet, last) and np.array_equal(recorded, last)
        assert quiet_result.success == recorded_result.success == success
        assert quiet_result.steps == recorded_result.steps == len(recorded_result.frames)
        assert quiet_result.frames == [] and np.array_equal(recorded_result.frames[-1], last)
        # At the goal it stops (within the success test's tolerance, possibly a step early).
        assert quiet_result.steps <= task.goal_steps if success else quiet_result.steps == len(actions)


def test_the_best_frame_cost_scores_a_candidate_that_passes_through_the_goal():
    """A candidate that reaches the goal frame mid-way and moves on: the `best` cost finds
    the goal in it, the `last` cost scores only where it ends."""
    task = make_task(3, 64, goal_steps=8)
    world, start = task.start(64)
    frames = []
    try:
        for action in task.actions[task.start_step :]:
            frames.append(world.step(action))
    finally:
        world.close()
    passing = np.stack([*frames, start, start])  # the goal frame, then back to the start
    last, best = frame_cost(task.goal_frame), frame_cost(task.goal_frame, frames="best")
    assert best(passing) == pytest.approx(0.0, abs=1e-9)
    assert last(passing) == pytest.approx(last(np.stack([start]))) and last(passing) > 1.0
    assert best(np.stack(frames[:1])) == pytest.approx(last(np.stack(frames[:1])))
    with pytest.raises(ValueError, match="last, best"):
        frame_cost(task.goal_frame, frames="mean")


def _fork_frames(seed: int = 3, candidates: int = 6, frames: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """A task's goal frame and a fork's worth of candidates [K, H, 64, 64, 3]: frames of the
    true environment under random targets, the same with noise, and one blank candidate
    (nothing to see: the not-seen costs)."""
    task = make_task(seed, 64)
    world, _ = task.start(64)
    rng = np.random.default_rng(seed)
    try:
        rolled = np.stack([world.step(rng.uniform(50.0, 450.0, 2)) for _ in range(candidates * frames)])
    finally:
        world.close()
    clean = rolled.reshape(candidates, frames, 64, 64, 3)
    noisy = np.clip(clean.astype(int) + rng.integers(-60, 60, clean.shape), 0, 255).astype(np.uint8)
    blank = np.full((1, frames, 64, 64, 3), 255, np.uint8)
    return task.goal_frame, np.concatenate([clean, noisy, blank])


def check_fork_cost_matches_frame_by_frame(device: str) -> None:
    """`frame_cost(..., device=D).many`, a whole fork in PyTorch on D, against NumPy's cost
    frame by frame (shared with tests/test_gpu.py)."""
    import torch

    from streamworld.pusht.batch_locate import locate_batch
    from streamworld.pusht.world import locate

    goal, fork = _fork_frames()
    for mode in ("last", "best"):
        host = frame_cost(goal, frames=mode)
        batched = frame_cost(goal, frames=mode, device=device)
        expected, got = np.array([host(c) for c in fork]), batched.many(fork)
        # True frames and the blank one: the same costs. Noisy frames have near-equal peaks,
        # which sums rounded in another order may break the other way: a pixel apart.
        clean = [*range(6), len(fork) - 1]
        assert np.allclose(got[clean], expected[clean], rtol=1e-9, atol=1e-9), mode
        assert np.abs(got - expected).max() < 2.0, mode
        assert batched(fork[0]) == pytest.approx(expected[0], rel=1e-9)
        sliced, whole = batched.batch.frames(fork, slice_frames=7), batched.batch.frames(fork)
        assert sliced.shape == fork.shape[:2] and np.allclose(
            sliced[clean], whole[clean], rtol=1e-9, atol=1e-9
        )
    clean = fork[:6].reshape(-1, 64, 64, 3)  # true frames: no ties between peaks
    agent, block = (x.cpu().numpy() for x in locate_batch(torch.from_numpy(clean).to(device)))
    for i, frame in enumerate(clean):
        found = locate(frame)
        assert np.allclose(agent[i], found.agent, atol=1e-9) and np.allclose(block[i], found.block, atol=1e-9)
    blank = np.full((1, 64, 64, 3), 255, np.uint8)
    assert all(torch.isnan(x).all() for x in locate_batch(torch.from_numpy(blank).to(device)))


def test_a_fork_scored_at_once_in_pytorch_costs_what_numpy_scores_frame_by_frame():
    check_fork_cost_matches_frame_by_frame("cpu")


def test_cem_scores_a_fork_at_once_when_the_cost_can():
    """A cost with `many` gets each fork's frames in one call, never frame by frame."""
    calls = []

    class Fork:
        def __call__(self, candidate):
            raise AssertionError("scored one candidate at a time")

        def many(self, frames):
            calls.append(len(frames))
            return np.abs(frames[:, -1] - 300.0).sum(-1)

    async def rollouts(candidates):
        return candidates  # the "frames" are the actions

    config = CEMConfig(horizon=4, samples=8, elites=2, iterations=3, knot_frames=2)
    asyncio.run(cem(rollouts, Fork(), np.array([256.0, 256.0]), config, np.random.default_rng(0)))
    assert calls == [8, 8, 8]


@pytest.fixture(scope="module")
def pusht_model() -> WorldModel:
    return WorldModel.load(get_preset("pusht"))


@pytest.mark.slow
async def test_the_planner_reaches_an_easy_goal_with_the_shipped_model(pusht_model):
    """A goal 5 steps along a recorded trajectory: the model-predictive planner, forking the
    observed frame into 16 candidates per iteration, reaches it within 24 steps."""
    from streamworld.planning import EngineRollouts

    config = CEMConfig(horizon=8, samples=16, elites=4, iterations=3, knot_frames=2, init_std=60.0)
    engine_config = EngineConfig(
        ttff_budget_s=1e3, scheduler=SchedulerConfig(lookahead_chunks=1e6), max_streams=17
    )
    task = make_task(1, 64, goal_steps=5)
    world, _ = task.start(64)
    before = state_error(world.scene, task.goal)
    world.close()
    async with AsyncEngine(pusht_model, engine_config) as engine:
        result = await run_episode(
            lambda frame, _world: EngineRollouts(engine, frame), task, config, 64, budget=24, execute=8
        )
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    assert before[0] > 40.0  # not solved at the start
    assert result.success, result.to_json()
    assert result.final_error[0] < 20.0 and result.branches >= 48


def test_eval_plan_cli_writes_each_episode_as_it_ends(tmp_path, capsys):
    """`eval pusht --plan` on two tiny episodes: the JSON holds both, marked complete, with
    the summary the printed table shows."""
    import json

    from streamworld.cli import main

    out = tmp_path / "plan.json"
    args = ["--seeds", "0-1", "--samples", "2", "--elites", "1", "--iterations", "1"]
    args += ["--plan-horizon", "4", "--knot-frames", "4", "--budget", "4", "--json", str(out)]
    assert main(["eval", "pusht", "--plan", *args]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] is True and [e["seed"] for e in report["episodes"]] == [0, 1]
    assert all(e["plans"] == 1 and e["branches"] == 2 for e in report["episodes"] if not e["success"])
    assert report["summary"]["episodes"] == 2 and report["execute"] == 4 and report["cost_frames"] == "last"
    assert report["cost"] == "frame" and report["cost_device"] == "host"
    assert f"| 2 | {report['summary']['success_rate']:.0%} |" in capsys.readouterr().out
    assert report["kv_mode"] == "final" and report["timesteps"] == [1000.0, 750.0, 500.0, 250.0]
    assert report["weights"] == "shipped" and report["prediction"] == "x0"
    # The engine's counters: its DiT batches, and no CUDA graphs on a CPU.
    engine = report["engine"]
    assert engine["dit_batches"] > 0 and 1 <= engine["mean_batch_units"] <= 2 and "cuda_graphs" not in engine
    # One denoising step, clean K/V: the planning streams run what the flags say.
    assert (
        main(
            [
                "eval",
                "pusht",
                "--plan",
                *args,
                "--steps",
                "1000",
                "--kv-mode",
                "clean",
                "--cost-frames",
                "best",
                "--max-speed",
                "30",
                "--cost",
                "pose",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["kv_mode"] == "clean" and report["timesteps"] == [1000.0] and report["complete"]
    assert report["cost_frames"] == "best" and report["cem"]["max_speed"] == 30.0 and report["cost"] == "pose"
    assert main(["eval", "pusht", "--plan", *args, "--max-speed", "-1"]) == 2
    assert "max_speed" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_plan_concurrent_episodes_reach_what_one_at_a_time_reaches(tmp_path, capsys, monkeypatch):
    """`--concurrent 3` plans three episodes at once. In the true environment (no batched
    float rounding) every episode ends exactly as when they run one at a time, and the
    JSON lists them in the order of the seeds, whichever finished first."""
    import json

    from streamworld.cli import main

    base = ["eval", "pusht", "--plan", "--simulator", "--seeds", "0-3", "--samples", "8", "--elites", "2"]
    base += ["--iterations", "2", "--plan-horizon", "8", "--budget", "16", "--goal-steps", "2"]
    import streamworld.pusht.planning as pusht_planning

    episode, flight = pusht_planning.run_episode, {"now": 0, "most": 0}

    async def counted(*args, **kwargs):
        flight["now"] += 1
        flight["most"] = max(flight["most"], flight["now"])
        try:
            return await episode(*args, **kwargs)
        finally:
            flight["now"] -= 1

    monkeypatch.setattr(pusht_planning, "run_episode", counted)
    reports, most = [], []
    for n in ("1", "3"):
        out = tmp_path / f"plan{n}.json"
        assert main([*base, "--concurrent", n, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
        most.append(flight["most"])
        flight["most"] = 0
    assert most == [1, 3]  # one at a time, then three in flight together
    one, three = reports
    assert three["concurrent"] == 3 and three["complete"] and "engine" not in three  # no model, no engine
    assert [e["seed"] for e in three["episodes"]] == [0, 1, 2, 3]
    keys = ("seed", "success", "steps", "plans", "branches", "final_position_error")
    ended = [[[e[k] for k in keys] for e in r["episodes"]] for r in (one, three)]
    assert ended[0] == ended[1]
    assert any(e["success"] for e in one["episodes"]) and any(e["plans"] > 1 for e in one["episodes"])
    assert "3 episodes at once:" in capsys.readouterr().out
    assert main([*base, "--concurrent", "0"]) == 2
    assert "--concurrent must be 1 to" in capsys.readouterr().err
    assert main([*base, "--concurrent", "20", "--samples", "16"]) == 2
    assert "340 planning streams" in capsys.readouterr().err


def test_eval_plan_concurrent_sizes_one_engine_for_every_episode_in_flight(tmp_path, monkeypatch):
    """Through the model, `--concurrent 2` gives the engine room for both episodes' forks
    (streams and batch), and both episodes complete."""
    import json

    import streamworld.planning as planning
    from streamworld.cli import main

    sized = []
    original = planning.planning_engine_config

    def recording(branches, cuda_graphs=False, planners=1):
        config = original(branches, cuda_graphs, planners)
        sized.append((branches, planners, config.max_streams, config.scheduler.max_batch_units))
        return config

    monkeypatch.setattr(planning, "planning_engine_config", recording)
    out = tmp_path / "plan.json"
    args = ["--seeds", "0-1", "--samples", "12", "--elites", "1", "--iterations", "1", "--concurrent", "2"]
    args += ["--plan-horizon", "4", "--knot-frames", "4", "--budget", "4", "--json", str(out)]
    assert main(["eval", "pusht", "--plan", *args]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and [e["seed"] for e in report["episodes"]] == [0, 1]
    assert sized == [(12, 2, 26, 24)]
    assert report["summary"]["branches_per_wall_second"] > 0


def test_eval_plan_with_an_ensemble_rolls_out_every_member_and_records_them(tmp_path, monkeypatch):
    """`--ensemble pusht-delta`: one more engine; every candidate is rolled out by both models,
    each with its own noise seed, and the report names the members."""
    import json

    from streamworld import planning
    from streamworld.cli import main
    from streamworld.pusht import planning as pusht_planning

    calls = []
    original = planning.EngineRollouts.__init__

    def spy(self, engine, image, seed=0):
        calls.append((engine.model.config.id, seed))
        original(self, engine, image, seed)

    monkeypatch.setattr(planning.EngineRollouts, "__init__", spy)
    options = []
    episode = pusht_planning.run_episode

    async def run_episode(*a, **kw):
        options.append((kw["replan_error"], kw["shape_weight"]))
        return await episode(*a, **kw)

    monkeypatch.setattr(pusht_planning, "run_episode", run_episode)
    out = tmp_path / "plan.json"
    args = ["--seeds", "3", "--samples", "2", "--elites", "1", "--iterations", "1", "--plan-horizon", "4"]
    args += ["--knot-frames", "4", "--budget", "4", "--json", str(out), "--ensemble", "pusht-delta"]
    args += ["--replan-error", "4", "--shape-weight", "150"]
    assert main(["eval", "pusht", "--plan", *args]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["ensemble"] == [{"model": "pusht-delta", "weights": "shipped"}]
    assert options == [(4.0, 150.0)] and report["replan_error"] == 4.0 and report["shape_weight"] == 150.0
    assert calls == [("pusht", 3), ("pusht-delta", 3 + 1000003)]
    assert report["episodes"][0]["branches"] == 2  # candidates, each rolled out by both members


def test_a_replica_is_the_world_in_the_same_state_and_moves_alone():
    from streamworld.pusht.world import PushTWorld

    rng = np.random.default_rng(0)
    world = PushTWorld(64)
    world.reset(5)
    for action in rng.uniform(100, 400, (12, 2)):
        world.step(action)
    twin = world.replica()
    try:
        assert twin.scene == world.scene and np.array_equal(twin.render(), world.render())
        for action in rng.uniform(100, 400, (6, 2)):  # the same future in both
            assert np.array_equal(twin.step(action), world.step(action))
        before = world.scene
        twin.step([500.0, 500.0])
        assert world.scene == before  # stepping the replica leaves the original alone
    finally:
        twin.close()
        world.close()


async def test_simulator_rollouts_are_the_true_futures_and_plan_an_easy_goal():
    """SimulatorRollouts roll each candidate out in a replica of the real environment: its
    frames are what stepping the environment gives, the real one does not move, and the
    planner with them (a perfect model) reaches the easy goal of the model test."""
    from streamworld.pusht.planning import SimulatorRollouts

    task = make_task(1, 64, goal_steps=5)
    world, _ = task.start(64)
    try:
        before = world.scene
        candidates = np.random.default_rng(1).uniform(0, 512, (3, 4, 2)).astype(np.float32)
        rollouts = SimulatorRollouts(world)
        frames = await rollouts(candidates)
        rollouts.close()
        assert frames.shape == (3, 4, 64, 64, 3) and frames.dtype == np.uint8
        twin = world.replica()
        assert all(np.array_equal(twin.step(a), f) for a, f in zip(candidates[2], frames[2], strict=True))
        twin.close()
        assert world.scene == before
    finally:
        world.close()
    config = CEMConfig(horizon=8, samples=16, elites=4, iterations=3, knot_frames=2, init_std=60.0)
    result = await run_episode(
        lambda frame, world: SimulatorRollouts(world), task, config, 64, budget=24, execute=8
    )
    assert result.success, result.to_json()


def _pose_cost_task():
    """Task 3 (its block pushed on the way), its goal cost, and the goal pose read [5]."""
    task = make_task(3, 64)
    cost = PoseCost(task.goal_frame)
    return task, cost, cost.goal.copy()


def test_the_pose_cost_reads_the_goal_off_its_frame_and_scores_the_success_tests_terms():
    """The goal's pose is read off the goal frame (within 3 world units and 2 degrees of the
    true one); a pose 20 units or 20 degrees from it costs 1, one both 1.5, the goal itself 0;
    a pose passes the success test exactly where it costs below 1; `best`
    scores the nearest step, `last` the last; a frame is read as its pose is, and a frame
    with nothing to read costs `UNSEEN`."""
    from streamworld.pusht.data import scene_row
    from streamworld.pusht.pose import estimate_scene

    task, cost, goal = _pose_cost_task()
    true = np.array(scene_row(task.goal))
    assert np.abs(goal[:4] - true[:4]).max() < 3 and abs(goal[4] - true[4]) < math.radians(2)
    poses = np.repeat(goal[None, None], 5, 0).repeat(2, 1)  # [5 candidates, 2 steps, 5]
    poses[1, -1, 0] += 20.0  # the agent 20 units off
    poses[2, -1, 4] += math.pi / 9  # the block turned 20 degrees
    poses[3, -1, 4] += 2 * math.pi  # a whole turn: the same angle
    poses[4, -1, 2:] += [18.0, 24.0, math.pi / 18]  # the block 30 units off, turned 10 degrees
    np.testing.assert_allclose(cost.many(poses), [0, 1, 1, 0, 1.5], atol=1e-9)
    poses[0, -1, 2:4] += 30.0  # passes through the goal at the first step only
    assert cost.many(poses[:1])[0] > 2 and PoseCost(task.goal_frame, "best").many(poses[:1])[0] == 0
    rng = np.random.default_rng(0)
    near = goal + np.column_stack([rng.normal(0, 10, (400, 4)), rng.normal(0, 0.3, 400)])
    costs = cost.many(near[:, None])
    passed = np.array(
        [reached(Scene(tuple(p[:2]), tuple(p[2:])), Scene(tuple(goal[:2]), tuple(goal[2:]))) for p in near]
    )
    assert np.array_equal(passed, costs < 1) and 0 < passed.sum() < 400
    frames = np.stack([task.goal_frame, np.full((64, 64, 3), 255, np.uint8)])[:, None]
    assert cost.many(frames)[0] == 0 and cost.many(frames)[1] == PoseCost.UNSEEN
    start = task.start(64)[1]
    seen = np.array(scene_row(estimate_scene(start, max_mismatch=math.inf)))
    assert cost(start[None]) == cost.many(seen[None, None])[0] > 2
    with pytest.raises(ValueError, match="frames must be one of last, best"):
        PoseCost(task.goal_frame, "first")
    # A goal whose block has left the arena's view (seed 88's): the agent alone is scored,
    # as the frame cost does; a goal frame showing nothing scores every candidate alike.
    out_of_view = PoseCost(make_task(88, 64).goal_frame)
    assert np.isnan(out_of_view.goal[2:]).all() and not np.isnan(out_of_view.goal[:2]).any()
    poses = np.repeat(np.r_[out_of_view.goal[:2], goal[2:]][None, None], 3, 0)
    poses[1, 0, 2:] += 100.0  # the block elsewhere: no matter
    poses[2, 0, 1] += 20.0
    np.testing.assert_allclose(out_of_view.many(poses), [0, 0, 1], atol=1e-9)
    assert (PoseCost(np.full((64, 64, 3), 255, np.uint8)).many(poses) == 0).all()


async def test_simulator_rollouts_give_the_true_poses_and_plan_an_easy_goal_on_the_pose_cost():
    """`SimulatorRollouts(poses=True)` answers each step's true pose, what stepping a replica
    gives, and the planner on `cost="pose"` with them reaches the easy goal; an unknown cost
    is refused."""
    from streamworld.pusht.data import scene_row
    from streamworld.pusht.planning import SimulatorRollouts

    task = make_task(1, 64, goal_steps=5)
    world, _ = task.start(64)
    try:
        candidates = np.random.default_rng(1).uniform(0, 512, (3, 4, 2)).astype(np.float32)
        rollouts = SimulatorRollouts(world, poses=True)
        poses = await rollouts(candidates)
        rollouts.close()
        assert poses.shape == (3, 4, 5)
        twin = world.replica()
        for action, pose in zip(candidates[2], poses[2], strict=True):
            twin.advance(action)
            assert scene_row(twin.scene) == pose.tolist()
        twin.close()
    finally:
        world.close()
    config = CEMConfig(horizon=8, samples=16, elites=4, iterations=3, knot_frames=2, init_std=60.0)
    result = await run_episode(
        lambda frame, world: SimulatorRollouts(world, poses=True),
        task,
        config,
        64,
        budget=24,
        execute=8,
        cost="pose",
    )
    assert result.success, result.to_json()
    with pytest.raises(ValueError, match="cost must be one of frame, pose"):
        await run_episode(lambda frame, world: None, task, config, 64, cost="pixels")


def test_a_frame_is_surprised_by_a_predicted_pose_whose_block_lies_further_than_the_tolerance():
    """A predicted pose [5] is compared with the pose read off the real frame: the block 3 px
    (24 world units) away surprises at a tolerance of 2 px and not of 4; a real frame with
    nothing to read always surprises."""
    task, _, goal = _pose_cost_task()
    assert not surprised(task.goal_frame, goal, 0.5)
    moved = goal.copy()
    moved[2] += 24.0
    assert surprised(task.goal_frame, moved, 2.0) and not surprised(task.goal_frame, moved, 4.0)
    assert surprised(np.full((64, 64, 3), 255, np.uint8), goal, 100.0)


def test_a_frame_is_surprised_only_by_a_block_further_than_the_tolerance_or_unseen():
    """The start and goal frames of a task whose block is pushed ~20 px on the way: each is
    not surprised by itself; they surprise each other at a tolerance below the block's true
    distance and not above it; a blank frame (no block seen) and a frame with one surprise
    each other, two blank frames do not."""
    from streamworld.pusht.world import locate

    task = make_task(3, 64)
    world, start = task.start(64)
    world.close()
    goal = task.goal_frame
    distance = math.dist(locate(start).block, locate(goal).block)
    assert distance > 10.0  # the block really moved
    assert not surprised(start, start, 0.0) and not surprised(goal, goal, 0.0)
    assert surprised(goal, start, distance - 1.0) and surprised(start, goal, distance - 1.0)
    assert not surprised(goal, start, distance + 1.0) and not surprised(start, goal, distance + 1.0)
    blank = np.full((64, 64, 3), 255, np.uint8)
    assert surprised(blank, start, 100.0) and surprised(start, blank, 100.0)
    assert not surprised(blank, blank, 0.0)


class _WrongAfterTwo:
    """SimulatorRollouts whose frames are the truth for two steps, then shifted 20 px to the
    right: from the third step on they are wrong about where the block is."""

    def __init__(self, world) -> None:
        from streamworld.pusht.planning import SimulatorRollouts

        self.true = SimulatorRollouts(world)

    async def __call__(self, candidates: np.ndarray) -> np.ndarray:
        frames = await self.true(candidates)
        frames[:, 2:] = np.roll(frames[:, 2:], 20, axis=-2)
        return frames

    def close(self) -> None:
        self.true.close()


async def test_replan_error_never_cuts_short_a_plan_that_goes_as_predicted():
    """With the true futures (SimulatorRollouts) and a block that is pushed ~14 px during the
    episode, a tolerance of half a pixel never replans early: the same plans run as without it."""
    from streamworld.pusht.planning import SimulatorRollouts
    from streamworld.pusht.world import locate

    config = CEMConfig(horizon=8, samples=4, elites=2, iterations=1, knot_frames=4)
    task = make_task(5, 64)
    runs = [
        await run_episode(
            lambda frame, world: SimulatorRollouts(world), task, config, 64, budget=12, record=True, **kw
        )
        for kw in ({}, {"replan_error": 0.5})
    ]
    default, replanning = runs
    blocks = [locate(f).block for f in replanning.frames]
    assert max(math.dist(blocks[0], b) for b in blocks) > 5.0  # the block moved as predicted
    assert replanning.replans_early == 0 and default.replans_early == 0
    assert replanning.executed == default.executed == [8, 4]
    assert replanning.plans == default.plans == 2 and replanning.steps == 12


async def test_replan_error_replans_at_the_step_the_block_strays_from_the_prediction():
    """Rollouts right for two steps and wrong about the block after: with `replan_error` each
    plan stops after its third step (the first one surprised) and is replanned, until the
    budget; without it (0: off) each plan runs its whole horizon."""
    config = CEMConfig(horizon=8, samples=4, elites=2, iterations=1, knot_frames=4)
    task = make_task(5, 64)
    default = await run_episode(lambda frame, world: _WrongAfterTwo(world), task, config, 64, budget=12)
    early = await run_episode(
        lambda frame, world: _WrongAfterTwo(world), task, config, 64, budget=12, replan_error=3.0
    )
    assert not default.success and not early.success
    assert default.replans_early == 0 and default.executed == [8, 4]
    # The last plan has only 3 steps of budget left: it runs them all, not cut short.
    assert early.executed == [3, 3, 3, 3] and early.replans_early == 3
    assert early.plans == 4 > default.plans and sum(early.executed) == early.steps == 12
    assert all(n < config.horizon for n in early.executed)
    assert early.to_json()["replans_early"] == 3


class _Forks:
    """SimulatorRollouts that keep every fork's candidates in `forks` (shared by all plans)."""

    def __init__(self, world: PushTWorld, forks: list) -> None:
        from streamworld.pusht.planning import SimulatorRollouts

        self.true, self.forks = SimulatorRollouts(world), forks

    async def __call__(self, candidates: np.ndarray) -> np.ndarray:
        self.forks.append(candidates.copy())
        return await self.true(candidates)

    def close(self) -> None:
        self.true.close()


@pytest.mark.parametrize("warm_start", ["mean", "plan"])
async def test_a_later_plan_first_tries_the_last_plans_mean_or_its_chosen_plan_moved_on(warm_start):
    """After 4 of 8 steps, the next plan's first candidate is the last plan's final mean
    (`mean`) or the plan it chose (`plan`), one knot of 4 steps on, its last knot held."""
    config = CEMConfig(horizon=8, samples=4, elites=2, iterations=1, knot_frames=4)
    forks: list = []
    result = await run_episode(
        lambda frame, world: _Forks(world, forks),
        make_task(5, 64),
        config,
        64,
        budget=8,
        execute=4,
        record=True,
        warm_start=warm_start,
    )
    assert result.plans == 2 and len(forks) == 2
    first = result.recorded_plans[0]
    assert not np.allclose(first.knots, first.mean)  # the two warm starts differ here
    np.testing.assert_allclose(np.repeat(first.knots, 4, 0), first.actions)  # the chosen plan's knots
    kept = first.mean if warm_start == "mean" else first.knots
    np.testing.assert_allclose(forks[1][0], np.repeat([kept[1], kept[1]], 4, 0), atol=1e-3)


def test_an_unknown_warm_start_is_refused_and_the_flag_offers_the_planners_choices():
    import argparse

    from streamworld.cli import arguments
    from streamworld.pusht.planning import WARM_STARTS

    assert arguments.WARM_STARTS == WARM_STARTS
    parser = argparse.ArgumentParser()
    arguments.add_search_arguments(parser)
    assert parser.parse_args([]).warm_start == "mean"
    assert parser.parse_args(["--warm-start", "plan"]).warm_start == "plan"
    config = CEMConfig(horizon=4, samples=2, elites=1, iterations=1, knot_frames=4)
    with pytest.raises(ValueError, match="warm_start must be one of mean, plan"):
        asyncio.run(run_episode(lambda frame, world: None, make_task(5, 64), config, 64, warm_start="best"))


def test_a_negative_replan_error_is_refused():
    task = make_task(5, 64)
    config = CEMConfig(horizon=8, samples=4, elites=2, iterations=1, knot_frames=4)
    with pytest.raises(ValueError, match="replan_error must be >= 0"):
        asyncio.run(run_episode(lambda frame, world: None, task, config, 64, replan_error=-1.0))


def test_the_shape_weight_reaches_the_episodes_cost_and_defaults_to_the_costs(monkeypatch):
    """`run_episode(shape_weight=W)` scores with `frame_cost(goal, W)`; the flag's default is
    the cost's own; a negative weight is refused."""
    import argparse

    from streamworld.cli.arguments import add_search_arguments
    from streamworld.pusht import planning as pusht_planning
    from streamworld.pusht.planning import SHAPE_WEIGHT, SimulatorRollouts

    parser = argparse.ArgumentParser()
    add_search_arguments(parser)
    assert parser.parse_args([]).shape_weight == SHAPE_WEIGHT == 200.0
    weights = []
    original = pusht_planning.frame_cost

    def spy(goal_frame, shape_weight=SHAPE_WEIGHT, **kw):
        weights.append(shape_weight)
        return original(goal_frame, shape_weight, **kw)

    monkeypatch.setattr(pusht_planning, "frame_cost", spy)
    task = make_task(5, 64)
    config = CEMConfig(horizon=4, samples=2, elites=1, iterations=1, knot_frames=4)
    for w in (0.0, 50.0):
        asyncio.run(
            run_episode(
                lambda frame, world: SimulatorRollouts(world), task, config, 64, budget=4, shape_weight=w
            )
        )
    assert weights == [0.0, 50.0]
    with pytest.raises(ValueError, match="shape_weight must be >= 0"):
        asyncio.run(run_episode(lambda frame, world: None, task, config, 64, shape_weight=-1.0))


def test_eval_plan_simulator_refuses_model_options(capsys):
    from streamworld.cli import main

    assert main(["eval", "pusht", "--plan", "--simulator", "--dit", "x.safetensors"]) == 2
    assert "--simulator plans without the world model" in capsys.readouterr().err


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT ARGS` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_the_plan_cost_benchmark_times_both_cost_modes(tmp_path):
    """benchmarks/plan_cost.py writes a timing for each `--cost-frames` mode, here for the
    fork-at-once PyTorch path (the timings themselves belong to the benchmark, not to this
    test)."""
    import json

    from streamworld.pusht.planning import COST_FRAMES

    out = tmp_path / "cost.json"
    cmd = ["plan_cost.py", "--candidates", "2", "--frames", "3"]
    done = _benchmark(*cmd, "--repeats", "1", "--device", "cpu", "--fork", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["candidates"], report["frames"], report["cost_device"], report["fork"]) == (2, 3, "cpu", 1)
    assert set(report["modes"]) == set(COST_FRAMES)
    assert all(row["seconds_per_plan"] > 0 for row in report["modes"].values())
    bad = _benchmark(*cmd, "--repeats", "0")
    assert bad.returncode == 2 and "--repeats and --fork must be at least 1" in bad.stderr
    # The default: NumPy frame by frame on the host, as `eval --plan` on a CPU.
    bench = load_script("benchmarks/plan_cost.py")
    rows = bench.measure(2, 3, 1)
    assert set(rows) == set(COST_FRAMES) and all(row["seconds_per_plan"] > 0 for row in rows.values())


@pytest.mark.slow
def test_the_plan_throughput_benchmark_times_each_fork_size(tmp_path):
    """benchmarks/plan_throughput.py forks the shipped model's stream for each size asked and
    writes one row per size (the timings belong to the benchmark, not to this test)."""
    import json

    out = tmp_path / "throughput.json"
    cmd = ["plan_throughput.py", "--horizon", "4", "--repeats", "1"]
    done = _benchmark(*cmd, "--branches", "1,2", "--warmup", "0", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["device"], report["horizon"], report["weights"]) == ("cpu", 4, "shipped")
    assert [row["branches"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["min_s"] <= row["fork_s"] <= row["max_s"]
        assert row["frames_per_s"] == pytest.approx(row["branches"] * 4 / row["fork_s"], rel=0.01)
    bad = _benchmark(*cmd, "--branches", "2,x")
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    # The delta model with one step in clean mode, as the best planning setting serves it.
    args = [
        "--model",
        "pusht-delta",
        "--steps",
        "1000",
        "--kv-mode",
        "clean",
        "--branches",
        "2",
        "--warmup",
        "0",
    ]
    done = _benchmark(*cmd, *args, "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["model"], report["kv_mode"], report["timesteps"]) == ("pusht-delta", "clean", [1000.0])
    bad = _benchmark(*cmd, "--steps", "250,1000")
    assert bad.returncode == 2 and "--steps must decrease" in bad.stderr


def _load_benchmark(name: str):
    return load_script(f"benchmarks/{name}.py")


def test_the_plan_ranking_benchmark_finds_the_pick_the_truths_best_and_the_regret():
    """benchmarks/plan_ranking.py's bookkeeping on two made-up forks: the model's pick is the
    first least model cost over the forks (as `cem` keeps it), the best by the truth the least
    true cost, and their origins and iterations are where they sat."""
    bench = _load_benchmark("plan_ranking")
    assert bench.spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0])) == pytest.approx(1.0)
    assert bench.spearman(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    forks = [
        {
            "model_costs": np.array([5.0, 1.0, 4.0]),
            "true_costs": np.array([6.0, 9.0, 2.0]),
            "reaches": [False, False, True],
            "distances": [50.0, 80.0, 5.0],
            "origins": bench.origins(0, 3, 1),
        },
        {
            "model_costs": np.array([1.0, 3.0, 2.0]),
            "true_costs": np.array([7.0, 3.0, 8.0]),
            "reaches": [False, False, False],
            "distances": [40.0, 30.0, 60.0],
            "origins": bench.origins(1, 3, 1),
        },
    ]
    row = bench.summarise(7, forks, start=60.0)
    assert forks[0]["origins"] == ["mean", "proposal", "random"]
    assert row["pick"] == {
        "origin": "proposal",
        "iteration": 0,
        "true_cost": 9.0,
        "block_distance": 80.0,
        "reaches": False,
    }
    assert row["best_by_truth"] == {
        "origin": "random",
        "iteration": 0,
        "true_cost": 2.0,
        "block_distance": 5.0,
    }
    assert row["regret"] == 7.0 and row["some_candidate_reaches"] and row["proposals_reaching"] == 0
    assert row["spearman_per_fork"] == [-0.5, -0.5]
    totals = bench.totals([row])
    assert totals["picks_from"] == {"mean": 0, "proposal": 1, "random": 0}
    assert totals["pushes_where_the_pick_brings_the_block_nearer"] == 0 and totals["pick_reaches"] == 0


@pytest.mark.slow
def test_the_plan_ranking_benchmark_runs_a_plan_through_the_model_and_the_truth(tmp_path):
    """One tiny plan end to end with the shipped model; a bad count of proposals is a usage
    error."""
    import json

    out = tmp_path / "ranking.json"
    cmd = ["plan_ranking.py", "--seeds", "3", "--samples", "3", "--elites", "2", "--iterations", "1"]
    # With a speed limit, so that the final mean's true rollout runs the limited actions too.
    args = ["--plan-horizon", "8", "--proposals", "1", "--max-speed", "30", "--json", str(out)]
    done = _benchmark(*cmd, *args, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["cem"]["horizon"], report["cem"]["knot_frames"], report["cem"]["max_speed"]) == (
        8,
        4,
        30.0,
    )
    # By default the search of `eval pusht --plan --noise-beta 2 --keep-elites 2`.
    bench = _load_benchmark("plan_ranking")
    search = bench.search(bench.make_parser().parse_args([]))
    assert (search.horizon, search.knot_frames, search.samples, search.iterations) == (24, 4, 16, 3)
    assert (
        search.max_speed == 0
        and bench.search(bench.make_parser().parse_args(["--max-speed", "25"])).max_speed == 25
    )
    (row,) = report["tasks"]
    assert report["totals"]["tasks"] == 1 and len(row["spearman_per_fork"]) == 1
    assert row["regret"] >= 0 and row["pick"]["iteration"] == 0
    assert row["final_mean"]["true_cost"] >= 0 and isinstance(row["final_mean"]["reaches"], bool)
    (fork,) = row["forks"]
    assert fork["origins"] == ["mean", "proposal", "random"] and len(fork["model_costs"]) == 3
    assert min(fork["true_costs"]) == pytest.approx(row["best_by_truth"]["true_cost"], abs=0.01)
    assert report["totals"]["final_mean_reaches"] == int(row["final_mean"]["reaches"])
    bad = _benchmark(*cmd, "--proposals", "3")
    assert bad.returncode == 2 and "--proposals must be 0 to 2" in bad.stderr
    missing = _benchmark(*cmd, "--proposals", "1", "--dit", str(tmp_path / "none.safetensors"))
    assert missing.returncode == 2 and "none.safetensors does not exist" in missing.stderr
    assert report["weights"] == "shipped"
