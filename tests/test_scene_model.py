"""streamworld.pusht.scene_model: the scene functions, the model's rollouts, its file, and
planning with it in the world model's place (`eval pusht --plan --scene-model`)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import numpy as np
import pytest
import safetensors.torch
import torch

from streamworld.pusht.data import scene_row
from streamworld.pusht.pose import block_corners, draw_scene, estimate_scene
from streamworld.pusht.scene_model import (
    SceneModel,
    SceneModelRollouts,
    agent_step,
    apply,
    features,
    state_row,
    targets,
    velocity_apply,
    velocity_features,
    velocity_targets,
    wall_features,
    wall_gap,
)
from streamworld.pusht.world import PushTWorld, Scene


def _scenes(rng, n):
    return np.column_stack([rng.uniform(0, 512, (n, 4)), rng.uniform(-3, 3, n)])


def _still(width=8, kind="moves") -> SceneModel:
    """A model that predicts no change (of the block, for `velocities`)."""
    model = SceneModel(width, kind=kind)
    torch.nn.init.zeros_(model.net[-1].weight)
    torch.nn.init.zeros_(model.net[-1].bias)
    return model.eval()


def test_a_change_applied_to_a_scene_gives_the_scene_it_was_taken_to():
    rng = np.random.default_rng(0)
    now = _scenes(rng, 50)
    after = now + np.column_stack([rng.normal(0, 10, (50, 4)), rng.normal(0, 0.2, 50)])
    np.testing.assert_allclose(apply(now, targets(now, after)), after, atol=1e-9)
    before = now - 1.0
    shifted = now.copy()
    shifted[:, [0, 2]] += 100.0  # the agent and the block moved together
    np.testing.assert_allclose(
        features(before, now, now[:, :2] + 5),
        features(before + np.array([100, 0, 100, 0, 0]), shifted, now[:, :2] + [105, 5]),
        atol=1e-9,
    )


def test_the_scene_functions_give_tensors_what_they_give_arrays():
    rng = np.random.default_rng(1)
    before, now = _scenes(rng, 20), _scenes(rng, 20)
    action = rng.uniform(0, 512, (20, 2))
    change = rng.normal(0, 1, (20, 5))
    t = torch.tensor
    for f, args in ((features, (before, now, action)), (targets, (before, now)), (apply, (now, change))):
        np.testing.assert_allclose(f(*(t(a) for a in args)).numpy(), f(*args), atol=1e-9)


def test_a_block_that_did_not_move_gives_a_finite_gradient():
    """Through a rollout, a predicted move below float32's resolution is exactly zero; its
    length must not make the gradient NaN (it did: training diverged)."""
    rng = np.random.default_rng(2)
    now = torch.tensor(_scenes(rng, 4), dtype=torch.float32, requires_grad=True)
    before = torch.cat([now[:2].detach(), now[2:] + torch.tensor([0.0, 0.0, 3.0, 4.0, 0.0])])
    moves = features(before, now, torch.tensor(rng.uniform(0, 512, (4, 2)), dtype=torch.float32))
    np.testing.assert_allclose(moves[:, 6].detach().numpy(), [0.0, 0.0, 0.5, 0.5], atol=1e-6)
    moves.sum().backward()
    assert torch.isfinite(now.grad).all()


def _rolled_out(model: SceneModel):
    """Starts [4, 5], actions [4, 6, 2] and the model's rollouts of them as one batch,
    checked to be what each candidate's rollout alone gives."""
    rng = np.random.default_rng(2)
    start = _scenes(rng, 4)
    actions = rng.uniform(0, 512, (4, 6, 2))
    batch = model.roll_out(start, actions)
    assert batch.shape == (4, 6, 5)
    for i in range(4):
        np.testing.assert_allclose(
            model.roll_out(start[i : i + 1], actions[i : i + 1])[0], batch[i], atol=1e-9
        )
    return start, actions, batch


