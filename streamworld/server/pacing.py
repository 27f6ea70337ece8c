"""Backpressure: a slow client never grows server memory without bound nor slows others.

Three bounds, all from `SessionLimits`:

- The outgoing queue. When `pause_chunks` chunks wait to be sent, the stream's playback clock
  pauses (no new chunk starts) until the queue drains.
- Sends. A client that does not take a message within `slow_client_timeout_s` is cut off.
- Acknowledgements (an extension of the protocol). Socket buffers hide a slow reader that
  still reads: sent chunks pile up in the kernel's buffers, on both ends, long before a send
  blocks. A client that acknowledges chunks (`{"type": "ack", "chunk": n}`) is also held to
  `ack_window`: with that many chunks sent and not acknowledged its clock pauses too, and if,
  once that far behind, no ack advances for `slow_client_timeout_s`, it is stalled and its
  session ends with `too_slow`. Such a client gets the stream at its own pace, with bounded lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

from ..engine import ChunkOutput, StreamHandle
from .config import SessionLimits
from .sockets import SessionSocket, dumps

log = logging.getLogger("streamworld.server")


class ClientTooSlow(Exception):
    """The client did not take a message within `slow_client_timeout_s`; it was cut off."""


# What a send raises once the client has gone (or has been cut off).
CLIENT_GONE = (ConnectionError, RuntimeError, ClientTooSlow)


class Sender:
    """Sends to one WebSocket, messages of one call back to back, within the send timeout."""

    def __init__(
        self, socket: SessionSocket, timeout_s: float, abort: Callable[[], None], label: str
    ) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self.abort = abort
        self.label = label  # for the log
        self._lock = asyncio.Lock()

    async def send(self, *messages: dict | bytes) -> None:
        """Sends messages back to back (never interleaved with other sends).

        A client that does not take them in time is cut off: its connection is aborted
        (nothing more can reach a client that does not read) and `ClientTooSlow` is raised.
        The send itself is never cancelled here, since cancelling aiohttp's drain would break
        the connection's later writes and close; the abort ends it.
        """
        async with self._lock:
            task = asyncio.ensure_future(self._write(messages))
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if not done:
                log.warning("%s: client did not read for %.0f s; dropping it", self.label, self.timeout_s)
                self.abort()
                with contextlib.suppress(BaseException):
                    await task
                raise ClientTooSlow(f"the client did not read for {self.timeout_s:.0f} s")
            task.result()

    async def _write(self, messages: tuple[dict | bytes, ...]) -> None:
        for m in messages:
            if isinstance(m, bytes):
                await self.socket.send_bytes(m)
            else:
                await self.socket.send_text(dumps(m))


class Pacing:
    """One session's outgoing chunks and how far the client is behind.

    `outgoing` holds engine chunks not yet sent, then None once the stream has ended.
    `chunks_handed` counts chunks given to the socket, before the send completes, so that a
    fast client's ack of a chunk it already has is never refused.
    """

    def __init__(self, handle: StreamHandle, limits: SessionLimits, label: str) -> None:
        self.handle = handle
        self.limits = limits
        self.label = label  # for the log
        self.outgoing: deque[ChunkOutput | None] = deque()
        self.ready = asyncio.Event()
        self.chunks_sent = 0
        self.chunks_handed = 0
        self.acked = 0
        self.last_ack_progress = 0.0
        self.behind_since: float | None = None  # when the lag last reached ack_window
        self.stalled = False
        self._paused = False  # what was last told to the engine
        self._watchdog: asyncio.Task | None = None

    @property
    def acks_on(self) -> bool:
        """The client has sent an ack: its lag is bounded too (the watchdog runs from then)."""
        return self._watchdog is not None

    def push(self, chunk: ChunkOutput | None) -> None:
        self.outgoing.append(chunk)
        self.update()
        self.ready.set()

    def update(self) -> None:
        """Pauses the stream's clock while the client is behind, resumes it when it is not."""
        if not self.handle.live:
            return
        lagging = self.acks_on and self.chunks_handed - self.acked >= self.limits.ack_window
        if not lagging:
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = time.monotonic()
        behind = len(self.outgoing) >= self.limits.pause_chunks or lagging
        if behind != self._paused:
            self._paused = behind
            self.handle.set_paused(behind)

    def ack(self, chunk: int, running: Callable[[], bool], on_stall: Callable[[], None]) -> None:
        """The client has consumed every chunk up to `chunk` (already validated).

        The first ack starts the watchdog, which calls `on_stall` once if the client stalls
        while `running()` holds.
        """
        now = time.monotonic()
        if not self.acks_on:
            self.last_ack_progress = now
            self._watchdog = asyncio.create_task(self._watch(running, on_stall), name=f"{self.label}-acks")
        if chunk + 1 > self.acked:
            self.acked = chunk + 1
            self.last_ack_progress = now
        self.update()

    @property
    def behind(self) -> int:
        """Chunks handed to the socket and not acknowledged."""
        return self.chunks_handed - self.acked

    async def _watch(self, running: Callable[[], bool], on_stall: Callable[[], None]) -> None:
        limits = self.limits
        while running() and not self.stalled:
            await asyncio.sleep(min(1.0, limits.slow_client_timeout_s / 4))
            if self.behind_since is None or not running():
                continue
            # Timed from the later of the last advancing ack and the moment it fell behind.
            since = max(self.last_ack_progress, self.behind_since)
            if time.monotonic() - since > limits.slow_client_timeout_s:
                log.warning("%s: no ack for %.0f s; ending it", self.label, limits.slow_client_timeout_s)
                self.stalled = True
                on_stall()
                self.ready.set()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(BaseException):
                await self._watchdog
