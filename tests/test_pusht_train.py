"""The PushT training forward trains exactly what the cached serving forward computes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from streamworld.engine.reference import ContiguousKVCache
from streamworld.models.causal_wan import ChunkInput
from streamworld.models.pixels import frames_to_latents
from streamworld.models.presets import PUSHT
from streamworld.models.world_model import WorldModel
from streamworld.pusht.train import clip_layout, clip_length, smoke_config


@pytest.fixture(scope="module")
def model() -> WorldModel:
    return WorldModel.load(smoke_config(PUSHT), random_weights=True)


def _sample(cfg, seed: int, chunks: int | None = None):
    g = torch.Generator().manual_seed(seed)
    n = clip_length(cfg, chunks)
    shape = (3, n, cfg.height, cfg.width)
    return (
        torch.rand((3, 1, cfg.height, cfg.width), generator=g) * 2 - 1,  # sink
        torch.rand(shape, generator=g) * 2 - 1,  # clean clip
        torch.randn(shape, generator=g),  # noise
        torch.rand((n, 2), generator=g) * 512,  # actions
    )


@pytest.mark.parametrize("chunks", [None, 5])
@pytest.mark.parametrize("regime", ["clean", "noisy"])
def test_training_layout_equals_cached_forward(model: WorldModel, regime: str, chunks: int | None) -> None:
    """Every chunk of a training clip gets what the cached forward computes: by default up to
    the first chunk whose window is full; with 5 chunks also the two after it, for which the
    cached forward moves the sink up to the window (by 4 and 8 frames)."""
    cfg, dit = model.config, model.dit
    chunk, n = cfg.latent_frames_per_chunk, clip_length(cfg, chunks)
    assert n > cfg.window_frames, "the clip must reach a full window, where frames start leaving it"
    sink, x0, noise, actions = _sample(cfg, 0, chunks)
    sigma = (
        torch.tensor([0.9, 0.5, 0.3, 0.7, 0.2]).repeat_interleave(chunk)[:n]
        if regime == "clean"
        else torch.full((n,), 0.6)
    )
    x_t = (1 - sigma[None, :, None, None]) * x0 + sigma[None, :, None, None] * noise
    ctx, ctx_t = (x0, torch.zeros(n)) if regime == "clean" else (x_t, sigma)
    text = model.text_context("")

    # Training layout: one forward over [sink | context copy | clip].
    positions, mask = clip_layout(cfg, chunks=chunks)
    s = len(positions) - 2 * n  # copies of the sink, one per place the cached forward puts it
    assert s == (1 if chunks is None else 3)
    latents = torch.cat([sink.expand(-1, s, -1, -1), ctx, x_t], 1)[None]
    timesteps = torch.cat([torch.zeros(s), ctx_t * 1000, sigma * 1000])[None]
    acts = torch.cat([torch.zeros(s, 2), actions, actions])[None]
    with torch.no_grad():
        trained = dit.forward_masked(latents, timesteps, text, positions, mask, acts)[0, :, s + n :]

    # Serving: prefill the sink, then chunk by chunk through a K/V cache with eviction.
    cache = ContiguousKVCache(1, cfg.num_layers, cfg.tokens_per_frame, cfg.sink_frames, cfg.window_frames)
    served = []
    with torch.no_grad():
        dit.forward_chunk([ChunkInput(sink, torch.zeros(1), text, cache.view(0, 0, (0,)), torch.zeros(1, 2))])
        for c in range(n // chunk):
            first, sl = 1 + c * chunk, slice(c * chunk, (c + 1) * chunk)
            write = (0,) if regime == "noisy" else ()
            unit = ChunkInput(x_t[:, sl], sigma[sl] * 1000, text, cache.view(first, 0, write), actions[sl])
            served.append(dit.forward_chunk([unit])[0])
            if regime == "clean":
                commit = ChunkInput(
                    x0[:, sl], torch.zeros(chunk), text, cache.view(first, 0, (0,)), actions[sl]
                )
                dit.forward_chunk([commit])
            cache.evict(first + chunk)
    served = torch.cat(served, 1)
    assert served.shape == trained.shape
    torch.testing.assert_close(trained, served, rtol=1e-4, atol=1e-4)


def test_clips_always_end_with_a_chunk_whose_window_is_full() -> None:
    import dataclasses

    for window, chunk in [(8, 4), (6, 4), (5, 3), (3, 3)]:
        cfg = dataclasses.replace(PUSHT, window_frames=window, latent_frames_per_chunk=chunk)
        n = clip_length(cfg)
        assert n % chunk == 0 and 1 + n - chunk >= 1 + window


def test_layout_mask_matters(model: WorldModel) -> None:
    """A mask that lets the last chunk see the whole clip changes its output (the test can fail)."""
    cfg, dit = model.config, model.dit
    n = clip_length(cfg)
    sink, x0, noise, actions = _sample(cfg, 1)
    positions, mask = clip_layout(cfg)
    loose = mask.clone()
    loose[1 + n :, : 1 + n] = True
    latents = torch.cat([sink, x0, noise], 1)[None]
    timesteps = torch.cat([torch.zeros(1 + n), torch.full((n,), 1000.0)])[None]
    acts = torch.cat([torch.zeros(1, 2), actions, actions])[None]
    text = model.text_context("")
    with torch.no_grad():
        a = dit.forward_masked(latents, timesteps, text, positions, mask, acts)
        b = dit.forward_masked(latents, timesteps, text, positions, loose, acts)
    assert (a[:, :, -1] - b[:, :, -1]).abs().max() > 1e-3


def test_block_weight_adds_the_error_on_block_pixels(tmp_path):
    """Same batch, same draws: the loss grows linearly with the block weight (each block
    pixel's error counted 1 + weight times, every other pixel's once), and strictly, since an
    untrained model errs on the block."""
    from streamworld.pusht.data import Dataset, DatasetSpec, generate_dataset
    from streamworld.pusht.train import TrainConfig, Trainer

    spec = DatasetSpec(episodes=2, steps=clip_length(PUSHT) + 2, size=64, seed=3)
    generate_dataset(spec, tmp_path / "d", workers=1, progress=False)
    data = Dataset.load(tmp_path / "d")
    cfg = smoke_config(PUSHT)
    losses = {}
    for weight in (0.0, 1.0, 3.0):
        trainer = Trainer(
            cfg, TrainConfig(batch_size=2, block_weight=weight), data, tmp_path / f"w{weight}", "cpu"
        )
        losses[weight] = float(trainer.loss(trainer.batcher.sample(2))[0].detach())
    block_part = losses[1.0] - losses[0.0]
    assert block_part > 0.01 * losses[0.0]
    assert losses[3.0] - losses[0.0] == pytest.approx(3 * block_part, rel=1e-3)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    from streamworld.pusht.data import Dataset, DatasetSpec, generate_dataset

    folder = tmp_path_factory.mktemp("pusht-data")
    generate_dataset(DatasetSpec(episodes=2, steps=16, size=64, seed=3), folder, workers=1, progress=False)
    return Dataset.load(folder)


def assert_served(frames: torch.Tensor, expected: np.ndarray) -> None:
    """Frames the engine served equal the reference generator's up to float rounding (the
    engine's contract, as tests/test_engine.py checks it): at most 2 levels of 255 apart."""
    assert frames.shape == expected.shape and frames.dtype == torch.uint8
    assert (frames.int() - torch.from_numpy(expected).int()).abs().max() <= 2


