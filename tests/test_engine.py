"""The AsyncEngine against the sequential reference: exactness, cancellation, pipelining,
priorities, admission and failure isolation (CPU, tiny-wan)."""

from __future__ import annotations

import asyncio
import random
from functools import cache

import numpy as np
import pytest
import torch

from streamworld.engine import (
    AsyncEngine,
    EngineConfig,
    Overloaded,
    SchedulerConfig,
    StreamError,
    StreamRequest,
)
from streamworld.engine.kv_modes import COMMIT
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from tests.conftest import load_tiny

# Run everything as soon as possible, with no playback-clock gating: no lookahead bound,
# and interactive streams do not wait for their (far) deadlines either.
ASAP = SchedulerConfig(lookahead_chunks=1e6, jit_margin_s=1e6)


def engine_config(**kw) -> EngineConfig:
    kw.setdefault("scheduler", ASAP)
    kw.setdefault("ttff_budget_s", 1e3)
    return EngineConfig(**kw)


async def collect(handle) -> list:
    return [c async for c in handle]


@cache
def reference(model, seed: int, num_chunks: int, prompt: str = "", kv_mode: str = "clean"):
    return ReferenceGenerator(model).generate(
        GenerationRequest(seed=seed, num_chunks=num_chunks, prompt=prompt, kv_mode=kv_mode)
    )


def assert_matches(outputs, expected) -> None:
    latents = torch.cat([o.latents for o in outputs], dim=1)
    frames = np.concatenate([o.frames for o in outputs])
    torch.testing.assert_close(latents, expected.latents, atol=1e-4, rtol=1e-4)
    assert frames.shape == expected.frames.shape
    assert np.abs(frames.astype(int) - expected.frames.astype(int)).max() <= 2
    assert [o.index for o in outputs] == list(range(len(outputs)))


async def test_concurrent_streams_with_staggered_arrival_match_the_reference(tiny_model):
    specs = [
        (1, "clean", "interactive", "a"),
        (2, "final", "standard", "b"),
        (3, "noisy", "batch", "c"),
        (4, "noisy", "interactive", "a"),
        (5, "clean", "standard", "d"),
    ]
    async with AsyncEngine(tiny_model, engine_config(num_stages=2, trace=True)) as engine:
        tasks = []
        for seed, mode, prio, prompt in specs:
            req = StreamRequest(seed=seed, num_chunks=3, prompt=prompt, kv_mode=mode, priority=prio)
            tasks.append(asyncio.create_task(collect(engine.open_stream(req))))
            await asyncio.sleep(0.05)  # staggered arrival, while others run
        results = await asyncio.gather(*tasks)
        assert max(engine.stats.batch_sizes) > 1, engine.stats.batch_sizes
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    for (seed, mode, _, prompt), outputs in zip(specs, results, strict=True):
        assert_matches(outputs, reference(tiny_model, seed, 3, prompt, mode))


async def test_an_uneven_explicit_placement_matches_the_reference_in_every_kv_mode(tiny_model):
    from streamworld.engine import ReplicaPlacement, StagePlacement

    # tiny-wan's 4 blocks as 1 + 2 + 1, the outer stages sharing rank 1.
    stages = (StagePlacement(0, 1, "cpu", 1), StagePlacement(1, 3, "cpu", 0), StagePlacement(3, 4, "cpu", 1))
    placement = ReplicaPlacement(stages, "cpu")
    specs = [(11, "clean"), (12, "final"), (13, "noisy"), (14, "noisy")]
    async with AsyncEngine(tiny_model, engine_config(placement=placement, trace=True)) as engine:
        assert [(s.start, s.stop) for s in engine.stages] == [(0, 1), (1, 3), (3, 4)]
        assert len(engine.ranks) == 2
        handles = [engine.open_stream(StreamRequest(seed=s, num_chunks=3, kv_mode=m)) for s, m in specs]
        results = await asyncio.gather(*(collect(h) for h in handles))
        assert {(e.unit.stage, e.rank) for e in engine.trace} == {(0, 1), (1, 0), (2, 1)}
        assert engine.pool.pages_used == 0
    for (seed, mode), outputs in zip(specs, results, strict=True):
        assert_matches(outputs, reference(tiny_model, seed, 3, "", mode))


