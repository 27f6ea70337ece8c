"""Executors: a virtual rank is one worker thread, plus its own CUDA stream on a GPU.

Work is submitted from the event loop and runs on the rank's thread; completion comes back
to the loop as an asyncio future (through `call_soon_threadsafe`), never by polling. On a GPU
each rank issues its kernels on its own CUDA stream and synchronises that stream before it
reports completion, so several ranks can time-share one GPU.

On a CPU every executor shares one process-wide thread, `cpu_worker()`, and the process
should do all its PyTorch CPU work there (`on_torch_thread`), model loading included.
PyTorch's CPU build uses GNU OpenMP, and every thread that runs a parallel operator owns a
team of OpenMP threads. Once the process has more OpenMP threads than cores (a second
team is enough), libgomp cuts its spin-waiting from about 3 ms to almost nothing, so every
operator pays for its threads to sleep and wake: measured on 2 cores, the PushT reference
loop runs at 42 frames/s on one thread and at 19 once a second thread has run an operator
(docs/benchmarks.md). One thread for all CPU work keeps one team.
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

_cpu_pool: ThreadPoolExecutor | None = None
_cpu_thread: threading.Thread | None = None
_cpu_lock = threading.Lock()


def cpu_worker() -> ThreadPoolExecutor:
    """The process's one thread for PyTorch CPU work (created on first use, never shut down)."""
    global _cpu_pool
    with _cpu_lock:
        if _cpu_pool is None:
            _cpu_pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="streamworld-cpu", initializer=_note_cpu_thread
            )
        return _cpu_pool


def _note_cpu_thread() -> None:
    global _cpu_thread
    _cpu_thread = threading.current_thread()


def on_torch_thread(device: torch.device | str, fn: Callable[[], T]) -> T:
    """Runs `fn` where this process does its PyTorch work for `device` and returns its result:
    on a CPU the shared worker thread (waiting for it), elsewhere the calling thread."""
    if torch.device(device).type != "cpu" or threading.current_thread() is _cpu_thread:
        return fn()
    return cpu_worker().submit(fn).result()


class Executor:
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        if device.type == "cpu":
            self._pool, self._owns_pool = cpu_worker(), False
        else:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"streamworld-{name}")
            self._owns_pool = True
        self.cuda_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.busy = False
        self.busy_s = 0.0  # seconds spent running work
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Runs `fn` on this rank; the returned future completes on the calling loop."""
        self.busy = True
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
        if self._owns_pool:
            self._pool.shutdown(wait=True, cancel_futures=True)
