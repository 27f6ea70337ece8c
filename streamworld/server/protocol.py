"""The wire protocol (docs/protocol.md, version 1) in one place: close codes, parsing and
validating client messages, and building server messages.

Every problem with a client message becomes a `ProtocolError` with a protocol error code
(`bad_request`, `unsupported`) and a message a person can act on.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

# MAX_NUM_CHUNKS: chunks one session may ask for (about 9 hours at 16 fps and 12 frames a
# chunk); null asks for an open-ended stream. The engine holds the same bound.
from ..engine import ACTION_POLICIES, MAX_NUM_CHUNKS, PRIORITY_CLASSES, BranchRequest, ChunkOutput
from ..media import FORMATS
from ..models.config import ModelConfig, widened_action_range

PRIORITIES = tuple(PRIORITY_CLASSES)
# First-frame images: what one decode may cost. The base64 text is at most 8 MiB (a file of
# at most 6 MiB); each side at most 4096 pixels and the longer at most 8 times the shorter,
# checked in the header before any pixel is decoded; at most 8 Mi pixels decoded (a JPEG is
# decoded at a reduced size when that is enough for the model, a progressive JPEG is held
# at full size) with 8-bit samples (16-bit greyscale is refused; 16-bit colour PNGs are read
# as 8 bits). Pixel buffers then stay under 4 bytes decoded + 3 bytes RGB per pixel: the
# whole decode costs at most MAX_IMAGE_DECODE_BYTES.
MAX_IMAGE_BASE64_CHARS = 8 * 2**20
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_ASPECT = 8
MAX_IMAGE_PIXELS = 2**23
MAX_IMAGE_DECODE_BYTES = 64 * 2**20
# zTXt, iTXt and iCCP chunks each inflate to up to 1 MiB in Pillow.
MAX_PNG_COMPRESSED_METADATA = 8
_IMAGE_MODES = ("1", "L", "P", "LA", "PA", "RGB", "RGBA")
# Decodes one server should run at once (the session holds a semaphore of this size):
# together they cost at most this many times MAX_IMAGE_DECODE_BYTES.
MAX_CONCURRENT_IMAGE_DECODES = 2
# Client messages longer than this are parsed off the event loop, at most
# MAX_CONCURRENT_LARGE_PARSES at once per server: JSON of many small values costs about
# 0.4 s and 20 MiB of Python objects per MiB of text, which on the loop would stall every
# session's sends. Shorter ones (every action, ping, ack) parse on the loop in under 10 ms.
LARGE_MESSAGE_CHARS = 16 * 1024
MAX_CONCURRENT_LARGE_PARSES = 2
# Longest `type` accepted; every known type is far shorter, and unknown ones are echoed.
MAX_TYPE_CHARS = 64
# Client text quoted in an error message is cut to this many characters.
MAX_ECHO_CHARS = 64
# A ping `id` is echoed: a string of at most this many characters, or another JSON value
# whose JSON text is at most this long.
MAX_PING_ID_CHARS = 128
# Longest prompt, in bytes of UTF-8: room for 4096 characters of any script, while the text
# encoder reads at most 512 tokens (about 2,000 English characters) of it anyway.
MAX_PROMPT_BYTES = 16 * 1024

CLOSE_OK = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN = 1013
# A close frame carries at most 123 bytes of reason.
MAX_CLOSE_REASON = 120


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, reply_to: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # The `id` of the request this error answers (a refused `session.fork`), if any.
        self.reply_to = reply_to

    def to_message(self) -> dict[str, Any]:
        message = {"type": "error", "code": self.code, "message": self.message}
        return message if self.reply_to is None else {**message, "id": self.reply_to}


@dataclass
class SessionStart:
    model: str
    prompt: str
    image: np.ndarray | None
    seed: int
    num_chunks: int | None
    format: str
    priority: str
    action_policy: str
    kv_mode: str


@dataclass
class ActionMessage:
    actions: np.ndarray  # [N, action_dim] float32
    frame: int | None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not standard JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {_excerpt(text)} is too large")
    return value


def _excerpt(text: str) -> str:
    """Client text to quote in a message: repr, cut to MAX_ECHO_CHARS characters."""
    if len(text) > MAX_ECHO_CHARS:
        return repr(text[:MAX_ECHO_CHARS]) + f" (cut from {len(text)} characters)"
    return repr(text)


def excerpt_number(n: int) -> str:
    """A client integer to quote in a message, cut as `_excerpt` cuts text."""
    text = str(n)
    if len(text) > MAX_ECHO_CHARS:
        return f"{text[:MAX_ECHO_CHARS]}... (cut from {len(text)} digits)"
    return text


def parse_json(text: str) -> dict[str, Any]:
    """A client text message; standard JSON only (no NaN, Infinity or numbers that overflow)."""
    try:
        msg = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and integers too long to parse
        raise ProtocolError("bad_request", f"message is not valid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_request", "a message must be a JSON object with a 'type' field")
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("bad_request", "a message needs a string 'type' field")
    if len(kind) > MAX_TYPE_CHARS:
        raise ProtocolError(
            "bad_request", f"unknown message type {_excerpt(kind)}: at most {MAX_TYPE_CHARS} characters"
        )
    return msg


def _field(msg: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = msg.get(name, default)
    if value is None:
        return default
    # JSON true/false are Python bools, which are ints too: never accept them as numbers.
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError("bad_request", f"'{name}' must be {what}, got {json.dumps(value)}")
    if not isinstance(value, kinds):
        raise ProtocolError("bad_request", f"'{name}' must be {what}, got {type(value).__name__}")
    return value


def _choice(msg: dict, name: str, choices: tuple[str, ...], default: str, code: str = "bad_request") -> str:
    value = _field(msg, name, (str,), "a string", default)
    if value not in choices:
        raise ProtocolError(code, f"'{name}' must be one of {', '.join(choices)}; got {_excerpt(value)}")
    return value


def parse_session_start(
    msg: dict[str, Any], models: dict[str, ModelConfig], default_model: str
) -> SessionStart:
    if msg["type"] != "session.start":
        raise ProtocolError(
            "bad_request", f"the first message must be 'session.start', got {_excerpt(msg['type'])}"
        )
    model_id = _field(msg, "model", (str,), "a string", default_model)
    if model_id not in models:
        raise ProtocolError(
            "unsupported", f"model {_excerpt(model_id)} is not served; served: {', '.join(models)}"
        )
    cfg = models[model_id]
    prompt = _checked_prompt(_field(msg, "prompt", (str,), "a string", ""))
    if prompt and not cfg.takes_prompt:
        raise ProtocolError("bad_request", f"model {model_id} takes no prompt")
    seed = _field(msg, "seed", (int,), "an integer", None)
    if seed is None:
        seed = secrets.randbelow(2**31)
    elif not 0 <= seed < 2**63:
        raise ProtocolError("bad_request", "'seed' must be between 0 and 2**63 - 1")
    num_chunks = _field(msg, "num_chunks", (int,), "an integer or null", None)
    if num_chunks is not None and not 1 <= num_chunks <= MAX_NUM_CHUNKS:
        raise ProtocolError(
            "bad_request", "'num_chunks' must be from 1 to 10**6 (or null for an open-ended stream)"
        )
    fmt = _choice(msg, "format", FORMATS, "jpeg", code="unsupported")
    priority = _choice(msg, "priority", PRIORITIES, "standard")
    policy = _choice(msg, "action_policy", ACTION_POLICIES, "hold")
    kv_mode = _choice(msg, "kv_mode", tuple(cfg.kv_modes), cfg.default_kv_mode, code="unsupported")
    image = None
    image_field = _field(msg, "image", (str,), "a base64 PNG or JPEG string", None)
    if image_field is not None:
        if not cfg.needs_image:
            raise ProtocolError("bad_request", f"model {model_id} takes no image")
        image = decode_image(image_field, cfg.width, cfg.height)
    return SessionStart(model_id, prompt, image, seed, num_chunks, fmt, priority, policy, kv_mode)


def decode_image(data: str, width: int, height: int) -> np.ndarray:
    """base64 PNG/JPEG (optionally a data: URL) -> uint8 [height, width, 3], resized if needed.

    Bounded before decoding (see MAX_IMAGE_DECODE_BYTES); every refusal is a bad_request.
    """
    from PIL import Image, UnidentifiedImageError

    if data.startswith("data:"):
        data = data.partition(",")[2]
    if len(data) > MAX_IMAGE_BASE64_CHARS:
        raise ProtocolError("bad_request", "'image' is longer than 8 MiB of base64 (a file of at most 6 MiB)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("bad_request", "'image' is not valid base64") from None
    if raw.startswith(PNG_SIGNATURE):
        _check_png_metadata(raw)
    try:
        with Image.open(io.BytesIO(raw), formats=("PNG", "JPEG")) as img:
            _check_image_header(img, width, height)
            img.load()
            rgb = img.convert("RGB") if img.mode != "RGB" else img
            if rgb.size != (width, height):
                rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
            return np.asarray(rgb, dtype=np.uint8).copy()
    except ProtocolError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        # Pillow raises ValueError too: a truncated header chunk, a metadata chunk that
        # inflates past its limit.
        raise ProtocolError("bad_request", "'image' is not a readable PNG or JPEG") from None


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png_metadata(raw: bytes) -> None:
    """Refuses a PNG with more compressed metadata chunks than MAX_PNG_COMPRESSED_METADATA."""
    pos, compressed = len(PNG_SIGNATURE), 0
    while pos + 8 <= len(raw):
        length = int.from_bytes(raw[pos : pos + 4], "big")
        kind = raw[pos + 4 : pos + 8]
        if kind in (b"zTXt", b"iTXt", b"iCCP"):
            compressed += 1
            if compressed > MAX_PNG_COMPRESSED_METADATA:
                raise ProtocolError(
                    "bad_request",
                    f"'image' has more than {MAX_PNG_COMPRESSED_METADATA} compressed metadata chunks",
                )
        if kind == b"IEND":
            return
        pos += 12 + length


def _check_image_header(img: Any, width: int, height: int) -> None:
    """Size, aspect ratio and sample type from the header; selects a reduced JPEG decode."""
    w, h = img.size
    if not (1 <= w <= MAX_IMAGE_SIDE and 1 <= h <= MAX_IMAGE_SIDE) or max(w, h) > MAX_IMAGE_ASPECT * min(
        w, h
    ):
        raise ProtocolError(
            "bad_request",
            f"'image' is {w}x{h}; each side must be at most {MAX_IMAGE_SIDE} pixels "
            f"and the longer at most {MAX_IMAGE_ASPECT} times the shorter",
        )
    if img.mode not in _IMAGE_MODES:
        hint = "16-bit or float samples" if img.mode.startswith(("I", "F")) else f"mode {img.mode}"
        raise ProtocolError("bad_request", f"'image' has {hint}; send an 8-bit RGB or greyscale image")
    pixels = w * h
    if img.format == "JPEG":
        # libjpeg decodes at 1/2, 1/4 or 1/8 scale; a progressive JPEG still holds all its
        # coefficients, so only a baseline one gets cheaper.
        img.draft("RGB", (width, height))
        if not img.info.get("progressive"):
            pixels = img.size[0] * img.size[1]
    if pixels > MAX_IMAGE_PIXELS:
        raise ProtocolError(
            "bad_request",
            f"'image' is {w}x{h}; at most {MAX_IMAGE_PIXELS} pixels (e.g. 4096x2048) are decoded",
        )


MAX_ACTIONS_PER_MESSAGE = 4096


def parse_action(
    msg: dict[str, Any], action_dim: int, action_range: tuple[float, float] | None = None
) -> ActionMessage:
    """An `action` message; with the model's `action_range`, values outside its widened range
    (`ModelConfig.accepted_action_range`) are refused."""
    if action_dim == 0:
        raise ProtocolError("bad_request", "this model takes no actions")
    actions = msg.get("actions")
    if not isinstance(actions, list) or not actions:
        raise ProtocolError("bad_request", "'actions' must be a non-empty list of action vectors")
    if len(actions) > MAX_ACTIONS_PER_MESSAGE:
        raise ProtocolError("bad_request", f"at most {MAX_ACTIONS_PER_MESSAGE} action vectors per message")
    for i, row in enumerate(actions):
        if not isinstance(row, list) or len(row) != action_dim:
            raise ProtocolError("bad_request", f"actions[{i}] must be a list of {action_dim} numbers")
        if any(isinstance(x, bool) or not isinstance(x, int | float) for x in row):
            raise ProtocolError("bad_request", f"actions[{i}] must hold numbers, got {row!r}"[:200])
    try:
        arr = np.asarray(actions, dtype=np.float64)
    except (OverflowError, ValueError):
        raise ProtocolError("bad_request", "actions must hold finite numbers") from None
    if not np.isfinite(arr).all() or np.abs(arr).max() > 3.0e38:
        raise ProtocolError("bad_request", "actions must hold finite numbers")
    if action_range is not None:
        low, high = widened_action_range(action_range)
        if arr.min() < low or arr.max() > high:
            raise ProtocolError("bad_request", f"action values must be in [{low:g}, {high:g}] for this model")
    frame = _field(msg, "frame", (int,), "an integer", None)
    if frame is not None and not 0 <= frame < 2**53:
        raise ProtocolError("bad_request", "'frame' must be >= 0")
    return ActionMessage(arr.astype(np.float32), frame)


def parse_prompt(msg: dict[str, Any], takes_prompt: bool) -> str:
    if not takes_prompt:
        raise ProtocolError("bad_request", "this model takes no prompt")
    prompt = msg.get("prompt")
    if not isinstance(prompt, str):
        raise ProtocolError("bad_request", "'prompt' must be a string")
    return _checked_prompt(prompt)


def _checked_prompt(prompt: str) -> str:
    # Cheap length test first: a character is at least one byte of UTF-8.
    if len(prompt) > MAX_PROMPT_BYTES:
        raise ProtocolError("bad_request", f"'prompt' is longer than {MAX_PROMPT_BYTES} bytes of UTF-8")
    try:
        size = len(prompt.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate, e.g. from the JSON escape "\ud800"
        raise ProtocolError(
            "bad_request", "'prompt' is not valid Unicode text (it cannot be UTF-8)"
        ) from None
    if size > MAX_PROMPT_BYTES:
        raise ProtocolError("bad_request", f"'prompt' is longer than {MAX_PROMPT_BYTES} bytes of UTF-8")
    return prompt


def parse_ack(msg: dict[str, Any], chunks_sent: int) -> int:
    """The chunk index of an `ack` (the client has consumed every chunk up to it)."""
    chunk = msg.get("chunk")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        raise ProtocolError("bad_request", "'chunk' must be a chunk index (an integer >= 0)")
    if chunk >= chunks_sent:
        raise ProtocolError(
            "bad_request", f"ack for chunk {excerpt_number(chunk)}, but {chunks_sent} chunks have been sent"
        )
    return chunk


# Forks (`session.fork`, an extension): branches one fork may ask for, chunks one branch may
# ask for, and branches one session may have running at once. Together with the pause of a
# branch whose sent chunks back up (`pause_chunks`), they bound what a fork can hold.
MAX_FORK_BRANCHES = 16
MAX_BRANCH_CHUNKS = 64
MAX_SESSION_BRANCHES = 32
# Payload formats a branch may use: each chunk is encoded on its own (no codec state).
BRANCH_FORMATS = ("jpeg", "rgb")


@dataclass
class ForkMessage:
    branches: list[BranchRequest]
    format: str


def parse_fork(msg: dict[str, Any], cfg: ModelConfig, session_format: str) -> ForkMessage:
    """A `session.fork` message (docs/protocol.md), but its `id` (`echo_id`)."""
    branches = msg.get("branches")
    if not isinstance(branches, list) or not 1 <= len(branches) <= MAX_FORK_BRANCHES:
        raise ProtocolError("bad_request", f"'branches' must be a list of 1 to {MAX_FORK_BRANCHES} branches")
    default = session_format if session_format in BRANCH_FORMATS else "jpeg"
    fmt = _choice(msg, "format", BRANCH_FORMATS, default, code="unsupported")
    out = []
    for i, b in enumerate(branches):
        if not isinstance(b, dict):
            raise ProtocolError("bad_request", f"branches[{i}] must be an object")
        num_chunks = b.get("num_chunks")
        if not isinstance(num_chunks, int) or isinstance(num_chunks, bool):
            raise ProtocolError("bad_request", f"branches[{i}].num_chunks must be an integer")
        if not 1 <= num_chunks <= MAX_BRANCH_CHUNKS:
            raise ProtocolError(
                "bad_request", f"branches[{i}].num_chunks must be from 1 to {MAX_BRANCH_CHUNKS}"
            )
        actions = None
        if b.get("actions") is not None:
            try:
                actions = parse_action(b, cfg.action_dim, cfg.action_range).actions
            except ProtocolError as e:
                raise ProtocolError(e.code, f"branches[{i}]: {e.message}") from None
        try:
            seed = _field(b, "seed", (int,), "an integer", None)
            paced = _field(b, "paced", (bool,), "true or false", False)
        except ProtocolError as e:
            raise ProtocolError(e.code, f"branches[{i}]: {e.message}") from None
        if seed is not None and not 0 <= seed < 2**63:
            raise ProtocolError("bad_request", f"branches[{i}].seed must be between 0 and 2**63 - 1")
        out.append(BranchRequest(num_chunks, actions, seed, None, paced))
    return ForkMessage(out, fmt)


def parse_branch_cancel(msg: dict[str, Any]) -> int:
    branch = msg.get("branch")
    if not isinstance(branch, int) or isinstance(branch, bool) or branch < 1:
        raise ProtocolError("bad_request", "'branch' must be a branch number (an integer >= 1)")
    return branch


def echo_id(msg: dict[str, Any], name: str = "id") -> Any:
    """A client value the server echoes (`ping`'s and `session.fork`'s `id`), bounded."""
    value = msg.get(name)
    try:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    except RecursionError:  # nested deeper than json.dumps goes; no id of 128 characters is
        text = None
    if text is None or len(text) > MAX_PING_ID_CHARS:
        raise ProtocolError(
            "bad_request",
            f"'{name}' must be a string of at most {MAX_PING_ID_CHARS} characters "
            f"or a JSON value at most {MAX_PING_ID_CHARS} characters long",
        )
    return value


# --- server messages ------------------------------------------------------------------------


def close_reason(text: str) -> bytes:
    """A close frame's reason: UTF-8, cut on a character boundary to fit the frame."""
    return text.encode()[:MAX_CLOSE_REASON].decode(errors="ignore").encode()


