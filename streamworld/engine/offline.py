"""Offline generation: many finite streams at once through an in-process engine.

The counterpart of the server for code that wants whole videos rather than live streams
(as vLLM's `LLM.generate` is to its async engine): `generate_all` opens every request as a
stream of one engine, whose scheduler batches them as it batches live streams, and returns
each stream's frames once all are done. A stream's frames are the reference generator's
for the same request, up to float rounding (the engine's contract, tests/test_engine.py);
run one at a time through `ReferenceGenerator`, the same requests cost a DiT call each per
stream and step instead of one per batch.

    frames = generate_all_sync(model, [StreamRequest(seed=s, num_chunks=4, ...) for s in seeds])
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..models.world_model import WorldModel
from .config import EngineConfig, SchedulerConfig
from .engine import AsyncEngine
from .handle import StreamHandle
from .request import StreamError, StreamRequest


def offline_config(streams: int, batch_units: int | None = None) -> EngineConfig:
    """An engine that holds `streams` streams at once and batches `batch_units` units (all
    the streams' by default): no deadline applies (a caller waits for every stream) and no
    chunk is held back. Planning's engine is one too (`planning.planning_engine_config`)."""
    return EngineConfig(
        ttff_budget_s=1e3,
        scheduler=SchedulerConfig(
            lookahead_chunks=1e6, max_batch_units=max(16, streams if batch_units is None else batch_units)
        ),
        max_streams=max(1, streams),
        max_queue=max(16, streams),  # where memory caps the K/V pool, the rest wait their turn
    )


async def generate_all(
    model: WorldModel, requests: list[StreamRequest], config: EngineConfig | None = None
) -> list[np.ndarray]:
    """The frames [T, H, W, 3] uint8 of each request (each with `num_chunks` set), in
    order. Raises ValueError for a request without an end or paced as `interactive` (its
    chunks would wait for a playback clock), and StreamError if a stream fails or ends
    early; the engine's close then cancels the others."""
    if any(r.num_chunks is None for r in requests):
        raise ValueError("offline generation needs num_chunks on every request")
    if any(r.priority == "interactive" for r in requests):
        raise ValueError("offline streams are not paced: give them the standard or batch priority")
    if not requests:
        return []
    async with AsyncEngine(model, config or offline_config(len(requests))) as engine:
        handles = [engine.open_stream(r) for r in requests]
        return list(await asyncio.gather(*(_frames(h) for h in handles)))


def generate_all_sync(
    model: WorldModel, requests: list[StreamRequest], config: EngineConfig | None = None
) -> list[np.ndarray]:
    """`generate_all` for code without an event loop of its own (a training loop); from
    inside a running loop, await `generate_all` instead."""
    return asyncio.run(generate_all(model, requests, config))


async def _frames(handle: StreamHandle) -> np.ndarray:
    chunks = [chunk.frames async for chunk in handle]  # a failed stream raises StreamError
    if handle.status != "completed" or not chunks:
        raise StreamError(f"stream {handle.id} ended {handle.status} before its last chunk")
    return np.concatenate(chunks)
