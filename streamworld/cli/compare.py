"""`streamworld compare`: two PushT evaluation reports, seed by seed (`pusht/compare.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import arguments
from .errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "compare",
        help="compare two PushT evaluation reports seed by seed, with paired tests",
        description=(
            "Compare the JSON reports of two `streamworld eval` runs on the same seeds: B against A. "
            "Planning reports (--plan): goals reached by both, by one only, the exact two-sided "
            "sign test over the episodes only one side reached, and the difference in success rate "
            "with its 95% bootstrap interval over the seeds. Prediction reports: per KV mode and "
            "report horizon, each side's mean over the seeds where both sides found the object (the "
            "others are counted by side, with the sign test of which side lost more), the mean "
            "difference B - A with its 95% bootstrap interval over the "
            "seeds, how many seeds each side did better on, and the sign test of that split. A side "
            "may be several reports of one evaluation (a run split over seed ranges): give them "
            "separated by commas, or as a quoted glob pattern."
        ),
        epilog=(
            "example: streamworld compare 'shipped-seeds*.json' 'round17-seeds*.json'. "
            "Seeds in only one side are left out and counted. Exit status 2 for reports that cannot "
            "be compared (different kinds, different goal steps, budget or frame size, a seed twice in "
            "one side, reports of one side that differ in what they evaluated, including their bound "
            "for a T: reports from before 2026-12-05 used 0.35, later ones 0.2). Across the two sides, "
            "T metrics measured with different bounds, and metrics one side's reports predate, are "
            "left out, and the output names them."
        ),
    )
    parser.add_argument(
        "a", metavar="A", help="the reports to compare against: a file, files a,b,c, or a glob"
    )
    parser.add_argument("b", metavar="B", help="the reports compared with A, given the same way")
    parser.add_argument(
        "--metric",
        action="append",
        dest="metrics",
        choices=("block_px", "block_t_shape", "block_deg", "psnr", "agent_px"),
        help="prediction metrics to print; repeat for several (default: block_px, block_t_shape, block_deg "
        "and psnr; --json always holds all). block_deg, the block's angle error where it is a T, is in "
        "reports since 2026-12-05; with an older report it is left out, and the output says so",
    )
    parser.add_argument(
        "--resamples",
        type=int,
        default=10_000,
        help="bootstrap resamples of the seeds for the intervals (default 10000, at most 100000)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the comparison as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..pusht.compare import CompareError, compare, format_comparison, load_side

    if not 100 <= args.resamples <= 100_000:
        raise UsageError("--resamples must be between 100 and 100000")
    arguments.check_output_folder("--json", args.json)
    try:
        a, b = load_side(args.a), load_side(args.b)
        result = compare(a, b, resamples=args.resamples)
    except CompareError as e:
        raise UsageError(str(e)) from None
    if args.metrics:
        print(format_comparison(result, tuple(dict.fromkeys(args.metrics))))
    else:
        print(format_comparison(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
