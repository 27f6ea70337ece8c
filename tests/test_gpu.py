"""GPU-only checks: CUDA execution, bf16, and the real Wan 2.1 T2V 1.3B size.

Run on a CUDA machine with `python -m pytest -m gpu -s` (not part of CI, which has no GPU).
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

from streamworld.engine.reference import ContiguousKVCache, GenerationRequest, ReferenceGenerator
from streamworld.models import causal_wan, get_preset
from streamworld.models.causal_wan import ChunkInput
from streamworld.models.world_model import WorldModel
from tests.conftest import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on one)"),
]


@pytest.fixture(autouse=True)
def _give_cached_memory_back():
    """After each test, the allocator's cached blocks go back to the GPU. Engines size their
    K/V pool from the free memory (`kv_memory_fraction`); without this, blocks cached by
    earlier tests (about 40 GiB once) left a later engine's decoder out of memory."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cached_vs_full(model: WorldModel, chunks: int) -> tuple[float, float]:
    """(relative error of the cached chunk forward vs. the block-causal full sequence, full norm)."""
    cfg = model.config
    f = cfg.latent_frames_per_chunk
    dev = model.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    clean = torch.randn(model.latent_shape((chunks - 1) * f), generator=gen).to(dev)
    noisy = torch.randn(model.latent_shape(f), generator=gen).to(dev)
    noisy_t = torch.full((f,), 750.0, device=dev)
    text = model.text_context("a red car on a wet road")
    cache = ContiguousKVCache(1, cfg.num_layers, cfg.tokens_per_frame, cfg.sink_frames, 10 * chunks * f)
    outs = []
    with torch.inference_mode():
        for c in range(chunks - 1):
            view = cache.view(c * f, 0, (0,))
            unit = ChunkInput(clean[:, c * f : (c + 1) * f], torch.zeros(f, device=dev), text, view)
            outs.append(model.dit.forward_chunk([unit])[0])
        view = cache.view((chunks - 1) * f, 0, ())
        outs.append(model.dit.forward_chunk([ChunkInput(noisy, noisy_t, text, view)])[0])
        seq = torch.cat([clean, noisy], dim=1).unsqueeze(0)
        t = torch.cat([torch.zeros((chunks - 1) * f, device=dev), noisy_t]).unsqueeze(0)
        ids = torch.arange(chunks, device=dev).repeat_interleave(f)
        full = model.dit.forward_sequence(seq, t, text, ids)[0]
    return _rel_err(torch.cat(outs, dim=1), full), full.float().norm().item()


def test_tiny_cached_forward_equals_full_sequence_on_cuda_float32():
    model = WorldModel.load(tiny_config(window_frames=12), device="cuda", dtype="float32")
    err, _ = _cached_vs_full(model, chunks=4)
    print(f"\ntiny-wan cuda float32: cached vs full relative error {err:.2e}")
    assert err < 1e-4


def test_reference_on_cuda_matches_cpu_for_tiny_wan():
    req = GenerationRequest(seed=1, num_chunks=2, prompt="x", kv_mode="noisy")
    cpu = ReferenceGenerator(WorldModel.load(tiny_config(), device="cpu")).generate(req)
    cuda = ReferenceGenerator(WorldModel.load(tiny_config(), device="cuda", dtype="float32")).generate(req)
    err = _rel_err(cuda.latents, cpu.latents)
    print(f"\ntiny-wan latents cuda vs cpu relative error {err:.2e}")
    assert err < 1e-3


@pytest.fixture(scope="module")
def wan13b() -> WorldModel:
    t0 = time.perf_counter()
    model = WorldModel.load(
        get_preset("wan2.1-t2v-1.3b"), random_weights=True, device="cuda", dtype="bfloat16"
    )
    print(f"\nwan2.1-t2v-1.3b random weights loaded in {time.perf_counter() - t0:.1f} s")
    return model


def test_wan13b_bf16_cached_forward_close_to_full_sequence(wan13b):
    err, norm = _cached_vs_full(wan13b, chunks=3)
    print(f"\nwan2.1-t2v-1.3b bf16 480x832: cached vs full relative error {err:.2e} (|full| {norm:.1f})")
    assert err < 3e-2


