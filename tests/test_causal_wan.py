"""The causal DiT: cached chunk forward vs. the block-causal definition, batching, stages."""

from __future__ import annotations

import pytest
import torch

from streamworld.engine.reference import ContiguousKVCache
from streamworld.models.actions import gather_latent_actions
from streamworld.models.causal_wan import ChunkInput
from tests.conftest import load_tiny

TOL = dict(atol=2e-5, rtol=1e-4)


def _cache(model, versions: int = 1) -> ContiguousKVCache:
    c = model.config
    return ContiguousKVCache(versions, c.num_layers, c.tokens_per_frame, c.sink_frames, c.window_frames)


@pytest.mark.parametrize("action_dim", [0, 3])
@torch.inference_mode()
def test_clean_cached_chunk_forward_equals_block_causal_full_sequence(action_dim):
    # A window large enough that nothing is evicted: positions are then absolute frame indices.
    model = load_tiny(window_frames=12, action_dim=action_dim)
    cfg = model.config
    f = cfg.latent_frames_per_chunk
    gen = torch.Generator().manual_seed(1)
    clean = torch.randn(model.latent_shape(3 * f), generator=gen)
    noisy = torch.randn(model.latent_shape(f), generator=gen)
    noisy_t = torch.tensor([700.0, 750.0, 800.0])  # per-frame timesteps
    text = model.text_context("a red car on a wet road")
    actions = torch.randn(1 + cfg.temporal_ratio * 4 * f, max(action_dim, 1), generator=gen)[:, :action_dim]

    def latent_actions(first: int, n: int):
        return gather_latent_actions(actions, first, n, cfg.temporal_ratio) if action_dim else None

    cache = _cache(model)
    committed = []
    for c in range(3):
        view = cache.view(c * f, 0, (0,))
        unit = ChunkInput(clean[:, c * f : (c + 1) * f], torch.zeros(f), text, view, latent_actions(c * f, f))
        committed.append(model.dit.forward_chunk([unit])[0])
    view = cache.view(3 * f, 0, ())
    assert view.context_frames == 3 * f
    last = model.dit.forward_chunk([ChunkInput(noisy, noisy_t, text, view, latent_actions(3 * f, f))])[0]

    seq = torch.cat([clean, noisy], dim=1).unsqueeze(0)
    t = torch.cat([torch.zeros(3 * f), noisy_t]).unsqueeze(0)
    chunk_ids = torch.arange(4).repeat_interleave(f)
    seq_actions = latent_actions(0, 4 * f)
    full = model.dit.forward_sequence(
        seq, t, text, chunk_ids, None if seq_actions is None else seq_actions.unsqueeze(0)
    )[0]

    torch.testing.assert_close(torch.cat(committed, dim=1), full[:, : 3 * f], **TOL)
    torch.testing.assert_close(last, full[:, 3 * f :], **TOL)
    # The mask matters: without it the first chunk would see the future and differ.
    unmasked = model.dit.forward_sequence(
        seq,
        t,
        text,
        torch.zeros(4 * f, dtype=torch.long),
        None if seq_actions is None else seq_actions.unsqueeze(0),
    )[0]
    assert (unmasked[:, :f] - full[:, :f]).abs().max() > 1e-3


@torch.inference_mode()
def test_batched_units_with_different_context_and_timesteps_equal_single_runs():
    model = load_tiny(window_frames=12)
    f = model.config.latent_frames_per_chunk
    gen = torch.Generator().manual_seed(2)
    texts = [model.text_context("first"), model.text_context("second prompt")]
    caches = [_cache(model), _cache(model)]
    # Stream 0 has two committed chunks of context, stream 1 one.
    for s, chunks in enumerate((2, 1)):
        for c in range(chunks):
            view = caches[s].view(c * f, 0, (0,))
            x = torch.randn(model.latent_shape(f), generator=gen)
            model.dit.forward_chunk([ChunkInput(x, torch.zeros(f), texts[s], view)])
    units = [
        ChunkInput(
            torch.randn(model.latent_shape(f), generator=gen),
            torch.full((f,), t),
            texts[s],
            caches[s].view(first, 0, ()),
        )
        for s, (first, t) in enumerate(((2 * f, 937.5), (f, 400.0)))
    ]
    assert [u.kv.context_frames for u in units] == [2 * f, f]
    singles = torch.cat([model.dit.forward_chunk([u]) for u in units])

    # The same batch split into two stages.
    act = model.dit.embed(units)
    act = model.dit.run_blocks(act, units, 0, 2)
    act = model.dit.run_blocks(act, units, 2, model.config.num_layers)
    batched = model.dit.head(act)
    torch.testing.assert_close(batched, singles, **TOL)


@torch.inference_mode()
def test_each_block_writes_kv_for_every_frame_of_the_chunk():
    model = load_tiny()
    cfg = model.config
    f = cfg.latent_frames_per_chunk
    cache = _cache(model)
    view = cache.view(0, 0, (0,))
    x = torch.randn(model.latent_shape(f))
    model.dit.forward_chunk([ChunkInput(x, torch.zeros(f), model.text_context(""), view)])
    assert sorted(cache.versions[0]) == list(range(f))
    heads, head_dim = model.dit.heads, model.dit.head_dim
    for blocks in cache.versions[0].values():
        assert len(blocks) == cfg.num_layers
        for k, v in blocks:
            assert k.shape == v.shape == (cfg.tokens_per_frame, heads, head_dim)


def test_rope_table_extends_for_any_number_of_frames():
    model = load_tiny()
    cos, sin = model.dit.rope(5000)
    assert cos.shape == (5000, model.config.tokens_per_frame, model.dit.head_dim)
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos))


def test_rope_table_matches_diffusers_wan_rope():
    model = load_tiny()
    f = 5
    cos, sin = model.dit.rope(f)
    c = model.config
    x = torch.zeros(1, c.latent_channels, f, c.latent_height, c.latent_width)
    ref_cos, ref_sin = model.dit.transformer.rope(x)  # [1, F*P, 1, d]
    torch.testing.assert_close(cos.flatten(0, 1), ref_cos[0, :, 0])
    torch.testing.assert_close(sin.flatten(0, 1), ref_sin[0, :, 0])
