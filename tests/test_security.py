"""Hardening: who may connect, what each input may cost, and how ordinary failures are reported.

A real server on a free port, real aiohttp and websockets clients; docs/security.md says what
these pin.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from streamworld.client import StreamWorldClient
from streamworld.engine.engine import EngineConfig
from streamworld.engine.scheduler import SchedulerConfig
from streamworld.server.app import ServerConfig, StreamWorldServer
from streamworld.server.session import SessionLimits
from tests.conftest import load_tiny
from tests.test_server import RunningServer, models  # noqa: F401

# One session's worth of K/V pages: a second noisy session queues.
ONE_SESSION = EngineConfig(
    ttff_budget_s=1e3, scheduler=SchedulerConfig(lookahead_chunks=1e6), max_streams=1, max_queue=4
)


class HardenedServer(RunningServer):
    """The app under the runner `streamworld serve` uses (it also shapes malformed-request replies)."""

    def __init__(self, server: StreamWorldServer) -> None:
        self.runner = server.make_runner()


async def start(models, engine_config=ONE_SESSION, **config):  # noqa: F811
    server = StreamWorldServer(models, engine_config, ServerConfig(**config), default_model="tiny-wan")
    running = await HardenedServer(server).start()
    return server, running, f"127.0.0.1:{running.port}"


async def upgrade_status(host: str, **connect) -> int:
    """101 when the WebSocket upgrade is accepted, else the HTTP status it was refused with."""
    try:
        async with websockets.connect(f"ws://{host}/v1/stream", **connect):
            return 101
    except InvalidStatus as e:
        return e.response.status_code


async def finished(host: str, reason: str, model: str = "tiny-wan") -> float:
    async with aiohttp.ClientSession() as s, s.get(f"http://{host}/metrics") as r:
        text = await r.text()
    m = re.search(
        rf'^streamworld_sessions_finished_total\{{model="{model}",reason="{reason}"\}} (\S+)$', text, re.M
    )
    return float(m.group(1)) if m else 0.0


async def until(condition, tries: int = 2400) -> None:
    """Waits for `condition` (an upper bound for a machine shared with other work, not a timing claim)."""
    for _ in range(tries):
        if await condition():
            return
        await asyncio.sleep(0.025)
    raise AssertionError("condition never held")


def errors(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


# --- ordinary endings are counted as what they are -------------------------------------------
async def test_a_queued_client_leaving_is_cancelled_not_an_error(models, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    server, running, host = await start(models)
    try:
        async with websockets.connect(f"ws://{host}/v1/stream") as first:
            await first.send(json.dumps({"type": "session.start", "kv_mode": "noisy", "num_chunks": None}))
            assert json.loads(await first.recv())["type"] == "session.started"
            queued = await websockets.connect(f"ws://{host}/v1/stream")
            await queued.send(json.dumps({"type": "session.start", "kv_mode": "noisy"}))
            # Gone without a close frame, as a killed client goes, before its session.queued.
            queued.transport.abort()
            await until(lambda: finished(host, "cancelled"))
        await until(lambda: _true(not server.sessions))
        assert await finished(host, "cancelled") == 2
        assert await finished(host, "error") == 0
    finally:
        await running.close()
    assert errors(caplog) == []


async def _true(value: bool) -> bool:
    return value


@pytest.mark.slow
async def test_a_client_that_stops_reading_is_counted_as_an_error(models, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    model = load_tiny(height=256, width=256)  # big rgb chunks fill the socket buffers quickly
    limits = SessionLimits(pause_chunks=1, slow_client_timeout_s=0.5)
    server, running, host = await start({"tiny-wan": model}, limits=limits)
    try:
        slow = await websockets.connect(f"ws://{host}/v1/stream", max_size=2**26, max_queue=1)
        await slow.send(json.dumps({"type": "session.start", "format": "rgb", "num_chunks": None}))
        slow.transport.pause_reading()
        await until(lambda: finished(host, "error"))
        await until(lambda: _true(not server.sessions))
        assert await finished(host, "error") == 1
        assert await finished(host, "cancelled") == 0
        slow.transport.abort()
    finally:
        await running.close()
    assert errors(caplog) == []


# --- who may connect -------------------------------------------------------------------------
async def test_cross_origin_upgrades_are_refused_unless_allowed(models):  # noqa: F811
    _, running, host = await start(models)
    try:
        assert await upgrade_status(host) == 101  # no Origin: not a browser
        assert await upgrade_status(host, origin=f"http://{host}") == 101
        assert await upgrade_status(host, origin="http://evil.example") == 403
        assert await upgrade_status(host, origin=f"http://{host}.evil.example") == 403
    finally:
        await running.close()
    _, running, host = await start(models, allowed_origins=("https://app.example",))
    try:
        assert await upgrade_status(host, origin="https://app.example") == 101
        assert await upgrade_status(host, origin="http://evil.example") == 403
    finally:
        await running.close()
    _, running, host = await start(models, allowed_origins=("*",))
    try:
        assert await upgrade_status(host, origin="http://evil.example") == 101
    finally:
        await running.close()


async def test_a_token_guards_streams_models_and_metrics_but_not_health_or_the_demo(models, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    token = "s3cret-token"
    _, running, host = await start(models, auth_token=token)
    http = f"http://{host}"
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/v1/models", "/metrics"):
                async with s.get(http + path) as r:
                    assert r.status == 401
                async with s.get(http + path, headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401
                async with s.get(http + path, headers={"Authorization": f"Bearer {token}"}) as r:
                    assert r.status == 200
                async with s.get(f"{http}{path}?token={token}") as r:
                    assert r.status == 200
            for path in ("/healthz", "/", "/web/app.js"):
                async with s.get(http + path) as r:
                    assert r.status == 200, path
        assert await upgrade_status(host) == 401
        assert await upgrade_status(host, additional_headers={"Authorization": "Bearer nope"}) == 401
        async with websockets.connect(f"ws://{host}/v1/stream?token={token}", origin=http):
            pass
        async with StreamWorldClient(f"ws://{host}/v1/stream", token=token, num_chunks=1) as c:
            assert [ch.index async for ch in c.chunks()] == [0]
    finally:
        await running.close()
    leaks = [
        r.getMessage() for r in caplog.records if token in r.getMessage() and r.name.startswith("aiohttp")
    ]
    assert not leaks, leaks


# --- bounds ----------------------------------------------------------------------------------
async def test_connections_beyond_the_limit_get_503_before_the_upgrade(models):  # noqa: F811
    _, running, host = await start(models, max_connections=2)
    try:
        async with websockets.connect(f"ws://{host}/v1/stream"), websockets.connect(f"ws://{host}/v1/stream"):
            assert await upgrade_status(host) == 503
        assert await upgrade_status(host) == 101  # freed when they close
    finally:
        await running.close()


async def test_a_session_queued_too_long_is_refused_with_overloaded(models):  # noqa: F811
    limits = SessionLimits(queue_timeout_s=0.2)
    _, running, host = await start(models, limits=limits)
    url = f"ws://{host}/v1/stream"
    try:
        async with StreamWorldClient(url, num_chunks=None, kv_mode="noisy"), websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "session.start", "kv_mode": "noisy"}))
            assert json.loads(await ws.recv()) == {"type": "session.queued", "position": 1}
            reply = json.loads(await ws.recv())
            assert reply["type"] == "error" and reply["code"] == "overloaded"
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1013
        assert await finished(host, "overloaded") == 1
    finally:
        await running.close()


async def test_health_answers_503_while_the_server_drains(models):  # noqa: F811
    server, running, host = await start(models)
    try:
        async with StreamWorldClient(f"ws://{host}/v1/stream", num_chunks=None) as c:
            await server.drain()  # what SIGTERM does before the port closes
            async for _ in c.chunks():
                pass
            assert c.done_reason == "stopped"
        async with aiohttp.ClientSession() as s, s.get(f"http://{host}/healthz") as r:
            assert r.status == 503 and (await r.json())["status"] == "shutting_down"
        assert await upgrade_status(host) == 503
    finally:
        await running.close()


async def test_every_response_names_the_server_without_versions(models):  # noqa: F811
    _, running, host = await start(models, auth_token="t")
    http = f"http://{host}"
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/healthz", "/", "/web/app.js", "/nowhere", "/v1/models", "/v1/models?token=t"):
                async with s.get(http + path) as r:
                    assert r.headers["Server"] == "StreamWorld", path
            async with s.ws_connect(f"ws://{host}/v1/stream?token=t") as ws:
                assert ws._response.headers["Server"] == "StreamWorld"
    finally:
        await running.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\nX-<script>: y\r\n\r\n",
        b"GET /<script>\x01 HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: <script>\r\n\r\n",
    ],
)
async def test_a_malformed_request_gets_a_short_400_that_echoes_nothing(models, caplog, request_bytes):  # noqa: F811
    caplog.set_level(logging.INFO)
    _, running, host = await start(models)
    try:
        reader, writer = await asyncio.open_connection(*host.split(":"))
        writer.write(request_bytes)
        reply = await reader.read()
        writer.close()
    finally:
        await running.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
    assert b"Server: StreamWorld\r\n" in head + b"\r\n"
    assert b"script" not in body and len(body) < 64
    assert errors(caplog) == []


STREAM = b"GET /v1/stream?token=t HTTP/1.1\r\nHost: x\r\n"
CLOSE = b"Connection: close\r\n\r\n"
UPGRADE = b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"


async def raw_reply(host: str, request_bytes: bytes) -> tuple[bytes, bytes]:
    reader, writer = await asyncio.open_connection(*host.split(":"))
    writer.write(request_bytes)
    head = await reader.readuntil(b"\r\n\r\n")  # the connection may stay open: read one reply
    length = re.search(rb"\r\nContent-Length: (\d+)", head, re.I)
    body = await reader.readexactly(int(length.group(1))) if length else b""
    writer.close()
    return head.split(b"\r\n")[0], body


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n" + CLOSE, 401),
        (STREAM + b"Upgrade: \xff<script>\r\nConnection: Upgrade\r\n\r\n", 400),
        (STREAM + b"Upgrade: <script>\r\nConnection: Upgrade\r\n\r\n", 400),
        (STREAM + CLOSE, 400),
        (STREAM + UPGRADE + b"Sec-WebSocket-Key: \xc3\xa9\xc3\xa9<script>\r\n\r\n", 400),
        (STREAM + UPGRADE + b"Sec-WebSocket-Key: \xff\xfe<script>\r\n\r\n", 400),
    ],
    ids=[
        "token-not-utf8",
        "upgrade-not-utf8",
        "upgrade-not-websocket",
        "no-upgrade",
        "key-not-ascii",
        "key-not-utf8",
    ],
)
async def test_header_bytes_that_are_not_utf8_or_no_upgrade_get_a_fixed_reply(
    models,  # noqa: F811
    caplog,
    request_bytes,
    status,
):
    """Not a server error, and nothing of the client's headers is repeated."""
    caplog.set_level(logging.INFO)
    _, running, host = await start(models, auth_token="t")
    try:
        line, body = await raw_reply(host, request_bytes)
    finally:
        await running.close()
    assert f" {status} ".encode() in line, line
    assert b"script" not in body and len(body) < 128, body
    assert errors(caplog) == []


