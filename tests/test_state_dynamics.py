"""benchmarks/pusht_state_dynamics.py: its scenes are the training data's, its change of
scene is exactly undone by applying it, and a tiny run reports every horizon (CPU)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from streamworld.pusht.data import DatasetSpec, record_episode
from tests.conftest import load_script

dyn = load_script("benchmarks/pusht_state_dynamics.py")


def test_the_scenes_are_those_train_pusht_records():
    spec = DatasetSpec(episodes=2, steps=12, size=dyn.SIZE, seed=4, push_share=0.85)
    scenes, actions = dyn.record_scenes((1, spec))
    seed = spec.episode_seed(1)
    _, true_actions, true_states = record_episode(seed, seed, 12, dyn.SIZE, 0.85)
    np.testing.assert_allclose(actions, true_actions, atol=1e-3)
    np.testing.assert_allclose(scenes, true_states, atol=1e-3)


def test_a_change_applied_to_a_scene_gives_the_scene_it_was_taken_to():
    rng = np.random.default_rng(0)
    now = np.column_stack([rng.uniform(0, 512, (50, 4)), rng.uniform(-3, 3, 50)])
    after = now + np.column_stack([rng.normal(0, 10, (50, 4)), rng.normal(0, 0.2, 50)])
    np.testing.assert_allclose(dyn.apply(now, dyn.targets(now, after)), after, atol=1e-9)
    before = now - 1.0
    shifted = now.copy()
    shifted[:, [0, 2]] += 100.0  # the agent and the block moved together
    np.testing.assert_allclose(
        dyn.features(before, now, now[:, :2] + 5),
        dyn.features(before + np.array([100, 0, 100, 0, 0]), shifted, now[:, :2] + [105, 5]),
        atol=1e-9,
    )


def test_a_tiny_run_through_rollouts_reports_each_horizon():
    args = argparse.Namespace(
        episodes=3,
        steps_per_episode=40,
        data_seed=0,
        push_share=0.85,
        train_steps=20,
        width=16,
        seed=0,
        workers=1,
        seeds=[0, 1],
        rollout_steps=4,
    )
    report = dyn.run(args)
    assert report["model"]["rollout_steps"] == 4
    assert set(report["horizons"]) == {str(h) for h in dyn.HORIZONS}
    assert report["model"]["samples"] == 3 * 40
    assert all(v["block_px_mean"] is None or v["block_px_mean"] >= 0 for v in report["horizons"].values())


def test_the_scene_functions_give_tensors_what_they_give_arrays():
    rng = np.random.default_rng(1)
    before, now = (np.column_stack([rng.uniform(0, 512, (20, 4)), rng.uniform(-3, 3, 20)]) for _ in range(2))
    action = rng.uniform(0, 512, (20, 2))
    change = rng.normal(0, 1, (20, 5))
    t = torch.tensor
    for f, args in (
        (dyn.features, (before, now, action)),
        (dyn.targets, (before, now)),
        (dyn.apply, (now, change)),
    ):
        np.testing.assert_allclose(f(*(t(a) for a in args)).numpy(), f(*args), atol=1e-9)


def test_rollouts_build_on_their_own_predictions():
    """A model that predicts no change keeps each rollout at its start, so every step is
    scored from the start against the true scene that many steps later."""
    rng = np.random.default_rng(2)
    episodes = torch.tensor(np.cumsum(rng.normal(0, 3, (6, 20, 5)), 1) + 200, dtype=torch.float32)
    taken = torch.tensor(rng.uniform(0, 512, (6, 19, 2)), dtype=torch.float32)
    scale = torch.ones(5)
    still = torch.nn.Linear(dyn.INPUTS, dyn.OUTPUTS)
    torch.nn.init.zeros_(still.weight)
    torch.nn.init.zeros_(still.bias)
    k = 4
    loss = dyn.rollout_loss(still, scale, episodes, taken, k, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    n = dyn.BATCH // k
    e = torch.randint(0, 6, (n,), generator=gen)
    t = torch.randint(1, 20 - k, (n,), generator=gen)
    start = episodes[e, t]
    expected = sum((dyn.targets(episodes[e, t + j + 1], start) ** 2).mean() for j in range(k)) / k
    assert loss.item() == pytest.approx(float(expected), rel=1e-5)
