"""Every client input has a bound on what it can cost, and a documented reply past it
(PROTOCOL.md, bad input and limits): JSON numbers, echoed strings, chunk counts, actions,
prompts and first-frame images."""

from __future__ import annotations

import base64
import io
import json
import struct
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest
import websockets
from PIL import Image

from streamworld.engine.request import validate
from streamworld.models.text_encoder import TextEncoder
from streamworld.models.world_model import WorldModel
from streamworld.server import protocol
from streamworld.server.protocol import ProtocolError
from tests.conftest import load_tiny, tiny_config
from tests.test_server import FAST, raw_session, start_server

MODELS = {"tiny-wan": tiny_config(), "tiny-act": tiny_config(id="tiny-act", action_dim=2)}


def refusal(fn, *args) -> str:
    """The message of the bad_request that `fn(*args)` raises."""
    with pytest.raises(ProtocolError) as e:
        fn(*args)
    assert e.value.code == "bad_request"
    return e.value.message


@pytest.fixture(scope="module")
def models(tiny_model):
    act = load_tiny(action_dim=2)
    object.__setattr__(act.config, "id", "tiny-act")
    return {"tiny-wan": tiny_model, "tiny-act": act}


@pytest.fixture
async def url(models):
    _, running = await start_server(models, FAST)
    yield f"ws://127.0.0.1:{running.port}/v1/stream"
    await running.close()


async def session_replies(url: str, *messages) -> list[dict]:
    """Starts a one-chunk tiny-act session, sends `messages`, returns every text reply."""
    start = {"type": "session.start", "model": "tiny-act", "num_chunks": 1, "seed": 1}
    replies, code = await raw_session(url, start, *messages)
    assert code == 1000 and replies[-1] == {"type": "session.done", "reason": "completed", "chunks": 1}
    return replies


# --- standard JSON ----------------------------------------------------------------------------
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
def test_non_standard_json_numbers_are_refused(literal):
    message = refusal(protocol.parse_json, f'{{"type": "ping", "id": {literal}}}')
    assert "JSON" in message


async def test_a_ping_with_nan_gets_bad_request_and_never_a_nan_pong(url):
    replies = await session_replies(url, '{"type": "ping", "id": NaN}', {"type": "ping", "id": 2})
    assert replies[1]["type"] == "error" and replies[1]["code"] == "bad_request"
    assert {"type": "pong", "id": 2} in replies
    assert not any(r["type"] == "pong" and r["id"] != 2 for r in replies)


async def test_a_large_message_is_parsed_off_the_event_loop(url, monkeypatch):
    """Small messages parse on the loop's thread; one over LARGE_MESSAGE_CHARS in a thread
    of its own, and is answered as any other."""
    threads = {}
    parse = protocol.parse_json

    def recording(text):
        threads[len(text) > protocol.LARGE_MESSAGE_CHARS] = threading.get_ident()
        return parse(text)

    monkeypatch.setattr(protocol, "parse_json", recording)
    big = {"type": "ping", "id": 3, "pad": [0] * protocol.LARGE_MESSAGE_CHARS}
    replies = await session_replies(url, big, {"type": "ping", "id": 4})
    assert {"type": "pong", "id": 3} in replies and {"type": "pong", "id": 4} in replies
    assert threads[False] == threading.get_ident() != threads[True]


# --- echoed client strings --------------------------------------------------------------------
@pytest.mark.parametrize("ping_id", [None, 7, -2.5, True, "x" * 128, [1, "a"], {"k": 1}])
def test_a_short_ping_id_is_echoed(ping_id):
    assert protocol.pong({"type": "ping", "id": ping_id}) == {"type": "pong", "id": ping_id}


@pytest.mark.parametrize("ping_id", ["x" * 129, 10**200, ["y" * 200], {"k": "z" * 200}])
def test_a_long_ping_id_is_refused_not_echoed(ping_id):
    message = refusal(protocol.pong, {"type": "ping", "id": ping_id})
    assert "128" in message and len(message) < 200