@pytest.mark.parametrize("kv_mode", ["clean", "final", "noisy"])
def test_wan13b_generates_480x832_chunks_in_every_kv_mode(wan13b, kv_mode):
    cfg = wan13b.config
    gen = ReferenceGenerator(wan13b)
    gen.generate(GenerationRequest(seed=0, num_chunks=1, prompt="warm-up", kv_mode=kv_mode))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = gen.generate(
        GenerationRequest(seed=0, num_chunks=3, prompt="a fox in the snow", kv_mode=kv_mode)
    )
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    frames = result.frames
    assert frames.shape == (cfg.first_chunk_frames + 2 * cfg.frames_per_chunk, 480, 832, 3)
    assert torch.isfinite(result.latents).all()
    assert frames.std() > 1.0  # not a constant image
    print(
        f"\nwan2.1-t2v-1.3b {kv_mode}: 3 chunks, {frames.shape[0]} frames in {elapsed:.2f} s "
        f"({frames.shape[0] / elapsed:.1f} frames/s, sequential reference, no engine); "
        f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )


def _engine_run(model: WorldModel, requests, inspect=None, **config):
    import asyncio

    from streamworld.engine import AsyncEngine, EngineConfig, SchedulerConfig

    async def main():
        scheduler = config.pop("scheduler", SchedulerConfig(lookahead_chunks=1e6))
        cfg = EngineConfig(ttff_budget_s=1e3, scheduler=scheduler, **config)
        async with AsyncEngine(model, cfg) as engine:
            assert engine.overlap == (len(engine.ranks) == 1)  # on by default with one rank on a GPU
            handles = [engine.open_stream(r) for r in requests]

            async def collect(h):
                return [c async for c in h]

            outs = await asyncio.gather(*(collect(h) for h in handles))
            if inspect is not None:
                inspect(engine)
            return outs, dict(engine.stats.batch_sizes), engine.pool.pages_used

    return asyncio.run(main())


def test_engine_with_cuda_stream_ranks_matches_the_reference_tiny_wan():
    from streamworld.engine import StreamRequest

    model = WorldModel.load(tiny_config(), device="cuda", dtype="float32")
    modes = ["clean", "final", "noisy", "noisy"]
    requests = [StreamRequest(seed=i, num_chunks=3, prompt=f"p{i}", kv_mode=m) for i, m in enumerate(modes)]
    outs, batches, pages_used = _engine_run(model, requests, num_stages=2, num_ranks=2)
    assert pages_used == 0
    assert max(batches) > 1
    ref = ReferenceGenerator(model)
    for req, out in zip(requests, outs, strict=True):
        expected = ref.generate(
            GenerationRequest(seed=req.seed, num_chunks=3, prompt=req.prompt, kv_mode=req.kv_mode)
        )
        got = torch.cat([o.latents for o in out], dim=1)
        err = _rel_err(got, expected.latents)
        print(
            f"\nengine (2 CUDA-stream ranks) vs reference, tiny-wan float32 {req.kv_mode}: rel err {err:.1e}"
        )
        assert err < 1e-4


