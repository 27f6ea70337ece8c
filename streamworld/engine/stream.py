"""Stream and chunk state as metadata: the request, the playback clock, the actions, which
units of each chunk are done. No tensors live here (the runner holds them, runner.py), so
the scheduler decides over plain Python.

A stream's life: waiting (queued for K/V pages) -> running -> completed | cancelled | error.
A chunk's: started (units run in their linear order, kv_modes.py) -> denoised -> decoding ->
decoded -> retired (dropped once both are done).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..models.config import ModelConfig
from ..models.frames import actions_needed, latent_action_window
from .kv_modes import COMMIT, PREFILL, PREFILL_CHUNK
from .kv_pool import PageTable
from .request import StreamRequest, check_action_values


@dataclass(frozen=True)
class WorkUnit:
    """`(stream, chunk, phase, stage)`: one stage's blocks for one phase of one chunk."""

    stream: int
    chunk: int
    phase: int  # a denoising step k >= 0, COMMIT or PREFILL
    stage: int

    def __str__(self) -> str:
        phase = {COMMIT: "commit", PREFILL: "prefill"}.get(self.phase, f"step{self.phase}")
        return f"s{self.stream}/c{self.chunk}/{phase}/g{self.stage}"


class ActionTrack:
    """Per-video-frame actions as they arrive, kept only as far back as chunks still need.

    `push` without a frame appends after the last known action; with a frame, the vectors
    apply from that frame on and replace whatever was queued from there. `hold` fills frames
    past the known ones with the last action (zeros before any): the `hold` action policy.
    """

    def __init__(self, action_dim: int) -> None:
        self.action_dim = action_dim
        self.base = 0  # video frame of frames[0]; earlier frames are forgotten
        self.frames = np.zeros((0, action_dim), dtype=np.float32)
        self.last = np.zeros(action_dim, dtype=np.float32)  # last action before `base`

    @property
    def known(self) -> int:
        return self.base + len(self.frames)

    def push(self, actions: np.ndarray, frame: int | None = None) -> None:
        actions = np.asarray(actions, dtype=np.float32).reshape(-1, self.action_dim)
        start = self.known if frame is None else frame
        if start < self.base:  # actions for frames already generated: only the rest matter
            actions, start = actions[self.base - start :], self.base
        if start > self.known:  # frames skipped over hold the last known action
            self.frames = self.hold(self.base, start)
        self.frames = np.concatenate([self.frames[: start - self.base], actions])

    def hold(self, start: int, stop: int) -> np.ndarray:
        """Actions of video frames [start, stop), `start >= base`, extended with the last one."""
        if start < self.base:
            raise ValueError(f"actions before frame {self.base} are forgotten")
        out = np.empty((stop - start, self.action_dim), dtype=np.float32)
        have = self.frames[start - self.base : stop - self.base]
        out[: len(have)] = have
        if len(have) < len(out):
            if len(self.frames):
                out[len(have) :] = self.frames[-1]
            else:
                out[len(have) :] = self.last
        return out

    def copy(self) -> ActionTrack:
        """An independent track with the same actions (a fork's branch)."""
        track = ActionTrack(self.action_dim)
        track.base, track.frames, track.last = self.base, self.frames.copy(), self.last.copy()
        return track

    def forget_before(self, frame: int) -> None:
        """Drops the actions of frames before `frame` (no chunk will need them)."""
        drop = min(max(frame - self.base, 0), len(self.frames))
        if drop:
            self.last = self.frames[drop - 1].copy()
            self.frames = self.frames[drop:]
            self.base += drop


def hold_actions(actions: np.ndarray | None, num_frames: int, action_dim: int) -> np.ndarray:
    """The `hold` policy over a whole request: `num_frames` actions, the given ones first."""
    track = ActionTrack(action_dim)
    if actions is not None and len(actions):
        track.push(actions)
    return track.hold(0, num_frames)


