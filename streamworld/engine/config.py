"""The engine's one typed configuration, with the scheduler's nested in it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .placement import ReplicaPlacement
from .stream import WorkUnit


@dataclass(frozen=True)
class SchedulerConfig:
    # A chunk starts at most this many chunk durations before its deadline (bounded lookahead).
    lookahead_chunks: float = 2.0
    # Interactive chunks start this much earlier than the latency estimate says.
    jit_margin_s: float = 0.05
    jit_safety: float = 1.5
    max_batch_units: int = 16
    # Query tokens in one batch (the sum over its units).
    token_budget: int = 65536


@dataclass(frozen=True)
class EngineConfig:
    num_stages: int = 1
    num_ranks: int = 1
    # Where the replica's stages run: block ranges, devices and ranks (placement.py). None:
    # `num_stages` even stages on the model's device, stage g on rank g % `num_ranks`.
    placement: ReplicaPlacement | None = None
    # Pages per stage; by default room for `max_streams` streams in their worst case, capped
    # on a GPU at `kv_memory_fraction` of the memory free when the engine starts.
    kv_pages: int | None = None
    max_streams: int = 8
    kv_memory_fraction: float = 0.6
    max_queue: int = 16
    ttff_budget_s: float = 1.0
    # Most chunks (of different streams) decoded in one VAE batch.
    max_decode_batch: int = 8
    # Most branches one fork may ask for (`AsyncEngine.fork`).
    max_fork_branches: int = 16
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
    # Replay each stage's DiT blocks from CUDA graphs captured per batch shape (graphs.py):
    # far fewer kernel launches per step. CUDA devices only.
    cuda_graphs: bool = False
    # Tests: called on the executor for every unit before it runs; raising fails the unit.
    fault_hook: Callable[[WorkUnit], None] | None = None
