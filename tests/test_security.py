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
import websockets

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


async def start(models, engine_config=ONE_SESSION, **config):  # noqa: F811
    server = StreamWorldServer(models, engine_config, ServerConfig(**config), default_model="tiny-wan")
    running = await RunningServer(server.build_app()).start()
    return server, running, f"127.0.0.1:{running.port}"


async def finished(host: str, reason: str, model: str = "tiny-wan") -> float:
    async with aiohttp.ClientSession() as s, s.get(f"http://{host}/metrics") as r:
        text = await r.text()
    m = re.search(
        rf'^streamworld_sessions_finished_total\{{model="{model}",reason="{reason}"\}} (\S+)$', text, re.M
    )
    return float(m.group(1)) if m else 0.0


async def until(condition, tries: int = 400) -> None:
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
