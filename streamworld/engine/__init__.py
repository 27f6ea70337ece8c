"""Streams, K/V pages, scheduling and execution, and the sequential reference generator.

This package's only import surface for the server, the command line, the benchmarks and
PushT: import from `streamworld.engine`, not from its modules.

    request     StreamRequest, priorities, action policies, admission errors, validation
    kv_modes    clean / final / noisy: what each unit reads, writes and waits for
    stream      stream and chunk state (metadata only) and their transitions
    kv_pool     K/V page bookkeeping: free lists, reservations, page tables
    kv_cache    the K/V tensors and the paged views the DiT reads and writes
    scheduler   every decision: admission, chunk starts, ready units, batches, decodes
    runner      all work on executor threads, and the tensors kept between units
    executor    virtual ranks: worker threads (+ CUDA streams)
    handle      what a caller holds for one stream
    engine      the public API and the busy loop
    reference   the sequential reference generator (the ground truth)
"""

from .config import EngineConfig, SchedulerConfig
from .engine import AsyncEngine
from .executor import on_torch_thread
from .handle import StreamHandle
from .kv_modes import context_frame_indices
from .reference import GenerationRequest, GenerationResult, ReferenceGenerator
from .request import (
    ACTION_POLICIES,
    MAX_NUM_CHUNKS,
    PRIORITY_CLASSES,
    Overloaded,
    StreamError,
    StreamRequest,
    Unsupported,
)
from .stream import ChunkOutput

__all__ = [
    "ACTION_POLICIES",
    "MAX_NUM_CHUNKS",
    "PRIORITY_CLASSES",
    "AsyncEngine",
    "ChunkOutput",
    "EngineConfig",
    "GenerationRequest",
    "GenerationResult",
    "Overloaded",
    "ReferenceGenerator",
    "SchedulerConfig",
    "StreamError",
    "StreamHandle",
    "StreamRequest",
    "Unsupported",
    "context_frame_indices",
    "on_torch_thread",
]
