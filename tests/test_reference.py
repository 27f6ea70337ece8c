"""The sequential reference generator: KV modes, windows, actions, first image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamworld.engine.reference import GenerationRequest, ReferenceGenerator, hold_actions
from streamworld.models.schedule import FlowSchedule
from tests.conftest import load_tiny


def _generate(model, **kw):
    kw.setdefault("seed", 3)
    kw.setdefault("num_chunks", 3)
    return ReferenceGenerator(model).generate(GenerationRequest(**kw))


def test_kv_modes_are_deterministic_and_differ_after_the_first_chunk(tiny_model):
    f = tiny_model.config.latent_frames_per_chunk
    results = {}
    for mode in ("clean", "final", "noisy"):
        a = _generate(tiny_model, kv_mode=mode, prompt="a cat")
        b = _generate(tiny_model, kv_mode=mode, prompt="a cat")
        assert torch.equal(a.latents, b.latents), mode
        assert np.array_equal(a.frames, b.frames), mode
        results[mode] = a.latents
    # Chunk 0 has no context, so all modes agree on it; later chunks read different K/V.
    for mode in ("final", "noisy"):
        torch.testing.assert_close(results[mode][:, :f], results["clean"][:, :f])
    for x, y in (("clean", "final"), ("clean", "noisy"), ("final", "noisy")):
        assert (results[x][:, f:] - results[y][:, f:]).abs().max() > 1e-4, (x, y)


def test_teacher_forcing_commits_the_given_latents_as_each_chunks_context(tiny_model):
    """Given the free-running run's own latents, teacher forcing is that run exactly; given
    other latents, the first chunk (no context) is the same and the later ones change."""
    f = tiny_model.config.latent_frames_per_chunk
    free = _generate(tiny_model, kv_mode="clean")
    same = _generate(tiny_model, kv_mode="clean", context_latents=free.latents)
    assert torch.equal(same.latents, free.latents)
    other = torch.randn(free.latents.shape, generator=torch.Generator().manual_seed(0))
    forced = _generate(tiny_model, kv_mode="clean", context_latents=other)
    assert torch.equal(forced.latents[:, :f], free.latents[:, :f])
    assert (forced.latents[:, f:] - free.latents[:, f:]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="kv_mode 'clean'"):
        _generate(tiny_model, kv_mode="final", context_latents=free.latents)
    with pytest.raises(ValueError, match="shape"):
        _generate(tiny_model, kv_mode="clean", context_latents=free.latents[:, :f])


def test_seed_and_prompt_change_the_output(tiny_model):
    base = _generate(tiny_model, num_chunks=1, prompt="a")
    assert not torch.equal(base.latents, _generate(tiny_model, num_chunks=1, prompt="a", seed=4).latents)
    assert not torch.equal(base.latents, _generate(tiny_model, num_chunks=1, prompt="b").latents)


def test_prompt_change_applies_from_its_chunk_on(tiny_model):
    f = tiny_model.config.latent_frames_per_chunk
    base = _generate(tiny_model, prompt="a")
    switched = _generate(tiny_model, prompt="a", prompt_changes={2: "b"})
    torch.testing.assert_close(switched.latents[:, : 2 * f], base.latents[:, : 2 * f])
    assert (switched.latents[:, 2 * f :] - base.latents[:, 2 * f :]).abs().max() > 1e-4


def test_frame_counts_follow_the_vae_temporal_compression(tiny_model):
    cfg = tiny_model.config
    result = _generate(tiny_model)
    assert result.chunk_frames == [cfg.first_chunk_frames, cfg.frames_per_chunk, cfg.frames_per_chunk]
    assert result.frames.shape == (sum(result.chunk_frames), cfg.height, cfg.width, 3)
    assert result.frames.dtype == np.uint8
    assert result.latents.shape == tiny_model.latent_shape(3 * cfg.latent_frames_per_chunk)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["clean", "noisy"])
def test_window_keeps_kv_memory_flat_over_many_chunks(mode):
    model = load_tiny(height=32, width=32)
    result = _generate(model, num_chunks=55, kv_mode=mode)
    cfg = model.config
    # Once the window is full, the bytes held stay exactly constant.
    full_after = -(-cfg.window_frames // cfg.latent_frames_per_chunk) + 1
    steady = result.kv_bytes[full_after:-1]
    assert len(set(steady)) == 1, steady
    # The last chunk is read by no later chunk: in clean mode it commits no K/V, unless the
    # stream goes on (open-ended, as `bench`'s baseline runs it). The frames are the same.
    if mode == "clean":
        assert result.kv_bytes[-1] < steady[0]
        going_on = _generate(model, num_chunks=55, kv_mode=mode, open_ended=True)
        assert going_on.kv_bytes[-1] == steady[0]
        assert np.array_equal(going_on.frames, result.frames)
    else:
        assert result.kv_bytes[-1] == steady[0]
    versions = cfg.num_steps if mode == "noisy" else 1
    per_frame = cfg.num_layers * 2 * cfg.tokens_per_frame * model.dit.dim * 4
    assert steady[0] == versions * cfg.max_context_frames * per_frame
    assert len(set(result.decoder_bytes[1:])) == 1, result.decoder_bytes
    assert np.isfinite(result.latents.numpy()).all()


def test_stream_runs_past_1024_latent_frames():
    # One layer, one step, `final` mode and no decoding keep 350 chunks cheap.
    model = load_tiny(height=32, width=32, denoising_steps=(1000.0,), dit=_one_layer_dit())
    cfg = model.config
    gen = ReferenceGenerator(model)
    from streamworld.engine.reference import ContiguousKVCache

    cache = ContiguousKVCache(1, cfg.num_layers, cfg.tokens_per_frame, cfg.sink_frames, cfg.window_frames)
    text = model.text_context("")
    f = cfg.latent_frames_per_chunk
    chunks = 1026 // f + 1
    with torch.inference_mode():
        for c in range(chunks):
            x0 = gen.denoise_chunk(0, c, c * f, text, cache, "final", None)
            cache.evict((c + 1) * f)
            assert torch.isfinite(x0).all()
    assert chunks * f > 1024
    assert cache.num_frames() == cfg.max_context_frames
    assert max(cache.versions[0]) == chunks * f - 1


def _one_layer_dit() -> dict:
    from streamworld.models import get_preset

    return {**get_preset("tiny-wan").dit, "num_layers": 1}


def test_actions_condition_only_the_frames_after_them():
    model = load_tiny(action_dim=2)
    cfg = model.config
    n = 1 + cfg.temporal_ratio * (3 * cfg.latent_frames_per_chunk - 1)
    actions = np.random.default_rng(0).normal(size=(n, 2)).astype(np.float32)
    base = _generate(model, actions=actions)
    assert torch.equal(base.latents, _generate(model, actions=actions).latents)
    # Change the actions of video frames >= 12: chunk 0 covers frames 0..8, whose actions
    # (0..7) are untouched, so it must not change; chunk 2 (frames 21..32) must.
    changed = actions.copy()
    changed[12:] += 1.0
    other = _generate(model, actions=changed)
    f = cfg.latent_frames_per_chunk
    torch.testing.assert_close(other.latents[:, :f], base.latents[:, :f])
    assert (other.latents[:, 2 * f :] - base.latents[:, 2 * f :]).abs().max() > 1e-4


def test_hold_policy_repeats_the_last_action():
    held = hold_actions(np.array([[1.0, 2.0], [3.0, 4.0]]), 4, 2)
    assert held.tolist() == [[1, 2], [3, 4], [3, 4], [3, 4]]
    assert hold_actions(None, 2, 2).tolist() == [[0, 0], [0, 0]]


def test_first_image_is_prefilled_and_not_sent_back():
    model = load_tiny(needs_image=True)
    cfg = model.config
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(cfg.height, cfg.width, 3), dtype=np.uint8)
    result = _generate(model, image=image, num_chunks=2)
    assert result.chunk_frames == [cfg.frames_per_chunk, cfg.frames_per_chunk]
    assert cfg.first_chunk_frames == cfg.frames_per_chunk
    again = _generate(model, image=image, num_chunks=2)
    assert np.array_equal(result.frames, again.frames)
    other = _generate(model, image=255 - image, num_chunks=2)
    assert (other.latents - result.latents).abs().max() > 1e-4
    with pytest.raises(ValueError, match="needs a first image"):
        _generate(model)


def test_bad_requests_are_refused_with_clear_errors(tiny_model):
    with pytest.raises(ValueError, match="kv_mode"):
        _generate(tiny_model, kv_mode="fuzzy")
    with pytest.raises(ValueError, match="takes no actions"):
        _generate(tiny_model, actions=np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="num_chunks"):
        _generate(tiny_model, num_chunks=0)


def test_warped_schedule_follows_the_shifted_grid():
    sched = FlowSchedule.build((1000, 750, 500, 250), shift=5.0, warp=True)
    assert sched.timesteps[0] == pytest.approx(1000.0)
    assert sched.timesteps[3] == pytest.approx(625.0)  # 5 * 0.25 / (1 + 4 * 0.25)
    plain = FlowSchedule.build((1000, 750, 500, 250), warp=False)
    assert plain.timesteps == (1000.0, 750.0, 500.0, 250.0)
    x0, noise = torch.randn(4), torch.randn(4)
    x = plain.renoise(x0, noise, 2)
    # With the exact flow v = noise - x0, one step recovers x0.
    torch.testing.assert_close(plain.x0_from_flow(x, noise - x0, 2), x0)
    with pytest.raises(ValueError):
        FlowSchedule.build((250, 500))