def test_a_batch_rolls_out_as_each_candidate_alone_and_as_the_training_step():
    torch.manual_seed(0)
    model = SceneModel(16, torch.tensor([2.0, 1.0, 3.0, 0.5, 0.5])).eval()
    start, actions, batch = _rolled_out(model)
    # The first step from rest is the differentiable `step` training calls.
    s = torch.tensor(start, dtype=torch.float32)
    first = model.step(s, s, torch.tensor(actions[:, 0], dtype=torch.float32))
    np.testing.assert_allclose(first.detach().numpy(), batch[:, 0], atol=1e-3)
    # Each step goes on from the last, with the move that led to it.
    with torch.no_grad():
        x = torch.tensor(features(batch[:, 0], batch[:, 1], actions[:, 2]), dtype=torch.float32)
        third = apply(batch[:, 1], (model(x) * model.scale).double().numpy())
    np.testing.assert_allclose(batch[:, 2], third, atol=1e-9)
    assert not np.allclose(batch[:, 0], batch[:, 1])
    np.testing.assert_allclose(_still().roll_out(start, actions), np.repeat(start[:, None], 6, 1))


def _physics_episode(seed=3, steps=60):
    """States [steps + 1, 10] (`state_row`) and actions [steps, 2] of an episode whose
    targets jump every 4 steps, some outside the world, pushing the block."""
    world = PushTWorld(64)
    world.reset(seed)
    rng = np.random.default_rng(seed)
    states, actions = [state_row(world)], []
    for t in range(steps):
        if t % 4 == 0:
            target = np.array(world.scene.block[:2]) + rng.normal(0, 80, 2)
            target[0] = -30.0 if t == 8 else target[0]  # clipped, as the environment clips it
        world.advance(target)
        actions.append(target.copy())
        states.append(state_row(world))
    world.close()
    return np.array(states), np.array(actions)


def test_the_agent_steps_exactly_as_the_environment_steps_it():
    states, actions = _physics_episode()
    place, velocity = agent_step(states[:-1, 0:2], states[:-1, 5:7], actions)
    np.testing.assert_allclose(place, states[1:, 0:2], rtol=0, atol=1e-9)
    np.testing.assert_allclose(velocity, states[1:, 5:7], rtol=0, atol=1e-9)
    assert np.abs(states[1:, 7:]).max() > 1  # the block was pushed: its velocity is in the state


def test_a_velocities_change_applied_gives_the_state_it_was_taken_to():
    states, actions = _physics_episode(seed=4)
    now, after = states[:-1], states[1:]
    np.testing.assert_allclose(velocity_apply(now, velocity_targets(now, after), actions), after, atol=1e-9)
    t = torch.tensor
    np.testing.assert_allclose(
        velocity_targets(t(now), t(after)).numpy(), velocity_targets(now, after), atol=1e-9
    )
    np.testing.assert_allclose(velocity_features(t(now), t(actions)).numpy(), velocity_features(now, actions))
    # The input is the step seen from the block: turned and moved together, it is the same.
    turn, shift = 0.7, np.array([30.0, -20.0])
    c, s = np.cos(turn), np.sin(turn)
    r = np.array([[c, -s], [s, c]])
    moved = now.copy()
    moved[:, 0:2], moved[:, 2:4] = now[:, 0:2] @ r.T + shift, now[:, 2:4] @ r.T + shift
    moved[:, 4] += turn
    moved[:, 5:7], moved[:, 7:9] = now[:, 5:7] @ r.T, now[:, 7:9] @ r.T
    turned = actions @ r.T + shift
    inside = (np.clip(actions, 0, 512) == actions).all(1) & (np.clip(turned, 0, 512) == turned).all(1)
    assert inside.sum() > 20
    np.testing.assert_allclose(
        velocity_features(moved[inside], turned[inside]),
        velocity_features(now[inside], actions[inside]),
        atol=1e-9,
    )


def test_a_velocities_model_rolls_out_from_rest_as_its_training_step_does():
    torch.manual_seed(0)
    model = SceneModel(16, torch.tensor([2.0, 1.0, 3.0, 0.5, 0.5, 0.2]), kind="velocities").eval()
    assert model.columns == 10
    start, actions, batch = _rolled_out(model)
    # Each step is the differentiable `step` training calls, from the state it reached,
    # velocities carried: the roll-out starts at rest.
    now = torch.tensor(np.concatenate([start, np.zeros((4, 5))], 1), dtype=torch.float32)
    with torch.no_grad():
        for h in range(6):
            now = model.step(now, now, torch.tensor(actions[:, h], dtype=torch.float32))
            np.testing.assert_allclose(now[:, :5].numpy(), batch[:, h], rtol=1e-4, atol=1e-2)
    # A model that predicts no change of the block moves the agent as the environment does.
    still = _still(kind="velocities").roll_out(start, actions)
    np.testing.assert_allclose(still[..., 2:], np.repeat(start[:, None, 2:], 6, 1))
    place, velocity = start[:, :2], np.zeros((4, 2))
    for h in range(6):
        place, velocity = agent_step(place, velocity, actions[:, h])
        np.testing.assert_array_equal(still[:, h, :2], place)


