"""The server's HTTP side, as the load generator reads it: the model entry and the metrics.

The generator learns what to ask for from `/v1/models` (prompt or not, first image or not)
and measures the server from `/metrics` before and after the run. It reads them with the
standard library in a worker thread, so that it needs no HTTP client beyond `websockets`.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit, urlunsplit


def http_base(ws_url: str) -> str:
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"--url must be ws://HOST:PORT/v1/stream or wss://..., got {ws_url!r}")
    return urlunsplit((scheme, parts.netloc, "", "", ""))


def parse_prometheus(text: str) -> dict[str, float]:
    """Sums over labels: {"streamworld_kv_pages_used": 0.0, ...} plus "name{labels}" entries."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if name != key:
            out[name] = out.get(name, 0.0) + v
    return out


async def _get(url: str) -> str:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    return await asyncio.to_thread(get)


async def fetch_metrics(base: str) -> dict[str, float]:
    return parse_prometheus(await _get(f"{base}/metrics"))


async def fetch_model(base: str, model: str | None) -> dict[str, Any]:
    """The /v1/models entry of `model` (or of the server's default model)."""
    entries = json.loads(await _get(f"{base}/v1/models"))["models"]
    for entry in entries:
        if entry["id"] == model or (model is None and entry.get("default")):
            return entry
    if model is None and entries:
        return entries[0]
    served = ", ".join(e["id"] for e in entries)
    raise ValueError(f"the server does not serve model {model!r} (it serves {served})")


async def wait_instances_free(base: str, instances: set[str], timeout_s: float = 15.0) -> dict[str, float]:
    """K/V pages in use per server instance, where several servers share one address (Ray
    Serve replicas): /healthz answers from one of them at a time, so it is asked until each
    of `instances` has answered with none in use (or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    seen: dict[str, float] = {}
    while True:
        body = json.loads(await _get(f"{base}/healthz"))
        if body.get("instance") is not None:
            seen[body["instance"]] = float(sum(body.get("kv_pages_used", {}).values()))
        done = instances <= set(seen) and not any(seen[i] for i in instances)
        if done or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.1)


async def wait_pages_free(base: str, timeout_s: float = 15.0) -> dict[str, float]:
    """Server metrics once no KV page is in use (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = await fetch_metrics(base)
        if metrics.get("streamworld_kv_pages_used", 0.0) == 0 or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.25)
