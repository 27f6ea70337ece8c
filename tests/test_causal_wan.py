"""The causal DiT: cached chunk forward vs. the block-causal definition, batching, stages."""

from __future__ import annotations

import pytest
import torch

from streamworld.engine.reference import ContiguousKVCache
from streamworld.models.actions import ActionAdapter, gather_latent_actions
from streamworld.models.causal_wan import ChunkInput
from tests.conftest import load_tiny, tiny_config

TOL = dict(atol=2e-5, rtol=1e-4)


def _cache(model, versions: int = 1) -> ContiguousKVCache:
    c = model.config
    return ContiguousKVCache(versions, c.num_layers, c.tokens_per_frame, c.sink_frames, c.window_frames)


@pytest.mark.parametrize(("action_dim", "spatial"), [(0, False), (3, False), (2, True)])
@torch.inference_mode()
def test_clean_cached_chunk_forward_equals_block_causal_full_sequence(action_dim, spatial):
    # A window large enough that nothing is evicted: positions are then absolute frame indices.
    model = load_tiny(window_frames=12, action_dim=action_dim, spatial_actions=spatial)
    if spatial:  # its output layer starts at zero; make the spatial path count
        torch.nn.init.normal_(model.dit.action_adapter.spatial.net[2].weight, std=0.1)
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


def test_rotation_at_absolute_positions_matches_the_table_and_stays_relative_for_hours():
    """Keys are cached rotated at absolute frame positions: the rotation must equal the
    table's, and attention scores must depend only on position differences, also hours
    into a stream (16 fps -> 4 latent frames/s: 100,000 frames is about 7 hours)."""
    from streamworld.models.causal_wan import _rotate

    model = load_tiny()
    dit = model.dit
    cos, sin = dit.rope(6)
    cos_at, sin_at = dit.rope_at(range(6))
    torch.testing.assert_close(cos_at, cos)
    torch.testing.assert_close(sin_at, sin)
    g = torch.Generator().manual_seed(0)
    p = model.config.tokens_per_frame
    q = torch.randn(p, 1, dit.head_dim, generator=g)
    k = torch.randn(p, 1, dit.head_dim, generator=g)

    def scores(q_frame: int, k_frame: int) -> torch.Tensor:
        qc, qs = dit.rope_at([q_frame])
        kc, ks = dit.rope_at([k_frame])
        rq = _rotate(q, qc[0, :, None], qs[0, :, None])
        rk = _rotate(k, kc[0, :, None], ks[0, :, None])
        return rq[:, 0] @ rk[:, 0].T

    near = scores(7, 3)
    torch.testing.assert_close(scores(100_007, 100_003), near, rtol=1e-4, atol=1e-4)
    # Moving rotated keys later in time equals rotating them there in the first place.
    shift_c, shift_s = dit.temporal_shift(99_996)
    kc, ks = dit.rope_at([3])
    moved = _rotate(_rotate(k, kc[0, :, None], ks[0, :, None]), shift_c, shift_s)
    kc2, ks2 = dit.rope_at([99_999])
    torch.testing.assert_close(moved, _rotate(k, kc2[0, :, None], ks2[0, :, None]), rtol=1e-4, atol=1e-4)


def test_rope_table_matches_diffusers_wan_rope():
    model = load_tiny()
    f = 5
    cos, sin = model.dit.rope(f)
    c = model.config
    x = torch.zeros(1, c.latent_channels, f, c.latent_height, c.latent_width)
    ref_cos, ref_sin = model.dit.transformer.rope(x)  # [1, F*P, 1, d]
    torch.testing.assert_close(cos.flatten(0, 1), ref_cos[0, :, 0])
    torch.testing.assert_close(sin.flatten(0, 1), ref_sin[0, :, 0])


def _spatial_adapter(grid=(4, 6), ratio=2) -> ActionAdapter:
    torch.manual_seed(0)
    adapter = ActionAdapter(2, ratio, 16, (0.0, 96.0), spatial_grid=grid)
    return adapter


@torch.inference_mode()
def test_spatial_actions_start_as_a_no_op():
    """Adding the spatial path to trained weights changes nothing until it is trained."""
    adapter = _spatial_adapter()
    feats = adapter.spatial_tokens(torch.rand(2, 3, 4) * 96)
    assert feats.shape == (2, 3 * 4 * 6, 16)
    assert torch.count_nonzero(feats) == 0


@torch.inference_mode()
def test_spatial_action_features_follow_the_target_across_the_grid():
    """Features depend on the offset between token and target: moving the target by one
    patch moves the features by one token, and tokens far from it differ from near ones."""
    adapter = _spatial_adapter(grid=(4, 6), ratio=1)
    torch.nn.init.normal_(adapter.spatial.net[2].weight)
    # A 6x4 token grid over a 96x96 action range: one patch is 16 x 24 action units.
    a = torch.tensor([[[40.0, 36.0]]])  # x (width), y (height)
    moved = a + torch.tensor([16.0, 24.0])  # one patch right and one down
    f0 = adapter.spatial_tokens(a).view(4, 6, -1)
    f1 = adapter.spatial_tokens(moved).view(4, 6, -1)
    torch.testing.assert_close(f1[1:, 1:], f0[:-1, :-1], rtol=1e-4, atol=1e-5)
    near, far = f0[1, 2], f0[3, 5]  # token (row 1, col 2) holds the target
    assert (near - far).abs().max() > 1e-3


def test_spatial_actions_need_2d_actions():
    with pytest.raises(ValueError, match="action_dim must be 2"):
        tiny_config(action_dim=3, spatial_actions=True)
    with pytest.raises(ValueError, match="positions"):
        ActionAdapter(3, 1, 8, spatial_grid=(2, 2))
