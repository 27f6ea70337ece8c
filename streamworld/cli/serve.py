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
    from ..engine import EngineConfig
    from ..models.world_model import WorldModel
    from ..server import ServerConfig, SessionLimits, StreamWorldServer

DEFAULT_MODEL = "pusht"


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
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
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

    model_ids = args.models or [DEFAULT_MODEL]
    unknown = [m for m in model_ids if m not in PRESETS]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r}; known models: {', '.join(sorted(PRESETS))}")
    if len(set(model_ids)) != len(model_ids):
        raise UsageError("each --model may be given once")
    if args.max_sessions < 1 or args.max_queue < 0:
        raise UsageError("--max-sessions must be at least 1 and --max-queue at least 0")
    if args.max_connections < 1:
        raise UsageError("--max-connections must be at least 1")
    token = args.auth_token if args.auth_token is not None else os.environ.get(TOKEN_ENV)
    if token is not None and not token.strip():
        raise UsageError(f"--auth-token (or {TOKEN_ENV}) must not be empty")
    arguments.check_engine_arguments(args)
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


def load_served_models(args: argparse.Namespace, model_ids: list[str]) -> dict[str, WorldModel]:
    """Each model with the weight arguments that apply to it (see --model's help)."""
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
        models[mid] = loading.load_world_model(config, model_weights, options, label=f"{mid}: ")
        if args.stages > config.num_layers:
            raise UsageError(f"--stages must be at most {config.num_layers} for {mid}")
    return models


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = serve_config(args)
    loading.apply_threads(args)
    loading.check_weight_paths(args)
    models = load_served_models(args, config.model_ids)
    _run_server(config, models)
    return 0


def _run_server(config: ServeConfig, models: dict[str, WorldModel]) -> None:
    import asyncio

    from ..server import StreamWorldServer

    server = StreamWorldServer(models, config.engine, config.server, default_model=config.model_ids[0])
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

    from aiohttp import web

    host, port = config.host, config.port
    runner = server.make_runner()
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        token = " (a token is required)" if config.server.auth_token is not None else ""
        print(
            f"StreamWorld serving {', '.join(config.model_ids)} at http://{host}:{port}/ "
            f"(streams: ws://{host}:{port}/v1/stream){token}; Ctrl-C stops",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.drain()
    finally:
        await runner.cleanup()
