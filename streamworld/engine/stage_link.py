"""Moving what one DiT stage hands the next to the next stage's device.

A stage pipeline over several GPUs hands each unit's activation row (tokens and per-frame
conditioning, about 14 MB per 480x832 chunk in bf16) from one stage to the next. A
`StageLink` makes that copy on a side stream of the sending GPU, ordered after the stage's
kernels by the stream itself and before the receiving stage's kernels by a CUDA event: the
sending rank's thread does not wait for the copy, and the copy overlaps the sender's next
batch. The receiver waits for the event on its own stream (`receive`), never on the host.

Between stages on one device (virtual ranks time-sharing a GPU, or the CPU) nothing is
copied. Copies between devices of which one is not a GPU are plain blocking copies.

Each link counts the bytes it moved and the seconds its copies took (CUDA event timing, read
once the copies have run), for `streamworld bench`.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import torch


class StageLink:
    """The hand-off from the stage on `src` to the stage on `dst`."""

    def __init__(self, src: torch.device, dst: torch.device) -> None:
        self.src, self.dst = src, dst
        self.crosses = src != dst
        gpu = self.crosses and src.type == "cuda" and dst.type == "cuda"
        self.stream = torch.cuda.Stream(device=src) if gpu else None
        self.bytes = 0
        self._copy_s = 0.0
        self._pending: list[tuple[Any, Any]] = []  # (start, end) events not yet counted
        self._lock = threading.Lock()

    def send(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Starts copying `tensors` (made on the current stream of `src`) to `dst`; returns
        the copies and the CUDA event the receiver must wait for (None: usable at once)."""
        if not self.crosses:
            return tensors, None
        moved = sum(t.numel() * t.element_size() for t in tensors)
        if self.stream is None:
            start = time.perf_counter()
            out = [t.to(self.dst) for t in tensors]
            with self._lock:
                self.bytes += moved
                self._copy_s += time.perf_counter() - start
            return out, None
        self.stream.wait_stream(torch.cuda.current_stream(self.src))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record()
            out = [torch.empty_like(t, device=self.dst).copy_(t, non_blocking=True) for t in tensors]
            end.record()
        for t in tensors:  # the sender's memory is not reused before the copy has read it
            t.record_stream(self.stream)
        for t in out:  # nor the copies' (made on the receiving GPU) before the copy has written them
            t.record_stream(self.stream)
        with self._lock:
            self.bytes += moved
            self._pending.append((begin, end))
        self._count()
        return out, end

    @staticmethod
    def receive(tensors: list[torch.Tensor], event: Any) -> None:
        """*receiving rank* Orders the current stream after the copy of `tensors`, and keeps
        their memory from going back to the allocator while this stream may still read it."""
        if event is None:
            return
        stream = torch.cuda.current_stream(tensors[0].device)
        stream.wait_event(event)
        for t in tensors:
            t.record_stream(stream)

    @property
    def copy_s(self) -> float:
        """Seconds spent copying so far (copies still running are not counted yet)."""
        self._count()
        with self._lock:
            return self._copy_s

    def _count(self) -> None:
        """Adds the copies that have finished to `copy_s` (never waits)."""
        with self._lock:
            keep = []
            for begin, end in self._pending:
                if end.query():
                    self._copy_s += begin.elapsed_time(end) / 1000.0
                else:
                    keep.append((begin, end))
            self._pending = keep


def stage_links(devices: list[torch.device]) -> list[StageLink]:
    """One link per pair of consecutive stages."""
    return [StageLink(a, b) for a, b in itertools.pairwise(devices)]
