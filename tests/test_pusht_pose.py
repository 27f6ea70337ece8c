"""Reading the block's whole pose from a frame, and continuing the environment from it."""

from __future__ import annotations

import numpy as np
import pytest

from streamworld.pusht.pose import MAX_MISMATCH, continue_frames, estimate_scene, fit_block
from streamworld.pusht.world import box_mean, locate, palette_weights


@pytest.fixture(scope="module")
def episodes():
    """Two recorded episodes of 24 steps: (frames, actions, true scenes per frame)."""
    from streamworld.pusht.policy import ScriptedPolicy
    from streamworld.pusht.world import PushTWorld

    out = []
    for seed in (3, 8):
        world, policy = PushTWorld(64), ScriptedPolicy(seed + 500_000, push_share=0.9)
        frames, actions, scenes = [world.reset(seed)], [], [world.scene]
        for _ in range(24):
            actions.append(policy(world.scene))
            frames.append(world.step(actions[-1]))
            scenes.append(world.scene)
        world.close()
        out.append((np.stack(frames), np.stack(actions), scenes))
    return out


def _angle_gap(a: float, b: float) -> float:
    return abs((a - b + np.pi) % (2 * np.pi) - np.pi)


def test_the_fit_finds_the_true_pose(episodes):
    moved = 0.0
    for frames, _, scenes in episodes:
        moved += np.hypot(*np.subtract(scenes[-1].block[:2], scenes[0].block[:2]))
        for frame, truth in zip(frames[::3], scenes[::3], strict=True):
            pose, mismatch = fit_block(frame)
            assert mismatch < 0.2
            assert np.hypot(*np.subtract(pose[:2], truth.block[:2])) < 6.0  # world units
            assert _angle_gap(pose[2], truth.block[2]) < np.deg2rad(4)
            scene = estimate_scene(frame)
            assert scene.block == pose
            assert np.hypot(*np.subtract(scene.agent, truth.agent)) < 3.0
    assert moved > 20  # the episodes push the block, so poses differ


def test_a_dissolved_or_missing_block_has_no_pose(episodes):
    frame = episodes[0][0][5]
    blank = np.full_like(frame, 255)
    blank[30:33, 30:33] = (71, 115, 240)  # the agent alone
    assert fit_block(blank) is None and estimate_scene(blank) is None
    no_agent = frame.copy()
    no_agent[np.linalg.norm(frame.astype(float) - (71, 115, 240), axis=-1) < 90] = 255
    assert estimate_scene(no_agent) is None and fit_block(no_agent)[1] < MAX_MISMATCH / 2
    # The block drawn as a grey disc of the T's area, as a drifting model draws a dissolved
    # block (the agent is elsewhere and stays sharp). A moderate blur still fits a T.
    block = locate(frame).block
    ys, xs = np.mgrid[0:64, 0:64] + 0.5
    blob = frame.copy()
    blob[box_mean(palette_weights(frame)[..., 2], 3) > 0] = 255
    blob[np.hypot(xs - block[0], ys - block[1]) <= np.sqrt(98 / np.pi)] = (131, 149, 168)
    fit = fit_block(blob)
    assert fit is not None and fit[1] > MAX_MISMATCH
    assert estimate_scene(blob) is None
    assert fit_block(frame)[1] < MAX_MISMATCH / 2
    blurred = np.stack([box_mean(frame[..., c].astype(float) - 255.0, 5) + 255.0 for c in range(3)], -1)
    near_block = (box_mean(palette_weights(frame)[..., 2], 5) > 0)[..., None]
    assert estimate_scene(np.where(near_block, blurred.round(), frame).astype(np.uint8)) is not None


def test_continuing_from_two_true_frames_draws_the_true_next_frames(episodes):
    errors = []
    for frames, actions, _ in episodes:
        for t in (4, 10, 16):
            simulated = continue_frames((frames[t - 1], frames[t], actions[t : t + 4]))
            assert simulated is not None and simulated.shape == (4, 64, 64, 3)
            assert simulated.dtype == np.uint8
            for got, want in zip(simulated, frames[t + 1 : t + 5], strict=True):
                a, b = locate(got), locate(want)
                errors.append(np.hypot(a.block[0] - b.block[0], a.block[1] - b.block[1]))
                errors.append(np.hypot(a.agent[0] - b.agent[0], a.agent[1] - b.agent[1]))
    assert np.median(errors) < 0.5 and np.mean(errors) < 1.0  # pixels of 64


def test_two_frames_too_far_apart_are_not_one_motion(episodes):
    (frames, actions, _), (other, _, _) = episodes
    here, there = estimate_scene(frames[5]), estimate_scene(other[5])
    assert np.hypot(*np.subtract(here.block[:2], there.block[:2])) > 60  # two different scenes
    assert continue_frames((other[5], frames[5], actions[5:9])) is None
    assert continue_frames((frames[4], frames[5], actions[5:9])) is not None
