"""Where planning succeeds and fails: `eval pusht --plan` reports split by what each task asks.

A planning run's success rate is one number over tasks of very different difficulty: some
goals need the agent alone, some a long push, some a turn of the block. This script
replays each task's start and goal (`planning.make_task`, the same tasks every run of a
seed sees) and splits the reports' episodes by how far the block must move between start
and goal (world units) and by how far it must turn (degrees, for goals that move the
block). One or more sides, each given as `streamworld compare` takes them (a file, files
separated by commas, or a quoted glob), are tabulated side by side on the seeds all of
them share, so that a model and the true environment's ceiling (`--simulator`) can be
read bin by bin.

    python benchmarks/plan_breakdown.py 'model/plan-seeds*.json' 'simulator/plan-seeds*.json' \
        --names model,simulator --json breakdown.json

It costs no model: on a 2-core CPU about 5 s per 100 tasks. The tasks are rebuilt by
today's `make_task`; a report made when tasks were drawn differently would be binned by
the wrong tasks, and nothing in a report can tell.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# Run as a script, Python puts benchmarks/ on sys.path, not the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamworld.pusht.compare import CompareError, load_side
from streamworld.pusht.planning import make_task
from streamworld.pusht.world import angle_error

# Bins: the block's move from start to goal (world units), and its turn (degrees) for goals
# that move it at least STILL_UNITS.
STILL_UNITS = 1.0
MOVE_BINS = ((0.0, STILL_UNITS), (STILL_UNITS, 30.0), (30.0, 80.0), (80.0, 150.0), (150.0, math.inf))
TURN_BINS = ((0.0, 10.0), (10.0, 30.0), (30.0, 60.0), (60.0, 180.1))
SIZE = 64  # frames are drawn but not used: the demands are in world units


def task_demands(seed: int, goal_steps: int) -> tuple[float, float]:
    """(how far the block moves, degrees it turns) from the task's start to its goal."""
    task = make_task(seed, SIZE, goal_steps)
    world, _ = task.start(SIZE)
    start = world.scene
    world.close()
    return math.dist(start.block[:2], task.goal.block[:2]), angle_error(start.block[2], task.goal.block[2])


def _label(lo: float, hi: float, unit: str) -> str:
    return f">= {lo:g} {unit}" if math.isinf(hi) else f"{lo:g}-{hi:g} {unit}"


def breakdown(sides: dict[str, dict[int, bool]], demands: dict[int, tuple[float, float]]) -> list[dict]:
    """One row per bin: tasks in it, and each side's goals reached there."""
    rows = []
    for kind, bins, unit in (("block move", MOVE_BINS, "units"), ("block turn", TURN_BINS, "deg")):
        for lo, hi in bins:
            if kind == "block move":
                seeds = [s for s, (move, _) in demands.items() if lo <= move < hi]
                label = "block still" if hi == STILL_UNITS else _label(lo, hi, unit)
            else:
                seeds = [s for s, (move, turn) in demands.items() if move >= STILL_UNITS and lo <= turn < hi]
                label = _label(lo, min(hi, 180), unit)
            rows.append(
                {
                    "split": kind,
                    "bin": label,
                    "tasks": len(seeds),
                    "reached": {name: sum(outcome[s] for s in seeds) for name, outcome in sides.items()},
                }
            )
    return rows


def _share(reached: int, tasks: int) -> str:
    return f"{reached} ({reached / tasks:.0%})" if tasks else "-"


def markdown(rows: list[dict], names: list[str]) -> str:
    lines = [
        "| split | bin | tasks | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for row in rows:
        cells = [_share(row["reached"][n], row["tasks"]) for n in names]
        lines.append(f"| {row['split']} | {row['bin']} | {row['tasks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sides", nargs="+", help="planning reports per side: a file, files a,b,c, or a quoted glob"
    )
    parser.add_argument(
        "--names", help="names of the sides, separated by commas (default: side 1, side 2, ...)"
    )
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    names = args.names.split(",") if args.names else [f"side {i + 1}" for i in range(len(args.sides))]
    if len(names) != len(args.sides):
        parser.error(f"--names gives {len(names)} names for {len(args.sides)} sides")
    if len(set(names)) != len(names):
        parser.error("--names: each side needs its own name")
    try:
        loaded = [load_side(spec) for spec in args.sides]
    except CompareError as e:
        parser.error(str(e))
    if any(side.kind != "plan" for side in loaded):
        parser.error("every side must be `streamworld eval --plan` reports")
    tasks = {(s.settings["goal_steps"], s.settings["budget"]) for s in loaded}
    if len(tasks) != 1:
        parser.error(f"the sides evaluated different tasks (goal steps, budget): {sorted(tasks)}")
    seeds = sorted(set.intersection(*(set(side.by_seed) for side in loaded)))
    if not seeds:
        parser.error("the sides share no seed")
    goal_steps = loaded[0].settings["goal_steps"]
    demands = {seed: task_demands(seed, goal_steps) for seed in seeds}
    sides = {
        name: {seed: side.by_seed[seed]["success"] for seed in seeds}
        for name, side in zip(names, loaded, strict=True)
    }
    rows = breakdown(sides, demands)
    print(
        f"{len(seeds)} seeds shared by every side; goals reached: "
        + ", ".join(f"{n} {sum(o.values())}" for n, o in sides.items())
    )
    print(markdown(rows, names))
    if args.json:
        out = {"sides": dict(zip(names, args.sides, strict=True)), "seeds": len(seeds), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
