"""How fast the planner's rollouts go through the engine: branches per second per fork size.

The PushT planner rolls its candidates out as one fork of K branches of a stream started
from the observed frame (`streamworld.planning.EngineRollouts`), each branch H frames
(default 24: 6 chunks of 4). This times such forks through an in-process engine, as
`streamworld eval pusht --plan` runs them, for each K of `--branches`: the median of
`--repeats` forks after `--warmup` untimed ones, in seconds per fork, branches per second
and predicted frames per second.

On a CUDA device, `--profile` also records one more fork per K with the PyTorch profiler
and reports the GPU's busy share (the union of its kernels' intervals over the fork's wall
time) and the host functions that take the most time, so the figure can be read against
the GPU's own limit: a busy share well below 1 means the host, not the GPU, sets the pace.

    python benchmarks/plan_throughput.py --json plan_throughput.json
    python benchmarks/plan_throughput.py --model pusht-delta --steps 1000 --kv-mode clean  # as planned
    python benchmarks/plan_throughput.py --device cuda --cuda-graphs --branches 16,48,128 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone

import numpy as np
import torch

from streamworld.cli.errors import UsageError
from streamworld.cli.loading import parse_steps
from streamworld.engine import AsyncEngine
from streamworld.models import get_preset
from streamworld.models.world_model import WeightPaths, WorldModel
from streamworld.planning import EngineRollouts, planning_engine_config
from streamworld.pusht.planning import make_task


def busy_share(prof: torch.profiler.profile, wall_s: float) -> float:
    """The union of the GPU kernels' intervals over `wall_s`."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6 / wall_s  # microseconds


def host_top(prof: torch.profiler.profile, count: int) -> list[dict]:
    """The host operations with the most self time."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in rows]


async def _forks(engine: AsyncEngine, frame: np.ndarray, branches: int, horizon: int, args) -> dict:
    rng = np.random.default_rng(0)

    def candidates() -> np.ndarray:
        return rng.uniform(50.0, 450.0, (branches, horizon, 2)).astype(np.float32)

    rollouts = EngineRollouts(engine, frame, seed=0)
    try:
        for _ in range(args.warmup):
            await rollouts(candidates())
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            await rollouts(candidates())
            times.append(time.perf_counter() - start)
        fork_s = statistics.median(times)
        row = {
            "branches": branches,
            "fork_s": round(fork_s, 4),
            "min_s": round(min(times), 4),
            "max_s": round(max(times), 4),
            "branches_per_s": round(branches / fork_s, 1),
            "frames_per_s": round(branches * horizon / fork_s, 1),
        }
        if args.profile and engine.model.device.type == "cuda":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                start = time.perf_counter()
                await rollouts(candidates())
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
            row["profiled_fork_s"] = round(wall, 4)
            row["gpu_busy_share"] = round(busy_share(prof, wall), 3)
            row["host_top"] = host_top(prof, 12)
        return row
    finally:
        rollouts.close()


async def measure(model: WorldModel, args) -> list[dict]:
    task = make_task(0, model.config.height)
    world, frame = task.start(model.config.height)
    world.close()
    rows = []
    for branches in args.branches:
        async with AsyncEngine(model, planning_engine_config(branches, args.cuda_graphs)) as engine:
            row = await _forks(engine, frame, branches, args.horizon, args)
        print(
            f"{branches:4d} branches: {row['fork_s'] * 1e3:8.1f} ms per fork, "
            f"{row['branches_per_s']:7.1f} branches/s, {row['frames_per_s']:8.1f} frames/s"
            + (f", GPU busy {row['gpu_busy_share']:.0%}" if "gpu_busy_share" in row else "")
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 (as eval pusht) or bfloat16")
    p.add_argument("--cuda-graphs", action="store_true", help="replay the DiT from CUDA graphs")
    p.add_argument(
        "--model", default="pusht", choices=("pusht", "pusht-delta"), help="the model (default pusht)"
    )
    p.add_argument("--dit", help="PushT DiT weights (default: the model's shipped ones)")
    p.add_argument("--kv-mode", help="the streams' KV mode (default: the model's, final)")
    p.add_argument(
        "--steps", metavar="T,T,...", help="denoising timesteps, e.g. 1000 (default: the preset's)"
    )
    p.add_argument("--branches", default="16", help="fork sizes, comma-separated (default 16)")
    p.add_argument("--horizon", type=int, default=24, help="frames per branch (default 24)")
    p.add_argument("--repeats", type=int, default=5, help="timed forks per size (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed forks first (default 2)")
    p.add_argument("--profile", action="store_true", help="CUDA: profile one more fork per size")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    try:
        args.branches = [int(b) for b in args.branches.split(",")]
    except ValueError:
        p.error(f"--branches takes comma-separated integers, not {args.branches!r}")
    if min(*args.branches, args.horizon, args.repeats) < 1 or args.warmup < 0:
        p.error("--branches, --horizon and --repeats must be at least 1, --warmup at least 0")
    if args.cuda_graphs and not args.device.startswith("cuda"):
        p.error("--cuda-graphs needs a CUDA --device")
    config = get_preset(args.model)
    if args.kv_mode:
        config = replace(config, default_kv_mode=args.kv_mode)
    if args.steps:
        try:
            config = replace(config, denoising_steps=parse_steps(args.steps))
        except UsageError as e:
            p.error(str(e))
    model = WorldModel.load(config, WeightPaths(dit=args.dit), device=args.device, dtype=args.dtype)
    rows = asyncio.run(measure(model, args))
    report = {
        "benchmark": "plan_throughput",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "device": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "dtype": args.dtype,
        "cuda_graphs": args.cuda_graphs,
        "model": args.model,
        "weights": args.dit or "shipped",
        "kv_mode": model.config.default_kv_mode,
        "timesteps": list(model.config.denoising_steps),
        "horizon": args.horizon,
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
