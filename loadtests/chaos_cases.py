"""The chaos suite's clients: one coroutine per kind of misbehaving (or well-behaved) session.

Each case opens its own WebSocket (`docs/protocol.md`) and returns an `Outcome`: whether the
server's replies were the documented ones. Verdicts:

- `ok`: the documented reply (or, for a dropped connection, nothing to check);
- `undocumented`: a client error reply (4xx-like: `bad_request`, `unsupported`, `overloaded`,
  close 1003/1008/1009/1013) other than the one the protocol documents for that input;
- `internal`: a server error (`internal`, close 1011), an abrupt close, or no reply in time.

Disconnects are TCP resets: the socket gets SO_LINGER 0 and is closed without a close frame,
as a crashed browser or a dropped network leaves it. Bystanders and slow readers return a
`ViewRecord` of what arrived and when.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from loadtests.viewer import grey_image

MIB = 2**20
CLIENT_ERRORS = {"bad_request", "unsupported", "overloaded", "too_slow"}
CLIENT_CLOSES = {1000, 1001, 1003, 1008, 1009, 1013}
REPLY_TIMEOUT_S = 30.0
STAGES = ("before_start", "queued", "mid_chunk", "after_stop")


@dataclass
class Outcome:
    case: str
    verdict: str = "ok"  # ok, undocumented, internal
    detail: str = ""
    replies: list[str] = field(default_factory=list)
    stage_reached: bool = True  # a disconnect case reached the stage it aimed at


@dataclass
class ViewRecord:
    kind: str  # bystander, slow, long
    chunks: list[int] = field(default_factory=list)  # chunk indices, in arrival order
    arrivals: list[float] = field(default_factory=list)  # monotonic seconds, payload arrivals
    end: str = "unfinished"
    close_code: int | None = None
    errors: list[str] = field(default_factory=list)
    planned: int | None = None


def start_message(model: dict[str, Any], num_chunks: int | None, seed: int, **extra: Any) -> dict[str, Any]:
    msg = {"type": "session.start", "model": model["id"], "num_chunks": num_chunks, "seed": seed}
    if model.get("needs_image") and not model.get("has_default_image"):
        msg["image"] = grey_image(model)
    return {**msg, **extra}


def reset(ws: ClientConnection) -> None:
    """Drop the connection with a TCP reset: no close frame, no FIN handshake."""
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def open_ws(url: str) -> ClientConnection:
    # No keepalive pings: a deliberately slow reader must not be closed by its own library.
    return await connect(url, max_size=64 * MIB, open_timeout=30, ping_interval=None, compression=None)


async def next_message(ws: ClientConnection, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any] | bytes:
    message = await asyncio.wait_for(ws.recv(), timeout)
    return message if isinstance(message, bytes) else json.loads(message)


async def drain(ws: ClientConnection, timeout: float = REPLY_TIMEOUT_S) -> tuple[list[dict], int | None]:
    """Every text message until the server closes: (messages, close code; None = abrupt, -1 = timeout)."""
    messages: list[dict] = []
    try:
        while True:
            message = await next_message(ws, timeout)
            if not isinstance(message, bytes):
                messages.append(message)
    except ConnectionClosed as e:
        return messages, e.rcvd.code if e.rcvd is not None else None
    except asyncio.TimeoutError:
        reset(ws)
        return messages, -1


def judge(case: str, replies: list[str], got: tuple[Any, Any], allowed: set[tuple[Any, Any]]) -> Outcome:
    """`got` = (error code or "started" or None, close code); `allowed` the documented pairs."""
    out = Outcome(case, replies=replies)
    if got in allowed:
        return out
    code, close = got
    client_side = (code is None or code in CLIENT_ERRORS or code == "started") and close in CLIENT_CLOSES
    out.verdict = "undocumented" if client_side else "internal"
    out.detail = f"got {got}, documented {sorted(allowed, key=str)}"
    return out


def summarise_replies(messages: list[dict], close: int | None) -> list[str]:
    said = [f"{m.get('type')}:{m.get('code') or m.get('reason') or ''}" for m in messages]
    return [*said[:8], f"close:{close}"]


async def disconnect(url: str, model: dict[str, Any], stage: str, seed: int, fill: int = 8) -> Outcome:
    """A session that is reset at `stage` (one of STAGES). To reach `queued`, sessions that are
    admitted at once are held (unread) while the next one is tried, up to `fill` of them; all
    of them are reset together."""
    out = Outcome(f"disconnect:{stage}")
    held: list[ClientConnection] = []
    try:
        for _ in range(fill if stage == "queued" else 1):
            ws = await open_ws(url)
            held.append(ws)
            if stage != "before_start":
                await ws.send(json.dumps(start_message(model, None, seed, format="jpeg")))
                await _walk_to_stage(ws, stage, seed, out)
            if stage != "queued" or out.stage_reached or out.verdict != "ok":
                break
    except ConnectionClosed as e:
        out.verdict, out.detail = "internal", f"the server closed first ({e.rcvd and e.rcvd.code})"
    except asyncio.TimeoutError:
        out.verdict, out.detail = "internal", f"no reply in {REPLY_TIMEOUT_S:.0f} s"
    finally:
        for ws in held:
            reset(ws)
    return out


async def _walk_to_stage(ws: ClientConnection, stage: str, seed: int, out: Outcome) -> None:
    chunks_wanted = 1 + seed % 3
    seen = 0
    while True:
        msg = await next_message(ws)
        if isinstance(msg, bytes):
            seen += 1
            if stage == "after_stop":
                await ws.send(json.dumps({"type": "session.stop"}))
                return
            if stage == "mid_chunk" and seen >= chunks_wanted:
                return
            continue
        kind = msg.get("type")
        out.replies.append(str(kind))
        if kind == "error":
            code = msg.get("code")
            out.verdict = (
                "ok" if code == "overloaded" else ("undocumented" if code in CLIENT_ERRORS else "internal")
            )
            out.detail = f"error {code}: {msg.get('message', '')[:200]}"
            return
        if stage == "queued" and kind in ("session.queued", "session.started"):
            out.stage_reached = kind == "session.queued"
            return
        if stage == "mid_chunk" and kind == "chunk" and seen + 1 >= chunks_wanted and seed % 2:
            return  # between a chunk's header and its payload


def bad_first_messages(model: dict[str, Any]) -> dict[str, tuple[str | bytes, set[tuple[Any, Any]]]]:
    """Invalid first messages and their documented replies: {name: (message, {(error code, close)})}."""
    bad = {("bad_request", 1008)}
    start = {"type": "session.start", "model": model["id"]}

    def with_(**fields: Any) -> str:
        return json.dumps({**start, **fields})

    cases: dict[str, tuple[str | bytes, set[tuple[Any, Any]]]] = {
        "invalid_json": ("{bad", bad),
        "nan_json": ('{"type": "session.start", "seed": NaN}', bad),
        "infinity_json": ('{"type": "session.start", "num_chunks": Infinity}', bad),
        "deep_nesting": ("[" * 200_000, bad),
        "not_an_object": ("[1, 2, 3]", bad),
        "unknown_type": ('{"type": "warp"}', bad),
        "huge_type": (json.dumps({"type": "x" * (6 * MIB)}), bad),
        "huge_model": (with_(model="m" * (6 * MIB)), {("unsupported", 1008)}),
        "over_frame_limit": ("x" * (9 * MIB), {(None, 1009)}),
        "num_chunks_zero": (with_(num_chunks=0), bad),
        "num_chunks_negative": (with_(num_chunks=-3), bad),
        "num_chunks_fraction": (with_(num_chunks=2.5), bad),
        "num_chunks_bool": (with_(num_chunks=True), bad),
        # No upper bound is documented: refusing it and serving it are both fine.
        "num_chunks_1e30": (with_(num_chunks=10**30), {("bad_request", 1008), ("started", 1000)}),
        "seed_out_of_range": (with_(seed=2**64), bad),
        "bad_base64_image": (with_(image="%%% not base64 %%%"), bad),
        "unknown_format": (with_(format="gif"), {("unsupported", 1008)}),
        "unknown_model": (with_(model="no-such-model"), {("unsupported", 1008)}),
        "binary_frame": (b"\x00\xff" * 64, {("bad_request", 1003)}),
    }
    return cases


async def bad_first(url: str, name: str, message: str | bytes, allowed: set[tuple[Any, Any]]) -> Outcome:
    """A connection whose first message is invalid: it must get its documented error and close."""
    ws = await open_ws(url)
    try:
        await ws.send(message)
        messages, close = await _replies_until_close(ws)
    except ConnectionClosed as e:  # closed while we were still sending (the frame limit)
        messages, close = [], e.rcvd.code if e.rcvd is not None else None
    errors = [m.get("code") for m in messages if m.get("type") == "error"]
    started = any(m.get("type") == "session.started" for m in messages)
    got = ("started" if started else (errors[0] if errors else None), close)
    return judge(f"bad_first:{name}", summarise_replies(messages, close), got, allowed)


async def _replies_until_close(ws: ClientConnection) -> tuple[list[dict], int | None]:
    """Replies until close; a session that was accepted after all is stopped at once."""
    messages: list[dict] = []
    try:
        while True:
            msg = await next_message(ws)
            if isinstance(msg, bytes):
                continue
            messages.append(msg)
            if msg.get("type") == "session.started":
                await ws.send(json.dumps({"type": "session.stop"}))
    except ConnectionClosed as e:
        return messages, e.rcvd.code if e.rcvd is not None else None
    except asyncio.TimeoutError:
        reset(ws)
        return messages, -1


def bad_session_messages(model: dict[str, Any]) -> dict[str, tuple[str, set[str | None]]]:
    """Invalid messages inside a running session: {name: (message, allowed error codes; None = no reply)}.
    Each must leave the session running."""
    bad: set[str | None] = {"bad_request"}
    dim = max(int(model.get("action_dim") or 0), 1)

    def action(actions: Any, **extra: Any) -> str:
        return json.dumps({"type": "action", "actions": actions, **extra})

    cases = {
        "invalid_json": ("{bad", bad),
        "nan_action": ('{"type": "action", "actions": [[' + ", ".join(["NaN"] * dim) + "]]}", bad),
        "nan_ping": ('{"type": "ping", "id": NaN}', bad),
        "infinity_prompt": ('{"type": "prompt", "prompt": Infinity}', bad),
        "unknown_type": ('{"type": "warp"}', bad),
        "huge_unknown_type": (json.dumps({"type": "y" * (4 * MIB)}), bad),
        "action_wrong_dim": (action([[0.5] * (dim + 1)]), bad),
        "action_empty": (action([]), bad),
        "action_not_a_list": (action("left"), bad),
        "action_nested_too_deep": (action([[[0.5] * dim]]), bad),
        "action_negative_frame": (action([[0.5] * dim], frame=-1), bad),
        "action_1e15": (action([[1e15] * dim]), {None, "bad_request"} if model.get("action_dim") else bad),
        "second_start": (json.dumps({"type": "session.start"}), bad),
        "ack_unsent_chunk": (json.dumps({"type": "ack", "chunk": 10**6}), bad),
        "ack_not_int": (json.dumps({"type": "ack", "chunk": "3"}), bad),
    }
    if model.get("takes_prompt"):
        # A valid but huge prompt: the server may take it or refuse it, not fail.
        cases["huge_prompt"] = (
            json.dumps({"type": "prompt", "prompt": "forest " * (MIB // 7)}),
            {None, "bad_request"},
        )
    else:
        cases["prompt_for_model_without_prompt"] = (json.dumps({"type": "prompt", "prompt": "x"}), bad)
    return cases


async def bad_in_session(
    url: str, model: dict[str, Any], names: list[str], seed: int, chunks: int
) -> list[Outcome]:
    """One session of `chunks` chunks that gets the invalid messages `names` interleaved with
    pings: each must get its documented reply, and the session must still complete."""
    table = bad_session_messages(model)
    ws = await open_ws(url)
    outcomes: list[Outcome] = []
    seen: list[int] = []
    try:
        await ws.send(json.dumps(start_message(model, chunks, seed, format="jpeg")))
        for i, name in enumerate(names):
            message, allowed = table[name]
            await ws.send(message)
            await ws.send(json.dumps({"type": "ping", "id": i}))
            codes = await _errors_until_pong(ws, i, seen)
            got = codes[0] if codes else None
            out = Outcome(f"bad_in_session:{name}", replies=[str(c) for c in codes])
            if got not in allowed or len(codes) > 1:
                out.verdict = "undocumented" if set(codes) <= CLIENT_ERRORS else "internal"
                out.detail = f"got {codes or 'no reply'}, documented {sorted(allowed, key=str)}"
            outcomes.append(out)
        outcomes.append(await _session_survived(ws, chunks, seen))
    except (ConnectionClosed, asyncio.TimeoutError, _SessionEnded) as e:
        code = getattr(getattr(e, "rcvd", None), "code", None)
        outcomes.append(
            Outcome("bad_in_session:survived", "internal", f"the session ended: {e!r} {code or ''}")
        )
    finally:
        reset(ws)
    return outcomes


class _SessionEnded(Exception):
    pass


async def _errors_until_pong(ws: ClientConnection, ping_id: int, seen: list[int]) -> list[str]:
    codes: list[str] = []
    while True:
        msg = await next_message(ws)
        if isinstance(msg, bytes):
            continue
        kind = msg.get("type")
        if kind == "pong" and msg.get("id") == ping_id:
            return codes
        if kind == "error":
            codes.append(str(msg.get("code")))
            if msg.get("code") == "overloaded":
                raise _SessionEnded("overloaded")
        elif kind == "chunk":
            seen.append(int(msg.get("index", -1)))
        elif kind == "session.done":
            raise _SessionEnded(f"session.done {msg.get('reason')} before the checks ended")


async def _session_survived(ws: ClientConnection, chunks: int, seen: list[int]) -> Outcome:
    out = Outcome("bad_in_session:survived")
    messages, close = await drain(ws)
    seen.extend(int(m.get("index", -1)) for m in messages if m.get("type") == "chunk")
    done = [m for m in messages if m.get("type") == "session.done"]
    reason = done[0].get("reason") if done else None
    if reason != "completed" or close != 1000 or seen != list(range(chunks)):
        out.verdict = "internal"
        out.detail = f"ended {reason} close {close}, chunks {seen[:12]} of {chunks}"
    out.replies = summarise_replies(messages, close)
    return out


async def binary_in_session(url: str, model: dict[str, Any], seed: int) -> Outcome:
    """A binary frame from the client during a session: error bad_request, then close 1003."""
    ws = await open_ws(url)
    try:
        await ws.send(json.dumps(start_message(model, None, seed, format="jpeg")))
        while (msg := await next_message(ws)) and not (
            isinstance(msg, dict) and msg.get("type") == "session.started"
        ):
            if isinstance(msg, dict) and msg.get("type") == "error":
                return Outcome("binary_in_session", detail=f"not started: {msg.get('code')}")
        await ws.send(b"\x01\x02\x03")
        messages, close = await drain(ws)
    except ConnectionClosed as e:
        messages, close = [], e.rcvd.code if e.rcvd is not None else None
    finally:
        reset(ws)
    errors = [m.get("code") for m in messages if m.get("type") == "error"]
    got = (errors[0] if errors else None, close)
    return judge("binary_in_session", summarise_replies(messages, close), got, {("bad_request", 1003)})


async def view(
    url: str,
    model: dict[str, Any],
    kind: str,
    num_chunks: int | None,
    seed: int,
    slow_factor: float = 0.0,
    stop: asyncio.Event | None = None,
) -> ViewRecord:
    """A well-behaved session: read every chunk (each `slow_factor` times its play time late, if
    given), and `session.stop` once `stop` is set (for sessions without a length)."""
    rec = ViewRecord(kind, planned=num_chunks)
    try:
        ws = await open_ws(url)
    except (OSError, asyncio.TimeoutError) as e:
        rec.end, rec.errors = "connect_failed", [repr(e)]
        return rec
    stopper = asyncio.create_task(_stop_when(ws, stop)) if stop is not None else None
    try:
        await ws.send(json.dumps(start_message(model, num_chunks, seed, format="jpeg")))
        await _read_view(ws, rec, slow_factor)
    except ConnectionClosed as e:
        rec.close_code = e.rcvd.code if e.rcvd is not None else None
    except asyncio.TimeoutError:
        rec.errors.append(f"no message in {REPLY_TIMEOUT_S:.0f} s")
        reset(ws)
    finally:
        if stopper is not None:
            stopper.cancel()
    return rec


async def _stop_when(ws: ClientConnection, stop: asyncio.Event) -> None:
    await stop.wait()
    with contextlib.suppress(ConnectionClosed):
        await ws.send(json.dumps({"type": "session.stop"}))


async def _read_view(ws: ClientConnection, rec: ViewRecord, slow_factor: float) -> None:
    fps, frames = 0.0, 0
    while True:
        msg = await next_message(ws)
        if isinstance(msg, bytes):
            rec.arrivals.append(time.monotonic())
            if slow_factor and fps:
                await asyncio.sleep(slow_factor * frames / fps)
            continue
        kind = msg.get("type")
        if kind == "session.started":
            fps = float(msg.get("fps") or 0)
        elif kind == "chunk":
            rec.chunks.append(int(msg.get("index", -1)))
            frames = int(msg.get("num_frames") or 0)
        elif kind == "error":
            rec.errors.append(f"{msg.get('code')}: {str(msg.get('message'))[:200]}")
        elif kind == "session.done":
            rec.end = str(msg.get("reason"))
