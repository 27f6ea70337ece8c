"""Per-stream state: the request, its playback clock, its actions, its chunks in flight."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..models.actions import latent_action_window
from ..models.config import ModelConfig
from .kv_pool import PageTable

PRIORITY_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}
ACTION_POLICIES = ("hold", "wait")


@dataclass
class StreamRequest:
    seed: int
    num_chunks: int | None = None  # None: until cancelled
    prompt: str = ""
    image: np.ndarray | None = None  # [H, W, 3] uint8, frame 0 of image-to-world models
    actions: np.ndarray | None = None  # [N, action_dim] from video frame 0
    kv_mode: str | None = None
    priority: str = "standard"
    action_policy: str = "hold"


class ActionTrack:
    """Per-video-frame actions as they arrive, kept only as far back as chunks still need.

    `push` without a frame appends after the last known action; with a frame, the vectors
    apply from that frame on and replace whatever was queued from there. `hold` fills frames
    past the known ones with the last action (zeros before any).
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

    def forget_before(self, frame: int) -> None:
        """Drops the actions of frames before `frame` (no chunk will need them)."""
        drop = min(max(frame - self.base, 0), len(self.frames))
        if drop:
            self.last = self.frames[drop - 1].copy()
            self.frames = self.frames[drop:]
            self.base += drop


def actions_needed(first_latent_frame: int, num_latent_frames: int, temporal_ratio: int) -> int:
    """Video frames whose actions a chunk needs (the stop of its action window)."""
    return latent_action_window(first_latent_frame + num_latent_frames - 1, temporal_ratio)[1]


@dataclass
class ChunkState:
    index: int  # -1 is the first-image prefill
    first_frame: int  # first latent frame
    num_frames: int  # latent frames
    phases: list[int]
    text: Any  # CrossKV captured when the chunk starts
    latent_actions: Any = None
    progress: int = 0  # units done, in the chunk's linear order
    in_flight: bool = False
    x_t: Any = None  # current step's input latents
    x0: Any = None  # latest clean estimate
    # With overlapped dispatch: a CUDA event that completes when the last unit's kernels have
    # run (x0 and x_t are valid on other streams and on the host only after it).
    ready: Any = None
    activation: Any = None  # StageActivation row between stages
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
        if self.progress >= self.total_units(num_stages):
            return None
        return self.phases[self.progress // num_stages], self.progress % num_stages


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
    text: Any = None  # CrossKV of `prompt`, None while encoding
    status: str = "waiting"  # waiting, running, completed, cancelled, error
    error: str | None = None
    started_at: float | None = None
    page_table: PageTable | None = None
    decoder: Any = None
    chunks: dict[int, ChunkState] = field(default_factory=dict)
    next_chunk: int = 0  # next chunk index to start
    next_decode: int = 0  # next chunk index to decode (decoding is in order)
    delivered: int = 0
    prefill_pending: bool = False
    image_latent: Any = None  # [C, 1, h, w] once the first image is encoded
    stopping: bool = False  # `stop` asked: finish the started chunks, then end
    prompt_encoding: bool = False  # an encoding of some prompt is in flight
    est_latency: float | None = None  # EMA of this stream's chunk latency (first unit -> frames)
    paused_s: float = 0.0  # total time the playback clock was paused (backpressure)
    paused_since: float | None = None

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

    def finished_generating(self) -> bool:
        n = self.request.num_chunks
        return n is not None and self.delivered >= n


def chunk_duration_s(config: ModelConfig) -> float:
    return config.frames_per_chunk / config.fps
