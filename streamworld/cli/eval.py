"""`streamworld eval pusht`: the world model's rollouts against the real PushT environment."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import arguments, loading
from .errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval",
        help="evaluate the PushT world model against the real environment",
        description=(
            "Roll out the real PushT environment from each seed's initial state with the scripted "
            "controller, give the model the first frame and the same actions, and compare predicted with "
            "true frames per horizon: PSNR, SSIM and the agent's and block's position errors, against the "
            "copy-first-frame baseline. Prints a Markdown table; --json writes every horizon."
        ),
    )
    parser.add_argument("model", choices=("pusht",), help="the model to evaluate")
    parser.add_argument(
        "--seeds", default="0-99", help="environment seeds, e.g. 0-99 or 1,5,9 (default 0-99)"
    )
    parser.add_argument("--horizon", type=int, default=32, help="future frames compared (default 32)")
    parser.add_argument(
        "--kv-mode",
        action="append",
        dest="kv_modes",
        choices=arguments.KV_MODES,
        help="KV mode to evaluate; repeat for several (default: all three)",
    )
    parser.add_argument("--dit", metavar="PATH", help="weights to evaluate (default: the shipped ones)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models import get_preset
    from ..models.world_model import WeightPaths
    from ..pusht.evaluate import evaluate, markdown_table, parse_seeds

    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        raise UsageError(f"--seeds: {e}") from None
    if args.horizon < 1:
        raise UsageError("--horizon must be at least 1")
    arguments.check_output_folder("--json", args.json)
    if args.dit is not None and not Path(args.dit).exists():
        raise UsageError(f"--dit: {args.dit} does not exist")
    # WorldModel.load's own dtype, as eval has always used (eval has no --dtype).
    options = loading.LoadOptions(device=args.device, dtype="float32")
    model = loading.load_world_model(get_preset(args.model), WeightPaths(dit=args.dit), options)
    modes = list(dict.fromkeys(args.kv_modes or ["clean", "final", "noisy"]))
    report = evaluate(model, seeds, modes, horizon=args.horizon)
    print(markdown_table(report))
    print("generation frames/s (reference loop, this machine): " + json.dumps(report["generation_fps"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