def test_a_velocities_models_errors_score_the_block_not_the_agent():
    model = SceneModel(8, torch.tensor([2.0, 1.0, 3.0, 0.5, 0.5, 0.2]), kind="velocities")
    states, _ = _physics_episode(seed=5, steps=10)
    true = torch.tensor(states, dtype=torch.float32)
    off = true.clone()
    off[:, 0:2] += 50.0  # the agent is never scored: the model steps it exactly
    assert model.errors(true, off).abs().max() < 1e-6
    off[:, 7] += 100.0  # the block's velocity: 1 unit of the target, divided by its scale
    errors = model.errors(true, off)
    np.testing.assert_allclose(
        torch.hypot(errors[:, 3] * 0.5, errors[:, 4] * 0.5).numpy(), np.ones(11), rtol=1e-5
    )
    assert errors[:, :3].abs().max() < 1e-4 and errors[:, 5].abs().max() < 1e-6


def test_the_walls_kind_sees_how_near_each_wall_is_from_the_block(tmp_path):
    # The block's origin 50 units from the left wall's face (at 7) and 100 from the bottom
    # one's; turned a quarter, its frame's y axis points along the world's -x.
    now = np.zeros((3, 10))
    now[:, 0:2] = 200.0
    now[0, 2:5] = [57.0, 107.0, 0.0]
    now[1, 2:5] = [57.0, 107.0, np.pi / 2]
    now[2, 2:5] = [256.0, 256.0, 0.4]  # 248 units from every wall face: beyond its reach
    near = wall_features(now)
    np.testing.assert_allclose(near[0, 0:3], [0.75, -0.75, 0.0], atol=1e-12)  # left: toward -x
    np.testing.assert_allclose(near[1, 0:3], [0.75, 0.0, 0.75], atol=1e-12)  # -x is its +y
    np.testing.assert_allclose(near[0, 6:9], [0.5, 0.0, -0.5], atol=1e-12)  # bottom: toward -y
    np.testing.assert_allclose(near[0, [3, 9]], [0.0, 0.0])  # right and top: out of reach
    np.testing.assert_array_equal(near[2], np.zeros(12))
    np.testing.assert_allclose(wall_features(torch.tensor(now)).numpy(), near, atol=1e-12)
    # Its input is the velocities kind's and the walls': away from the walls, only zeros.
    model = SceneModel(8, torch.tensor([2.0, 1.0, 3.0, 0.5, 0.5, 0.2]), kind="walls").eval()
    actions = np.full((3, 2), 220.0)
    x = model.inputs(None, now, actions)
    np.testing.assert_array_equal(x[:, :11], velocity_features(now, actions))
    np.testing.assert_array_equal(x[2, 11:], np.zeros(12))
    # It steps and saves as the velocities kind does.
    path = tmp_path / "walls.safetensors"
    model.save(path)
    loaded = SceneModel.load(path)
    assert loaded.kind == "walls" and loaded.columns == 10
    start, plan = now[:, :5], np.full((3, 4, 2), 220.0)
    np.testing.assert_array_equal(loaded.roll_out(start, plan), model.roll_out(start, plan))


def test_the_ts_corners_are_the_environments_and_its_wall_gap_the_nearest_face():
    world = PushTWorld(64)
    world.reset(3)
    world.advance((300.0, 200.0))
    block = world.env.block
    vertices = [block.local_to_world(v) for shape in block.shapes for v in shape.get_vertices()]
    corners = sorted(map(tuple, np.round(block_corners(world.scene.block), 6)))
    assert corners == sorted((round(v.x, 6), round(v.y, 6)) for v in vertices)
    world.close()
    assert wall_gap((67.0, 300.0, 0.0)) == pytest.approx(0.0)  # the bar's left end on the left wall's face
    assert wall_gap((300.0, 300.0, 0.0)) == pytest.approx(84.0)  # the stem's foot, 84 below the top face
    assert wall_gap((256.0, 40.0, np.pi)) == pytest.approx(-87.0)  # upside down, the stem through the floor


