"""Replicas on the CPU: two engines serving one model as one pool (ReplicaSet)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from streamworld.engine import AsyncEngine, Overloaded, ReplicaSet, StreamRequest
from streamworld.engine.scheduler import ReplicaLoad, choose_replica
from tests.test_engine import assert_matches, collect, engine_config, reference


def two_replicas(model, max_streams: int = 2, max_queue: int = 16) -> ReplicaSet:
    # Each pool holds `max_streams` noisy streams; both engines share the model's weights.
    engines = [
        AsyncEngine(model, engine_config(max_streams=max_streams, max_queue=max_queue, trace=True))
        for _ in range(2)
    ]
    return ReplicaSet(engines)


def test_the_choice_prefers_free_pages_then_fewer_streams_of_the_class_then_short_queues():
    loads = [
        ReplicaLoad(0, admits_now=True, free_pages=10, waiting=0, live_in_class=3),
        ReplicaLoad(1, admits_now=True, free_pages=20, waiting=0, live_in_class=5),
        ReplicaLoad(2, admits_now=False, free_pages=30, waiting=1, live_in_class=0),
    ]
    assert choose_replica(loads) == 1
    tied = [ReplicaLoad(i, True, 10, 0, live) for i, live in enumerate([2, 1, 1])]
    assert choose_replica(tied) == 1
    full = [ReplicaLoad(0, False, 0, 3, 0), ReplicaLoad(1, False, 0, 1, 4)]
    assert choose_replica(full) == 1


@pytest.mark.slow
async def test_eight_streams_spread_over_two_replicas_and_match_the_reference(tiny_model):
    modes = ["clean", "final", "noisy", "noisy"] * 2
    async with two_replicas(tiny_model) as replicas:
        handles = [
            replicas.open_stream(StreamRequest(seed=i, num_chunks=2, kv_mode=m)) for i, m in enumerate(modes)
        ]
        assert len({h.id for h in handles}) == 8  # one id space
        results = await asyncio.gather(*(collect(h) for h in handles))
        replicas_used = {h.replica for h in handles}
        assert replicas_used == {0, 1}
        assert all(e.stats.chunks_delivered > 0 for e in replicas.engines)
        assert replicas.pages_used == 0 and replicas.live_streams() == 0 and replicas.waiting == 0
    for (seed, mode), outputs in zip(enumerate(modes), results, strict=True):
        assert_matches(outputs, reference(tiny_model, seed, 2, "", mode))


async def test_a_full_replica_does_not_block_admission_to_the_other(tiny_model):
    async with two_replicas(tiny_model, max_streams=1) as replicas:
        first = replicas.open_stream(StreamRequest(seed=1, num_chunks=None, kv_mode="noisy"))
        await first.admitted()
        second = replicas.open_stream(StreamRequest(seed=2, num_chunks=2, kv_mode="noisy"))
        assert second.replica != first.replica
        assert second.queue_position == 0 and second.status == "running"  # admitted at once
        outputs = await collect(second)
        first.cancel()
    assert_matches(outputs, reference(tiny_model, 2, 2, "", "noisy"))


async def test_cancelling_on_one_replica_leaves_the_other_unchanged(tiny_model):
    async with two_replicas(tiny_model, max_streams=1) as replicas:
        victim = replicas.open_stream(StreamRequest(seed=3, num_chunks=None, kv_mode="clean"))
        survivor = replicas.open_stream(StreamRequest(seed=4, num_chunks=3, kv_mode="final"))
        assert victim.replica != survivor.replica
        task = asyncio.create_task(collect(survivor))
        await asyncio.sleep(0.05)
        victim.cancel()
        outputs = await task
        assert replicas.engines[victim.replica].pages_used == 0
    assert_matches(outputs, reference(tiny_model, 4, 3, "", "final"))


async def test_a_waiting_stream_moves_to_the_replica_that_frees_up_first(tiny_model):
    async with two_replicas(tiny_model, max_streams=1) as replicas:
        long_a = replicas.open_stream(StreamRequest(seed=5, num_chunks=None, kv_mode="noisy"))
        long_b = replicas.open_stream(StreamRequest(seed=6, num_chunks=None, kv_mode="noisy"))
        queued = replicas.open_stream(StreamRequest(seed=7, num_chunks=2, kv_mode="noisy"))
        assert queued.status == "waiting" and replicas.waiting == 1
        # Whichever replica it queued on, the other one frees up first: it moves there.
        other = long_b if queued.replica == long_a.replica else long_a
        other.cancel()
        await asyncio.wait_for(queued.admitted(), 10)
        assert queued.replica == other.replica and queued.status == "running"
        outputs = await collect(queued)
        for h in (long_a, long_b):
            h.cancel()
        await asyncio.sleep(0)
        assert replicas.pages_used == 0 and replicas.waiting == 0
    assert_matches(outputs, reference(tiny_model, 7, 2, "", "noisy"))


async def test_the_queue_bound_counts_both_replicas(tiny_model):
    async with two_replicas(tiny_model, max_streams=1, max_queue=2) as replicas:

        def noisy(seed: int, chunks: int | None) -> StreamRequest:
            return StreamRequest(seed=seed, num_chunks=chunks, kv_mode="noisy")

        held = [replicas.open_stream(noisy(i, None)) for i in range(2)]
        queued = [replicas.open_stream(noisy(10 + i, 1)) for i in range(2)]
        assert {q.replica for q in queued} == {0, 1}  # the shorter queue each time
        with pytest.raises(Overloaded):
            replicas.open_stream(noisy(20, 1))
        for h in held + queued:
            h.cancel()


async def test_a_server_with_two_replicas_spreads_sessions_and_labels_its_metrics(tiny_model):
    import re

    import aiohttp

    from streamworld.client import StreamWorldClient
    from tests.test_server import FAST, expected_frames, start_server

    config = dataclasses.replace(FAST, max_streams=1)
    _, running = await start_server({"tiny-wan": [tiny_model, tiny_model]}, config)
    url, base = f"ws://127.0.0.1:{running.port}/v1/stream", f"http://127.0.0.1:{running.port}"
    try:

        async def session(seed: int) -> tuple[int, np.ndarray]:
            async with StreamWorldClient(url, seed=seed, num_chunks=2, format="rgb") as c:
                frames = [chunk.frames async for chunk in c.chunks()]
                return c.info.raw["replica"], np.concatenate(frames)

        results = await asyncio.gather(*(session(seed) for seed in range(4)))
        assert {replica for replica, _ in results} == {0, 1}
        for seed, (_, frames) in enumerate(results):
            assert np.abs(frames.astype(int) - expected_frames(tiny_model, seed, 2).astype(int)).max() <= 2
        async with aiohttp.ClientSession() as http:
            metrics = await (await http.get(f"{base}/metrics")).text()
            health = await (await http.get(f"{base}/healthz")).json()
        assert health["replicas"] == {"tiny-wan": 2}
        for replica in ("0", "1"):
            assert re.search(
                rf'^streamworld_kv_pages_used{{model="tiny-wan",replica="{replica}"}} 0\.0$', metrics, re.M
            )
            assert re.search(
                rf'^streamworld_sessions_active{{model="tiny-wan",replica="{replica}"}} 0\.0$', metrics, re.M
            )
        assert re.search(r'^streamworld_sessions_waiting{model="tiny-wan"} 0\.0$', metrics, re.M)
    finally:
        await running.close()
