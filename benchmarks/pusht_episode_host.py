"""The host's share of a PushT planning episode: the true environment, not the model.

An episode of `eval pusht --plan` builds its task (the scripted recording up to the goal),
replays it to the start, and executes each plan's actions in the real environment. On a
GPU, where a plan takes about 0.3 s, this host work is a large part of an episode's wall
time. Drawing a 512x512 frame and averaging it down takes most of a step, and only a few
of the frames are ever looked at (the goal, each plan's observation), so the episode draws
only those (`PushTWorld.advance`). This times the three parts per episode, and one step
with and without drawing, on one core.

    python benchmarks/pusht_episode_host.py --episodes 30 --json host.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

# Run as a script, Python puts benchmarks/ on sys.path, not the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(episodes: int, steps: int) -> dict:
    from streamworld.pusht.planning import EpisodeResult, _execute, make_task
    from streamworld.pusht.world import PushTWorld

    t0 = time.perf_counter()
    tasks = [make_task(seed, 64) for seed in range(episodes)]
    t1 = time.perf_counter()
    starts = [task.start(64) for task in tasks]
    t2 = time.perf_counter()
    actions = np.random.default_rng(0).uniform(150.0, 350.0, (steps, 2))
    for task, (world, frame) in zip(tasks, starts, strict=True):
        result = EpisodeResult(task.seed, False, 0, 0, frames=[])
        _execute(world, frame, actions, task, result, False, None, 0.0)
    t3 = time.perf_counter()
    for world, _ in starts:
        world.close()

    world = PushTWorld(64)
    world.reset(0)
    ms = 1e3
    t4 = time.perf_counter()
    for a in actions:
        world.step(a)
    t5 = time.perf_counter()
    undrawn = {}
    if hasattr(world, "advance"):  # not before it existed: the script also times older commits
        for a in actions:
            world.advance(a)
        undrawn["step_undrawn_ms"] = (time.perf_counter() - t5) / steps * ms
    world.close()
    return {
        "make_task_ms": (t1 - t0) / episodes * ms,
        "start_ms": (t2 - t1) / episodes * ms,
        f"execute_{steps}_steps_ms": (t3 - t2) / episodes * ms,
        "step_drawn_ms": (t5 - t4) / steps * ms,
        **undrawn,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=30, help="tasks built and started (default 30)")
    parser.add_argument("--steps", type=int, default=24, help="steps run per episode (default 24: a plan)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements, median reported (default 3)")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    args = parser.parse_args()
    if args.episodes < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--episodes, --steps and --repeats must be at least 1")
    warnings.filterwarnings("ignore", message="pkg_resources")
    from offline_generation import commit  # this folder is on sys.path when run as a script

    runs = [measure(args.episodes, args.steps) for _ in range(args.repeats)]
    median = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
    result = {
        "date": datetime.now(timezone.utc).date().isoformat(),
        "machine": f"{platform.machine()} CPU, one Python thread",
        "commit": commit(),
        "episodes": args.episodes,
        "steps": args.steps,
        "median": median,
        "runs": runs,
    }
    for k, v in median.items():
        print(f"{k}: {v:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
