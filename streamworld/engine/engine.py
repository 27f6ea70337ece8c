"""AsyncEngine: the public API, and the busy loop that glues the scheduler, the K/V page
pool and the model runner.

One asyncio task (the busy loop) owns all bookkeeping. Each turn it asks the scheduler
which chunks start, which batch each idle executor runs next and which chunks decode
together, hands that work to the executors, and sleeps until a completion (an asyncio
future resolved from the executor thread) or the next chunk start time wakes it. Tensor
work only ever runs on executors, through the runner (runner.py):

    prep executor     prompt encoding, first-image encoding (off the DiT path)
    rank executors    DiT stages; each stage runs on the rank its placement names
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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..models.world_model import WorldModel
from .config import EngineConfig
from .executor import Executor, resolve_overlap
from .handle import StreamHandle
from .kv_cache import KVCache, default_pages
from .kv_modes import PREFILL, PREFILL_CHUNK, num_kv_versions, unit_kv_access
from .kv_pool import KVPagePool, PageTable, Stage, pages_needed
from .placement import single_device
from .request import (
    PRIORITY_CLASSES,
    BranchRequest,
    Overloaded,
    StreamRequest,
    Unsupported,
    validate_branch,
    validate_stream_request,
)
from .runner import Decoded, ModelRunner, UnitResult, Work, placed_devices
from .scheduler import ReadyUnit, Scheduler
from .stats import EngineStats, TraceEvent, ema
from .stream import ActionTrack, ChunkOutput, ChunkState, PendingFork, Stream, chunk_duration_s

log = logging.getLogger("streamworld.engine")


@dataclass
class _Launched:
    """A unit handed to an executor: its work, the K/V versions it writes, its chunk."""

    work: Work
    writes: tuple[int, ...]
    chunk: ChunkState


class AsyncEngine:
    def __init__(self, model: WorldModel, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        cfg = model.config
        self.placement = (
            self.config.placement
            or single_device(
                str(model.device), cfg.num_layers, self.config.num_stages, self.config.num_ranks
            ).replicas[0]
        )
        self.stages: list[Stage] = [Stage(g, s.start, s.stop) for g, s in enumerate(self.placement.stages)]
        stage_devices, rank_devices = placed_devices(model, self.placement)
        num_ranks = len(rank_devices)
        self.num_steps = model.schedule.num_steps
        pages = self.config.kv_pages
        if pages is None:  # room for `max_streams` streams in their worst case (noisy)
            wanted = self._pages_for("noisy") * self.config.max_streams
            pages = default_pages(model, wanted, self.config.kv_memory_fraction, self.stages, stage_devices)
        self.pool = KVPagePool(len(self.stages), pages)
        cache = KVCache.for_model(model, self.stages, pages, stage_devices)
        self.scheduler = Scheduler(
            self.config.scheduler,
            num_stages=len(self.stages),
            num_steps=self.num_steps,
            num_ranks=num_ranks,
            max_decode_batch=self.config.max_decode_batch,
            stage_ranks=[s.rank for s in self.placement.stages],
        )
        self.overlap = overlap = resolve_overlap(self.config.overlap_dispatch, model.device, num_ranks)
        # The hook is read per batch: tests swap the configuration of a running engine.
        self.runner = ModelRunner(
            model,
            self.stages,
            cache,
            overlap,
            lambda: self.config.fault_hook,
            stage_devices,
            cuda_graphs=self.config.scheduler.max_batch_units if self.config.cuda_graphs else 0,
        )
        # On a CPU all of them share the process's one PyTorch thread (executor.py says why).
        self.ranks = [Executor(f"rank{r}", d, overlap=overlap) for r, d in enumerate(rank_devices)]
        self.decoder = Executor("decode", model.decoder_device)
        self.prep = Executor("prep", model.device)
        self.streams: dict[int, Stream] = {}
        self.waiting: deque[int] = deque()
        self.stats = EngineStats()
        self.trace: list[TraceEvent] = []
        self.est_latency: float | None = None
        self._handles: dict[int, StreamHandle] = {}
        self._forking: set[int] = set()  # streams with a pending fork (stream.pending_fork)
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.started_at = time.monotonic()
        # Replicas (replicas.py): which one this is, and a callback for when pages free up.
        self.replica = 0
        self.on_capacity: Callable[[AsyncEngine], None] | None = None

    # --- lifecycle ----------------------------------------------------------------------------
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
        # The K/V pages and the graphs go back now, not whenever the engine is collected:
        # a process that starts engines one after another (a benchmark) sizes each new pool
        # from the memory left free.
        self.runner.release()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- public API ---------------------------------------------------------------------------
    def open_stream(self, request: StreamRequest) -> StreamHandle:
        """Validates and admits a stream, or queues it; raises Overloaded if the queue is full."""
        if self._task is None or self._closed:
            raise RuntimeError("the engine is not running: call `await engine.start()` first")
        cfg = self.model.config
        request = dataclasses.replace(request)  # ours: stop() changes num_chunks
        kv_mode = validate_stream_request(cfg, request)
        need = self._pages_for(kv_mode)
        if need > self.pool.pages_per_stage:
            raise Unsupported(
                f"a {kv_mode} stream needs {need} pages per stage; the pool has {self.pool.pages_per_stage}"
            )
        must_wait = bool(self.waiting) or not self.pool.can_reserve(need)
        if must_wait and len(self.waiting) >= self.config.max_queue:
            raise Overloaded("the server is at capacity and its admission queue is full")
        stream = self._new_stream(request, kv_mode)
        if request.actions is not None and cfg.action_dim:
            stream.actions.push(request.actions)
        handle = self._handles[stream.id]
        self.waiting.append(stream.id)
        self._admit_waiting()
        self._poke()
        return handle

    def fork(self, stream_id: int, branches: list[BranchRequest]) -> list[StreamHandle]:
        """Forks a running stream into branches that share its history (docs/architecture.md, Forks).

        The fork point is the stream's next chunk not yet started when the fork is asked:
        the stream starts no chunk until every chunk before it has run and been decoded;
        then each branch takes a copy of its page table (the pages shared, counted once per
        table), a fork of its decoder state, its prompt and its queued actions, and goes on
        from there with its own actions, seed and chunk count; the stream resumes. Each
        branch reserves its worst case of pages now, so a fork that is accepted never waits
        for memory. ValueError for an unknown, finished or stopping stream, one with a fork
        pending, a bad branch or more than `max_fork_branches`; Overloaded when the pages
        of the branches cannot be reserved now.
        """
        parent = self.streams.get(stream_id)
        if parent is None:
            raise ValueError(f"no stream {stream_id} here (unknown, or ended)")
        if not parent.live or parent.stopping:
            state = "stopping" if parent.stopping and parent.live else parent.status
            raise ValueError(f"stream {stream_id} is {state}: only a running stream can fork")
        if not parent.wants_more():
            raise ValueError(f"stream {stream_id} has started all its chunks: nothing is left to fork from")
        if parent.pending_fork is not None:
            raise ValueError(f"stream {stream_id} has a fork pending")
        if not 1 <= len(branches) <= self.config.max_fork_branches:
            raise ValueError(f"a fork has 1 to {self.config.max_fork_branches} branches, not {len(branches)}")
        for branch in branches:
            validate_branch(self.model.config, branch)
        need = self._pages_for(parent.kv_mode)
        if not self.pool.can_reserve(need * len(branches)):
            free = self.pool.pages_per_stage - self.pool.reserved
            raise Overloaded(
                f"{len(branches)} branches need {need * len(branches)} pages per stage; {free} are free"
            )
        self.pool.reserve(need * len(branches))
        handles = []
        for branch in branches:
            request = dataclasses.replace(
                parent.request,
                seed=parent.request.seed if branch.seed is None else branch.seed,
                image=None,
                actions=None,
                priority=branch.priority or parent.request.priority,
            )
            stream = self._new_stream(request, parent.kv_mode, status="forking")
            stream.paced = branch.paced
            handles.append(self._handles[stream.id])
        parent.pending_fork = PendingFork([h.id for h in handles], list(branches))
        self._forking.add(parent.id)
        self._poke()
        return handles

    def _new_stream(self, request: StreamRequest, kv_mode: str, status: str = "waiting") -> Stream:
        cfg = self.model.config
        stream = Stream(
            id=next(self._ids),
            request=request,
            config=cfg,
            kv_mode=kv_mode,
            priority=PRIORITY_CLASSES[request.priority],
            created_at=time.monotonic(),
            chunk_duration=chunk_duration_s(cfg),
            ttff_budget=self.config.ttff_budget_s,
            actions=ActionTrack(cfg.action_dim),
            output=asyncio.Queue(),
            prompt=request.prompt,
            status=status,
        )
        self.streams[stream.id] = stream
        self._handles[stream.id] = StreamHandle(self, stream)
        return stream

    def _forks_due(self) -> None:
        """Branches the streams with a pending fork that have reached their fork point."""
        for sid in [sid for sid in self._forking if self.streams[sid].between_chunks]:
            self._branch(self.streams[sid])

    def _branch(self, parent: Stream) -> None:
        """Starts the branches of `parent`'s pending fork (`parent` is between chunks)."""
        fork, parent.pending_fork = parent.pending_fork, None
        self._forking.discard(parent.id)
        assert fork is not None and parent.page_table is not None
        now = time.monotonic()
        for sid, request in zip(fork.branches, fork.requests, strict=True):
            stream = self.streams.get(sid)
            if stream is None or stream.status != "forking":
                continue  # ended before the fork point (its reservation went back then)
            self.runner.fork_stream(parent.id, sid, stream.request.seed)
            table = parent.page_table.fork(self._pages_for(parent.kv_mode))
            stream.branch(parent, table, request.num_chunks, request.actions, now)
            self._handles[sid]._admitted.set()

    # --- for replica sets (replicas.py) ------------------------------------------------------
    def admission_need(self, request: StreamRequest) -> int:
        """Pages per stage the request would reserve (raises as open_stream would for a bad one)."""
        return self._pages_for(validate_stream_request(self.model.config, dataclasses.replace(request)))

    def admits_now(self, need: int) -> bool:
        """Whether a stream needing `need` pages would be admitted at once (nobody waits first)."""
        return not self._closed and not self.waiting and self.pool.can_reserve(need)

    def share_ids(self, ids: Iterator[int]) -> None:
        """Draws stream ids from `ids` (one id space for the replicas of a set)."""
        self._ids = ids

    def release_waiting(self, stream_id: int) -> StreamHandle:
        """Takes a waiting stream out of this engine (to move it to another replica)."""
        stream = self.streams[stream_id]
        if stream.status != "waiting":
            raise ValueError(f"stream {stream_id} is {stream.status}, not waiting")
        self.waiting.remove(stream_id)
        del self.streams[stream_id]
        return self._handles.pop(stream_id)

    def adopt_waiting(self, handle: StreamHandle) -> None:
        """Takes a waiting stream released by another replica, and admits it if it fits."""
        stream = handle.stream
        self.streams[stream.id] = stream
        self._handles[stream.id] = handle
        handle.rebind(self)
        self.waiting.append(stream.id)
        self._admit_waiting()
        self._poke()

    def queue_position(self, stream_id: int) -> int:
        try:
            return self.waiting.index(stream_id) + 1
        except ValueError:
            return 0

    def push_actions(self, stream_id: int, actions: np.ndarray, frame: int | None = None) -> None:
        self._get(stream_id).push_actions(actions, frame, self.config.max_actions_ahead)
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
        if stream.live and stream.set_paused(paused, time.monotonic()):
            self._poke()

    def stop(self, stream_id: int) -> None:
        """Finishes the chunks already started, then ends the stream as completed."""
        stream = self._get(stream_id)
        if stream.status in ("waiting", "forking"):
            self.cancel(stream_id, reason="stopped")
            return
        for index in stream.stop_after_begun():
            self.runner.drop_chunk(stream.id, index)
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

    def executor_busy_share(self) -> float:
        """Share of wall time the DiT executors spent running batches since start."""
        wall = time.monotonic() - self.started_at
        if wall <= 0:
            return math.nan
        return sum(r.busy_s for r in self.ranks) / (wall * len(self.ranks))

    # --- admission ----------------------------------------------------------------------------
    def _pages_for(self, kv_mode: str) -> int:
        cfg = self.model.config
        versions = num_kv_versions(kv_mode, self.num_steps)
        return pages_needed(versions, cfg.sink_frames, cfg.window_frames, cfg.latent_frames_per_chunk)

    def _admit_waiting(self) -> None:
        def fits(stream: Stream) -> bool:
            return self.pool.can_reserve(self._pages_for(stream.kv_mode))

        while not self._closed:
            stream = self.scheduler.next_admission([self.streams[sid] for sid in self.waiting], fits)
            if stream is None:
                return
            self.waiting.remove(stream.id)
            self._admit(stream)

    def _admit(self, stream: Stream) -> None:
        cfg = self.model.config
        need = self._pages_for(stream.kv_mode)
        self.pool.reserve(need)
        versions = num_kv_versions(stream.kv_mode, self.num_steps)
        table = PageTable(self.pool, versions, cfg.sink_frames, cfg.window_frames, need)
        stream.admit(table, self.runner.open_stream(stream.id, stream.request.seed), time.monotonic())
        if stream.request.image is not None:
            self._encode_image(stream)
        self._encode_prompt(stream)
        self._handles[stream.id]._admitted.set()

    def _encode_prompt(self, stream: Stream) -> None:
        """Encodes the stream's current prompt; at most one encoding per stream in flight."""
        stream.text_ready = False
        if stream.prompt_encoding:
            return  # the callback below picks up the newest prompt
        stream.prompt_encoding = True
        prompt = stream.prompt
        self.runner.want_prompt(stream.id, prompt)
        fut = self.prep.submit(lambda: self.runner.encode_prompt(stream.id, prompt))

        def done(f: asyncio.Future) -> None:
            self.prep.done()
            stream.prompt_encoding = False
            if not stream.live:
                return
            if f.exception() is not None:
                self._end(stream, "error", "error", f"prompt encoding failed: {f.exception()}")
            elif stream.prompt == prompt:
                stream.text_ready = True
                if stream.pending_fork is not None:  # its completion may have waited for this
                    self._maybe_complete(stream)
            else:
                self._encode_prompt(stream)
            self._poke()

        fut.add_done_callback(done)

    def _encode_image(self, stream: Stream) -> None:
        image = stream.request.image
        fut = self.prep.submit(lambda: self.runner.encode_image(stream.id, image))

        def done(f: asyncio.Future) -> None:
            self.prep.done()
            if not stream.live:
                return
            if f.exception() is not None:
                self._end(stream, "error", "error", f"first-frame encoding failed: {f.exception()}")
                return
            stream.image_ready = True
            self._poke()

        fut.add_done_callback(done)

    # --- the busy loop ------------------------------------------------------------------------
    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while not self._closed:
            self._wake.clear()
            next_time = None
            try:
                next_time = self._turn(time.monotonic())
            except Exception:  # a bug or an allocation failure: fail loudly, keep serving
                log.exception("engine loop failed; ending the live streams")
                for stream in [s for s in self.streams.values() if s.live]:
                    self._end(stream, "error", "error", "internal engine error (see the server log)")
            timeout = None if next_time is None else max(0.0, next_time - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _turn(self, now: float) -> float | None:
        """One round of decisions; returns when the next chunk may start (None: no timer)."""
        self._forks_due()
        started, next_time = self.scheduler.start_chunks(self.streams.values(), now, self.est_latency)
        for stream, chunk in started:
            self.runner.begin_chunk(stream.id, chunk)
        for rank, ex in enumerate(self.ranks):
            if not ex.busy:
                self._launch(
                    rank, self.scheduler.next_batch(self.scheduler.ready_units(self.streams.values(), rank))
                )
        self._launch_decode()
        return next_time

    # --- DiT batches --------------------------------------------------------------------------
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
            works.append(_Launched(*self._work(stream, chunk, r), chunk))
        stage = self.stages[batch[0].unit.stage]
        batch_id = next(self._batch_ids)
        fut = self.ranks[rank].submit(lambda: self.runner.execute(stage, [w.work for w in works]))
        fut.add_done_callback(lambda f: self._on_batch_done(rank, batch_id, now, works, f))
        self.stats.record_batch(len(works))

    def _work(self, stream: Stream, chunk: ChunkState, r: ReadyUnit) -> tuple[Work, tuple[int, ...]]:
        """The unit's pages (allocating those it writes) and its work; with the versions written."""
        unit = r.unit
        read, writes = unit_kv_access(stream.kv_mode, unit.phase, self.num_steps)
        table = stream.page_table
        assert table is not None
        frames = range(chunk.first_frame, chunk.first_frame + chunk.num_frames)
        read_pages = table.context_pages(unit.stage, read, chunk.first_frame)
        write_pages = [table.ensure(unit.stage, v, frames) for v in writes]
        return self.runner.work(unit, chunk, read_pages, write_pages), writes

    def _on_batch_done(
        self,
        rank: int,
        batch_id: int,
        started: float,
        works: list[_Launched],
        fut: asyncio.Future,
    ) -> None:
        self.ranks[rank].done()
        now = time.monotonic()
        if fut.cancelled():
            return
        if fut.exception() is not None:  # execute catches per unit; this is a bug path
            results = [UnitResult(False, repr(fut.exception()))] * len(works)
        else:
            results = fut.result()
        for w, res in zip(works, results, strict=True):
            if self.config.trace:
                self.trace.append(TraceEvent(w.work.unit, rank, batch_id, started, now))
            self._unit_done(w, res, now)
        self._poke()

    def _unit_done(self, w: _Launched, res: UnitResult, now: float) -> None:
        unit, chunk = w.work.unit, w.chunk
        stream = self.streams.get(unit.stream)
        if stream is None or not stream.live:
            return  # cancelled or failed meanwhile: discard
        chunk.in_flight = False
        if not res.ok:
            self._end(stream, "error", "error", f"{unit} failed: {res.error}")
            return
        chunk.progress += 1
        if unit.phase != PREFILL:
            assert stream.page_table is not None
            for version in w.writes:
                stream.page_table.evict(unit.stage, version, chunk.first_frame + chunk.num_frames)
        if unit.phase == self.num_steps - 1 and unit.stage == len(self.stages) - 1:
            chunk.denoised = True
            chunk.denoised_at = now
            self.runner.chunk_denoised(stream.id, chunk.index)
        self._retire_if_done(stream, chunk)

    # --- decoding -----------------------------------------------------------------------------
    def _launch_decode(self) -> None:
        """Decodes the chunks the scheduler picks, if the decoder is idle."""
        if self.decoder.busy:
            return
        picked = self.scheduler.next_decode_batch(self.streams.values())
        if not picked:
            return
        for _, chunk in picked:
            chunk.decoding = True
        job = self.runner.decode_job([(stream.id, chunk.index) for stream, chunk in picked])
        fut = self.decoder.submit(lambda: self.runner.decode(job))
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
            chunk.decoded = True
            chunk.decode_s = decode_s
            stream.decoder_signature = res.signature
            stream.next_decode += 1
            if chunk.index != PREFILL_CHUNK:
                self._deliver(stream, chunk, res, now)
            self._retire_if_done(stream, chunk)

    def _deliver(self, stream: Stream, chunk: ChunkState, decoded: Decoded, now: float) -> None:
        missed = now > stream.deadline(chunk.index)
        timings = chunk.timings(now)
        start = stream.chunk_video_start(chunk.index)
        stream.output.put_nowait(
            ChunkOutput(chunk.index, start, decoded.frames, decoded.latents, timings, missed)
        )
        stream.delivered += 1
        self.stats.record_delivery(decoded.frames.shape[0], missed)
        if chunk.index == 0 and stream.started_at is not None:
            self.stats.ttff_s.append(now - stream.started_at)
        latency = now - (chunk.first_unit_at or now)
        self.est_latency = ema(self.est_latency, latency)
        stream.est_latency = ema(stream.est_latency, latency)
        self._maybe_complete(stream)

    def _retire_if_done(self, stream: Stream, chunk: ChunkState) -> None:
        if chunk.retirable(len(self.stages)):
            stream.chunks.pop(chunk.index, None)
            self.runner.drop_chunk(stream.id, chunk.index)
            if stream.pending_fork is not None:  # its completion may have waited for this
                self._maybe_complete(stream)

    def _maybe_complete(self, stream: Stream) -> None:
        if not (stream.live and stream.finished_generating()):
            return
        if stream.pending_fork is not None and (stream.chunks or not stream.text_ready):
            # Delivered, but a chunk's last units (a commit pass) still run, or a new prompt
            # is being encoded: the branches take both, so the stream completes once the
            # chunk retires and the prompt is ready.
            return
        self._end(stream, "completed", "stopped" if stream.stopping else "completed")

    # --- ending streams -----------------------------------------------------------------------
    def _end(self, stream: Stream, status: str, reason: str, error: str | None = None) -> None:
        fork = stream.pending_fork
        if fork is not None:  # a stream that completes is between chunks: its branches go on
            if status == "completed" and stream.between_chunks:
                self._branch(stream)
            else:
                stream.pending_fork = None
                self._forking.discard(stream.id)
                for sid in fork.branches:
                    if sid in self.streams:
                        why = f"stream {stream.id} ended before the fork point"
                        self._end(self.streams[sid], "error", "error", why)
        if stream.status == "forking":  # a branch that never started: its reservation goes back
            self.pool.unreserve(self._pages_for(stream.kv_mode))
        was_waiting = stream.status == "waiting"
        stream.status = status
        stream.error = error
        if was_waiting:
            with contextlib.suppress(ValueError):
                self.waiting.remove(stream.id)
        if stream.page_table is not None:
            stream.page_table.release()
        self.runner.close_stream(stream.id)
        stream.chunks.clear()
        stream.output.put_nowait(None)
        self._handles[stream.id]._admitted.set()
        self.stats.finished[reason] += 1
        self.streams.pop(stream.id, None)
        self._handles.pop(stream.id, None)
        self._admit_waiting()
        if self.on_capacity is not None:
            self.on_capacity(self)
        self._poke()

    def _get(self, stream_id: int) -> Stream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise KeyError(f"no live stream {stream_id}") from None
