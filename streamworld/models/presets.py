"""Named model configurations.

`tiny-wan` is a seeded random Wan-architecture text-to-video model small enough for tests on
a CPU; `wan2.1-t2v-1.3b` is the real Wan 2.1 T2V 1.3B configuration (CausVid / Self-Forcing
checkpoints), whose weights come from local paths, or random weights for benchmarking.
"""

from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig

TINY_WAN = ModelConfig(
    id="tiny-wan",
    description="Seeded random tiny Wan-architecture text-to-video model (tests; output is noise-like)",
    dit=dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    vae=dict(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0, 0.0, 0.0, 0.0],
        latents_std=[1.0, 1.0, 1.0, 1.0],
    ),
    text_encoder=dict(
        vocab_size=384,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
    ),
    text_len=32,
    height=64,
    width=64,
    fps=16,
    lite_decoder=dict(widths=(16, 8, 8, 8), blocks=(1, 1, 1, 1)),
    latent_frames_per_chunk=3,
    denoising_steps=(1000.0, 750.0, 500.0, 250.0),
    timestep_shift=5.0,
    sink_frames=1,
    window_frames=5,
    init_seed=0,
)

WAN21_T2V_13B = ModelConfig(
    id="wan2.1-t2v-1.3b",
    description="Wan 2.1 T2V 1.3B (CausVid / Self-Forcing few-step causal checkpoints)",
    dit=dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    # diffusers' AutoencoderKLWan defaults are the Wan 2.1 VAE (incl. latents mean/std).
    vae=dict(
        base_dim=96,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2,
        temperal_downsample=[False, True, True],
    ),
    # umT5-XXL encoder.
    text_encoder=dict(
        vocab_size=256384,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
    ),
    text_len=512,
    height=480,
    width=832,
    fps=16,
    latent_frames_per_chunk=3,
    denoising_steps=(1000.0, 750.0, 500.0, 250.0),
    timestep_shift=5.0,
    sink_frames=3,
    window_frames=15,
    requires_weights=True,
)

# The embedded default model: an action-conditioned PushT world model trained by StreamWorld
# (`streamworld train pusht`), shipped in the package. It denoises 64x64 frames directly (pixel
# space, 8x8 patches: 64 tokens per frame) so it runs faster than real time on a CPU; see
# docs/pusht.md for the choices and the training recipe.
PUSHT = ModelConfig(
    id="pusht",
    description="PushT world model (image + agent-target actions, 64x64 at 10 fps), trained by StreamWorld",
    dit=dict(
        patch_size=(1, 8, 8),
        num_attention_heads=6,
        attention_head_dim=32,
        in_channels=3,
        out_channels=3,
        text_dim=16,
        freq_dim=64,
        ffn_dim=768,
        num_layers=6,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    ),
    # Latent frames after the first are differences from the first frame (models/pixels.py).
    vae={"kind": "pixels", "anchored": True},
    text_encoder=None,
    text_len=1,
    height=64,
    width=64,
    fps=10,
    latent_frames_per_chunk=4,
    denoising_steps=(1000.0, 750.0, 500.0, 250.0),
    timestep_shift=1.0,
    warp_denoising_steps=False,
    prediction="x0",
    sink_frames=1,
    window_frames=8,
    action_dim=2,
    action_range=(0.0, 512.0),
    spatial_actions=True,
    needs_image=True,
    # No commit pass (4 DiT passes per chunk instead of 5), and at least as good as `clean`
    # in the evaluation (docs/pusht.md).
    default_kv_mode="final",
    builtin_weights="pusht.safetensors",
    environment="pusht",
)

# The same PushT model trained further to predict each chunk's change since the last frame
# before it (`train pusht --prediction delta`, on 5-chunk stream clips): it places the pushed
# block better and plans more goals (docs/pusht.md, docs/planning.md), and, as every delta
# model, serves `clean` and `final` but not `noisy`.
PUSHT_DELTA = replace(
    PUSHT.with_prediction("delta"),
    id="pusht-delta",
    description="PushT world model predicting each chunk's change (better block motion; no noisy KV mode)",
    builtin_weights="pusht-delta.safetensors",
)

PRESETS: dict[str, ModelConfig] = {c.id: c for c in (PUSHT, PUSHT_DELTA, TINY_WAN, WAN21_T2V_13B)}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(PRESETS))}") from None
