"""Streams, K/V pages, scheduling and execution, and the sequential reference generator.

This package's only import surface for the server, the command line, the benchmarks and
PushT: import from `streamworld.engine`, not from its modules.

    request     StreamRequest, BranchRequest (forks), priorities, action policies, errors, validation
    kv_modes    clean / final / noisy: what each unit reads, writes and waits for
    stream      stream and chunk state (metadata only) and their transitions
    kv_pool     K/V page bookkeeping: free lists, reservations, page tables
    kv_cache    the K/V tensors and the paged views the DiT reads and writes
    scheduler   every decision: admission, chunk starts, ready units, batches, decodes
    runner      all work on executor threads, and the tensors kept between units
    graphs      CUDA graphs of a stage's DiT blocks (--cuda-graphs)
    placement   which devices a model uses: replicas, stages, virtual ranks (plain data)
    executor    virtual ranks: worker threads (+ CUDA streams)
    replicas    ReplicaSet: several engines serving one model as one pool
    cpu_threads PyTorch's CPU thread count, adapted to other processes' load
    handle      what a caller holds for one stream
    engine      the public API and the busy loop
    offline     generate_all: many finite streams at once, batched, frames back at the end
    reference   the sequential reference generator (the ground truth)
"""

from .config import EngineConfig, SchedulerConfig
from .cpu_threads import ThreadGovernor
from .engine import AsyncEngine
from .executor import on_torch_thread
from .graphs import summed_stats
from .handle import StreamHandle
from .kv_modes import context_frame_indices
from .offline import generate_all, generate_all_sync, offline_config
from .placement import (
    Placement,
    PlacementError,
    ReplicaPlacement,
    StagePlacement,
    check_devices,
    parse_placement,
    single_device,
)
from .reference import GenerationRequest, GenerationResult, ReferenceGenerator
from .replicas import ReplicaSet
from .request import (
    ACTION_POLICIES,
    MAX_NUM_CHUNKS,
    PRIORITY_CLASSES,
    BranchRequest,
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
    "BranchRequest",
    "ChunkOutput",
    "EngineConfig",
    "GenerationRequest",
    "GenerationResult",
    "Overloaded",
    "Placement",
    "PlacementError",
    "ReferenceGenerator",
    "ReplicaPlacement",
    "ReplicaSet",
    "SchedulerConfig",
    "StagePlacement",
    "StreamError",
    "StreamHandle",
    "StreamRequest",
    "ThreadGovernor",
    "Unsupported",
    "check_devices",
    "context_frame_indices",
    "generate_all",
    "generate_all_sync",
    "offline_config",
    "on_torch_thread",
    "parse_placement",
    "single_device",
    "summed_stats",
]