def test_an_engine_refuses_a_placement_its_model_does_not_match(tiny_model):
    from streamworld.engine import parse_placement

    placement = parse_placement("0-1@cpu,2-3@cuda:0", [], 4).replicas[0]
    with pytest.raises(
        ValueError, match=r"blocks 2-3 are on \['cpu'\], but the placement puts them on cuda:0"
    ):
        AsyncEngine(tiny_model, engine_config(placement=placement))


async def test_image_and_action_streams_match_the_reference_with_actions_arriving_late():
    model = load_tiny(needs_image=True, action_dim=2)
    cfg = model.config
    rng = np.random.default_rng(0)
    num_chunks = 3
    frames_needed = 1 + cfg.temporal_ratio * (1 + num_chunks * cfg.latent_frames_per_chunk - 1)
    cases = []
    for seed in (0, 1):
        image = rng.integers(0, 256, (cfg.height, cfg.width, 3), dtype=np.uint8)
        actions = rng.normal(size=(frames_needed, 2)).astype(np.float32)
        cases.append((seed, image, actions))
    async with AsyncEngine(model, engine_config()) as engine:
        handles = []
        for seed, image, actions in cases:
            req = StreamRequest(
                seed=seed,
                num_chunks=num_chunks,
                image=image,
                actions=actions[:5],
                action_policy="wait",
                kv_mode="noisy" if seed else "clean",
            )
            handles.append(engine.open_stream(req))
        tasks = [asyncio.create_task(collect(h)) for h in handles]
        await asyncio.sleep(0.1)
        for h, (_, _, actions) in zip(handles, cases, strict=True):
            h.push_actions(actions[5:20])
        await asyncio.sleep(0.1)
        for h, (_, _, actions) in zip(handles, cases, strict=True):
            h.push_actions(actions[20:], frame=20)
        results = await asyncio.gather(*tasks)
    gen = ReferenceGenerator(model)
    for (seed, image, actions), outputs in zip(cases, results, strict=True):
        expected = gen.generate(
            GenerationRequest(
                seed=seed,
                num_chunks=num_chunks,
                image=image,
                actions=actions,
                kv_mode="noisy" if seed else "clean",
            )
        )
        assert_matches(outputs, expected)
        assert outputs[0].first_frame == 1  # the image is frame 0 and is not sent back


def test_offline_generation_serves_every_request_as_the_reference_does(tiny_model):
    """`generate_all_sync` (training's rollouts use it) returns each request's frames, in
    order, equal to the reference generator's up to float rounding; a request without an end
    is refused before anything runs."""
    from streamworld.engine import generate_all_sync

    specs = [(3, "final", "a"), (4, "clean", "b"), (5, "noisy", "")]
    requests = [StreamRequest(seed=s, num_chunks=2, prompt=p, kv_mode=m) for s, m, p in specs]
    frames = generate_all_sync(tiny_model, requests)
    assert len(frames) == len(specs)
    for (seed, mode, prompt), got in zip(specs, frames, strict=True):
        expected = reference(tiny_model, seed, 2, prompt, mode).frames
        assert got.shape == expected.shape and got.dtype == np.uint8
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= 2
    assert generate_all_sync(tiny_model, []) == []
    with pytest.raises(ValueError, match="num_chunks"):
        generate_all_sync(tiny_model, [StreamRequest(seed=0)])
    with pytest.raises(ValueError, match="not paced"):
        generate_all_sync(tiny_model, [StreamRequest(seed=0, num_chunks=1, priority="interactive")])


def test_dit_batches_hold_units_of_one_context_length(tiny_model, monkeypatch):
    """The noisy pipeline runs a stream's next chunk beside the current one. While the
    window fills, the two attend to contexts of different lengths and must run as separate
    batches (a batch of mixed contexts attends unit by unit and cannot replay a CUDA graph);
    once it is full they batch together again."""
    from streamworld.engine import generate_all_sync
    from streamworld.models.causal_wan import CausalWanDiT

    batches = []
    plan_blocks = CausalWanDiT.plan_blocks

    def spied(self, act, units):
        batches.append([len(u.kv.read_pages) for u in units])
        return plan_blocks(self, act, units)

    monkeypatch.setattr(CausalWanDiT, "plan_blocks", spied)
    requests = [StreamRequest(seed=s, num_chunks=5, kv_mode="noisy") for s in (1, 2)]
    generate_all_sync(tiny_model, requests)
    assert batches and all(len(set(b)) == 1 for b in batches), batches
    window = 1 + tiny_model.config.window_frames  # the sink and the window
    assert any(len(b) > 2 and b[0] == window for b in batches)  # chunks past the window batch together


