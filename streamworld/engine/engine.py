"""AsyncEngine: the glue between streams, the scheduler, the K/V pool and the executors.

One asyncio task (the busy loop) owns all bookkeeping. Each turn it starts the chunks whose
time has come, asks the scheduler for a batch for every idle executor, hands batches to the
executors, and sleeps until a completion (an asyncio future resolved from the executor
thread) or the next chunk start time wakes it. Tensor work only ever runs on executors:

    prep executor     prompt encoding, first-image encoding (off the DiT path)
    rank executors    DiT stages; stage g runs on rank g % num_ranks
    decode executor   VAE decoding with each stream's causal decoder state

Frames of each stream come out of `StreamHandle` (an async iterator) as soon as they are
decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..models.actions import gather_latent_actions, latent_action_window
from ..models.causal_wan import ChunkInput, StageActivation
from ..models.kv import commit_kv_access, num_kv_versions, prefill_kv_access, step_kv_access
from ..models.transfer import to_device
from ..models.vae import image_from_uint8, to_uint8
from ..models.world_model import WorldModel
from .executor import Executor
from .kv_pool import KVPagePool, PagedKVView, PageTable, Stage, pages_needed, split_stages
from .reference import validate_request
from .scheduler import ReadyUnit, Scheduler, SchedulerConfig
from .stream import (
    ACTION_POLICIES,
    PRIORITY_CLASSES,
    ActionTrack,
    ChunkOutput,
    ChunkState,
    Stream,
    StreamRequest,
    actions_needed,
    chunk_duration_s,
)
from .units import COMMIT, PREFILL, PREFILL_CHUNK, WorkUnit, chunk_phases, context_dependency, unit_index

log = logging.getLogger("streamworld.engine")


class Overloaded(RuntimeError):
    """The admission queue is full."""


class Unsupported(ValueError):
    """The request can never be served here (e.g. its K/V never fits the pool)."""


class StreamError(RuntimeError):
    """The stream ended with an error."""


@dataclass(frozen=True)
class EngineConfig:
    num_stages: int = 1
    num_ranks: int = 1
    # Pages per stage; by default room for `max_streams` streams in their worst case, capped
    # on a GPU at `kv_memory_fraction` of the memory free when the engine starts.
    kv_pages: int | None = None
    max_streams: int = 8
    kv_memory_fraction: float = 0.6
    max_queue: int = 16
    ttff_budget_s: float = 1.0
    # Most chunks (of different streams) decoded in one VAE batch.
    max_decode_batch: int = 8
    # Actions may be queued at most this many video frames ahead of generation.
    max_actions_ahead: int = 4096
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trace: bool = False
    # Queue the next DiT batch while the GPU still runs the current one (executor.py). None:
    # on with one rank on a GPU (one CUDA stream orders all DiT work, so freed K/V pages
    # and in-flight latents need no other synchronisation), off otherwise. With it, the
    # model's outputs are checked for non-finite values when their chunk is decoded
    # instead of after every batch (that check waits for the GPU).
    overlap_dispatch: bool | None = None
    # Tests: called on the executor for every unit before it runs; raising fails the unit.
    fault_hook: Callable[[WorkUnit], None] | None = None


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


@dataclass
class _Work:
    """One unit of a launched batch, with what the executor needs."""

    unit: WorkUnit
    stream: Stream
    chunk: ChunkState
    view: PagedKVView
    writes: tuple[int, ...]


@dataclass
class _Result:
    ok: bool
    error: str | None = None
    x_t: Any = None
    x0: Any = None
    activation: Any = None
    ready: Any = None  # overlapped dispatch: the batch's CUDA completion event


class StreamHandle:
    """What a caller holds for one stream: an async iterator of decoded chunks."""

    def __init__(self, engine: AsyncEngine, stream: Stream) -> None:
        self._engine = engine
        self.stream = stream
        self._admitted = asyncio.Event()
        if stream.status != "waiting":
            self._admitted.set()

    @property
    def id(self) -> int:
        return self.stream.id

    @property
    def queue_position(self) -> int:
        """1-based position in the admission queue; 0 once admitted."""
        return self._engine.queue_position(self.stream.id)

    @property
    def status(self) -> str:
        """waiting, running, completed, cancelled or error."""
        return self.stream.status

    @property
    def live(self) -> bool:
        return self.stream.live

    @property
    def error(self) -> str | None:
        """Why the stream failed (status `error`), else None."""
        return self.stream.error

    @property
    def actions_known(self) -> int:
        """Video frames whose actions are known (the next appended action's frame)."""
        return self.stream.actions.known

    def set_paused(self, paused: bool) -> None:
        """Pauses or resumes the stream's playback clock (backpressure)."""
        self._engine.set_paused(self.id, paused)

    async def admitted(self) -> None:
        """Returns once the stream holds its pages (or has ended without them)."""
        await self._admitted.wait()

    def push_actions(self, actions: np.ndarray, frame: int | None = None) -> None:
        self._engine.push_actions(self.id, actions, frame)

    def set_prompt(self, prompt: str) -> None:
        self._engine.set_prompt(self.id, prompt)

    def cancel(self) -> None:
        self._engine.cancel(self.id)

    def stop(self) -> None:
        self._engine.stop(self.id)

    def __aiter__(self) -> StreamHandle:
        return self

    async def __anext__(self) -> ChunkOutput:
        item = await self.stream.output.get()
        if item is None:
            self.stream.output.put_nowait(None)  # later calls end too
            if self.stream.status == "error":
                raise StreamError(self.stream.error or "stream failed")
            raise StopAsyncIteration
        return item


class AsyncEngine:
    def __init__(self, model: WorldModel, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        cfg = model.config
        self.stages: list[Stage] = split_stages(cfg.num_layers, self.config.num_stages)
        self.num_steps = model.schedule.num_steps
        pages = self.config.kv_pages if self.config.kv_pages is not None else self._default_pages()
        self.pool = KVPagePool(
            self.stages,
            pages,
            cfg.tokens_per_frame,
            model.dit.heads,
            model.dit.head_dim,
            model.dtype,
            model.device,
        )
        self.scheduler = Scheduler(self.config.scheduler)
        overlap = self.config.overlap_dispatch
        if overlap is None:
            overlap = model.device.type == "cuda" and self.config.num_ranks == 1
        elif overlap and self.config.num_ranks > 1:
            raise ValueError("overlapped dispatch needs one rank (one CUDA stream for all DiT work)")
        self.overlap = overlap
        # On a CPU all three share the process's one PyTorch thread (executor.py says why).
        self.ranks = [
            Executor(f"rank{r}", model.device, overlap=overlap) for r in range(self.config.num_ranks)
        ]
        self.decoder = Executor("decode", model.device)
        self.prep = Executor("prep", model.device)
        self.streams: dict[int, Stream] = {}
        self.waiting: deque[int] = deque()
        self.stats = EngineStats()
        self.trace: list[TraceEvent] = []
        self.est_latency: float | None = None
        self._handles: dict[int, StreamHandle] = {}
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.started_at = time.monotonic()

    def _default_pages(self) -> int:
        cfg, model = self.model.config, self.model
        worst = pages_needed(self.num_steps, cfg.sink_frames, cfg.window_frames, cfg.latent_frames_per_chunk)
        pages = worst * self.config.max_streams
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            # Memory PyTorch's allocator holds but does not use is free for the pool too
            # (an engine closed earlier in this process leaves its pool there).
            free += torch.cuda.memory_reserved(model.device) - torch.cuda.memory_allocated(model.device)
            element = torch.empty((), dtype=model.dtype).element_size()
            # A page in every stage: K and V of one frame for all blocks.
            page_bytes = 2 * cfg.num_layers * cfg.tokens_per_frame * model.dit.dim * element
            pages = min(pages, int(self.config.kv_memory_fraction * free) // page_bytes)
        return max(pages, 1)

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="streamworld-engine")

    async def close(self) -> None:
        """Cancels every stream and stops the executors."""
        self._closed = True  # from here on nothing is admitted
        for sid in list(self.waiting) + list(self.streams):
            self.cancel(sid)
        if self._task is not None:
            self._poke()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for ex in (*self.ranks, self.decoder, self.prep):
            await asyncio.to_thread(ex.shutdown)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- public API ---------------------------------------------------------------------
    def open_stream(self, request: StreamRequest) -> StreamHandle:
        """Validates and admits a stream, or queues it; raises Overloaded if the queue is full."""
        if self._task is None or self._closed:
            raise RuntimeError("the engine is not running: call `await engine.start()` first")
        cfg = self.model.config
        request = dataclasses.replace(request)  # ours: stop() changes num_chunks
        gen_view = _as_generation_request(request)
        kv_mode = validate_request(self.model, gen_view)
        if request.priority not in PRIORITY_CLASSES:
            raise ValueError(f"priority must be one of {list(PRIORITY_CLASSES)}")
        if request.action_policy not in ACTION_POLICIES:
            raise ValueError(f"action_policy must be one of {list(ACTION_POLICIES)}")
        need = self._pages_for(kv_mode)
        if need > self.pool.pages_per_stage:
            raise Unsupported(
                f"a {kv_mode} stream needs {need} pages per stage; the pool has {self.pool.pages_per_stage}"
            )
        must_wait = bool(self.waiting) or not self.pool.can_reserve(need)
        if must_wait and len(self.waiting) >= self.config.max_queue:
            raise Overloaded("the server is at capacity and its admission queue is full")
        now = time.monotonic()
        stream = Stream(
            id=next(self._ids),
            request=request,
            config=cfg,
            kv_mode=kv_mode,
            priority=PRIORITY_CLASSES[request.priority],
            created_at=now,
            chunk_duration=chunk_duration_s(cfg),
            ttff_budget=self.config.ttff_budget_s,
            actions=ActionTrack(cfg.action_dim),
            output=asyncio.Queue(),
            prompt=request.prompt,
        )
        if request.actions is not None and cfg.action_dim:
            stream.actions.push(request.actions)
        self.streams[stream.id] = stream
        handle = StreamHandle(self, stream)
        self._handles[stream.id] = handle
        if self.pool.can_reserve(need) and not self.waiting:
            self._admit(stream)
        else:
            self.waiting.append(stream.id)
        self._poke()
        return handle

    def queue_position(self, stream_id: int) -> int:
        try:
            return self.waiting.index(stream_id) + 1
        except ValueError:
            return 0

    def push_actions(self, stream_id: int, actions: np.ndarray, frame: int | None = None) -> None:
        stream = self._get(stream_id)
        cfg = self.model.config
        arr = np.asarray(actions, dtype=np.float32)
        if cfg.action_dim == 0:
            raise ValueError(f"model {cfg.id} takes no actions")
        if arr.ndim != 2 or arr.shape[1] != cfg.action_dim or not np.isfinite(arr).all():
            raise ValueError(f"actions must be a list of finite vectors of length {cfg.action_dim}")
        if frame is not None and frame < 0:
            raise ValueError("frame must be >= 0")
        # The queue of future actions is bounded: a bad `frame` cannot make it huge.
        start = stream.actions.known if frame is None else frame
        horizon = stream.actions.base + self.config.max_actions_ahead
        if start + len(arr) > horizon:
            raise ValueError(
                f"actions may reach at most {self.config.max_actions_ahead} frames past the oldest frame "
                f"still to be generated (frame {stream.actions.base}); "
                f"these reach frame {start + len(arr) - 1}"
            )
        stream.actions.push(arr, frame)
        self._poke()

    def set_prompt(self, stream_id: int, prompt: str) -> None:
        stream = self._get(stream_id)
        if not self.model.config.takes_prompt:
            raise ValueError(f"model {self.model.config.id} takes no prompt")
        stream.prompt = prompt
        if stream.live:
            self._encode_prompt(stream)

    def set_paused(self, stream_id: int, paused: bool) -> None:
        """Pauses (or resumes) the stream's playback clock: no new chunk starts while paused.

        Chunks already started finish. The server pauses a stream whose client reads too
        slowly; deadlines move by the time spent paused.
        """
        stream = self._get(stream_id)
        if not stream.live:
            return
        now = time.monotonic()
        if paused and stream.paused_since is None:
            stream.paused_since = now
        elif not paused and stream.paused_since is not None:
            stream.paused_s += now - stream.paused_since
            stream.paused_since = None
            self._poke()

    def stop(self, stream_id: int) -> None:
        """Finishes the chunks already started, then ends the stream as completed."""
        stream = self._get(stream_id)
        if stream.status == "waiting":
            self.cancel(stream_id, reason="stopped")
            return
        # Chunks that have not run a unit yet are dropped; those begun finish. (A chunk starts
        # only after its predecessor has begun, so the begun chunks are a prefix.)
        begun = [c for c, ch in stream.chunks.items() if c >= 0 and (ch.progress > 0 or ch.in_flight)]
        keep = max(begun) + 1 if begun else stream.delivered
        for c in [c for c in stream.chunks if c >= keep]:
            del stream.chunks[c]
        stream.next_chunk = min(stream.next_chunk, keep)
        stream.request.num_chunks = keep
        stream.stopping = True
        self._maybe_complete(stream)
        self._poke()

    def cancel(self, stream_id: int, reason: str = "cancelled") -> None:
        """Drops the stream's queued work and frees its pages and decoder state at once."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.status in ("completed", "cancelled", "error"):
            return
        self._end(stream, "cancelled", reason)

    @property
    def pages_used(self) -> int:
        return self.pool.pages_used

    def live_streams(self) -> int:
        return sum(1 for s in self.streams.values() if s.live)

    # --- admission ----------------------------------------------------------------------
    def _pages_for(self, kv_mode: str) -> int:
        cfg = self.model.config
        versions = num_kv_versions(kv_mode, self.num_steps)
        return pages_needed(versions, cfg.sink_frames, cfg.window_frames, cfg.latent_frames_per_chunk)

    def _admit(self, stream: Stream) -> None:
        need = self._pages_for(stream.kv_mode)
        self.pool.reserve(need)
        cfg = self.model.config
        stream.page_table = PageTable(
            self.pool,
            num_kv_versions(stream.kv_mode, self.num_steps),
            cfg.sink_frames,
            cfg.window_frames,
            need,
        )
        stream.decoder = self.model.vae.new_decoder_state()
        stream.status = "running"
        stream.started_at = time.monotonic()
        if stream.request.image is not None:
            stream.prefill_pending = True
            stream.next_decode = PREFILL_CHUNK
            self._encode_image(stream)
        self._encode_prompt(stream)
        self._handles[stream.id]._admitted.set()

    def _admit_waiting(self) -> None:
        while self.waiting and not self._closed:
            stream = self.streams[self.waiting[0]]
            if not self.pool.can_reserve(self._pages_for(stream.kv_mode)):
                return
            self.waiting.popleft()
            self._admit(stream)

    def _encode_prompt(self, stream: Stream) -> None:
        """Encodes the stream's current prompt; at most one encoding per stream in flight."""
        stream.text = None
        if stream.prompt_encoding:
            return  # the callback below picks up the newest prompt
        stream.prompt_encoding = True
        prompt = stream.prompt
        fut = self.prep.submit(lambda: self.model.text_context(prompt))

        def done(f: asyncio.Future) -> None:
            self.prep.done()
            stream.prompt_encoding = False
            if not stream.live:
                return
            if f.exception() is not None:
                self._end(stream, "error", "error", f"prompt encoding failed: {f.exception()}")
            elif stream.prompt == prompt:
                stream.text = f.result()
            else:
                self._encode_prompt(stream)
            self._poke()

        fut.add_done_callback(done)

    def _encode_image(self, stream: Stream) -> None:
        model = self.model
        image = stream.request.image

        def encode() -> torch.Tensor:
            pixels = image_from_uint8(image).to(model.device, model.dtype)
            return model.vae.encode_image(pixels)[0].float()

        fut = self.prep.submit(encode)

        def done(f: asyncio.Future) -> None:
            self.prep.done()
            if not stream.live:
                return
            if f.exception() is not None:
                self._end(stream, "error", "error", f"first-frame encoding failed: {f.exception()}")
                return
            stream.image_latent = f.result()
            self._poke()

        fut.add_done_callback(done)

    # --- the busy loop ------------------------------------------------------------------
    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while not self._closed:
            self._wake.clear()
            now = time.monotonic()
            next_time = None
            try:
                next_time = self._start_chunks(now)
                for rank, ex in enumerate(self.ranks):
                    if not ex.busy:
                        self._launch(rank, self.scheduler.next_batch(self._ready_units(rank)))
                self._launch_decode()
            except Exception:  # a bug or an allocation failure: fail loudly, keep serving
                log.exception("engine loop failed; ending the live streams")
                for stream in [s for s in self.streams.values() if s.live]:
                    self._end(stream, "error", "error", "internal engine error (see the server log)")
            timeout = None if next_time is None else max(0.0, next_time - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _start_chunks(self, now: float) -> float | None:
        """Creates chunk states whose start conditions hold; returns the next start time."""
        next_time: float | None = None
        cfg = self.model.config
        for stream in self.streams.values():
            if not stream.live or stream.text is None:
                continue
            if stream.prefill_pending:
                latent = stream.image_latent
                if latent is None:
                    continue
                chunk = ChunkState(PREFILL_CHUNK, 0, 1, [PREFILL], stream.text, eligible_at=now)
                chunk.x0 = latent
                chunk.denoised = True
                if cfg.action_dim:  # latent frame 0 is conditioned by no action
                    chunk.latent_actions = gather_latent_actions(
                        torch.zeros(0, cfg.action_dim), 0, 1, cfg.temporal_ratio
                    )
                stream.chunks[PREFILL_CHUNK] = chunk
                stream.prefill_pending = False
            while (
                stream.paused_since is None and stream.wants_more() and len(stream.chunks) <= self.num_steps
            ):
                c = stream.next_chunk
                phases = chunk_phases(stream.kv_mode, self.num_steps)
                if not self._context_ready(stream, c, phases[0], 0):
                    break
                first = stream.chunk_first_frame(c)
                f = cfg.latent_frames_per_chunk
                needed = actions_needed(first, f, cfg.temporal_ratio)
                if (
                    cfg.action_dim
                    and stream.request.action_policy == "wait"
                    and stream.actions.known < needed
                ):
                    break
                est = stream.est_latency if stream.est_latency is not None else self.est_latency
                start_at = self.scheduler.chunk_start_time(
                    stream.deadline(c), stream.priority, stream.chunk_duration, est
                )
                if now < start_at:
                    next_time = start_at if next_time is None else min(next_time, start_at)
                    break
                latent_actions = None
                if cfg.action_dim:
                    start = latent_action_window(first, cfg.temporal_ratio)[0]
                    window = torch.from_numpy(stream.actions.hold(start, needed))
                    latent_actions = gather_latent_actions(window, first, f, cfg.temporal_ratio, offset=start)
                    stream.actions.forget_before(latent_action_window(first + f, cfg.temporal_ratio)[0])
                stream.chunks[c] = ChunkState(
                    c, first, f, phases, stream.text, latent_actions, eligible_at=now
                )
                stream.next_chunk += 1
        return next_time

    def _context_ready(self, stream: Stream, c: int, phase: int, stage: int) -> bool:
        """Has the previous chunk written the K/V this unit reads at this stage?"""
        if c == PREFILL_CHUNK:
            return True
        prev = c - 1
        if prev == PREFILL_CHUNK:
            if not self.model.config.needs_image:
                return True
            if stream.prefill_pending:
                return False
            prev_state = stream.chunks.get(PREFILL_CHUNK)
            return prev_state is None or prev_state.progress > stage
        prev_state = stream.chunks.get(prev)
        if prev_state is None:
            return prev < stream.next_chunk  # finished and retired
        dep = context_dependency(stream.kv_mode, phase, self.num_steps)
        return prev_state.progress > unit_index(prev_state.phases, dep, stage, len(self.stages))

    def _ready_units(self, rank: int) -> list[ReadyUnit]:
        ready = []
        num_stages = len(self.stages)
        tokens = self.model.config.tokens_per_frame
        for stream in self.streams.values():
            if not stream.live:
                continue
            for chunk in stream.chunks.values():
                if chunk.in_flight:
                    continue
                nxt = chunk.next_unit(num_stages)
                if nxt is None:
                    continue
                phase, stage = nxt
                if stage % len(self.ranks) != rank or not self._context_ready(
                    stream, chunk.index, phase, stage
                ):
                    continue
                unit = WorkUnit(stream.id, chunk.index, phase, stage)
                deadline = stream.deadline(max(chunk.index, 0))
                ready.append(
                    ReadyUnit(
                        unit, stream.priority, deadline, chunk.num_frames * tokens, (stage, chunk.num_frames)
                    )
                )
        return ready

    # --- DiT batches --------------------------------------------------------------------
    def _launch(self, rank: int, batch: list[ReadyUnit]) -> None:
        if not batch:
            return
        works = []
        now = time.monotonic()
        for r in batch:
            stream = self.streams[r.unit.stream]
            chunk = stream.chunks[r.unit.chunk]
            chunk.in_flight = True
            if chunk.first_unit_at is None:
                chunk.first_unit_at = now
            works.append(self._work(stream, chunk, r.unit))
        stage = self.stages[batch[0].unit.stage]
        batch_id = next(self._batch_ids)
        fut = self.ranks[rank].submit(lambda: self._execute(stage, works))
        fut.add_done_callback(lambda f: self._on_batch_done(rank, batch_id, now, works, f))
        self.stats.batches += 1
        self.stats.batch_sizes[len(works)] += 1

    def _work(self, stream: Stream, chunk: ChunkState, unit: WorkUnit) -> _Work:
        if unit.phase == PREFILL:
            read, writes = prefill_kv_access(stream.kv_mode, self.num_steps)
        elif unit.phase == COMMIT:
            access = commit_kv_access(stream.kv_mode)
            assert access is not None
            read, writes = access
        else:
            read, writes = step_kv_access(stream.kv_mode, unit.phase, self.num_steps)
        table = stream.page_table
        assert table is not None
        frames = range(chunk.first_frame, chunk.first_frame + chunk.num_frames)
        view = PagedKVView(
            self.pool,
            self.stages[unit.stage],
            table.context_pages(unit.stage, read, chunk.first_frame),
            [table.ensure(unit.stage, v, frames) for v in writes],
            self.model.config.tokens_per_frame,
            chunk.first_frame,
            min(self.model.config.sink_frames, chunk.first_frame),
        )
        return _Work(unit, stream, chunk, view, writes)

    def _execute(self, stage: Stage, works: list[_Work]) -> list[_Result]:
        """Runs one batch on the executor thread; on failure, each unit alone."""
        try:
            return self._execute_batch(stage, works)
        except Exception as e:
            if len(works) == 1:
                log.warning("unit %s failed", works[0].unit, exc_info=True)
                return [_Result(False, f"{type(e).__name__}: {e}")]
        results = []
        for w in works:
            try:
                results.extend(self._execute_batch(stage, [w]))
            except Exception as e:
                log.warning("unit %s failed", w.unit, exc_info=True)
                results.append(_Result(False, f"{type(e).__name__}: {e}"))
        return results

    def _execute_batch(self, stage: Stage, works: list[_Work]) -> list[_Result]:
        model = self.model
        cfg = model.config
        sched = model.schedule
        last = stage.index == len(self.stages) - 1
        inputs, x_ts = [], []
        for w in works:
            if self.config.fault_hook is not None:
                self.config.fault_hook(w.unit)
            phase, chunk = w.unit.phase, w.chunk
            if phase >= 0:
                t = sched.timesteps[phase]
                if stage.index == 0:
                    shape = model.latent_shape(chunk.num_frames)
                    x_t = sched.step_input(
                        w.stream.request.seed, chunk.index, phase, chunk.x0, shape, model.device
                    )
                else:
                    x_t = chunk.x_t
            else:
                t, x_t = cfg.context_timestep, chunk.x0
            x_ts.append(x_t)
            timesteps = torch.full((chunk.num_frames,), t, device=model.device)
            la = None if chunk.latent_actions is None else to_device(chunk.latent_actions, model.device)
            inputs.append(ChunkInput(x_t, timesteps, chunk.text, w.view, la))
        if stage.index == 0:
            act = model.dit.embed(inputs)
        else:
            rows = [w.chunk.activation for w in works]
            act = StageActivation(
                torch.cat([r.hidden for r in rows]),
                torch.cat([r.modulation for r in rows]),
                torch.cat([r.temb for r in rows]),
                rows[0].num_frames,
            )
        act = model.dit.run_blocks(act, inputs, stage.start, stage.stop)
        results = []
        # Checking for non-finite values waits for the GPU; overlapped dispatch checks at decode.
        check = not self.overlap
        if last:
            flow = model.dit.head(act)
            for i, w in enumerate(works):
                x0 = sched.x0_from_flow(x_ts[i], flow[i], w.unit.phase) if w.unit.phase >= 0 else w.chunk.x0
                ok = not check or bool(torch.isfinite(x0).all())
                results.append(
                    _Result(ok, None if ok else "non-finite values in the model output", x_ts[i], x0)
                )
        else:
            for i in range(len(works)):
                row = StageActivation(
                    act.hidden[i : i + 1], act.modulation[i : i + 1], act.temb[i : i + 1], act.num_frames
                )
                ok = not check or bool(torch.isfinite(row.hidden).all())
                results.append(_Result(ok, None if ok else "non-finite activations", x_ts[i], None, row))
        if self.overlap and model.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # on the rank's stream, after every kernel of this batch
            for r in results:
                r.ready = ready
        return results

    def _on_batch_done(
        self, rank: int, batch_id: int, started: float, works: list[_Work], fut: asyncio.Future
    ) -> None:
        self.ranks[rank].done()
        now = time.monotonic()
        if fut.cancelled():
            return
        if fut.exception() is not None:  # _execute catches per unit; this is a bug path
            results = [_Result(False, repr(fut.exception()))] * len(works)
        else:
            results = fut.result()
        num_stages = len(self.stages)
        for w, res in zip(works, results, strict=True):
            stream, chunk, unit = w.stream, w.chunk, w.unit
            if self.config.trace:
                self.trace.append(TraceEvent(unit, rank, batch_id, started, now))
            if not stream.live:
                continue  # cancelled or failed meanwhile: discard
            chunk.in_flight = False
            if not res.ok:
                self._end(stream, "error", "error", f"{unit} failed: {res.error}")
                continue
            chunk.progress += 1
            if unit.stage == 0 and unit.phase >= 0:
                chunk.x_t = res.x_t
            chunk.activation = res.activation
            chunk.ready = res.ready
            if res.x0 is not None:
                chunk.x0 = res.x0
            if unit.phase != PREFILL:
                next_first = chunk.first_frame + chunk.num_frames
                assert stream.page_table is not None
                for version in w.writes:
                    stream.page_table.evict(unit.stage, version, next_first)
            if unit.phase == self.num_steps - 1 and unit.stage == num_stages - 1:
                chunk.denoised = True
                chunk.denoised_at = now
            self._retire_if_done(stream, chunk)
        self._poke()

    # --- decoding -----------------------------------------------------------------------
    def _launch_decode(self) -> None:
        """Decodes the most urgent ready chunk, batched with others whose decoder states agree."""
        if self.decoder.busy:
            return
        candidates = []
        for stream in self.streams.values():
            if not stream.live:
                continue
            chunk = stream.chunks.get(stream.next_decode)
            if chunk is not None and chunk.denoised and not chunk.decoding:
                candidates.append((stream.priority, stream.deadline(max(chunk.index, 0)), stream.id, chunk))
        if not candidates:
            return
        candidates.sort(key=lambda c: c[:3])
        head = self.streams[candidates[0][2]]
        # Same decoder position and chunk shape, and the head's priority class: lower classes
        # do not ride along and delay it.
        key = (head.priority, head.decoder.signature(), candidates[0][3].num_frames)
        picked = [
            (self.streams[sid], chunk)
            for prio, _, sid, chunk in candidates
            if (prio, self.streams[sid].decoder.signature(), chunk.num_frames) == key
        ][: self.config.max_decode_batch]
        for _, chunk in picked:
            chunk.decoding = True
        vae, dtype = self.model.vae, self.model.dtype
        x0s = [chunk.x0 for _, chunk in picked]
        states = [stream.decoder for stream, _ in picked]
        events = {id(c.ready): c.ready for _, c in picked if c.ready is not None}
        check = self.overlap

        def decode() -> tuple[list[tuple[np.ndarray, torch.Tensor] | BaseException], float]:
            start = time.perf_counter()
            for event in events.values():  # the DiT's kernels for these latents have run
                torch.cuda.current_stream().wait_event(event)
            results: list = [None] * len(x0s)
            todo = list(range(len(x0s)))
            if check:
                finite = torch.stack([torch.isfinite(x).all() for x in x0s]).tolist()
                for i in [i for i in todo if not finite[i]]:
                    results[i] = ValueError("non-finite values in the model output")
                todo = [i for i in todo if finite[i]]
            latents = [x0s[i].unsqueeze(0).to(dtype) for i in todo]
            try:
                videos: list = vae.decode_chunks(latents, [states[i] for i in todo]) if todo else []
            except Exception:
                if len(latents) == 1:
                    raise
                # One bad stream must not end the others: decode each alone.
                videos = []
                for x, i in zip(latents, todo, strict=True):
                    try:
                        videos.append(vae.decode_chunk(x, states[i]))
                    except Exception as e:
                        videos.append(e)
            for i, v in zip(todo, videos, strict=True):
                results[i] = v if isinstance(v, BaseException) else (to_uint8(v)[0], x0s[i].float().cpu())
            return results, time.perf_counter() - start

        fut = self.decoder.submit(decode)
        fut.add_done_callback(lambda f: self._on_decoded(picked, f))

    def _on_decoded(self, picked: list[tuple[Stream, ChunkState]], fut: asyncio.Future) -> None:
        self.decoder.done()
        self._poke()
        if fut.exception() is not None:
            for stream, chunk in picked:
                if stream.live:
                    self._end(
                        stream, "error", "error", f"decoding chunk {chunk.index} failed: {fut.exception()}"
                    )
            return
        results, decode_s = fut.result()
        now = time.monotonic()
        for (stream, chunk), res in zip(picked, results, strict=True):
            if not stream.live:
                continue
            if isinstance(res, BaseException):
                self._end(stream, "error", "error", f"decoding chunk {chunk.index} failed: {res}")
                continue
            f, lat = res
            chunk.decoded = True
            chunk.decode_s = decode_s
            stream.next_decode += 1
            if chunk.index != PREFILL_CHUNK:
                self._deliver(stream, chunk, f, lat, now)
            self._retire_if_done(stream, chunk)

    def _deliver(
        self, stream: Stream, chunk: ChunkState, frames: np.ndarray, latents: torch.Tensor, now: float
    ) -> None:
        deadline = stream.deadline(chunk.index)
        missed = now > deadline
        first = chunk.first_unit_at or now
        ms = 1000.0
        timings = {
            "queued": (first - chunk.eligible_at) * ms,
            "dit": ((chunk.denoised_at or now) - first) * ms,
            "decode": chunk.decode_s * ms,
            "encode": 0.0,
            "total": (now - first) * ms,
        }
        out = ChunkOutput(
            chunk.index, stream.chunk_video_start(chunk.index), frames, latents, timings, missed
        )
        stream.output.put_nowait(out)
        stream.delivered += 1
        self.stats.chunks_delivered += 1
        self.stats.frames_generated += frames.shape[0]
        self.stats.deadline_misses += int(missed)
        if chunk.index == 0 and stream.started_at is not None:
            self.stats.ttff_s.append(now - stream.started_at)
        latency = now - first
        self.est_latency = _ema(self.est_latency, latency)
        stream.est_latency = _ema(stream.est_latency, latency)
        self._maybe_complete(stream)

    def _retire_if_done(self, stream: Stream, chunk: ChunkState) -> None:
        if chunk.decoded and chunk.progress >= chunk.total_units(len(self.stages)):
            stream.chunks.pop(chunk.index, None)

    def _maybe_complete(self, stream: Stream) -> None:
        if stream.live and stream.finished_generating():
            self._end(stream, "completed", "stopped" if stream.stopping else "completed")

    # --- ending streams -----------------------------------------------------------------
    def _end(self, stream: Stream, status: str, reason: str, error: str | None = None) -> None:
        was_waiting = stream.status == "waiting"
        stream.status = status
        stream.error = error
        if was_waiting:
            with contextlib.suppress(ValueError):
                self.waiting.remove(stream.id)
        if stream.page_table is not None:
            stream.page_table.release()
        # A decode batch in flight may still hold the state: drop the reference rather than
        # resetting it under the decode thread (it is freed when that decode returns).
        stream.decoder = None
        stream.chunks.clear()
        stream.output.put_nowait(None)
        self._handles[stream.id]._admitted.set()
        self.stats.finished[reason] += 1
        self.streams.pop(stream.id, None)
        self._handles.pop(stream.id, None)
        self._admit_waiting()
        self._poke()

    def _get(self, stream_id: int) -> Stream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise KeyError(f"no live stream {stream_id}") from None

    def executor_busy_share(self) -> float:
        """Share of wall time the DiT executors spent running batches since start."""
        wall = time.monotonic() - self.started_at
        if wall <= 0:
            return math.nan
        return sum(r.busy_s for r in self.ranks) / (wall * len(self.ranks))


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _as_generation_request(request: StreamRequest):
    from .reference import GenerationRequest

    return GenerationRequest(
        seed=request.seed,
        num_chunks=request.num_chunks if request.num_chunks is not None else 1,
        prompt=request.prompt,
        image=request.image,
        actions=request.actions,
        kv_mode=request.kv_mode,
    )
