"""The scheduler alone: plain metadata, no model and no tensors."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from streamworld.engine.config import SchedulerConfig
from streamworld.engine.kv_modes import (
    COMMIT,
    chunk_phases,
    context_frame_count,
    context_frame_indices,
    unit_index,
)
from streamworld.engine.kv_pool import KVPagePool, PageTable
from streamworld.engine.request import PRIORITY_CLASSES, StreamRequest
from streamworld.engine.scheduler import ReadyUnit, Scheduler, context_frames
from streamworld.engine.stream import ActionTrack, Stream, WorkUnit, chunk_duration_s
from streamworld.models.presets import PUSHT, TINY_WAN

T0 = 1000.0  # every stream starts here; times are explicit, never read from a clock
STEPS, STAGES = 4, 2


def make_stream(sid: int, config=TINY_WAN, *, priority="standard", kv_mode="noisy", policy="hold", at=T0):
    request = StreamRequest(seed=sid, kv_mode=kv_mode, priority=priority, action_policy=policy)
    stream = Stream(
        id=sid,
        request=request,
        config=config,
        kv_mode=kv_mode,
        priority=PRIORITY_CLASSES[priority],
        created_at=at,
        chunk_duration=chunk_duration_s(config),
        ttff_budget=1.0,
        actions=ActionTrack(config.action_dim),
        output=asyncio.Queue(),
    )
    table = PageTable(KVPagePool(STAGES, 10_000), STEPS, config.sink_frames, config.window_frames, 0)
    stream.admit(table, ("fresh",), at)
    stream.text_ready = True
    return stream


def scheduler(**config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), num_stages=STAGES, num_steps=STEPS, max_decode_batch=3)


def ready(sid: int, *, priority=1, deadline=0.0, stage=0, frames=3, tokens=100, chunk=0) -> ReadyUnit:
    return ReadyUnit(WorkUnit(sid, chunk, 0, stage), priority, deadline, tokens, (stage, frames, 0))


def test_the_most_urgent_class_leads_the_batch_whatever_its_deadline():
    batch = scheduler().next_batch(
        [ready(1, priority=2, deadline=1.0), ready(2, priority=0, deadline=50.0), ready(3, priority=1)]
    )
    assert [r.unit.stream for r in batch] == [2, 3, 1]


def test_earliest_deadline_first_within_a_class():
    units = [ready(s, deadline=d) for s, d in ((1, 30.0), (2, 10.0), (3, 20.0))]
    assert [r.unit.stream for r in scheduler().next_batch(units)] == [2, 3, 1]


def test_a_batch_holds_one_stage_and_shape_within_the_token_budget():
    units = [
        ready(1, deadline=1.0, tokens=400),
        ready(2, deadline=2.0, stage=1),  # another stage: never in the same batch
        ready(3, deadline=3.0, frames=1),  # another chunk shape
        ready(4, deadline=4.0, tokens=400),
        ready(5, deadline=5.0, tokens=400),  # would pass the budget
        ready(6, deadline=6.0, tokens=200),
    ]
    batch = scheduler(token_budget=1000).next_batch(units)
    assert [r.unit.stream for r in batch] == [1, 4, 6]
    assert sum(r.tokens for r in batch) <= 1000
    assert len(scheduler(max_batch_units=2).next_batch(units)) == 2
    assert scheduler().next_batch([]) == []


def test_context_frame_count_is_the_length_of_the_context():
    for sink, window in ((0, 4), (1, 5), (3, 15), (2, 0)):
        for first in range(40):
            assert context_frame_count(first, sink, window) == len(context_frame_indices(first, sink, window))


def test_units_batch_only_with_units_of_the_same_context_length():
    """The runner reads a batch's K/V in one gather (and a CUDA graph replays it) only when
    every unit attends to as many frames; units whose contexts differ go in separate batches."""
    sched = scheduler()
    config = dataclasses.replace(TINY_WAN, sink_frames=1, window_frames=5)
    streams = [make_stream(sid, config, kv_mode="final") for sid in (1, 2, 3)]
    for stream, chunks in zip(streams, (1, 2, 1), strict=True):  # stream 2 is one chunk further on
        for _ in range(chunks):
            stream.start_chunk(chunk_phases("final", STEPS), T0)
        for c in range(chunks - 1):  # finished and retired: its context is written
            del stream.chunks[c]
    ready_now = sched.ready_units(streams, 0)
    contexts = {r.unit.stream: r.shape[2] for r in ready_now}
    assert contexts == {1: 0, 2: 3, 3: 0}
    batch = sched.next_batch(ready_now)
    assert sorted(r.unit.stream for r in batch) == [1, 3]
    assert [r.unit.stream for r in sched.next_batch([r for r in ready_now if r not in batch])] == [2]

    # Past the window every chunk attends to the sink and the window: one context length.
    far = [make_stream(sid, config, kv_mode="final") for sid in (4, 5)]
    for stream, chunks in zip(far, (3, 5), strict=True):
        for _ in range(chunks):
            stream.start_chunk(chunk_phases("final", STEPS), T0)
        for c in range(chunks - 1):
            del stream.chunks[c]
    ready_far = sched.ready_units(far, 0)
    assert {r.shape[2] for r in ready_far} == {1 + 5}
    assert len(sched.next_batch(ready_far)) == 2


def test_an_image_models_chunks_count_the_first_image_as_context():
    """PushT: the first image's prefill attends to nothing, chunk 0 to the image (the sink),
    then the window fills (4 frames a chunk, a window of 8) and stays full."""
    stream = make_stream(7, PUSHT, kv_mode="final")
    contexts = [context_frames(stream, stream.start_prefill(T0))]
    for _ in range(5):
        contexts.append(context_frames(stream, stream.start_chunk(chunk_phases("final", STEPS), T0)))
    assert contexts == [0, 1, 5, 9, 9, 9]


def test_lookahead_bounds_how_early_a_chunk_starts():
    sched = scheduler(lookahead_chunks=2.0)
    stream = make_stream(1)
    duration = stream.chunk_duration
    # Chunk 0 is due at T0 + 1 s (the first-frame budget): it may start 2 durations before.
    early = T0 + 1.0 - 2 * duration - 0.01
    started, wake = sched.start_chunks([stream], early, None)
    assert started == [] and wake == pytest.approx(T0 + 1.0 - 2 * duration)
    started, _ = sched.start_chunks([stream], wake, None)
    assert [c.index for _, c in started] == [0]
    assert stream.chunks[0].phases == chunk_phases("noisy", STEPS)
    # Chunk 1 waits for chunk 0's first unit (its context) even when its time has come.
    started, _ = sched.start_chunks([stream], T0 + 100.0, None)
    assert started == []
    stream.chunks[0].progress = 1
    started, _ = sched.start_chunks([stream], T0 + 100.0, None)
    assert [c.index for _, c in started] == [1]


def test_interactive_chunks_start_just_in_time_and_others_at_the_lookahead():
    sched = scheduler(lookahead_chunks=2.0, jit_safety=1.5, jit_margin_s=0.05)
    deadline, duration, est = T0 + 1.0, 0.5, 0.2
    assert sched.chunk_start_time(deadline, 0, duration, est) == pytest.approx(deadline - 1.5 * est - 0.05)
    assert sched.chunk_start_time(deadline, 1, duration, est) == pytest.approx(deadline - 2 * duration)
    # Without a latency estimate the lookahead bound is all there is.
    assert sched.chunk_start_time(deadline, 0, duration, None) == pytest.approx(deadline - 2 * duration)
    interactive, standard = make_stream(1, priority="interactive"), make_stream(2)
    interactive.est_latency = est
    now = T0 + 1.0 - 2 * interactive.chunk_duration
    started, wake = sched.start_chunks([interactive, standard], now, None)
    assert [s.id for s, _ in started] == [2]
    assert wake == pytest.approx(T0 + 1.0 - 1.5 * est - 0.05)


def test_the_wait_policy_starts_a_chunk_once_all_its_actions_are_known():
    sched = scheduler()
    waiting, holding = make_stream(1, PUSHT, policy="wait"), make_stream(2, PUSHT)
    started, _ = sched.start_chunks([waiting, holding], T0 + 10.0, None)
    assert [s.id for s, _ in started] == [2]  # `hold` fills unknown actions with the last one
    need = PUSHT.first_chunk_frames
    waiting.actions.push([[0.5, 0.5]] * (need - 1))
    assert sched.start_chunks([waiting], T0 + 10.0, None)[0] == []
    waiting.actions.push([[0.5, 0.5]])
    started, _ = sched.start_chunks([waiting], T0 + 10.0, None)
    assert [c.index for _, c in started] == [0]
    assert started[0][1].actions.shape[1] == PUSHT.action_dim


def test_paused_unprompted_and_capped_streams_start_nothing():
    sched = scheduler()
    paused, unprompted = make_stream(1), make_stream(2)
    paused.set_paused(True, T0)
    unprompted.text_ready = False
    assert sched.start_chunks([paused, unprompted], T0 + 50.0, None)[0] == []
    capped = make_stream(3)
    for _ in range(STEPS + 1):  # the noisy pipeline's depth, then no more
        for chunk in capped.chunks.values():
            chunk.progress = 1
        sched.start_chunks([capped], T0 + 50.0, None)
    assert len(capped.chunks) == STEPS + 1
    for chunk in capped.chunks.values():
        chunk.progress = 1
    assert sched.start_chunks([capped], T0 + 50.0, None)[0] == []


@pytest.mark.parametrize(
    ("kv_mode", "waits_for"),
    [("noisy", (0, 0)), ("final", (STEPS - 1, 0)), ("clean", (COMMIT, 0))],
)
def test_a_unit_is_ready_once_the_previous_chunk_wrote_its_context(kv_mode, waits_for):
    sched = scheduler()
    stream = make_stream(1, kv_mode=kv_mode)
    stream.start_chunk(chunk_phases(kv_mode, STEPS), T0)
    stream.start_chunk(chunk_phases(kv_mode, STEPS), T0)
    prev = stream.chunks[0]
    needed = unit_index(prev.phases, *waits_for, STAGES) + 1
    prev.progress = needed - 1
    prev.in_flight = True  # only chunk 1 is a candidate
    assert sched.ready_units([stream], 0) == []
    prev.progress = needed
    [unit] = sched.ready_units([stream], 0)
    assert (unit.unit.chunk, unit.unit.phase, unit.unit.stage) == (1, 0, 0)


def test_a_clean_streams_last_chunk_has_no_commit_pass_and_nothing_may_read_after_it():
    """The scheduler starts a stream's last chunk without the commit pass; a chunk that
    would read the K/V it never writes is an internal error, named as such."""
    sched = scheduler()
    stream = make_stream(1, kv_mode="clean")
    stream.request.num_chunks = 2
    started, _ = sched.start_chunks([stream], T0 + 50.0, None)
    assert [c.phases for _, c in started] == [[*range(STEPS), COMMIT]]
    stream.chunks[0].progress = stream.chunks[0].total_units(STAGES)
    started, _ = sched.start_chunks([stream], T0 + 50.0, None)
    assert [c.phases for _, c in started] == [list(range(STEPS))]
    stream.start_chunk(chunk_phases("clean", STEPS), T0)  # past its end: what nothing may do
    stream.chunks[1].in_flight = True
    with pytest.raises(RuntimeError, match="chunk 2 reads K/V that chunk 1, its last, never writes"):
        sched.ready_units([stream], 0)


def test_the_noisy_pipeline_runs_two_chunks_of_one_stream_side_by_side():
    sched = scheduler()
    stream = make_stream(1)
    for _ in range(2):
        stream.start_chunk(chunk_phases("noisy", STEPS), T0)
    stream.chunks[0].progress = unit_index(stream.chunks[0].phases, 1, 0, STAGES)  # at step 1
    units = {(r.unit.chunk, r.unit.phase) for r in sched.ready_units([stream], 0)}
    assert units == {(0, 1), (1, 0)}


def test_units_go_to_the_rank_of_their_stage():
    sched = Scheduler(SchedulerConfig(), num_stages=2, num_steps=STEPS, num_ranks=2)
    stream = make_stream(1)
    stream.start_chunk(chunk_phases("noisy", STEPS), T0)
    assert [r.unit.stage for r in sched.ready_units([stream], 0)] == [0]
    assert sched.ready_units([stream], 1) == []
    stream.chunks[0].progress = 1
    assert [r.unit.stage for r in sched.ready_units([stream], 1)] == [1]


def test_decode_batches_group_equal_decoder_states_of_the_leading_class():
    sched = scheduler()
    streams = [make_stream(i, priority="batch" if i == 5 else "standard") for i in range(1, 9)]
    for s in streams:
        s.start_chunk(chunk_phases("noisy", STEPS), T0)
        s.chunks[0].denoised = True
    streams[1].decoder_signature = ("warm",)  # another decoder position: not with the head
    streams[3].chunks[0].decoding = True  # already decoding
    picked = sched.next_decode_batch(streams)
    # 2: another decoder state, 4: decoding, 5: a lower class; 7 and 8: past the cap of 3.
    assert [s.id for s, _ in picked] == [1, 3, 6]
    assert sched.next_decode_batch([streams[4]]) != []  # alone, a batch stream decodes
    not_next = make_stream(9)
    not_next.next_decode = 1  # decoding is in order: chunk 0 is not this stream's next
    not_next.start_chunk(chunk_phases("noisy", STEPS), T0)
    not_next.chunks[0].denoised = True
    assert sched.next_decode_batch([not_next]) == []


def test_admission_is_first_come_first_served_head_of_line():
    sched = scheduler()
    big, small = make_stream(1), make_stream(2)
    assert sched.next_admission([big, small], lambda s: s is small) is None
    assert sched.next_admission([big, small], lambda s: True) is big
    assert sched.next_admission([], lambda s: True) is None


def test_scheduler_config_is_part_of_the_engine_config():
    from streamworld.engine import EngineConfig

    config = EngineConfig(scheduler=SchedulerConfig(token_budget=7))
    assert dataclasses.replace(config).scheduler.token_budget == 7
