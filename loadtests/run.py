"""StreamWorld load generator: many WebSocket sessions against a running server.

    python loadtests/run.py --url ws://127.0.0.1:8000/v1/stream --duration 60 --json out.json \\
        [--model M] [--arrival-rate PER_S | --sessions N] [options]

Two ways to offer load:

- `--arrival-rate R`: open loop. Sessions arrive as a Poisson process of R per second for
  `--duration` seconds, whatever the server's state, each with its own length
  (`--session-chunks`, exponentially distributed around the mean; 0 = until the run ends).
  Sessions with a length run to completion after the run's end (up to `--drain` seconds).
- `--sessions N`: N sessions start together and run until the run ends (unless they are
  cancelling ones).

Each session draws a priority and a wire format from the mixes given, and may be a
cancelling session (it drops the connection, with no `session.stop`, after a random share
of its chunks) or a slow reader (it reads each chunk `--slow-factor` times slower than real
time, so the server's backpressure must hold it back without hurting the others). For
action models every session sends one action per video frame at the stream's frame rate.

The client does not decode video: it checks each payload against its announced size and
times its arrival. Per session and overall it reports time to first frame, inter-chunk
gaps (p50/p95/p99) and their jitter, the real-time factor, chunk deadline attainment
against a simulated playout buffer (playback starts `--playout-buffer` seconds after the
first chunk; a chunk that arrives after its first frame was due stalls playback until it
arrives), stalls (count and seconds), action-to-frame latency (from sending the action for
frame n to receiving the chunk that holds frame n+1) and errors by kind. It reads the
server's /metrics before and after, and checks that the KV pages go back to 0 once every
session has ended.

Output: a table on stdout and, with `--json`, everything as JSON. Exit code 0 when the run
completed (whatever it measured), 1 when the server's KV pages did not return to 0 or a
session broke the protocol, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import math
import platform
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

PRIORITIES = ("interactive", "standard", "batch")
FORMATS = ("jpeg", "h264", "fmp4", "rgb")
# Stall-free playback needs every chunk before its first frame is due; closer than this
# counts as "on time" (the simulated player's scheduling slack).
PLAYOUT_SLACK_S = 0.005


# --- configuration ---------------------------------------------------------------------------
def parse_mix(text: str, allowed: tuple[str, ...], what: str) -> dict[str, float]:
    """ "interactive:1,standard:2" -> normalised weights; a bare name means weight 1."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.strip().partition(":")
        if name not in allowed:
            raise ValueError(f"{what}: unknown {name!r} (choose from {', '.join(allowed)})")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"{what}: weight {weight!r} is not a number") from None
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"{what}: weight of {name} must be a finite number >= 0")
        mix[name] = mix.get(name, 0.0) + w
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"{what}: weights must not all be 0")
    return {k: v / total for k, v in mix.items()}


@dataclass
class LoadConfig:
    url: str
    duration_s: float
    model: str | None = None
    arrival_rate: float | None = None
    sessions: int | None = None
    session_chunks: float = 8.0
    cancel_share: float = 0.1
    slow_share: float = 0.1
    slow_factor: float = 3.0
    priorities: dict[str, float] = field(default_factory=lambda: {"standard": 1.0})
    formats: dict[str, float] = field(default_factory=lambda: {"jpeg": 1.0})
    kv_mode: str | None = None
    prompt: str = "a walk through a forest"
    playout_buffer_s: float = 0.5
    send_actions: bool = True
    ack: bool = False  # acknowledge each chunk once read (the protocol's `ack` extension)
    drain_s: float = 30.0
    seed: int = 0


@dataclass
class SessionPlan:
    index: int
    start_at: float  # seconds after the run's start
    num_chunks: int | None  # None: until the run ends
    priority: str
    format: str
    slow: bool
    cancel_after: int | None  # drop the connection after this many chunks
    seed: int


