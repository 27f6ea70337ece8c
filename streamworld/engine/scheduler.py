"""The scheduler: plain Python over metadata. It decides; it never computes.

Two decisions:

- `chunk_start_time`: when a stream may start its next chunk. Never earlier than
  `lookahead_chunks` chunk durations before the chunk's deadline (bounded lookahead: a
  stream does not run far ahead of its playback clock, which saves K/V and keeps
  action-to-frame latency low). `interactive` streams start as late as their deadline
  allows (deadline - estimated chunk latency - margin), so the newest actions make it in.
- `next_batch`: given the ready units of one executor, the most urgent one (priority class
  first, `interactive` > `standard` > `batch`, then earliest deadline) plus other ready
  units of the same stage and shape, most urgent first, within a token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from .units import WorkUnit


@dataclass(frozen=True)
class SchedulerConfig:
    lookahead_chunks: float = 2.0
    # Interactive chunks start this much earlier than the latency estimate says.
    jit_margin_s: float = 0.05
    jit_safety: float = 1.5
    max_batch_units: int = 16
    # Query tokens in one batch (the sum over its units).
    token_budget: int = 65536


@dataclass(frozen=True)
class ReadyUnit:
    unit: WorkUnit
    priority: int  # class rank, 0 = interactive
    deadline: float
    tokens: int
    shape: tuple  # units batch together only when this agrees (stage, chunk shape)

    def urgency(self) -> tuple:
        return (self.priority, self.deadline, self.unit.stream, self.unit.chunk, self.unit.phase)


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()

    def chunk_start_time(
        self, deadline: float, priority: int, chunk_duration: float, est_latency: float | None
    ) -> float:
        """Earliest time a chunk with this deadline may start."""
        earliest = deadline - self.config.lookahead_chunks * chunk_duration
        if priority == 0 and est_latency is not None:
            jit = deadline - self.config.jit_safety * est_latency - self.config.jit_margin_s
            earliest = max(earliest, jit)
        return earliest

    def next_batch(self, ready: list[ReadyUnit]) -> list[ReadyUnit]:
        if not ready:
            return []
        ordered = sorted(ready, key=ReadyUnit.urgency)
        head = ordered[0]
        batch, tokens = [head], head.tokens
        for r in ordered[1:]:
            if len(batch) >= self.config.max_batch_units:
                break
            if r.shape == head.shape and tokens + r.tokens <= self.config.token_budget:
                batch.append(r)
                tokens += r.tokens
        return batch