def test_a_ping_id_nested_deeper_than_json_writes_is_refused():
    nested: list = []
    for _ in range(100_000):  # what parse_json could hand on where the stack is shallower
        nested = [nested]
    message = refusal(protocol.pong, {"type": "ping", "id": nested})
    assert "128" in message and len(message) < 200


def test_integers_quoted_back_are_cut_short():
    message = refusal(protocol.parse_ack, {"type": "ack", "chunk": 10**4000}, 3)
    assert "cut from 4001 digits" in message and len(message) < 200
    assert protocol.excerpt_number(12) == "12"


async def test_an_unknown_type_is_echoed_cut_short(url):
    replies = await session_replies(url, {"type": "w" * 100_000}, {"type": "ping", "id": "x" * 10_000})
    errors = [r for r in replies if r["type"] == "error"]
    assert len(errors) == 2 and all(e["code"] == "bad_request" for e in errors)
    assert all(len(e["message"]) < 300 for e in errors), [len(e["message"]) for e in errors]
    assert not any(r["type"] == "pong" for r in replies)


@pytest.mark.parametrize(
    "start",
    [
        {"type": "session.start", "model": "m" * 100_000},
        {"type": "session.start", "format": "f" * 100_000},
        {"type": "session.start", "priority": "p" * 100_000},
        {"type": "session.start", "action_policy": "a" * 100_000},
        {"type": "session.start", "kv_mode": "k" * 100_000},
        {"type": "s" * 100_000},
    ],
)
def test_errors_about_a_start_echo_at_most_a_short_excerpt(start):
    with pytest.raises(ProtocolError) as e:
        protocol.parse_session_start(protocol.parse_json(json.dumps(start)), MODELS, "tiny-wan")
    assert len(e.value.message) < 300


async def test_a_long_non_ascii_model_id_closes_1008_with_a_reason_that_fits(url):
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.start", "model": "é" * 200}))
        reply = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
    assert reply["code"] == "unsupported"
    assert ws.close_code == 1008
    assert len(ws.close_reason.encode()) <= 123
    assert len(protocol.close_reason(reply["message"])) <= 123


# --- chunk count ------------------------------------------------------------------------------
@pytest.mark.parametrize("num_chunks", [10**6 + 1, 10**30])
def test_num_chunks_has_an_upper_bound(num_chunks):
    msg = {"type": "session.start", "num_chunks": num_chunks}
    assert "10**6" in refusal(protocol.parse_session_start, msg, MODELS, "tiny-wan")
    with pytest.raises(ValueError, match="num_chunks"):
        validate(MODELS["tiny-wan"], num_chunks=num_chunks, image=None, actions=None, kv_mode=None)


def test_num_chunks_up_to_the_bound_or_null_is_accepted():
    for n in (1, 10**6, None):
        start = protocol.parse_session_start({"type": "session.start", "num_chunks": n}, MODELS, "tiny-wan")
        assert start.num_chunks == n
        validate(MODELS["tiny-wan"], num_chunks=n, image=None, actions=None, kv_mode=None)


# --- action values ----------------------------------------------------------------------------
def action_message(*values: float) -> dict:
    return {"type": "action", "actions": [[v, 0.0] for v in values]}


@pytest.mark.parametrize("value", [1e15, -1e15, 5.0000001, -5.5, 1e38])
def test_an_action_far_outside_the_models_range_is_refused(value):
    cfg = MODELS["tiny-act"]  # action_range (-1, 1): values in [-5, 5] are accepted
    message = refusal(protocol.parse_action, action_message(0.5, value), cfg.action_dim, cfg.action_range)
    assert "[-5, 5]" in message
    with pytest.raises(ValueError, match="range"):
        validate(cfg, num_chunks=1, image=None, actions=np.array([[value, 0.0]]), kv_mode=None)