def plan_sessions(cfg: LoadConfig) -> list[SessionPlan]:
    rng = random.Random(cfg.seed)
    starts: list[float] = []
    if cfg.sessions is not None:
        starts = [0.0] * cfg.sessions
    else:
        assert cfg.arrival_rate is not None
        t = rng.expovariate(cfg.arrival_rate)
        while t < cfg.duration_s:
            starts.append(t)
            t += rng.expovariate(cfg.arrival_rate)
    plans = []
    for i, start in enumerate(starts):
        length = None
        if cfg.session_chunks > 0 and cfg.sessions is None:
            length = max(1, round(rng.expovariate(1.0 / cfg.session_chunks)))
        cancel = None
        if rng.random() < cfg.cancel_share:
            upto = length if length is not None else max(2, round(cfg.session_chunks) or 8)
            cancel = rng.randint(1, max(1, upto - 1))
        plans.append(
            SessionPlan(
                index=i,
                start_at=start,
                num_chunks=length,
                priority=_draw(rng, cfg.priorities),
                format=_draw(rng, cfg.formats),
                # A cancelling session reads at full speed: each session is one kind.
                slow=cancel is None and rng.random() < cfg.slow_share,
                cancel_after=cancel,
                seed=cfg.seed * 100_003 + i,
            )
        )
    return plans


def _draw(rng: random.Random, mix: dict[str, float]) -> str:
    x, acc = rng.random(), 0.0
    for name, w in mix.items():
        acc += w
        if x < acc:
            return name
    return next(reversed(mix))


