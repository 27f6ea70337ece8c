"""Stream state, K/V pages, scheduling and execution, and the sequential reference generator."""

from .engine import AsyncEngine, EngineConfig, Overloaded, StreamError, StreamHandle
from .reference import GenerationRequest, GenerationResult, ReferenceGenerator
from .scheduler import SchedulerConfig
from .stream import ChunkOutput, StreamRequest

__all__ = [
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
]
