"""benchmarks/pusht_step_determinism.py: a fresh environment restarted from a world's state
holds exactly the part of it each condition keeps, and a short run scores every condition
(CPU)."""

from __future__ import annotations

import numpy as np

from streamworld.pusht.world import PushTWorld
from tests.conftest import load_script

det = load_script("benchmarks/pusht_step_determinism.py")


def _pushing_world() -> PushTWorld:
    """A world whose agent and block are both moving."""
    world = PushTWorld(det.SIZE)
    world.reset(3)
    for _ in range(30):
        world.advance(world.scene.block[:2])
        if np.hypot(*world.env.block.velocity) > 1 and np.hypot(*world.env.agent.velocity) > 1:
            return world
    raise AssertionError("the agent never pushed the block")


def test_a_restart_keeps_what_its_condition_keeps():
    world, fresh = _pushing_world(), PushTWorld(det.SIZE)
    env = world.env
    for condition, agent_moving, block_moving in (
        ("state", True, True),
        ("block at rest", True, False),
        ("at rest", False, False),
    ):
        det.restart(fresh, world, condition)
        f = fresh.env
        assert tuple(f.agent.position) == tuple(env.agent.position)
        assert (tuple(f.block.position), f.block.angle) == (tuple(env.block.position), env.block.angle)
        assert (tuple(f.agent.velocity) == tuple(env.agent.velocity)) == agent_moving
        assert (tuple(f.block.velocity) == tuple(env.block.velocity)) == block_moving
        assert (f.block.angular_velocity == env.block.angular_velocity) == block_moving
        if not block_moving:
            assert tuple(f.block.velocity) == (0.0, 0.0) and f.block.angular_velocity == 0.0
    world.close()
    fresh.close()


def test_a_short_run_scores_every_condition():
    report = det.measure(episodes=2, steps=40, seed=7)
    assert report["steps_scored"] > 0 and report["true_move_px_mean"] > 0
    for condition in det.CONDITIONS:
        row = report[condition]
        assert 0 <= row["block_px_median"] <= row["block_px_p90"]
        assert row["block_px_mean"] >= 0 and row["block_deg_mean"] >= 0
    # Leaving the agent's velocity out misplaces the block more than keeping it.
    assert report["at rest"]["block_px_mean"] > report["state"]["block_px_mean"]