def test_a_saved_model_loads_and_predicts_the_same(tmp_path):
    torch.manual_seed(1)
    model = SceneModel(12, torch.tensor([2.0, 1.0, 3.0, 0.5, 0.5]))
    path = tmp_path / "scene.safetensors"
    model.save(path, {"episodes": "3"})
    loaded = SceneModel.load(path)
    assert loaded.width == 12 and not loaded.training
    x = torch.randn(7, 8)
    torch.testing.assert_close(loaded(x), model(x))
    torch.testing.assert_close(loaded.scale, model.scale)


def test_a_saved_model_keeps_its_kind_and_older_files_are_moves(tmp_path):
    torch.manual_seed(2)
    model = SceneModel(12, torch.tensor([2.0, 1.0, 3.0, 0.5, 0.5, 0.2]), kind="velocities")
    path = tmp_path / "scene.safetensors"
    model.save(path)
    loaded = SceneModel.load(path)
    assert loaded.kind == "velocities" and loaded.columns == 10
    x = torch.randn(7, 11)
    torch.testing.assert_close(loaded(x), model(x))
    # A file written before the kinds has no `kind`: it is the first kind, `moves`.
    SceneModel(8).save(path)
    tensors = safetensors.torch.load_file(str(path))
    safetensors.torch.save_file(
        tensors, str(path), metadata={"format": "streamworld-pusht-scene-model/1", "width": "8"}
    )
    assert SceneModel.load(path).kind == "moves"
    safetensors.torch.save_file(
        tensors,
        str(path),
        metadata={"format": "streamworld-pusht-scene-model/1", "width": "8", "kind": "frames"},
    )
    with pytest.raises(ValueError, match="unknown kind 'frames'"):
        SceneModel.load(path)
    with pytest.raises(ValueError, match="unknown scene model kind"):
        SceneModel(8, kind="frames")


def test_a_file_that_is_not_a_scene_model_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        SceneModel.load(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SceneModel.load(junk)
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "something else"})
    with pytest.raises(ValueError, match="not a scene model"):
        SceneModel.load(other)
    wrong = tmp_path / "wrong.safetensors"
    SceneModel(8).save(wrong)
    tensors = safetensors.torch.load_file(str(wrong))
    safetensors.torch.save_file(
        tensors, str(wrong), metadata={"format": "streamworld-pusht-scene-model/1", "width": "9"}
    )
    with pytest.raises(ValueError, match="do not fit a width-9"):
        SceneModel.load(wrong)
    safetensors.torch.save_file(tensors, str(wrong), metadata={"format": "streamworld-pusht-scene-model/1"})
    with pytest.raises(ValueError, match="no width"):
        SceneModel.load(wrong)


def test_rollouts_draw_the_predicted_scenes_from_the_scene_the_frame_shows():
    world = PushTWorld(64)
    frame = world.reset(3)
    seen = estimate_scene(frame)
    assert seen is not None
    rollouts = SceneModelRollouts(_still(), frame)
    assert not rollouts.unread
    candidates = np.random.default_rng(0).uniform(0, 512, (3, 4, 2))
    out = asyncio.run(rollouts(candidates))
    assert out.shape == (3, 4, 64, 64, 3) and out.dtype == np.uint8
    canvas = PushTWorld(64)
    canvas.reset(0)
    np.testing.assert_array_equal(out[2, 3], draw_scene(canvas, seen))
    # A model that moves the agent right by one step's scale draws it there.
    right = SceneModel(8, torch.ones(5))
    torch.nn.init.zeros_(right.net[-1].weight)
    with torch.no_grad():
        right.net[-1].bias.copy_(
            torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
        )  # 10 world units in the block's frame
    out = asyncio.run(SceneModelRollouts(right.eval(), frame)(candidates[:1, :1]))
    moved = np.array(scene_row(seen), np.float64)
    moved[0] += 10 * np.cos(seen.block[2])
    moved[1] += 10 * np.sin(seen.block[2])
    expected = draw_scene(canvas, Scene(tuple(moved[:2]), tuple(moved[2:])))
    np.testing.assert_array_equal(out[0, 0], expected)
    world.close()
    canvas.close()