def test_the_last_chunk_of_a_clean_stream_commits_no_kv(tiny_model):
    """In clean mode every chunk but a stream's last runs a commit pass: no later chunk
    reads the last one's K/V. Its frames still equal the reference's."""
    from dataclasses import replace

    from streamworld.engine import generate_all_sync, offline_config

    units = []
    requests = [StreamRequest(seed=s, num_chunks=3, kv_mode="clean") for s in (1, 2)]
    config = replace(offline_config(2), fault_hook=units.append)
    results = generate_all_sync(tiny_model, requests, config)
    commits = sorted((u.stream, u.chunk) for u in units if u.phase == COMMIT and u.stage == 0)
    streams = sorted({u.stream for u in units})
    assert len(streams) == 2 and commits == [(s, c) for s in streams for c in (0, 1)]
    steps = [u for u in units if u.phase == 0 and u.stage == 0 and u.chunk == 2]
    assert len(steps) == 2  # the last chunks ran
    for request, frames in zip(requests, results, strict=True):
        expected = reference(tiny_model, request.seed, 3, "", "clean").frames
        assert frames.shape == expected.shape  # batched, the frames may differ by rounding
        assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 2


def test_offline_generation_raises_a_failed_stream_and_queues_past_the_pool(tiny_model):
    """A stream that fails raises its error instead of coming back short; more streams
    than the K/V pool holds wait their turn instead of being refused."""
    from dataclasses import replace

    from streamworld.engine import StreamError, generate_all_sync, offline_config

    def fail(unit):
        raise RuntimeError("injected")

    requests = [StreamRequest(seed=s, num_chunks=1) for s in range(3)]
    with pytest.raises(StreamError):
        generate_all_sync(tiny_model, requests, replace(offline_config(3), fault_hook=fail))
    many = [StreamRequest(seed=s, num_chunks=1, kv_mode="noisy") for s in range(20)]
    narrow = replace(offline_config(20), max_streams=1)  # a pool with room for one noisy stream
    frames = generate_all_sync(tiny_model, many, narrow)
    for seed in (0, 19):
        expected = reference(tiny_model, seed, 1, "", "noisy").frames
        assert np.abs(frames[seed].astype(int) - expected.astype(int)).max() <= 2


async def test_noisy_mode_runs_chunk_c_step_k_before_chunk_c_minus_1_finishes(tiny_model):
    async with AsyncEngine(tiny_model, engine_config(num_stages=2, trace=True)) as engine:
        outputs = await collect(engine.open_stream(StreamRequest(seed=9, num_chunks=6, kv_mode="noisy")))
        trace = list(engine.trace)
    assert_matches(outputs, reference(tiny_model, 9, 6, "", "noisy"))
    steps = tiny_model.schedule.num_steps
    last_unit_end = {}
    for e in trace:
        if e.unit.phase == steps - 1 and e.unit.stage == 1:
            last_unit_end[e.unit.chunk] = e.end
    overlapped = [e for e in trace if e.unit.chunk >= 1 and e.start < last_unit_end[e.unit.chunk - 1]]
    assert overlapped, "no unit of chunk c started before chunk c-1 had finished its steps"
    # Diagonal: chunk c step k shares a batch with chunk c-1 step k+1 (once both attend to
    # the full window: a batch holds one context length).
    by_batch: dict[int, set] = {}
    for e in trace:
        by_batch.setdefault(e.batch, set()).add((e.unit.chunk, e.unit.phase))
    assert any((c, k) in units and (c - 1, k + 1) in units for units in by_batch.values() for (c, k) in units)


async def test_clean_mode_serialises_chunks_of_one_stream(tiny_model):
    async with AsyncEngine(tiny_model, engine_config(trace=True)) as engine:
        await collect(engine.open_stream(StreamRequest(seed=2, num_chunks=3, kv_mode="clean")))
        trace = list(engine.trace)
    commit_end = {e.unit.chunk: e.end for e in trace if e.unit.phase == COMMIT}
    for e in trace:
        if e.unit.chunk >= 1:
            assert e.start >= commit_end[e.unit.chunk - 1]