async def test_a_huge_action_on_the_wire_is_a_bad_request_and_the_session_completes(url):
    """1e15 passed the parser before and made the model's output non-finite: the session
    ended with `internal` and 1011. Now it is refused and the session goes on."""
    replies = await session_replies(
        url, {"type": "action", "actions": [[1e15, 0.0]]}, {"type": "action", "actions": [[0.5, 0.5]]}
    )
    errors = [r for r in replies if r["type"] == "error"]
    assert [e["code"] for e in errors] == ["bad_request"]
    assert "range" in errors[0]["message"]


def test_the_engine_refuses_huge_actions_pushed_through_its_python_api(models):
    from streamworld.engine.stream import ActionTrack, Stream, StreamRequest

    config = models["tiny-act"].config
    stream = Stream(1, StreamRequest(seed=0), config, "clean", 1, 0.0, 1.0, 1.0, ActionTrack(2), None)
    with pytest.raises(ValueError, match="range"):
        stream.push_actions(np.array([[1e15, 0.0]]), None, 4096)
    stream.push_actions(np.array([[0.5, 0.5]]), None, 4096)
    assert stream.actions.known == 1


def test_actions_within_the_margin_around_the_range_are_accepted():
    cfg = MODELS["tiny-act"]
    values = (-5.0, -1.0, 0.0, 1.0, 4.9, 5.0)
    parsed = protocol.parse_action(action_message(*values), cfg.action_dim, cfg.action_range)
    assert parsed.actions[:, 0].tolist() == pytest.approx(values)
    validate(cfg, num_chunks=1, image=None, actions=parsed.actions, kv_mode=None)


def test_the_accepted_range_is_the_model_range_widened_by_twice_its_width_on_each_side():
    assert tiny_config(action_range=(0.0, 512.0)).accepted_action_range == (-1024.0, 1536.0)
    assert tiny_config().accepted_action_range == (-5.0, 5.0)


# --- prompts ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt",
    ["a" * 16_385, "é" * 8_193, "\U0001f600" * 4_097, "x" * 7_500_000],
    ids=["ascii", "2-byte", "4-byte", "7.5MB"],
)
def test_a_prompt_over_16_kib_of_utf8_is_refused(prompt):
    for parse, msg in (
        (protocol.parse_session_start, ({"type": "session.start", "prompt": prompt}, MODELS, "tiny-wan")),
        (protocol.parse_prompt, ({"type": "prompt", "prompt": prompt}, True)),
    ):
        message = refusal(parse, *msg)
        assert "16384 bytes" in message and len(message) < 200


@pytest.mark.parametrize(
    "prompt",
    ["a" * 16_384, "é" * 8_192, "\U0001f600" * 4_096, ""],
    ids=["ascii", "2-byte", "4-byte", "empty"],
)
def test_a_prompt_up_to_16_kib_is_accepted(prompt):
    assert protocol.parse_prompt({"type": "prompt", "prompt": prompt}, True) == prompt
    start = protocol.parse_session_start({"type": "session.start", "prompt": prompt}, MODELS, "tiny-wan")
    assert start.prompt == prompt


def test_a_prompt_that_is_not_unicode_text_is_refused():
    msg = protocol.parse_json('{"type": "prompt", "prompt": "a \\ud800 lone surrogate"}')
    assert "UTF-8" in refusal(protocol.parse_prompt, msg, True)


def test_the_text_encoder_cache_is_bounded_by_bytes(tiny_model):
    enc = tiny_model.text_encoder
    entry = enc.text_len * enc.text_dim * 4  # float32 embedding of one prompt
    bounded = TextEncoder(enc.model, enc.tokenizer, text_len=enc.text_len, cache_bytes=3 * entry + 300_000)
    for i in range(8):  # distinct prompts of 100 KB each: through the Python API, no wire cap
        bounded.encode(f"{i} " + "x" * 100_000)
    info = bounded.cache_info()
    assert info.currsize == 2 and info.currbytes <= info.maxbytes == 3 * entry + 300_000
    bounded.encode("7 " + "x" * 100_000)
    assert bounded.cache_info().hits == 1  # the newest stays cached
    bounded.encode("x" * 1_000_000)  # larger than the whole budget: encoded, not cached
    assert bounded.cache_info().currbytes <= 3 * entry + 300_000