@pytest.mark.slow
def test_rollout_workers_leave_the_trainers_process_group():
    """`timeout` and Ctrl-C signal the whole process group; the workers that simulate
    rollout targets are in a group of their own, so a task in flight still returns and the
    trainer can finish its step, save and export, while the pool can still end them."""
    import multiprocessing as mp

    from streamworld.pusht.train import own_process_group

    with mp.get_context("spawn").Pool(1, initializer=own_process_group) as pool:
        worker = pool.apply_async(os.getpid).get(timeout=60)
        group = pool.apply_async(os.getpgrp).get(timeout=60)
        assert group == worker != os.getpgrp()
        assert pool.apply_async(abs, (-3,)).get(timeout=60) == 3


def _trainer(small_data, tmp_path, name, **overrides):
    from streamworld.pusht.train import TrainConfig, Trainer

    config = TrainConfig(batch_size=4, rollout_episodes=2, rollout_frames=16, **overrides)
    return Trainer(smoke_config(PUSHT), config, small_data, tmp_path / name, "cpu")


def test_rollout_context_is_the_served_prediction_aligned_with_the_true_clip(small_data, tmp_path):
    """Each rollout is what the reference generator predicts for its episode and seed (the
    engine serves it, batched with the others: equal up to float rounding); a
    sample's context copy is that rollout at exactly the steps of its true clip, and only its
    last chunk (whose window is full) is trained."""
    from streamworld.engine import GenerationRequest, ReferenceGenerator

    trainer = _trainer(small_data, tmp_path, "r", rollout_share=0.5)
    rollouts = trainer.rollouts
    rollouts.refresh()
    cfg, b = trainer.mcfg, trainer.batcher
    for r, (e, seed) in enumerate(zip(rollouts.episodes.tolist(), rollouts.seeds.tolist(), strict=True)):
        request = GenerationRequest(
            seed=seed,
            num_chunks=16 // cfg.frames_per_chunk,
            image=np.array(small_data.frames[e, 0]),
            actions=small_data.actions[e, :16],
            kv_mode="final",
        )
        expected = ReferenceGenerator(trainer.model).generate(request).frames
        assert_served(rollouts.frames[r], expected)
    batch = rollouts.sample(16)
    n, chunk = b.clip, b.chunk
    to_uint8 = lambda v: ((v + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)  # noqa: E731
    starts = set()
    for clip, own, actions in zip(
        to_uint8(batch["frames"]), to_uint8(batch["own"]), batch["actions"], strict=True
    ):
        matches = [
            (r, start)
            for r, e in enumerate(rollouts.episodes.tolist())
            for start in range(1, 16 - n + 2)
            if torch.equal(clip[1:], b.frames[e, start : start + n])
            and torch.equal(own, rollouts.frames[r, start - 1 : start - 1 + n])
            and torch.equal(actions, b.actions[e, start - 1 : start - 1 + n])
        ]
        assert matches, "the context copy is not the rollout at the clip's steps"
        assert torch.equal(clip[0], b.frames[rollouts.episodes[matches[0][0]], 0])  # the sink
        starts.add(matches[0][1])
    assert starts <= {1, 5}  # the trained chunk starts at 9 or 13: the clip at 1 or 5
    assert batch["loss_chunks"].tolist() == [[False] * (n // chunk - 1) + [True]] * 16


def test_a_rollout_sample_is_a_final_sample_with_the_models_context(small_data, tmp_path):
    """The same draws: with the true frames as its own context, a rollout sample's loss is a
    `final` sample's; with the rollout's frames it differs (the context reaches the loss)."""
    own = _trainer(small_data, tmp_path, "own", rollout_share=1.0)
    final = _trainer(small_data, tmp_path, "final", regime_weights=(0.0, 1.0, 0.0))
    batch = own.next_batch()
    assert own.rollouts.refreshes == 1 and batch["own_mask"].all()
    truth = {**batch, "own": batch["frames"][:, :, 1:]}
    losses = []
    for trainer, b in [
        (own, truth),
        (final, {k: v for k, v in batch.items() if not k.startswith("own")}),
        (own, batch),
    ]:
        trainer.gen.manual_seed(11)
        with torch.no_grad():
            losses.append(float(trainer.loss(b)[0]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert abs(losses[2] - losses[0]) > 1e-4 * losses[0]


def test_batches_mix_true_and_own_context_and_rollouts_follow_the_weights(small_data, tmp_path):
    mixed = _trainer(small_data, tmp_path, "mix", rollout_share=0.5).next_batch()
    assert mixed["own_mask"].tolist() == [False, False, True, True]
    assert torch.equal(mixed["own"][:2], torch.zeros_like(mixed["own"][:2]))
    trainer = _trainer(small_data, tmp_path, "every", rollout_share=0.5, rollout_every=2)
    trainer.train_step()  # step 0: the first rollouts
    before = trainer.rollouts.frames.clone()
    trainer.train_step()  # step 1: the same rollouts
    assert trainer.rollouts.refreshes == 1 and torch.equal(before, trainer.rollouts.frames)
    stats = trainer.train_step()  # step 2: made again, with the weights of two steps later
    assert trainer.rollouts.refreshes == 2 and "loss_rollout" in stats
    assert not torch.equal(before, trainer.rollouts.frames)


def test_simulated_targets_continue_the_scene_the_rollout_shows(small_data, tmp_path):
    """With `rollout_targets="simulated"`, a sample's trained chunk is the environment
    continued from the rollout's last two context frames with the episode's actions; the
    rest of the sample is the "true" sample. Rollouts whose frames show no T give no chunk
    to train, and the error says so."""
    from streamworld.pusht.pose import continue_frames

    trainer = _trainer(small_data, tmp_path, "sim", rollout_share=0.5, rollout_targets="simulated")
    rollouts, b = trainer.rollouts, trainer.batcher
    rollouts.refresh()  # random weights draw no T anywhere
    assert not rollouts.valid.any()
    with pytest.raises(RuntimeError, match="no rollout chunk"):
        rollouts.sample(2)
    # As if the model drew the true frames, shifted by a step (so they are not the truth).
    rollouts.frames = b.frames[rollouts.episodes, :16].clone()
    rollouts.max_mismatch = 0.0  # no drawn T is perfect: no chunk counts
    rollouts._simulate()
    assert not rollouts.valid.any()
    rollouts.max_mismatch = 0.35
    rollouts._simulate()
    assert (
        rollouts.valid[:, rollouts.first_chunk :].all()
        and not rollouts.valid[:, : rollouts.first_chunk].any()
    )
    batch = rollouts.sample(8)
    to_uint8 = lambda v: ((v + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)  # noqa: E731
    n, k = b.clip, b.chunk
    for clip, own, actions in zip(
        to_uint8(batch["frames"]), to_uint8(batch["own"]), batch["actions"], strict=True
    ):
        (r,) = [
            r
            for r in range(len(rollouts.episodes))
            if torch.equal(clip[0], b.frames[rollouts.episodes[r], 0])
        ][:1]
        starts = [s for s in range(0, 16 - n + 1) if torch.equal(own, rollouts.frames[r, s : s + n])]
        assert starts, "the context copy is not the rollout"
        expected = continue_frames((own[-k - 2].numpy(), own[-k - 1].numpy(), actions[-k:].numpy()))
        assert torch.equal(clip[-k:], torch.from_numpy(expected))
        e = rollouts.episodes[r]
        assert torch.equal(clip[1 : 1 + n - k], b.frames[e, starts[0] + 1 : starts[0] + 1 + n - k])


def test_stream_clip_rollouts_are_served_streams_from_the_clips_sink_and_train_every_chunk(
    small_data, tmp_path
):
    """With stream clips (`clip_chunks`), each rollout is what the reference generator serves
    from a random frame (the clip's sink) with the clip's actions; a sample is one rollout as
    the context copy of its true clip, the sink the frame before the clip, and every chunk is
    trained. The training step runs on such batches."""
    from streamworld.engine import GenerationRequest, ReferenceGenerator

    trainer = _trainer(small_data, tmp_path, "stream", rollout_share=0.5, clip_chunks=3)
    rollouts, b = trainer.rollouts, trainer.batcher
    rollouts.refresh()
    n, k = b.clip, b.chunk
    assert n == 12 and rollouts.frames.shape[1] == n and rollouts.first_chunk == 1
    for r, (e, start, seed) in enumerate(
        zip(rollouts.episodes.tolist(), rollouts.starts.tolist(), rollouts.seeds.tolist(), strict=True)
    ):
        assert 1 <= start <= 16 - n + 1
        request = GenerationRequest(
            seed=seed,
            num_chunks=n // k,
            image=np.array(small_data.frames[e, start - 1]),
            actions=small_data.actions[e, start - 1 : start - 1 + n],
            kv_mode="final",
        )
        expected = ReferenceGenerator(trainer.model).generate(request).frames
        assert_served(rollouts.frames[r], expected)
    batch = rollouts.sample(8)
    to_uint8 = lambda v: ((v + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)  # noqa: E731
    for clip, own, actions in zip(
        to_uint8(batch["frames"]), to_uint8(batch["own"]), batch["actions"], strict=True
    ):
        (r,) = [r for r in range(len(rollouts.frames)) if torch.equal(own, rollouts.frames[r])][:1]
        e, start = int(rollouts.episodes[r]), int(rollouts.starts[r])
        assert torch.equal(clip[0], b.frames[e, start - 1])  # the sink: the frame before the clip
        assert torch.equal(clip[1:], b.frames[e, start : start + n])  # the true clip as the target
        assert torch.equal(actions, b.actions[e, start - 1 : start - 1 + n])
    assert batch["loss_chunks"].all() and batch["loss_chunks"].shape == (8, n // k)
    stats = trainer.train_step()
    assert np.isfinite(stats["loss"]) and "loss_rollout" in stats


def test_simulated_targets_of_stream_clips_continue_each_chunks_own_context(small_data, tmp_path):
    """Stream clips with simulated targets: the first chunk keeps the true chunk (its context
    is the true sink), each later chunk is the environment continued from the last two frames
    of the model's own chunks before it, with the clip's actions; a chunk without a T in its
    context is not trained, and the samples only come from rollouts with some target."""
    from streamworld.pusht.pose import continue_frames

    trainer = _trainer(
        small_data, tmp_path, "stream-sim", rollout_share=0.5, clip_chunks=3, rollout_targets="simulated"
    )
    rollouts, b = trainer.rollouts, trainer.batcher
    rollouts.refresh()  # random weights draw no T anywhere: only the true first chunks are left
    assert rollouts.valid[:, 0].all() and not rollouts.valid[:, 1:].any() and not rollouts.has_targets
    assert rollouts.chunks_with_target == 0 and rollouts.chunks_simulated == 2 * 2  # chunks 1-2 of each
    with pytest.raises(RuntimeError, match="no rollout chunk"):
        rollouts.sample(2)
    n, k = b.clip, b.chunk
    # As if the model drew the true frames one step late (so they are not the truth).
    index = (rollouts.starts - 1)[:, None] + torch.arange(n)
    rollouts.frames = b.frames[rollouts.episodes[:, None], index].clone()
    rollouts._simulate()
    assert rollouts.valid.all()
    rollouts.valid[0, 2] = False  # as if chunk 2 of rollout 0 had no T before it
    batch = rollouts.sample(8)
    to_uint8 = lambda v: ((v + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)  # noqa: E731
    seen = set()
    for clip, own, actions, trained in zip(
        to_uint8(batch["frames"]), to_uint8(batch["own"]), batch["actions"], batch["loss_chunks"], strict=True
    ):
        (r,) = [r for r in range(len(rollouts.frames)) if torch.equal(own, rollouts.frames[r])][:1]
        seen.add(r)
        e, start = int(rollouts.episodes[r]), int(rollouts.starts[r])
        assert torch.equal(clip[1 : 1 + k], b.frames[e, start : start + k])  # chunk 0: the truth
        for c in range(1, n // k):
            expected = continue_frames(
                (own[c * k - 2].numpy(), own[c * k - 1].numpy(), actions[c * k : (c + 1) * k].numpy())
            )
            assert torch.equal(clip[1 + c * k : 1 + (c + 1) * k], torch.from_numpy(expected)) == bool(
                rollouts.valid[r, c]
            )
        assert trained.tolist() == rollouts.valid[r].tolist()
    assert seen == {0, 1}


def test_weights_grown_into_a_deeper_model_compute_the_same_and_load_at_their_depth(small_data, tmp_path):
    """`--init` weights with fewer blocks than `--layers`: the grown model predicts exactly
    what the shallower one does, and its exported weights load at their own depth, even
    through the preset of the shallower model."""
    import dataclasses

    from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
    from streamworld.models.world_model import WeightPaths
    from streamworld.pusht.train import TrainConfig, Trainer

    shallow = _trainer(small_data, tmp_path, "shallow")
    with torch.no_grad():  # no zero outputs left in the shallower model's blocks
        for p in shallow.ema.values():
            if p.dtype.is_floating_point:
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    init = shallow.export(tmp_path / "shallow.safetensors")
    cfg = smoke_config(PUSHT)
    deep_cfg = dataclasses.replace(cfg, dit={**cfg.dit, "num_layers": cfg.num_layers + 3})
    deep = Trainer(deep_cfg, TrainConfig(batch_size=4), small_data, tmp_path / "deep", "cpu", init=init)
    grown = deep.export(tmp_path / "deep.safetensors")

    small = WorldModel.load(cfg, WeightPaths(dit=str(init)))
    big = WorldModel.load(cfg, WeightPaths(dit=str(grown)))  # the shallow preset: depth from the file
    assert big.config.num_layers == cfg.num_layers + 3 == len(big.dit.transformer.blocks)
    request = GenerationRequest(
        seed=1,
        num_chunks=3,
        image=np.asarray(small_data.frames[0][0]),
        actions=np.asarray(small_data.actions[0][:12], dtype=np.float32),
    )
    a = ReferenceGenerator(small).generate(request).frames
    b = ReferenceGenerator(big).generate(request).frames
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(a).std() > 0  # frames that show something


@pytest.mark.parametrize(
    "objective",
    [{}, {"clip_chunks": 3, "unroll_share": 0.5}],
    ids=["teacher-forced", "unrolled"],
)
@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_compiled_training_steps_equal_the_eager_ones(small_data, tmp_path, device, objective):
    """`--compile`: the same seeds give the same losses and weights as the eager forward, up to
    float rounding (bf16 autocast on a GPU), and the forward did go through torch.compile;
    also with half of each batch on the unrolled objective."""
    from torch._dynamo.utils import counters

    from streamworld.pusht.train import TrainConfig, Trainer

    def trainer(name: str, compiled: bool) -> Trainer:
        config = TrainConfig(batch_size=4, warmup_steps=1, compile=compiled, seed=7, **objective)
        return Trainer(smoke_config(PUSHT), config, small_data, tmp_path / name, device)

    torch._dynamo.reset()
    eager, compiled = trainer("eager", False), trainer("compiled", True)
    for _ in range(3):
        a, b = eager.train_step(), compiled.train_step()
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2 if device == "cuda" else 1e-4)
    assert counters["stats"]["unique_graphs"] > 0, "torch.compile never ran"
    tol = 2e-2 if device == "cuda" else 1e-4
    for key, value in eager.ema.items():
        torch.testing.assert_close(compiled.ema[key], value, rtol=tol, atol=tol, msg=key)
    moved = max((eager.ema[k] - v).abs().max().item() for k, v in trainer("fresh", False).ema.items())
    assert moved > 0, "the steps changed no weight"


@pytest.mark.parametrize("chunks", [None, 5])
def test_clips_start_from_the_episode_start_or_as_streams_of_their_own(tmp_path, chunks):
    """Default clips keep the episode's first frame as their sink and train only the last
    chunk of a clip that starts late; stream clips (`chunks` given) start from the frame
    before them and train every chunk."""
    from streamworld.pusht.data import Dataset, DatasetSpec, generate_dataset
    from streamworld.pusht.train import ClipBatcher

    generate_dataset(DatasetSpec(episodes=2, steps=30, size=64, seed=3), tmp_path, workers=1, progress=False)
    data = Dataset.load(tmp_path)
    cfg = smoke_config(PUSHT)
    batcher = ClipBatcher(data, cfg, torch.device("cpu"), torch.Generator().manual_seed(0), 0.3, chunks)
    n = clip_length(cfg, chunks)
    assert batcher.clip == n and batcher.stream_clips == (chunks is not None)
    batch = batcher.sample(16)
    video = (
        torch.from_numpy(np.array(data.frames)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    )  # [E, 3, T+1, S, S]
    late = 0
    for frames, trained in zip(batch["frames"], batch["loss_chunks"], strict=True):
        ((e, start),) = [
            (e, t)
            for e in range(2)
            for t in range(1, 31 - n + 1)
            if torch.equal(frames[:, 1:], video[e, :, t : t + n])
        ]
        sink_frame = start - 1 if chunks is not None else 0
        assert torch.equal(frames[:, 0], video[e, :, sink_frame])
        if chunks is not None or start == 1:
            assert trained.all()
        else:
            assert trained.tolist() == [False] * (n // cfg.latent_frames_per_chunk - 1) + [True]
        late += start > 1
    assert late > 0


@pytest.fixture(scope="module")
def data_24(tmp_path_factory):
    """Episodes long enough for stream clips of 4 chunks (the sink moves for the fourth)."""
    from streamworld.pusht.data import Dataset, DatasetSpec, generate_dataset

    folder = tmp_path_factory.mktemp("pusht-data-24")
    generate_dataset(DatasetSpec(episodes=2, steps=24, size=64, seed=5), folder, workers=1, progress=False)
    return Dataset.load(folder)


def _unroll_trainer(data, tmp_path, prediction: str, context_timestep: float = 0.0, **overrides):
    import dataclasses

    from streamworld.pusht.train import TrainConfig, Trainer

    config = TrainConfig(**{"batch_size": 4, "clip_chunks": 4, "unroll_share": 1.0, "seed": 3, **overrides})
    model = dataclasses.replace(
        smoke_config(PUSHT).with_prediction(prediction), context_timestep=context_timestep
    )
    return Trainer(model, config, data, tmp_path / prediction, "cpu")


@pytest.mark.parametrize(
    ("prediction", "context_timestep"), [("x0", 0.0), ("delta", 0.0), ("flow", 0.0), ("delta", 50.0)]
)
def test_the_unrolled_sampler_is_the_served_one_step_clean_rollout(
    data_24, tmp_path, prediction, context_timestep
):
    """`Trainer.unrolled` predicts each stream clip as the reference generator serves it
    with one step (t = 1000) in `clean` mode from the clip's sink and actions, given the
    same noise: every chunk, including the fourth, for which the sink moves; for each
    kind of output, and with a context timestep other than 0 (the sink's prefill and the
    commit passes)."""
    import dataclasses

    from streamworld.engine import GenerationRequest, ReferenceGenerator
    from streamworld.models.schedule import chunk_noise

    trainer = _unroll_trainer(data_24, tmp_path, prediction, context_timestep)
    cfg, chunk = trainer.mcfg, trainer.batcher.chunk
    served = WorldModel.load(dataclasses.replace(cfg, denoising_steps=(1000.0,)), random_weights=True)
    served.dit.load_state_dict(trainer.dit.state_dict())
    batch = trainer.batcher.sample(3)
    shape = served.latent_shape(chunk)
    seeds = [11, 12, 13]
    noise = torch.stack([torch.cat([chunk_noise(s, c, 0, shape) for c in range(4)], 1) for s in seeds])
    with torch.no_grad():
        unrolled = trainer.unrolled(batch["frames"], batch["actions"], noise)
    to_uint8 = lambda v: ((v + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)  # noqa: E731
    for i, seed in enumerate(seeds):
        request = GenerationRequest(
            seed=seed,
            num_chunks=4,
            image=to_uint8(batch["frames"][i, :, :1])[0].numpy(),
            actions=batch["actions"][i].numpy(),
            kv_mode="clean",
        )
        expected = ReferenceGenerator(served).generate(request).latents
        torch.testing.assert_close(unrolled[i], expected, rtol=1e-4, atol=1e-4)
    # Another draw of the first chunk's noise alone changes the last chunk: the model's own
    # first chunk, not the truth, is in its context (for delta, also in the frame it adds to).
    other = noise.clone()
    other[:, :, :chunk] = torch.randn_like(other[:, :, :chunk])
    with torch.no_grad():
        redrawn = trainer.unrolled(batch["frames"], batch["actions"], other)
    assert (redrawn[:, :, -chunk:] - unrolled[:, :, -chunk:]).abs().max() > 1e-5


def test_the_unrolled_objective_backpropagates_through_the_models_own_context(data_24, tmp_path):
    """An x0 model's last chunk depends on the first chunk's noise only through the model's
    own prediction of the first chunk in its context: the gradient reaches it (a delta
    model's would also reach it through the frame each chunk adds its output to). Training
    steps on the objective lower it."""
    x0 = _unroll_trainer(data_24, tmp_path, "x0")
    chunk = x0.batcher.chunk
    batch = x0.batcher.sample(2)
    frames, actions = batch["frames"], batch["actions"]
    noise = torch.randn(frames[:, :, 1:].shape, requires_grad=True)
    pred = x0.unrolled(frames, actions, noise)
    (grad,) = torch.autograd.grad(pred[:, :, -chunk:].square().sum(), noise)
    assert grad[:, :, :chunk].abs().max() > 0  # through chunks 1, 2 and 3's context
    assert grad[:, :, chunk : 2 * chunk].abs().max() > 0

    trainer = _unroll_trainer(data_24, tmp_path, "delta", lr=3e-3, warmup_steps=1)

    def loss() -> float:
        trainer.gen.manual_seed(5)
        with torch.no_grad():
            return float(trainer.unrolled_loss(batch)[0])

    before = loss()
    trainer.next_batch = lambda: batch  # one batch, learned by heart
    stats = [trainer.train_step() for _ in range(6)]
    assert {"loss_unrolled", "loss_unrolled_last"} <= stats[-1].keys()
    assert "loss_clean" not in stats[-1]  # the whole batch is unrolled
    assert loss() < 0.9 * before


def test_a_batch_splits_between_the_teacher_forced_and_the_unrolled_objective(data_24, tmp_path):
    """A quarter of a batch of 4: the last clip is unrolled, the first three teacher-forced,
    and the loss weighs the two by their clips."""
    trainer = _unroll_trainer(data_24, tmp_path, "delta", unroll_share=0.25)
    batch = trainer.batcher.sample(4)
    with torch.no_grad():
        trainer.gen.manual_seed(1)
        loss, stats = trainer.objective(batch)
        trainer.gen.manual_seed(1)
        unrolled, _ = trainer.unrolled_loss({k: v[3:] for k, v in batch.items()})
        taught, _ = trainer.loss({k: v[:3] for k, v in batch.items()})
    assert "loss_unrolled" in stats and any(k in stats for k in ("loss_clean", "loss_final"))
    assert abs(float(unrolled) - float(taught)) > 1e-3 * float(taught)  # so the weights matter
    assert float(loss) == pytest.approx((float(unrolled) + 3 * float(taught)) / 4, rel=1e-5)


def test_the_unrolled_objective_takes_the_absolute_error_with_unroll_loss_l1(data_24, tmp_path):
    """`unroll_loss="l1"`: the mean absolute error of the same unrolled predictions that
    "l2" squares (no change or block weight), chunk by chunk."""
    from streamworld.models.pixels import frames_to_latents

    l1 = _unroll_trainer(data_24, tmp_path, "delta", unroll_loss="l1")
    l2 = _unroll_trainer(data_24, tmp_path, "delta")
    batch = l1.batcher.sample(2)
    x0 = frames_to_latents(batch["frames"], l1.mcfg.anchored_pixels)[:, :, 1:]
    losses = {}
    for name, trainer in (("l1", l1), ("l2", l2)):
        trainer.gen.manual_seed(7)
        noise = torch.randn(x0.shape, generator=trainer.gen)
        with torch.no_grad():
            pred = trainer.unrolled(batch["frames"], batch["actions"], noise)
            trainer.gen.manual_seed(7)
            losses[name] = (float(trainer.unrolled_loss(batch)[0]), pred)
    assert losses["l1"][0] == pytest.approx(float((losses["l1"][1] - x0).abs().mean()), rel=1e-5)
    assert losses["l2"][0] == pytest.approx(float((losses["l2"][1] - x0).pow(2).mean()), rel=1e-5)
    assert losses["l1"][0] != pytest.approx(losses["l2"][0], rel=1e-2)


def test_each_unrolled_chunk_runs_the_closed_part_of_the_layout_it_reads(monkeypatch):
    """Chunk c keeps the sink copies used up to it, the context of chunks 0 .. c-1 and
    itself, and nothing kept attends to anything cut away; a layout where a chunk would
    read a later context chunk is refused."""
    import streamworld.pusht.train as train
    from streamworld.pusht.train import unroll_layouts

    cfg = smoke_config(PUSHT)
    positions, mask = clip_layout(cfg, chunks=5)
    n, chunk = clip_length(cfg, 5), cfg.latent_frames_per_chunk
    cuts = unroll_layouts(cfg, 5)
    assert [cut.sinks for cut in cuts] == [1, 1, 1, 2, 3]  # the sink moves for chunks 3 and 4
    for c, cut in enumerate(cuts):
        own = list(range(3 + n + c * chunk, 3 + n + (c + 1) * chunk))
        assert cut.frames[cut.sinks :].tolist() == [*range(3, 3 + c * chunk), *own]
        assert cut.frames[: cut.sinks].max() < 3  # sink copies
        assert torch.equal(cut.positions, positions[cut.frames])
        assert torch.equal(cut.mask, mask[cut.frames][:, cut.frames])
        assert cut.max_position == int(cut.positions.max())
        cut_away = torch.ones(len(positions), dtype=torch.bool)
        cut_away[cut.frames] = False
        assert not mask[cut.frames][:, cut_away].any()  # closed: nothing kept reads what is cut

    leaky = mask.clone()
    leaky[3 + n + 2 * chunk, 3 + 3 * chunk] = True  # chunk 2 would read chunk 3's context
    monkeypatch.setattr(train, "clip_layout", lambda *a, **k: (positions, leaky))
    with pytest.raises(RuntimeError, match="chunk 2 of the unrolled sampler"):
        unroll_layouts(cfg, 5)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"clip_chunks": None}, "stream clips"),
        ({"rollout_share": 0.5}, "cannot be combined"),
        ({"unroll_share": 1.5}, r"in \[0, 1\]"),
        ({"unroll_share": 0.1}, "rounds to no clip"),  # 0.4 of a batch of 4
        ({"unroll_loss": "l3"}, "--unroll-loss must be one of l2, l1"),
        ({"unroll_share": 0.0, "unroll_loss": "l1"}, "give --unroll-share too"),
        ({"unroll_share": 0.0, "adversarial_weight": 0.5}, "judges the unrolled rollouts"),
        ({"adversarial_weight": -0.5}, "negative"),
        ({"adversarial_weight": float("nan")}, "must be finite"),
        ({"adversarial_weight": float("inf")}, "must be finite"),
        ({"adversarial_weight": 0.5, "adversarial_start": -1}, "negative"),
        ({"adversarial_start": 5}, "give --adversarial-weight too"),
    ],
)
def test_bad_unroll_settings_are_refused(data_24, tmp_path, overrides, error):
    from streamworld.pusht.train import TrainConfig, Trainer

    config = TrainConfig(**{"batch_size": 4, "clip_chunks": 4, "unroll_share": 1.0, **overrides})
    with pytest.raises(ValueError, match=error):
        Trainer(smoke_config(PUSHT), config, data_24, tmp_path / "bad", "cpu")


@pytest.mark.slow
def test_train_cli_runs_the_unrolled_objective_and_refuses_what_cannot_run(tmp_path, capsys):
    from streamworld.cli import main as cli_main

    smoke = ["train", "pusht", "--smoke", "--total-steps", "2"]
    work = tmp_path / "unroll"
    assert cli_main([*smoke, "--workdir", str(work), "--clip-chunks", "2", "--unroll-share", "0.5"]) == 0
    history = torch.load(work / "checkpoint.pt", weights_only=True)["history"]
    assert history and "loss_unrolled" in history[-1]
    adversarial = tmp_path / "adversarial"
    flags = ["--clip-chunks", "2", "--unroll-share", "0.5", "--adversarial-weight", "0.5"]
    assert cli_main([*smoke, "--workdir", str(adversarial), *flags, "--adversarial-start", "0"]) == 0
    state = torch.load(adversarial / "checkpoint.pt", weights_only=True)
    assert {"loss_disc", "loss_adversarial"} <= state["history"][-1].keys() and "disc" in state
    refused = {
        ("--unroll-share", "0.5"): "--clip-chunks",
        ("--unroll-share", "0.5", "--clip-chunks", "2", "--rollout-share", "0.5"): "cannot be combined",
        ("--unroll-share", "1.5", "--clip-chunks", "2"): "in [0, 1]",
        ("--unroll-share", "0.25", "--clip-chunks", "2"): "rounds to no clip",  # the smoke batch is 2
        ("--unroll-loss", "l1"): "give --unroll-share too",
        ("--adversarial-weight", "0.5"): "give --unroll-share too",
        ("--adversarial-weight", "-1", "--clip-chunks", "2", "--unroll-share", "0.5"): "at least 0",
        ("--adversarial-background", "0.5"): "give --adversarial-weight too",
        ("--adversarial-background", "1.5"): "in [0, 1]",
        ("--adversarial-max-scale", "0.01"): "give --adversarial-weight too",
        ("--adversarial-max-scale", "0", *flags): "above 0",
    }
    for extra, reason in refused.items():
        other = tmp_path / "refused"
        assert cli_main([*smoke, "--workdir", str(other), *extra]) == 2
        assert reason in capsys.readouterr().err
        assert not (other / "data").exists()  # refused before recording any data


@pytest.mark.slow
def test_the_train_speed_benchmark_counts_and_times_the_unrolled_objective(tmp_path):
    """benchmarks/pusht_train_speed.py: a variant's sixth field is its unroll share; the
    model FLOPs of a step add the unrolled clips' forwards (`unroll_layouts`) to the
    teacher-forced clips' (the timings belong to the benchmark, not to this test)."""
    import json

    from tests.conftest import load_script

    bench = load_script("benchmarks/pusht_train_speed.py")
    cfg = bench.variant_config(6, 6, 768)
    taught, unrolled, half = (bench.model_flops(cfg, 4, 5, u) for u in (0, 4, 2))
    assert half == pytest.approx((taught + unrolled) / 2) and unrolled != pytest.approx(taught)
    out = tmp_path / "speed.json"
    argv = ["--device", "cpu", "--episodes", "2", "--data", str(tmp_path / "data"), "--warmup", "0"]
    assert bench.main([*argv, "--steps", "1", "u=2,2,64,2,3,0.5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["variants"]
    assert (row["unroll_share"], row["clip_chunks"], row["batch"]) == (0.5, 3, 2)
    expected = bench.model_flops(bench.variant_config(2, 2, 64), 2, 3, 1)
    assert row["model_tflop_per_step"] == pytest.approx(expected / 1e12, rel=1e-3)
    assert expected != pytest.approx(bench.model_flops(bench.variant_config(2, 2, 64), 2, 3, 0), rel=1e-2)


def test_an_action_map_peaks_at_the_pixel_the_agent_is_driven_to():
    from streamworld.pusht.adversarial import action_maps

    actions = torch.tensor([[[100.0, 300.0], [500.0, 20.0]]])  # world (x, y), 8 units a pixel
    maps = action_maps(actions, 64)
    assert maps.shape == (1, 1, 2, 64, 64)
    for frame, (row, col) in enumerate([(37, 12), (2, 62)]):  # (y / 8, x / 8)
        peak = int(maps[0, 0, frame].argmax())
        assert divmod(peak, 64) == (row, col)
    assert float(maps.max()) <= 1.0 and float(maps[0, 0, 0, 0, 63]) < 1e-6


def test_the_adaptive_weight_gives_the_adversarial_gradient_its_ratio_at_the_layer():
    from streamworld.pusht.adversarial import adaptive_weight

    layer = torch.nn.Parameter(torch.randn(3, 4))
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    regression, adversarial = (layer * a).sum().square(), (layer * b).sum()
    weight = adaptive_weight(regression, adversarial, layer, 0.3)
    (g_reg,) = torch.autograd.grad(regression, layer, retain_graph=True)
    (g_adv,) = torch.autograd.grad(weight * adversarial, layer)
    assert float(g_adv.norm()) == pytest.approx(0.3 * float(g_reg.norm()), rel=1e-5)
    assert not weight.requires_grad
    regression, adversarial = (layer * a).sum().square(), (layer * b).sum()  # the graphs again
    capped = adaptive_weight(regression, adversarial, layer, 0.3, cap=float(weight) / 2)
    assert float(capped) == pytest.approx(float(weight) / 2)


def test_the_discriminator_judges_only_the_patches_where_clip_and_rollout_differ():
    """Its patch grid is its logits'; a difference in one pixel marks the one patch whose
    cell holds it; the hinge losses over those patches ignore every other patch's logit."""
    from streamworld.pusht.adversarial import (
        DIFFERENCE,
        ClipDiscriminator,
        differing_patches,
        discriminator_loss,
        generator_loss,
        patch_weights,
    )

    disc = ClipDiscriminator(16, width=4)
    real = torch.rand(2, 3, 5, 16, 16) * 2 - 1
    grid = disc.grid(5)
    assert tuple(disc(real[:, :, :1], real, torch.rand(2, 5, 2) * 512).shape) == (2, 1, *grid)
    fake = real.clone()
    fake[1, 2, 2, 9, 14] += 3 * DIFFERENCE  # sample 1, frame 2, pixel (9, 14)
    fake[0, 0, 0, 0, 0] += 0.5 * DIFFERENCE  # under the threshold
    where = differing_patches(real, fake, grid)
    assert where.shape == (2, 1, *grid) and float(where.sum()) == 1.0
    assert float(where[1, 0, 1, 1, 1]) == 1.0  # frame 2 of 5 -> 1 of 3; pixel // 8

    d_real, d_fake = torch.randn(2, 1, *grid), torch.randn(2, 1, *grid)
    masked = discriminator_loss(d_real, d_fake, where)
    assert float(masked) == pytest.approx(
        float(torch.relu(1 - d_real[where > 0]) + torch.relu(1 + d_fake[where > 0]))
    )
    elsewhere = where == 0
    d_real[elsewhere], d_fake[elsewhere] = 5.0, 5.0
    assert float(discriminator_loss(d_real, d_fake, where)) == pytest.approx(float(masked))
    assert float(generator_loss(d_fake, where)) == pytest.approx(-float(d_fake[where > 0]))
    assert float(discriminator_loss(d_real, d_fake)) != pytest.approx(float(masked))

    # With the background weighed in: 1 is the mean over every patch, 0 the mask alone.
    assert patch_weights(where, 0.0) is where
    weights = patch_weights(where, 0.25)
    assert set(weights.unique().tolist()) == {0.25, 1.0} and float(weights[1, 0, 1, 1, 1]) == 1.0
    every = discriminator_loss(d_real, d_fake, patch_weights(where, 1.0))
    assert float(every) == pytest.approx(float(discriminator_loss(d_real, d_fake)))


@pytest.mark.slow
def test_the_discriminator_learns_and_its_verdict_joins_the_unrolled_loss_at_its_start(data_24, tmp_path):
    """With `adversarial_weight`, every step first trains the discriminator on the true
    clips against the unrolled rollouts, and from `adversarial_start` on the rollouts' loss
    adds its verdict times the adaptive weight; the discriminator's own weights get no
    gradient from that term."""
    from streamworld.pusht.adversarial import differing_patches, discriminator_loss

    trainer = _unroll_trainer(
        data_24, tmp_path, "delta", adversarial_weight=0.5, adversarial_start=2, lr=2e-3, warmup_steps=1
    )
    batch = trainer.batcher.sample(4)
    trainer.next_batch = lambda: batch  # one batch: the discriminator can learn it
    first = {k: v.clone() for k, v in trainer.disc.state_dict().items()}
    stats = [trainer.train_step() for _ in range(5)]
    assert all("loss_adversarial" not in row for row in stats[:2])
    assert all({"loss_adversarial", "adversarial_scale"} <= row.keys() for row in stats[2:])
    assert any(not torch.equal(first[k], v) for k, v in trainer.disc.state_dict().items())
    for row in stats[2:]:  # the whole batch is unrolled: the loss is the two terms
        expected = row["loss_unrolled"] + row["adversarial_scale"] * row["loss_adversarial"]
        assert row["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)

    trainer.disc.zero_grad(set_to_none=True)
    frames = batch["frames"]
    latents = frames_to_latents(frames, trainer.mcfg.anchored_pixels)
    noise = torch.randn(latents[:, :, 1:].shape)
    pred = trainer.unrolled(frames, batch["actions"], noise)
    regression = (pred - latents[:, :, 1:]).square().mean()
    loss, _ = trainer.adversarial_term(regression, latents[:, :, :1], pred, batch["actions"])
    loss.backward()
    assert all(p.grad is None for p in trainer.disc.parameters())
    assert all(p.requires_grad for p in trainer.disc.parameters())  # for its own next step

    # Its own steps teach it to tell these true clips from these rollouts, over the
    # patches where they differ.
    sink, real, fake = latents[:, :, :1], latents[:, :, 1:], pred.detach()
    where = differing_patches(real, fake, trainer.disc.grid(real.shape[2]))
    with torch.no_grad():
        before = discriminator_loss(
            trainer.disc(sink, real, batch["actions"]), trainer.disc(sink, fake, batch["actions"]), where
        )
    steps = [trainer.discriminator_step(sink, real, fake, batch["actions"], where) for _ in range(8)]
    assert steps[0]["loss_disc"] == pytest.approx(float(before), rel=1e-5)
    assert steps[-1]["loss_disc"] < steps[0]["loss_disc"] - 0.1
    assert steps[-1]["disc_real"] > steps[-1]["disc_fake"]


@pytest.mark.slow
def test_where_clip_and_rollout_do_not_differ_the_discriminator_has_nothing_to_learn(
    data_24, tmp_path, monkeypatch
):
    """Training masks both adversarial losses with `differing_patches`: with no patch that
    differs, the discriminator's loss and its verdict are zero and its weights stay put;
    with `adversarial_background` 1 it learns every patch alike."""
    import streamworld.pusht.train as train

    monkeypatch.setattr(train, "differing_patches", lambda real, fake, grid: torch.zeros(len(real), 1, *grid))
    trainer = _unroll_trainer(data_24, tmp_path, "delta", adversarial_weight=0.5, adversarial_start=0)
    first = {k: v.clone() for k, v in trainer.disc.named_parameters()}
    row = trainer.train_step()
    assert row["loss_disc"] == 0 and row["loss_adversarial"] == 0 and row["disc_patches"] == 0
    assert row["loss"] == pytest.approx(row["loss_unrolled"], rel=1e-6)
    assert all(torch.equal(first[k], v) for k, v in trainer.disc.named_parameters())

    everywhere = _unroll_trainer(
        data_24,
        tmp_path / "bg",
        "delta",
        adversarial_weight=0.5,
        adversarial_start=0,
        adversarial_background=1.0,
    )
    row = everywhere.train_step()
    assert row["disc_patches"] == 0 and row["loss_disc"] > 1 and row["loss_adversarial"] != 0
    assert any(not torch.equal(first[k], v) for k, v in everywhere.disc.named_parameters())


@pytest.mark.slow
def test_the_adversarial_scale_stops_at_its_bound_and_the_log_says_so(data_24, tmp_path):
    """`adversarial_max_scale` bounds the term's adaptive weight; the step's log gives the
    weight used and whether it was at the bound."""
    free = _unroll_trainer(data_24, tmp_path / "free", "delta", adversarial_weight=0.5, adversarial_start=0)
    row = free.train_step()
    assert row["adversarial_capped"] == 0 and row["adversarial_scale"] > 0
    bound = row["adversarial_scale"] / 10
    capped = _unroll_trainer(
        data_24,
        tmp_path / "capped",
        "delta",
        adversarial_weight=0.5,
        adversarial_start=0,
        adversarial_max_scale=bound,
    )
    row = capped.train_step()
    assert row["adversarial_capped"] == 1 and row["adversarial_scale"] == pytest.approx(bound)
    assert row["loss"] == pytest.approx(row["loss_unrolled"] + bound * row["loss_adversarial"], rel=1e-4)


@pytest.mark.slow
def test_a_resumed_adversarial_run_keeps_its_discriminator(data_24, tmp_path):
    trainer = _unroll_trainer(data_24, tmp_path, "delta", adversarial_weight=0.5, adversarial_start=0)
    trainer.train_step()
    trainer.save_checkpoint()
    resumed = _unroll_trainer(data_24, tmp_path, "delta", adversarial_weight=0.5, adversarial_start=0)
    assert resumed.step == 1
    for key, value in trainer.disc.state_dict().items():
        assert torch.equal(resumed.disc.state_dict()[key], value), key
    assert resumed.disc_opt.state_dict()["state"]  # Adam's moments came back too


def test_a_checkpoint_from_before_the_adversarial_setting_is_not_resumed_with_it(data_24, tmp_path):
    """A checkpoint whose training config predates `adversarial_weight` passes the settings
    check, which compares only what both record, but holds no discriminator to resume."""
    plain = _unroll_trainer(data_24, tmp_path, "delta")
    plain.train_step()
    plain.save_checkpoint()
    state = torch.load(plain.checkpoint_path, weights_only=True)
    for name in ("adversarial_weight", "adversarial_start"):
        del state["train_config"][name]
    torch.save(state, plain.checkpoint_path)
    with pytest.raises(ValueError, match="without a discriminator"):
        _unroll_trainer(data_24, tmp_path, "delta", adversarial_weight=0.5)