async def test_an_idle_or_half_sent_http_connection_is_closed_after_the_keepalive_bound(models):  # noqa: F811
    """serve's runner closes such connections (after 75 s; 0.5 s here). aiohttp's own
    AppRunner default would hold them an hour."""
    running = HardenedServer.__new__(HardenedServer)
    running.runner = StreamWorldServer(models, ONE_SESSION, ServerConfig()).make_runner(keepalive_timeout=0.5)
    await running.start()
    try:
        for sent in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(sent)
            assert await asyncio.wait_for(reader.read(), 60) == b""  # closed, nothing sent
            writer.close()
    finally:
        await running.close()


def test_serve_flags_set_who_may_connect_and_the_bounds(monkeypatch, capsys):
    from streamworld.cli import build_parser, main
    from streamworld.cli.serve import TOKEN_ENV, serve_config

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    default = serve_config(build_parser().parse_args(["serve"])).server
    assert default == ServerConfig()
    assert (default.allowed_origins, default.auth_token, default.max_connections) == ((), None, 256)
    assert default.limits.queue_timeout_s == 60
    argv = ["serve", "--allow-origin", "https://a.example", "--allow-origin", "*", "--auth-token", "tok"]
    argv += ["--max-connections", "9", "--queue-timeout", "7"]
    server = serve_config(build_parser().parse_args(argv)).server
    assert server.allowed_origins == ("https://a.example", "*") and server.auth_token == "tok"
    assert server.max_connections == 9 and server.limits.queue_timeout_s == 7
    assert "tok" not in repr(server)
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert serve_config(build_parser().parse_args(["serve"])).server.auth_token == "from-env"
    assert main(["serve", "--max-connections", "0"]) == 2
    assert "--max-connections" in capsys.readouterr().err


