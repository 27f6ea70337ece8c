"""`streamworld config`: the effective deployment configuration of a file and flags.

    streamworld config --print --config deploy/cpu-pusht.yaml --port 9000

takes every `serve` flag, applies them over the file as `serve` does, validates the result
(placements and devices included) and prints it as a deployment file, token redacted.
Without --print it only checks.
"""

from __future__ import annotations

import argparse

from . import serve


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "config",
        # Flags are matched whole: a deployment file's overrides are found by name.
        allow_abbrev=False,
        help="check a deployment file (with flags applied) and print the effective configuration",
        description=(
            "Validates what `streamworld serve` would run with the same arguments (--config FILE and "
            "any serve flag) without loading a model, and with --print writes it out as YAML: a "
            "complete deployment file (the token is shown as <set>). Exits 2 naming the bad key."
        ),
    )
    parser.add_argument("--print", action="store_true", help="print the effective configuration as YAML")
    parser.add_argument(
        "--devices-here",
        action="store_true",
        help="also check that this machine has the devices the file names (serve always does)",
    )
    serve.add_serve_arguments(parser)
    parser.set_defaults(func=run, command_parser=parser)


def run(args: argparse.Namespace) -> int:
    config = serve.serve_config(args, devices_here=args.devices_here)
    if args.print:
        print(config.deploy.to_yaml(), end="")
    else:
        source = args.config or "the flags"
        print(f"{source}: valid ({', '.join(config.model_ids)} on {config.host}:{config.port})")
    return 0
