"""The socket a session runs over: a small interface, and one adapter per web framework.

A `Session` (session.py) needs five things of its WebSocket: send a text message, send a
binary one, receive the next message (with a timeout), close with a code and reason, and
abort (cut off a client that does not read). `SessionSocket` is that interface;

    AiohttpSocket   aiohttp's WebSocketResponse (app.py, `streamworld serve`)
    AsgiSocket      Starlette's WebSocket, so FastAPI and any ASGI server (asgi.py, Ray Serve)

Both send exactly the same bytes: JSON messages are `json.dumps` with its default
separators (what aiohttp's `send_json` writes), payloads as they are. Whatever a framework
raises once the client has gone becomes `ConnectionError`, which sessions treat as the
client leaving (pacing.CLIENT_GONE).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from aiohttp import WSMsgType, web

from .protocol import CLOSE_TOO_BIG


@dataclass(frozen=True)
class Incoming:
    """One message from the client: text, binary, or the end of the connection (closed:
    the client closed or left, or broke a framing limit the framework enforces)."""

    kind: Literal["text", "binary", "closed"]
    data: str | bytes | None = None


CLOSED = Incoming("closed")


class SessionSocket(Protocol):
    @property
    def closed(self) -> bool: ...

    async def send_text(self, text: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def receive(self, timeout: float | None = None) -> Incoming:
        """The next message; `TimeoutError` after `timeout` seconds without one."""
        ...

    async def close(self, code: int, reason: bytes = b"") -> None: ...

    def abort(self) -> None:
        """Drops the connection now, without a closing handshake; pending sends fail."""
        ...


def dumps(message: dict) -> str:
    """A protocol message as sent on every transport."""
    return json.dumps(message)


async def messages(socket: SessionSocket):
    """The client's messages until the connection ends."""
    while True:
        msg = await socket.receive()
        if msg.kind == "closed":
            return
        yield msg


class AiohttpSocket:
    def __init__(self, ws: web.WebSocketResponse, transport: Any = None) -> None:
        self.ws = ws
        self.transport = transport

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def send_text(self, text: str) -> None:
        await self.ws.send_str(text)

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def receive(self, timeout: float | None = None) -> Incoming:
        msg = await self.ws.receive(timeout=timeout)
        if msg.type == WSMsgType.TEXT:
            return Incoming("text", msg.data)
        if msg.type == WSMsgType.BINARY:
            return Incoming("binary", msg.data)
        return CLOSED  # closed, or an oversize frame (aiohttp closes with 1009)

    async def close(self, code: int, reason: bytes = b"") -> None:
        await self.ws.close(code=code, message=reason)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class AsgiSocket:
    """Starlette's WebSocket, accepted. An ASGI application cannot reach the TCP connection:
    `abort` cancels the sends in flight, wakes a pending receive and marks the socket closed;
    the server (uvicorn, Ray Serve's proxy) closes the connection when the handler returns,
    and a client that reads nothing is dropped by its ping timeout.

    `max_text`: the longest client message, in bytes (of UTF-8 for text; `ServerConfig.max_text_frame`);
    a longer one closes the connection with 1009, as aiohttp's limit does. uvicorn applies the
    limit itself (`ws_max_size`), but an ASGI server that takes other settings (Ray Serve's
    proxy) may not."""

    def __init__(self, ws: Any, max_text: int | None = None) -> None:
        self.ws = ws
        self.max_text = max_text
        self._closed = False
        self._aborted = asyncio.Event()
        self._sends: set[asyncio.Future] = set()

    @property
    def closed(self) -> bool:
        return self._closed

    async def send_text(self, text: str) -> None:
        await self._send({"type": "websocket.send", "text": text})

    async def send_bytes(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": data})

    async def _send(self, message: dict) -> None:
        if self._closed:
            raise ConnectionError("the WebSocket is closed")
        # The send runs as its own task, so that `abort` cancels only the send, never the
        # task that asked for it.
        send = asyncio.ensure_future(self.ws.send(message))
        self._sends.add(send)
        try:
            await send
        except asyncio.CancelledError:
            if send.cancelled() and self._aborted.is_set():
                raise ConnectionError("the WebSocket was aborted") from None
            send.cancel()
            raise
        except client_gone_errors() as e:  # disconnected, a closed transport, a send after the close
            self._closed = True
            raise ConnectionError(f"the client went away ({type(e).__name__})") from None
        finally:
            self._sends.discard(send)

    async def receive(self, timeout: float | None = None) -> Incoming:
        if self._closed:
            return CLOSED
        receive = asyncio.ensure_future(self.ws.receive())
        aborted = asyncio.ensure_future(self._aborted.wait())
        try:
            done, _ = await asyncio.wait(
                {receive, aborted}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            aborted.cancel()
        if not done:
            receive.cancel()
            raise TimeoutError
        if receive not in done:  # aborted
            receive.cancel()
            return CLOSED
        try:
            msg = receive.result()
        except client_gone_errors():  # the connection broke under the receive
            self._closed = True
            return CLOSED
        if msg["type"] != "websocket.receive":  # websocket.disconnect
            self._closed = True
            return CLOSED
        text, data = msg.get("text"), msg.get("bytes") or b""
        if (text is not None and self._too_long(text)) or (text is None and self._over(len(data))):
            await self.close(CLOSE_TOO_BIG, b"message too big")
            return CLOSED
        if text is not None:
            return Incoming("text", text)
        return Incoming("binary", data)

    def _too_long(self, text: str) -> bool:
        if not self._over(len(text) * 4):  # at most 4 bytes a character
            return False
        return self._over(len(text)) or self._over(len(text.encode("utf-8", "surrogatepass")))

    def _over(self, size: int) -> bool:
        return self.max_text is not None and size > self.max_text

    async def close(self, code: int, reason: bytes = b"") -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(*client_gone_errors()):
            await self.ws.close(code=code, reason=reason.decode("utf-8", "replace"))

    def abort(self) -> None:
        self._closed = True
        self._aborted.set()
        for send in list(self._sends):
            send.cancel()


def client_gone_errors() -> tuple[type[BaseException], ...]:
    """What Starlette and the ASGI server raise once the client has gone."""
    from starlette.websockets import WebSocketDisconnect

    return (WebSocketDisconnect, OSError, RuntimeError)
