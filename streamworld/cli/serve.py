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

from . import arguments, loading
from .errors import UsageError

if TYPE_CHECKING:
    from ..engine import EngineConfig, Placement
    from ..models.world_model import WorldModel
    from ..server import ServerConfig, SessionLimits, StreamWorldServer


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
        help="run the WebSocket streaming server",
        description=(
            "Serve one or more models on one port: the browser demo at /, /healthz, /metrics, /v1/models "
            "and WebSocket streams at /v1/stream (protocol: docs/protocol.md). Stops cleanly on Ctrl-C "
            "or SIGTERM: live sessions get session.done."
        ),
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
    parser.set_defaults(func=run)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The checked configuration of the arguments; a usage error names the first bad one."""
    from ..models import PRESETS
    from ..server import ServerConfig

    model_ids = args.models or [arguments.DEFAULT_MODEL]
    unknown = [m for m in model_ids if m not in PRESETS]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r}; known models: {', '.join(sorted(PRESETS))}")
    if len(set(model_ids)) != len(model_ids):
        raise UsageError("each --model may be given once")
    if args.max_sessions < 1 or args.max_queue < 0:
        raise UsageError("--max-sessions must be at least 1 and --max-queue at least 0")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_connections < 1:
        raise UsageError("--max-connections must be at least 1")
    token = args.auth_token if args.auth_token is not None else os.environ.get(TOKEN_ENV)
    if token is not None and not token.strip():
        raise UsageError(f"--auth-token (or {TOKEN_ENV}) must not be empty")
    arguments.check_engine_arguments(args)
    placements = {
        mid: loading.placement(args, PRESETS[mid].num_layers, label=f"{mid}: ") for mid in model_ids
    }
    return ServeConfig(
        model_ids=model_ids,
        host=args.host,
        port=args.port,
        engine=arguments.engine_config(args, max_streams=args.max_sessions, max_queue=args.max_queue),
        server=ServerConfig(
            limits=session_limits(args),
            max_connections=args.max_connections,
            allowed_origins=tuple(args.allowed_origins),
            auth_token=token,
        ),
        placements=placements,
    )


def session_limits(args: argparse.Namespace) -> SessionLimits:
    """`SessionLimits` with the flags given; the rest keep their defaults."""
    from ..server import SessionLimits

    given = {}
    for limit in SESSION_LIMIT_FLAGS:
        value = getattr(args, limit.field)
        if value is None:
            continue
        # Zero would stall every stream (a count) or end every session at once (seconds).
        if limit.kind is int and value < 1:
            raise UsageError(f"{limit.flag} must be at least 1")
        if limit.kind is float and not value > 0:  # also refuses nan
            raise UsageError(f"{limit.flag} must be a positive number of seconds")
        given[limit.field] = value
    return SessionLimits(**given)


def load_served_models(
    args: argparse.Namespace, model_ids: list[str], placements: dict[str, Placement]
) -> dict[str, list[WorldModel]]:
    """Each model with the weight arguments that apply to it (see --model's help), one per
    replica of its placement (replicas on one device share it)."""
    from ..models import PRESETS
    from ..models.world_model import WeightPaths

    weights = loading.weight_paths(args)
    if args.decoder == "lite" and all(PRESETS[m].pixel_space for m in model_ids):
        raise UsageError("--decoder lite: the served models have no VAE decoder to replace")
    models = {}
    for mid in model_ids:
        config = loading.override_preset(PRESETS[mid], args)
        options = loading.LoadOptions.from_args(args)
        if config.pixel_space:
            options = replace(options, decoder="wan")  # --decoder lite applies to the models with a VAE
        if config.requires_weights or len(model_ids) == 1:
            model_weights = weights
        else:  # a small model next to others: its own weights, but the lite decoder's if given
            lite = options.decoder == "lite"
            model_weights = WeightPaths(lite_decoder=args.decoder_weights) if lite else None
        models[mid] = loading.load_placed(config, model_weights, options, placements[mid], label=f"{mid}: ")
    return models


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = serve_config(args)
    check_address(config.host, config.port)  # before the models load: a taken port fails at once
    governor = loading.apply_threads(args, adaptive=True)
    loading.check_weight_paths(args)
    models = load_served_models(args, config.model_ids, config.placements)
    try:
        _run_server(config, models)
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
    import logging
    import signal

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
        token = " (a token is required)" if config.server.auth_token is not None else ""
        print(
            f"StreamWorld serving {', '.join(config.model_ids)} at http://{host}:{port}/ "
            f"(streams: ws://{host}:{port}/v1/stream){token}; Ctrl-C stops",
            flush=True,
        )
        for mid, placed in config.placements.items():
            if len(placed.replicas) > 1 or len(placed.replicas[0].stages) > 1:
                print(f"  {mid}: {len(placed.replicas)} replica(s): {placed.describe()}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logging.getLogger("streamworld.serve").info("stopping: draining live sessions")
        await server.drain()
    finally:
        await runner.cleanup()
    print(f"StreamWorld stopped serving at http://{host}:{port}/", flush=True)


def _bound_port(runner, default: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return default