@pytest.mark.parametrize("stages, wanted", [pytest.param(2, 100, marks=pytest.mark.slow), (3, 40)])
async def test_random_cancellations_free_everything_and_leave_others_unchanged(tiny_model, stages, wanted):
    from streamworld.engine import parse_placement

    # 2 stages time-share one rank; 3 stages run on 3 ranks as a pipeline of virtual devices.
    placement = None if stages == 2 else parse_placement("pipeline", ["cpu"] * 3, 4).replicas[0]
    config = engine_config(num_stages=2, placement=placement, trace=True, max_streams=6)
    rnd = random.Random(1234)
    cancelled_total = 0
    async with AsyncEngine(tiny_model, config) as engine:
        assert len(engine.stages) == stages
        while cancelled_total < wanted:
            survivor_seed = rnd.randrange(3)
            survivor = engine.open_stream(StreamRequest(seed=survivor_seed, num_chunks=2, kv_mode="noisy"))
            survivor_task = asyncio.create_task(collect(survivor))
            victims = []
            for _ in range(5):
                mode = rnd.choice(["clean", "final", "noisy"])
                h = engine.open_stream(StreamRequest(seed=rnd.randrange(100), num_chunks=None, kv_mode=mode))
                victims.append(h)
            received: dict[int, list] = {h.id: [] for h in victims}

            async def drain(h, received=received):
                async for c in h:
                    received[h.id].append((asyncio.get_running_loop().time(), c))

            drains = [asyncio.create_task(drain(h)) for h in victims]
            cancel_times, delivered_by_cancel = {}, {}
            for h in rnd.sample(victims, len(victims)):
                await asyncio.sleep(rnd.choice([0, 0.001, 0.01, 0.03, 0.08]))
                cancel_times[h.id] = asyncio.get_running_loop().time()
                # Taken by the drain, or delivered and still queued for it (readable after the
                # cancel, as the server's shutdown relies on): nothing more may come.
                delivered_by_cancel[h.id] = len(received[h.id]) + h.backlog
                h.cancel()
                cancelled_total += 1
            await asyncio.gather(*drains)
            outputs = await survivor_task
            assert_matches(outputs, reference(tiny_model, survivor_seed, 2, "", "noisy"))
            for h in victims:
                assert len(received[h.id]) == delivered_by_cancel[h.id], "delivered after cancel"
                launched_after = [
                    e for e in engine.trace if e.unit.stream == h.id and e.start > cancel_times[h.id]
                ]
                assert not launched_after, launched_after
            assert engine.pool.pages_used == 0
            assert engine.pool.reserved == 0
            assert engine.live_streams() == 0
            engine.trace.clear()
    assert cancelled_total >= wanted


async def test_interactive_streams_are_served_ahead_of_standard():
    # 32 fps: a 12-frame chunk is due every 0.375 s per stream. Two streams fit a small CPU,
    # eight do not; a token budget of two units per batch makes the streams compete. What
    # the scheduler decides is the order, which holds however busy the machine is; which
    # deadlines are met depends on the machine's speed (docs/benchmarks.md measures that).
    model = load_tiny(fps=32)
    budget = 2 * model.config.latent_frames_per_chunk * model.config.tokens_per_frame
    config = EngineConfig(
        ttff_budget_s=0.5,
        trace=True,
        scheduler=SchedulerConfig(lookahead_chunks=2.0, token_budget=budget),
    )
    async with AsyncEngine(model, config) as engine:
        handles = {}
        for i in range(8):
            prio = "interactive" if i < 2 else "standard"
            handles[i] = (prio, engine.open_stream(StreamRequest(seed=i, num_chunks=5, priority=prio)))
        results = await asyncio.gather(*(collect(h) for _, h in handles.values()))
        trace = sorted(engine.trace, key=lambda e: e.end)
    assert all(len(chunks) == 5 for chunks in results)
    priority = {h.id: prio for prio, h in handles.values()}
    finished = {e.unit.stream: e.end for e in trace}  # each stream's last unit
    interactive = [t for s, t in finished.items() if priority[s] == "interactive"]
    standard = [t for s, t in finished.items() if priority[s] == "standard"]
    assert len(interactive) == 2 and len(standard) == 6
    assert max(interactive) <= min(standard), (interactive, standard)
    rank = {"interactive": [], "standard": []}
    for k, e in enumerate(trace):
        rank[priority[e.unit.stream]].append(k)
    assert np.mean(rank["interactive"]) < np.mean(rank["standard"])