def test_rollouts_from_a_frame_without_a_t_are_the_frame_unchanged():
    blank = np.full((64, 64, 3), 255, np.uint8)
    rollouts = SceneModelRollouts(_still(), blank)
    assert rollouts.unread
    out = asyncio.run(rollouts(np.zeros((2, 3, 2))))
    assert out.shape == (2, 3, 64, 64, 3) and (out == 255).all()
    # Poses: none to give, which the pose cost scores alike for every candidate.
    from streamworld.pusht.planning import PoseCost, make_task

    poses = asyncio.run(SceneModelRollouts(_still(), blank, poses=True)(np.zeros((2, 3, 2))))
    assert poses.shape == (2, 3, 5) and np.isnan(poses).all()
    assert (PoseCost(make_task(3, 64).goal_frame).many(poses) == PoseCost.UNSEEN).all()


def test_rollouts_with_poses_answer_the_models_rolled_out_poses_undrawn():
    """`poses=True`: the answer is the model's `roll_out` from the scene the frame shows,
    every step of it, with nothing drawn."""
    torch.manual_seed(5)
    moving = SceneModel(16, torch.tensor([3.0, 3.0, 1.0, 1.0, 0.02])).eval()
    world = PushTWorld(64)
    frame = world.reset(3)
    world.close()
    candidates = np.random.default_rng(0).uniform(0, 512, (3, 4, 2))
    poses = asyncio.run(SceneModelRollouts(moving, frame, every_frame=False, poses=True)(candidates))
    start = np.repeat([scene_row(estimate_scene(frame))], 3, 0)
    np.testing.assert_array_equal(poses, moving.roll_out(start, candidates))
    assert poses.shape == (3, 4, 5) and np.abs(poses[:, -1] - start).max() > 1  # it moved


def test_rollouts_that_draw_only_the_last_frame_draw_it_as_all_of_them_do():
    """`every_frame=False` draws each candidate's last frame only, the same frame, and a
    plan whose cost reads the last frame goes exactly as with every frame drawn."""
    from streamworld.planning import CEMConfig
    from streamworld.pusht.planning import make_task, run_episode

    torch.manual_seed(5)
    moving = SceneModel(16, torch.tensor([3.0, 3.0, 1.0, 1.0, 0.02])).eval()  # random, so it moves
    world = PushTWorld(64)
    frame = world.reset(3)
    candidates = np.random.default_rng(1).uniform(0, 512, (3, 6, 2))
    every = asyncio.run(SceneModelRollouts(moving, frame)(candidates))
    last = asyncio.run(SceneModelRollouts(moving, frame, every_frame=False)(candidates))
    assert last.shape == (3, 1, 64, 64, 3)
    np.testing.assert_array_equal(last[:, 0], every[:, -1])
    assert not np.array_equal(every[:, 0], every[:, -1])  # the frames do differ along the way
    blank = np.full((64, 64, 3), 255, np.uint8)
    assert asyncio.run(SceneModelRollouts(moving, blank, False)(candidates)).shape == (3, 1, 64, 64, 3)
    world.close()
    config = CEMConfig(horizon=8, samples=6, elites=2, iterations=2, knot_frames=4, init_std=80.0)
    task = make_task(4, 64)
    results = []
    for every in (True, False):
        rollouts_for = lambda f, w, e=every: SceneModelRollouts(moving, f, e)  # noqa: E731
        results.append(asyncio.run(run_episode(rollouts_for, task, config, 64, budget=16, seed=2)))
    assert results[0].steps == results[1].steps == 16
    assert results[0].final_error == results[1].final_error
    assert results[0].success == results[1].success


