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
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class _Worker:
    """One daemon thread that runs submitted callables in order. (A ThreadPoolExecutor's
    thread is joined at interpreter exit, so Ctrl-C would wait for the model work running.)"""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _loop(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                result = fn(*args)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(result)


_cpu_worker: _Worker | None = None
_cpu_lock = threading.Lock()


def cpu_worker() -> _Worker:
    """The process's one thread for PyTorch CPU work (created on first use)."""
    global _cpu_worker
    with _cpu_lock:
        if _cpu_worker is None:
            _cpu_worker = _Worker("streamworld-cpu")
        return _cpu_worker


def on_torch_thread(device: torch.device | str, fn: Callable[[], T]) -> T:
    """Runs `fn` where this process does its PyTorch work for `device` and returns its result:
    on a CPU the shared worker thread (waiting for it), elsewhere the calling thread."""
    worker = cpu_worker() if torch.device(device).type == "cpu" else None
    if worker is None or threading.current_thread() is worker.thread:
        return fn()
    fut = worker.submit(fn)
    while True:  # timed waits, so that Ctrl-C in the main thread is seen at once
        try:
            return fut.result(timeout=0.25)
        except concurrent.futures.TimeoutError:
            continue


def set_cpu_threads(threads: int) -> Future[None]:
    """Sets PyTorch's CPU thread count on the CPU worker, between two pieces of work; returns
    the queued change's future (callers on the event loop do not wait for it)."""
    return cpu_worker().submit(torch.set_num_threads, threads)


def resolve_overlap(asked: bool | None, device: torch.device, num_ranks: int) -> bool:
    """Whether DiT batches overlap (`EngineConfig.overlap_dispatch`): by default with one rank
    on a GPU, where one CUDA stream orders all DiT work; never with several ranks."""
    if asked is None:
        return device.type == "cuda" and num_ranks == 1
    if asked and num_ranks > 1:
        raise ValueError("overlapped dispatch needs one rank (one CUDA stream for all DiT work)")
    return asked


class Executor:
    """One virtual rank. With `overlap` (CUDA only), a run returns as soon as its kernels are
    queued and the previous run's kernels have finished, instead of waiting for its own: the
    caller then prepares and queues the next run while the GPU works, so the GPU does not sit
    idle while the host builds each batch. Whoever reads a run's results elsewhere (another
    CUDA stream, the host) must first wait for the CUDA event the run recorded."""

    def __init__(self, name: str, device: torch.device, overlap: bool = False) -> None:
        self.name = name
        self.device = device
        self._pool: _Worker | ThreadPoolExecutor
        if device.type == "cpu":
            self._pool = cpu_worker()
        else:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"streamworld-{name}")
        self._futures: set[Future] = set()  # submitted and not finished
        self.cuda_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        if self.cuda_stream is not None:
            # Pool streams are not ordered after the default stream: whatever the creating
            # thread has queued (a model still being initialised or cast) must come first.
            self.cuda_stream.wait_stream(torch.cuda.current_stream(device))
        self.overlap = overlap and self.cuda_stream is not None
        # The last overlapped run's end, and its callable: holding the callable keeps what it
        # captured (inputs made on other CUDA streams, such as prompt K/V) from going back to
        # the allocator while queued kernels may still read it.
        self._previous: tuple[torch.cuda.Event, Callable[[], Any]] | None = None
        self.busy = False
        self.busy_s = 0.0  # seconds spent running work
        # Ids of the threads that ran work (native and pthread), for profiles. A set, added
        # to on every run: a profile once found kernels launched from a thread whose ids the
        # first run had not recorded.
        self.thread_ids: set[int] = set()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Runs `fn` on this rank; the returned future completes on the calling loop."""
        self.busy = True
        fut = self._pool.submit(self._run, fn)
        self._futures.add(fut)
        fut.add_done_callback(self._futures.discard)
        return asyncio.wrap_future(fut)

    def _run(self, fn: Callable[[], T]) -> T:
        ident = threading.get_ident()
        # The profiler names a thread by its native id or by the low 32 bits of its pthread id.
        self.thread_ids.update((threading.get_native_id(), ident, ident & 0xFFFFFFFF))
        start = time.perf_counter()
        try:
            ctx = (
                torch.cuda.stream(self.cuda_stream)
                if self.cuda_stream is not None
                else contextlib.nullcontext()
            )
            with ctx, torch.inference_mode():
                out = fn()
                if self.overlap:
                    queued = torch.cuda.Event()
                    queued.record(self.cuda_stream)
                    previous, self._previous = self._previous, (queued, fn)
                    if previous is not None:
                        # At most one run queued ahead of the GPU. An asynchronous CUDA error
                        # of the previous run surfaces here, in this run.
                        previous[0].synchronize()
                elif self.cuda_stream is not None:
                    self.cuda_stream.synchronize()
            return out
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - start

    def done(self) -> None:
        self.busy = False

    def shutdown(self) -> None:
        """Returns once none of this executor's work is queued or running."""
        if isinstance(self._pool, ThreadPoolExecutor):
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._previous is not None:  # the last overlapped run's kernels
                self._previous[0].synchronize()
                self._previous = None
            return
        # The shared CPU thread lives on. Our queued work is not cancelled (its completion
        # callbacks expect a result or an error), but there is at most one batch per
        # executor, so waiting is short.
        concurrent.futures.wait(list(self._futures))