async def test_streams_do_not_run_far_ahead_of_their_playback_clock():
    model = load_tiny(fps=48)  # a chunk is due every 0.25 s
    config = EngineConfig(ttff_budget_s=0.2, scheduler=SchedulerConfig(lookahead_chunks=1.0), trace=True)
    async with AsyncEngine(model, config) as engine:
        handle = engine.open_stream(StreamRequest(seed=0, num_chunks=4))
        stream = handle.stream
        await collect(handle)
        first_start = {}
        for e in engine.trace:
            first_start.setdefault(e.unit.chunk, e.start)
    for c, start in first_start.items():
        earliest = stream.deadline(c) - 1.0 * stream.chunk_duration
        assert start >= earliest - 1e-3, (c, start - earliest)


async def test_exhausted_pool_queues_then_admits_and_full_queue_refuses(tiny_model):
    probe = AsyncEngine(tiny_model, engine_config())
    need = probe._pages_for("clean")
    config = engine_config(kv_pages=2 * need, max_queue=1)
    async with AsyncEngine(tiny_model, config) as engine:
        first = [engine.open_stream(StreamRequest(seed=s, num_chunks=2)) for s in (0, 1)]
        queued = engine.open_stream(StreamRequest(seed=2, num_chunks=2))
        assert queued.queue_position == 1
        assert queued.stream.status == "waiting"
        with pytest.raises(Overloaded):
            engine.open_stream(StreamRequest(seed=3, num_chunks=2))
        outputs = await asyncio.gather(*(collect(h) for h in [*first, queued]))
        assert queued.queue_position == 0
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    for seed, out in zip((0, 1, 2), outputs, strict=True):
        assert_matches(out, reference(tiny_model, seed, 2))


async def test_a_failing_unit_ends_only_its_own_stream(tiny_model):
    victim_seed = 77

    async with AsyncEngine(tiny_model, engine_config(trace=True)) as engine:
        handles = [engine.open_stream(StreamRequest(seed=s, num_chunks=3, kv_mode="final")) for s in (0, 1)]
        victim = engine.open_stream(StreamRequest(seed=victim_seed, num_chunks=3, kv_mode="final"))

        def fault(unit):
            if unit.stream == victim.id and unit.chunk == 1 and unit.phase == 2:
                raise RuntimeError("injected failure")

        engine.config = EngineConfig(**{**engine.config.__dict__, "fault_hook": fault})
        results = await asyncio.gather(*(collect(h) for h in handles))
        with pytest.raises(StreamError, match="injected failure"):
            await collect(victim)
        failed_batch = [
            e.batch
            for e in engine.trace
            if e.unit.stream == victim.id and e.unit.chunk == 1 and e.unit.phase == 2
        ]
        shared = [e for e in engine.trace if e.batch in failed_batch and e.unit.stream != victim.id]
        assert shared, "the failing unit ran alone; the test needs it batched with others"
        assert engine.stats.finished["error"] == 1
        assert engine.pool.pages_used == 0
    for seed, out in zip((0, 1), results, strict=True):
        assert_matches(out, reference(tiny_model, seed, 3, "", "final"))


async def test_kv_pages_stay_flat_on_a_long_stream(tiny_model):
    async with AsyncEngine(tiny_model, engine_config()) as engine:
        handle = engine.open_stream(StreamRequest(seed=0, num_chunks=None, kv_mode="noisy"))
        used = []
        async for out in handle:
            used.append(engine.pool.pages_used)
            if out.index == 15:
                handle.cancel()
        assert engine.pool.pages_used == 0
    need = engine._pages_for("noisy")
    assert max(used) <= need
    # No growth: once the window is full, the last chunks hold no more than the early ones
    # (the exact count at a delivery depends on how far the next chunk has got).
    assert max(used[-5:]) <= max(used[6:11]), used


async def test_prompt_switch_applies_from_the_next_chunk_not_yet_started():
    # `wait` holds chunk 2 until its actions arrive, so the switch lands exactly there.
    model = load_tiny(action_dim=2)
    cfg = model.config
    f, r = cfg.latent_frames_per_chunk, cfg.temporal_ratio
    actions = np.random.default_rng(3).normal(size=(1 + r * (3 * f - 1), 2)).astype(np.float32)
    upto_chunk_1 = r * (2 * f - 1)  # actions chunks 0 and 1 need
    async with AsyncEngine(model, engine_config()) as engine:
        request = StreamRequest(
            seed=4, num_chunks=3, prompt="old", actions=actions[:upto_chunk_1], action_policy="wait"
        )
        handle = engine.open_stream(request)
        outputs = []
        async for out in handle:
            outputs.append(out)
            if out.index == 1:
                handle.set_prompt("new")
                handle.push_actions(actions[upto_chunk_1:])
    expected = ReferenceGenerator(model).generate(
        GenerationRequest(seed=4, num_chunks=3, prompt="old", prompt_changes={2: "new"}, actions=actions)
    )
    assert_matches(outputs, expected)
    unchanged = ReferenceGenerator(model).generate(
        GenerationRequest(seed=4, num_chunks=3, prompt="old", actions=actions)
    )
    assert (expected.latents[:, 2 * f :] - unchanged.latents[:, 2 * f :]).abs().max() > 1e-4


