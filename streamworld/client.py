"""Python client for the StreamWorld WebSocket protocol (version 1, see `docs/protocol.md`).

One `StreamWorldClient` is one stream: entering it connects, sends `session.start` and waits
for `session.started` (through any `session.queued` messages); `chunks()` then yields the
generated video chunk by chunk, decoded to uint8 frames [T, H, W, 3] whatever the wire format
(`rgb`, `jpeg`, `h264` or `fmp4`), until `session.done`.

```python
async with StreamWorldClient("ws://127.0.0.1:8000/v1/stream", model="pusht", format="rgb", num_chunks=3) as c:
    async for chunk in c.chunks():
        print(chunk.index, chunk.frames.shape)
```

Actions, prompt switches, `session.stop` and pings may be sent from any task while another
iterates `chunks()`. One background task reads the socket, so pongs and errors are seen at
once even while chunks wait to be consumed (received chunks are buffered until then).

`generate(url, **options)` runs a whole finite session and returns all its frames.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import io
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
from PIL import Image
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from .media import FORMATS, SIZED_FORMATS, ChunkDecoder, make_decoder

__all__ = [
    "FORMATS",
    "Chunk",
    "SessionInfo",
    "StreamWorldClient",
    "StreamWorldError",
    "encode_image",
    "generate",
]

DEFAULT_MAX_SIZE = 64 * 2**20  # an rgb chunk of 832x480 frames is about 1.2 MiB per frame
# Payload bytes of the session's own chunks received and not yet taken by `chunks()` before
# the client gives up on its consumer: 512 MiB, 37 rgb chunks of 832x480 (12 frames each),
# hundreds of jpeg ones. A branch's chunks are bounded by the chunks it asked for instead.
DEFAULT_MAX_BUFFERED = 512 * 2**20
# Chunks a branch may receive when the fork that made it is not known (protocol.md: a branch
# asks for at most 64).
MAX_BRANCH_CHUNKS = 64


class StreamWorldError(Exception):
    """An `error` from the server, or a session that ended badly.

    `code` is the server's error code (`bad_request`, `unsupported`, `overloaded`, `internal`)
    or one of the client's own: `connection_closed` (the connection ended without
    `session.done`) and `protocol` (the server broke the protocol, or a payload did not decode).
    `close_code` is the WebSocket close code when the error ended the connection.
    """

    def __init__(self, code: str, message: str, close_code: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.close_code = close_code

    def __repr__(self) -> str:
        close = "" if self.close_code is None else f", close_code={self.close_code}"
        return f"StreamWorldError({self.code!r}, {self.message!r}{close})"


@dataclass(frozen=True)
class SessionInfo:
    """The server's `session.started` message."""

    session_id: str
    model: str
    width: int
    height: int
    fps: float
    format: str
    codec: str | None  # RFC 6381, for h264/fmp4
    kv_mode: str
    frames_per_chunk: int
    first_chunk_frames: int
    raw: dict[str, Any] = field(repr=False, compare=False)
    # Extensions: the engine replica (a model served by several) and the server instance
    # (several servers behind one address, as Ray Serve replicas) that hold the session.
    replica: int | None = None
    instance: str | None = None

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> SessionInfo:
        try:
            return cls(
                session_id=str(message["session_id"]),
                model=str(message["model"]),
                width=int(message["width"]),
                height=int(message["height"]),
                fps=float(message["fps"]),
                format=str(message["format"]),
                codec=message.get("codec"),
                kv_mode=str(message["kv_mode"]),
                frames_per_chunk=int(message["frames_per_chunk"]),
                first_chunk_frames=int(message["first_chunk_frames"]),
                raw=message,
                replica=None if message.get("replica") is None else int(message["replica"]),
                instance=None if message.get("instance") is None else str(message["instance"]),
            )
        except KeyError as e:
            raise StreamWorldError("protocol", f"session.started lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise StreamWorldError(
                "protocol", f"session.started has a field of the wrong type: {e}"
            ) from None


