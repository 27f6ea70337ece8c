"""`streamworld serve`: the WebSocket streaming server.

The arguments become one `ServeConfig` (models, address, `EngineConfig`, `ServerConfig`
with its `SessionLimits`), checked before any model loads; then the models load and the
aiohttp application runs until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from . import arguments, deployment, loading
from .errors import UsageError

if TYPE_CHECKING:
    from ..deploy.config import DeployConfig
    from ..engine import EngineConfig, Placement
    from ..models.world_model import WorldModel
    from ..server import ServerConfig, StreamWorldServer


class LimitFlag(NamedTuple):
    """A flag for one `SessionLimits` field. Not given, the field keeps its default, so the
    flags and the server cannot disagree; the help states that default (a test pins it)."""

    flag: str
    field: str
    kind: type  # int: a count, at least 1; float: seconds, above 0
    help: str


SESSION_LIMIT_FLAGS = (
    LimitFlag(
        "--start-timeout",
        "start_timeout_s",
        float,
        "seconds a new connection has to send session.start before it is closed (default 30)",
    ),
    LimitFlag(
        "--pause-chunks",
        "pause_chunks",
        int,
        "chunks waiting to be sent that pause a stream's playback clock until the client takes "
        "them (default 2)",
    ),
    LimitFlag(
        "--slow-client-timeout",
        "slow_client_timeout_s",
        float,
        "seconds a chunk's send may take (and, for a client that sends acks, its acks may stay "
        "--ack-window chunks behind) before its session ends with an error (default 10)",
    ),
    LimitFlag(
        "--ack-window",
        "ack_window",
        int,
        "chunks a client that sends acks may hold unacknowledged before its clock pauses (default 3)",
    ),
    LimitFlag(
        "--queue-timeout",
        "queue_timeout_s",
        float,
        "seconds a session may wait in the admission queue before it is refused with error "
        "overloaded and close 1013 (default 60)",
    ),
)

TOKEN_ENV = "STREAMWORLD_AUTH_TOKEN"


@dataclass(frozen=True)
class ServeConfig:
    """Everything `serve` runs with, checked: what is served, where, and how."""

    model_ids: list[str]  # the first is the default model
    host: str
    port: int
    engine: EngineConfig
    server: ServerConfig
    placements: dict[str, Placement]  # per model: its replicas, stages and devices
    deploy: DeployConfig  # what it was made of (file and flags), for `config --print`


def _add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may connect: origins, the shared token, the connection cap (docs/security.md)."""
    access = parser.add_argument_group("who may connect (docs/security.md)")
    access.add_argument(
        "--allow-origin",
        action="append",
        dest="allowed_origins",
        metavar="ORIGIN",
        default=[],
        help="a browser origin (scheme://host[:port]) whose pages may open streams besides the server's "
        "own; repeat for several; * allows every origin",
    )
    access.add_argument(
        "--auth-token",
        metavar="TOKEN",
        help=f"require this shared secret on /v1/stream, /v1/models and /metrics (Authorization: Bearer, "
        f"or ?token=); default: the {TOKEN_ENV} environment variable, else no token",
    )
    access.add_argument(
        "--max-connections",
        type=int,
        default=256,
        metavar="N",
        help="open WebSocket connections at most; more get HTTP 503 (default 256)",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        # Flags are matched whole: a deployment file's overrides are found by name.
        allow_abbrev=False,
        help="run the WebSocket streaming server",
        description=(
            "Serve one or more models on one port: the browser demo at /, /healthz, /metrics, /v1/models "
            "and WebSocket streams at /v1/stream (protocol: docs/protocol.md). Stops cleanly on Ctrl-C "
            "or SIGTERM: live sessions get session.done."
        ),
    )
    add_serve_arguments(parser)
    parser.set_defaults(func=run, command_parser=parser)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of `serve` (also taken by `config`)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="deployment file (YAML; examples in deploy/, keys in docs/deploy.md): its keys are these "
        "flags' names with underscores, and flags given here override it",
    )
    models = parser.add_argument_group("model and weights")
    models.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="MODEL",
        help="model to serve; repeat for several (default: pusht). The first is the default model.",
    )
    arguments.add_weight_arguments(models)  # they apply to the real-size models, or to the only model served
    models.add_argument(
        "--default-kv-mode",
        choices=arguments.KV_MODES,
        help="K/V mode of sessions that do not ask for one (default: the model's, see /v1/models)",
    )
    parser.add_argument(
        "--transport",
        choices=("aiohttp", "asgi"),
        default="aiohttp",
        help="the web server: aiohttp (default) or asgi (the same protocol as a FastAPI application "
        'under uvicorn, as Ray Serve runs it; needs pip install -e ".[asgi]")',
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port, 1-65535; 0 picks a free one (default 8000)"
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=8,
        help="sessions per model that fit the K/V pool in their worst case (default 8)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=16, help="sessions that may wait for admission (default 16)"
    )
    _add_access_arguments(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="least severe log messages shown (default info)",
    )
    arguments.add_engine_arguments(parser)
    limits = parser.add_argument_group("session limits (backpressure and timeouts, per session)")
    for limit in SESSION_LIMIT_FLAGS:
        metavar = "N" if limit.kind is int else "SECONDS"
        limits.add_argument(limit.flag, dest=limit.field, type=limit.kind, metavar=metavar, help=limit.help)


