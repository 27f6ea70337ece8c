"""benchmarks/pusht_state_dynamics.py: its scenes are the training data's, its rollouts
build on their own predictions, and a tiny run reports every horizon and saves the model
(CPU). The scene model itself: tests/test_scene_model.py."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from streamworld.pusht.data import DatasetSpec, record_episode, scene_row
from streamworld.pusht.scene_model import SceneModel, targets, wall_gap
from streamworld.pusht.world import Scene
from tests.conftest import load_script

dyn = load_script("benchmarks/pusht_state_dynamics.py")


def test_the_scenes_are_those_train_pusht_records():
    """Scripted and candidate episodes alike (tests/test_pusht.py checks the share)."""
    spec = DatasetSpec(episodes=6, steps=12, size=dyn.SIZE, seed=4, push_share=0.85, candidate_share=0.5)
    kinds = set()
    for index in range(6):
        scenes, actions = dyn.record_scenes((index, spec))
        policy = spec.policy(index)
        kinds.add(type(policy).__name__)
        _, true_actions, true_states = record_episode(spec.episode_seed(index), policy, 12, dyn.SIZE)
        np.testing.assert_allclose(actions, true_actions, atol=1e-3)
        np.testing.assert_allclose(scenes[:, :5], true_states, atol=1e-3)
        assert scenes.shape == (13, 10) and np.abs(scenes[1:, 5:7]).max() > 0  # the agent's velocity
    assert kinds == {"CandidatePolicy", "ScriptedPolicy"}


@pytest.mark.parametrize("kind", ["moves", "velocities", "walls"])
def test_a_tiny_run_through_rollouts_reports_each_horizon_and_saves_the_model(tmp_path, kind):
    args = argparse.Namespace(
        episodes=3,
        steps_per_episode=40,
        data_seed=0,
        push_share=0.85,
        jump_share=0.0,
        candidate_share=0.5,
        judge_candidates=3,
        train_steps=20,
        width=16,
        seed=0,
        workers=1,
        seeds=[0, 1],
        rollout_steps=4,
        device="cpu",
        batch=64,
        train_minutes=0.0,
        max_grad_norm=0.0,
        load=None,
        save=tmp_path / "scene.safetensors",
        kind=kind,
        data=None,
    )
    report = dyn.run(args)
    assert report["model"]["rollout_steps"] == 4 and report["model"]["batch"] == 64
    assert set(report["horizons"]) == {str(h) for h in dyn.HORIZONS}
    assert report["model"]["samples"] == 3 * 40
    assert all(v["block_px_mean"] is None or v["block_px_mean"] >= 0 for v in report["horizons"].values())
    assert report["model"]["saved"] == "scene.safetensors" and len(report["model"]["sha256"]) == 64
    assert report["one_step"]["steps_scored"] > 0 and report["one_step"]["block_px_mean"] >= 0
    judged = report["candidates"]
    assert judged["candidates"] == 2 * 3 and 0 <= judged["moved"] <= 6
    assert 0 <= judged["near_wall"]["candidates"] <= 6 and 0 <= judged["near_goal"]["candidates"] <= 6
    assert set(judged["horizons"]) == {str(h) for h in dyn.CANDIDATE_HORIZONS}
    saved = SceneModel.load(tmp_path / "scene.safetensors")
    assert saved.kind == kind and saved.scale.shape == ((5,) if kind == "moves" else (6,))
    assert saved.width == 16 and not torch.all(saved.scale == 1)
    assert saved.metadata == {
        "width": "16",
        "kind": kind,
        "episodes": "3",
        "data_seed": "0",
        "jump_share": "0.0",
        "candidate_share": "0.5",
        "train_steps": "20",
        "rollout_steps": "4",
        "batch": "64",
    }
    # Scoring the saved model again gives the same horizons, and says which file it scored.
    args.load = tmp_path / "scene.safetensors"
    again = dyn.run(args)
    assert again["horizons"] == report["horizons"] and again["model"]["loaded"] == "scene.safetensors"
    assert again["candidates"] == report["candidates"]
    assert again["model"]["rollout_steps"] == "4" and "data" not in again


def test_rollouts_build_on_their_own_predictions():
    """A model that predicts no change keeps each rollout at its start, so every step is
    scored from the start against the true scene that many steps later."""
    rng = np.random.default_rng(2)
    episodes = torch.tensor(np.cumsum(rng.normal(0, 3, (6, 20, 5)), 1) + 200, dtype=torch.float32)
    taken = torch.tensor(rng.uniform(0, 512, (6, 19, 2)), dtype=torch.float32)
    still = SceneModel(8)
    torch.nn.init.zeros_(still.net[-1].weight)
    torch.nn.init.zeros_(still.net[-1].bias)
    k = 4
    loss = dyn.rollout_loss(still, episodes, taken, k, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    n = dyn.BATCH // k
    e = torch.randint(0, 6, (n,), generator=gen)
    t = torch.randint(1, 20 - k, (n,), generator=gen)
    start = episodes[e, t]
    expected = sum((targets(episodes[e, t + j + 1], start) ** 2).mean() for j in range(k)) / k
    assert loss.item() == pytest.approx(float(expected), rel=1e-5)


class _Replaying:
    """A scene model that knows the environment: its rollouts are the true ones."""

    def __init__(self, world):
        self.world = world

    def roll_out(self, start, actions):
        from streamworld.pusht.data import scene_row

        out = np.empty((*actions.shape[:2], 5))
        for k, candidate in enumerate(actions):
            twin = self.world.replica()
            for h, action in enumerate(candidate):
                twin.advance(action)
                out[k, h] = scene_row(twin.scene)
            twin.close()
        return out


class _Still:
    def roll_out(self, start, actions):
        return np.repeat(start[:, None], actions.shape[1], 1)


def test_candidates_are_judged_step_by_step_against_the_environment():
    from streamworld.pusht.planning import make_task, reached, state_error
    from streamworld.pusht.proposals import CandidatePolicy, block_middle

    task = make_task(4, dyn.SIZE)
    world, _ = task.start(dyn.SIZE)
    policy = CandidatePolicy(9)  # of its 8 candidates, 6 move the block
    candidates = np.stack([policy.candidate(world.scene, task.goal) for _ in range(8)])
    errors, facts = dyn.candidate_errors(_Replaying(world), world, candidates, task.goal)
    assert errors.shape == (8, 24, 2) and np.all(errors == 0)
    # A model that is the environment predicts the success test's outcome exactly.
    np.testing.assert_array_equal(facts["predicted_reached"], facts["reached"])
    errors, still = dyn.candidate_errors(_Still(), world, candidates, task.goal)
    for key in ("moved", "wall_gap", "goal_units", "goal_degrees", "reached"):
        np.testing.assert_array_equal(facts[key], still[key])
    moved = facts["moved"]
    assert moved.any() and not moved.all()
    start = block_middle(world.scene.block)
    for k, candidate in enumerate(candidates):
        twin, gap = world.replica(), np.inf
        for h, action in enumerate(candidate):
            twin.advance(action)
            shift = np.linalg.norm(block_middle(twin.scene.block) - start) * dyn.SIZE / 512
            assert errors[k, h, 0] == pytest.approx(shift)
            gap = min(gap, wall_gap(twin.scene.block))
        assert moved[k] == (shift > 1) and facts["wall_gap"][k] == gap
        assert (facts["goal_units"][k], facts["goal_degrees"][k]) == state_error(twin.scene, task.goal)
        assert facts["reached"][k] == reached(twin.scene, task.goal)
        # The still model's end is the start itself, put to the success test as the true end is.
        end = _Still().roll_out(np.array([scene_row(world.scene)]), candidate[None])[0, -1]
        assert still["predicted_reached"][k] == reached(Scene(tuple(end[:2]), tuple(end[2:])), task.goal)
        twin.close()
    summary = dyn._candidate_summary(errors, still)
    assert summary["candidates"] == 8 and summary["moved"] == int(moved.sum())
    assert summary["horizons"]["24"]["block_px_mean"] == pytest.approx(errors[:, 23, 0].mean(), abs=1e-3)
    assert summary["horizons"]["8"]["moved_block_px_mean"] == pytest.approx(
        errors[moved, 7, 0].mean(), abs=1e-3
    )
    world.close()


def test_the_candidate_summary_sums_candidates_near_a_wall_and_near_the_goal_apart():
    errors = np.random.default_rng(0).uniform(0, 5, (8, 24, 2))
    walled = np.array([True, False, True, False, False, False, False, False])
    near_goal = np.array([False, True, True, False, False, False, True, False])
    facts = {
        "moved": np.ones(8, bool),
        "wall_gap": np.where(walled, 3.0, 50.0),
        "goal_units": np.where(near_goal, 30.0, 100.0),
        "goal_degrees": np.where(near_goal, 10.0, 5.0),
        "reached": np.array([False, True, False, False, False, False, True, False]),
        "predicted_reached": np.array([False, True, True, False, False, False, False, True]),
    }
    summary = dyn._candidate_summary(errors, facts)
    near = summary["near_wall"]
    assert near["candidates"] == 2
    assert near["block_px_mean"] == pytest.approx(errors[walled, 23, 0].mean(), abs=1e-3)
    share = errors[walled, 23, 0].sum() / errors[:, 23, 0].sum()
    assert near["share_of_error"] == pytest.approx(share, abs=1e-3)
    goal = summary["near_goal"]
    assert goal["candidates"] == 3 and goal["reached"] == 2
    assert goal["block_px_mean"] == pytest.approx(errors[near_goal, 23, 0].mean(), abs=1e-3)
    assert goal["success_test_agrees"] == pytest.approx(1 / 3, abs=1e-3)  # of 1, 2, 6: only 1


def test_a_loss_that_stops_being_finite_ends_training_with_an_error(monkeypatch, capsys):
    rng = np.random.default_rng(0)
    scenes = [np.cumsum(rng.normal(0, 3, (30, 5)), 0) + 200 for _ in range(3)]
    actions = [rng.uniform(0, 512, (29, 2)) for _ in range(3)]
    _, loss, _, steps = dyn.train(scenes, actions, 3, 8, 0, False, 4, batch=32, max_grad_norm=1.0)
    assert np.isfinite(loss) and steps == 3
    scenes[1][7, 3] = np.inf  # one scene the physics could never give
    with pytest.raises(dyn.Diverged, match="loss is nan"):
        dyn.train(scenes, actions, 3, 8, 0, False, 4, batch=32)
    # The command line says so and exits with an error, saving nothing.
    monkeypatch.setattr(dyn, "run", lambda args: (_ for _ in ()).throw(dyn.Diverged("the loss is nan")))
    monkeypatch.setattr("sys.argv", ["pusht_state_dynamics.py", "--max-grad-norm", "10"])
    with pytest.raises(SystemExit) as exited:
        dyn.main()
    assert exited.value.code == 1 and "training diverged: the loss is nan" in capsys.readouterr().err


def test_recorded_episodes_are_kept_and_reused_only_for_the_same_data(tmp_path, monkeypatch):
    spec = DatasetSpec(episodes=2, steps=10, size=dyn.SIZE, seed=4, candidate_share=1.0)
    path = tmp_path / "data.npz"
    first = dyn.recorded(spec, 1, path)
    assert path.is_file() and len(first) == 2 and first[0][0].shape == (11, 10)

    def no_recording(*_):
        raise AssertionError("recorded again")

    monkeypatch.setattr(dyn, "record", no_recording)
    again = dyn.recorded(spec, 1, path)
    for (s0, a0), (s1, a1) in zip(first, again, strict=True):
        np.testing.assert_array_equal(s0, s1)
        np.testing.assert_array_equal(a0, a1)
    other = DatasetSpec(episodes=2, steps=10, size=dyn.SIZE, seed=5, candidate_share=1.0)
    with pytest.raises(SystemExit, match=r"recorded for .*not for this run's"):
        dyn.recorded(other, 1, path)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not an npz")
    with pytest.raises(SystemExit, match="not episodes this script saved"):
        dyn.recorded(spec, 1, junk)


def test_one_step_errors_of_a_still_block_are_the_true_moves():
    """A model that predicts no change of the block misses, one step ahead, by exactly how
    far the true block moved, on the steps it scores."""
    still = SceneModel(8, kind="velocities")
    torch.nn.init.zeros_(still.net[-1].weight)
    torch.nn.init.zeros_(still.net[-1].bias)
    report = dyn.one_step_errors(still, episodes=2)
    spec = DatasetSpec(2, 150, dyn.SIZE, dyn.ONE_STEP_SEED, candidate_share=1.0)
    moves = np.concatenate(
        [np.hypot(*np.diff(dyn.record_scenes((i, spec))[0][:, 2:4], axis=0).T) for i in range(2)]
    )
    moves = moves[moves >= dyn.MOVED] * dyn.SIZE / 512
    assert report["steps_scored"] == len(moves) > 0
    assert report["block_px_mean"] == pytest.approx(moves.mean(), abs=2e-4)
    assert report["block_px_median"] == pytest.approx(np.median(moves), abs=2e-4)
