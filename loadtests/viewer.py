"""One viewer: a client session that connects, reads its chunks and times them.

A `Viewer` plays one `SessionPlan` over a WebSocket (the protocol in `docs/protocol.md`) and
fills a `SessionRecord` with raw observations: when each chunk's payload arrived, how many
frames it held, when each action was sent, how the session ended. It does not decode video,
so that many viewers measure the server rather than the client; it checks each payload
against its announced size and chunk order instead. Figures derived from the record are the
report's (`loadtests/report.py`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from loadtests.plan import LoadConfig, SessionPlan


def grey_image(model: dict[str, Any]) -> str:
    """A mid-grey first frame as a base64 PNG, for image models whose server has no default."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (int(model["width"]), int(model["height"])), (128, 128, 128)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


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
    # Which server holds the session where several share one address (Ray Serve replicas),
    # and which engine replica of the model (session.started extensions).
    instance: str | None = None
    replica: int | None = None


class Viewer:
    def __init__(
        self, cfg: LoadConfig, model: dict[str, Any], plan: SessionPlan, t0: float, stop_event: asyncio.Event
    ) -> None:
        self.cfg, self.model, self.plan, self.t0, self.stop_event = cfg, model, plan, t0, stop_event
        kind = "cancel" if plan.cancel_after is not None else ("slow" if plan.slow else "normal")
        self.rec = SessionRecord(plan.index, plan.priority, plan.format, kind, plan.num_chunks)
        self.action_sent_at: dict[int, float] = {}  # video frame -> when its action was sent
        self._sent_at = 0.0  # run clock: session.start sent
        # The chunk header whose binary payload comes next; {"_init": True} for the fmp4
        # initialization segment, which is not a chunk.
        self._pending_meta: dict[str, Any] | None = None
        self._action_task: asyncio.Task | None = None

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

    def _start_message(self) -> dict[str, Any]:
        plan, cfg = self.plan, self.cfg
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
        return start

    async def _session(self, ws) -> None:
        rec = self.rec
        start = self._start_message()
        self._sent_at = self.now()
        await ws.send(json.dumps(start))
        stop_task = asyncio.create_task(self._stop_at_end(ws))
        try:
            async for message in ws:
                if isinstance(message, bytes):
                    if await self._on_binary(ws, message):
                        return
                else:
                    self._on_control(ws, json.loads(message))
        finally:
            stop_task.cancel()
            if self._action_task is not None:
                self._action_task.cancel()
        if rec.end == "unfinished":
            rec.end = "error" if rec.error_code else "closed"

    async def _on_binary(self, ws, message: bytes) -> bool:
        """Takes one binary message; True when the session has dropped its connection."""
        rec, plan, cfg = self.rec, self.plan, self.cfg
        meta = self._pending_meta
        if meta is None:
            rec.protocol_errors.append("binary message without a chunk header")
            return False
        self._pending_meta = None
        if meta.get("_init"):
            return False
        await self._on_payload(meta, message)
        index = meta.get("index")
        if plan.cancel_after is not None and len(rec.chunk_times) >= plan.cancel_after:
            rec.end = "cancelled"
            ws.transport.abort()  # a dropped connection, not a polite close
            return True
        if plan.slow and rec.fps:
            # Read the next message only after this chunk would have played
            # `slow_factor` times over.
            await asyncio.sleep(cfg.slow_factor * rec.chunk_frames[-1] / rec.fps)
        if cfg.ack and isinstance(index, int):
            # The session may have ended meanwhile; its last messages are still read.
            with contextlib.suppress(ConnectionClosed):
                await ws.send(json.dumps({"type": "ack", "chunk": index}))
        return False

    def _on_control(self, ws, msg: dict[str, Any]) -> None:
        rec = self.rec
        kind = msg.get("type")
        if kind == "session.queued":
            rec.queued = True
        elif kind == "session.started":
            rec.admitted_s = self.now() - self._sent_at
            rec.instance, rec.replica = msg.get("instance"), msg.get("replica")
            rec.fps = float(msg.get("fps") or 0) or None
            if self.plan.format == "fmp4":
                self._pending_meta = {"_init": True}
            if self.cfg.send_actions and msg.get("action_dim"):
                self._action_task = asyncio.create_task(self._send_actions(ws, int(msg["action_dim"])))
        elif kind == "chunk":
            self._pending_meta = msg
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

    async def _stop_at_end(self, ws) -> None:
        """At the end of the run, politely stop the sessions that have no length of their own
        (sessions with one run to completion: every arrival is measured whole)."""
        if self.plan.num_chunks is not None:
            return
        await self.stop_event.wait()
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps({"type": "session.stop"}))

    async def _on_payload(self, meta: dict[str, Any], payload: bytes) -> None:
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
            rec.ttff_s = now - self._sent_at
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
