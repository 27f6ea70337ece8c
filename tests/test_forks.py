"""Stream forks: branches share their parent's K/V pages, equal the sequential reference fed
the parent's inputs up to the fork and their own after it, and free every page exactly once
(CPU, tiny-wan with a first image and actions)."""

from __future__ import annotations

import asyncio
import random
from functools import cache

import numpy as np
import pytest
import torch

from streamworld.engine import AsyncEngine, BranchRequest, Overloaded, StreamError, StreamRequest
from streamworld.engine.kv_pool import KVPagePool, PageTable, pages_needed
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from tests.conftest import load_tiny
from tests.test_engine import collect, engine_config

CHUNKS = 8  # actions for this many chunks, more than any stream here runs


@cache
def action_model():
    return load_tiny(needs_image=True, action_dim=2)


def inputs(seed: int):
    cfg = action_model().config
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (cfg.height, cfg.width, 3), dtype=np.uint8)
    frames = 1 + cfg.temporal_ratio * CHUNKS * cfg.latent_frames_per_chunk
    return image, [rng.uniform(-1, 1, size=(frames, 2)).astype(np.float32) for _ in range(3)]


def reference_chunks(request: GenerationRequest, first: int, count: int):
    """The reference's latents and frames of chunks [first, first + count)."""
    model = action_model()
    result = ReferenceGenerator(model).generate(request)
    f = model.config.latent_frames_per_chunk
    starts = np.cumsum([0, *result.chunk_frames])
    latents = result.latents[:, first * f : (first + count) * f]
    return latents, result.frames[starts[first] : starts[first + count]]


def assert_equal_to(outputs, latents, frames) -> None:
    got = torch.cat([o.latents for o in outputs], dim=1)
    torch.testing.assert_close(got, latents, atol=1e-4, rtol=1e-4)
    video = np.concatenate([o.frames for o in outputs])
    assert video.shape == frames.shape
    assert np.abs(video.astype(int) - frames.astype(int)).max() <= 2


@pytest.mark.parametrize("kv_mode", ["clean", "final", "noisy"])
async def test_branches_equal_the_reference_fed_the_parents_inputs_then_their_own(kv_mode):
    """Two branches (one with its own seed) of a stream with a first image and actions; the
    parent is cancelled as soon as they have started, so they run on pages it let go."""
    model = action_model()
    image, (parent_actions, *branch_actions) = inputs(1)
    async with AsyncEngine(model, engine_config()) as engine:
        request = StreamRequest(seed=3, image=image, actions=parent_actions, kv_mode=kv_mode)
        parent = engine.open_stream(request)
        before = [await parent.__anext__()]
        branches = engine.fork(
            parent.id,
            [
                BranchRequest(2, actions=branch_actions[0]),
                BranchRequest(2, actions=branch_actions[1], seed=9),
            ],
        )
        await branches[0].admitted()
        fork = branches[0].stream.fork_chunk
        assert fork is not None and fork >= 1
        while before[-1].index < fork - 1:  # the parent's chunks up to the fork point
            before.append(await parent.__anext__())
        parent.cancel()
        results = await asyncio.gather(*(collect(b) for b in branches))
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    parent_ref = GenerationRequest(3, fork, image=image, actions=parent_actions, kv_mode=kv_mode)
    assert_equal_to(before[:fork], *reference_chunks(parent_ref, 0, fork))
    video_start = parent.stream.chunk_video_start(fork)
    cases = ((3, branch_actions[0]), (9, branch_actions[1]))
    for (seed, actions), outputs in zip(cases, results, strict=True):
        assert [o.index for o in outputs] == [fork, fork + 1]
        fed = np.concatenate([parent_actions[: video_start - 1], actions])
        request = GenerationRequest(
            3, fork + 2, image=image, actions=fed, kv_mode=kv_mode, seed_changes={fork: seed}
        )
        assert_equal_to(outputs, *reference_chunks(request, fork, 2))


