"""How much of a PushT step does the state a model carries decide? The environment itself,
restarted each step from part of its own state, against the environment that went on.

A scene model predicts each 0.1-s step of the block from a state it carries. The
environment's own state is more than the scene: the agent is a kinematic body moved by PD
control, so its velocity is state, and the block, though fully damped, keeps the velocity
the last substep's contact gave it into the next step's first substep. This script records
episodes driven as `train pusht --candidate-share 1` drives them (the planner's kind of
actions), and at every step copies part of the true state into a fresh environment, steps
it with the same action and measures where its block lands against the true one:

- `state`: the scene and every velocity (what the `velocities` kind carries); what is left
  is the physics' own memory (its solver's cached contact impulses), which no state here
  holds;
- `block at rest`: the block's velocity and spin set to 0;
- `at rest`: the agent's velocity set to 0 too (the scene alone).

    python benchmarks/pusht_step_determinism.py --json step_determinism.json

About 30 seconds on a 2-core CPU with the defaults (20 episodes of 150 steps).
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from streamworld.pusht.data import DatasetSpec
from streamworld.pusht.world import WORLD_SIZE, PushTWorld, angle_error

SIZE = 64
CONDITIONS = ("state", "block at rest", "at rest")
MOVED = 0.1  # world units: a step whose block moved less is not scored


def restart(fresh: PushTWorld, world: PushTWorld, condition: str) -> None:
    """Put `fresh` (reset, so its solver remembers no contact of `world`'s) in `world`'s
    state, less what `condition` leaves out."""
    fresh.reset(0)
    src, dst = world.env, fresh.env
    dst.agent.position = src.agent.position
    dst.agent.velocity = src.agent.velocity if condition != "at rest" else (0.0, 0.0)
    dst.block.angle, dst.block.position = src.block.angle, src.block.position
    keep = condition == "state"
    dst.block.velocity = src.block.velocity if keep else (0.0, 0.0)
    dst.block.angular_velocity = src.block.angular_velocity if keep else 0.0


def measure(episodes: int, steps: int, seed: int) -> dict:
    """Per condition, the block's error one step later over the steps whose true block moved."""
    from tqdm import tqdm

    spec = DatasetSpec(episodes, steps, SIZE, seed, candidate_share=1.0)
    world, fresh = PushTWorld(SIZE), PushTWorld(SIZE)
    rows: dict[str, list[tuple[float, float]]] = {c: [] for c in CONDITIONS}
    moves = []
    for index in tqdm(range(episodes), desc="episodes", unit="episode"):
        world.reset(spec.episode_seed(index))
        policy = spec.policy(index)
        for _ in range(steps):
            action = policy(world.scene)
            before = np.array(world.scene.block)
            found = {}
            for condition in CONDITIONS:
                restart(fresh, world, condition)
                fresh.advance(action)
                found[condition] = fresh.scene.block
            world.advance(action)
            true = world.scene.block
            move = float(np.hypot(*(np.array(true[:2]) - before[:2])))
            if move < MOVED:
                continue
            moves.append(move)
            for condition, block in found.items():
                off = float(np.hypot(block[0] - true[0], block[1] - true[1]))
                rows[condition].append((off, angle_error(block[2], true[2])))
    world.close()
    fresh.close()
    px = SIZE / WORLD_SIZE
    out = {"steps_scored": len(moves), "true_move_px_mean": round(float(np.mean(moves)) * px, 4)}
    for condition, found in rows.items():
        a = np.array(found)
        out[condition] = {
            "block_px_mean": round(float(a[:, 0].mean()) * px, 4),
            "block_px_median": round(float(np.median(a[:, 0])) * px, 4),
            "block_px_p90": round(float(np.quantile(a[:, 0], 0.9)) * px, 4),
            "block_deg_mean": round(float(a[:, 1].mean()), 4),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=20, help="episodes to record (default 20)")
    parser.add_argument("--steps", type=int, default=150, help="steps per episode (default 150)")
    parser.add_argument("--data-seed", type=int, default=7, help="seed of the episodes (default 7)")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    if args.episodes < 1 or args.steps < 1:
        parser.error("--episodes and --steps must be at least 1")
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist")
    report = {
        "benchmark": "pusht_step_determinism",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform()},
        "episodes": args.episodes,
        "steps": args.steps,
        "data_seed": args.data_seed,
        **measure(args.episodes, args.steps, args.data_seed),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