@dataclass
class Chunk:
    """One generated chunk: its `chunk` metadata and its payload, decoded unless `decode=False`."""

    index: int
    first_frame: int  # video frame index of frames[0] in the stream
    num_frames: int
    frames: np.ndarray | None  # uint8 [num_frames, height, width, 3]; None with decode=False
    timings: dict[str, float]  # milliseconds, as the server measured them
    raw: dict[str, Any]  # the `chunk` message
    received_at: float  # time.monotonic() when the payload arrived
    nbytes: int  # payload size on the wire

    def __repr__(self) -> str:
        frames = "None" if self.frames is None else f"uint8{list(self.frames.shape)}"
        total = self.timings.get("total")
        total_ms = "" if total is None else f", total_ms={total:.1f}"
        return (
            f"Chunk(index={self.index}, first_frame={self.first_frame}, num_frames={self.num_frames}, "
            f"frames={frames}, nbytes={self.nbytes}{total_ms})"
        )


def encode_image(image: np.ndarray | bytes) -> str:
    """The `image` field of `session.start`: uint8 [H, W, 3] as base64 PNG, or PNG/JPEG bytes as base64."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"expected a uint8 image [H, W, 3], got {image.dtype} {image.shape}")
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image)).save(buffer, format="PNG")
        data = buffer.getvalue()
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        if not (data.startswith(b"\x89PNG\r\n\x1a\n") or data.startswith(b"\xff\xd8\xff")):
            raise ValueError("image bytes must be a PNG or JPEG file")
    else:
        raise TypeError(f"image must be a numpy array or PNG/JPEG bytes, not {type(image).__name__}")
    return base64.b64encode(data).decode("ascii")


# The client.


@dataclass
class _Payload:
    meta: dict[str, Any]
    data: bytes
    received_at: float


@dataclass
class _EndOfStream:
    error: StreamWorldError | None


@dataclass
class _ChunkSequence:
    """Where the reader is in the chunk stream: the metadata awaiting its payload, the next chunk due."""

    pending: dict[str, Any] | None = None
    next_index: int = 0
    next_frame: int | None = None  # None until the first chunk fixes it


class Branch:
    """One branch of a fork (`StreamWorldClient.fork`): its chunks, then how it ended."""

    def __init__(self, client: StreamWorldClient, number: int, fmt: str, num_chunks: int) -> None:
        self.client = client
        self.number = number  # the session's branch number, from 1
        self.format = fmt
        self.num_chunks = num_chunks  # what it asked for: the most chunks the server may send it
        self.chunks_received = 0
        self.done_reason: str | None = None  # completed, cancelled or error (branch.done)
        self.chunks_done: int | None = None
        self.message: str | None = None  # why it failed, for `error`
        self._incoming: asyncio.Queue[_Payload | _EndOfStream] = asyncio.Queue()
        self._sequence = _ChunkSequence()
        self._ended = False
        self._decoder = (
            make_decoder(fmt, client.info.width, client.info.height, None)
            if client.decode and client.info is not None
            else None
        )

    def __repr__(self) -> str:
        return f"Branch(number={self.number}, format={self.format!r}, done_reason={self.done_reason!r})"

    def _end(self, error: StreamWorldError | None) -> None:
        if not self._ended:
            self._ended = True
            self._incoming.put_nowait(_EndOfStream(error))

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Yields the branch's chunks (indices from the fork point on) until `branch.done`;
        StreamWorldError when the branch fails or the connection closes first."""
        while True:
            item = await self._incoming.get()
            if isinstance(item, _EndOfStream):
                self._incoming.put_nowait(item)
                if item.error is not None:
                    raise item.error
                return
            yield await self.client._to_chunk(item, self._decoder)

    async def cancel(self) -> None:
        """Cancels the branch; `chunks()` then ends (`done_reason` cancelled)."""
        await self.client._send({"type": "branch.cancel", "branch": self.number})


