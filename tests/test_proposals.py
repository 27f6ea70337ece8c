"""Push proposals (`streamworld.pusht.proposals`) and how the planner takes them (CPU)."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from streamworld.planning import CEMConfig, cem
from streamworld.pusht.planning import SimulatorRollouts, make_task, run_episode
from streamworld.pusht.pose import block_distance, estimate_scene
from streamworld.pusht.proposals import (
    AGENT_RADIUS,
    CLEARANCE,
    ENDS,
    VARIANTS,
    CandidatePolicy,
    PushProposals,
    _clear,
    _knots,
    _via,
    angle_to,
    block_middle,
    check_count,
    push_path,
    turn_path,
    turned_in_place,
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


@pytest.mark.slow
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
    check_count(10, 16)
    check_count(0, 2)
    for count, samples in ((11, 16), (4, 4), (-1, 16)):
        with pytest.raises(ValueError, match="--proposals must be 0 to"):
            check_count(count, samples)
    from streamworld.cli import main

    assert main(["eval", "pusht", "--plan", "--simulator", "--samples", "4", "--proposals", "4"]) == 2
    assert "--proposals must be 0 to 3" in capsys.readouterr().err


def test_a_turn_pushes_an_end_of_the_t_across_its_lever_the_way_the_goal_is_turned():
    """+30 degrees by the stem's tip: from beside the tip, the push runs across the line
    from the middle to the tip, in the sense that turns the body by +30 degrees, for about
    the arc the tip must travel; -30 degrees pushes the other way. A block within 10
    degrees of its goal's angle gets no turn."""
    goal = Scene((300.0, 400.0), (256.0, 200.0, np.radians(30.0)))
    now = Scene((100.0, 420.0), UPRIGHT)
    assert angle_to(now, goal) == pytest.approx(np.radians(30.0))
    tip = np.array(UPRIGHT[:2]) + np.array(ENDS[2])  # upright: body and world axes agree
    lever = tip - block_middle(UPRIGHT)
    behind, through, agent = turn_path(now, goal, end=2)[-3:]
    push = through - behind
    assert abs(push @ lever) < 1e-6 * np.linalg.norm(push) * np.linalg.norm(lever)  # across the lever
    # The tip's velocity under a small positive turn (body to world R(a)) is (-lever_y, lever_x).
    assert push @ np.array([-lever[1], lever[0]]) > 0
    arc = np.linalg.norm(lever) * np.radians(30.0)
    assert np.linalg.norm(push) == pytest.approx(arc + CLEARANCE, abs=2.0)
    assert block_distance(UPRIGHT, behind + push / np.linalg.norm(push) * CLEARANCE) == pytest.approx(
        AGENT_RADIUS, abs=1.0
    )
    assert agent == pytest.approx(goal.agent)
    back = turn_path(now, Scene(goal.agent, (256.0, 200.0, np.radians(-30.0))), end=2)
    assert (back[-2] - back[-3]) @ push < 0
    assert turn_path(now, Scene(goal.agent, (256.0, 200.0, np.radians(8.0))), end=2) is None


def test_a_way_that_would_cross_the_block_goes_round_it_by_one_clear_waypoint():
    a, b = np.array([100.0, 241.0]), np.array([420.0, 241.0])  # straight through the T's middle
    (waypoint,) = _via(UPRIGHT, a, b)
    assert _legs_clear(UPRIGHT, [a, waypoint, b]) > AGENT_RADIUS - 1.0
    assert _via(UPRIGHT, a, np.array([100.0, 400.0])) == []  # already clear: no waypoint


def test_a_block_near_its_goal_but_turned_gets_turns_first_and_a_far_one_pushes_first():
    proposals = PushProposals(np.zeros((64, 64, 3), np.uint8), 0)
    proposals.goal = Scene((300.0, 400.0), (262.0, 205.0, np.radians(40.0)))
    now = Scene((100.0, 420.0), UPRIGHT)
    near = list(proposals.paths(now))
    assert all(np.allclose(p, turn_path(now, proposals.goal, e)) for e, p in enumerate(near[:3]))
    assert np.allclose(near[3], push_path(now, proposals.goal))
    proposals.goal = Scene((300.0, 400.0), (406.0, 200.0, np.radians(40.0)))
    far = list(proposals.paths(now))
    assert np.allclose(far[0], push_path(now, proposals.goal))
    assert np.allclose(far[-1], turn_path(now, proposals.goal, 2))


def test_a_still_but_turned_block_gets_the_agents_goal_place_and_the_turns_and_no_more_than_asked():
    """Pushes of a block whose middle is in place all come to the agent's goal place alone:
    one proposal of them, after the three turns; `count` cuts the distinct paths."""
    proposals = PushProposals(np.zeros((64, 64, 3), np.uint8), 0)
    proposals.goal = Scene((300.0, 400.0), turned_in_place(UPRIGHT, np.radians(40.0)))
    now = Scene((100.0, 420.0), UPRIGHT)
    for count, expected in ((10, 4), (4, 4), (2, 2)):
        proposals.count = count
        laid = proposals.laid(now, knots=6)
        assert laid.shape == (expected, 6, 2)
    proposals.count = 10
    laid = proposals.laid(now, knots=6)
    for end in range(3):
        np.testing.assert_allclose(
            laid[end], np.clip(_knots(turn_path(now, proposals.goal, end), 6), 0, 512), atol=1e-3
        )
    np.testing.assert_allclose(laid[3], np.repeat([proposals.goal.agent], 6, axis=0))  # held on every knot


