"""benchmarks/pusht_physics_floor.py: the environment started from an episode's exact start
redraws that episode's frames, and a start moved by a known amount is moved by exactly
that amount before the physics runs (CPU, the eval episodes of two seeds)."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from streamworld.pusht.evaluate import block_scores, block_summary, record_eval_episode
from streamworld.pusht.pose import simulate
from streamworld.pusht.world import PushTWorld
from tests.conftest import load_script

floor = load_script("benchmarks/pusht_physics_floor.py")


def test_the_exact_start_redraws_the_episode_and_a_jittered_one_does_not():
    ep = record_eval_episode(1, 32, floor.SIZE)
    world = PushTWorld(floor.SIZE)
    world.reset(1)
    true = world.scene
    exact = simulate(world, true, true, ep.actions)
    # Within a few pixels: reset runs one physics step after placing the bodies, and the
    # rollout's own start does not repeat the episode's.
    differs = np.abs(exact.astype(int) - ep.frames[1:].astype(int)).max(-1) > 8
    assert differs.mean() < 0.005
    assert all(r["block_px"] < 0.05 for r in block_scores(exact, ep, floor.HORIZONS).values())
    rng = np.random.default_rng(0)
    moved = floor.start_scene("jitter", 1.0, 4.0, true, ep.frames[0], rng)
    shift = math.hypot(moved.block[0] - true.block[0], moved.block[1] - true.block[1])
    assert shift == pytest.approx(floor.WORLD_SIZE / floor.SIZE)  # 1 px
    assert abs(math.degrees(moved.block[2] - true.block[2])) == pytest.approx(4.0)
    assert moved.agent == true.agent
    errors = block_scores(simulate(world, moved, moved, ep.actions), ep, floor.HORIZONS)
    assert errors[8]["block_px"] > 0.5
    seen = floor.start_scene("seen", 0.0, 0.0, true, ep.frames[0], rng)
    assert math.hypot(seen.block[0] - true.block[0], seen.block[1] - true.block[1]) < 4.0  # half a px
    world.close()


def test_the_report_names_each_start_and_counts_its_rollouts():
    args = argparse.Namespace(seeds=[0, 1], starts=["true", "jitter:0.5,2"], jitter_seed=3)
    report = floor.run(args)
    assert set(report["starts"]) == {"true", "jitter:0.5,2"}
    assert all(r["rollouts"] == 2 for r in report["starts"].values())
    assert report["starts"]["true"]["horizons"]["32"]["block_px_mean"] < 0.05
    assert "| `jitter:0.5,2` | 2 |" in floor.table(report)


@pytest.mark.parametrize("text", ["jitter", "jitter:1", "jitter:-1,2", "shake:1,2", "seen:1,1"])
def test_a_bad_start_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        floor.parse_start(text)


def test_the_command_line_refuses_a_bad_start_and_keeps_good_ones_by_name():
    parser = floor.make_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--start", "jitter:1"])
    assert parser.parse_args(["--start", "seen", "--start", "jitter:1,2"]).starts == ["seen", "jitter:1,2"]


def test_the_block_summary_leaves_out_what_was_not_found():
    nan = float("nan")
    rows = [
        {8: {"block_px": 1.0, "block_deg": nan}},
        {8: {"block_px": 3.0, "block_deg": nan}},
        {8: {"block_px": nan, "block_deg": nan}},
        {8: {"block_px": 8.0, "block_deg": nan}},
    ]
    summary = block_summary(rows, (8,))["8"]
    assert summary == {"block_px_mean": 4.0, "block_px_median": 3.0, "block_deg_median": None}