def test_a_two_stage_pipeline_on_one_gpu_as_two_virtual_devices_matches_the_reference(wan13b):
    """cuda:0 twice: two stages on two ranks (two CUDA streams) of one GPU, bf16."""
    from streamworld.engine import StreamRequest, parse_placement

    placement = parse_placement("pipeline", ["cuda:0", "cuda:0"], wan13b.config.num_layers).replicas[0]
    requests = [
        StreamRequest(seed=i, num_chunks=2, prompt="a fox", kv_mode=m)
        for i, m in enumerate(["noisy", "clean"])
    ]
    outs, _, pages_used = _engine_run(wan13b, requests, placement=placement)
    assert pages_used == 0
    ref = ReferenceGenerator(wan13b)
    for req, out in zip(requests, outs, strict=True):
        expected = ref.generate(
            GenerationRequest(seed=req.seed, num_chunks=2, prompt="a fox", kv_mode=req.kv_mode)
        )
        err = _rel_err(torch.cat([o.latents for o in out], dim=1), expected.latents)
        print(
            f"\n2-stage pipeline on cuda:0 x2 vs reference, wan2.1-t2v-1.3b bf16 {req.kv_mode}:"
            f" rel err {err:.1e}"
        )
        assert err < 5e-2


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    # Runs on a 2-GPU host (issue "Measure several GPUs"). On one GPU, the two-stage test on
    # virtual devices and the stage-link test cover the same code but the copy between devices.
    reason="a pipeline across GPUs needs two CUDA devices and this machine has fewer; the "
    "one-GPU stage tests cover all but the copy between devices (run it on a 2-GPU host)",
)
@pytest.mark.parametrize("kv_mode", ["clean", "final", "noisy"])
def test_a_pipeline_across_two_gpus_matches_the_reference_tiny_wan(kv_mode):
    """Blocks, K/V pages and activations really on two devices (float32)."""
    from streamworld.engine import StreamRequest, parse_placement

    model = WorldModel.load(tiny_config(), device="cuda:0", dtype="float32")
    placement = parse_placement("0-1@cuda:0,2-3@cuda:1,decode@cuda:1", [], 4).replicas[0]
    model.place([(s.start, s.stop, s.device) for s in placement.stages], placement.decoder_device)
    requests = [StreamRequest(seed=i, num_chunks=3, prompt=f"p{i}", kv_mode=kv_mode) for i in range(3)]
    outs, _, pages_used = _engine_run(model, requests, placement=placement)
    assert pages_used == 0
    reference = WorldModel.load(tiny_config(), device="cuda:0", dtype="float32")
    ref = ReferenceGenerator(reference)
    for req, out in zip(requests, outs, strict=True):
        expected = ref.generate(
            GenerationRequest(seed=req.seed, num_chunks=3, prompt=req.prompt, kv_mode=kv_mode)
        )
        err = _rel_err(torch.cat([o.latents for o in out], dim=1), expected.latents)
        print(f"\npipeline cuda:0 -> cuda:1 vs reference, tiny-wan float32 {kv_mode}: rel err {err:.1e}")
        assert err < 1e-4


def test_engine_with_overlapped_dispatch_matches_the_reference_tiny_wan():
    """One rank on a GPU queues each batch while the previous one runs (overlapped dispatch);
    every stream must still equal the reference, with decodes waiting for the DiT's events."""
    from streamworld.engine import StreamRequest

    model = WorldModel.load(tiny_config(), device="cuda", dtype="float32")
    modes = ["clean", "final", "noisy", "noisy", "noisy"]
    requests = [StreamRequest(seed=i, num_chunks=4, prompt=f"p{i}", kv_mode=m) for i, m in enumerate(modes)]
    outs, batches, pages_used = _engine_run(model, requests)
    assert pages_used == 0 and max(batches) > 1
    ref = ReferenceGenerator(model)
    for req, out in zip(requests, outs, strict=True):
        expected = ref.generate(
            GenerationRequest(seed=req.seed, num_chunks=4, prompt=req.prompt, kv_mode=req.kv_mode)
        )
        err = _rel_err(torch.cat([o.latents for o in out], dim=1), expected.latents)
        frames = torch.from_numpy(np.concatenate([o.frames for o in out])).int()
        frame_err = (frames - torch.from_numpy(expected.frames).int()).abs().max().item()
        print(f"\noverlapped dispatch vs reference, tiny-wan float32 {req.kv_mode}: rel err {err:.1e}")
        # Batches of up to 5 units against the reference's single units: float32 rounding
        # over 4 chunks reached 1.02e-4 once; a missed wait would give errors of order 1.
        assert err < 1e-3 and frame_err <= 2


def test_overlapped_decode_waits_for_slow_dit_kernels():
    """Each unit's kernels queue behind a long GPU sleep on the rank's stream, so they finish
    long after the host has moved on: a decode that did not wait for the chunk's CUDA event
    would read latents not yet written."""
    from streamworld.engine import StreamRequest

    model = WorldModel.load(tiny_config(), device="cuda", dtype="float32")

    def slow(unit) -> None:
        torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time before this unit's kernels

    requests = [StreamRequest(seed=i, num_chunks=3, prompt="p", kv_mode="noisy") for i in range(3)]
    outs, _, pages_used = _engine_run(model, requests, fault_hook=slow)
    assert pages_used == 0
    ref = ReferenceGenerator(model)
    for req, out in zip(requests, outs, strict=True):
        expected = ref.generate(GenerationRequest(seed=req.seed, num_chunks=3, prompt="p", kv_mode="noisy"))
        err = _rel_err(torch.cat([o.latents for o in out], dim=1), expected.latents)
        print(f"\noverlapped dispatch with slow DiT kernels vs reference: rel err {err:.1e}")
        assert err < 1e-3


