"""One WebSocket = one stream: the session state machine over a `StreamHandle`.

    connect -> session.start -> (session.queued)* -> session.started [+ fmp4 init] ->
        chunk + payload ... -> session.done -> close 1000

Three tasks per session: the reader (client messages), the pump (engine chunks into the
outgoing queue) and the writer (encode in the CPU pool, send); and one more per branch of a
fork (`session.fork`), which encodes and sends that branch's chunks, tagged with its number,
and pauses the branch while its chunks back up. `pacing.py` bounds how far a
slow client may fall behind; `protocol.py` shapes every message and close code. A session
knows the server only through its `SessionContext`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine import ChunkOutput, Overloaded, StreamError, StreamHandle, StreamRequest, Unsupported
from ..media import make_encoder
from ..models.config import ModelConfig
from . import protocol
from .config import ServedModel, SessionLimits
from .metrics import Metrics, SessionMetrics
from .pacing import CLIENT_GONE, ClientTooSlow, Pacing, Sender
from .protocol import (
    CLOSE_INTERNAL,
    CLOSE_OK,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN,
    CLOSE_UNSUPPORTED_DATA,
    ProtocolError,
    SessionStart,
)
from .sockets import SessionSocket, messages

if TYPE_CHECKING:
    from ..media import ChunkEncoder

log = logging.getLogger("streamworld.server")

__all__ = ["Session", "SessionContext", "SessionLimits"]


@dataclass
class _Branch:
    number: int  # the session's own numbering, from 1
    handle: StreamHandle
    task: asyncio.Task | None = None


@dataclass
class SessionContext:
    """What sessions need from the server, and all they see of it."""

    models: dict[str, ServedModel]
    default_model: str
    limits: SessionLimits
    metrics: Metrics
    encode_pool: Executor
    instance: str | None = None  # ServerConfig.instance
    shutting_down: bool = False

    def __post_init__(self) -> None:
        self.model_configs: dict[str, ModelConfig] = {m: s.model.config for m, s in self.models.items()}
        # First frames decoded at once, per server: a burst of starts holds a bounded number
        # of decoded images in memory and threads of the default pool.
        self.image_decodes = asyncio.Semaphore(protocol.MAX_CONCURRENT_IMAGE_DECODES)
        # Large client messages parsed at once, per server, in threads (`parse_message`).
        self.large_parses = asyncio.Semaphore(protocol.MAX_CONCURRENT_LARGE_PARSES)

    async def parse_message(self, text: str) -> dict:
        """`protocol.parse_json`, off the event loop and a bounded number at once for a
        message longer than `protocol.LARGE_MESSAGE_CHARS`."""
        if len(text) <= protocol.LARGE_MESSAGE_CHARS:
            return protocol.parse_json(text)
        async with self.large_parses:
            parse = asyncio.ensure_future(asyncio.to_thread(protocol.parse_json, text))
            try:
                return await asyncio.shield(parse)
            except asyncio.CancelledError:
                # The thread parses on regardless: hold the slot until it has finished.
                with contextlib.suppress(BaseException):
                    await parse
                raise


def refusal(e: Exception) -> tuple[ProtocolError, int]:
    """The error and close code for an engine's refusal to open a stream."""
    if isinstance(e, Unsupported):
        return ProtocolError("unsupported", str(e)), protocol.CLOSE_POLICY
    if isinstance(e, Overloaded):
        return ProtocolError("overloaded", str(e)), protocol.CLOSE_TRY_AGAIN
    return ProtocolError("bad_request", str(e)), protocol.CLOSE_POLICY


