"""`streamworld bench`: N streams through the engine against the sequential baseline
(the measurement itself lives in `streamworld.bench`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from . import arguments, loading
from .errors import UsageError

if TYPE_CHECKING:
    from ..bench import BenchConfig
    from ..engine import Placement


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="N concurrent streams through the engine vs. the sequential baseline",
        description=(
            "Run N streams through the engine for a fixed time, then the same streams one after another "
            "through the sequential reference loop (the naive baseline) in the same process. Prints "
            "aggregate and per-stream frames/s, time to first frame, inter-chunk p50/p99, deadline "
            "attainment, the batch-size histogram, executor idle share and the engine/baseline ratio."
        ),
    )
    arguments.add_model_arguments(parser)
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams (default 4)")
    parser.add_argument(
        "--duration",
        type=float,
        default=20.0,
        help="seconds of engine run (default 20); a window that has seen no chunk by then runs on "
        "until the first one arrives (2 minutes more at most)",
    )
    parser.add_argument("--kv-mode", choices=arguments.KV_MODES, help="KV mode (default: the model's)")
    parser.add_argument(
        "--priority",
        choices=("interactive", "standard", "batch"),
        default="standard",
        help="priority class of every stream (default standard)",
    )
    parser.add_argument(
        "--prompt",
        default="a walk through a forest",
        help="text prompt of every stream (models that take one)",
    )
    parser.add_argument(
        "--unpaced",
        action="store_true",
        help="no playback clocks: every stream runs as fast as it can (throughput)",
    )
    arguments.add_engine_arguments(parser)
    _add_baseline_arguments(parser)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="CUDA only: run the measured window under the PyTorch profiler and report GPU kernel "
        "time per executor (DiT, decode, encode), GPU idle share and the costliest kernels "
        "(the profiler slows the run: quote throughput from a run without it)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full result as JSON")
    parser.set_defaults(func=run)


def _add_baseline_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sequential baseline")
    group.add_argument(
        "--baseline-kv-mode",
        choices=arguments.KV_MODES,
        help="KV mode of the sequential baseline (default: same as --kv-mode)",
    )
    group.add_argument("--no-baseline", action="store_true", help="skip the sequential baseline")
    group.add_argument(
        "--baseline-repeats",
        type=int,
        default=1,
        metavar="N",
        help="run the sequential baseline N times and take the median for the ratio (default 1); "
        "it runs one unit at a time, so it is host-bound and varies more between runs than the engine",
    )


def bench_config(args: argparse.Namespace, placement: Placement | None = None) -> BenchConfig:
    from ..bench import BenchConfig

    return BenchConfig(
        placement=placement,
        streams=args.streams,
        duration_s=args.duration,
        kv_mode=args.kv_mode,
        baseline_kv_mode=args.baseline_kv_mode,
        priority=args.priority,
        prompt=args.prompt,
        paced=not args.unpaced,
        engine=arguments.engine_config(args),
        baseline=not args.no_baseline,
        baseline_repeats=args.baseline_repeats,
        profile=args.profile,
    )


def run(args: argparse.Namespace) -> int:
    from ..bench import format_report, run_bench, write_json

    if args.streams < 1 or args.duration <= 0:
        raise UsageError("--streams must be at least 1 and --duration positive")
    if args.baseline_repeats < 1:
        raise UsageError("--baseline-repeats must be at least 1")
    arguments.check_engine_arguments(args)
    arguments.check_output_folder("--json", args.json)
    config = loading.preset(args)
    placed = loading.placement(args, loading.model_depth(config, args))  # checked before any weights load
    if args.devices or args.placement:
        loading.apply_threads(args)
        loading.check_weight_paths(args)
        models = loading.load_placed(
            config, loading.weight_paths(args), loading.LoadOptions.from_args(args), placed
        )
    else:
        models = [loading.load_model(args)]
        placed = None
    if args.profile and models[0].device.type != "cuda":
        raise UsageError("--profile reads GPU kernel times and needs a CUDA device (--device cuda)")
    result = run_bench(models, bench_config(args, placed))
    print(format_report(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
