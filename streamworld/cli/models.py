"""`streamworld models`: the model presets, as a list or as the /v1/models JSON."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "models",
        help="list the model presets",
        description="List the model presets: frame size as height x width (as --frame-size takes it), "
        "frame rate, frames per chunk and inputs. `serve` serves pusht unless --model says otherwise.",
    )
    parser.add_argument("--json", action="store_true", help="print the /v1/models entries as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models import PRESETS

    entries = [c.describe() for c in PRESETS.values()]
    if args.json:
        print(json.dumps({"models": entries}, indent=2))
        return 0
    for e in entries:
        # height x width, as --frame-size takes it
        size = f"{e['height']}x{e['width']} (HxW) @ {e['fps']} fps, {e['frames_per_chunk']} frames/chunk"
        inputs = f"actions {e['action_dim']}, prompt {e['takes_prompt']}, image {e['needs_image']}"
        print(f"{e['id']:18} {size}, {inputs}: {e['description']}")
    return 0