async def test_cancel_during_a_shared_decode_leaves_the_other_streams_intact(tiny_model):
    async with AsyncEngine(tiny_model, engine_config()) as engine:
        launch, cancelled = engine._launch_decode, []

        def launch_then_cancel():
            idle = not engine.decoder.busy
            launch()
            decoding = [
                s
                for s in engine.streams.values()
                if any(c.decoding and not c.decoded for c in s.chunks.values())
            ]
            if idle and engine.decoder.busy and len(decoding) >= 2 and not cancelled:
                cancelled.append(decoding[-1].id)
                engine.cancel(decoding[-1].id)  # a disconnect handled right after the launch

        engine._launch_decode = launch_then_cancel
        handles = [engine.open_stream(StreamRequest(seed=s, num_chunks=3)) for s in range(3)]
        results = await asyncio.gather(*(collect(h) for h in handles))
        assert cancelled
        assert engine.pool.pages_used == 0
    for h, out in zip(handles, results, strict=True):
        if h.id not in cancelled:
            assert_matches(out, reference(tiny_model, h.stream.request.seed, 3))


async def test_a_failing_decode_ends_only_its_own_stream(tiny_model, monkeypatch):
    vae = tiny_model.vae
    victim_states = []
    batched, single = vae.decode_chunks, vae.decode_chunk

    def decode_chunks(latents, states):
        if any(s is v for s in states for v in victim_states) and len(states) > 1:
            raise RuntimeError("batched decode failed")
        return batched(latents, states)

    def decode_chunk(latents, state):
        if any(state is v for v in victim_states):
            raise RuntimeError("injected decode failure")
        return single(latents, state)

    monkeypatch.setattr(vae, "decode_chunks", decode_chunks)
    monkeypatch.setattr(vae, "decode_chunk", decode_chunk)
    async with AsyncEngine(tiny_model, engine_config()) as engine:
        handles = [engine.open_stream(StreamRequest(seed=s, num_chunks=2)) for s in (0, 1, 2)]
        victim_states.append(engine.runner.streams[handles[1].id].decoder)  # the runner holds tensors
        tasks = [asyncio.create_task(collect(h)) for h in handles]
        with pytest.raises(StreamError, match="injected decode failure"):
            await tasks[1]
        healthy = [await tasks[0], await tasks[2]]
        assert engine.pool.pages_used == 0
    for seed, out in zip((0, 2), healthy, strict=True):
        assert_matches(out, reference(tiny_model, seed, 2))


async def test_stop_finishes_the_begun_chunks_and_ends_the_stream(tiny_model):
    async with AsyncEngine(tiny_model, engine_config()) as engine:
        handle = engine.open_stream(StreamRequest(seed=6, num_chunks=None, kv_mode="noisy"))
        outputs = []
        async for out in handle:
            outputs.append(out)
            if out.index == 0:
                handle.stop()
        assert handle.stream.status == "completed"
        assert engine.stats.finished["stopped"] == 1
        assert engine.pool.pages_used == 0 and engine.pool.reserved == 0
    # Chunks already begun when stop() came (at most the S + 1 a stream holds) were delivered.
    assert 1 <= len(outputs) <= 1 + tiny_model.schedule.num_steps + 1
    assert_matches(outputs, reference(tiny_model, 6, len(outputs), "", "noisy"))


