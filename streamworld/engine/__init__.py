"""Stream state, K/V pages, scheduling and execution, and the sequential reference generator.

This package's only import surface for the server, the command line, the benchmarks and
PushT: import from `streamworld.engine`, not from its modules.
"""

from .engine import AsyncEngine, EngineConfig, Overloaded, StreamError, StreamHandle, Unsupported
from .executor import on_torch_thread
from .reference import GenerationRequest, GenerationResult, ReferenceGenerator
from .scheduler import SchedulerConfig
from .stream import ACTION_POLICIES, PRIORITY_CLASSES, ChunkOutput, StreamRequest

__all__ = [
    "ACTION_POLICIES",
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
    "on_torch_thread",
]
