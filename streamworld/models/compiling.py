"""torch.compile with a dynamic batch dimension only, as StreamWorld's hot paths use it.

Served batches vary in size and nothing else (a model's frame size and chunk length are
fixed when it loads), so every compiled function is compiled with static sizes except
dimension 0 of its batched inputs. With every size dynamic, the generated kernels divide by
runtime sizes for every element and cannot vectorise; on an H200 they gained nothing over
eager (docs/benchmarks.md). Batch size 1 is specialised by torch.compile, so a function
needs two variants per input geometry: one unit and a batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def configure() -> None:
    """Process-wide settings the compiled paths rely on (idempotent)."""
    # Without this, sizes that happen to be equal when a function is first compiled are
    # assumed equal forever after, and later batches recompile.
    torch.fx.experimental._config.use_duck_shape = False
    # Two to four variants per function and geometry; leave room for several geometries.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


class BatchCompiled:
    """`fn` compiled whole (fullgraph) with dimension 0 of every tensor argument of at least
    `min_ndim` dimensions dynamic, also inside list arguments; the rest (weights, tables) is
    compiled in.

    It compiles only while `warming()`: the owner calls it there with every variant it will
    need, before serving starts. Afterwards a call whose inputs no compiled variant accepts
    runs eagerly instead of compiling. Compiling while serving would stall a stream for
    seconds, and it is not thread-safe: while one executor thread traces, a compiled call
    on another fails ("using FX to symbolically trace a dynamo-optimized function").
    """

    _warming = 0  # process-wide: compiled functions are shared by the models of a process

    def __init__(
        self, fn: Callable[..., Any], *, min_ndim: int, options: dict[str, Any] | None = None
    ) -> None:
        configure()
        self.min_ndim = min_ndim
        # `options`: torch.compile's backend options (inductor settings) for this function.
        self._compiling = torch.compile(fn, dynamic=False, fullgraph=True, options=options)
        self._run_only = torch._dynamo.run(fn)  # the compiled variants, or eager

    def __call__(self, *args: Any) -> Any:
        for a in args:
            for t in a if isinstance(a, list | tuple) else (a,):
                if isinstance(t, torch.Tensor) and t.ndim >= self.min_ndim:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return (self._compiling if BatchCompiled._warming else self._run_only)(*args)


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """Compiled functions called in this block compile the variants they lack. Only for
    loading, while no executor runs."""
    BatchCompiled._warming += 1
    try:
        yield
    finally:
        BatchCompiled._warming -= 1
