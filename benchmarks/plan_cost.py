"""What the PushT planner's frame cost takes per plan: `--cost-frames last` against `best`.

A plan of the default search scores 48 candidates (3 forks of 16 branches) of 24 predicted
frames each. `last` reads each candidate's last frame with the locator; `best` reads all
24 and keeps the least cost. The candidates here are frames of the true environment under
random targets (the locator's work does not depend on where the frames come from). Median
of `--repeats` timings of one plan's worth of costs, with nothing else running.

By default the host scores them frame by frame with NumPy, as `eval pusht --plan` does on
a CPU; `--device cuda` scores each fork at once on the GPU, as it does on CUDA.

    python benchmarks/plan_cost.py --json plan_cost.json
    python benchmarks/plan_cost.py --device cuda --json plan_cost_cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from streamworld.pusht.planning import COST_FRAMES, frame_cost, make_task


def candidates(count: int, frames: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The goal frame of task `seed` and `count` candidates [count, frames, 64, 64, 3]."""
    task = make_task(seed, 64)
    world, _ = task.start(64)
    rng = np.random.default_rng(seed)
    try:
        rolled = np.stack([world.step(rng.uniform(50.0, 450.0, 2)) for _ in range(count + frames)])
    finally:
        world.close()
    return task.goal_frame, np.stack([rolled[i : i + frames] for i in range(count)])


def measure(count: int, frames: int, repeats: int, device: str | None = None, fork: int = 16) -> dict:
    """Per mode, the seconds one plan's costs take: frame by frame with NumPy on the host,
    or, with `device`, fork by fork (`fork` candidates at once) in PyTorch there."""
    goal, batch = candidates(count, frames, seed=0)
    rows = {}
    for mode in COST_FRAMES:
        cost = frame_cost(goal, frames=mode, device=device)
        cost.many(batch[:fork])  # untimed: the first call sets the device up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i in range(0, count, fork):
                cost.many(batch[i : i + fork])
            times.append(time.perf_counter() - start)
        rows[mode] = {"seconds_per_plan": statistics.median(times), "min": min(times), "max": max(times)}
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", type=int, default=48, help="candidates per plan (default 48: 3 x 16)")
    p.add_argument("--frames", type=int, default=24, help="predicted frames per candidate (default 24)")
    p.add_argument("--repeats", type=int, default=9, help="timed plans per mode (default 9)")
    p.add_argument(
        "--device",
        help="score each fork at once in PyTorch on this device (cuda, as `eval --plan` on a GPU "
        "does; cpu); default: frame by frame with NumPy on the host",
    )
    p.add_argument("--fork", type=int, default=16, help="candidates per fork with --device (default 16)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    if min(args.candidates, args.frames, args.repeats, args.fork) < 1:
        p.error("--candidates, --frames, --repeats and --fork must be at least 1")
    rows = measure(args.candidates, args.frames, args.repeats, args.device, args.fork)
    for mode, row in rows.items():
        ms = row["seconds_per_plan"] * 1e3
        print(f"--cost-frames {mode}: {ms:.1f} ms per plan (median of {args.repeats})")
    report = {
        "benchmark": "plan_cost",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "candidates": args.candidates,
        "frames": args.frames,
        "repeats": args.repeats,
        "cost_device": args.device or "host",
        "fork": args.fork if args.device else None,
        "modes": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