def test_after_a_turn_the_way_to_the_agents_goal_place_avoids_the_block_where_the_turn_leaves_it():
    """The legs after the push (the one leg that meets the block) go round the block turned
    in place (its middle kept, the goal's angle), not round the goal's block far away; only
    the first steps away from the push's end, where the agent is against it, may touch."""
    now = Scene((100.0, 420.0), UPRIGHT)
    turned = turned_in_place(UPRIGHT, np.radians(40.0))
    np.testing.assert_allclose(block_middle(turned), block_middle(UPRIGHT))
    detours = 0
    for agent_goal in ((256.0, 100.0), (256.0, 380.0), (120.0, 240.0), (390.0, 240.0)):
        goal = Scene(agent_goal, (406.0, 200.0, np.radians(40.0)))
        for end in range(len(ENDS)):
            path = [np.array(now.agent), *turn_path(now, goal, end)]
            push = next(
                j for j in range(len(path) - 1) if _legs_clear(UPRIGHT, path[j : j + 2]) < AGENT_RADIUS - 1
            )
            # Clear of it, but for the first steps away from the push's end, against the block.
            assert _clear(turned, path[push + 1], path[push + 2], leaving=CLEARANCE)
            assert len(path) == push + 3 or _legs_clear(turned, path[push + 2 :]) > AGENT_RADIUS - 1.0
            detours += len(path) - push - 2 > 1  # a waypoint between the push's end and the goal place
    assert detours >= 2


@pytest.mark.slow
def test_turns_bring_blocks_nearer_their_goals_angle_in_the_true_environment():
    """On the tasks of seeds 100-129 whose block starts turned 15 degrees or more from its
    goal, read from the frames alone: the best of the three turns, run in the real
    environment, takes at least 5 degrees off the angle to the goal on nearly all."""
    turned = better = 0
    for seed in range(100, 130):
        task = make_task(seed, 64)
        world, frame = task.start(64)
        now, goal = estimate_scene(frame), estimate_scene(task.goal_frame)
        before = abs(np.degrees(angle_to(now, goal)))
        if before < 15.0:
            world.close()
            continue
        turned += 1
        after = []
        for end in range(len(ENDS)):
            path = turn_path(now, goal, end)
            if path is None:
                continue
            twin = world.replica()
            for action in np.repeat(_knots(path, 6), 4, axis=0):
                twin.step(action.astype(np.float32))
            after.append(abs(np.degrees(angle_to(twin.scene, goal))))
            twin.close()
        world.close()
        better += bool(after) and min(after) < before - 5.0
    assert turned >= 12
    assert better >= 0.9 * turned, (turned, better)


def test_proposals_toward_a_known_goal_scene_are_those_read_from_its_frame():
    task = make_task(101, 64)
    world, frame = task.start(64)
    now = estimate_scene(frame)
    read = PushProposals(task.goal_frame, 5)
    known = PushProposals.toward(estimate_scene(task.goal_frame), 5)
    np.testing.assert_array_equal(known.laid(now, 6), read(frame, 6))
    assert len(known.laid(now, 6)) == 5
    world.close()


def _episode(policy, seed: int, steps: int) -> np.ndarray:
    from streamworld.pusht.world import PushTWorld

    world = PushTWorld(64)
    world.reset(seed)
    actions = []
    for _ in range(steps):
        actions.append(policy(world.scene))
        world.advance(actions[-1])
    world.close()
    return np.array(actions)


def test_candidate_policy_holds_each_knot_and_repeats_itself_by_seed():
    actions = _episode(CandidatePolicy(3), 7, 48)
    assert actions.shape == (48, 2) and actions.min() >= 0 and actions.max() <= 512
    knots = actions.reshape(12, 4, 2)  # two candidates of 6 knots held 4 steps each
    assert np.all(knots == knots[:, :1])
    assert not np.all(knots[1:] == knots[:-1])  # the knots do move
    np.testing.assert_array_equal(_episode(CandidatePolicy(3), 7, 48), actions)
    assert not np.array_equal(_episode(CandidatePolicy(4), 7, 48), actions)


def test_candidates_follow_a_proposal_or_wander_around_the_agent(monkeypatch):
    now, goal = Scene((100.0, 400.0), UPRIGHT), RIGHT
    laid = PushProposals.toward(goal, len(VARIANTS) + len(ENDS)).laid(now, 6)
    monkeypatch.setattr(CandidatePolicy, "PROPOSAL_SPREADS", (0.0,))
    proposing = CandidatePolicy(0, proposal_share=1.0)
    for _ in range(10):
        knots = proposing.candidate(now, goal)[::4]
        assert any(np.array_equal(knots, path) for path in laid)
    wandering = CandidatePolicy(0, proposal_share=0.0)
    knots = np.stack([wandering.candidate(now, goal)[::4] for _ in range(400)])
    assert not any(np.array_equal(k, path) for k in knots for path in laid)
    np.testing.assert_allclose(knots.mean((0, 1)), now.agent, atol=20)
    assert 50 < knots[:, 0].std(0).mean() < 90  # about init_std, less what the walls clip
    drawn = CandidatePolicy(0, proposal_share=1.0).goal_like_tasks(now)
    moved = np.linalg.norm(np.subtract(drawn.block[:2], now.block[:2]))
    assert moved <= CandidatePolicy.GOAL_MOVE and drawn.block != now.block
