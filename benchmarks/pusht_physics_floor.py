"""How well could any model predict a pushed PushT block from what the first frame shows?
The true physics, started from the scene a 64-px frame shows, as a floor under the block
error that `streamworld eval pusht` reports.

`streamworld eval` rolls a model out free-running from an episode's first frame, under the
episode's actions, and scores the block's position against the true frames 1-32 frames
later (the locator's centroid, px). A model can only know the start as well as the frame
shows it: at 64 px the block's place is read to a fraction of a pixel and its angle to
about a degree (`pose.estimate_scene`), and pushing is sensitive to where the agent meets
the block. This script replaces the model by the environment itself, started from:

- `true`: the episode's exact start (a check: it must reproduce the true frames);
- `seen`: the scene `pose.estimate_scene` reads off the true first frame, at rest, as a
  model sees it;
- `jitter:PX,DEG`: the exact start with the block moved by PX pixels and turned by DEG
  degrees in a random direction (one draw per seed, from `--jitter-seed`): how fast a
  known error in the start grows.

It renders the frames that start gives under the episode's actions and scores them with
`streamworld eval`'s own metrics (`evaluate.block_scores`: the locator, the T fit) at 8, 16,
24 and 32 frames. If even the physics started from the seen scene misses by N px at 32
frames, no model of 64-px frames can be expected to beat about N px there.

    python benchmarks/pusht_physics_floor.py --seeds 0-99 --json physics_floor.json

About 2.5 minutes on a 2-core CPU for 100 seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from streamworld.pusht.evaluate import block_scores, block_summary, parse_seeds, record_eval_episode
from streamworld.pusht.pose import estimate_scene, simulate
from streamworld.pusht.world import WORLD_SIZE, PushTWorld, Scene

HORIZONS = (8, 16, 24, 32)
SIZE = 64  # the shipped models' frames
DEFAULT_STARTS = ("true", "seen", "jitter:0.25,1", "jitter:0.5,2", "jitter:1,4")


def parse_start(text: str) -> tuple[str, float, float]:
    """`true`, `seen` or `jitter:PX,DEG` as (kind, pixels, degrees)."""
    if text in ("true", "seen"):
        return text, 0.0, 0.0
    kind, sep, rest = text.partition(":")
    try:
        px, deg = (float(v) for v in rest.split(","))
    except ValueError:
        px = deg = math.nan
    if kind != "jitter" or not sep or not (px >= 0 and deg >= 0):
        raise argparse.ArgumentTypeError(f"a start is true, seen or jitter:PX,DEG (both >= 0), got {text!r}")
    return kind, px, deg


def start_name(text: str) -> str:
    """`text`, once `parse_start` accepts it (the report names each start as given)."""
    parse_start(text)
    return text


def start_scene(kind: str, px: float, deg: float, true: Scene, first_frame: np.ndarray, rng) -> Scene | None:
    """The scene a rollout starts from (None where the first frame shows no T to read)."""
    if kind == "true":
        return true
    if kind == "seen":
        return estimate_scene(first_frame)
    direction = rng.uniform(0.0, 2 * math.pi)
    shift = px * WORLD_SIZE / SIZE
    x, y, angle = true.block
    turn = math.radians(deg) * rng.choice((-1.0, 1.0))
    return Scene(true.agent, (x + shift * math.cos(direction), y + shift * math.sin(direction), angle + turn))


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    world = PushTWorld(SIZE)
    rows: dict[str, list] = {s: [] for s in args.starts}
    unread: dict[str, int] = {s: 0 for s in args.starts}
    started = time.perf_counter()
    for seed in tqdm(args.seeds, desc="physics floor", unit="seed"):
        ep = record_eval_episode(seed, max(HORIZONS), SIZE)
        world.reset(seed)
        true = world.scene
        rng = np.random.default_rng([args.jitter_seed, seed])
        for name in args.starts:
            scene = start_scene(*parse_start(name), true, ep.frames[0], rng)
            if scene is None:
                unread[name] += 1
                continue
            rows[name].append(block_scores(simulate(world, scene, scene, ep.actions), ep, HORIZONS))
    world.close()
    return {
        "benchmark": "pusht_physics_floor",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "seeds": [args.seeds[0], args.seeds[-1], len(args.seeds)],
        "frame_size": SIZE,
        "jitter_seed": args.jitter_seed,
        "seconds": round(time.perf_counter() - started, 1),
        "starts": {
            name: {
                "rollouts": len(rows[name]),
                "unread_first_frames": unread[name],
                "horizons": block_summary(rows[name], HORIZONS),
            }
            for name in args.starts
            if rows[name]
        },
    }


def table(report: dict) -> str:
    lines = [
        "| start | rollouts | "
        + " | ".join(f"block error h={h} (mean / median)" for h in HORIZONS)
        + " | angle error h=32 (median) |",
        "|---|---|" + "---|" * len(HORIZONS) + "---|",
    ]
    for name, r in report["starts"].items():
        at = [r["horizons"][str(h)] for h in HORIZONS]
        cells = [f"{_cell(a['block_px_mean'])} / {_cell(a['block_px_median'])} px" for a in at]
        deg = r["horizons"][str(HORIZONS[-1])]["block_deg_median"]
        lines.append(f"| `{name}` | {r['rollouts']} | " + " | ".join(cells) + f" | {_cell(deg)}° |")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seeds", type=parse_seeds, default=parse_seeds("0-99"), help="eval episode seeds (default 0-99)"
    )
    parser.add_argument(
        "--start",
        dest="starts",
        type=start_name,
        action="append",
        help="true, seen or jitter:PX,DEG, repeatable; default: " + "; ".join(DEFAULT_STARTS),
    )
    parser.add_argument("--jitter-seed", type=int, default=0, help="seed of the jitter's draws (default 0)")
    parser.add_argument("--json", type=Path, help="write the report here")
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    args.starts = args.starts or list(DEFAULT_STARTS)
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist")
    report = run(args)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
