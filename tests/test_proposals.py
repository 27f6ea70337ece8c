"""Push proposals (`streamworld.pusht.proposals`) and how the planner takes them (CPU)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from streamworld.planning import CEMConfig, cem
from streamworld.pusht.planning import SimulatorRollouts, make_task, run_episode
from streamworld.pusht.pose import block_distance
from streamworld.pusht.proposals import (
    AGENT_RADIUS,
    CLEARANCE,
    PushProposals,
    block_middle,
    check_count,
    push_path,
)
from streamworld.pusht.world import Scene

UPRIGHT = (256.0, 200.0, 0.0)  # a T standing upright, bar on top; its middle is about (256, 241)
RIGHT = Scene((300.0, 300.0), (406.0, 200.0, 0.0))  # the goal: the same T 150 units to the right


def _legs_clear(block, path) -> float:
    """The least distance from the block over the straight legs of `path`."""
    t = np.linspace(0.0, 1.0, 200)[:, None]
    return min(block_distance(block, a + t * (b - a)).min() for a, b in itertools.pairwise(path))


@pytest.mark.parametrize("agent", [(420.0, 250.0), (420.0, 230.0), (330.0, 330.0), (300.0, 150.0)])
def test_the_way_behind_the_block_never_touches_it(agent):
    """From the goal's side (above, level with or below the middle) the agent goes round the
    block, and every leg up to the point behind it stays clear of the T."""
    now = Scene(agent, UPRIGHT)
    path = push_path(now, RIGHT)
    assert len(path) == 6  # a detour of two points, behind, middle, through, the agent's goal
    assert _legs_clear(UPRIGHT, [np.array(agent), *path[:-3]]) > AGENT_RADIUS - 1.0


def test_a_push_starts_just_behind_first_contact_and_moves_the_middle_as_far_as_the_goal():
    now = Scene((100.0, 250.0), UPRIGHT)  # behind already: no detour
    start = block_middle(UPRIGHT)
    behind, middle, through, agent = push_path(now, RIGHT)
    direction = np.array([1.0, 0.0])
    contact = behind + direction * CLEARANCE  # where the agent first touches the block
    assert block_distance(UPRIGHT, contact) == pytest.approx(AGENT_RADIUS, abs=1.0)
    assert behind[1] == pytest.approx(start[1]) and through[1] == pytest.approx(start[1])
    # The agent walks on past contact by exactly the distance the middle must move.
    assert through[0] - contact[0] == pytest.approx(block_middle(RIGHT.block)[0] - start[0])
    assert middle == pytest.approx((behind + through) / 2) and agent == pytest.approx(RIGHT.agent)


def test_variants_turn_the_push_or_shift_it_across_and_a_line_that_misses_gives_none():
    now = Scene((100.0, 250.0), UPRIGHT)
    behind, _, through, _ = push_path(now, RIGHT, turn=0.35)
    heading = np.arctan2(*(through - behind)[::-1])
    assert heading == pytest.approx(0.35, abs=1e-6)  # the whole push is turned, not just its end
    shifted = push_path(now, RIGHT, offset=20.0)
    assert shifted[0][1] == pytest.approx(block_middle(UPRIGHT)[1] + 20.0)
    assert push_path(now, RIGHT, offset=150.0) is None  # wider than the block: no contact
    # A block whose middle is in place needs the agent alone.
    assert np.allclose(push_path(now, Scene(RIGHT.agent, UPRIGHT)), [RIGHT.agent])


def test_proposals_carry_blocks_toward_their_goals_in_the_true_environment():
    """On the tasks of seeds 100-119 whose block must move, read from the frames alone: the
    first proposal, run in the real environment, brings the block's middle nearer its goal
    on most tasks, and the best of three at least halves the distance on most."""
    nearer = halved = pushes = 0
    for seed in range(100, 120):
        task = make_task(seed, 64)
        world, frame = task.start(64)
        goal = block_middle(task.goal.block)
        before = np.linalg.norm(block_middle(world.scene.block) - goal)
        if before < 25:
            world.close()
            continue
        pushes += 1
        after = []
        for proposal in PushProposals(task.goal_frame, 3)(frame, knots=6):
            twin = world.replica()
            for action in np.repeat(proposal, 4, axis=0):
                twin.step(action)
            after.append(np.linalg.norm(block_middle(twin.scene.block) - goal))
            twin.close()
        world.close()
        nearer += bool(after) and after[0] < before
        halved += bool(after) and min(after) < before / 2
    assert pushes >= 12
    assert nearer >= 0.75 * pushes and halved >= 0.5 * pushes, (pushes, nearer, halved)


def test_frames_that_cannot_be_read_give_no_proposal():
    task = make_task(100, 64)
    blank = np.full_like(task.goal_frame, 255)
    assert PushProposals(task.goal_frame, 4)(blank, 6).shape == (0, 6, 2)
    assert PushProposals(blank, 4)(task.goal_frame, 6).shape == (0, 6, 2)
    assert PushProposals(task.goal_frame, 0)(task.goal_frame, 6).shape == (0, 6, 2)


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


async def test_an_episode_rolls_its_proposals_out_beside_the_random_candidates():
    """run_episode(proposals=2): the first plan's fork holds, after the mean, the true
    futures of the proposals laid out from the start frame (here rolled out in the true
    environment)."""
    task = make_task(103, 64)
    config = CEMConfig(horizon=24, samples=6, elites=2, iterations=1, knot_frames=4)
    result = await run_episode(
        lambda frame, world: SimulatorRollouts(world), task, config, 64, budget=1, record=True, proposals=2
    )
    world, frame = task.start(64)
    proposals = PushProposals(task.goal_frame, 2)(frame, knots=6)
    assert len(proposals) == 2
    fork = result.recorded_plans[0].candidates
    for k, proposal in enumerate(proposals, start=1):
        twin = world.replica()
        expected = [twin.step(a) for a in np.repeat(proposal.astype(np.float32), 4, axis=0)]
        twin.close()
        assert np.array_equal(fork[k], np.stack(expected))
    world.close()


def test_the_count_of_proposals_is_checked_against_the_variants_and_the_samples(capsys):
    check_count(7, 16)
    check_count(0, 2)
    for count, samples in ((8, 16), (4, 4), (-1, 16)):
        with pytest.raises(ValueError, match="--proposals must be 0 to"):
            check_count(count, samples)
    from streamworld.cli import main

    assert main(["eval", "pusht", "--plan", "--simulator", "--samples", "4", "--proposals", "4"]) == 2
    assert "--proposals must be 0 to 3" in capsys.readouterr().err