async def test_the_parent_goes_on_unchanged_and_branches_share_its_pages():
    """After a fork the parent's own chunks still equal its reference; right after the fork
    point every page the parent held is held by each branch too (pages_used does not grow)."""
    model = action_model()
    image, (parent_actions, branch_actions, _) = inputs(2)
    async with AsyncEngine(model, engine_config()) as engine:
        parent = engine.open_stream(StreamRequest(seed=4, num_chunks=5, image=image, actions=parent_actions))
        outputs = [await parent.__anext__()]
        used = []
        original = engine._branch

        def branch(stream):  # the pool's counters around the fork itself
            used.append(engine.pool.pages_used)
            original(stream)
            used.append(engine.pool.pages_used)
            table = stream.page_table
            assert all(engine.pool.refs(stage, page) == 4 for (stage, _, _), page in table.pages.items())

        engine._branch = branch
        branches = engine.fork(parent.id, [BranchRequest(1, actions=branch_actions)] * 3)
        outputs += await collect(parent)
        await asyncio.gather(*(collect(b) for b in branches))
        assert used[0] == used[1] > 0
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    ref = GenerationRequest(4, 5, image=image, actions=parent_actions)
    assert_equal_to(outputs, *reference_chunks(ref, 0, 5))


async def test_cancelling_before_the_fork_point_ends_the_branches_and_returns_their_reservations():
    model = action_model()
    image, (actions, *_) = inputs(3)
    async with AsyncEngine(model, engine_config()) as engine:
        parent = engine.open_stream(StreamRequest(seed=0, image=image, actions=actions))
        await parent.admitted()
        reserved = engine.pool.reserved
        branches = engine.fork(parent.id, [BranchRequest(2), BranchRequest(1)])
        assert engine.pool.reserved == 3 * reserved
        parent.cancel()  # before its first chunk is done: the fork point is never reached
        for b in branches:
            with pytest.raises(StreamError, match="ended before the fork point"):
                await collect(b)
        assert engine.pool.reserved == 0 and engine.pool.pages_used == 0


async def test_a_cancelled_branch_frees_only_what_it_alone_held():
    model = action_model()
    image, (actions, a, b) = inputs(4)
    async with AsyncEngine(model, engine_config()) as engine:
        parent = engine.open_stream(StreamRequest(seed=1, num_chunks=4, image=image, actions=actions))
        await parent.__anext__()
        first, second = engine.fork(parent.id, [BranchRequest(3, actions=a), BranchRequest(2, actions=b)])
        await first.__anext__()
        first.cancel()
        fork = second.stream.fork_chunk
        rest = await collect(second)
        await collect(parent)
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    video_start = parent.stream.chunk_video_start(fork)
    fed = np.concatenate([actions[: video_start - 1], b])
    request = GenerationRequest(1, fork + 2, image=image, actions=fed)
    assert_equal_to(rest, *reference_chunks(request, fork, 2))


async def test_bad_forks_are_refused_with_the_reason():
    model = action_model()
    image, (actions, *_) = inputs(5)
    cfg = model.config
    room = 2 * pages_needed(1, cfg.sink_frames, cfg.window_frames, cfg.latent_frames_per_chunk)
    async with AsyncEngine(model, engine_config(max_fork_branches=4, kv_pages=room)) as engine:
        with pytest.raises(ValueError, match=r"no stream 99 here \(unknown, or ended\)"):
            engine.fork(99, [BranchRequest(1)])
        done = engine.open_stream(StreamRequest(seed=0, num_chunks=1, image=image, kv_mode="clean"))
        await collect(done)
        with pytest.raises(ValueError, match=f"no stream {done.id} here"):
            engine.fork(done.id, [BranchRequest(1)])
        stopping = engine.open_stream(StreamRequest(seed=0, image=image, kv_mode="clean"))
        await stopping.__anext__()
        stopping.stop()
        with pytest.raises(ValueError, match="is stopping: only a running stream can fork"):
            engine.fork(stopping.id, [BranchRequest(1)])
        await collect(stopping)
        live = engine.open_stream(StreamRequest(seed=0, image=image, actions=actions, kv_mode="clean"))
        with pytest.raises(ValueError, match="1 to 4 branches, not 5"):
            engine.fork(live.id, [BranchRequest(1)] * 5)
        with pytest.raises(ValueError, match="1 to 4 branches, not 0"):
            engine.fork(live.id, [])
        with pytest.raises(ValueError, match="num_chunks must be from 1"):
            engine.fork(live.id, [BranchRequest(0)])
        with pytest.raises(ValueError, match="vectors of length 2"):
            engine.fork(live.id, [BranchRequest(1, actions=np.zeros((3, 5), np.float32))])
        with pytest.raises(Overloaded, match="2 branches need"):  # room for 2 streams in all
            engine.fork(live.id, [BranchRequest(1)] * 2)
        branch = engine.fork(live.id, [BranchRequest(1)])
        with pytest.raises(ValueError, match="has a fork pending"):
            engine.fork(live.id, [BranchRequest(1)])
        await collect(branch[0])
        live.cancel()
    assert engine.pool.reserved == 0 and engine.pool.pages_used == 0


