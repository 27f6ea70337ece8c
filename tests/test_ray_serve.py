"""StreamWorld on Ray Serve: two CPU replicas of `pusht` on a local Ray instance.

Marked `ray` and left out of the default run (Ray is an optional extra); CI installs
`.[ray]` and runs `python -m pytest -m ray`. One local Ray and one application serve the
whole module, about a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import time
import urllib.request

import numpy as np
import pytest
import websockets

from streamworld.client import StreamWorldClient, StreamWorldError
from streamworld.deploy.config import validate
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.models import get_preset
from streamworld.models.world_model import WorldModel
from streamworld.pusht.world import initial_frame

pytestmark = pytest.mark.ray

APP = "streamworld-test"
DEPLOY = {
    "server": {"host": "127.0.0.1"},
    # 3 sessions per replica; 1 more may wait in a replica's queue.
    "engine": {"max_sessions": 3, "max_queue": 1, "threads": 1},
    "models": [{"model": "pusht", "device": "cpu"}],
    "ray": {"min_replicas": 2, "max_replicas": 2, "num_cpus": 1, "name": APP},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    # In the fixture, not at import: the default run deselects these tests without Ray.
    ray = pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray]"')
    from ray import serve

    from streamworld.deploy import ray_serve

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_serve.application(validate(DEPLOY, "test")), name=APP, route_prefix="/")
        yield f"ws://127.0.0.1:{port}/v1/stream", f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def pusht() -> WorldModel:
    return WorldModel.load(get_preset("pusht"))


def _health(http: str) -> dict:
    with urllib.request.urlopen(f"{http}/healthz", timeout=10) as r:
        return json.loads(r.read())


def _pages_by_instance(http: str, want: int = 2, tries: int = 60) -> dict[str, int]:
    """K/V pages in use per replica: /healthz answers from either, so ask until both have."""
    seen: dict[str, int] = {}
    for _ in range(tries):
        body = _health(http)
        seen[body["instance"]] = body["kv_pages_used"]["pusht"]
        if len(seen) >= want and not any(seen.values()):
            break
        time.sleep(0.1)
    return seen


async def _session(url: str, seed: int, actions: np.ndarray, chunks: int = 2):
    async with StreamWorldClient(url, seed=seed, num_chunks=chunks, format="rgb", action_policy="wait") as c:
        await c.send_actions(actions, frame=0)
        frames = np.concatenate([ch.frames async for ch in c.chunks()])
        return c.info.instance, c.done_reason, frames


def _expected(pusht: WorldModel, seed: int, actions: np.ndarray) -> np.ndarray:
    image, _ = initial_frame(seed)
    request = GenerationRequest(seed=seed, num_chunks=2, image=image, actions=actions.astype(np.float32))
    return ReferenceGenerator(pusht).generate(request).frames


async def test_six_sessions_spread_over_both_replicas_with_the_reference_frames(app_url, pusht):
    url, http = app_url
    rng = np.random.default_rng(0)
    plans = {seed: rng.uniform(100, 400, size=(8, 2)) for seed in range(20, 26)}
    results = await asyncio.wait_for(
        asyncio.gather(*(_session(url, seed, actions) for seed, actions in plans.items())), 240
    )
    per_replica = collections.Counter(instance for instance, _, _ in results)
    assert len(per_replica) == 2 and all(n >= 1 for n in per_replica.values()), per_replica
    for (seed, actions), (_, reason, frames) in zip(plans.items(), results, strict=True):
        assert reason == "completed"
        assert np.abs(frames.astype(int) - _expected(pusht, seed, actions).astype(int)).max() <= 2
    assert _pages_by_instance(http) == dict.fromkeys(per_replica, 0)


async def test_a_disconnect_frees_its_replicas_pages(app_url):
    url, http = app_url
    async with websockets.connect(url, max_size=2**24) as ws:
        await ws.send(json.dumps({"type": "session.start", "format": "rgb", "num_chunks": None, "seed": 3}))
        started = json.loads(await ws.recv())
        assert started["type"] == "session.started" and started["instance"]
        assert json.loads(await ws.recv())["type"] == "chunk"
        body = _health(http)
        for _ in range(50):  # until /healthz answers from the replica that holds the session
            if body["instance"] == started["instance"]:
                break
            body = _health(http)
        assert body["instance"] == started["instance"] and body["kv_pages_used"]["pusht"] > 0
    pages = _pages_by_instance(http)
    assert pages.get(started["instance"]) == 0 and not any(pages.values())


async def test_a_full_cluster_queues_then_refuses_as_documented(app_url):
    """2 replicas whose pools hold 3 `noisy` sessions each, with a queue of 1 each: sessions
    opened one by one start until the pools are full, then wait in a replica's queue
    (session.queued), then are refused with overloaded and close 1013; once the running
    sessions end, every waiting one is admitted and completes. (Which replica takes each is
    Ray's router's choice, so the test does not assume an even split.)"""
    url, http = app_url
    started: list[StreamWorldClient] = []
    waiting: list[tuple[StreamWorldClient, asyncio.Task]] = []
    refused: list[StreamWorldClient] = []
    try:
        for seed in range(40, 52):
            queued: list[int] = []
            client = StreamWorldClient(
                url,
                seed=seed,
                num_chunks=None,
                format="jpeg",
                kv_mode="noisy",
                on_queued=queued.append,
            )
            task = asyncio.create_task(client.start())
            for _ in range(150):
                if queued or task.done():
                    break
                await asyncio.sleep(0.1)
            if queued and not task.done():
                assert queued == [1]
                waiting.append((client, task))
                continue
            assert task.done(), "neither started, queued nor refused within 15 s"
            if task.exception() is None:
                assert not waiting, "a session started while another waited: a replica had room"
                started.append(client)
                continue
            err = task.exception()
            assert (
                isinstance(err, StreamWorldError) and err.code == "overloaded" and client.close_code == 1013
            )
            refused.append(client)
            break
        assert len(started) <= 6 and 1 <= len(waiting) <= 2 and len(refused) == 1
        assert {c.info.instance for c in started} and len({c.info.instance for c in started}) == 2
        # The running sessions end: every waiting session is admitted and completes.
        for c in started:
            await c.close()
        for c, task in waiting:
            await asyncio.wait_for(task, 60)
            first = await asyncio.wait_for(anext(aiter(c.chunks())), 60)
            assert first.index == 0
    finally:
        for c, task in waiting:
            task.cancel()
            await c.close()
        for c in started + refused:
            await c.close()
    assert not any(_pages_by_instance(http).values())


async def test_a_replica_removed_mid_session_leaves_the_other_replicas_sessions_whole(app_url, pusht):
    import ray
    from ray import serve

    url, http = app_url
    rng = np.random.default_rng(1)
    plans = {seed: rng.uniform(100, 400, size=(8, 2)) for seed in range(30, 34)}
    clients = {
        seed: StreamWorldClient(url, seed=seed, num_chunks=2, format="rgb", action_policy="wait")
        for seed in plans
    }
    for c in clients.values():
        await asyncio.wait_for(c.start(), 60)
    instances = {c.info.instance for c in clients.values()}
    assert len(instances) == 2
    victim = next(iter(sorted(instances)))
    replica = next(
        name
        for name in (a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
        if name.startswith(f"SERVE_REPLICA::{APP}#") and name.endswith(victim)
    )
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
    for seed, c in clients.items():
        await c.send_actions(plans[seed], frame=0)
    survivors = 0
    for seed, c in clients.items():
        if c.info.instance == victim:
            with pytest.raises((StreamWorldError, websockets.ConnectionClosed, ConnectionError)):
                async for _ in c.chunks():
                    pass
            continue
        frames = np.concatenate([ch.frames async for ch in c.chunks()])
        assert c.done_reason == "completed"
        assert np.abs(frames.astype(int) - _expected(pusht, seed, plans[seed]).astype(int)).max() <= 2
        survivors += 1
    for c in clients.values():
        await c.close()
    assert survivors >= 1
    # Ray replaces the replica; the application serves again on both.
    for _ in range(120):
        if (
            serve.status().applications[APP].status == "RUNNING"
            and len(_pages_by_instance(http, tries=20)) == 2
        ):
            break
        time.sleep(0.5)
    assert serve.status().applications[APP].status == "RUNNING"


async def test_the_load_generator_reports_each_replica_and_every_page_back(app_url):
    """The load generator's per-replica report: the sessions each replica served and its K/V
    pages after the run. How Ray's router splits 4 sessions opened together is its own
    choice (a probe that a busy replica answers late sends the burst to the other one), so
    the test counts sessions over the replicas rather than assuming both took some."""
    from loadtests import run

    url, _ = app_url
    cfg = run.LoadConfig(
        url=url,
        duration_s=4.0,
        sessions=4,
        cancel_share=0.0,
        slow_share=0.0,
        priorities=run.parse_mix("standard:1", run.PRIORITIES, "p"),
        formats=run.parse_mix("jpeg:1", run.FORMATS, "f"),
        drain_s=30.0,
        seed=1,
    )
    result = await asyncio.wait_for(run.run_load(cfg, progress=False), 120)
    instances = result["server"]["instances"]
    assert 1 <= len(instances) <= 2 and sum(v["sessions"] for v in instances.values()) == 4, instances
    assert all(v["kv_pages_used_after"] == 0 for v in instances.values()), instances
    assert result["overall"]["errors"] == {} and run.check(result) == []
    assert f"servers: {len(instances)} instances" in run.format_report(result)
