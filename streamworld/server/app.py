"""The aiohttp application: one port serves the demo, health, metrics, models and streams.

    GET /            the browser demo (files from web/, installed as streamworld.web)
    GET /healthz     200 {"status": "ok", ...} while the engines take work, 503 when shutting down
    GET /metrics     Prometheus text format
    GET /v1/models   served models and their properties
    GET /v1/stream   WebSocket: one connection = one stream (see session.py)

Engines start in `on_startup` and stop in `on_cleanup`; `drain()` (SIGINT/SIGTERM, while the
port still listens, then again from `on_shutdown`) stops admitting and ends every live session
with `session.done`. Who may connect (origin, token) and the connection bound are checked
before a WebSocket upgrade; docs/security.md says what that protects.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http import HTTPStatus
from pathlib import Path

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine import AsyncEngine, EngineConfig, Placement, ReplicaSet
from ..models.world_model import WorldModel
from ..scenes import first_frame_source
from . import protocol
from .config import ServedModel, ServerConfig
from .metrics import Metrics
from .session import Session, SessionContext
from .sockets import AiohttpSocket, SessionSocket

log = logging.getLogger("streamworld.server")


def find_web_root() -> Path:
    """The browser demo's directory: the package data of `streamworld.web`, which pyproject.toml
    maps to the top-level web/, so every install (not only an editable one) has it."""
    spec = importlib.util.find_spec("streamworld.web")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "web"  # run from a checkout that was never installed


WEB_ROOT = find_web_root()

# Every response's Server header: no language or library versions for a scanner to match.
SERVER_NAME = "StreamWorld"
# Paths that need the token when `ServerConfig.auth_token` is set; /healthz and the demo's
# static files stay open (load balancers and the page that asks for the token need them).
TOKEN_PATHS = frozenset({"/v1/stream", "/v1/models", "/metrics"})


class AccessLog(AbstractAccessLogger):
    """One line per request, with the path but not the query string or Referer: a browser's
    token travels in the query string (`?token=`) and must not reach the log."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            "%s %s %s %s %d %.3fs",
            request.remote,
            request.method,
            request.path,
            response.status,
            response.body_length,
            time,
        )