def grey_image(model: dict[str, Any]) -> str:
    """A mid-grey first frame as a base64 PNG, for image models whose server has no default."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (int(model["width"]), int(model["height"])), (128, 128, 128)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


# --- one session ------------------------------------------------------------------------------
@dataclass
class SessionRecord:
    index: int
    priority: str
    format: str
    kind: str  # "normal", "slow" or "cancel"
    planned_chunks: int | None
    started_at: float | None = None  # run clock: connection opened
    admitted_s: float | None = None  # session.start -> session.started
    ttff_s: float | None = None  # session.start -> first chunk payload
    chunk_times: list[float] = field(default_factory=list)  # run clock, payload arrivals
    chunk_frames: list[int] = field(default_factory=list)
    chunk_first_frames: list[int] = field(default_factory=list)
    fps: float | None = None
    bytes: int = 0
    actions_sent: int = 0
    action_latencies: list[float] = field(default_factory=list)
    queued: bool = False
    end: str = "unfinished"  # completed, stopped, cancelled, error, connect_failed, closed
    error_code: str | None = None
    error_message: str | None = None
    close_code: int | None = None
    protocol_errors: list[str] = field(default_factory=list)


class Session:
    def __init__(
        self, cfg: LoadConfig, model: dict[str, Any], plan: SessionPlan, t0: float, stop_event: asyncio.Event
    ) -> None:
        self.cfg, self.model, self.plan, self.t0, self.stop_event = cfg, model, plan, t0, stop_event
        kind = "cancel" if plan.cancel_after is not None else ("slow" if plan.slow else "normal")
        self.rec = SessionRecord(plan.index, plan.priority, plan.format, kind, plan.num_chunks)
        self.action_sent_at: dict[int, float] = {}  # video frame -> when its action was sent

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> SessionRecord:
        rec, cfg = self.rec, self.cfg
        rec.started_at = self.now()
        try:
            # No keepalive pings: a slow reader's unread queue would hold back their pongs and
            # the client library would close the connection itself.
            async with connect(cfg.url, max_size=256 * 2**20, open_timeout=30, ping_interval=None) as ws:
                await self._session(ws)
                rec.close_code = ws.close_code
        except (OSError, InvalidStatus, InvalidURI, asyncio.TimeoutError) as e:
            if rec.end == "unfinished":
                rec.end, rec.error_code, rec.error_message = "connect_failed", "connect_failed", str(e)
        except ConnectionClosed as e:
            rec.close_code = e.rcvd.code if e.rcvd is not None else None
            if rec.end == "unfinished":
                rec.end = "error" if rec.error_code else "closed"
                rec.error_code = rec.error_code or "connection_closed"
        except asyncio.CancelledError:
            if rec.end == "unfinished":
                rec.end, rec.error_code = "timeout", "drain_timeout"
            raise
        except Exception as e:  # anything else (a bad handshake, bad JSON) is an error, not lost
            if rec.end == "unfinished":
                rec.end, rec.error_code = "error", f"client:{type(e).__name__}"
                rec.error_message = str(e)
        return rec

    async def _session(self, ws) -> None:
        rec, plan, cfg = self.rec, self.plan, self.cfg
        start: dict[str, Any] = {
            "type": "session.start",
            "seed": plan.seed,
            "num_chunks": plan.num_chunks,
            "format": plan.format,
            "priority": plan.priority,
            "model": self.model["id"],
        }
        if self.model.get("takes_prompt"):
            start["prompt"] = cfg.prompt
        if self.model.get("needs_image") and not self.model.get("has_default_image"):
            start["image"] = grey_image(self.model)
        if cfg.kv_mode:
            start["kv_mode"] = cfg.kv_mode
        sent_at = self.now()
        await ws.send(json.dumps(start))
        action_task: asyncio.Task | None = None
        stop_task = asyncio.create_task(self._stop_at_end(ws))
        pending_meta: dict[str, Any] | None = None
        try:
            async for message in ws:
                if isinstance(message, bytes):
                    if pending_meta is None:
                        rec.protocol_errors.append("binary message without a chunk header")
                        continue
                    if pending_meta.get("_init"):
                        pending_meta = None  # the fmp4 initialization segment
                        continue
                    await self._on_payload(pending_meta, message, sent_at)
                    index = pending_meta.get("index")
                    pending_meta = None
                    if plan.cancel_after is not None and len(rec.chunk_times) >= plan.cancel_after:
                        rec.end = "cancelled"
                        ws.transport.abort()  # a dropped connection, not a polite close
                        return
                    if plan.slow and rec.fps:
                        # Read the next message only after this chunk would have played
                        # `slow_factor` times over.
                        await asyncio.sleep(cfg.slow_factor * rec.chunk_frames[-1] / rec.fps)
                    if cfg.ack and isinstance(index, int):
                        # The session may have ended meanwhile; its last messages are still read.
                        with contextlib.suppress(ConnectionClosed):
                            await ws.send(json.dumps({"type": "ack", "chunk": index}))
                    continue
                msg = json.loads(message)
                kind = msg.get("type")
                if kind == "session.queued":
                    rec.queued = True
                elif kind == "session.started":
                    rec.admitted_s = self.now() - sent_at
                    rec.fps = float(msg.get("fps") or 0) or None
                    if plan.format == "fmp4":
                        pending_meta = {"_init": True}
                    if cfg.send_actions and msg.get("action_dim"):
                        action_task = asyncio.create_task(self._send_actions(ws, int(msg["action_dim"])))
                elif kind == "chunk":
                    pending_meta = msg
                elif kind == "session.done":
                    rec.end = msg.get("reason", "completed")
                    if rec.end == "error" and rec.error_code is None:
                        rec.error_code = "session_error"
                elif kind == "error":
                    rec.error_code = msg.get("code", "unknown")
                    rec.error_message = msg.get("message")
                elif kind == "pong":
                    pass
                else:
                    rec.protocol_errors.append(f"unknown message type {kind!r}")
        finally:
            stop_task.cancel()
            if action_task is not None:
                action_task.cancel()
        if rec.end == "unfinished":
            rec.end = "error" if rec.error_code else "closed"

    async def _stop_at_end(self, ws) -> None:
        """At the end of the run, politely stop the sessions that have no length of their own
        (sessions with one run to completion: every arrival is measured whole)."""
        if self.plan.num_chunks is not None:
            return
        await self.stop_event.wait()
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps({"type": "session.stop"}))

    async def _on_payload(self, meta: dict[str, Any], payload: bytes, sent_at: float) -> None:
        rec = self.rec
        now = self.now()
        if meta.get("bytes") is not None and meta["bytes"] != len(payload):
            rec.protocol_errors.append(
                f"chunk {meta.get('index')}: {len(payload)} bytes, announced {meta['bytes']}"
            )
        sizes = meta.get("sizes")
        if sizes is not None and sum(sizes) != len(payload):
            rec.protocol_errors.append(f"chunk {meta.get('index')}: frame sizes do not add up")
        if meta.get("index") != len(rec.chunk_times):
            rec.protocol_errors.append(f"chunk {meta.get('index')} arrived as number {len(rec.chunk_times)}")
        if not rec.chunk_times:
            rec.ttff_s = now - sent_at
        rec.chunk_times.append(now)
        n = int(meta.get("num_frames") or 0)
        first = int(meta.get("first_frame") or 0)
        rec.chunk_frames.append(n)
        rec.chunk_first_frames.append(first)
        rec.bytes += len(payload)
        for frame in range(first, first + n):
            sent = self.action_sent_at.pop(frame - 1, None)  # the action of frame n shows in n+1
            if sent is not None:
                rec.action_latencies.append(now - sent)

    async def _send_actions(self, ws, action_dim: int) -> None:
        """One action per video frame at the frame rate, each for the frame after the newest received."""
        rng = random.Random(self.plan.seed)
        fps = self.rec.fps or 10.0
        try:
            while True:
                rec = self.rec
                nxt = rec.chunk_first_frames[-1] + rec.chunk_frames[-1] if rec.chunk_times else 0
                frame = max(nxt, max(self.action_sent_at, default=-1) + 1)
                action = [rng.uniform(-1.0, 1.0) for _ in range(action_dim)]
                await ws.send(json.dumps({"type": "action", "actions": [action], "frame": frame}))
                self.action_sent_at[frame] = self.now()
                rec.actions_sent += 1
                await asyncio.sleep(1.0 / fps)
        except ConnectionClosed:
            pass


# --- derived metrics ---------------------------------------------------------------------------
def playout(times: list[float], frames: list[int], fps: float | None, buffer_s: float) -> dict[str, Any]:
    """A simulated player: starts `buffer_s` after chunk 0 arrives and plays at `fps`; a chunk
    that arrives after its first frame was due stalls playback until it arrives."""
    if not times or not fps:
        return {"on_time": 0, "chunks": len(times), "stalls": 0, "stall_s": 0.0}
    start, played, stall_s, stalls, on_time = times[0] + buffer_s, 0, 0.0, 0, 0
    for t, n in zip(times, frames, strict=True):
        due = start + stall_s + played / fps
        if t <= due + PLAYOUT_SLACK_S:
            on_time += 1
        else:
            stalls += 1
            stall_s += t - due
        played += n
    return {"on_time": on_time, "chunks": len(times), "stalls": stalls, "stall_s": stall_s}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def session_metrics(rec: SessionRecord, buffer_s: float) -> dict[str, Any]:
    gaps = [b - a for a, b in zip(rec.chunk_times, rec.chunk_times[1:], strict=False)]
    frames = sum(rec.chunk_frames)
    rtf = None
    if len(rec.chunk_times) > 1 and rec.fps:
        span = rec.chunk_times[-1] - rec.chunk_times[0]
        rtf = (frames - rec.chunk_frames[0]) / rec.fps / span if span > 0 else None
    return {
        "chunks": len(rec.chunk_times),
        "frames": frames,
        "ttff_s": rec.ttff_s,
        "gaps_s": gaps,
        "jitter_s": statistics.pstdev(gaps) if len(gaps) > 1 else None,
        "real_time_factor": rtf,
        "playout": playout(rec.chunk_times, rec.chunk_frames, rec.fps, buffer_s),
    }


def summarise(records: list[SessionRecord], buffer_s: float) -> dict[str, Any]:
    per = [session_metrics(r, buffer_s) for r in records]
    gaps = [g for m in per for g in m["gaps_s"]]
    on_time = sum(m["playout"]["on_time"] for m in per)
    chunks = sum(m["playout"]["chunks"] for m in per)
    ttffs = [m["ttff_s"] for m in per if m["ttff_s"] is not None]
    rtfs = [m["real_time_factor"] for m in per if m["real_time_factor"] is not None]
    jitters = [m["jitter_s"] for m in per if m["jitter_s"] is not None]
    latencies = [x for r in records for x in r.action_latencies]
    ends: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in records:
        ends[r.end] = ends.get(r.end, 0) + 1
        if r.error_code:
            errors[r.error_code] = errors.get(r.error_code, 0) + 1
        if r.protocol_errors:
            errors["protocol"] = errors.get("protocol", 0) + 1
    return {
        "sessions": len(records),
        "ends": ends,
        "errors": errors,
        "chunks": chunks,
        "frames": sum(m["frames"] for m in per),
        "ttff_s": {"p50": _pct(ttffs, 50), "p95": _pct(ttffs, 95), "max": max(ttffs, default=None)},
        "inter_chunk_s": {"p50": _pct(gaps, 50), "p95": _pct(gaps, 95), "p99": _pct(gaps, 99)},
        "jitter_s": {"mean": statistics.fmean(jitters) if jitters else None},
        "real_time_factor": {"p50": _pct(rtfs, 50), "min": min(rtfs, default=None)},
        "deadline_attainment": on_time / chunks if chunks else None,
        "stalls": {
            "count": sum(m["playout"]["stalls"] for m in per),
            "seconds": sum(m["playout"]["stall_s"] for m in per),
        },
        "action_to_frame_s": {"p50": _pct(latencies, 50), "p95": _pct(latencies, 95), "n": len(latencies)},
    }


# --- server metrics ----------------------------------------------------------------------------
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


SERVER_COUNTERS = (
    "streamworld_frames_generated_total",
    "streamworld_chunk_deadline_miss_total",
    "streamworld_action_to_frame_seconds_sum",
    "streamworld_action_to_frame_seconds_count",
    "streamworld_time_to_first_frame_seconds_count",
    "streamworld_time_to_first_frame_seconds_sum",
)


async def wait_pages_free(base: str, timeout_s: float = 15.0) -> dict[str, float]:
    """Server metrics once no KV page is in use (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = await fetch_metrics(base)
        if metrics.get("streamworld_kv_pages_used", 0.0) == 0 or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.25)


