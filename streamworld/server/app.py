"""The aiohttp application: one port serves the demo, health, metrics, models and streams.

    GET /            the browser demo (files from web/, installed as streamworld.web)
    GET /healthz     200 {"status": "ok", ...} while the engines take work, 503 when shutting down
    GET /metrics     Prometheus text format
    GET /v1/models   served models and their properties
    GET /v1/stream   WebSocket: one connection = one stream (see session.py)

Engines start in `on_startup` and stop in `on_cleanup`; `on_shutdown` (SIGINT/SIGTERM under
`run_app`) stops admitting and ends every live session with `session.done`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine import AsyncEngine, EngineConfig
from ..models.world_model import WorldModel
from ..scenes import first_frame_source
from .config import ServedModel, ServerConfig
from .metrics import Metrics
from .session import Session, SessionContext

log = logging.getLogger("streamworld.server")


def find_web_root() -> Path:
    """The browser demo's directory: the package data of `streamworld.web`, which pyproject.toml
    maps to the top-level web/, so every install (not only an editable one) has it."""
    spec = importlib.util.find_spec("streamworld.web")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "web"  # run from a checkout that was never installed


WEB_ROOT = find_web_root()


class StreamWorldServer:
    def __init__(
        self,
        models: dict[str, WorldModel],
        engine_config: EngineConfig | None = None,
        config: ServerConfig | None = None,
        default_model: str | None = None,
    ) -> None:
        if not models:
            raise ValueError("serve at least one model")
        self.config = config or ServerConfig()
        self.limits = self.config.limits
        self.engine_config = engine_config or EngineConfig()
        self.models: dict[str, ServedModel] = {
            mid: ServedModel(model, AsyncEngine(model, self.engine_config), first_frame_source(model.config))
            for mid, model in models.items()
        }
        self.default_model = default_model or next(iter(models))
        if self.default_model not in self.models:
            raise ValueError(f"default model {self.default_model!r} is not served")
        self.metrics = Metrics({mid: m.engine for mid, m in self.models.items()})
        self.sessions: set[Session] = set()
        self.encode_pool = ThreadPoolExecutor(
            self.config.encode_threads, thread_name_prefix="streamworld-encode"
        )
        self.context = SessionContext(
            self.models, self.default_model, self.limits, self.metrics, self.encode_pool
        )

    @property
    def shutting_down(self) -> bool:
        return self.context.shutting_down

    # --- application -----------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/stream", self.stream)
        app.router.add_get("/", self.index)
        if WEB_ROOT.is_dir():
            app.router.add_static("/web/", WEB_ROOT, show_index=False)
        app.on_startup.append(self._startup)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        for served in self.models.values():
            await served.engine.start()

    async def _shutdown(self, app: web.Application) -> None:
        """Stops admitting, ends live sessions with session.done, drops what does not end."""
        self.context.shutting_down = True
        sessions = list(self.sessions)
        for s in sessions:
            s.shutdown()
        # Connected without a session.start: nothing to end, only a connection to close.
        closing = [asyncio.ensure_future(s.close_going_away()) for s in sessions if not s.has_stream]
        waits = [asyncio.ensure_future(s.done.wait()) for s in sessions if s.has_stream]
        pending_all = closing + waits
        if pending_all:
            _, pending = await asyncio.wait(pending_all, timeout=self.config.shutdown_grace_s)
            for task in pending:
                task.cancel()
        for s in sessions:
            if not s.ended:
                s.abort()  # a client that does not take session.done in time is dropped

    async def _cleanup(self, app: web.Application) -> None:
        for served in self.models.values():
            await served.engine.close()
        self.encode_pool.shutdown(wait=True, cancel_futures=True)

    # --- handlers --------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        body = {
            "status": "shutting_down" if self.shutting_down else "ok",
            "models": list(self.models),
            "sessions": len(self.sessions),
        }
        return web.json_response(body, status=503 if self.shutting_down else 200)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, request: web.Request) -> web.Response:
        entries = []
        for mid, served in self.models.items():
            entry = served.model.config.describe()
            entry["default"] = mid == self.default_model
            entry["has_default_image"] = served.first_frame is not None
            entries.append(entry)
        return web.json_response({"models": entries})

    async def index(self, request: web.Request) -> web.StreamResponse:
        page = WEB_ROOT / "index.html"
        if page.is_file():
            return web.FileResponse(page)
        links = "".join(f"<li>{mid}</li>" for mid in self.models)
        html = (
            "<!doctype html><title>StreamWorld</title><h1>StreamWorld</h1>"
            "<p>The browser demo's files are missing from this installation. Served models:</p>"
            f"<ul>{links}</ul><p>See <a href='/v1/models'>/v1/models</a>, <a href='/healthz'>/healthz</a>, "
            "<a href='/metrics'>/metrics</a>; streams are at <code>/v1/stream</code> (WebSocket).</p>"
        )
        return web.Response(text=html, content_type="text/html")

    async def stream(self, request: web.Request) -> web.WebSocketResponse:
        # No permessage-deflate: media payloads do not compress, and it costs CPU per chunk.
        ws = web.WebSocketResponse(max_msg_size=self.config.max_text_frame, heartbeat=30.0, compress=False)
        await ws.prepare(request)
        session = Session(self.context, ws, secrets.token_hex(8), transport=request.transport)
        self.sessions.add(session)
        try:
            await session.serve()
        finally:
            self.sessions.discard(session)
            if not ws.closed:
                await ws.close()
        return ws
