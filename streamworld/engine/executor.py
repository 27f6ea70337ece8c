"""Executors: a virtual rank is one worker thread, plus its own CUDA stream on a GPU.

Work is submitted from the event loop and runs on the rank's thread; completion comes back
to the loop as an asyncio future (through `call_soon_threadsafe`), never by polling. On a GPU
each rank issues its kernels on its own CUDA stream and synchronises that stream before it
reports completion, so several ranks can time-share one GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class Executor:
    def __init__(self, name: str, device: torch.device, inline: bool = False) -> None:
        self.name = name
        self.device = device
        # Inline: work runs on the calling (event loop) thread at submit time. On CPUs this
        # keeps PyTorch's OpenMP work on the main thread, where it runs fastest.
        self.inline = inline
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"streamworld-{name}")
        self.cuda_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.busy = False
        self.busy_s = 0.0  # seconds spent running work
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Runs `fn` on this rank; the returned future completes on the calling loop."""
        self.busy = True
        if self.inline:
            fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            try:
                fut.set_result(self._run(fn))
            except StopIteration as e:  # futures cannot hold StopIteration
                fut.set_exception(RuntimeError(f"work raised StopIteration: {e!r}"))
            except BaseException as e:
                fut.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                if not isinstance(e, Exception):
                    raise
            return fut
        return asyncio.wrap_future(self._pool.submit(self._run, fn))

    def _run(self, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            ctx = (
                torch.cuda.stream(self.cuda_stream)
                if self.cuda_stream is not None
                else contextlib.nullcontext()
            )
            with ctx, torch.inference_mode():
                out = fn()
                if self.cuda_stream is not None:
                    self.cuda_stream.synchronize()
            return out
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - start

    def done(self) -> None:
        self.busy = False

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