# --- the run -----------------------------------------------------------------------------------
async def run_load(cfg: LoadConfig, progress: bool = True) -> dict[str, Any]:
    base = http_base(cfg.url)
    model = await fetch_model(base, cfg.model)
    before = await fetch_metrics(base)
    plans = plan_sessions(cfg)
    stop_event = asyncio.Event()
    t0 = time.monotonic()
    sessions = [Session(cfg, model, p, t0, stop_event) for p in plans]

    async def launch(s: Session) -> SessionRecord:
        await asyncio.sleep(max(0.0, s.plan.start_at - (time.monotonic() - t0)))
        return await s.run()

    tasks = [asyncio.create_task(launch(s)) for s in sessions]
    ticker = asyncio.create_task(_progress(sessions, cfg.duration_s, t0)) if progress else None
    await asyncio.sleep(cfg.duration_s)
    stop_event.set()
    _, pending = await asyncio.wait(tasks, timeout=cfg.drain_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if ticker is not None:
        ticker.cancel()
        print(file=sys.stderr)
    wall = time.monotonic() - t0
    after = await wait_pages_free(base)
    records = [s.rec for s in sessions]
    kinds = {k: [r for r in records if r.kind == k] for k in ("normal", "cancel", "slow")}
    keeping_up = kinds["normal"] + kinds["cancel"]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "client_machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}",
        "config": asdict(cfg),
        "model": model,
        "wall_s": wall,
        "overall": summarise(keeping_up, cfg.playout_buffer_s),
        "by_kind": {k: summarise(v, cfg.playout_buffer_s) for k, v in kinds.items() if v},
        "by_priority": {
            p: summarise([r for r in keeping_up if r.priority == p], cfg.playout_buffer_s)
            for p in PRIORITIES
            if any(r.priority == p for r in keeping_up)
        },
        "server": {
            "kv_pages_used_after": after.get("streamworld_kv_pages_used"),
            "kv_pages_total": after.get("streamworld_kv_pages_total"),
            "sessions_active_after": after.get("streamworld_sessions_active"),
            "deltas": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SERVER_COUNTERS},
        },
        "sessions": [
            {**asdict(r), "metrics": {k: v for k, v in session_metrics(r, cfg.playout_buffer_s).items()}}
            for r in records
        ],
    }