class Session:
    def __init__(self, ctx: SessionContext, socket: SessionSocket, session_id: str) -> None:
        self.ctx = ctx
        self.ws = socket  # any transport (sockets.py)
        self.id = session_id
        self.sender = Sender(
            socket, ctx.limits.slow_client_timeout_s, self._drop_slow_client, f"session {session_id}"
        )
        self.start: SessionStart | None = None
        self.cfg: ModelConfig | None = None
        # What the server's own first frame shows (models with an environment), for session.started.
        self.scene: dict | None = None
        self.handle: StreamHandle | None = None
        self.pacing: Pacing | None = None
        self.observed: SessionMetrics | None = None
        self.done = asyncio.Event()
        # None while running; then "stopped", "error", "overloaded" (queued too long) or
        # "cancelled" (client gone).
        self.end_reason: str | None = None
        self.branches: dict[int, _Branch] = {}  # running branches of forks, by number
        self._branch_numbers = itertools.count(1)

    # --- what the server sees ----------------------------------------------------------------
    @property
    def has_stream(self) -> bool:
        return self.handle is not None

    @property
    def ended(self) -> bool:
        return self.ws.closed and self.done.is_set()

    @property
    def outgoing(self) -> Sequence[ChunkOutput | None]:
        return () if self.pacing is None else self.pacing.outgoing

    @property
    def chunks_sent(self) -> int:
        return 0 if self.pacing is None else self.pacing.chunks_sent

    @property
    def acked(self) -> int:
        return 0 if self.pacing is None else self.pacing.acked

    def abort(self) -> None:
        self.ws.abort()

    def _drop_slow_client(self) -> None:
        """A send timed out: counted as an error (docs/protocol.md) before the reader can see the
        connection drop and count the client as gone."""
        if self.observed is not None and self.end_reason != "cancelled":
            self.end_reason = "error"
            self._finish("error")
        self.abort()

    def shutdown(self) -> None:
        """Server shutdown: drop the work in flight, then session.done (stopped) and close."""
        if self.handle is not None and self.end_reason is None:
            self.end_reason = "stopped"
            self.handle.cancel()

    async def close_going_away(self) -> None:
        """Server shutdown, for a connection that has not started a session."""
        await self.ws.close(protocol.CLOSE_GOING_AWAY, b"server shutting down")

    async def serve(self) -> None:
        """The whole session; whatever happens, its stream is cancelled when this returns."""
        try:
            await self._run()
        except CLIENT_GONE as e:
            # A client leaving (or cut off) is no server error: nothing more can reach it.
            log.info("session %s: the client went away (%s)", self.id, e)
            if self.observed is not None and self.end_reason is None:
                self.end_reason = "cancelled"
                self._finish("cancelled")
        except Exception:
            log.exception("session %s failed", self.id)
            with contextlib.suppress(Exception):
                await self.sender.send(protocol.error("internal", "internal server error"))
                await self.ws.close(CLOSE_INTERNAL, b"internal error")
        finally:
            if self.handle is not None:
                self.handle.cancel()
            for branch in list(self.branches.values()):
                branch.handle.cancel()
                if branch.task is not None:
                    branch.task.cancel()
            self.done.set()

    # --- ending --------------------------------------------------------------------------------
    async def _end(self, code: int, reason: str, *messages: dict) -> None:
        """The last messages, then the close; a client already gone gets nothing."""
        with contextlib.suppress(*CLIENT_GONE):
            for message in messages:
                await self.sender.send(message)
            await self.ws.close(code, protocol.close_reason(reason))

    async def _fail(self, err: ProtocolError, code: int) -> None:
        await self._end(code, err.message, err.to_message())

    def _finish(self, reason: str) -> None:
        """Counts the session's end once, whatever path ends it."""
        self.observed.finish(reason)

    def _running(self) -> bool:
        return self.end_reason is None and not self.observed.counted

    def _stream_error(self) -> str:
        return (self.handle.error or "internal error").splitlines()[0]

    # --- opening ---------------------------------------------------------------------------------
    async def _run(self) -> None:
        start = await self._read_start()
        if start is None:
            return
        self.start = start
        self.cfg = self.ctx.models[start.model].model.config
        self.observed = SessionMetrics(self.ctx.metrics, self.cfg.id)
        encoder = await self._open(start)
        if encoder is None:
            return
        self.pacing = Pacing(self.handle, self.ctx.limits, f"session {self.id}")
        reader = asyncio.create_task(self._reader(), name=f"session-{self.id}-reader")
        try:
            await self._stream(encoder)
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            await self.pacing.close()
            self.handle.cancel()
            encoder.close()
            self.done.set()

    async def _read_start(self) -> SessionStart | None:
        try:
            msg = await self.ws.receive(timeout=self.ctx.limits.start_timeout_s)
        except TimeoutError:
            await self._fail(ProtocolError("bad_request", "no session.start received in time"), CLOSE_POLICY)
            return None
        if msg.kind == "binary":
            await self._fail(
                ProtocolError("bad_request", "binary messages are not accepted"), CLOSE_UNSUPPORTED_DATA
            )
            return None
        if msg.kind != "text":
            return None  # closed, or an oversize frame (the framework closes with 1009)
        try:
            parsed = await self.ctx.parse_message(msg.data)
            # Off the event loop, and a bounded number at once: a first image is decoded here.
            async with self.ctx.image_decodes:
                return await asyncio.to_thread(
                    protocol.parse_session_start, parsed, self.ctx.model_configs, self.ctx.default_model
                )
        except ProtocolError as e:
            await self._fail(e, CLOSE_POLICY)
            return None

    async def _open(self, start: SessionStart) -> ChunkEncoder | None:
        """Opens the stream; None when it cannot be opened (the client has been told why)."""
        served, cfg = self.ctx.models[start.model], self.cfg
        image = start.image
        if cfg.needs_image and image is None:
            image = await self._default_image(served, start.seed)
            if image is None:
                return None
        request = StreamRequest(
            seed=start.seed,
            num_chunks=start.num_chunks,
            prompt=start.prompt,
            image=image,
            kv_mode=start.kv_mode,
            priority=start.priority,
            action_policy=start.action_policy,
        )
        if self.ctx.shutting_down:
            await self._fail(ProtocolError("overloaded", "the server is shutting down"), CLOSE_TRY_AGAIN)
            return None
        try:
            encoder = make_encoder(start.format, cfg.width, cfg.height, cfg.fps)
        except ValueError as e:
            await self._fail(ProtocolError("unsupported", str(e)), CLOSE_POLICY)
            return None
        try:
            self.handle = served.engine.open_stream(request)
        except (Unsupported, Overloaded, ValueError) as e:
            if isinstance(e, Overloaded):
                self._finish("overloaded")
            await self._fail(*refusal(e))
            encoder.close()
            return None
        return encoder

    async def _default_image(self, served: ServedModel, seed: int) -> Any:
        """The served model's own first frame for `seed`; None when there is none (told)."""
        try:
            default = await asyncio.to_thread(served.default_image, seed)
        except Exception as e:
            log.exception("first frame for model %s, seed %s failed", self.cfg.id, seed)
            await self._fail(
                ProtocolError("internal", f"the first frame for seed {seed} failed: {e}"), CLOSE_INTERNAL
            )
            return None
        if default is None:
            await self._fail(
                ProtocolError("bad_request", f"model {self.cfg.id} needs an 'image'"), CLOSE_POLICY
            )
            return None
        image, self.scene = default
        return image

    # --- streaming -------------------------------------------------------------------------------
    async def _stream(self, encoder: ChunkEncoder) -> None:
        if not await self._wait_admitted():
            await self._end_unadmitted()
            return
        replicas = len(self.ctx.models[self.cfg.id].engine.engines)
        replica = self.handle.replica if replicas > 1 else None
        started = protocol.session_started(
            self.id, self.cfg, self.start, encoder.codec, self.scene, replica, self.ctx.instance
        )
        init = encoder.init_segment()
        await self.sender.send(*((started, init) if init else (started,)))
        pump = asyncio.create_task(self._pump(), name=f"session-{self.id}-pump")
        try:
            await self._writer(encoder)
        except CLIENT_GONE:
            self._finish("error" if self.end_reason == "error" else "cancelled")
        except Exception:
            log.exception("session %s: sending failed", self.id)
            self._finish("error")
            await self._fail(ProtocolError("internal", "internal server error"), CLOSE_INTERNAL)
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def _wait_admitted(self) -> bool:
        handle = self.handle
        last_position = None
        deadline = time.monotonic() + self.ctx.limits.queue_timeout_s
        while handle.queue_position:
            if handle.queue_position != last_position:
                last_position = handle.queue_position
                await self.sender.send(protocol.session_queued(last_position))
            left = deadline - time.monotonic()
            if left <= 0:
                await self._refuse_queued_too_long()
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.admitted(), timeout=min(0.5, left))
            if self.ws.closed:
                return False
        return handle.status == "running"

    async def _refuse_queued_too_long(self) -> None:
        """Queued past `queue_timeout_s`: leaves the queue and gets the overload reply."""
        if self.end_reason is not None:
            return  # stopped or gone meanwhile: that ending stands
        self.end_reason = "overloaded"
        self.handle.cancel()
        self._finish("overloaded")
        timeout = self.ctx.limits.queue_timeout_s
        err = ProtocolError("overloaded", f"no capacity became free within {timeout:g} s; try again later")
        await self._fail(err, CLOSE_TRY_AGAIN)

    async def _end_unadmitted(self) -> None:
        """The stream ended while queued: stopped, failed, or the client left."""
        if self.ws.closed:
            return
        if self.end_reason == "stopped":
            self._finish("stopped")
            await self._end(CLOSE_OK, "", protocol.session_done("stopped", 0))
        elif self.handle.status == "error":
            self._finish("error")
            err = self._stream_error()
            await self._end(CLOSE_INTERNAL, err, protocol.error("internal", err))

    async def _reader(self) -> None:
        """Client messages during the session; a disconnect cancels the stream at once."""
        try:
            async for msg in messages(self.ws):
                if msg.kind == "binary":
                    err = ProtocolError("bad_request", "binary messages are not accepted")
                    await self._fail(err, CLOSE_UNSUPPORTED_DATA)
                    break
                try:
                    parsed = await self.ctx.parse_message(msg.data)
                    if parsed["type"] == "session.fork":
                        await self._fork(parsed)
                        continue
                    reply = self._handle_message(parsed)
                except ProtocolError as e:
                    reply = e.to_message()
                if reply is not None:
                    await self.sender.send(reply)
        except CLIENT_GONE:
            pass
        finally:
            # The client went away (or broke the protocol): cancel everything now.
            if self._running():
                self.end_reason = "cancelled"
                self._finish("cancelled")
            if self.end_reason == "cancelled":
                self.handle.cancel()
            self.pacing.ready.set()

    def _handle_message(self, parsed: dict) -> dict | None:
        """Applies one client message; returns the reply to send, if any."""
        kind, handle, cfg = parsed["type"], self.handle, self.cfg
        try:
            if kind == "action":
                action = protocol.parse_action(parsed, cfg.action_dim)
                first = handle.actions_known if action.frame is None else action.frame
                try:
                    handle.push_actions(action.actions, action.frame)
                except ValueError as e:
                    raise ProtocolError("bad_request", str(e)) from None
                self.observed.action_arrived(first + 1)
            elif kind == "prompt":
                handle.set_prompt(protocol.parse_prompt(parsed, cfg.takes_prompt))
            elif kind == "ping":
                return protocol.pong(parsed)
            elif kind == "ack":
                chunk = protocol.parse_ack(parsed, self.pacing.chunks_handed)
                self.pacing.ack(chunk, self._running, self._stalled)
            elif kind == "session.stop":
                if self.end_reason is None:
                    self.end_reason = "stopped"
                handle.stop()
                for branch in list(self.branches.values()):
                    branch.handle.stop()
            elif kind == "branch.cancel":
                number = protocol.parse_branch_cancel(parsed)
                if number not in self.branches:
                    raise ProtocolError("bad_request", f"no running branch {protocol.excerpt_number(number)}")
                self.branches[number].handle.cancel()
            elif kind == "session.start":
                raise ProtocolError("bad_request", "session.start may be sent only once")
            else:
                raise ProtocolError("bad_request", f"unknown message type {kind!r}")
        except KeyError:
            pass  # the stream has already ended; late messages are ignored
        return None

    # --- forks ---------------------------------------------------------------------------------
    async def _fork(self, parsed: dict) -> None:
        """`session.fork`: the branches start; `session.forked` goes out before any of their
        chunks. A refusal is an `error` carrying the fork's `id`; the session goes on."""
        fork_id = protocol.echo_id(parsed)
        try:
            await self._start_branches(fork_id, protocol.parse_fork(parsed, self.cfg, self.start.format))
        except ProtocolError as e:
            raise ProtocolError(e.code, e.message, fork_id) from None

    async def _start_branches(self, fork_id: Any, fork: protocol.ForkMessage) -> None:
        if self.end_reason is not None:
            raise ProtocolError("bad_request", "the session is ending and cannot fork")
        if len(self.branches) + len(fork.branches) > protocol.MAX_SESSION_BRANCHES:
            raise ProtocolError(
                "bad_request",
                f"a session may have {protocol.MAX_SESSION_BRANCHES} branches running; "
                f"{len(self.branches)} are, and this fork asks for {len(fork.branches)} more",
            )
        try:
            handles = self.handle.fork(fork.branches)
        except Overloaded as e:
            raise ProtocolError("overloaded", str(e)) from None
        except (KeyError, ValueError) as e:
            raise ProtocolError("bad_request", str(e).strip("'\"")) from None
        branches = [_Branch(next(self._branch_numbers), h) for h in handles]
        for b in branches:
            self.branches[b.number] = b
        await self.sender.send(protocol.session_forked(fork_id, [b.number for b in branches]))
        for b in branches:
            name = f"session-{self.id}-branch-{b.number}"
            b.task = asyncio.create_task(self._branch_pump(b, fork.format), name=name)

    async def _branch_pump(self, branch: _Branch, fmt: str) -> None:
        """One branch's chunks, encoded and sent as `chunk` messages with its number, then
        `branch.done`. The branch pauses while `pause_chunks` of its chunks wait."""
        cfg, handle = self.cfg, branch.handle
        encoder = make_encoder(fmt, cfg.width, cfg.height, cfg.fps)
        sent, reason, message = 0, "completed", None

        def pace() -> None:
            with contextlib.suppress(KeyError):  # ended meanwhile
                handle.set_paused(handle.backlog >= self.ctx.limits.pause_chunks)

        try:
            async for chunk in handle:
                pace()
                header, payload = await self._encoded(encoder, chunk)
                try:
                    await self.sender.send({**header, "branch": branch.number}, payload)
                except CLIENT_GONE as e:
                    # No server error, and nothing more to send: the branch's pages go back
                    # now (left running, it would pause on its unsent chunks and keep them).
                    log.info("session %s: the client went away in branch %d (%s)", self.id, branch.number, e)
                    handle.cancel()
                    return
                sent += 1
                pace()
            if handle.status == "cancelled":
                reason = "cancelled"
        except StreamError as e:
            reason, message = "error", str(e).splitlines()[0]
        except Exception:  # e.g. the encoder failed: the branch ends in error, the session goes on
            log.exception("session %s: branch %d failed", self.id, branch.number)
            handle.cancel()
            reason, message = "error", "internal server error"
        finally:
            encoder.close()
            self.branches.pop(branch.number, None)
        with contextlib.suppress(*CLIENT_GONE):
            await self.sender.send(protocol.branch_done(branch.number, reason, sent, message))

    async def _finish_branches(self, reason: str) -> None:
        """Before `session.done`: branches run to their end (completed, stopped), or are cancelled."""
        for branch in list(self.branches.values()):
            if reason not in ("completed", "stopped"):
                branch.handle.cancel()
        tasks = [b.task for b in self.branches.values() if b.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    def _stalled(self) -> None:
        """The client stopped acknowledging: end the session, freeing its pages at once."""
        self.end_reason = "error"
        self.handle.cancel()

    async def _pump(self) -> None:
        """Engine chunks into the outgoing queue, then the end marker."""
        try:
            async for chunk in self.handle:
                self.pacing.push(chunk)
        except StreamError as e:
            self.end_reason = "error"
            log.warning("session %s: %s", self.id, e)
        finally:
            self.pacing.outgoing.append(None)
            self.pacing.ready.set()

    async def _writer(self, encoder: ChunkEncoder) -> None:
        pacing = self.pacing
        while True:
            while not pacing.outgoing:
                if self.ws.closed:
                    self._finish(self.end_reason or "cancelled")
                    return
                pacing.ready.clear()
                await pacing.ready.wait()
            if self.end_reason == "cancelled":
                return  # the reader has counted the client leaving
            if pacing.stalled:
                break
            chunk = pacing.outgoing.popleft()
            if chunk is None:
                break
            if not await self._send_chunk(encoder, chunk):
                return
        await self._end_stream()

    async def _send_chunk(self, encoder: ChunkEncoder, chunk: ChunkOutput) -> bool:
        """Encodes and sends one chunk; False when the client was too slow to take it."""
        pacing = self.pacing
        pacing.update()
        header, payload = await self._encoded(encoder, chunk)
        pacing.chunks_handed = pacing.chunks_sent + 1
        pacing.update()
        try:
            await self.sender.send(header, payload)
        except ClientTooSlow:
            self.end_reason = "error"
            self._finish("error")
            self.handle.cancel()
            return False
        self.observed.chunk_sent(chunk, first=pacing.chunks_sent == 0)
        pacing.chunks_sent += 1
        pacing.update()
        return True

    async def _encoded(self, encoder: ChunkEncoder, chunk: ChunkOutput) -> tuple[dict, bytes]:
        """The chunk's `chunk` message and payload, encoded in the CPU pool."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        encoded = await loop.run_in_executor(self.ctx.encode_pool, encoder.encode, chunk.frames)
        encode_ms = (time.perf_counter() - t0) * 1000
        return protocol.chunk_header(chunk, encoded.payload, encoded.sizes, encode_ms), encoded.payload

    async def _end_stream(self) -> None:
        """Every chunk is sent, or the stream stopped or failed: session.done and the close."""
        if self.end_reason == "cancelled":
            return
        reason = self.end_reason or "completed"
        await self._finish_branches(reason)
        self._finish(reason)
        chunks = self.pacing.chunks_sent
        if self.pacing.stalled:
            timeout = self.ctx.limits.slow_client_timeout_s
            err = protocol.error(
                "too_slow",
                f"no chunk acknowledged for {timeout:.0f} s with {self.pacing.behind} chunks "
                "unacknowledged; read and acknowledge faster, or do not send acks",
            )
            await self._end(CLOSE_POLICY, "too slow", err, protocol.session_done("error", chunks))
        elif reason == "error":
            err = protocol.error("internal", self._stream_error())
            await self._end(CLOSE_INTERNAL, "internal error", err, protocol.session_done("error", chunks))
        else:
            await self._end(CLOSE_OK, "", protocol.session_done(reason, chunks))
