"""One WebSocket = one stream: the session state machine.

    connect -> session.start -> (session.queued)* -> session.started [+ fmp4 init] ->
        chunk + payload ... -> session.done -> close 1000

Three tasks per session: the reader (client messages), the pump (engine chunks into the
bounded outgoing queue) and the writer (encode in the CPU pool, send). Backpressure: when
`pause_chunks` chunks wait to be sent, the stream's playback clock pauses (no new chunk
starts); a client that does not take a chunk for `slow_client_timeout_s` is ended with an
error. A slow client therefore never grows server memory without bound nor slows others.

Socket buffers hide a slow reader that still reads: sent chunks pile up in the kernel's
buffers, on both ends, long before a send blocks. A client that acknowledges chunks
(`{"type": "ack", "chunk": n}`, an extension of the protocol) is also held to
`ack_window`: with that many chunks sent and not acknowledged, its clock pauses too, and
if, once that far behind, no ack advances for `slow_client_timeout_s`, the session ends
with a `too_slow` error. Such a client gets the stream at its own pace, with
bounded lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import WSCloseCode, WSMsgType, web

from ..engine import ChunkOutput, Overloaded, StreamError, StreamRequest, Unsupported
from .media import make_encoder
from .protocol import (
    ProtocolError,
    SessionStart,
    parse_ack,
    parse_action,
    parse_json,
    parse_prompt,
    parse_session_start,
)

if TYPE_CHECKING:
    from .app import ServedModel, StreamWorldServer

log = logging.getLogger("streamworld.server")

CLOSE_POLICY = 1008
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_TOO_BIG = 1009
CLOSE_TRY_AGAIN = 1013
CLOSE_INTERNAL = 1011


@dataclass(frozen=True)
class SessionLimits:
    start_timeout_s: float = 30.0
    pause_chunks: int = 2
    slow_client_timeout_s: float = 10.0
    # Chunks a client that sends acks may hold unacknowledged before its clock pauses.
    ack_window: int = 3


class ClientTooSlow(Exception):
    """The client did not take a message within `slow_client_timeout_s`; it was cut off."""


CLIENT_GONE = (ConnectionError, RuntimeError, ClientTooSlow)


class Session:
    def __init__(
        self, server: StreamWorldServer, ws: web.WebSocketResponse, session_id: str, transport=None
    ) -> None:
        self.server = server
        self.ws = ws
        self.id = session_id
        self.transport = transport
        self._send_lock = asyncio.Lock()
        self.served: ServedModel | None = None
        self.handle = None
        self.start: SessionStart | None = None
        # What the server's own first frame shows (models with an environment), for session.started.
        self.scene: dict | None = None
        self.outgoing: deque[ChunkOutput] = deque()
        self.outgoing_ready = asyncio.Event()
        self.started_at = time.monotonic()
        self.last_sent: float | None = None
        self.chunks_sent = 0
        # Chunks handed to the socket (counted before the send completes, so that a fast
        # client's ack of a chunk it already has is never refused).
        self.chunks_handed = 0
        # (first frame an action conditions, its arrival), for action_to_frame_seconds.
        self.pending_actions: deque[tuple[int, float]] = deque(maxlen=1024)
        self.done = asyncio.Event()
        # None while running; then "stopped", "error" or "cancelled" (client gone).
        self.end_reason: str | None = None
        self._counted = False
        self._paused = False  # what this session last told the engine
        # Acknowledgements (optional): chunks consumed by the client, and when that last grew.
        self.acked = 0
        self.last_ack_progress = 0.0
        self.behind_since: float | None = None  # when the lag last reached ack_window
        self.too_slow = False
        self._watchdog: asyncio.Task | None = None

    # --- helpers ---------------------------------------------------------------------------
    async def send(self, *messages: dict | bytes) -> None:
        """Sends messages back to back (never interleaved with other sends).

        A client that does not take them within `slow_client_timeout_s` is cut off: its
        connection is aborted (nothing more can reach a client that does not read) and
        `ClientTooSlow` is raised. The send itself is never cancelled, since cancelling
        aiohttp's drain would break the connection's later writes and close.
        """
        async with self._send_lock:
            task = asyncio.ensure_future(self._write(messages))
            done, _ = await asyncio.wait({task}, timeout=self.server.limits.slow_client_timeout_s)
            if not done:
                log.warning(
                    "session %s: client did not read for %.0f s; dropping it",
                    self.id,
                    self.server.limits.slow_client_timeout_s,
                )
                self.abort()
                with contextlib.suppress(BaseException):
                    await task
                raise ClientTooSlow
            task.result()

    async def _write(self, messages: tuple[dict | bytes, ...]) -> None:
        for m in messages:
            if isinstance(m, bytes):
                await self.ws.send_bytes(m)
            else:
                await self.ws.send_json(m)

    async def send_json(self, msg: dict) -> None:
        await self.send(msg)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def fail_and_close(self, err: ProtocolError, code: int) -> None:
        with contextlib.suppress(*CLIENT_GONE):
            await self.send(err.to_message())
            await self.ws.close(code=code, message=err.message[:120].encode())

    # --- the session -----------------------------------------------------------------------
    async def run(self) -> None:
        start = await self._read_start()
        if start is None:
            return
        self.start = start
        self.started_at = time.monotonic()  # time to first frame counts from session.start
        served = self.server.models[start.model]
        self.served = served
        cfg = served.model.config
        image = start.image
        if cfg.needs_image and image is None:
            try:
                default = await asyncio.to_thread(served.default_image, start.seed)
            except Exception as e:
                log.exception("first frame for model %s, seed %s failed", cfg.id, start.seed)
                await self.fail_and_close(
                    ProtocolError("internal", f"the first frame for seed {start.seed} failed: {e}"),
                    CLOSE_INTERNAL,
                )
                return
            if default is None:
                await self.fail_and_close(
                    ProtocolError("bad_request", f"model {cfg.id} needs an 'image'"), CLOSE_POLICY
                )
                return
            image, self.scene = default
        request = StreamRequest(
            seed=start.seed,
            num_chunks=start.num_chunks,
            prompt=start.prompt,
            image=image,
            kv_mode=start.kv_mode,
            priority=start.priority,
            action_policy=start.action_policy,
        )
        if self.server.shutting_down:
            await self.fail_and_close(
                ProtocolError("overloaded", "the server is shutting down"), CLOSE_TRY_AGAIN
            )
            return
        try:
            encoder = make_encoder(start.format, cfg.width, cfg.height, cfg.fps)
        except ValueError as e:
            await self.fail_and_close(ProtocolError("unsupported", str(e)), CLOSE_POLICY)
            return
        try:
            self.handle = served.engine.open_stream(request)
        except Unsupported as e:
            await self.fail_and_close(ProtocolError("unsupported", str(e)), CLOSE_POLICY)
            encoder.close()
            return
        except Overloaded as e:
            self.server.metrics.finished.labels(cfg.id, "overloaded").inc()
            await self.fail_and_close(ProtocolError("overloaded", str(e)), CLOSE_TRY_AGAIN)
            encoder.close()
            return
        except ValueError as e:
            await self.fail_and_close(ProtocolError("bad_request", str(e)), CLOSE_POLICY)
            encoder.close()
            return
        reader = asyncio.create_task(self._reader(), name=f"session-{self.id}-reader")
        try:
            if not await self._wait_admitted():
                await self._end_unadmitted()
                return
            init = encoder.init_segment()
            started = (self._started_message(encoder), init) if init else (self._started_message(encoder),)
            await self.send(*started)
            pump = asyncio.create_task(self._pump(), name=f"session-{self.id}-pump")
            try:
                await self._writer(encoder)
            except CLIENT_GONE:
                self._finish("error" if self.end_reason == "error" else "cancelled")
            except Exception:
                log.exception("session %s: sending failed", self.id)
                self._finish("error")
                await self.fail_and_close(ProtocolError("internal", "internal server error"), CLOSE_INTERNAL)
            finally:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            if self._watchdog is not None:
                self._watchdog.cancel()
                with contextlib.suppress(BaseException):
                    await self._watchdog
            self._cancel_stream()
            encoder.close()
            self.done.set()

    async def _end_unadmitted(self) -> None:
        """The stream ended while queued: stopped, failed, or the client left."""
        if self.ws.closed:
            return
        status = self.handle.status
        if self.end_reason == "stopped":
            self._finish("stopped")
            with contextlib.suppress(*CLIENT_GONE):
                await self.send({"type": "session.done", "reason": "stopped", "chunks": 0})
                await self.ws.close(code=WSCloseCode.OK)
        elif status == "error":
            self._finish("error")
            err = (self.handle.error or "internal error").splitlines()[0]
            await self.fail_and_close(ProtocolError("internal", err), CLOSE_INTERNAL)

    async def _read_start(self) -> SessionStart | None:
        try:
            msg = await self.ws.receive(timeout=self.server.limits.start_timeout_s)
        except TimeoutError:
            await self.fail_and_close(
                ProtocolError("bad_request", "no session.start received in time"), CLOSE_POLICY
            )
            return None
        if msg.type == WSMsgType.BINARY:
            await self.fail_and_close(
                ProtocolError("bad_request", "binary messages are not accepted"), CLOSE_UNSUPPORTED_DATA
            )
            return None
        if msg.type != WSMsgType.TEXT:
            return None  # closed, or an oversize frame (aiohttp closes with 1009)
        try:
            parsed = parse_json(msg.data)
            # Off the event loop: a first image is decoded here.
            return await asyncio.to_thread(
                parse_session_start, parsed, self.server.model_configs, self.server.default_model
            )
        except ProtocolError as e:
            await self.fail_and_close(e, CLOSE_POLICY)
            return None

    async def _wait_admitted(self) -> bool:
        handle = self.handle
        last_position = None
        while handle.queue_position:
            if handle.queue_position != last_position:
                last_position = handle.queue_position
                await self.send_json({"type": "session.queued", "position": last_position})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.admitted(), timeout=0.5)
            if self.ws.closed:
                return False
        return handle.status == "running"

    def _started_message(self, encoder) -> dict:
        cfg = self.served.model.config
        return {
            "type": "session.started",
            "session_id": self.id,
            "model": cfg.id,
            "width": cfg.width,
            "height": cfg.height,
            "fps": cfg.fps,
            "format": self.start.format,
            "codec": encoder.codec,
            "kv_mode": self.start.kv_mode,
            "frames_per_chunk": cfg.frames_per_chunk,
            "first_chunk_frames": cfg.first_chunk_frames,
            "seed": self.start.seed,
            "action_dim": cfg.action_dim,
            **({"scene": self.scene} if self.scene is not None else {}),
        }

    async def _reader(self) -> None:
        """Client messages during the session; a disconnect cancels the stream at once."""
        cfg = self.served.model.config
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.BINARY:
                    await self.fail_and_close(
                        ProtocolError("bad_request", "binary messages are not accepted"),
                        CLOSE_UNSUPPORTED_DATA,
                    )
                    break
                if msg.type != WSMsgType.TEXT:
                    break
                try:
                    reply = self._handle_message(parse_json(msg.data), cfg)
                except ProtocolError as e:
                    reply = e.to_message()
                if reply is not None:
                    await self.send(reply)
        except CLIENT_GONE:
            pass
        finally:
            # The client went away (or broke the protocol): cancel everything now.
            if not self._counted and self.end_reason is None:
                self.end_reason = "cancelled"
                self._finish("cancelled")
            if self.end_reason == "cancelled":
                self._cancel_stream()
            self.outgoing_ready.set()

    def _handle_message(self, parsed: dict, cfg) -> dict | None:
        """Applies one client message; returns the reply to send, if any."""
        kind = parsed["type"]
        try:
            if kind == "action":
                action = parse_action(parsed, cfg.action_dim)
                first = self.handle.actions_known if action.frame is None else action.frame
                try:
                    self.handle.push_actions(action.actions, action.frame)
                except ValueError as e:
                    raise ProtocolError("bad_request", str(e)) from None
                self.pending_actions.append((first + 1, time.monotonic()))
            elif kind == "prompt":
                self.handle.set_prompt(parse_prompt(parsed, cfg.takes_prompt))
            elif kind == "ping":
                return {"type": "pong", "id": parsed.get("id")}
            elif kind == "ack":
                chunk = parse_ack(parsed, self.chunks_handed)
                now = time.monotonic()
                if not self.acks_on:
                    self.last_ack_progress = now
                    self._watchdog = asyncio.create_task(self._ack_watchdog(), name=f"session-{self.id}-acks")
                if chunk + 1 > self.acked:
                    self.acked = chunk + 1
                    self.last_ack_progress = now
                self._update_pause()
            elif kind == "session.stop":
                if self.end_reason is None:
                    self.end_reason = "stopped"
                self.handle.stop()
            elif kind == "session.start":
                raise ProtocolError("bad_request", "session.start may be sent only once")
            else:
                raise ProtocolError("bad_request", f"unknown message type {kind!r}")
        except KeyError:
            pass  # the stream has already ended; late messages are ignored
        return None

    async def _pump(self) -> None:
        """Engine chunks into the outgoing queue; pauses the stream's clock when it backs up."""
        handle = self.handle
        try:
            async for chunk in handle:
                self.outgoing.append(chunk)
                self._update_pause()
                self.outgoing_ready.set()
        except StreamError as e:
            self.end_reason = "error"
            log.warning("session %s: %s", self.id, e)
        finally:
            self.outgoing.append(None)  # end marker
            self.outgoing_ready.set()

    async def _writer(self, encoder) -> None:
        served = self.served
        model = served.model.config.id
        metrics = self.server.metrics
        limits = self.server.limits
        loop = asyncio.get_running_loop()
        while True:
            while not self.outgoing:
                if self.ws.closed:
                    self._finish(self.end_reason or "cancelled")
                    return
                self.outgoing_ready.clear()
                await self.outgoing_ready.wait()
            if self.end_reason == "cancelled":
                return
            if self.too_slow:
                break
            chunk = self.outgoing.popleft()
            if chunk is None:
                break
            self._update_pause()
            t0 = time.perf_counter()
            encoded = await loop.run_in_executor(self.server.encode_pool, encoder.encode, chunk.frames)
            encode_ms = (time.perf_counter() - t0) * 1000
            timings = dict(chunk.timings, encode=encode_ms, total=chunk.timings["total"] + encode_ms)
            meta = {
                "type": "chunk",
                "index": chunk.index,
                "first_frame": chunk.first_frame,
                "num_frames": int(chunk.frames.shape[0]),
                "bytes": len(encoded.payload),
                "timings": {k: round(v, 3) for k, v in timings.items()},
            }
            if encoded.sizes is not None:
                meta["sizes"] = encoded.sizes
            self.chunks_handed = self.chunks_sent + 1
            self._update_pause()
            try:
                await self.send(meta, encoded.payload)
            except ClientTooSlow:
                self.end_reason = "error"
                self._finish("error")
                self._cancel_stream()
                return
            now = time.monotonic()
            if self.chunks_sent == 0:
                metrics.ttff.labels(model).observe(now - self.started_at)
            else:
                metrics.inter_chunk.labels(model).observe(now - self.last_sent)
            self.last_sent = now
            self.chunks_sent += 1
            self._update_pause()
            metrics.frames.labels(model).inc(meta["num_frames"])
            if chunk.deadline_missed:
                metrics.deadline_miss.labels(model).inc()
            chunk_started = now - (chunk.timings["total"] + chunk.timings["queued"]) / 1000
            last_frame = chunk.first_frame + meta["num_frames"] - 1
            while self.pending_actions and self.pending_actions[0][0] <= last_frame:
                _, arrived = self.pending_actions[0]
                if arrived > chunk_started:
                    break  # arrived after this chunk started: a later chunk shows it
                self.pending_actions.popleft()
                metrics.action_to_frame.labels(model).observe(now - arrived)
        if self.end_reason == "cancelled":
            return
        reason = self.end_reason or "completed"
        self._finish(reason)
        if self.too_slow:
            behind = self.chunks_handed - self.acked
            err = ProtocolError(
                "too_slow",
                f"no chunk acknowledged for {limits.slow_client_timeout_s:.0f} s with {behind} chunks "
                "unacknowledged; read and acknowledge faster, or do not send acks",
            )
            with contextlib.suppress(*CLIENT_GONE):
                await self.send_json(err.to_message())
                await self.send_json({"type": "session.done", "reason": "error", "chunks": self.chunks_sent})
                await self.ws.close(code=CLOSE_POLICY, message=b"too slow")
            return
        if reason == "error":
            err = (self.handle.error or "internal error").splitlines()[0]
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.send_json(ProtocolError("internal", err).to_message())
                await self.send_json({"type": "session.done", "reason": "error", "chunks": self.chunks_sent})
                await self.ws.close(code=CLOSE_INTERNAL, message=b"internal error")
            return
        with contextlib.suppress(*CLIENT_GONE):
            await self.send_json({"type": "session.done", "reason": reason, "chunks": self.chunks_sent})
            await self.ws.close(code=WSCloseCode.OK)

    @property
    def acks_on(self) -> bool:
        """The client has sent an ack: its lag is bounded too (the watchdog runs from then)."""
        return self._watchdog is not None

    def _update_pause(self) -> None:
        """Pauses the stream's clock while the client is behind, resumes it when it is not."""
        handle = self.handle
        if handle is None or not handle.live:
            return
        limits = self.server.limits
        lagging = self.acks_on and self.chunks_handed - self.acked >= limits.ack_window
        if not lagging:
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = time.monotonic()
        behind = len(self.outgoing) >= limits.pause_chunks or lagging
        if behind != self._paused:
            self._paused = behind
            handle.set_paused(behind)

    async def _ack_watchdog(self) -> None:
        """Ends a session whose acks do not advance for `slow_client_timeout_s` while it is
        `ack_window` chunks behind (timed from the later of its last advancing ack and the
        moment it fell that far behind)."""
        limits = self.server.limits
        while self.end_reason is None and not self.too_slow and not self._counted:
            await asyncio.sleep(min(1.0, limits.slow_client_timeout_s / 4))
            if self.behind_since is None or self.end_reason is not None or self._counted:
                continue
            # Stalled: behind by the window, and no ack has advanced since it got there.
            since = max(self.last_ack_progress, self.behind_since)
            if time.monotonic() - since > limits.slow_client_timeout_s:
                log.warning("session %s: no ack for %.0f s; ending it", self.id, limits.slow_client_timeout_s)
                self.too_slow = True
                self.end_reason = "error"
                self._cancel_stream()  # frees its pages at once
                self.outgoing_ready.set()

    def _finish(self, reason: str) -> None:
        """Counts the session's end once, whatever path ends it."""
        if not self._counted:
            self._counted = True
            self.server.metrics.finished.labels(self.served.model.config.id, reason).inc()

    def _cancel_stream(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def shutdown(self) -> None:
        """Server shutdown: drop the work in flight, then session.done (stopped) and close."""
        if self.handle is not None and self.end_reason is None:
            self.end_reason = "stopped"
            self.handle.cancel()