def serve_config(args: argparse.Namespace, devices_here: bool = True) -> ServeConfig:
    """The checked configuration of the flags and `--config`; a usage error names the first
    bad key or flag. `devices_here`: also check that this machine has the devices."""
    return config_of(deployment.deploy_config(args), devices_here)


def config_of(deploy: DeployConfig, devices_here: bool = True) -> ServeConfig:
    """A validated deployment as what `serve` runs: placements checked against the devices."""
    from ..models import PRESETS
    from ..server import ServerConfig, SessionLimits

    model_ids = [m.model for m in deploy.models]
    unknown = [m for m in model_ids if m not in PRESETS]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r}; known models: {', '.join(sorted(PRESETS))}")
    if len(set(model_ids)) != len(model_ids):
        raise UsageError("each model may be served once (a --model or models[] entry named twice)")
    if deploy.server.transport == "asgi":
        _check_asgi_installed()
    placements = {}
    for i, mid in enumerate(model_ids):
        ns = deployment.model_namespace(deploy, i)
        arguments.check_engine_arguments(ns)
        if devices_here:  # every model's files, before the first loads (a Wan DiT takes minutes)
            try:
                loading.check_weight_paths(ns)
            except UsageError as e:
                raise UsageError(f"{mid} (models[{i}]): {e}") from None
        try:
            loading.override_preset(PRESETS[mid], ns)  # the geometry, checked before anything loads
        except UsageError as e:
            raise UsageError(str(e) if mid in str(e) else f"{mid}: {e}") from None
        depth = loading.model_depth(PRESETS[mid], ns) if devices_here else PRESETS[mid].num_layers
        placements[mid] = loading.placement(ns, depth, f"{mid}: ", devices_here)
    server, engine = deploy.server, deploy.engine
    token = server.auth_token if server.auth_token is not None else os.environ.get(TOKEN_ENV)
    if token is not None and not token.strip():
        raise UsageError(f"--auth-token (or {TOKEN_ENV}) must not be empty")
    limits = {k.dest: getattr(server.limits, k.key) for k in deployment.KEYS if k.section == "server.limits"}
    return ServeConfig(
        model_ids=model_ids,
        host=server.host,
        port=server.port,
        engine=arguments.engine_config(
            deployment.model_namespace(deploy, 0), max_streams=engine.max_sessions, max_queue=engine.max_queue
        ),
        server=ServerConfig(
            limits=SessionLimits(**{k: v for k, v in limits.items() if v is not None}),
            max_connections=server.max_connections,
            allowed_origins=tuple(server.allow_origin),
            auth_token=token,
        ),
        placements=placements,
        deploy=deploy,
    )


def _check_asgi_installed() -> None:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f'--transport asgi needs {" and ".join(missing)}: pip install -e ".[asgi]"')


