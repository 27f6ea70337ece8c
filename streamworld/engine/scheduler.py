"""The scheduler: every decision of the engine, in plain Python over stream and chunk
metadata (stream.py). It decides; it never computes, and it holds no tensors.

- `next_admission`: streams are admitted first come, first served, head of line: a stream
  whose pages do not fit yet is not overtaken by smaller ones behind it.
- `start_chunks`: when a stream may start its next chunk. Not before the previous chunk
  has written the K/V the first unit reads; not while its playback clock is paused or a
  fork of it waits for the stream to be between chunks; with
  the `wait` action policy, not before the actions of all its frames are known; at most
  `num_steps` chunks of one stream at once (the noisy pipeline's depth); and never earlier
  than `lookahead_chunks` chunk durations before the chunk's deadline (bounded lookahead: a
  stream does not run far ahead of its playback clock, which saves K/V and keeps
  action-to-frame latency low). `interactive` streams start as late as their deadline
  allows (deadline - estimated chunk latency - margin), so the newest actions make it in.
  Unpaced streams (a fork's branches, by default) start as soon as the rest allows.
- `ready_units`: the next unit of every chunk whose context is written (kv_modes.py).
- `next_batch`: of one executor's ready units, the most urgent one (priority class first,
  `interactive` > `standard` > `batch`, then earliest deadline) plus other ready units of
  the same stage and shape, most urgent first, within a token budget. The shape includes
  the number of context frames the unit attends to: the runner reads the K/V of a batch
  of equal contexts in one gather and attends for all its units at once, and only such a
  batch can replay a CUDA graph. A batch of mixed contexts runs attention unit by unit,
  eagerly; on an H200 that made 8 planning episodes in one process slower than running
  them one after another (docs/benchmarks.md, "Planning several episodes at once on an
  H200"). Contexts differ only while a stream's window fills (its first chunks), so
  long-running streams still batch together.
- `next_decode_batch`: the most urgent chunk ready to decode, with others whose decoder
  states and shapes agree and whose class is the same (lower classes do not ride along
  and delay it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .config import SchedulerConfig
from .kv_modes import PREFILL_CHUNK, chunk_phases, context_dependency, context_frame_count, unit_index
from .stream import ChunkState, Stream, WorkUnit


@dataclass(frozen=True)
class ReadyUnit:
    unit: WorkUnit
    priority: int  # class rank, 0 = interactive
    deadline: float
    tokens: int
    shape: tuple  # units batch together only when this agrees (stage, frames, context frames)

    def urgency(self) -> tuple:
        return (self.priority, self.deadline, self.unit.stream, self.unit.chunk, self.unit.phase)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        num_stages: int = 1,
        num_steps: int = 1,
        num_ranks: int = 1,
        max_decode_batch: int = 8,
        stage_ranks: Sequence[int] | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.num_stages = num_stages
        self.num_steps = num_steps
        self.num_ranks = num_ranks
        # The rank that runs each stage (the placement's); by default stage g on g % ranks.
        self.stage_ranks = (
            list(stage_ranks) if stage_ranks is not None else [g % num_ranks for g in range(num_stages)]
        )
        if len(self.stage_ranks) != num_stages or not all(0 <= r < num_ranks for r in self.stage_ranks):
            raise ValueError(f"stage_ranks {self.stage_ranks} must give each of {num_stages} stages a rank")
        self.max_decode_batch = max_decode_batch

    # --- admission --------------------------------------------------------------------------
    def next_admission(self, waiting: list[Stream], fits: Callable[[Stream], bool]) -> Stream | None:
        """The waiting stream to admit now, if any (`fits`: its pages can be reserved)."""
        if waiting and fits(waiting[0]):
            return waiting[0]
        return None

    # --- starting chunks --------------------------------------------------------------------
    def chunk_start_time(
        self, deadline: float, priority: int, chunk_duration: float, est_latency: float | None
    ) -> float:
        """Earliest time a chunk with this deadline may start."""
        earliest = deadline - self.config.lookahead_chunks * chunk_duration
        if priority == 0 and est_latency is not None:
            jit = deadline - self.config.jit_safety * est_latency - self.config.jit_margin_s
            earliest = max(earliest, jit)
        return earliest

    def start_chunks(
        self, streams: Iterable[Stream], now: float, est_latency: float | None
    ) -> tuple[list[tuple[Stream, ChunkState]], float | None]:
        """Starts every chunk whose time has come; returns them and the next start time."""
        started: list[tuple[Stream, ChunkState]] = []
        next_time: float | None = None
        for stream in streams:
            if not stream.live or not stream.text_ready:
                continue
            if stream.prefill_pending:
                if not stream.image_ready:
                    continue
                started.append((stream, stream.start_prefill(now)))
            while self._may_start(stream):
                est = stream.est_latency if stream.est_latency is not None else est_latency
                start_at = (
                    self.chunk_start_time(
                        stream.deadline(stream.next_chunk), stream.priority, stream.chunk_duration, est
                    )
                    if stream.paced
                    else now
                )
                if now < start_at:
                    next_time = start_at if next_time is None else min(next_time, start_at)
                    break
                phases = chunk_phases(
                    stream.kv_mode, self.num_steps, read_later=not stream.starts_last_chunk()
                )
                started.append((stream, stream.start_chunk(phases, now)))
        return started, next_time

    def _may_start(self, stream: Stream) -> bool:
        """May the stream's next chunk start, its clock aside?"""
        if stream.paused_since is not None or not stream.wants_more() or stream.pending_fork is not None:
            return False
        if len(stream.chunks) > self.num_steps:  # in-flight cap
            return False
        first_phase = chunk_phases(stream.kv_mode, self.num_steps)[0]
        if not self.context_ready(stream, stream.next_chunk, first_phase, 0):
            return False
        waits = stream.config.action_dim and stream.request.action_policy == "wait"
        return not waits or stream.next_chunk_actions_known()

    def context_ready(self, stream: Stream, c: int, phase: int, stage: int) -> bool:
        """Has the previous chunk written the K/V this unit reads at this stage?"""
        if c == PREFILL_CHUNK:
            return True
        prev = c - 1
        if prev == PREFILL_CHUNK:
            if not stream.config.needs_image:
                return True
            if stream.prefill_pending:
                return False
            prev_state = stream.chunks.get(PREFILL_CHUNK)
            return prev_state is None or prev_state.progress > stage
        prev_state = stream.chunks.get(prev)
        if prev_state is None:
            return prev < stream.next_chunk  # finished and retired
        dep = context_dependency(stream.kv_mode, phase, self.num_steps)
        try:
            needed = unit_index(prev_state.phases, dep, stage, self.num_stages)
        except ValueError:  # a stream's last chunk commits nothing (`chunk_phases`)
            raise RuntimeError(
                f"stream {stream.id}: chunk {c} reads K/V that chunk {prev}, its last, never writes"
            ) from None
        return prev_state.progress > needed

    # --- DiT batches ------------------------------------------------------------------------
    def ready_units(self, streams: Iterable[Stream], rank: int) -> list[ReadyUnit]:
        """The next unit of every chunk that can run now on `rank` (the stages placed there)."""
        ready = []
        for stream in streams:
            if not stream.live:
                continue
            tokens = stream.config.tokens_per_frame
            for chunk in stream.chunks.values():
                if chunk.in_flight:
                    continue
                nxt = chunk.next_unit(self.num_stages)
                if nxt is None:
                    continue
                phase, stage = nxt
                if self.stage_ranks[stage] != rank or not self.context_ready(
                    stream, chunk.index, phase, stage
                ):
                    continue
                unit = WorkUnit(stream.id, chunk.index, phase, stage)
                deadline = stream.deadline(max(chunk.index, 0))
                shape = (stage, chunk.num_frames, context_frames(stream, chunk))
                ready.append(ReadyUnit(unit, stream.priority, deadline, chunk.num_frames * tokens, shape))
        return ready

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

    # --- decoding ---------------------------------------------------------------------------
    def next_decode_batch(self, streams: Iterable[Stream]) -> list[tuple[Stream, ChunkState]]:
        """Chunks to decode together (in order within a stream: only its next chunk)."""
        candidates = []
        for stream in streams:
            if not stream.live:
                continue
            chunk = stream.chunks.get(stream.next_decode)
            if chunk is not None and chunk.denoised and not chunk.decoding:
                candidates.append(
                    (stream.priority, stream.deadline(max(chunk.index, 0)), stream.id, stream, chunk)
                )
        if not candidates:
            return []
        candidates.sort(key=lambda c: c[:3])
        _, _, _, head, head_chunk = candidates[0]
        key = (head.priority, head.decoder_signature, head_chunk.num_frames)
        picked = [
            (stream, chunk)
            for prio, _, _, stream, chunk in candidates
            if (prio, stream.decoder_signature, chunk.num_frames) == key
        ]
        return picked[: self.max_decode_batch]


def context_frames(stream: Stream, chunk: ChunkState) -> int:
    """How many cached frames the chunk's units attend to (its page table's sink and window)."""
    table = stream.page_table
    assert table is not None, f"stream {stream.id} has chunks but no page table"
    return context_frame_count(chunk.first_frame, table.sink_frames, table.window_frames)


# --- replicas -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaLoad:
    """What the choice of a replica for a new stream looks at (replicas.py)."""

    index: int
    admits_now: bool  # it would admit the stream at once
    free_pages: int  # pages per stage not reserved
    waiting: int  # streams in its admission queue
    live_in_class: int  # its live streams of the new stream's priority class


def choose_replica(loads: Sequence[ReplicaLoad]) -> int:
    """The replica that can admit a new stream soonest: among those that admit it now, the
    one with the most free pages, then the fewest live streams of its class; if none can,
    the one with the shortest queue (then the fewest live streams of its class)."""
    now = [r for r in loads if r.admits_now]
    if now:
        return min(now, key=lambda r: (-r.free_pages, r.live_in_class, r.index)).index
    return min(loads, key=lambda r: (r.waiting, r.live_in_class, r.index)).index
