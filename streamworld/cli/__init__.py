"""`streamworld` command line: one module per command, assembled by `main`.

| module | owns |
| --- | --- |
| `main` | the top-level parser, dispatch, exit codes |
| `arguments` | argument groups several commands share (model, weights, engine) and their checks |
| `loading` | the one way a command turns its arguments into a loaded model (or teacher VAE) |
| `serve`, `generate`, `bench`, `train`, `eval`, `distill_decoder`, `models` | one command each |

A command module's `add_parser` declares its subcommand and arguments; its `run` handles them.
"""

from .errors import UsageError
from .main import build_parser, main

__all__ = ["UsageError", "build_parser", "main"]
