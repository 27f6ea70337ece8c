"""What the engine counts: batches, frames, deadlines, endings, time to first frame, and
(optionally) a trace of every unit it ran."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from .stream import WorkUnit


@dataclass
class TraceEvent:
    unit: WorkUnit
    rank: int
    batch: int  # batch sequence number
    start: float
    end: float


@dataclass
class EngineStats:
    batches: int = 0
    batch_sizes: Counter = field(default_factory=Counter)
    frames_generated: int = 0
    chunks_delivered: int = 0
    deadline_misses: int = 0
    finished: Counter = field(default_factory=Counter)  # reason -> streams
    ttff_s: deque = field(default_factory=lambda: deque(maxlen=1024))

    def record_batch(self, size: int) -> None:
        self.batches += 1
        self.batch_sizes[size] += 1

    def record_delivery(self, frames: int, missed: bool) -> None:
        self.chunks_delivered += 1
        self.frames_generated += frames
        self.deadline_misses += int(missed)


def ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average; the first value stands alone."""
    return new if old is None else (1 - weight) * old + weight * new