async def test_at_most_two_first_frames_decode_at_once(models, monkeypatch):  # noqa: F811
    """Each decode may cost up to 64 MiB: many uploads at once must queue, not add up."""
    import threading

    from streamworld.server import protocol

    parse, running_now, most, lock = protocol.parse_session_start, [0], [0], threading.Lock()
    release = threading.Event()

    def slow_parse(*args):
        with lock:
            running_now[0] += 1
            most[0] = max(most[0], running_now[0])
        release.wait(5)
        with lock:
            running_now[0] -= 1
        return parse(*args)

    monkeypatch.setattr(protocol, "parse_session_start", slow_parse)
    _server, running, host = await start(models, max_connections=16)
    try:
        sockets = [await websockets.connect(f"ws://{host}/v1/stream") for _ in range(6)]
        for ws in sockets:
            await ws.send(json.dumps({"type": "session.start", "num_chunks": 1}))
        await until(lambda: _true(running_now[0] == protocol.MAX_CONCURRENT_IMAGE_DECODES))
        await asyncio.sleep(0.2)  # the other four would have started by now if not held back
        assert most[0] == protocol.MAX_CONCURRENT_IMAGE_DECODES == 2
        release.set()
        for ws in sockets:
            await ws.close()
    finally:
        release.set()
        await running.close()
