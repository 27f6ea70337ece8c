"""The `streamworld` parser and dispatch: each command module adds its own subparser.

Subcommands: `serve` (the streaming server), `config` (the deployment file, checked and
printed), `ray-serve` (replicas on Ray Serve), `generate` (the sequential reference
generator), `bench` (the engine against the sequential baseline), `train` and `eval` (the
embedded PushT world model), `compare` (two evaluation reports, seed by seed),
`distill-decoder` (the lite decoder) and `models` (the model presets).
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import bench, compare, config, distill_decoder, eval, generate, models, ray_serve, serve, train
from .deployment import given_dests
from .errors import UsageError

# In the order `streamworld --help` lists them.
COMMANDS = (serve, config, ray_serve, generate, bench, train, eval, compare, distill_decoder, models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamworld",
        description="Real-time serving of autoregressive video diffusion world models.",
    )
    parser.add_argument("--version", action="version", version=f"streamworld {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one command: 0 on success, 2 for a usage error (one line on stderr), 130 on Ctrl-C."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    command_parser = getattr(args, "command_parser", None)
    if command_parser is not None:  # flags that override a deployment file: those given
        args.given = given_dests(command_parser, argv[argv.index(args.command) + 1 :])
    try:
        return args.func(args)
    except UsageError as e:
        print(f"streamworld {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"streamworld {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