def _branch_message(spec: dict[str, Any]) -> dict[str, Any]:
    """A branch of `session.fork` from a dict with num_chunks, and optionally actions (any
    [N, action_dim] sequence or array), seed and paced."""
    unknown = set(spec) - {"num_chunks", "actions", "seed", "paced"}
    if unknown:
        raise ValueError(f"unknown branch fields {sorted(unknown)}")
    out: dict[str, Any] = {"num_chunks": int(spec["num_chunks"])}
    if spec.get("actions") is not None:
        actions = np.asarray(spec["actions"], dtype=np.float64)
        if actions.ndim != 2:
            raise ValueError(f"a branch's actions must be [N, action_dim], got shape {actions.shape}")
        out["actions"] = actions.tolist()
    if spec.get("seed") is not None:
        out["seed"] = int(spec["seed"])
    if spec.get("paced") is not None:
        out["paced"] = bool(spec["paced"])
    return out


def _json(message: dict[str, Any]) -> str:
    return json.dumps(message, allow_nan=False, separators=(",", ":"))


def _pong_key(ping_id: Any) -> str:
    return json.dumps(ping_id, sort_keys=True)


class StreamWorldClient:
    """One stream (session) on a StreamWorld server; use as `async with`, or `start()` + `close()`.

    The session options are the fields of `session.start`; those left as None are not sent,
    so the server's defaults apply. `start_fields` are merged into `session.start` last (for
    protocol extensions). `decode=False` skips decoding (`Chunk.frames` is None), for load tests.
    `on_queued(position)` (a function or coroutine function) is called for each `session.queued`.
    `token` is sent as `Authorization: Bearer <token>` to a server that requires one.
    `ack=True` acknowledges each chunk once the caller asks `chunks()` for the next one (the
    protocol's `ack` extension): the server then keeps this session's lag to a few chunks,
    pausing its stream while the caller is slow, instead of letting chunks pile up in
    socket buffers. `ack(index)` sends one by hand. A caller that breaks out of `chunks()`
    has not acknowledged the last chunk it took; if it keeps the session open without
    reading on, it should `ack()` that chunk, or the server ends the session (`too_slow`)
    after 10 s. `max_buffered` bounds the payload bytes of the session's chunks received and
    not yet taken by `chunks()`; past it the client leaves and `chunks()` raises
    `StreamWorldError` `buffer_full` once it has yielded what was received. A branch keeps
    at most the chunks it asked for.

    After the start: `info` (SessionInfo), `queue_position` (the last one announced, if the
    session had to wait), `init_segment` (fmp4), `errors` (every `error` received during the
    session, fatal or not), and after `session.done`: `done_reason` and `chunks_done`.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        prompt: str | None = None,
        image: np.ndarray | bytes | None = None,
        seed: int | None = None,
        num_chunks: int | None = None,
        format: str = "jpeg",
        priority: str | None = None,
        action_policy: str | None = None,
        kv_mode: str | None = None,
        start_fields: Mapping[str, Any] | None = None,
        decode: bool = True,
        on_queued: Callable[[int], Any] | None = None,
        ack: bool = False,
        max_size: int | None = DEFAULT_MAX_SIZE,
        max_buffered: int | None = DEFAULT_MAX_BUFFERED,
        open_timeout: float | None = 10.0,
        start_timeout: float | None = None,
        token: str | None = None,
    ) -> None:
        self.url = url
        self._token = token
        self.format = format
        self.decode = decode
        self.on_queued = on_queued
        self.auto_ack = ack
        self.max_size = max_size
        self.max_buffered = max_buffered
        self.open_timeout = open_timeout
        self.start_timeout = start_timeout
        options = {
            "model": model,
            "prompt": prompt,
            "image": None if image is None else encode_image(image),
            "seed": seed,
            "num_chunks": num_chunks,
            "format": format,
            "priority": priority,
            "action_policy": action_policy,
            "kv_mode": kv_mode,
        }
        self.start_message: dict[str, Any] = {
            "type": "session.start",
            **{key: value for key, value in options.items() if value is not None},
            **(start_fields or {}),
        }

        self._init_session_state()

    def _init_session_state(self) -> None:
        """What the session has told us so far (nothing yet), and the connection's internals."""
        self.info: SessionInfo | None = None
        self.queue_position: int | None = None
        self.init_segment: bytes | None = None
        self.errors: list[StreamWorldError] = []
        self.done_reason: str | None = None
        self.chunks_done: int | None = None
        self.chunks_received = 0
        self.buffered_bytes = 0  # payloads received, not yet taken by chunks()
        self._state = "new"
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._incoming: asyncio.Queue[_Payload | _EndOfStream] = asyncio.Queue()
        self._ended = False  # an _EndOfStream is queued
        self._closing = False  # close() was called: the end of the connection is no error
        self._pongs: dict[str, list[asyncio.Future[None]]] = {}
        self._ping_ids = itertools.count()
        self._decoder: ChunkDecoder | None = None
        self._consume = asyncio.Lock()  # chunks are decoded one at a time, in order
        self.branches: dict[int, Branch] = {}  # every branch of this session's forks
        # fork id -> (waiter, format, each branch's num_chunks)
        self._forks: dict[str, tuple[asyncio.Future[list[Branch]], str, list[int]]] = {}
        self._fork_ids = itertools.count()

    def __repr__(self) -> str:
        model = self.start_message.get("model")
        details = [f"{self.url!r}", f"model={model!r}", f"format={self.format!r}", f"state={self.state!r}"]
        if self.info is not None:
            details += [f"session_id={self.info.session_id!r}", f"chunks_received={self.chunks_received}"]
        return f"StreamWorldClient({', '.join(details)})"

    @property
    def state(self) -> str:
        """new, connecting, queued, streaming, done (session.done received) or closed (the connection)."""
        return self._state

    @property
    def close_code(self) -> int | None:
        """The close code the server sent, once the connection is closed."""
        return None if self._ws is None else self._ws.close_code

    @property
    def close_reason(self) -> str | None:
        return None if self._ws is None else self._ws.close_reason

    async def __aenter__(self) -> StreamWorldClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> SessionInfo:
        """Connects, starts the session and waits (through the queue, if any) until it has started."""
        if self._state != "new":
            raise RuntimeError(f"start() on a client in state {self._state!r}")
        self._state = "connecting"
        try:
            self._ws = await connect(
                self.url,
                max_size=self.max_size,
                open_timeout=self.open_timeout,
                # Media payloads do not compress, and deflating them would cost the server CPU.
                compression=None,
                additional_headers=None
                if self._token is None
                else {"Authorization": f"Bearer {self._token}"},
            )
            await self._ws.send(_json(self.start_message))
            await asyncio.wait_for(self._await_started(), self.start_timeout)
            assert self.info is not None
            if self.decode:
                if self.info.format not in FORMATS:
                    raise StreamWorldError(
                        "unsupported",
                        f"the client cannot decode format {self.info.format!r}; use decode=False",
                    )
                try:
                    self._decoder = make_decoder(
                        self.info.format, self.info.width, self.info.height, self.init_segment
                    )
                except (ValueError, IndexError, av.FFmpegError, OSError) as e:
                    raise StreamWorldError(
                        "protocol", f"the fmp4 initialization segment is unusable: {e}"
                    ) from e
        except BaseException:
            await self._shut()
            raise
        self._state = "streaming"
        self._reader = asyncio.create_task(self._read_loop(), name=f"streamworld-reader {self.url}")
        return self.info

    async def _await_started(self) -> None:
        assert self._ws is not None
        try:
            while self.info is None:
                message = self._parse(await self._ws.recv())
                kind = message.get("type")
                if kind == "session.queued":
                    self._state = "queued"
                    self.queue_position = _queue_position(message)
                    if self.on_queued is not None:
                        result = self.on_queued(self.queue_position)
                        if inspect.isawaitable(result):
                            await result
                elif kind == "error":
                    error = self._error_from(message)
                    error.close_code = await self._await_close()
                    raise error
                elif kind == "session.started":
                    self.info = SessionInfo.from_message(message)
            if self.info.format == "fmp4":
                init_segment = await self._ws.recv()
                if not isinstance(init_segment, bytes):
                    raise StreamWorldError(
                        "protocol", "expected the fmp4 initialization segment after session.started"
                    )
                self.init_segment = init_segment
        except ConnectionClosed as closed:
            code = self._ws.close_code
            raise StreamWorldError(
                "connection_closed",
                f"the server closed the connection before the session started ({_describe_close(closed)})",
                close_code=code,
            ) from None

    def _parse(self, data: str | bytes) -> dict[str, Any]:
        if isinstance(data, bytes):
            raise StreamWorldError("protocol", f"unexpected binary message of {len(data)} bytes")
        try:
            message = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:  # not JSON, integers too long, nested too deep
            raise StreamWorldError("protocol", f"a text message is not JSON: {str(e)[:200]}") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise StreamWorldError("protocol", f"a text message is not an object with a type: {data[:200]!r}")
        return message

    @staticmethod
    def _error_from(message: dict[str, Any]) -> StreamWorldError:
        return StreamWorldError(str(message.get("code", "")), str(message.get("message", "")))

    async def _await_close(self) -> int | None:
        """Waits for the server to close (it does after an error before the start); its close code."""
        assert self._ws is not None
        try:
            await asyncio.wait_for(self._ws.wait_closed(), timeout=self._ws.close_timeout)
        except asyncio.TimeoutError:
            await self._ws.close()
        return self._ws.close_code

    async def _read_loop(self) -> None:
        """Owns the receive side: pairs chunk metadata with payloads, answers pings, ends the stream."""
        assert self._ws is not None and self.info is not None
        sequence = _ChunkSequence()
        try:
            while True:
                data = await self._ws.recv()
                if isinstance(data, bytes):
                    self._take_payload(sequence, data)
                else:
                    self._take_message(sequence, self._parse(data))
        except ConnectionClosed as closed:
            if not self._closing:
                self._end(self._session_error(closed))
        except Exception as e:  # anything unexpected from the server must still end the stream
            error = e if isinstance(e, StreamWorldError) else StreamWorldError("protocol", f"{e!r}")
            self._end(error)
            if error.code == "buffer_full":  # the client's own limit: it leaves, as it may
                await self._ws.close(code=1000, reason="client buffer full")
            else:
                await self._ws.close(code=1002, reason="protocol error")
        finally:
            self._end(None)
            self._state = "closed"
            self._fail_pong_waiters()

    def _take_payload(self, sequence: _ChunkSequence, data: bytes) -> None:
        """Queues the binary payload of the chunk whose metadata came just before it."""
        pending = sequence.pending
        if pending is None:
            raise StreamWorldError("protocol", f"a binary message of {len(data)} bytes without chunk")
        if len(data) != pending["bytes"]:
            raise StreamWorldError(
                "protocol",
                f"chunk {pending['index']}: payload of {len(data)} bytes, not {pending['bytes']}",
            )
        branch = self.branches.get(pending["branch"]) if "branch" in pending else None
        if branch is not None:
            branch._incoming.put_nowait(_Payload(pending, data, time.monotonic()))
        else:
            if self.max_buffered is not None and self.buffered_bytes + len(data) > self.max_buffered:
                raise StreamWorldError(
                    "buffer_full",
                    f"more than {self.max_buffered} bytes of chunks received and not yet taken by chunks(): "
                    "the consumer is slower than the stream (ack=True lets the server pause it instead)",
                )
            self.buffered_bytes += len(data)
            self._incoming.put_nowait(_Payload(pending, data, time.monotonic()))
            self.chunks_received += 1
        sequence.pending = None

    def _take_message(self, sequence: _ChunkSequence, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "chunk":
            self._take_chunk_meta(sequence, message)
        elif kind == "pong":
            self._resolve_pong(message)
        elif kind == "error" and message.get("id") in self._forks:
            waiter, _, _ = self._forks.pop(message["id"])
            if not waiter.done():
                waiter.set_exception(self._error_from(message))
        elif kind == "error":
            self.errors.append(self._error_from(message))
        elif kind == "session.forked":
            self._take_forked(message)
        elif kind == "branch.done":
            branch = self.branches.get(message.get("branch"))
            if branch is not None:
                branch.done_reason, branch.chunks_done = message.get("reason"), message.get("chunks")
                branch.message = message.get("message")
                failed = branch.done_reason == "error"
                branch._end(StreamWorldError("internal", branch.message or "failed") if failed else None)
        elif kind == "session.done":
            self._state = "done"
            self.done_reason = message.get("reason")
            self.chunks_done = message.get("chunks")
            self._end(self._session_error() if self.done_reason == "error" else None)
        elif kind == "session.queued":
            self.queue_position = message.get("position")
        # Other types are ignored: the protocol grows by adding them.

    def _take_chunk_meta(self, sequence: _ChunkSequence, meta: dict[str, Any]) -> None:
        if sequence.pending is not None:
            raise StreamWorldError("protocol", f"chunk {sequence.pending['index']} has no payload")
        own = sequence
        if "branch" in meta:
            branch = self.branches.get(meta["branch"])
            if branch is None:
                raise StreamWorldError("protocol", f"chunk of unknown branch {meta['branch']!r}")
            if branch.chunks_received >= branch.num_chunks:
                raise StreamWorldError(
                    "protocol",
                    f"branch {branch.number}: more than the {branch.num_chunks} chunks it asked for",
                )
            branch.chunks_received += 1
            own = branch._sequence
            if own.next_frame is None:  # a branch's first chunk: the fork point
                own.next_index = meta.get("index")
            self._check_chunk(meta, own.next_index, own.next_frame, branch.format)
        else:
            self._check_chunk(meta, sequence.next_index, sequence.next_frame)
        own.next_index = meta["index"] + 1
        own.next_frame = meta["first_frame"] + meta["num_frames"]
        sequence.pending = meta

    def _take_forked(self, message: dict[str, Any]) -> None:
        waiter, fmt, counts = self._forks.pop(message.get("id"), (None, "jpeg", []))
        numbers = message.get("branches")
        if not isinstance(numbers, list) or not all(isinstance(n, int) for n in numbers):
            raise StreamWorldError("protocol", f"session.forked with branches {str(numbers)[:200]}")
        if counts and len(counts) != len(numbers):
            raise StreamWorldError(
                "protocol", f"session.forked with {len(numbers)} branches, {len(counts)} asked for"
            )
        asked = counts or [MAX_BRANCH_CHUNKS] * len(numbers)  # a fork this client does not know
        branches = [Branch(self, n, fmt, c) for n, c in zip(numbers, asked, strict=True)]
        self.branches.update((b.number, b) for b in branches)
        if waiter is not None and not waiter.done():
            waiter.set_result(branches)

    def _resolve_pong(self, message: dict[str, Any]) -> None:
        """Wakes the oldest `ping()` still waiting on this id."""
        waiters = self._pongs.get(_pong_key(message.get("id")))
        if waiters:
            waiter = waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)

    def _fail_pong_waiters(self) -> None:
        for waiters in self._pongs.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(StreamWorldError("connection_closed", "the connection closed"))
        self._pongs.clear()

    def _check_chunk(
        self, meta: dict[str, Any], index: int, first_frame: int | None, fmt: str | None = None
    ) -> None:
        where = f"chunk {meta.get('index')}"
        fmt = fmt or self.info.format
        for key in ("index", "first_frame", "num_frames", "bytes"):
            if not isinstance(meta.get(key), int):
                raise StreamWorldError("protocol", f"{where}: {key!r} missing or not an integer")
        if meta["index"] != index:
            raise StreamWorldError("protocol", f"{where} arrived where chunk {index} was due")
        if first_frame is not None and meta["first_frame"] != first_frame:
            raise StreamWorldError(
                "protocol", f"{where} starts at frame {meta['first_frame']}, not {first_frame}"
            )
        if fmt == "rgb" and meta["bytes"] != meta["num_frames"] * self.info.height * self.info.width * 3:
            raise StreamWorldError(
                "protocol", f"{where}: {meta['bytes']} bytes of rgb for {meta['num_frames']} frames"
            )
        sizes = meta.get("sizes")
        if fmt in SIZED_FORMATS and (
            not isinstance(sizes, list) or len(sizes) != meta["num_frames"] or sum(sizes) != meta["bytes"]
        ):
            raise StreamWorldError("protocol", f"{where}: sizes {sizes} do not match num_frames and bytes")

    def _session_error(self, closed: ConnectionClosed | None = None) -> StreamWorldError:
        """The error that ended the session: the last fatal `error` received, else a summary."""
        fatal = [error for error in self.errors if error.code != "bad_request"]
        if fatal:
            error = StreamWorldError(fatal[-1].code, fatal[-1].message)
        elif closed is None:
            error = StreamWorldError("internal", "the session ended with reason 'error'")
        else:
            error = StreamWorldError(
                "connection_closed", f"the connection closed without session.done ({_describe_close(closed)})"
            )
        if closed is not None:
            error.close_code = closed.rcvd.code if closed.rcvd is not None else 1006
        return error

    def _end(self, error: StreamWorldError | None) -> None:
        if not self._ended:
            self._ended = True
            self._incoming.put_nowait(_EndOfStream(error))
        if error is not None or self._state == "closed" or self._closing:
            gone = error or StreamWorldError("connection_closed", "the connection closed")
            for branch in self.branches.values():
                branch._end(gone)
            for waiter, _, _ in self._forks.values():
                if not waiter.done():
                    waiter.set_exception(gone)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Yields the session's chunks in order until `session.done`.

        Raises StreamWorldError when the session ends with an error or the connection closes
        without `session.done`; chunks received before that are yielded first.
        """
        if self.info is None:
            raise RuntimeError("chunks() before the session has started")
        while True:
            async with self._consume:
                item = await self._incoming.get()
                if isinstance(item, _EndOfStream):
                    self._incoming.put_nowait(item)  # later calls end the same way
                    if item.error is not None:
                        raise item.error
                    return
                self.buffered_bytes -= len(item.data)
                chunk = await self._to_chunk(item)
            yield chunk
            if self.auto_ack:  # the caller is back for more: it has consumed this one
                with contextlib.suppress(StreamWorldError):  # the session may just have ended
                    await self.ack(chunk.index)

    async def _to_chunk(self, item: _Payload, decoder: ChunkDecoder | None = None) -> Chunk:
        meta = item.meta
        frames = None
        decoder = decoder or self._decoder
        if decoder is not None:
            try:
                sizes = meta.get("sizes")
                frames = await asyncio.to_thread(decoder.decode, item.data, meta["num_frames"], sizes)
            except (ValueError, av.FFmpegError, OSError, Image.DecompressionBombError) as e:
                raise StreamWorldError(
                    "protocol", f"chunk {meta['index']}: the {self.info.format} payload does not decode: {e}"
                ) from e
            expected = (meta["num_frames"], self.info.height, self.info.width, 3)
            if frames.shape != expected:
                raise StreamWorldError(
                    "protocol", f"chunk {meta['index']}: decoded frames {frames.shape}, expected {expected}"
                )
        return Chunk(
            index=meta["index"],
            first_frame=meta["first_frame"],
            num_frames=meta["num_frames"],
            frames=frames,
            timings=dict(meta.get("timings") or {}),
            raw=meta,
            received_at=item.received_at,
            nbytes=len(item.data),
        )

    async def _send(self, message: dict[str, Any]) -> None:
        if self._ws is None or self.info is None:
            raise RuntimeError(f"{message['type']} before the session has started")
        try:
            await self._ws.send(_json(message))
        except ConnectionClosed as closed:
            raise StreamWorldError(
                "connection_closed", f"cannot send {message['type']}: {_describe_close(closed)}"
            ) from None

    async def send_actions(
        self, actions: Sequence[Sequence[float]] | np.ndarray, frame: int | None = None
    ) -> None:
        """Queues per-video-frame actions [N, action_dim] (or one vector [action_dim]).

        With `frame`, the first applies to that video frame and the rest follow it; without,
        they follow the last queued action. The action for frame n conditions frame n + 1.
        """
        array = np.asarray(actions, dtype=np.float64)
        if array.ndim == 1:
            array = array.reshape(1, -1) if array.size else array.reshape(0, 0)
        if array.ndim != 2:
            raise ValueError(f"actions must be [N, action_dim], got shape {array.shape}")
        message: dict[str, Any] = {"type": "action", "actions": array.tolist()}
        if frame is not None:
            message["frame"] = int(frame)
        await self._send(message)

    async def set_prompt(self, prompt: str) -> None:
        """Switches the prompt from the next chunk that has not started."""
        await self._send({"type": "prompt", "prompt": prompt})

    async def ack(self, index: int) -> None:
        """Tells the server that every chunk up to `index` has been consumed (see `ack=`)."""
        await self._send({"type": "ack", "chunk": int(index)})

    async def fork(
        self, branches: Sequence[dict[str, Any]], format: str | None = None, timeout: float | None = 30.0
    ) -> list[Branch]:
        """Forks the session into branches that share its history (`session.fork`).

        Each branch is a dict: `num_chunks` (required), `actions` ([N, action_dim], from the
        fork point's first video frame), `seed` (default: the session's) and `paced` (default
        False: as fast as the server can). `format`: "jpeg" or "rgb" (default: the session's
        if it is one of them, else jpeg). Returns the branches once the server has accepted
        them; their chunks start at the fork point, the session's next chunk not yet started.
        Raises StreamWorldError with the server's reason when the fork is refused.
        """
        fork_id = f"fork-{next(self._fork_ids)}"
        session_format = self.info.format if self.info is not None else None
        fmt = format or (session_format if session_format in ("jpeg", "rgb") else "jpeg")
        message: dict[str, Any] = {
            "type": "session.fork",
            "id": fork_id,
            "branches": [_branch_message(b) for b in branches],
            "format": fmt,
        }
        waiter: asyncio.Future[list[Branch]] = asyncio.get_running_loop().create_future()
        self._forks[fork_id] = (waiter, fmt, [int(b["num_chunks"]) for b in message["branches"]])
        try:
            await self._send(message)
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._forks.pop(fork_id, None)

    async def stop(self) -> None:
        """Asks the server to finish the chunk in flight and end the session (`chunks()` then ends)."""
        await self._send({"type": "session.stop"})

    async def ping(self, id: Any = None, timeout: float | None = None) -> float:
        """Round trip time in seconds of an application-level ping (`id`: any JSON value)."""
        if self._reader is None:
            raise RuntimeError("ping before the session has started")
        if self._reader.done():
            raise StreamWorldError("connection_closed", "ping on a closed connection")
        if id is None:
            id = f"ping-{next(self._ping_ids)}"
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._pongs.setdefault(_pong_key(id), [])
        waiters.append(waiter)
        sent = time.monotonic()
        try:
            await self._send({"type": "ping", "id": id})
            await asyncio.wait_for(waiter, timeout)
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
        return time.monotonic() - sent

    async def close(self) -> None:
        """Closes the connection (1000); a session still running is cancelled by the server."""
        if self._state == "closed":
            return
        self._closing = True
        await self._shut()

    async def _shut(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await self._reader
        self._end(None)
        self._state = "closed"


def _describe_close(closed: ConnectionClosed) -> str:
    if closed.rcvd is None:
        return "no close frame received"
    reason = f" {closed.rcvd.reason!r}" if closed.rcvd.reason else ""
    return f"close code {closed.rcvd.code}{reason}"


async def generate(
    url: str, *, actions: Sequence[Sequence[float]] | np.ndarray | None = None, **options: Any
) -> np.ndarray:
    """Runs one finite session (`num_chunks` required) and returns all its frames, uint8 [T, H, W, 3].

    `options` are StreamWorldClient's. `actions` (per video frame, from frame 0) are sent right
    after the start; pass `action_policy="wait"` so that no chunk starts before they arrive.
    """
    if options.get("num_chunks") is None:
        raise ValueError("generate() needs num_chunks: a session without it never ends")
    if not options.get("decode", True):
        raise ValueError("generate() returns decoded frames; it cannot take decode=False")
    async with StreamWorldClient(url, **options) as client:
        if actions is not None:
            await client.send_actions(actions, frame=0)
        frames = [chunk.frames async for chunk in client.chunks()]
        info = client.info
    if not frames:
        return np.zeros((0, info.height, info.width, 3), dtype=np.uint8)
    return np.concatenate(frames)


def _queue_position(message: dict[str, Any]) -> int:
    position = message.get("position")
    if not isinstance(position, int) or isinstance(position, bool):
        raise StreamWorldError("protocol", f"session.queued has no integer position: {str(position)[:64]}")
    return position


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not standard JSON")
