"""The same server as an ASGI application (FastAPI on Starlette), for uvicorn and Ray Serve.

    GET /            the browser demo          GET /metrics    Prometheus text format
    GET /healthz     health (503 draining)     GET /v1/models  served models
    WS  /v1/stream   one connection = one stream, protocol v1 byte for byte as over aiohttp

Everything but the transport is `StreamWorldServer`'s (app.py): the session state machine,
limits, metrics, origin and token checks, drain. `build_asgi_app` starts the engines at the
application's startup and drains and stops them at its shutdown (or leaves both to its
caller, as `serve_asgi` and the Ray Serve deployment do). Run it with

    streamworld serve --transport asgi ...      (uvicorn in place of aiohttp; `serve_asgi`)

A refused upgrade is answered with its HTTP status where the server supports the
WebSocket denial extension (uvicorn does) and otherwise with a close before the handshake
(HTTP 403). The message bound is `ServerConfig.max_text_frame`: `serve` gives it to uvicorn
(`ws_max_size`), and the session's socket checks each message itself (`AsgiSocket`), since
another ASGI server (Ray Serve's proxy) may not take it; an oversize message closes with 1009.
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations
# (WebSocket, Request), imported inside build_asgi_app, so they must be evaluated there.
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from .app import SERVER_NAME, TOKEN_PATHS, WEB_ROOT, StreamWorldServer, bearer_token
from .sockets import AsgiSocket, client_gone_errors

log = logging.getLogger("streamworld.server")


def build_asgi_app(server: StreamWorldServer, manage_lifespan: bool = True):
    """A FastAPI application serving `server`. `manage_lifespan`: start and stop the engines
    with the application (False: the caller does, as the Ray Serve deployment)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    @contextlib.asynccontextmanager
    async def lifespan(app) -> AsyncIterator[None]:
        if manage_lifespan:
            await server.start()
        yield
        if manage_lifespan:
            await server.drain()
            await server.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if _route_path(request.scope) in TOKEN_PATHS and not server.token_ok(
            bearer_token(request.headers, request.query_params)
        ):
            return PlainTextResponse(
                UNAUTHORIZED,
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="streamworld"', "Server": SERVER_NAME},
            )
        response = await call_next(request)
        response.headers["Server"] = SERVER_NAME
        return response

    _add_http_routes(app, server)
    _add_stream_route(app, server)
    return app


UNAUTHORIZED = "401: this server needs a token (Authorization: Bearer, or ?token=)\n"


def _add_http_routes(app, server: StreamWorldServer) -> None:
    """/healthz, /metrics, /v1/models, the demo page and its files."""
    from fastapi.responses import FileResponse, HTMLResponse, Response
    from fastapi.staticfiles import StaticFiles
    from prometheus_client import CONTENT_TYPE_LATEST

    @app.get("/healthz")
    async def healthz() -> Response:
        body, status = server.health()
        return _json(body, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(server.model_list())

    @app.get("/")
    async def index():
        page = WEB_ROOT / "index.html"
        if page.is_file():
            return FileResponse(page)
        return HTMLResponse(
            "<!doctype html><title>StreamWorld</title><p>The browser demo's files are missing.</p>"
        )

    if WEB_ROOT.is_dir():
        app.mount("/web", StaticFiles(directory=WEB_ROOT), name="web")


def _add_stream_route(app, server: StreamWorldServer) -> None:
    """/v1/stream: the checks before the upgrade, then one session."""
    from fastapi import WebSocket

    @app.websocket("/v1/stream")
    async def stream(websocket: WebSocket) -> None:
        if not server.token_ok(bearer_token(websocket.headers, websocket.query_params)):
            refusal = (401, UNAUTHORIZED)
        else:
            refusal = server.upgrade_refusal(
                websocket.headers.get("origin"), websocket.headers.get("host", "")
            )
        if refusal is not None:
            await _deny(websocket, *refusal)
            return
        server.connections += 1
        try:
            try:
                await websocket.accept()
            except client_gone_errors() as e:  # the client left before the handshake ended
                log.info("WebSocket closed before it was accepted (%s)", type(e).__name__)
                return
            await server.run_session(AsgiSocket(websocket, server.config.max_text_frame))
        finally:
            server.connections -= 1


async def _deny(websocket, status: int, text: str) -> None:
    """An HTTP answer to the upgrade where the server can send one, else a close (403)."""
    from fastapi.responses import PlainTextResponse

    extensions = websocket.scope.get("extensions") or {}
    if "websocket.http.response" in extensions:
        headers = {"Server": SERVER_NAME}
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="streamworld"'
        await websocket.send_denial_response(PlainTextResponse(text, status_code=status, headers=headers))
    else:
        await websocket.close(code=1008)


async def serve_asgi(
    server: StreamWorldServer,
    host: str,
    port: int,
    log_level: str,
    stop: asyncio.Event,
    announce: Callable[[int], None] = lambda port: None,
    stopping: Callable[[], None] = lambda: None,
) -> int | None:
    """Runs `server` under uvicorn until `stop` is set, then drains while the port still
    listens (as `streamworld serve` does over aiohttp) before uvicorn closes it. Returns the
    port it served on, or None if uvicorn could not listen."""
    runner = uvicorn_server(server, host, port, log_level)
    await server.start()
    task = asyncio.create_task(_serve_quietly(runner))
    try:
        while not runner.started:
            if task.done():  # uvicorn logs why (the port is taken) and returns
                return None
            await asyncio.sleep(0.05)
        bound = runner.servers[0].sockets[0].getsockname()[1] if runner.servers else port
        announce(bound)
        await stop.wait()
        stopping()
        await server.drain()
        return bound
    finally:
        runner.should_exit = True
        with contextlib.suppress(BaseException):
            await task
        await server.close()


async def _serve_quietly(runner) -> None:
    """uvicorn exits the process (`SystemExit`) when it cannot listen; here that ends only
    its task, and `serve_asgi` reports it."""
    with contextlib.suppress(SystemExit):
        await runner.serve()


def uvicorn_server(server: StreamWorldServer, host: str, port: int, log_level: str = "info"):
    """A uvicorn server for `server`'s application, set as `streamworld serve` sets aiohttp:
    the text frame bound, a 30 s ping, no compression, only StreamWorld's Server header. The
    caller starts and stops the engines (and drains) around it."""
    import uvicorn

    config = uvicorn.Config(
        build_asgi_app(server, manage_lifespan=False),
        host=host,
        port=port,
        log_level=log_level,
        ws_max_size=server.config.max_text_frame,
        ws_ping_interval=30.0,
        ws_ping_timeout=20.0,  # a client that reads nothing is dropped
        ws_per_message_deflate=False,
        lifespan="off",
        server_header=False,
    )
    return _quiet_server(config)


def _quiet_server(config):
    """uvicorn.Server without its own signal handlers: the caller's drain comes first."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def install_signal_handlers(self) -> None:  # uvicorn before 0.29
            pass

    return Server(config)


def _route_path(scope: dict) -> str:
    """The request's path inside the application (without a mount prefix such as a Ray
    Serve `route_prefix`), which is what the token's paths name."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _json(body: dict, status: int = 200):
    """JSON as the aiohttp server writes it (json.dumps' separators), so bodies are the same."""
    import json

    from fastapi.responses import Response

    return Response(json.dumps(body), status_code=status, media_type="application/json")