@dataclass
class ChunkState:
    index: int  # PREFILL_CHUNK (-1) is the first-image prefill
    first_frame: int  # first latent frame
    num_frames: int  # latent frames
    phases: list[int]
    # The actions of video frames [action_offset, action_offset + len) that condition the
    # chunk's latent frames (None for models without actions); fixed when the chunk starts.
    actions: np.ndarray | None = None
    action_offset: int = 0
    progress: int = 0  # units done, in the chunk's linear order
    in_flight: bool = False
    denoised: bool = False
    decoding: bool = False
    decoded: bool = False
    eligible_at: float = 0.0
    first_unit_at: float | None = None
    denoised_at: float | None = None
    decode_s: float = 0.0

    def total_units(self, num_stages: int) -> int:
        return len(self.phases) * num_stages

    def next_unit(self, num_stages: int) -> tuple[int, int] | None:
        """(phase, stage) of the next unit to run, None when all have run."""
        if self.progress >= self.total_units(num_stages):
            return None
        return self.phases[self.progress // num_stages], self.progress % num_stages

    def timings(self, now: float) -> dict[str, float]:
        """Milliseconds the chunk spent queued, in the DiT, decoding, and in all (delivery at `now`)."""
        first = self.first_unit_at or now
        return {
            "queued": (first - self.eligible_at) * 1000.0,
            "dit": ((self.denoised_at or now) - first) * 1000.0,
            "decode": self.decode_s * 1000.0,
            "encode": 0.0,
            "total": (now - first) * 1000.0,
        }

    def begun(self) -> bool:
        return self.progress > 0 or self.in_flight

    def retirable(self, num_stages: int) -> bool:
        return self.decoded and self.progress >= self.total_units(num_stages)


@dataclass
class ChunkOutput:
    """One decoded chunk as the engine delivers it."""

    index: int
    first_frame: int  # video frame index of its first frame
    frames: np.ndarray  # [T, H, W, 3] uint8
    latents: Any  # [C, F, h, w] float32 CPU tensor
    timings: dict[str, float]  # milliseconds: queued, dit, decode, total
    deadline_missed: bool


@dataclass
class PendingFork:
    """A fork asked of a stream: its branches start once the stream is between chunks."""

    branches: list[int]  # the branch streams' ids
    requests: list[Any]  # their BranchRequests


@dataclass
class Stream:
    id: int
    request: StreamRequest
    config: ModelConfig
    kv_mode: str
    priority: int
    created_at: float
    chunk_duration: float
    ttff_budget: float
    actions: ActionTrack
    output: asyncio.Queue
    prompt: str = ""
    text_ready: bool = False  # `prompt` is encoded (runner.py holds its K/V)
    # waiting (for pages), forking (a branch before its fork point), running, completed,
    # cancelled, error
    status: str = "waiting"
    error: str | None = None
    started_at: float | None = None
    page_table: PageTable | None = None
    decoder_signature: tuple | None = None  # streams with equal ones decode in one batch
    chunks: dict[int, ChunkState] = field(default_factory=dict)
    next_chunk: int = 0  # next chunk index to start
    next_decode: int = 0  # next chunk index to decode (decoding is in order)
    delivered: int = 0
    prefill_pending: bool = False  # the first image's chunk is still to start
    image_ready: bool = False  # the first image is encoded
    stopping: bool = False  # `stop` asked: finish the started chunks, then end
    prompt_encoding: bool = False  # an encoding of some prompt is in flight
    est_latency: float | None = None  # EMA of this stream's chunk latency (first unit -> frames)
    paused_s: float = 0.0  # total time the playback clock was paused (backpressure)
    paused_since: float | None = None
    paced: bool = True  # chunks keep to the playback clock; False: as soon as they can
    pending_fork: PendingFork | None = None  # no chunk starts until it is done
    parent: int | None = None  # a branch: the stream it was forked from
    fork_chunk: int | None = None  # a branch: its first chunk

    @property
    def between_chunks(self) -> bool:
        """Every chunk started has run and been decoded, and nothing is being encoded: the
        point a fork branches from."""
        return (
            self.live
            and not self.chunks
            and not self.prefill_pending
            and self.next_decode == self.next_chunk
            and self.text_ready
        )

    @property
    def live(self) -> bool:
        return self.status == "running"

    @property
    def offset(self) -> int:
        """Latent frames before chunk 0 (the first image)."""
        return 1 if self.config.needs_image else 0

    def chunk_first_frame(self, chunk: int) -> int:
        return self.offset + chunk * self.config.latent_frames_per_chunk

    def chunk_video_start(self, chunk: int) -> int:
        """Index of the chunk's first video frame in the stream."""
        cfg = self.config
        if chunk == 0:
            return 1 if cfg.needs_image else 0
        return cfg.first_chunk_frames + (1 if cfg.needs_image else 0) + (chunk - 1) * cfg.frames_per_chunk

    def deadline(self, chunk: int) -> float:
        """When chunk `chunk` must be ready to keep playback going (playback clock)."""
        base = self.started_at if self.started_at is not None else self.created_at
        paused = self.paused_s
        if self.paused_since is not None:
            paused += time.monotonic() - self.paused_since
        return base + paused + self.ttff_budget + chunk * self.chunk_duration

    def wants_more(self) -> bool:
        n = self.request.num_chunks
        return n is None or self.next_chunk < n

    def starts_last_chunk(self) -> bool:
        """Is the next chunk the stream's last (its `num_chunks` known)?"""
        n = self.request.num_chunks
        return n is not None and self.next_chunk == n - 1

    def finished_generating(self) -> bool:
        n = self.request.num_chunks
        return n is not None and self.delivered >= n

    def push_actions(self, actions: np.ndarray, frame: int | None, max_ahead: int) -> None:
        """Queues actions from `frame` on (after the known ones when None); ValueError when
        they are malformed, outside the model's accepted range (a huge action would make
        the model's output non-finite), or reach more than `max_ahead` frames past the
        oldest frame still to be generated (so a bad `frame` cannot make the queue huge)."""
        cfg = self.config
        arr = np.asarray(actions, dtype=np.float32)
        if cfg.action_dim == 0:
            raise ValueError(f"model {cfg.id} takes no actions")
        if arr.ndim != 2 or arr.shape[1] != cfg.action_dim or not np.isfinite(arr).all():
            raise ValueError(f"actions must be a list of finite vectors of length {cfg.action_dim}")
        if frame is not None and frame < 0:
            raise ValueError("frame must be >= 0")
        check_action_values(cfg, arr)
        start = self.actions.known if frame is None else frame
        if start + len(arr) > self.actions.base + max_ahead:
            raise ValueError(
                f"actions may reach at most {max_ahead} frames past the oldest frame "
                f"still to be generated (frame {self.actions.base}); "
                f"these reach frame {start + len(arr) - 1}"
            )
        self.actions.push(arr, frame)

    def next_chunk_actions_known(self) -> bool:
        """Are the actions of every frame of the next chunk known (the `wait` policy)?"""
        cfg = self.config
        first = self.chunk_first_frame(self.next_chunk)
        return self.actions.known >= actions_needed(first, cfg.latent_frames_per_chunk, cfg.temporal_ratio)

    # --- transitions ----------------------------------------------------------------------
    def branch(
        self, parent: Stream, page_table: PageTable, num_chunks: int, actions: np.ndarray | None, now: float
    ) -> None:
        """Starts this stream as a branch of `parent`, which is `between_chunks`: it goes on
        from the parent's next chunk with the parent's K/V (`page_table`, shared), prompt and
        queued actions, for `num_chunks` chunks, with `actions` in place of the queued ones
        from the video frame before that chunk's first (the action of frame n conditions
        frame n + 1, so actions[i] conditions the branch's i-th frame); its first chunk's
        deadline is `now` plus the first-chunk budget."""
        c = parent.next_chunk
        self.parent, self.fork_chunk = parent.id, c
        self.page_table = page_table
        self.decoder_signature = parent.decoder_signature
        self.next_chunk = self.next_decode = self.delivered = c
        self.request.num_chunks = c + num_chunks
        self.actions = parent.actions.copy()
        if actions is not None:  # actions[0] conditions the branch's first frame
            self.actions.push(actions, max(self.chunk_video_start(c) - 1, 0))
        self.prompt, self.text_ready, self.image_ready = parent.prompt, True, True
        self.status = "running"
        self.started_at = now - c * self.chunk_duration  # deadline(c) = now + ttff budget

    def admit(self, page_table: PageTable, decoder_signature: tuple, now: float) -> None:
        self.page_table = page_table
        self.decoder_signature = decoder_signature
        self.status = "running"
        self.started_at = now
        if self.request.image is not None:
            self.prefill_pending = True
            self.next_decode = PREFILL_CHUNK

    def start_prefill(self, now: float) -> ChunkState:
        """The first image's chunk: its latent is the encoded image, so it starts denoised."""
        actions = np.zeros((0, self.config.action_dim), np.float32) if self.config.action_dim else None
        chunk = ChunkState(PREFILL_CHUNK, 0, 1, [PREFILL], actions, eligible_at=now, denoised=True)
        self.chunks[PREFILL_CHUNK] = chunk
        self.prefill_pending = False
        return chunk

    def start_chunk(self, phases: list[int], now: float) -> ChunkState:
        """Starts the next chunk, fixing its actions (the `hold` rule past the known ones)."""
        cfg = self.config
        c, f, r = self.next_chunk, cfg.latent_frames_per_chunk, cfg.temporal_ratio
        first = self.chunk_first_frame(c)
        actions, offset = None, 0
        if cfg.action_dim:
            offset = latent_action_window(first, r)[0]
            actions = self.actions.hold(offset, actions_needed(first, f, r))
            self.actions.forget_before(latent_action_window(first + f, r)[0])
        chunk = ChunkState(c, first, f, phases, actions, offset, eligible_at=now)
        self.chunks[c] = chunk
        self.next_chunk += 1
        return chunk

    def stop_after_begun(self) -> list[int]:
        """`stop`: the chunks begun finish, the others are dropped; returns the dropped ones.
        (A chunk starts only after its predecessor has begun, so the begun ones are a prefix.)
        With a fork pending, every chunk started finishes: they all come before the fork point
        (none starts while a fork waits), which a drop would move back."""
        begun = [c for c, ch in self.chunks.items() if c >= 0 and ch.begun()]
        keep = max(begun) + 1 if begun else self.delivered
        if self.pending_fork is not None:
            keep = self.next_chunk
        dropped = [c for c in self.chunks if c >= keep]
        for c in dropped:
            del self.chunks[c]
        self.next_chunk = min(self.next_chunk, keep)
        self.request.num_chunks = keep
        self.stopping = True
        return dropped

    def set_paused(self, paused: bool, now: float) -> bool:
        """Pauses or resumes the playback clock; True when it resumed."""
        if paused and self.paused_since is None:
            self.paused_since = now
        elif not paused and self.paused_since is not None:
            self.paused_s += now - self.paused_since
            self.paused_since = None
            return True
        return False


def chunk_duration_s(config: ModelConfig) -> float:
    return config.frames_per_chunk / config.fps