async def _progress(sessions: list[Session], duration: float, t0: float) -> None:
    while True:
        t = time.monotonic() - t0
        live = sum(1 for s in sessions if s.rec.started_at is not None and s.rec.end == "unfinished")
        chunks = sum(len(s.rec.chunk_times) for s in sessions)
        print(
            f"\r{min(t, duration):6.1f}/{duration:.0f} s  sessions live {live:3d}  chunks {chunks:6d}",
            end="",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.sleep(1.0)


# --- report ------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_report(result: dict[str, Any]) -> str:
    cfg = result["config"]
    load = (
        f"{cfg['sessions']} sessions held"
        if cfg["sessions"] is not None
        else f"Poisson arrivals {cfg['arrival_rate']}/s, mean {cfg['session_chunks']} chunks per session"
    )
    header = (
        "class",
        "sessions",
        "chunks",
        "ttff p50/p95 s",
        "gap p50/p95/p99 s",
        "jitter s",
        "rtf p50",
        "deadlines",
        "stalls (s)",
        "action->frame p50/p95 s",
        "errors",
    )
    table = [header]
    rows = [("all (not slow)", result["overall"])] + [(k, v) for k, v in result["by_kind"].items()]
    rows += [(f"  {p}", v) for p, v in result["by_priority"].items()]
    for name, s in rows:
        ttff, gap, act = s["ttff_s"], s["inter_chunk_s"], s["action_to_frame_s"]
        deadlines = "-" if s["deadline_attainment"] is None else f"{100 * s['deadline_attainment']:.1f}%"
        table.append(
            (
                name,
                str(s["sessions"]),
                str(s["chunks"]),
                f"{_f(ttff['p50'], '{:.2f}')}/{_f(ttff['p95'], '{:.2f}')}",
                f"{_f(gap['p50'])}/{_f(gap['p95'])}/{_f(gap['p99'])}",
                _f(s["jitter_s"]["mean"]),
                _f(s["real_time_factor"]["p50"], "{:.2f}"),
                deadlines,
                f"{s['stalls']['count']} ({s['stalls']['seconds']:.1f})",
                f"{_f(act['p50'])}/{_f(act['p95'])}",
                ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"{cfg['url']}  model {result['model']['id']}  {cfg['duration_s']:.0f} s, {load}"]
    for row in table:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)]
        lines.append("  ".join([*cells, row[-1]]))
    server = result["server"]
    d = server["deltas"]
    lines.append(
        f"server: frames generated {d['streamworld_frames_generated_total']:.0f}, deadline misses "
        f"{d['streamworld_chunk_deadline_miss_total']:.0f}, KV pages in use after the run "
        f"{_f(server['kv_pages_used_after'], '{:.0f}')} of {_f(server['kv_pages_total'], '{:.0f}')}"
    )
    return "\n".join(lines)