async def test_a_stream_that_has_started_its_last_chunk_cannot_fork():
    """Its last chunk's K/V is never committed (no later chunk reads it), so nothing may
    branch after it."""
    model = action_model()
    image, (actions, *_) = inputs(6)
    async with AsyncEngine(model, engine_config()) as engine:
        stream = engine.open_stream(StreamRequest(seed=0, num_chunks=2, image=image, actions=actions))
        await stream.__anext__()
        assert stream.stream.next_chunk == 2  # the last chunk has started
        with pytest.raises(ValueError, match="has started all its chunks: nothing is left to fork from"):
            engine.fork(stream.id, [BranchRequest(1)])
        await collect(stream)
    assert engine.pool.reserved == 0 and engine.pool.pages_used == 0


async def test_stopping_a_stream_whose_fork_is_pending_branches_after_its_last_commit():
    """A fork asked while the stream's last chunk is delivered but its commit pass has not
    run, then a stop: the stream completes, and its branch starts only once that commit has
    written the K/V the branch reads. The branch equals the reference."""
    from streamworld.engine.kv_modes import COMMIT

    model = action_model()
    image, (parent_actions, branch_actions, _) = inputs(7)
    async with AsyncEngine(model, engine_config()) as engine:
        held = {"commit": True}
        ready_units = engine.scheduler.ready_units

        def hold_first_commit(streams, rank):  # chunk 0's commit waits until the test lets it go
            units = ready_units(streams, rank)
            if held["commit"]:
                units = [u for u in units if not (u.unit.phase == COMMIT and u.unit.chunk == 0)]
            return units

        engine.scheduler.ready_units = hold_first_commit
        request = StreamRequest(seed=3, image=image, actions=parent_actions, kv_mode="clean")
        parent = engine.open_stream(request)
        first = await parent.__anext__()
        assert first.index == 0 and 0 in parent.stream.chunks  # delivered, its commit not yet run
        branches = engine.fork(parent.id, [BranchRequest(2, actions=branch_actions)])
        parent.stop()
        held["commit"] = False
        engine._poke()
        outputs = await collect(branches[0])
        assert await collect(parent) == [] and parent.status == "completed"
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    assert [o.index for o in outputs] == [1, 2]
    video_start = parent.stream.chunk_video_start(1)
    fed = np.concatenate([parent_actions[: video_start - 1], branch_actions])
    reference = GenerationRequest(3, 3, image=image, actions=fed, kv_mode="clean")
    assert_equal_to(outputs, *reference_chunks(reference, 1, 2))


async def test_stopping_a_stream_whose_fork_is_pending_keeps_the_fork_point():
    """A fork asked while a chunk has started but not begun branches after that chunk. A
    stop then finishes that chunk instead of dropping it: dropping it would move the fork
    point back, to a chunk whose actions the stream has already let go."""
    model = action_model()
    image, (parent_actions, branch_actions, _) = inputs(8)
    async with AsyncEngine(model, engine_config()) as engine:
        held = {"chunk": True}
        ready_units = engine.scheduler.ready_units

        def hold_chunk_1(streams, rank):  # chunk 1 starts but none of its units runs
            units = ready_units(streams, rank)
            return [u for u in units if not (held["chunk"] and u.unit.chunk == 1)]

        engine.scheduler.ready_units = hold_chunk_1
        request = StreamRequest(seed=3, image=image, actions=parent_actions, kv_mode="clean")
        parent = engine.open_stream(request)
        before = [await parent.__anext__()]
        while parent.stream.next_chunk < 2:
            await asyncio.sleep(0.01)
        assert not parent.stream.chunks[1].begun()
        branches = engine.fork(parent.id, [BranchRequest(2, actions=branch_actions)])
        parent.stop()
        held["chunk"] = False
        engine._poke()
        outputs = await collect(branches[0])
        before += await collect(parent)
        assert parent.status == "completed" and [o.index for o in before] == [0, 1]
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    assert branches[0].stream.fork_chunk == 2 and [o.index for o in outputs] == [2, 3]
    video_start = parent.stream.chunk_video_start(2)
    fed = np.concatenate([parent_actions[: video_start - 1], branch_actions])
    reference = GenerationRequest(3, 4, image=image, actions=fed, kv_mode="clean")
    assert_equal_to(outputs, *reference_chunks(reference, 2, 2))