async def test_the_admission_queue_is_bounded_and_closed_engines_refuse(tiny_model):
    probe = AsyncEngine(tiny_model, engine_config())
    noisy_need = probe._pages_for("noisy")
    engine = AsyncEngine(tiny_model, engine_config(kv_pages=noisy_need, max_queue=2))
    await engine.start()
    first = engine.open_stream(StreamRequest(seed=0, num_chunks=1, kv_mode="noisy"))
    queued = [engine.open_stream(StreamRequest(seed=s, num_chunks=1, kv_mode="final")) for s in (1, 2)]
    assert [h.queue_position for h in queued] == [1, 2]
    with pytest.raises(Overloaded):  # fits the pool by itself, but the queue is full
        engine.open_stream(StreamRequest(seed=3, num_chunks=1, kv_mode="final"))
    await asyncio.gather(*(collect(h) for h in [first, *queued]))
    await engine.close()
    with pytest.raises(RuntimeError, match="not running"):
        engine.open_stream(StreamRequest(seed=4, num_chunks=1))
    assert engine.pool.reserved == 0


def test_action_track_holds_overwrites_and_forgets():
    from streamworld.engine.stream import ActionTrack

    track = ActionTrack(1)
    track.push(np.array([[1.0], [2.0], [3.0]]))
    track.push(np.array([[9.0]]), frame=1)  # replaces frame 1 and what was queued after it
    assert track.hold(0, 4).ravel().tolist() == [1, 9, 9, 9]
    track.push(np.array([[5.0]]), frame=6)  # frames 2..5 hold the last action
    assert track.hold(0, 8).ravel().tolist() == [1, 9, 9, 9, 9, 9, 5, 5]
    track.forget_before(5)
    assert track.base == 5
    assert track.hold(5, 9).ravel().tolist() == [9, 5, 5, 5]
    track.forget_before(100)
    assert track.hold(7, 9).ravel().tolist() == [5, 5]
    with pytest.raises(ValueError):
        track.hold(0, 2)


async def test_cpu_model_work_runs_on_one_process_wide_thread(tiny_model):
    """On a CPU every executor and `on_torch_thread` use one thread (executor.py says why)."""
    import threading

    from streamworld.engine.executor import on_torch_thread

    seen: set[str] = set()
    original = tiny_model.dit.run_blocks

    def spy(*args, **kwargs):
        seen.add(threading.current_thread().name)
        return original(*args, **kwargs)

    tiny_model.dit.run_blocks = spy
    try:
        async with AsyncEngine(tiny_model, engine_config()) as engine:
            await collect(engine.open_stream(StreamRequest(seed=0, num_chunks=1)))
            decode_thread = await engine.decoder.submit(lambda: threading.current_thread().name)
            engine.decoder.done()
    finally:
        del tiny_model.dit.run_blocks
    here = on_torch_thread("cpu", lambda: threading.current_thread().name)
    nested = on_torch_thread("cpu", lambda: on_torch_thread("cpu", lambda: threading.current_thread().name))
    assert seen == {decode_thread} == {here} == {nested} == {"streamworld-cpu"}
    assert threading.current_thread().name != "streamworld-cpu"


@pytest.mark.parametrize("overlap", [False, True])
async def test_non_finite_model_output_ends_only_its_own_stream(tiny_model, monkeypatch, overlap):
    """Without overlapped dispatch the check follows every batch; with it (forced here on a
    CPU, where it is otherwise off) the check happens when the chunk is decoded."""
    from streamworld.engine import runner
    from streamworld.models.schedule import chunk_noise

    victim_seed = 91

    def poisoned(seed, chunk, phase, shape):
        x = chunk_noise(seed, chunk, phase, shape)
        return x * float("nan") if seed == victim_seed and chunk == 1 else x

    monkeypatch.setattr(runner, "chunk_noise", poisoned)
    async with AsyncEngine(tiny_model, engine_config(overlap_dispatch=overlap)) as engine:
        assert engine.overlap is overlap
        handles = [engine.open_stream(StreamRequest(seed=s, num_chunks=3, kv_mode="noisy")) for s in (0, 1)]
        victim = engine.open_stream(StreamRequest(seed=victim_seed, num_chunks=3, kv_mode="noisy"))
        results = await asyncio.gather(*(collect(h) for h in handles))
        with pytest.raises(StreamError, match="non-finite values in the model output"):
            await collect(victim)
        assert engine.pool.pages_used == 0
    for seed, out in zip((0, 1), results, strict=True):
        assert_matches(out, reference(tiny_model, seed, 3, "", "noisy"))