def test_the_text_context_cache_is_bounded_by_bytes(tiny_model):
    m = tiny_model
    one = m.text_context("measure")
    entry = sum(t.nbytes for t in (*one.keys, *one.values))
    budget = 2 * entry + 1000
    model = WorldModel(m.config, m.dit, m.vae, m.text_encoder, m.device, m.dtype, text_cache_bytes=budget)
    for i in range(6):  # each entry with its key is about 1.5 entries
        model.text_context(f"{i} " + "y" * (entry // 2))
    entries, nbytes = model.text_cache_usage()
    assert entries == 1 and nbytes <= budget
    for i in range(6):
        model.text_context(f"short {i}")
    entries, nbytes = model.text_cache_usage()
    assert entries == 2 and nbytes <= budget


# --- first-frame images -----------------------------------------------------------------------
def png(width: int, height: int, color_type: int, bit_depth: int) -> bytes:
    """A valid all-zero PNG of any size, built without holding its pixels."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    row = b"\0" * (1 + width * channels * bit_depth // 8)  # filter byte + samples
    z = zlib.compressobj(1)
    rows_per_piece = max(1, 2**20 // len(row))
    data = []
    for start in range(0, height, rows_per_piece):
        data.append(z.compress(row * min(rows_per_piece, height - start)))
    data.append(z.flush())

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(data)) + chunk(b"IEND", b"")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


MEASURE = """
import json, resource, sys
from streamworld.server.protocol import ProtocolError, decode_image
names = sys.argv[1:]
inputs = [open(n).read() for n in names]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for name, data in zip(names, inputs):
    try:
        out = decode_image(data, 64, 64)
        result = list(out.shape)
        del out
    except ProtocolError as e:
        result = e.message
    now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps([name, result, (now - peak) * 1024]))
    peak = max(peak, now)
"""


def test_image_memory_is_bounded_refusing_by_header_before_decoding(tmp_path):
    """Peak memory (maxrss of a fresh process) of each decode: the refused inputs cost
    next to nothing, the largest accepted ones stay under the documented 64 MiB."""
    big = Image.new("RGB", (4096, 2048))
    progressive = io.BytesIO()
    big.save(progressive, "JPEG", progressive=True, subsampling=0, quality=95)
    baseline = io.BytesIO()
    Image.new("RGB", (4096, 4096)).save(baseline, "JPEG", quality=95)
    cases = {  # refused first: maxrss only grows
        "grey-1x16777216": (png(1, 16_777_216, 0, 8), "4096"),
        "rgba16-16777216x1": (png(16_777_216, 1, 6, 16), "4096"),
        "rgba16-4096x4096": (png(4096, 4096, 6, 16), "pixels"),
        "grey16-1024x1024": (png(1024, 1024, 0, 16), "16-bit"),
        "rgb-4096x256": (png(4096, 256, 2, 8), "8 times"),
        "rgba8-4096x2048": (png(4096, 2048, 6, 8), None),
        "rgb16-4096x2048": (png(4096, 2048, 2, 16), None),
        "jpeg-baseline-4096x4096": (baseline.getvalue(), None),
        "jpeg-progressive-4096x2048": (progressive.getvalue(), None),
    }
    for name, (raw, _) in cases.items():
        (tmp_path / name).write_text(b64(raw))
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *cases], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    results = {name: (result, grew) for name, result, grew in map(json.loads, out.stdout.splitlines())}
    for name, (_, refusal_says) in cases.items():
        result, grew = results[name]
        if refusal_says is None:
            assert result == [64, 64, 3], (name, result)
            assert grew <= protocol.MAX_IMAGE_DECODE_BYTES, (name, grew / 2**20)
        else:
            assert isinstance(result, str) and refusal_says in result, (name, result)
            assert grew <= 8 * 2**20, (name, grew / 2**20)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("A" * (8 * 2**20 + 4), "base64"),
        ("data:image/png;base64," + "A" * (8 * 2**20 + 4), "base64"),
        ("////", "PNG or JPEG"),
    ],
    ids=["long", "long-data-url", "not-an-image"],
)
def test_an_oversize_or_unreadable_image_string_is_refused(data, says):
    assert says in refusal(protocol.decode_image, data, 64, 64)


def test_a_png_with_many_compressed_text_chunks_is_refused():
    raw = png(64, 64, 2, 8)
    ztxt = b"Comment\0\0" + zlib.compress(b" " * 2**20)
    body = struct.pack(">I", len(ztxt)) + b"zTXt" + ztxt + struct.pack(">I", zlib.crc32(b"zTXt" + ztxt))
    many = raw[:33] + body * 64 + raw[33:]  # after the signature and IHDR
    assert "metadata" in refusal(protocol.decode_image, b64(many), 64, 64)
    assert protocol.decode_image(b64(raw[:33] + body + raw[33:]), 64, 64).shape == (64, 64, 3)


def test_a_png_that_pillow_refuses_with_value_error_is_a_bad_request():
    """A header chunk cut short, and one metadata chunk that inflates past Pillow's limit
    for text (1 MiB): Pillow raises ValueError for both, which must be a refusal, not an
    internal error."""
    raw = png(64, 64, 2, 8)
    ihdr = struct.pack(">I", 4) + b"IHDR" + raw[16:20]
    short = raw[:8] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + raw[16:20])) + raw[33:]
    ztxt = b"Comment\0\0" + zlib.compress(b" " * (2**20 + 2**16))
    bomb = raw[:33] + struct.pack(">I", len(ztxt)) + b"zTXt" + ztxt
    bomb += struct.pack(">I", zlib.crc32(b"zTXt" + ztxt))
    for case in (short, bomb + raw[33:]):
        assert "PNG or JPEG" in refusal(protocol.decode_image, b64(case), 64, 64)


def test_a_small_image_is_resized_to_the_model_and_keeps_its_colours():
    img = Image.new("RGB", (128, 96), (200, 30, 90))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    out = protocol.decode_image("data:image/png;base64," + b64(buf.getvalue()), 64, 48)
    assert out.shape == (48, 64, 3) and (out == [200, 30, 90]).all()


async def test_the_asgi_socket_applies_the_text_limit_itself():
    """Under an ASGI server that does not apply `max_text_frame` (Ray Serve's proxy), the
    socket does: a longer text message (in bytes of UTF-8) closes with 1009."""
    from streamworld.server.sockets import CLOSED, AsgiSocket

    class FakeWebSocket:
        def __init__(self, texts):
            self.texts, self.closed_with = list(texts), None

        async def receive(self):
            message = self.texts.pop(0)
            key = "bytes" if isinstance(message, bytes) else "text"
            return {"type": "websocket.receive", key: message}

        async def close(self, code, reason):
            self.closed_with = code

    fits, multibyte_fits = "x" * 100, "é" * 50  # 100 bytes each
    for too_long in ("é" * 51, b"\0" * 101):
        ws = FakeWebSocket([fits, multibyte_fits, b"\0" * 100, too_long])
        socket = AsgiSocket(ws, max_text=100)
        assert (await socket.receive()).data == fits
        assert (await socket.receive()).data == multibyte_fits
        assert (await socket.receive()).kind == "binary"
        assert await socket.receive() == CLOSED and ws.closed_with == 1009 and socket.closed