def check(result: dict[str, Any]) -> list[str]:
    """What makes the run a failure (not a slow server: a broken one)."""
    problems = []
    if result["server"]["kv_pages_used_after"] not in (0, 0.0, None):
        pages = result["server"]["kv_pages_used_after"]
        problems.append(f"{pages:.0f} KV pages still in use after every session ended")
    broken = [s["index"] for s in result["sessions"] if s["protocol_errors"]]
    if broken:
        problems.append(f"sessions {broken[:10]} saw protocol errors")
    return problems


# --- command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python loadtests/run.py",
        description=__doc__.split("\n\n")[0] + " Open-loop Poisson arrivals (--arrival-rate) or N held "
        "sessions (--sessions); reports latency, jitter, real-time factor, playout deadlines, stalls, "
        "action-to-frame latency and errors, and checks the server frees every KV page.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--url", required=True, help="the server's stream endpoint, ws://HOST:PORT/v1/stream")
    p.add_argument("--duration", type=float, required=True, help="seconds of offered load")
    p.add_argument("--json", metavar="OUT", help="write the full result (every session) as JSON")
    p.add_argument("--model", help="model id (default: the server's default model)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--arrival-rate", type=float, metavar="PER_S", help="Poisson arrivals per second")
    load.add_argument("--sessions", type=int, metavar="N", help="N sessions held for the whole run")
    p.add_argument(
        "--session-chunks",
        type=float,
        default=8.0,
        help="mean session length in chunks (exponential) with --arrival-rate; 0 = until the run ends",
    )
    p.add_argument("--cancel-share", type=float, default=0.1, help="share of sessions that disconnect")
    p.add_argument("--slow-share", type=float, default=0.1, help="share of sessions that read slowly")
    p.add_argument(
        "--slow-factor", type=float, default=3.0, help="a slow reader takes this many times real time"
    )
    p.add_argument(
        "--priorities", default="interactive:1,standard:2,batch:1", help="priority mix, name:weight,..."
    )
    p.add_argument("--formats", default="jpeg:1,h264:1", help="wire format mix, name:weight,...")
    p.add_argument("--kv-mode", choices=("clean", "final", "noisy"), help="KV mode (default: the model's)")
    p.add_argument("--prompt", default="a walk through a forest", help="prompt (text models only)")
    p.add_argument(
        "--playout-buffer", type=float, default=0.5, help="seconds the simulated player buffers first"
    )
    p.add_argument("--no-actions", action="store_true", help="do not send actions to action models")
    p.add_argument(
        "--ack",
        action="store_true",
        help="acknowledge each chunk once read (protocol extension): the server then holds a slow "
        "reader's lag to a few chunks by pausing its stream, instead of letting socket buffers fill",
    )
    p.add_argument("--drain", type=float, default=30.0, help="seconds for sessions to end after the run")
    p.add_argument("--seed", type=int, default=0, help="seed of the session plan (arrivals, mixes, lengths)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    if args.duration <= 0:
        raise ValueError("--duration must be positive")
    if args.arrival_rate is not None and args.arrival_rate <= 0:
        raise ValueError("--arrival-rate must be positive")
    if args.sessions is not None and args.sessions < 1:
        raise ValueError("--sessions must be at least 1")
    for name in ("cancel_share", "slow_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be between 0 and 1")
    if args.slow_factor <= 1.0:
        raise ValueError("--slow-factor must be above 1 (a slow reader reads slower than real time)")
    if args.session_chunks < 0 or args.playout_buffer < 0 or args.drain < 0:
        raise ValueError("--session-chunks, --playout-buffer and --drain must be at least 0")
    http_base(args.url)
    return LoadConfig(
        url=args.url,
        duration_s=args.duration,
        model=args.model,
        arrival_rate=args.arrival_rate,
        sessions=args.sessions,
        session_chunks=args.session_chunks,
        cancel_share=args.cancel_share,
        slow_share=args.slow_share,
        slow_factor=args.slow_factor,
        priorities=parse_mix(args.priorities, PRIORITIES, "--priorities"),
        formats=parse_mix(args.formats, FORMATS, "--formats"),
        kv_mode=args.kv_mode,
        prompt=args.prompt,
        playout_buffer_s=args.playout_buffer,
        send_actions=not args.no_actions,
        ack=args.ack,
        drain_s=args.drain,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.json:
        from pathlib import Path

        if not Path(args.json).resolve().parent.is_dir():
            parser.exit(2, f"{parser.prog}: error: --json: folder {Path(args.json).parent} does not exist\n")
    try:
        result = asyncio.run(run_load(cfg, progress=not args.quiet))
    except OSError as e:
        print(f"{parser.prog}: cannot reach the server at {http_base(cfg.url)}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    problems = check(result)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