async def test_a_non_finite_prompt_encoding_ends_only_its_own_stream(tiny_model, monkeypatch):
    encoder = tiny_model.text_encoder
    run = encoder._run
    monkeypatch.setattr(encoder, "_run", lambda p: run(p) * float("nan") if p == "poison" else run(p))
    async with AsyncEngine(tiny_model, engine_config()) as engine:
        victim = engine.open_stream(StreamRequest(seed=0, num_chunks=2, prompt="poison"))
        other = engine.open_stream(StreamRequest(seed=1, num_chunks=2, prompt="fine"))
        with pytest.raises(StreamError, match=r"prompt encoding failed: .*non-finite"):
            await collect(victim)
        out = await collect(other)
        assert engine.pool.pages_used == 0
    assert_matches(out, reference(tiny_model, 1, 2, "fine"))
    assert "poison" not in tiny_model._text_cache


def test_overlapped_dispatch_needs_a_single_rank(tiny_model):
    with pytest.raises(ValueError, match="one rank"):
        AsyncEngine(tiny_model, engine_config(num_ranks=2, overlap_dispatch=True))
    assert not AsyncEngine(tiny_model, engine_config()).overlap  # off by default on a CPU


@pytest.mark.parametrize(
    "writes",
    [
        ([[0, 1, 2]], []),  # the second unit writes nothing (a step that keeps no K/V)
        ([], [[3, 4, 5]]),
        ([[0, 1, 2], [6, 7, 8]], [[3, 4, 5]]),  # two versions, then one
        ([[0, 1, 2]], [[3, 4, 5]]),
    ],
)
def test_a_batched_kv_store_writes_each_units_rows_to_its_own_pages(writes):
    """`PagedKVBatch.store` on a batch whose units write different numbers of versions:
    each page gets exactly its unit's frame, and no other page changes."""
    from streamworld.engine.kv_cache import KVCache, PagedKVView
    from streamworld.engine.kv_pool import Stage

    stage, frames, p = Stage(0, 0, 2), 3, 2
    cache = KVCache([stage], 9, p, 1, 2, torch.float32, torch.device("cpu"))
    cache.keys[0].fill_(-1.0)
    cache.values[0].fill_(-1.0)
    views = [PagedKVView(cache, stage, [], list(w), p, 0, 0) for w in writes]
    batch = PagedKVView.plan(views)
    key = torch.arange(2 * frames * p * 2, dtype=torch.float32).view(2, frames * p, 1, 2)
    batch.store(1, key, -key)
    expected = torch.full_like(cache.keys[0][:, 1], -1.0)
    for unit, versions in enumerate(writes):
        for pages in versions:
            for f, page in enumerate(pages):
                expected[page] = key[unit, f * p : (f + 1) * p]
    assert torch.equal(cache.keys[0][:, 1], expected)
    assert torch.equal(cache.keys[0][:, 0], torch.full_like(expected, -1.0))  # block 0 untouched
    written = expected != -1.0
    assert torch.equal(cache.values[0][:, 1][written], -expected[written])


def test_decode_results_go_to_the_host_in_their_own_order_whatever_their_shapes():
    """`_batched_to_host` copies tensors of one shape and dtype together: each result is
    still its own tensor's values, in the order given."""
    from streamworld.engine.runner import _batched_to_host

    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.rand(1, 2, 3, generator=g),
        torch.randint(0, 255, (1, 4), generator=g).to(torch.uint8),
        torch.rand(1, 2, 3, generator=g),
        torch.rand(1, 5, generator=g),
        torch.randint(0, 255, (1, 4), generator=g).to(torch.uint8),
    ]
    hosted = _batched_to_host(tensors)
    assert len(hosted) == len(tensors)
    for t, h in zip(tensors, hosted, strict=True):
        assert h.dtype == t.dtype and h.device.type == "cpu" and torch.equal(h, t[0])


def test_graph_stats_sum_the_stages_counters():
    """`ModelRunner.graph_stats` (what `bench` and `eval --plan` report) adds up every
    stage's CUDA-graph counters, and is None where the runner has no graphs."""
    from types import SimpleNamespace

    from streamworld.engine.graphs import GraphStats
    from streamworld.engine.runner import ModelRunner

    stages = [
        SimpleNamespace(stats=GraphStats(captured=2, replays=10, eager=3)),
        SimpleNamespace(stats=GraphStats(1, 5, 1, 1)),
    ]
    assert ModelRunner.graph_stats(SimpleNamespace(graphs=stages)) == {
        "captured": 3,
        "replays": 15,
        "eager": 4,
        "evicted": 1,
        "failures": 0,
    }
    assert ModelRunner.graph_stats(SimpleNamespace(graphs=None)) is None
