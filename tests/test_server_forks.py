"""`session.fork` over the wire (an extension of protocol v1): branches arrive tagged with
their number, equal the sequential reference, end with `branch.done`, and a refused fork is
an `error` carrying the fork's id while the session goes on."""

from __future__ import annotations

import asyncio
import gc
import logging

import numpy as np
import pytest

from streamworld.client import StreamWorldClient, StreamWorldError
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.server.pacing import Sender
from tests.conftest import load_tiny
from tests.test_server import TRANSPORTS, metric, start_server


@pytest.fixture(scope="module")
def models(tiny_model):
    act = load_tiny(action_dim=2)
    object.__setattr__(act.config, "id", "tiny-act")
    return {"tiny-wan": tiny_model, "tiny-act": act}


@pytest.fixture(params=TRANSPORTS)
async def served(models, request):
    _, running = await start_server(models, transport=request.param)
    yield f"ws://127.0.0.1:{running.port}/v1/stream", f"http://127.0.0.1:{running.port}"
    await running.close()


async def drain(branch) -> list:
    return [ch async for ch in branch.chunks()]


def actions_for(cfg, chunks: int, seed: int) -> np.ndarray:
    frames = 1 + cfg.temporal_ratio * chunks * cfg.latent_frames_per_chunk
    return np.random.default_rng(seed).uniform(-1, 1, size=(frames, 2)).round(3)


async def test_branches_arrive_tagged_equal_the_reference_and_the_session_goes_on(served, models):
    url, http = served
    model = models["tiny-act"]
    cfg = model.config
    parent_actions, mine, theirs = (actions_for(cfg, 8, s) for s in (0, 1, 2))
    async with StreamWorldClient(url, model="tiny-act", format="rgb", seed=5, action_policy="wait") as c:
        await c.send_actions(parent_actions.tolist())
        chunks = c.chunks()
        await chunks.__anext__()
        branches = await c.fork(
            [{"num_chunks": 2, "actions": mine}, {"num_chunks": 2, "actions": theirs, "seed": 9}]
        )
        assert [b.number for b in branches] == [1, 2]
        results = await asyncio.gather(*(drain(b) for b in branches))
        fork = results[0][0].index
        after = await chunks.__anext__()  # the session goes on past the fork point
        while after.index < fork:
            after = await chunks.__anext__()
        await c.stop()
        async for _ in chunks:
            pass
        assert c.done_reason == "stopped"
    assert fork >= 1 and after.index == fork
    assert [b.done_reason for b in branches] == ["completed", "completed"]
    assert [b.chunks_done for b in branches] == [2, 2]
    start = results[0][0].first_frame
    gen = ReferenceGenerator(model)
    for (seed, actions), got in zip(((5, mine), (9, theirs)), results, strict=True):
        assert [ch.index for ch in got] == [fork, fork + 1]
        assert all(ch.raw["branch"] in (1, 2) for ch in got)
        fed = np.concatenate([parent_actions[: start - 1], actions]).astype(np.float32)
        ref = gen.generate(GenerationRequest(5, fork + 2, actions=fed, seed_changes={fork: seed}))
        expected = ref.frames[sum(ref.chunk_frames[:fork]) :]
        frames = np.concatenate([ch.frames for ch in got])
        assert frames.shape == expected.shape
        assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 2
    for _ in range(100):
        if await metric(http, "streamworld_kv_pages_used") == 0:
            break
        await asyncio.sleep(0.05)
    assert await metric(http, "streamworld_kv_pages_used") == 0


@pytest.mark.parametrize(
    "branches, fmt, code, message",
    [
        ([], None, "bad_request", "'branches' must be a list of 1 to 16 branches"),
        ([{"num_chunks": 1}] * 17, None, "bad_request", "1 to 16 branches"),
        ([{"num_chunks": 65}], None, "bad_request", "branches[0].num_chunks must be from 1 to 64"),
        ([{"num_chunks": 1, "actions": [[0.0]]}], None, "bad_request", "branches[0]: actions[0] must be"),
        ([{"num_chunks": 1, "seed": -1}], None, "bad_request", "branches[0].seed must be between"),
        ([{"num_chunks": 1}], "h264", "unsupported", "'format' must be one of jpeg, rgb"),
    ],
)
async def test_a_refused_fork_is_an_error_with_its_id_and_the_session_goes_on(
    models, branches, fmt, code, message
):
    _, running = await start_server(models)
    url = f"ws://127.0.0.1:{running.port}/v1/stream"
    try:
        async with StreamWorldClient(url, model="tiny-act", format="jpeg", num_chunks=3) as c:
            with pytest.raises(StreamWorldError) as refused:
                await c.fork(branches, format=fmt)
            assert refused.value.code == code and message in refused.value.message
            assert len([ch async for ch in c.chunks()]) == 3
            assert c.done_reason == "completed"
    finally:
        await running.close()