async def test_a_prompt_changed_while_a_stopped_stream_waits_to_branch_reaches_the_branch():
    """Fork, stop, then change the prompt while the last chunk's commit pass runs: the
    stream waits for the new prompt's encoding before it completes and branches, so the
    branch runs on the new prompt (it used to take the old prompt's text under the new
    prompt's name, and never encode it)."""
    from streamworld.engine.kv_modes import COMMIT

    model = action_model()
    image, (parent_actions, branch_actions, _) = inputs(9)
    async with AsyncEngine(model, engine_config()) as engine:
        held = {"commit": True, "prompted": False}
        ready_units = engine.scheduler.ready_units
        loop = asyncio.get_running_loop()

        def hold_first_commit(streams, rank):
            units = ready_units(streams, rank)
            first_commit = [u for u in units if u.unit.phase == COMMIT and u.unit.chunk == 0]
            if held["commit"]:
                return [u for u in units if u not in first_commit]
            if first_commit and not held["prompted"]:  # just after the commit is sent off
                held["prompted"] = True
                loop.call_soon(engine.set_prompt, parent.id, "b")
            return units

        engine.scheduler.ready_units = hold_first_commit
        request = StreamRequest(seed=3, prompt="a", image=image, actions=parent_actions, kv_mode="clean")
        parent = engine.open_stream(request)
        await parent.__anext__()
        branches = engine.fork(parent.id, [BranchRequest(2, actions=branch_actions)])
        parent.stop()
        held["commit"] = False
        engine._poke()
        outputs = await collect(branches[0])
        assert held["prompted"] and await collect(parent) == [] and parent.status == "completed"
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    video_start = parent.stream.chunk_video_start(1)
    fed = np.concatenate([parent_actions[: video_start - 1], branch_actions])
    reference = GenerationRequest(
        3, 3, prompt="a", prompt_changes={1: "b"}, image=image, actions=fed, kv_mode="clean"
    )
    assert_equal_to(outputs, *reference_chunks(reference, 1, 2))


@pytest.mark.parametrize("seed", range(100))
def test_random_forks_evictions_and_releases_free_every_page_exactly_once(seed):
    """Page tables forked, written, evicted and released in a random order: a page is free
    exactly when no table holds it, and every page is back at the end."""
    rng = random.Random(seed)
    pool = KVPagePool(num_stages=2, pages_per_stage=400)
    sink, window, chunk = 1, 4, 2
    tables: list[tuple[PageTable, int]] = []  # (table, next first frame)

    def write(table: PageTable, first: int) -> None:
        for stage in range(2):
            table.ensure(stage, 0, range(first, first + chunk))
            table.evict(stage, 0, first + chunk)

    def check() -> None:
        for stage in range(2):
            held: dict[int, int] = {}
            for table, _ in tables:
                for (s, _, _), page in table.pages.items():
                    if s == stage:
                        held[page] = held.get(page, 0) + 1
            free = pool._free[stage]
            assert len(free) == len(set(free))
            assert set(free).isdisjoint(held)
            assert all(pool.refs(stage, p) == n for p, n in held.items())
            assert len(free) + len(held) == pool.pages_per_stage

    for _ in range(60):
        op = rng.random()
        if op < 0.2 or not tables:
            pool.reserve(10)
            tables.append((PageTable(pool, 1, sink, window, 10), 0))
        elif op < 0.35:
            table, first = rng.choice(tables)
            pool.reserve(10)
            tables.append((table.fork(10), first))
        elif op < 0.8:
            i = rng.randrange(len(tables))
            table, first = tables[i]
            write(table, first)
            tables[i] = (table, first + chunk)
        else:
            table, _ = tables.pop(rng.randrange(len(tables)))
            table.release()
        check()
    for table, _ in tables:
        table.release()
    tables.clear()
    check()
    assert pool.pages_used == 0 and pool.reserved == 0


def test_a_shared_page_is_never_handed_out_for_writing_and_nothing_is_freed_twice():
    pool = KVPagePool(num_stages=1, pages_per_stage=8)
    pool.reserve(4)
    table = PageTable(pool, 1, 1, 4, 4)
    table.ensure(0, 0, range(0, 2))
    pool.reserve(4)
    branch = table.fork(4)
    with pytest.raises(RuntimeError, match="shared with a fork"):
        branch.ensure(0, 0, range(1, 3))
    table.release()
    assert branch.ensure(0, 0, range(1, 2))  # its alone now: the branch may write it
    branch.release()
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(0, 0)