def test_executors_wait_for_work_queued_on_the_default_stream():
    """Work still queued on the default stream when an engine starts (here the text encoder's
    weights being restored behind a GPU sleep; in the field, a model's initialisation) must
    come before the executors' work, which runs on streams of their own."""
    from streamworld.engine import StreamRequest

    model = WorldModel.load(tiny_config(), device="cuda", dtype="float32")
    request = StreamRequest(seed=5, num_chunks=2, prompt="a fox", kv_mode="noisy")
    expected = ReferenceGenerator(model).generate(
        GenerationRequest(seed=5, num_chunks=2, prompt="a fox", kv_mode="noisy")
    )
    model._text_cache.clear()
    model.text_encoder.clear_cache()
    params = list(model.text_encoder.model.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.fill_(float("nan"))
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the default stream
        for p, kept in zip(params, saved, strict=True):
            p.copy_(kept)  # queued behind the sleep
    (out,), _, pages_used = _engine_run(model, [request])
    err = _rel_err(torch.cat([o.latents for o in out], dim=1), expected.latents)
    print(f"\nengine started behind default-stream work vs reference: rel err {err:.1e}")
    assert pages_used == 0 and err < 1e-3


def test_engine_runs_wan13b_streams_in_bf16(wan13b):
    from streamworld.engine import StreamRequest

    requests = [StreamRequest(seed=i, num_chunks=2, prompt="a fox", kv_mode="noisy") for i in range(2)]
    t0 = time.perf_counter()
    outs, batches, pages_used = _engine_run(wan13b, requests)
    elapsed = time.perf_counter() - t0
    assert pages_used == 0
    ref = ReferenceGenerator(wan13b)
    for req, out in zip(requests, outs, strict=True):
        expected = ref.generate(
            GenerationRequest(seed=req.seed, num_chunks=2, prompt="a fox", kv_mode="noisy")
        )
        err = _rel_err(torch.cat([o.latents for o in out], dim=1), expected.latents)
        print(f"\nengine vs reference, wan2.1-t2v-1.3b bf16 480x832 noisy: latents rel err {err:.1e}")
        assert err < 5e-2
        assert out[0].frames.shape[1:] == (480, 832, 3)
    print(f"engine: 2 streams x 2 chunks in {elapsed:.2f} s, batch sizes {batches}")


def _one_chunk_flow(model: WorldModel) -> torch.Tensor:
    """The DiT's flow for one noisy chunk after one clean chunk in the cache."""
    cfg = model.config
    f, dev = cfg.latent_frames_per_chunk, model.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    clean = torch.randn(model.latent_shape(f), generator=gen).to(dev)
    noisy = torch.randn(model.latent_shape(f), generator=gen).to(dev)
    text = model.text_context("a red car")
    cache = ContiguousKVCache(1, cfg.num_layers, cfg.tokens_per_frame, cfg.sink_frames, 4 * f)
    with torch.inference_mode():
        model.dit.forward_chunk([ChunkInput(clean, torch.zeros(f, device=dev), text, cache.view(0, 0, (0,)))])
        unit = ChunkInput(noisy, torch.full((f,), 750.0, device=dev), text, cache.view(f, 0, ()))
        return model.dit.forward_chunk([unit])[0]


def test_compiled_elementwise_matches_eager_tiny_float32_and_wan13b_bf16(wan13b):
    tiny = WorldModel.load(tiny_config(), device="cuda", dtype="float32")
    eager = _one_chunk_flow(tiny)
    tiny.dit.compile_elementwise(tiny.config.latent_frames_per_chunk)
    err = _rel_err(_one_chunk_flow(tiny), eager)
    print(f"\ncompiled vs eager elementwise, tiny-wan cuda float32: rel err {err:.1e}")
    assert tiny.dit.elementwise_compiled and err < 1e-5

    eager = _one_chunk_flow(wan13b)
    try:
        wan13b.dit.compile_elementwise(wan13b.config.latent_frames_per_chunk)
        err = _rel_err(_one_chunk_flow(wan13b), eager)
    finally:
        wan13b.dit._ops = causal_wan._EAGER  # the shared fixture stays eager
    print(f"compiled vs eager elementwise, wan2.1-t2v-1.3b bf16 480x832: rel err {err:.1e}")
    assert err < 2e-2


def test_lite_decoder_streams_chunk_by_chunk_on_cuda_bf16(wan13b):
    from streamworld.models.lite_decoder import LiteDecoder
    from streamworld.models.vae import StreamingVAE

    cfg = wan13b.config
    vae = StreamingVAE(wan13b.vae.vae)
    vae.use_lite_decoder(LiteDecoder.for_model(cfg))
    f = cfg.latent_frames_per_chunk
    z = torch.randn(2, cfg.latent_channels, 2 * f, cfg.latent_height, cfg.latent_width, device="cuda")
    full = vae.decode_full(z)
    states = [vae.new_decoder_state() for _ in range(2)]
    first = vae.decode_chunks([z[:1, :, :f], z[1:, :, :f]], states)
    second = vae.decode_chunks([z[:1, :, f:], z[1:, :, f:]], states)
    chunked = torch.cat([torch.cat([a, b], dim=2) for a, b in zip(first, second, strict=True)])
    assert full.shape == (2, 3, 1 + cfg.temporal_ratio * (2 * f - 1), 480, 832)
    err = _rel_err(chunked, full)
    print(f"\nlite decoder bf16 480x832: chunked (batched) vs whole clip rel err {err:.1e}")
    assert err < 2e-2


def test_compiled_lite_decoder_matches_eager_on_cuda_bf16(wan13b):
    import copy

    from streamworld.models.lite_decoder import LiteDecoder
    from streamworld.models.vae import StreamingVAE

    cfg = wan13b.config
    eager = StreamingVAE(wan13b.vae.vae).use_lite_decoder(LiteDecoder.for_model(cfg))
    compiled = StreamingVAE(wan13b.vae.vae).use_lite_decoder(copy.deepcopy(eager.lite))
    f = cfg.latent_frames_per_chunk
    compiled.lite.compile_for(cfg.latent_height, cfg.latent_width, f)
    # 8 streams at 480x832 exceed 32-bit indexing in one call: they decode in parts.
    limit = compiled.lite.batch_limit
    assert limit is not None and 1 < limit < 8
    z = torch.randn(8, cfg.latent_channels, 2 * f, cfg.latent_height, cfg.latent_width, device="cuda")
    errs = []
    for batch in (1, 3, 8):
        outs = []  # per decoder: each stream's two chunks, [1, 3, T, H, W]
        for vae in (compiled, eager):
            states = [vae.new_decoder_state() for _ in range(batch)]
            chunks = [
                vae.decode_chunks([z[i : i + 1, :, s : s + f] for i in range(batch)], states) for s in (0, f)
            ]
            outs.append([torch.cat([c[i] for c in chunks], dim=2) for i in range(batch)])
        errs.append(_rel_err(torch.cat(outs[0]), torch.cat(outs[1])))
        # Eager against eager is bit-identical: a difference in every stream shows that the
        # compiled kernels decoded it (a batch that missed every compiled variant would
        # decode eagerly, and slowly).
        assert all(_rel_err(a, b) > 0 for a, b in zip(*outs, strict=True))
    print(
        f"\ncompiled vs eager lite decoder bf16 480x832 (batch limit {limit}), 1 stream, 3 and 8 "
        f"batched: rel err {errs[0]:.1e}, {errs[1]:.1e}, {errs[2]:.1e}"
    )
    assert max(errs) < 2e-2


def test_engine_runs_wan13b_with_lite_decoder_and_compiled_elementwise():
    from streamworld.engine import StreamRequest

    model = WorldModel.load(
        get_preset("wan2.1-t2v-1.3b"),
        random_weights=True,
        device="cuda",
        dtype="bfloat16",
        decoder="lite",
        compiled=True,
    )
    requests = [StreamRequest(seed=i, num_chunks=2, prompt="a fox", kv_mode="noisy") for i in range(2)]
    outs, batches, pages_used = _engine_run(model, requests)
    assert pages_used == 0
    cfg = model.config
    for out in outs:
        assert [o.frames.shape[0] for o in out] == [cfg.first_chunk_frames, cfg.frames_per_chunk]
        assert out[0].frames.shape[1:] == (480, 832, 3)
    print(f"\nengine, lite decoder + compiled elementwise: batch sizes {batches}")


def test_a_stage_link_orders_the_receiver_after_its_copy_without_blocking_the_host():
    """The copy between stages runs on the sender's side stream behind the stage's kernels;
    the receiving stream waits for its event. Forced onto one GPU (a copy within cuda:0
    takes the same code path as one between two GPUs)."""
    from streamworld.engine.stage_link import StageLink

    dev = torch.device("cuda:0")
    link = StageLink(dev, dev)
    link.crosses, link.stream = True, torch.cuda.Stream(dev)
    sender, receiver = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    n = 1 << 20
    with torch.cuda.stream(sender):
        x = torch.zeros(n, device=dev)
        torch.cuda._sleep(1_000_000_000)  # the stage's kernels: about half a second
        x.fill_(7.0)
        (y,), event = link.send([x])
    # The host is back before the stage has run, so before the copy has.
    assert event is not None and not event.query()
    with torch.cuda.stream(receiver):
        StageLink.receive([y], event)
        total = y.sum()
    receiver.synchronize()  # `item` reads on the default stream, which orders nothing here
    assert y.data_ptr() != x.data_ptr() and total.item() == 7.0 * n
    torch.cuda.synchronize()
    print(f"\nstage link: {link.bytes} bytes in {link.copy_s * 1e3:.3f} ms")
    assert link.bytes == 4 * n and link.copy_s > 0


def _graph_stats(engine, into: dict) -> None:
    for graphs in engine.runner.graphs or ():  # None when the engine runs eagerly
        for k, v in graphs.stats.to_json().items():
            into[k] = into.get(k, 0) + v


def _graphed_vs_reference(model: WorldModel, requests, label: str, tolerance: float, **config) -> dict:
    stats: dict = {}
    outs, batches, pages_used = _engine_run(
        model, requests, inspect=lambda e: _graph_stats(e, stats), cuda_graphs=True, **config
    )
    assert pages_used == 0
    ref = ReferenceGenerator(model)
    for req, out in zip(requests, outs, strict=True):
        request = GenerationRequest(req.seed, req.num_chunks, prompt=req.prompt, kv_mode=req.kv_mode)
        expected = ref.generate(request)
        err = _rel_err(torch.cat([o.latents for o in out], dim=1), expected.latents)
        print(f"\nCUDA graphs vs reference, {label} {req.kv_mode}: rel err {err:.1e}")
        assert err < tolerance
    print(f"graphs: {stats}; batch sizes {batches}")
    assert stats["captured"] > 0 and stats["replays"] > 0 and stats["failures"] == 0
    return stats


def test_cuda_graphs_match_the_reference_tiny_wan_with_sinks_moving_and_prompts_changing_slots():
    """Five chunks pass the tiny model's window, so the sinks move; four streams with three
    prompts in every mode make batches whose prompts change text slots; eager elementwise
    and compiled (Triton kernels inside the graph) both; one stage and two stages on two
    CUDA-stream ranks (the second stage's graph reads the first's activation)."""
    from streamworld.engine import StreamRequest

    modes = ["clean", "final", "noisy", "noisy"]
    prompts = ["p0", "p1", "p0", "p2"]
    requests = [
        StreamRequest(seed=i, num_chunks=5, prompt=p, kv_mode=m)
        for i, (m, p) in enumerate(zip(modes, prompts, strict=True))
    ]
    model = WorldModel.load(tiny_config(), device="cuda", dtype="float32")
    _graphed_vs_reference(model, requests, "tiny-wan float32", 1e-3)
    _graphed_vs_reference(model, requests, "tiny-wan float32, 2 stages", 1e-3, num_stages=2, num_ranks=2)
    model.dit.compile_elementwise(model.config.latent_frames_per_chunk)
    _graphed_vs_reference(model, requests, "tiny-wan float32 compiled", 1e-3)


def test_cuda_graphs_with_room_for_two_keep_two_and_still_match_the_reference(monkeypatch):
    """With room for only two graphs per stage, the many batch shapes of four streams in
    every mode keep at most two graphs at a time (`CaptureChoice`), the rest run eagerly,
    and the frames still equal the reference's."""
    import functools

    from streamworld.engine import StreamRequest, runner
    from streamworld.engine.graphs import StageGraphs

    monkeypatch.setattr(runner, "StageGraphs", functools.partial(StageGraphs, max_graphs=2))
    requests = [
        StreamRequest(seed=i, num_chunks=5, prompt=f"p{i % 2}", kv_mode=m)
        for i, m in enumerate(["clean", "final", "noisy", "noisy"])
    ]
    model = WorldModel.load(tiny_config(), device="cuda", dtype="float32")
    stats = _graphed_vs_reference(model, requests, "tiny-wan float32, two graphs", 1e-3)
    assert stats["captured"] - stats["evicted"] <= 2  # one stage: never more than two kept


def test_cuda_graphs_match_the_reference_wan13b_bf16(wan13b):
    from streamworld.engine import SchedulerConfig, StreamRequest

    # One unit per batch (`--token-budget 8192` at 480x832). Chosen when the noisy mode's
    # pipelined chunks mixed context lengths in larger batches, which run eagerly; the
    # scheduler now batches one context length at a time.
    scheduler = SchedulerConfig(lookahead_chunks=1e6, token_budget=8192)
    requests = [StreamRequest(seed=i, num_chunks=3, prompt="a fox", kv_mode="noisy") for i in range(2)]
    stats = _graphed_vs_reference(wan13b, requests, "wan2.1-t2v-1.3b bf16 480x832", 5e-2, scheduler=scheduler)
    assert stats["eager"] < stats["replays"]


@pytest.mark.parametrize("prediction", ["x0", "delta"])
def test_forks_under_cuda_graphs_equal_forks_run_eagerly_pusht(prediction):
    """The planner's workload on the GPU: the shipped PushT model (first frame and actions),
    two forks of 16 branches of 8 frames from one observed frame, with and without CUDA
    graphs. Branches of one fork have one batch shape, so the second fork replays graphs.
    "delta": the same with a seeded random model that predicts each chunk's change since the
    last frame before it."""
    import asyncio

    import numpy as np

    from streamworld.engine import AsyncEngine, EngineConfig, SchedulerConfig
    from streamworld.models import get_preset
    from streamworld.planning import EngineRollouts
    from streamworld.pusht.world import initial_frame

    config = get_preset("pusht").with_prediction(prediction)
    model = WorldModel.load(config, device="cuda", dtype="float32", random_weights=prediction == "delta")
    assert model.schedule.prediction == prediction
    frame, _ = initial_frame(0, model.config.height)
    candidates = np.random.default_rng(0).uniform(0, 512, (16, 8, 2)).astype(np.float32)

    async def rollouts(cuda_graphs: bool):
        cfg = EngineConfig(
            ttff_budget_s=1e3,
            scheduler=SchedulerConfig(lookahead_chunks=1e6),
            max_streams=17,
            cuda_graphs=cuda_graphs,
        )
        async with AsyncEngine(model, cfg) as engine:
            fork = EngineRollouts(engine, frame)
            predicted = [await fork(candidates), await fork(candidates[::-1].copy())]
            fork.close()
            stats: dict = {}
            _graph_stats(engine, stats)
            return predicted, stats, engine.pool.pages_used

    eager, _, _ = asyncio.run(rollouts(False))
    graphed, stats, pages_used = asyncio.run(rollouts(True))
    print(f"\nforks under CUDA graphs, pusht float32 {prediction}: graphs {stats}")
    assert pages_used == 0
    assert stats["captured"] > 0 and stats["replays"] > 0 and stats["failures"] == 0
    for a, b in zip(eager, graphed, strict=True):
        assert a.shape == (16, 8, 64, 64, 3)
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 2
    # The second fork's candidates are the first's reversed: so are its predictions.
    assert np.abs(eager[1][::-1].astype(int) - eager[0].astype(int)).max() <= 2


def test_the_planner_scores_a_fork_on_the_gpu_as_numpy_does_frame_by_frame():
    """`eval pusht --plan` on CUDA scores each fork's frames on the GPU at once
    (`pusht/batch_locate.py`): the same costs as the host's frame-by-frame NumPy."""
    from tests.test_planning import check_fork_cost_matches_frame_by_frame

    check_fork_cost_matches_frame_by_frame("cuda")