class PlainErrorHandler(web.RequestHandler):
    """A malformed HTTP request gets a short plain 400 (aiohttp's own echoes the offending
    bytes) and one info line in the log instead of an ERROR with a traceback: scanners and
    stray TLS handshakes reach every public port."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        log.info("malformed HTTP request from %s refused: %s", request.remote, type(exc).__name__)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already under way")
        try:
            text = f"{status} {HTTPStatus(status).phrase}\n"
        except ValueError:
            text = f"{status}\n"
        response = web.Response(status=status, text=text, headers={"Server": SERVER_NAME})
        response.force_close()
        return response


class PlainErrorServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return PlainErrorHandler(self, loop=self._loop, **self._kwargs)


# Seconds an HTTP connection may stay idle or half-sent (aiohttp's run_app uses the same).
KEEPALIVE_TIMEOUT_S = 75.0


class StreamWorldRunner(web.AppRunner):
    """The runner `streamworld serve` (and the tests) run the app under: a client leaving does
    not cancel its handler, and malformed requests get `PlainErrorHandler`."""

    async def setup(self) -> None:
        await super().setup()
        # aiohttp builds its Server inside setup(); the subclass only swaps the handler type.
        self.server.__class__ = PlainErrorServer


def origin_allowed(origin: str | None, host: str, allowed: tuple[str, ...]) -> bool:
    """No Origin (not a browser), the server's own host (by http or https: behind a TLS proxy
    the request arrives as http), or one the operator allowed."""
    if origin is None or "*" in allowed:
        return True
    origin = origin.rstrip("/").lower()
    if origin in {a.rstrip("/").lower() for a in allowed}:
        return True
    scheme, sep, authority = origin.partition("://")
    return bool(sep) and scheme in ("http", "https") and authority == host.lower()


def bearer_token(headers: Mapping[str, str], query: Mapping[str, str]) -> str:
    """The token a request carries: `Authorization: Bearer T`, else the `token` query parameter
    (browsers cannot set headers on a WebSocket)."""
    scheme, _, value = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    return query.get("token", "")


def served_model(
    models: WorldModel | Sequence[WorldModel], engine_config: EngineConfig, placement: Placement | None
) -> ServedModel:
    """One served model: an engine per replica, as one `ReplicaSet`."""
    replicas = [models] if isinstance(models, WorldModel) else list(models)
    if placement is not None and len(placement.replicas) != len(replicas):
        raise ValueError(f"{len(replicas)} models for a placement of {len(placement.replicas)} replicas")
    engines = [
        AsyncEngine(
            model,
            engine_config if placement is None else replace(engine_config, placement=placement.replicas[i]),
        )
        for i, model in enumerate(replicas)
    ]
    first = replicas[0]
    return ServedModel(first, ReplicaSet(engines), first_frame_source(first.config, isolated=True))


class StreamWorldServer:
    def __init__(
        self,
        models: dict[str, WorldModel | Sequence[WorldModel]],
        engine_config: EngineConfig | None = None,
        config: ServerConfig | None = None,
        default_model: str | None = None,
        placements: dict[str, Placement] | None = None,
    ) -> None:
        """`models`: per model id one `WorldModel`, or one per replica (placed as
        `placements[id]` says, one `ReplicaPlacement` per replica; without one, each replica
        runs on its model's device as `engine_config` says)."""
        if not models:
            raise ValueError("serve at least one model")
        self.config = config or ServerConfig()
        self.limits = self.config.limits
        self.engine_config = engine_config or EngineConfig()
        self.models: dict[str, ServedModel] = {
            mid: served_model(replicas, self.engine_config, (placements or {}).get(mid))
            for mid, replicas in models.items()
        }
        self.default_model = default_model or next(iter(models))
        if self.default_model not in self.models:
            raise ValueError(f"default model {self.default_model!r} is not served")
        self.metrics = Metrics({mid: m.engine.engines for mid, m in self.models.items()})
        self.sessions: set[Session] = set()
        self.connections = 0  # WebSocket upgrades being served, started sessions or not
        self.encode_pool = ThreadPoolExecutor(
            self.config.encode_threads, thread_name_prefix="streamworld-encode"
        )
        self.context = SessionContext(
            self.models, self.default_model, self.limits, self.metrics, self.encode_pool, self.config.instance
        )

    @property
    def shutting_down(self) -> bool:
        return self.context.shutting_down

    # --- application -----------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._require_token])
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
        app.on_response_prepare.append(self._name_server)
        return app

    def make_runner(
        self, shutdown_timeout: float = 10.0, keepalive_timeout: float = KEEPALIVE_TIMEOUT_S
    ) -> StreamWorldRunner:
        """`keepalive_timeout`: how long an HTTP connection may sit idle, or with a request
        not yet complete, before it is closed (an AppRunner's own default is an hour)."""
        return StreamWorldRunner(
            self.build_app(),
            handler_cancellation=False,
            shutdown_timeout=shutdown_timeout,
            keepalive_timeout=keepalive_timeout,
            access_log_class=AccessLog,
        )

    @web.middleware
    async def _require_token(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        guarded = resource is not None and resource.canonical in TOKEN_PATHS
        if guarded and not self.token_ok(bearer_token(request.headers, request.query)):
            raise web.HTTPUnauthorized(
                text="401: this server needs a token (Authorization: Bearer, or ?token=)\n",
                headers={"WWW-Authenticate": 'Bearer realm="streamworld"'},
            )
        return await handler(request)

    async def _name_server(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = SERVER_NAME

    async def _startup(self, app: web.Application) -> None:
        await self.start()

    async def _shutdown(self, app: web.Application) -> None:
        await self.drain()

    # --- what every transport shares (aiohttp here, ASGI in asgi.py) ---------------------------
    async def start(self) -> None:
        for served in self.models.values():
            await served.engine.start()

    def health(self) -> tuple[dict, int]:
        """/healthz: the body and status."""
        body = {
            "status": "shutting_down" if self.shutting_down else "ok",
            "models": list(self.models),
            "sessions": len(self.sessions),
            "replicas": {mid: len(m.engine.engines) for mid, m in self.models.items()},
            "kv_pages_used": {
                mid: sum(e.pool.pages_used for e in m.engine.engines) for mid, m in self.models.items()
            },
        }
        if self.config.instance is not None:
            body["instance"] = self.config.instance
        return body, 503 if self.shutting_down else 200

    def model_list(self) -> dict:
        """/v1/models."""
        entries = []
        for mid, served in self.models.items():
            entry = served.model.config.describe()
            entry["default"] = mid == self.default_model
            entry["has_default_image"] = served.first_frame is not None
            entries.append(entry)
        return {"models": entries}

    def token_ok(self, token: str) -> bool:
        expected = self.config.auth_token
        # Header bytes that are not UTF-8 reach here as surrogates: encoded back, not refused
        # with an exception (they simply do not match).
        if expected is None:
            return True
        return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), expected.encode())

    def upgrade_refusal(self, origin: str | None, host: str) -> tuple[int, str] | None:
        """Why a WebSocket upgrade is refused (HTTP status and text), or None."""
        if not origin_allowed(origin, host, self.config.allowed_origins):
            log.info("WebSocket upgrade from origin %r refused", origin)
            return 403, "403: this origin may not open streams here\n"
        if self.shutting_down:
            return 503, "503: the server is shutting down\n"
        if self.connections >= self.config.max_connections:
            log.warning("connection limit (%d) reached; upgrade refused", self.config.max_connections)
            return 503, "503: too many connections; try again later\n"
        return None

    async def run_session(self, socket: SessionSocket) -> None:
        """One accepted WebSocket, whatever its transport, until its session ends."""
        session = Session(self.context, socket, secrets.token_hex(8))
        self.sessions.add(session)
        try:
            await session.serve()
        finally:
            self.sessions.discard(session)
            if not socket.closed:
                await socket.close(protocol.CLOSE_OK)

    async def drain(self) -> None:
        """Stops admitting, ends live sessions with session.done, drops what does not end.

        Run while the port still listens, /healthz answers 503 and new upgrades are refused
        (503) meanwhile, so a load balancer sees the server leave before its port closes."""
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
        await self.close()

    async def close(self) -> None:
        """Stops the engines and the pools (after `drain`)."""
        for served in self.models.values():
            await served.engine.close()
            close = getattr(served.first_frame, "close", None)
            if close is not None:  # the first-frame child process (scenes.ChildProcessFrames)
                await asyncio.to_thread(close)
        self.encode_pool.shutdown(wait=True, cancel_futures=True)

    # --- handlers --------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        body, status = self.health()
        return web.json_response(body, status=status)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(self.model_list())

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
        refusal = self.upgrade_refusal(request.headers.get("Origin"), request.host)
        if refusal is not None:
            status, text = refusal
            raise web.HTTPForbidden(text=text) if status == 403 else web.HTTPServiceUnavailable(text=text)
        self.connections += 1
        try:
            # No permessage-deflate: media payloads do not compress, and it costs CPU per chunk.
            ws = web.WebSocketResponse(
                max_msg_size=self.config.max_text_frame, heartbeat=30.0, compress=False
            )
            try:
                await ws.prepare(request)
            except (web.HTTPException, ValueError):
                # Not an upgrade aiohttp accepts. Its own refusal repeats the client's headers,
                # and raises ValueError instead where they are not UTF-8 or not ASCII.
                raise web.HTTPBadRequest(text="400: not a WebSocket upgrade request\n") from None
            await self.run_session(AiohttpSocket(ws, request.transport))
            return ws
        finally:
            self.connections -= 1