def load_served_models(deploy: DeployConfig, placements: dict[str, Placement]) -> dict[str, list[WorldModel]]:
    """Each model of the deployment with its own weights and settings, one per replica of
    its placement (replicas on one device share it)."""
    from ..models import PRESETS

    if all(m.decoder == "lite" for m in deploy.models) and all(
        PRESETS[m.model].pixel_space for m in deploy.models
    ):
        raise UsageError("--decoder lite: the served models have no VAE decoder to replace")
    models = {}
    for i, spec in enumerate(deploy.models):
        ns = deployment.model_namespace(deploy, i)
        config = loading.override_preset(PRESETS[spec.model], ns)
        options = loading.LoadOptions.from_args(ns)
        if config.pixel_space:
            options = replace(options, decoder="wan")  # --decoder lite applies to the models with a VAE
        mid = spec.model
        models[mid] = loading.load_placed(
            config, loading.weight_paths(ns), options, placements[mid], label=f"{mid}: "
        )
    return models


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = serve_config(args)
    logging.getLogger().setLevel(config.deploy.server.log_level.upper())
    check_address(config.host, config.port)  # before the models load: a taken port fails at once
    governor = loading.apply_threads(deployment.model_namespace(config.deploy, 0), adaptive=True)
    try:  # stopped however serving ends, a model that fails to load included
        _run_server(config, load_served_models(config.deploy, config.placements))
    finally:
        if governor is not None:
            governor.stop()
    return 0


def check_address(host: str, port: int) -> None:
    """Fails with a usage error where `host:port` cannot be listened on (a port in use, a host
    name that does not resolve or is not this machine's). The server binds again later."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _run_server(config: ServeConfig, models: dict[str, list[WorldModel]]) -> None:
    import asyncio

    from ..server import StreamWorldServer

    server = StreamWorldServer(
        models, config.engine, config.server, default_model=config.model_ids[0], placements=config.placements
    )
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass  # uvloop is optional: asyncio's own loop serves too, a little slower
    asyncio.run(_serve_until_signal(server, config))


async def _serve_until_signal(server: StreamWorldServer, config: ServeConfig) -> None:
    """Serves until SIGINT or SIGTERM, then drains while the port still listens (/healthz says
    503, live sessions get session.done) before the port closes."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config.deploy.server.transport == "asgi":
        await _serve_asgi(server, config, stop)
    else:
        await _serve_aiohttp(server, config, stop)


async def _serve_aiohttp(server: StreamWorldServer, config: ServeConfig, stop) -> None:
    from aiohttp import web

    host, port = config.host, config.port
    runner = server.make_runner()
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        port = _bound_port(runner, port)  # --port 0: the port the system picked
        _announce(config, port)
        await stop.wait()
        _stopping()
        await server.drain()
    finally:
        await runner.cleanup()
    print(f"StreamWorld stopped serving at http://{host}:{port}/", flush=True)


async def _serve_asgi(server: StreamWorldServer, config: ServeConfig, stop) -> None:
    from ..server.asgi import serve_asgi

    port = await serve_asgi(
        server,
        config.host,
        config.port,
        config.deploy.server.log_level,
        stop,
        announce=lambda bound: _announce(config, bound),
        stopping=_stopping,
    )
    if port is None:
        raise UsageError(f"cannot listen on {config.host}:{config.port} (uvicorn says why above)")
    print(f"StreamWorld stopped serving at http://{config.host}:{port}/", flush=True)


def _announce(config: ServeConfig, port: int) -> None:
    host = config.host
    token = " (a token is required)" if config.server.auth_token is not None else ""
    print(
        f"StreamWorld serving {', '.join(config.model_ids)} at http://{host}:{port}/ "
        f"(streams: ws://{host}:{port}/v1/stream){token}; Ctrl-C stops",
        flush=True,
    )
    for mid, placed in config.placements.items():
        if len(placed.replicas) > 1 or len(placed.replicas[0].stages) > 1:
            print(f"  {mid}: {len(placed.replicas)} replica(s): {placed.describe()}", flush=True)


def _stopping() -> None:
    import logging

    logging.getLogger("streamworld.serve").info("stopping: draining live sessions")


def _bound_port(runner, default: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return default
