"""The WebSocket server against PROTOCOL.md, with a real server on a free port and real clients."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import numpy as np
import pytest
import websockets
from aiohttp import web

from streamworld.client import StreamWorldClient, StreamWorldError
from streamworld.engine.engine import EngineConfig
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.engine.scheduler import SchedulerConfig
from streamworld.server.app import ServerConfig, StreamWorldServer
from streamworld.server.session import SessionLimits
from tests.conftest import load_tiny

FAST = EngineConfig(
    ttff_budget_s=1e3, scheduler=SchedulerConfig(lookahead_chunks=1e6), max_streams=4, max_queue=16
)
TEXT_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def models(tiny_model):
    act = load_tiny(action_dim=2)
    object.__setattr__(act.config, "id", "tiny-act")
    return {"tiny-wan": tiny_model, "tiny-act": act}


class RunningServer:
    """The app under an AppRunner configured as `web.run_app` configures it (a client leaving
    does not cancel its handler), on a free loopback port."""

    def __init__(self, app) -> None:
        self.runner = web.AppRunner(app, handler_cancellation=False)

    async def start(self) -> RunningServer:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        await self.runner.cleanup()


class RunningAsgiServer:
    """The same server as an ASGI application under uvicorn, run by `serve_asgi` as
    `streamworld serve --transport asgi` runs it, on a free loopback port; `close` stops it
    as SIGTERM does (drain, then the port closes)."""

    def __init__(self, server: StreamWorldServer) -> None:
        self.server = server
        self.stop = asyncio.Event()

    async def start(self) -> RunningAsgiServer:
        from streamworld.server.asgi import serve_asgi

        bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(
            serve_asgi(self.server, "127.0.0.1", 0, "warning", self.stop, announce=bound.set_result)
        )
        done, _ = await asyncio.wait({bound, self.task}, return_when=asyncio.FIRST_COMPLETED)
        assert bound in done, "uvicorn did not start"
        self.port = bound.result()
        return self

    async def close(self) -> None:
        self.stop.set()
        await self.task


TRANSPORTS = ["aiohttp", "asgi"]


async def start_server(
    models, engine_config=FAST, limits=None, max_text_frame=TEXT_LIMIT, transport="aiohttp"
):
    limits = limits or SessionLimits()
    server = StreamWorldServer(
        models,
        engine_config,
        ServerConfig(max_text_frame=max_text_frame, limits=limits),
        default_model="tiny-wan" if "tiny-wan" in models else None,
    )
    if transport == "asgi":
        return server, await RunningAsgiServer(server).start()
    return server, await RunningServer(server.build_app()).start()


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    """Each test that takes it runs over both transports (protocol v1 is the same on both)."""
    return request.param


@pytest.fixture
async def served(models, transport):
    server, test_server = await start_server(models, transport=transport)
    yield server, f"ws://127.0.0.1:{test_server.port}/v1/stream", f"http://127.0.0.1:{test_server.port}"
    await test_server.close()


def expected_frames(model, seed, chunks, kv_mode=None, prompt="", actions=None):
    req = GenerationRequest(seed=seed, num_chunks=chunks, prompt=prompt, kv_mode=kv_mode, actions=actions)
    return ReferenceGenerator(model).generate(req).frames


async def metric(http: str, name: str, model: str = "tiny-wan") -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{http}/metrics") as r:
        text = await r.text()
    m = re.search(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


async def raw_session(url: str, *messages, max_size: int = 2**24):
    """Sends text messages on a raw WebSocket; returns (decoded text replies, close code)."""
    replies = []
    async with websockets.connect(url, max_size=max_size) as ws:
        for m in messages:
            await ws.send(m if isinstance(m, bytes | str) else json.dumps(m))
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                reply = await asyncio.wait_for(ws.recv(), 10)
                if isinstance(reply, str):
                    replies.append(json.loads(reply))
    return replies, ws.close_code


# --- streaming -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["rgb", "jpeg", "h264", "fmp4"])
async def test_every_format_decodes_to_the_announced_frames(served, fmt, tiny_model):
    _, url, _ = served
    cfg = tiny_model.config
    async with StreamWorldClient(url, model="tiny-wan", format=fmt, num_chunks=3, seed=1) as c:
        assert c.info.format == fmt and c.info.width == cfg.width and c.info.height == cfg.height
        if fmt in ("h264", "fmp4"):
            assert c.info.codec.startswith("avc1.")
        chunks = [ch async for ch in c.chunks()]
        assert c.done_reason == "completed"
    assert [ch.num_frames for ch in chunks] == [
        cfg.first_chunk_frames,
        cfg.frames_per_chunk,
        cfg.frames_per_chunk,
    ]
    for ch in chunks:
        assert ch.frames.shape == (ch.num_frames, cfg.height, cfg.width, 3)
        assert {"queued", "dit", "decode", "encode", "total"} <= set(ch.timings)
    frames = np.concatenate([ch.frames for ch in chunks])
    expected = expected_frames(tiny_model, 1, 3)
    err = np.abs(frames.astype(float) - expected.astype(float)).mean()
    # tiny-wan frames are structured noise, the hardest content for lossy codecs; unrelated
    # frames would differ by about 70 levels.
    assert err < (0.01 if fmt == "rgb" else 25), err


async def test_rgb_frames_equal_generate_with_several_sessions_at_once(served, models):
    _, url, _ = served
    specs = [("tiny-wan", 2, "clean", "a"), ("tiny-wan", 3, "noisy", "b"), ("tiny-act", 4, "final", "")]

    async def run(model, seed, mode, prompt):
        async with StreamWorldClient(
            url, model=model, format="rgb", num_chunks=2, seed=seed, kv_mode=mode, prompt=prompt or None
        ) as c:
            return np.concatenate([ch.frames async for ch in c.chunks()])

    results = await asyncio.gather(*(run(*s) for s in specs))
    for (model, seed, mode, prompt), frames in zip(specs, results, strict=True):
        expected = expected_frames(models[model], seed, 2, mode, prompt)
        assert frames.shape == expected.shape
        assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 2


async def test_actions_reach_the_model(served, models):
    _, url, _ = served
    model = models["tiny-act"]
    cfg = model.config
    n = 1 + cfg.temporal_ratio * (2 * cfg.latent_frames_per_chunk - 1)
    actions = np.random.default_rng(0).normal(size=(n, 2)).astype(np.float32).round(3)
    async with StreamWorldClient(
        url, model="tiny-act", format="rgb", num_chunks=2, seed=5, action_policy="wait"
    ) as c:
        await c.send_actions(actions[:10].tolist())
        await c.send_actions(actions[10:].tolist(), frame=10)
        frames = np.concatenate([ch.frames async for ch in c.chunks()])
    expected = expected_frames(model, 5, 2, actions=actions)
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 2
    without = expected_frames(model, 5, 2)
    assert np.abs(frames.astype(int) - without.astype(int)).max() > 2


async def test_health_models_and_metrics_endpoints(served):
    _, url, http = served
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{http}/healthz") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(f"{http}/v1/models") as r:
            models = {m["id"]: m for m in (await r.json())["models"]}
        async with s.get(f"{http}/") as r:
            assert r.status == 200 and "StreamWorld" in await r.text()
    keys = {
        "id",
        "width",
        "height",
        "fps",
        "latent_frames_per_chunk",
        "frames_per_chunk",
        "first_chunk_frames",
        "action_dim",
        "needs_image",
        "takes_prompt",
        "kv_modes",
        "default_kv_mode",
    }
    assert keys <= set(models["tiny-wan"])
    assert models["tiny-act"]["action_dim"] == 2
    async with StreamWorldClient(url, format="jpeg", num_chunks=2) as c:
        async for _ in c.chunks():
            pass
    for name in (
        "streamworld_sessions_active",
        "streamworld_sessions_waiting",
        "streamworld_kv_pages_used",
        "streamworld_kv_pages_total",
        "streamworld_time_to_first_frame_seconds_count",
        "streamworld_inter_chunk_seconds_count",
        "streamworld_action_to_frame_seconds_count",
        "streamworld_chunk_deadline_miss_total",
        "streamworld_frames_generated_total",
        "streamworld_batch_size_count",
    ):
        await metric(http, name)
    assert await metric(http, "streamworld_frames_generated_total") >= 21
    assert await metric(http, "streamworld_time_to_first_frame_seconds_count") == 1
    assert await metric(http, "streamworld_kv_pages_total") > 0


# --- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "first, code, close",
    [
        ("{not json", "bad_request", 1008),
        ({"type": "hello"}, "bad_request", 1008),
        ({"type": "action", "actions": [[0, 0]]}, "bad_request", 1008),
        ({"type": "session.start", "seed": "x"}, "bad_request", 1008),
        ({"type": "session.start", "seed": True}, "bad_request", 1008),
        ({"type": "session.start", "num_chunks": 0}, "bad_request", 1008),
        ({"type": "session.start", "priority": "urgent"}, "bad_request", 1008),
        ({"type": "session.start", "model": "nope"}, "unsupported", 1008),
        ({"type": "session.start", "format": "gif"}, "unsupported", 1008),
        ({"type": "session.start", "kv_mode": "fuzzy"}, "unsupported", 1008),
        ({"type": "session.start", "image": "aGVsbG8="}, "bad_request", 1008),
        ([1, 2], "bad_request", 1008),
    ],
)
async def test_an_invalid_start_gets_an_error_and_close_1008(served, first, code, close):
    _, url, _ = served
    replies, close_code = await raw_session(url, first)
    assert replies and replies[0]["type"] == "error" and replies[0]["code"] == code
    assert replies[0]["message"]
    assert close_code == close


async def test_bad_starts_do_not_disturb_a_running_session(served, models):
    _, url, _ = served
    bystander = asyncio.create_task(_frames(url, "tiny-wan", 11, 3))
    for first in ("{not json", {"type": "hello"}, {"type": "session.start", "format": "gif"}, b"\x00"):
        _, code = await raw_session(url, first)
        assert code in (1003, 1008)
    frames = await bystander
    expected = expected_frames(models["tiny-wan"], 11, 3)
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 2


async def test_oversize_text_and_binary_frames_close_the_connection(served):
    _, url, _ = served
    big = json.dumps({"type": "session.start", "prompt": "x" * (TEXT_LIMIT + 10)})
    _, code = await raw_session(url, big)
    assert code == 1009
    _, code = await raw_session(url, b"\x00\x01")
    assert code == 1003
    # Also during a session.
    async with websockets.connect(url, max_size=2**24) as ws:
        await ws.send(json.dumps({"type": "session.start", "format": "rgb", "num_chunks": None}))
        assert json.loads(await ws.recv())["type"] == "session.started"
        await ws.send(b"binary")
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    assert ws.close_code == 1003


async def test_invalid_messages_during_a_session_get_errors_and_the_session_goes_on(served, models):
    _, url, _ = served
    model = models["tiny-act"]
    bystander = asyncio.create_task(_frames(url, "tiny-wan", 8, 2))
    async with StreamWorldClient(url, model="tiny-act", format="rgb", num_chunks=2, seed=6) as c:
        await c._send({"type": "action", "actions": [[1.0, 2.0, 3.0]]})  # wrong length
        await c._send({"type": "action", "actions": [[1.0, "x"]]})
        await c._ws.send('{"type": "action", "actions": [[1.0, NaN]]}')  # Python's JSON reads NaN
        await c._send({"type": "warp"})
        await c._send({"type": "session.start"})
        frames = np.concatenate([ch.frames async for ch in c.chunks()])
        codes = [e.code for e in c.errors]
        assert c.done_reason == "completed"
    assert codes == ["bad_request"] * 5, codes
    expected = expected_frames(model, 6, 2)  # nothing valid was queued: zeros held
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 2
    other = await bystander
    assert np.abs(other.astype(int) - expected_frames(models["tiny-wan"], 8, 2).astype(int)).max() <= 2


async def _frames(url, model, seed, chunks):
    async with StreamWorldClient(url, model=model, format="rgb", num_chunks=chunks, seed=seed) as c:
        return np.concatenate([ch.frames async for ch in c.chunks()])


# --- lifecycle -----------------------------------------------------------------------------
async def test_disconnect_mid_stream_frees_the_pages(served):
    _, url, http = served
    async with websockets.connect(url, max_size=2**24) as ws:
        await ws.send(json.dumps({"type": "session.start", "format": "rgb", "num_chunks": None}))
        assert json.loads(await ws.recv())["type"] == "session.started"
        assert json.loads(await ws.recv())["type"] == "chunk"
        assert await metric(http, "streamworld_kv_pages_used") > 0
    # Gone in the middle of the next chunks.
    for _ in range(100):
        if await metric(http, "streamworld_kv_pages_used") == 0:
            break
        await asyncio.sleep(0.05)
    assert await metric(http, "streamworld_kv_pages_used") == 0
    assert await metric(http, "streamworld_sessions_active") == 0


@pytest.mark.slow
async def test_a_client_that_stops_reading_does_not_hold_up_others(models, transport):
    limits = SessionLimits(pause_chunks=1, slow_client_timeout_s=1.0)
    model = load_tiny(height=256, width=256)  # big rgb chunks fill the socket buffers quickly
    server, test_server = await start_server({"tiny-wan": model}, limits=limits, transport=transport)
    url = f"ws://127.0.0.1:{test_server.port}/v1/stream"
    try:
        # Unread frames sit ahead of the server's close frame, so the closing handshake at
        # the end cannot complete: do not wait the library's default 10 s for it.
        slow = await websockets.connect(url, max_size=2**26, max_queue=1, close_timeout=0.5)
        await slow.send(json.dumps({"type": "session.start", "format": "rgb", "num_chunks": None}))
        slow.transport.pause_reading()  # stop reading: TCP backpressure builds up
        frames = await _frames(url, "tiny-wan", 3, 3)
        assert frames.shape[0] == model.config.first_chunk_frames + 2 * model.config.frames_per_chunk
        # The slow session was paused, never ran far ahead, and is ended within its timeout.
        (engine,) = server.models["tiny-wan"].engine.engines
        for _ in range(200):
            if not server.sessions:
                break
            for s in server.sessions:
                assert len(s.outgoing) <= limits.pause_chunks + 1
            await asyncio.sleep(0.05)
        assert not server.sessions
        assert engine.pool.pages_used == 0
        slow.transport.resume_reading()
        await slow.close()
    finally:
        await test_server.close()


async def test_sixteen_sessions_complete_and_excess_ones_are_queued(models):
    cfg = EngineConfig(
        ttff_budget_s=1e3, scheduler=SchedulerConfig(lookahead_chunks=1e6), max_streams=4, max_queue=16
    )
    _, test_server = await start_server(models, engine_config=cfg)
    url = f"ws://127.0.0.1:{test_server.port}/v1/stream"
    queued = []
    try:

        async def one(i):
            async with StreamWorldClient(
                url, format="jpeg", num_chunks=1, seed=i, kv_mode="noisy", on_queued=queued.append
            ) as c:
                chunks = [ch async for ch in c.chunks()]
                return c.done_reason, len(chunks)

        results = await asyncio.gather(*(one(i) for i in range(16)))
    finally:
        await test_server.close()
    assert results == [("completed", 1)] * 16
    assert queued, "with 4 sessions' worth of pages, some of 16 must have been queued"
    assert all(p >= 1 for p in queued)


async def test_queue_overflow_is_refused_with_overloaded(models, transport):
    cfg = EngineConfig(ttff_budget_s=1e3, max_streams=1, max_queue=0)
    _, test_server = await start_server(models, engine_config=cfg, transport=transport)
    url = f"ws://127.0.0.1:{test_server.port}/v1/stream"
    try:
        async with StreamWorldClient(url, format="jpeg", num_chunks=None, kv_mode="noisy"):
            replies, code = await raw_session(url, {"type": "session.start", "kv_mode": "noisy"})
            assert replies[0]["code"] == "overloaded" and code == 1013
    finally:
        await test_server.close()


async def test_graceful_shutdown_ends_live_sessions_with_done(models, transport):
    server, test_server = await start_server(models, transport=transport)
    url = f"ws://127.0.0.1:{test_server.port}/v1/stream"
    clients = [StreamWorldClient(url, format="jpeg", num_chunks=None, seed=i) for i in range(2)]
    for c in clients:
        await c.start()
    for c in clients:
        async for _ in c.chunks():
            break
    await test_server.close()  # runs on_shutdown and on_cleanup, as SIGTERM does under run_app
    for c in clients:
        async for _ in c.chunks():
            pass
        assert c.done_reason == "stopped"
        assert c.close_code == 1000
        await c.close()
    (engine,) = server.models["tiny-wan"].engine.engines
    assert engine.pool.pages_used == 0 and engine.pool.reserved == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
async def test_serve_command_exits_cleanly_on_sigterm():
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamworld", "serve", "--port", str(port), "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        url = f"ws://127.0.0.1:{port}/v1/stream"
        deadline = time.monotonic() + 60
        while True:
            try:
                client = StreamWorldClient(url, format="jpeg", num_chunks=None)
                await client.start()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                await asyncio.sleep(0.2)
        async for _ in client.chunks():
            break
        proc.send_signal(signal.SIGTERM)
        async for _ in client.chunks():
            pass
        assert client.done_reason == "stopped"
        await client.close()
        rc = await asyncio.to_thread(proc.wait, 30)
        if rc != 0:
            print(proc.stdout.read()[-4000:])
        assert rc == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_start_errors_surface_in_the_client(served):
    _, url, _ = served
    with pytest.raises(StreamWorldError) as info:
        async with StreamWorldClient(url, model="nope"):
            pass
    assert info.value.code == "unsupported"


async def test_stop_while_queued_ends_with_done(models):
    cfg = EngineConfig(ttff_budget_s=1e3, max_streams=1, max_queue=4)
    _, test_server = await start_server(models, engine_config=cfg)
    url = f"ws://127.0.0.1:{test_server.port}/v1/stream"
    try:
        async with (
            StreamWorldClient(url, format="jpeg", num_chunks=None, kv_mode="noisy"),
            websockets.connect(url) as ws,
        ):
            await ws.send(json.dumps({"type": "session.start", "kv_mode": "noisy"}))
            assert json.loads(await ws.recv()) == {"type": "session.queued", "position": 1}
            await ws.send(json.dumps({"type": "session.stop"}))
            done = json.loads(await ws.recv())
            assert done == {"type": "session.done", "reason": "stopped", "chunks": 0}
            with pytest.raises(websockets.ConnectionClosedOK):
                await ws.recv()
    finally:
        await test_server.close()


async def test_actions_far_in_the_future_are_refused_and_the_session_goes_on(served):
    _, url, _ = served
    async with StreamWorldClient(url, model="tiny-act", format="rgb", num_chunks=1, seed=2) as c:
        await c.send_actions([[0.1, 0.2]], frame=10**14)
        pong = await c.ping()
        chunks = [ch async for ch in c.chunks()]
        assert [e.code for e in c.errors] == ["bad_request"]
        assert "at most" in c.errors[0].message
    assert pong >= 0 and len(chunks) == 1


async def test_malformed_numbers_are_bad_requests_and_a_client_leaving_after_a_ping_is_cleaned_up(served):
    server, url, http = served
    async with StreamWorldClient(url, model="tiny-act", format="rgb", num_chunks=1, seed=3) as c:
        await c._ws.send('{"type": "action", "actions": [[0, 1%s]]}' % ("0" * 400))
        await c._ws.send('{"type": "ping", "id": %s}' % ("9" * 5000))
        assert await c.ping() >= 0
        chunks = [ch async for ch in c.chunks()]
        assert [e.code for e in c.errors] == ["bad_request", "bad_request"]
    assert len(chunks) == 1
    # A `wait` session produces nothing; its client pings and leaves without reading.
    ws = await websockets.connect(url)
    await ws.send(json.dumps({"type": "session.start", "model": "tiny-act", "action_policy": "wait"}))
    assert json.loads(await ws.recv())["type"] == "session.started"
    await ws.send(json.dumps({"type": "ping", "id": 1}))
    ws.transport.abort()
    for _ in range(100):
        if await metric(http, "streamworld_kv_pages_used", "tiny-act") == 0 and not server.sessions:
            break
        await asyncio.sleep(0.05)
    assert await metric(http, "streamworld_kv_pages_used", "tiny-act") == 0
    assert not server.sessions


async def test_acks_hold_a_slow_but_reading_client_to_its_window_and_a_silent_one_is_ended(models, transport):
    """A client that acknowledges chunks is paused at `ack_window` unacknowledged chunks
    (socket buffers would otherwise absorb its lag), resumes as it acks, and is ended with
    `too_slow` when it stops acknowledging while that far behind."""
    limits = SessionLimits(ack_window=2, slow_client_timeout_s=1.0)
    server, test_server = await start_server(models, limits=limits, transport=transport)
    url = f"ws://127.0.0.1:{test_server.port}/v1/stream"
    (engine,) = server.models["tiny-wan"].engine.engines
    try:
        # Acks each chunk as it is consumed: completes, with exactly the reference's frames.
        async with StreamWorldClient(url, format="rgb", num_chunks=4, seed=5, ack=True) as c:
            got = [ch async for ch in c.chunks()]
        assert c.done_reason == "completed" and [ch.index for ch in got] == [0, 1, 2, 3]
        frames = np.concatenate([ch.frames for ch in got])
        assert np.array_equal(frames, expected_frames(models["tiny-wan"], 5, 4))

        # Acks chunk 0, then reads everything but acknowledges nothing more.
        async with StreamWorldClient(url, format="rgb", num_chunks=None, seed=6) as c:
            session = next(s for s in server.sessions if s.id == c.info.session_id)
            seen = []
            with pytest.raises(StreamWorldError) as err:
                async for ch in c.chunks():
                    seen.append(ch.index)
                    if ch.index == 0:
                        await c.ack(0)
                    # Never more than the window (plus what had started) ahead of the acks.
                    assert session.chunks_sent - session.acked <= limits.ack_window + engine.num_steps + 1
        assert err.value.code == "too_slow" and "acknowledge" in err.value.message
        assert len(seen) <= 1 + limits.ack_window + engine.num_steps + 1
        for _ in range(100):
            if engine.pool.pages_used == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.pool.pages_used == 0

        # Acks for chunks not sent yet, or of the wrong type, are refused; the session goes on.
        async with StreamWorldClient(url, format="rgb", num_chunks=2, seed=7) as c:
            await c.ack(50)
            await c._send({"type": "ack", "chunk": "x"})
            got = [ch async for ch in c.chunks()]
            assert len(got) == 2 and c.done_reason == "completed"
            assert [e.code for e in c.errors] == ["bad_request", "bad_request"]
            assert "50" in c.errors[0].message
    finally:
        await test_server.close()


async def test_a_burst_after_a_quiet_spell_does_not_end_a_client_that_kept_up(models):
    """`too_slow` is timed from when the client fell `ack_window` behind, not from its last
    ack: a client that acked everything, then got nothing for a while (no actions under
    `wait`), is not ended when a burst of chunks arrives."""
    limits = SessionLimits(ack_window=2, slow_client_timeout_s=1.0)
    _, test_server = await start_server(models, limits=limits)
    url = f"ws://127.0.0.1:{test_server.port}/v1/stream"
    cfg = models["tiny-act"].config
    try:
        async with StreamWorldClient(
            url, model="tiny-act", format="rgb", num_chunks=None, seed=1, action_policy="wait"
        ) as c:
            await c.send_actions(np.zeros((cfg.temporal_ratio * (cfg.latent_frames_per_chunk - 1), 2)))
            chunks = c.chunks()
            first = await anext(chunks)
            await c.ack(first.index)
            await asyncio.sleep(1.5)  # longer than the timeout, with nothing to send
            await c.send_actions(np.zeros((100, 2)))
            burst = [await anext(chunks), await anext(chunks)]
            await asyncio.sleep(0.5)  # two behind for half the timeout: allowed
            await c.ack(burst[-1].index)
            await c.stop()
            rest = [ch async for ch in chunks]
        assert [ch.index for ch in burst] == [1, 2] and all(ch.index > 2 for ch in rest)
        assert c.done_reason == "stopped" and c.errors == []
    finally:
        await test_server.close()


def test_the_browser_demo_ships_inside_the_package(tmp_path):
    """A plain (not editable) install must serve the demo: the top-level web/ is installed as
    the package data of `streamworld.web`, and the server finds it there."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from streamworld.server.app import WEB_ROOT

    names = ("index.html", "app.js", "style.css")
    assert all((WEB_ROOT / name).is_file() for name in names)
    root = Path(__file__).parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(root),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
    )
    [wheel] = tmp_path.glob("streamworld-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    assert {f"streamworld/web/{name}" for name in names} <= packaged
    # pyproject lists the packages (a mapped directory defeats discovery): none may be left out.
    packages = {str(p.relative_to(root)) for p in (root / "streamworld").rglob("__init__.py")}
    assert packages <= packaged


async def _raw_transcript(url: str, start: dict) -> tuple[list, int | None]:
    """Every frame the server sends for `start`, as it arrives (text or bytes), and the close."""
    frames = []
    async with websockets.connect(url, max_size=2**24) as ws:
        await ws.send(json.dumps(start))
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                frames.append(await asyncio.wait_for(ws.recv(), 10))
    return frames, ws.close_code


def _masked(frame):
    """A text frame with what differs between any two runs masked: the session id and the
    measured timings (their digits); the key order, separators and every other byte stay."""
    if isinstance(frame, bytes):
        return frame
    frame = re.sub(r'"session_id": "[0-9a-f]+"', '"session_id": "-"', frame)
    return re.sub(r'"timings": \{[^}]*\}', lambda m: re.sub(r"-?[0-9][0-9.e-]*", "0", m.group(0)), frame)


@pytest.mark.parametrize("fmt", ["rgb", "fmp4"])
async def test_both_transports_send_the_same_bytes(models, fmt):
    """Protocol v1 byte for byte over aiohttp and over ASGI: the same frames, text and binary,
    in the same order, with the same close code (timings and the session id aside)."""
    start = {"type": "session.start", "format": fmt, "num_chunks": 3, "seed": 11, "kv_mode": "noisy"}
    transcripts = []
    for transport in TRANSPORTS:
        _, test_server = await start_server(models, transport=transport)
        try:
            transcripts.append(await _raw_transcript(f"ws://127.0.0.1:{test_server.port}/v1/stream", start))
        finally:
            await test_server.close()
    (a, code_a), (b, code_b) = transcripts
    assert code_a == code_b == 1000
    assert [type(f) for f in a] == [type(f) for f in b] and len(a) >= 7  # started, 3 x (chunk, payload), done
    assert [_masked(f) for f in a] == [_masked(f) for f in b]
    assert '"timings": {' in a[1 if fmt == "rgb" else 2]  # the masking had something to mask


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_token_and_origin_are_checked_on_both_transports(models, transport):
    server = StreamWorldServer(models, FAST, ServerConfig(auth_token="s3cret"), default_model="tiny-wan")
    running = await (
        RunningAsgiServer(server) if transport == "asgi" else RunningServer(server.build_app())
    ).start()
    base, url = f"http://127.0.0.1:{running.port}", f"ws://127.0.0.1:{running.port}/v1/stream"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/v1/models") as r:
                assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
            async with s.get(f"{base}/v1/models?token=s3cret") as r:
                assert r.status == 200 and r.headers["Server"] == "StreamWorld"
            async with s.get(f"{base}/healthz") as r:
                assert r.status == 200  # open, for load balancers
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(url)
        assert refused.value.response.status_code == 401
        with pytest.raises(websockets.InvalidStatus) as foreign:
            await websockets.connect(f"{url}?token=s3cret", origin="https://elsewhere.example")
        assert foreign.value.response.status_code == 403
        frames = await _frames(f"{url}?token=s3cret", "tiny-wan", 1, 1)
        assert frames.shape[0] == models["tiny-wan"].config.first_chunk_frames
    finally:
        await running.close()


async def test_a_client_holds_at_most_max_buffered_bytes_it_has_not_taken(served, caplog):
    """A consumer slower than the stream: the client keeps what it received up to its bound,
    hands those chunks over, then ends with `buffer_full`; the server sees a client leave."""
    _, url, http = served
    caplog.set_level(logging.INFO)
    async with StreamWorldClient(url, format="rgb", num_chunks=2, seed=2) as probe:
        two_chunks = sum([chunk.nbytes async for chunk in probe.chunks()])
    async with StreamWorldClient(url, format="rgb", num_chunks=None, seed=2, max_buffered=two_chunks) as c:
        for _ in range(2400):  # take nothing until the client gives up (bounded wait)
            if c._state == "closed":
                break
            await asyncio.sleep(0.025)
        assert c._state == "closed" and c.buffered_bytes == two_chunks
        taken = 0
        with pytest.raises(StreamWorldError) as caught:
            async for _ in c.chunks():
                taken += 1
    assert taken == 2 and caught.value.code == "buffer_full" and c.buffered_bytes == 0
    for _ in range(200):
        if await metric(http, "streamworld_kv_pages_used") == 0:
            break
        await asyncio.sleep(0.05)
    assert await metric(http, "streamworld_kv_pages_used") == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