def error(code: str, message: str) -> dict[str, str]:
    return ProtocolError(code, message).to_message()


def pong(ping: dict[str, Any]) -> dict[str, Any]:
    """The reply to a ping; ProtocolError when its `id` is too long to echo."""
    return {"type": "pong", "id": echo_id(ping, "id")}


def session_queued(position: int) -> dict[str, Any]:
    return {"type": "session.queued", "position": position}


def session_started(
    session_id: str,
    cfg: ModelConfig,
    start: SessionStart,
    codec: str,
    scene: dict | None,
    replica: int | None = None,
    instance: str | None = None,
) -> dict[str, Any]:
    """`replica` only for a model served by several replicas (which one runs the session);
    `instance` only where several servers share one address (which one holds the session)."""
    return {
        "type": "session.started",
        "session_id": session_id,
        "model": cfg.id,
        "width": cfg.width,
        "height": cfg.height,
        "fps": cfg.fps,
        "format": start.format,
        "codec": codec,
        "kv_mode": start.kv_mode,
        "frames_per_chunk": cfg.frames_per_chunk,
        "first_chunk_frames": cfg.first_chunk_frames,
        "seed": start.seed,
        "action_dim": cfg.action_dim,
        **({"scene": scene} if scene is not None else {}),
        **({"replica": replica} if replica is not None else {}),
        **({"instance": instance} if instance is not None else {}),
    }


def chunk_header(chunk: ChunkOutput, payload: bytes, sizes: list[int] | None, encode_ms: float) -> dict:
    """The `chunk` message that precedes a payload; `total` includes the encoding."""
    timings = dict(chunk.timings, encode=encode_ms, total=chunk.timings["total"] + encode_ms)
    header = {
        "type": "chunk",
        "index": chunk.index,
        "first_frame": chunk.first_frame,
        "num_frames": int(chunk.frames.shape[0]),
        "bytes": len(payload),
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }
    if sizes is not None:
        header["sizes"] = sizes
    return header


def session_forked(fork_id: Any, branches: list[int]) -> dict[str, Any]:
    return {"type": "session.forked", "id": fork_id, "branches": branches}


def branch_done(branch: int, reason: str, chunks: int, message: str | None = None) -> dict[str, Any]:
    done = {"type": "branch.done", "branch": branch, "reason": reason, "chunks": chunks}
    return done if message is None else {**done, "message": message}


def session_done(reason: str, chunks: int) -> dict[str, Any]:
    return {"type": "session.done", "reason": reason, "chunks": chunks}
