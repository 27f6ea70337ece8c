"""StreamWorld on Ray Serve: replicas of the whole server behind Ray's proxy, on one port.

    streamworld ray-serve --config deploy/ray-cpu.yaml          (a local Ray, or `ray.address`)
    serve run streamworld.deploy.ray_serve:app_builder config=deploy/ray-cpu.yaml

Each Ray Serve replica is one `StreamWorldServer` (its models, engines and K/V pools, on the
GPUs Ray gives it) served as the ASGI application of server/asgi.py: the same routes and
protocol v1 as `streamworld serve`. A session is one WebSocket, so it stays on the replica
whose K/V pages hold it, for its whole life.

How Ray's parts map onto the server's (docs/deploy.md, "Ray Serve", says why):

- `max_ongoing_requests` = `engine.max_sessions + HEADROOM`. An open WebSocket is one
  ongoing request for its whole life, and a replica at its limit takes nothing new: Ray's
  router (power of two choices) sends the session to another replica. The headroom keeps
  room for HTTP requests (health, models, metrics share the limit); a session that lands
  there while the replica is full (a burst the router's probes have not seen yet) waits in
  the replica's own queue (`session.queued`) or gets `overloaded` and close 1013, as on one
  server. When every replica is at its limit, Ray's proxy holds new upgrades until a
  session ends (the client's handshake waits; give it a timeout).
- Autoscaling counts ongoing requests, that is, open sessions: `ray.target_sessions` per
  replica (default `engine.max_sessions`) between `min_replicas` and `max_replicas`.
- A replica that leaves (downscale, upgrade) gets no new session from Ray's routers and
  keeps serving its live ones until they end or `graceful_shutdown_timeout_s` passes, when
  Ray stops it (its clients then see the connection drop). Its engines stop in `__del__`,
  which Ray runs once the last session has ended.
- Metrics: each replica exports the server's gauges and counters (sessions, K/V pages,
  frames, session ends) through Ray's metrics (`ray.serve.metrics`), tagged by Ray with the
  deployment and replica, at the Ray metrics port; `/metrics` through the proxy answers
  from whichever replica takes the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from typing import Any

from .config import DeployConfig, DeployError, RaySection

log = logging.getLogger("streamworld.ray")

# Requests a replica takes beyond its sessions: HTTP requests (health, models, metrics).
HEADROOM = 2
METRICS_PERIOD_S = 5.0


def deployment_options(deploy: DeployConfig) -> dict[str, Any]:
    """The Ray Serve deployment options of a deployment file."""
    ray = deploy.ray or RaySection()
    if ray.min_replicas > ray.max_replicas:
        raise DeployError(
            f"ray.min_replicas ({ray.min_replicas}) is above ray.max_replicas ({ray.max_replicas})"
        )
    engine = deploy.engine
    options: dict[str, Any] = {
        "name": ray.name,
        "max_ongoing_requests": engine.max_sessions + HEADROOM,
        "ray_actor_options": {"num_cpus": ray.num_cpus, "num_gpus": ray.num_gpus},
        "graceful_shutdown_timeout_s": ray.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": 5.0,
    }
    if ray.min_replicas == ray.max_replicas:
        options["num_replicas"] = ray.max_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": ray.min_replicas,
            "max_replicas": ray.max_replicas,
            "target_ongoing_requests": ray.target_sessions or engine.max_sessions,
            "upscale_delay_s": ray.upscale_delay_s,
            "downscale_delay_s": ray.downscale_delay_s,
        }
    return options


class StreamWorldReplica:
    """One Ray Serve replica: a whole StreamWorld server (decorated in `application`)."""

    async def __init__(self, deploy: dict) -> None:
        from ray import serve

        from ..cli.deployment import model_namespace
        from ..cli.loading import apply_threads
        from ..cli.serve import config_of, load_served_models
        from ..server import StreamWorldServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = DeployConfig.model_validate(deploy)
        served = config_of(config)  # devices checked here, where Ray placed the replica
        self.instance = serve.get_replica_context().replica_id.unique_id
        server_config = dataclasses.replace(served.server, instance=self.instance)
        apply_threads(model_namespace(config, 0))
        models = await asyncio.to_thread(load_served_models, config, served.placements)
        self.server = StreamWorldServer(
            models,
            served.engine,
            server_config,
            default_model=served.model_ids[0],
            placements=served.placements,
        )
        await self.server.start()
        self._export = asyncio.get_running_loop().create_task(_export_metrics(self.server))
        log.info("replica %s serving %s", self.instance, ", ".join(served.model_ids))

    def __serve_build_asgi_app__(self):
        from ..server.asgi import build_asgi_app

        return build_asgi_app(self.server, manage_lifespan=False)

    async def __del__(self) -> None:
        """Ray runs this once the replica's last session has ended (or it is stopped)."""
        self._export.cancel()
        await self.server.drain()
        await self.server.close()