def test_eval_plan_draws_every_frame_only_where_something_reads_it(tmp_path):
    import argparse

    from streamworld.cli.eval import _rollouts_without_the_model

    path = tmp_path / "scene.safetensors"
    _still().save(path)
    frame = PushTWorld(64).reset(0)
    for cost_frames, replan_error, every in (("last", 0.0, False), ("best", 0.0, True), ("last", 3.0, True)):
        args = argparse.Namespace(simulator=False, scene_model=path, model="pusht", cost="frame")
        args.cost_frames, args.replan_error = cost_frames, replan_error
        rollouts_for = _rollouts_without_the_model(args)[2]
        assert rollouts_for(frame, None, 0).every_frame is every
        assert not rollouts_for(frame, None, 0).poses
    # The pose cost: poses, nothing drawn; in the true environment too.
    args.cost = "pose"
    assert _rollouts_without_the_model(args)[2](frame, None, 0).poses
    world = PushTWorld(64)
    world.reset(0)
    args.simulator, args.scene_model = True, None
    simulator = _rollouts_without_the_model(args)[2](frame, world, 0)
    assert simulator.poses
    simulator.close()
    world.close()


def test_eval_plan_with_a_scene_model_reports_it(tmp_path, capsys):
    from streamworld.cli import main

    path = tmp_path / "scene.safetensors"
    _still(kind="velocities").save(path)
    out = tmp_path / "plan.json"
    args = ["eval", "pusht", "--plan", "--scene-model", str(path), "--seeds", "0", "--samples", "4"]
    args += ["--elites", "2", "--iterations", "1", "--budget", "8", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["rollouts"] == "scene-model" and report["scene_model"] == "scene.safetensors"
    assert report["scene_model_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert report["scene_model_kind"] == "velocities" and len(report["episodes"]) == 1


def test_eval_plan_refuses_a_bad_scene_model_and_model_options(tmp_path, capsys):
    from streamworld.cli import main

    assert main(["eval", "pusht", "--plan", "--scene-model", str(tmp_path / "none.safetensors")]) == 2
    assert "--scene-model:" in capsys.readouterr().err
    path = tmp_path / "scene.safetensors"
    _still().save(path)
    assert main(["eval", "pusht", "--plan", "--scene-model", str(path), "--dit", "x.safetensors"]) == 2
    assert "--scene-model plans without the world model" in capsys.readouterr().err
    assert main(["eval", "pusht", "--plan", "--scene-model", str(path), "--simulator"]) == 2
    assert "pick one" in capsys.readouterr().err


def test_the_plan_ranking_benchmark_ranks_with_a_scene_model(tmp_path):
    """benchmarks/plan_ranking.py --scene-model: a tiny first plan through the scene model and
    the truth. A model that predicts no change gives every candidate the same cost, so its
    costs do not follow the truth's."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = tmp_path / "scene.safetensors"
    _still().save(path)
    out = tmp_path / "ranking.json"
    cmd = [sys.executable, "benchmarks/plan_ranking.py", "--seeds", "3", "--samples", "4", "--elites", "2"]
    cmd += ["--iterations", "1", "--plan-horizon", "8", "--proposals", "1"]
    done = subprocess.run(
        [*cmd, "--scene-model", str(path), "--json", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["scene_model"] == "scene.safetensors"
    (fork,) = report["tasks"][0]["forks"]
    assert len(set(fork["model_costs"])) == 1 and len(set(fork["true_costs"])) > 1
    bad = subprocess.run(
        [*cmd, "--scene-model", str(tmp_path / "none.safetensors")], cwd=root, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--scene-model:" in bad.stderr


def test_the_shipped_scene_model_plans_easy_goals_on_the_pose_cost(tmp_path):
    """`--scene-model shipped` is the package's `walls` model, and with `--cost pose` it
    reaches easy goals (5 recorded steps away) with the search docs/planning.md measures."""
    from streamworld.cli import main

    out = tmp_path / "plan.json"
    args = [
        "eval",
        "pusht-delta",
        "--plan",
        "--scene-model",
        "shipped",
        "--cost",
        "pose",
        "--noise-beta",
        "2",
    ]
    args += ["--keep-elites", "2", "--proposals", "6", "--seeds", "0-3", "--goal-steps", "5"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["scene_model"] == "pusht-scene.safetensors" and report["scene_model_kind"] == "walls"
    assert report["cost"] == "pose" and report["complete"]
    assert sum(e["success"] for e in report["episodes"]) >= 3, report["episodes"]
