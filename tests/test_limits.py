"""Every client input has a bound on what it can cost, and a documented reply past it
(PROTOCOL.md, bad input and limits): JSON numbers, echoed strings, chunk counts, actions,
prompts and first-frame images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import websockets

from streamworld.engine.request import validate
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


# --- echoed client strings --------------------------------------------------------------------
@pytest.mark.parametrize("ping_id", [None, 7, -2.5, True, "x" * 128, [1, "a"], {"k": 1}])
def test_a_short_ping_id_is_echoed(ping_id):
    assert protocol.pong({"type": "ping", "id": ping_id}) == {"type": "pong", "id": ping_id}


@pytest.mark.parametrize("ping_id", ["x" * 129, 10**200, ["y" * 200], {"k": "z" * 200}])
def test_a_long_ping_id_is_refused_not_echoed(ping_id):
    message = refusal(protocol.pong, {"type": "ping", "id": ping_id})
    assert "128" in message and len(message) < 200


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


@pytest.mark.parametrize("value", [1e15, -1e15, 3.0000001, -3.5, 1e38])
def test_an_action_far_outside_the_models_range_is_refused(value):
    cfg = MODELS["tiny-act"]  # action_range (-1, 1): values in [-3, 3] are accepted
    message = refusal(protocol.parse_action, action_message(0.5, value), cfg.action_dim, cfg.action_range)
    assert "[-3, 3]" in message
    with pytest.raises(ValueError, match="range"):
        validate(cfg, num_chunks=1, image=None, actions=np.array([[value, 0.0]]), kv_mode=None)


def test_actions_within_the_margin_around_the_range_are_accepted():
    cfg = MODELS["tiny-act"]
    values = (-3.0, -1.0, 0.0, 1.0, 2.9, 3.0)
    parsed = protocol.parse_action(action_message(*values), cfg.action_dim, cfg.action_range)
    assert parsed.actions[:, 0].tolist() == pytest.approx(values)
    validate(cfg, num_chunks=1, image=None, actions=parsed.actions, kv_mode=None)


def test_the_accepted_range_is_the_model_range_widened_by_its_width_on_each_side():
    assert tiny_config(action_range=(0.0, 512.0)).accepted_action_range == (-512.0, 1024.0)
    assert tiny_config().accepted_action_range == (-3.0, 3.0)