async def _export_metrics(server) -> None:
    """The server's gauges and counters as Ray metrics, every `METRICS_PERIOD_S`."""
    from ray.serve import metrics as ray_metrics

    gauges: dict[str, Any] = {}
    while True:
        try:
            _export_once(server, gauges, ray_metrics)
        except Exception:  # a metric Ray refuses must not stop the others for good
            log.warning("exporting metrics to Ray failed", exc_info=True)
        await asyncio.sleep(METRICS_PERIOD_S)


def _export_once(server, gauges: dict[str, Any], ray_metrics) -> None:
    for family in server.metrics.registry.collect():
        if family.type not in ("gauge", "counter"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            gauge = gauges.get(sample.name)
            if gauge is None:
                keys = tuple(sorted(sample.labels))
                gauge = ray_metrics.Gauge(sample.name, description=family.documentation, tag_keys=keys)
                gauges[sample.name] = gauge
            gauge.set(sample.value, tags=dict(sample.labels))


def application(deploy: DeployConfig):
    """The Ray Serve application of a deployment file."""
    from ray import serve

    cls = serve.ingress()(StreamWorldReplica)
    return serve.deployment(cls, **deployment_options(deploy)).bind(_for_replicas(deploy))


def _for_replicas(deploy: DeployConfig) -> dict:
    """The configuration each replica gets. The token from this process's environment goes
    with it: replicas on other nodes do not see STREAMWORLD_AUTH_TOKEN here."""
    import os

    data = deploy.model_dump(mode="json")
    token = os.environ.get("STREAMWORLD_AUTH_TOKEN")
    if data["server"]["auth_token"] is None and token:
        data["server"]["auth_token"] = token
    return data


def app_builder(args: dict[str, str]):
    """For `serve run streamworld.deploy.ray_serve:app_builder config=FILE` and KubeRay's
    `serveConfigV2` (`import_path` and `args: {config: FILE}`)."""
    from .config import load

    if "config" not in args:
        raise ValueError("app_builder needs config=<deployment file>")
    return application(load(args["config"]))


def run(deploy: DeployConfig, on_ready=lambda url: None) -> None:
    """Starts the application on Ray (the cluster at `ray.address`, or a local one) and
    serves until SIGINT or SIGTERM; then deletes it, letting replicas finish their sessions
    for up to `graceful_shutdown_timeout_s`."""
    import ray
    from ray import serve

    section = deploy.ray or RaySection()
    host, port = deploy.server.host, deploy.server.port
    if section.address is None:
        ray.init(include_dashboard=False, log_to_driver=True)
    else:
        ray.init(address=section.address, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(deploy), name=section.name, route_prefix="/")
        url = f"http://{host}:{port}/"
        print(
            f"StreamWorld on Ray Serve: {', '.join(m.model for m in deploy.models)} at {url} "
            f"(streams: ws://{host}:{port}/v1/stream); Ctrl-C stops",
            flush=True,
        )
        on_ready(url)
        _wait_for_signal()
        print("stopping: replicas finish their live sessions", flush=True)
        _delete(section.name, section.graceful_shutdown_timeout_s + 30.0)
    finally:
        if section.address is None:
            serve.shutdown()
            ray.shutdown()


def _delete(name: str, timeout_s: float) -> None:
    """Deletes the application and waits, at most `timeout_s`, for its replicas to finish
    their sessions and stop (a Ray cluster that went away meanwhile ends the wait)."""
    import time

    from ray import serve

    deadline = time.monotonic() + timeout_s
    try:
        serve.delete(name, _blocking=False)
        while time.monotonic() < deadline and name in serve.status().applications:
            time.sleep(1.0)
    except Exception as e:  # the cluster is gone: nothing is left to wait for
        log.warning("Ray Serve did not confirm the application's end: %s", e)


def _wait_for_signal() -> None:
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    asyncio.run(wait())
