"""`streamworld ray-serve`: the server's replicas on Ray Serve, from a deployment file.

Takes every `serve` flag (they override the file, as for `serve`), checks the configuration
here without loading a model, then starts the application on the Ray cluster at
`ray.address` (or a local Ray instance) and serves until Ctrl-C or SIGTERM. Needs the
optional extra: pip install -e ".[ray]". streamworld/deploy/ray_serve.py has the details.
"""

from __future__ import annotations

import argparse

from . import deployment, serve
from .errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "ray-serve",
        # Flags are matched whole: a deployment file's overrides are found by name.
        allow_abbrev=False,
        help='run replicas of the server on Ray Serve (pip install -e ".[ray]")',
        description=(
            "Serve the deployment file's models as Ray Serve replicas behind one port: each replica is a "
            "whole StreamWorld server (protocol v1, the browser demo, /healthz, /metrics), and a session "
            "stays on the replica that took it. The file's ray: section sets replicas, autoscaling, "
            "resources and the cluster address (docs/deploy.md, Ray Serve)."
        ),
    )
    serve.add_serve_arguments(parser)
    parser.set_defaults(func=run, command_parser=parser)


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    deploy = deployment.deploy_config(args)
    serve.config_of(deploy, devices_here=False)  # the devices are the replicas' to check
    from ..deploy import ray_serve
    from ..deploy.config import DeployError

    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        raise UsageError(f'Ray Serve is not installed: pip install -e ".[ray]" ({e})') from None
    try:
        ray_serve.deployment_options(deploy)  # checks the ray: section
    except DeployError as e:
        raise UsageError(str(e)) from None
    ray_serve.run(deploy)
    return 0