async def test_cancelling_a_branch_and_leaving_with_branches_running_free_every_page(served):
    url, http = served
    async with StreamWorldClient(url, model="tiny-act", format="jpeg") as c:
        chunks = c.chunks()
        await chunks.__anext__()
        first, second = await c.fork([{"num_chunks": 64}, {"num_chunks": 64}])
        stream = first.chunks()
        await stream.__anext__()
        await first.cancel()
        async for _ in stream:
            pass
        assert first.done_reason == "cancelled"
        await c._send({"type": "branch.cancel", "branch": 7})
        await c.ping()  # answered after the cancel's reply
        assert c.errors[-1].code == "bad_request" and "no running branch 7" in c.errors[-1].message
    # The client left with the session and the second branch running.
    await pages_back(http)
    assert second.done_reason is None


async def pages_back(http: str) -> None:
    for _ in range(200):
        if await metric(http, "streamworld_kv_pages_used", model="tiny-act") == 0:
            break
        await asyncio.sleep(0.05)
    assert await metric(http, "streamworld_kv_pages_used", model="tiny-act") == 0


async def test_a_branch_whose_encoder_fails_ends_in_error_and_the_session_goes_on(
    served, monkeypatch, caplog
):
    """A server fault in one branch (here its encoder) is an error of that branch alone:
    `branch.done` error, its pages back, the session and its other work unharmed."""
    from streamworld.server import session as session_module

    url, http = served
    real = session_module.make_encoder
    made = []

    class Broken:
        def __init__(self, encoder):
            self.encoder = encoder

        def encode(self, frames):
            raise RuntimeError("encoder broke")

        def close(self):
            self.encoder.close()

    def encoders(*args):
        made.append(real(*args))
        return made[-1] if len(made) == 1 else Broken(made[-1])  # the session's own first

    monkeypatch.setattr(session_module, "make_encoder", encoders)
    caplog.set_level(logging.INFO)
    async with StreamWorldClient(url, model="tiny-act", format="jpeg", num_chunks=4) as c:
        chunks = c.chunks()
        await chunks.__anext__()
        (branch,) = await c.fork([{"num_chunks": 8}])
        with pytest.raises(StreamWorldError, match="internal server error"):
            await drain(branch)
        assert branch.done_reason == "error" and branch.chunks_done == 0
        assert len([ch async for ch in chunks]) == 3
    await pages_back(http)
    assert any("branch 1 failed" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


async def test_a_client_gone_while_a_branch_sends_frees_the_branch_and_is_no_error(
    served, monkeypatch, caplog
):
    """A branch's send that finds the client gone ends the branch at once (its pages back,
    not held paused on unsent chunks) and logs no error."""
    url, http = served
    send = Sender.send

    async def branch_chunks_fail(self, *messages):
        if any(isinstance(m, dict) and m.get("type") == "chunk" and "branch" in m for m in messages):
            raise ConnectionResetError("gone")
        await send(self, *messages)

    monkeypatch.setattr(Sender, "send", branch_chunks_fail)
    caplog.set_level(logging.INFO)
    async with StreamWorldClient(url, model="tiny-act", format="jpeg", num_chunks=6) as c:
        chunks = c.chunks()
        await chunks.__anext__()
        await c.fork([{"num_chunks": 64}, {"num_chunks": 64}])
        assert len([ch async for ch in chunks]) == 5  # the session runs on to its end
    await pages_back(http)
    gc.collect()  # an exception no task retrieved is logged when its task goes
    await asyncio.sleep(0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_the_fork_example_of_the_protocol_doc_runs_as_written(served, models):
    """The Python fork example of docs/protocol.md, taken from the file."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    section = doc.split("### Forks from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"asyncio": asyncio}
    exec(code, namespace)
    url, _ = served
    cfg = models["tiny-act"].config
    async with StreamWorldClient(url, model="tiny-act", format="jpeg") as c:
        futures = await namespace["try_futures"](c, [actions_for(cfg, 2, s) for s in (3, 4, 5)])
    assert len(futures) == 3
    assert all(len(f) == 2 and f[0].shape[1:] == (cfg.height, cfg.width, 3) for f in futures)
    assert not np.array_equal(futures[0][1], futures[1][1])  # different actions, different futures


async def test_client_rollouts_fork_a_session_started_from_a_frame(models):
    """`ClientRollouts` over a server session of a model that starts from a frame and takes
    actions: each candidate's frames equal the reference fed the first frame and its actions."""
    from streamworld.planning import ClientRollouts

    model = load_tiny(needs_image=True, action_dim=2)
    object.__setattr__(model.config, "id", "tiny-img")
    cfg = model.config
    image = np.random.default_rng(0).integers(0, 256, (cfg.height, cfg.width, 3), dtype=np.uint8)
    candidates = np.stack([actions_for(cfg, 1, s)[: cfg.first_chunk_frames] for s in (1, 2)])
    candidates = candidates.astype(np.float32)
    _, running = await start_server({**models, "tiny-img": model})
    try:
        url = f"ws://127.0.0.1:{running.port}/v1/stream"
        async with StreamWorldClient(
            url, model="tiny-img", image=image, seed=4, format="rgb", action_policy="wait"
        ) as c:
            frames = await ClientRollouts(c)(candidates)
    finally:
        await running.close()
    assert frames.shape == (2, cfg.first_chunk_frames, cfg.height, cfg.width, 3)
    gen = ReferenceGenerator(model)
    for candidate, got in zip(candidates, frames, strict=True):
        ref = gen.generate(GenerationRequest(4, 1, image=image, actions=candidate))
        assert np.abs(got.astype(int) - ref.frames.astype(int)).max() <= 2
