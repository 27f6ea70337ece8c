"""Push proposals (`streamworld.pusht.proposals`) and how the planner takes them (CPU)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from streamworld.planning import CEMConfig, cem
from streamworld.pusht.planning import make_task, state_error
from streamworld.pusht.proposals import _reach, block_middle, push_path, push_proposals
from streamworld.pusht.world import Scene


def test_a_push_goes_round_behind_the_block_and_through_it_toward_the_goal():
    """The block (upright T, middle at about (256, 241)) must move 150 units right; the agent
    starts on its right, the goal's side: the path first goes round the block's side, then
    behind it (left, clear of it), pushes right, and ends at the goal's agent place."""
    now = Scene((420.0, 250.0), (256.0, 200.0, 0.0))
    goal = Scene((300.0, 300.0), (406.0, 200.0, 0.0))
    start, end = block_middle(now.block), block_middle(goal.block)
    path = push_path(now, goal)
    assert len(path) == 5
    detour, behind, middle, through, agent = path
    assert abs(detour[1] - start[1]) > _reach(now.block, np.array([0.0, 1.0]))  # beside the block
    assert behind[0] < start[0] - _reach(now.block, np.array([-1.0, 0.0])) - 15  # behind, clear
    np.testing.assert_allclose(behind[1], start[1])  # in line with the middle
    assert start[0] < through[0] < end[0] and middle[0] == pytest.approx((behind[0] + through[0]) / 2)
    np.testing.assert_allclose(agent, goal.agent)
    # From the far side there is no detour, and off-centre variants move across the push.
    assert len(push_path(Scene((100.0, 250.0), now.block), goal)) == 4
    shifted = push_path(Scene((100.0, 250.0), now.block), goal, offset=20.0)
    assert shifted[0][1] == pytest.approx(start[1] + 20.0)
    # A block already in place needs the agent alone.
    np.testing.assert_allclose(push_path(now, Scene(goal.agent, now.block)), [goal.agent])


@pytest.mark.parametrize("seed", [100, 103, 107, 108])
def test_the_first_proposal_carries_the_block_toward_the_goal_in_the_true_environment(seed):
    """Read from the frames alone, the straight push, run in the real environment, leaves the
    block's middle less than half as far from the goal's as it started."""
    task = make_task(seed, 64)
    world, frame = task.start(64)
    try:
        proposals = push_proposals(frame, task.goal_frame, knots=6, count=3)
        assert proposals.shape[1:] == (6, 2) and 1 <= len(proposals) <= 3
        goal = block_middle(task.goal.block)
        before = np.linalg.norm(block_middle(world.scene.block) - goal)
        for action in np.repeat(proposals[0], 4, axis=0):
            world.step(action)
        after = np.linalg.norm(block_middle(world.scene.block) - goal)
        assert before > 25 and after < before / 2, (before, after, state_error(world.scene, task.goal))
    finally:
        world.close()


def test_frames_that_cannot_be_read_give_no_proposal():
    task = make_task(100, 64)
    blank = np.full_like(task.goal_frame, 255)
    assert push_proposals(blank, task.goal_frame, 6, 4).shape == (0, 6, 2)
    assert push_proposals(task.goal_frame, blank, 6, 4).shape == (0, 6, 2)
    assert push_proposals(task.goal_frame, task.goal_frame, 6, 0).shape == (0, 6, 2)


def test_cem_rolls_proposals_out_in_its_first_iteration_only():
    """Proposals take the places after the mean in the first fork; a proposal that the cost
    wants becomes the plan even where the random samples would not find it."""
    forks = []
    target = np.array([500.0, 10.0])

    async def rollouts(candidates: np.ndarray) -> np.ndarray:
        forks.append(candidates.copy())
        return candidates[:, :, None, None, :]

    def cost(frames: np.ndarray) -> float:
        return float(np.linalg.norm(frames[-1, 0, 0] - target))

    config = CEMConfig(horizon=4, samples=6, elites=2, iterations=2, knot_frames=2, init_std=5.0)
    proposals = np.array([[[500.0, 10.0], [500.0, 10.0]], [[20.0, 20.0], [30.0, 30.0]]])
    start = np.array([256.0, 256.0])
    plan = asyncio.run(cem(rollouts, cost, start, config, np.random.default_rng(0), proposals=proposals))
    np.testing.assert_allclose(forks[0][1:3], np.repeat(proposals, 2, axis=1))
    assert not any(np.allclose(c, np.repeat(proposals[1], 2, axis=0)) for c in forks[1])
    assert plan.cost == 0.0 and np.allclose(plan.actions, target)
    without = asyncio.run(cem(rollouts, cost, start, config, np.random.default_rng(0)))
    assert without.cost > 100.0
    for bad, message in ((np.zeros((6, 2, 2)), "no room"), (np.zeros((1, 3, 2)), r"\[P, 2, 2\]")):
        with pytest.raises(ValueError, match=message):
            asyncio.run(cem(rollouts, cost, start, config, np.random.default_rng(0), proposals=bad))


def test_eval_plan_refuses_more_proposals_than_samples_leave_room_for(capsys):
    from streamworld.cli import main

    assert main(["eval", "pusht", "--plan", "--simulator", "--samples", "4", "--proposals", "4"]) == 2
    assert "--proposals must be 0 to samples - 1 (3)" in capsys.readouterr().err
