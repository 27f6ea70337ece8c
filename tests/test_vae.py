"""Streaming decode of the Wan VAE: chunk-by-chunk equals whole clip, per-stream state, encoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamworld.models.config import ModelConfig
from streamworld.models.vae import StreamingVAE, image_from_uint8, to_uint8

Z_DIM = 4
# Non-trivial normalisation, so tests notice when it is skipped or applied twice.
LATENTS_MEAN = [0.3, -0.2, 0.1, -0.5]
LATENTS_STD = [1.5, 0.7, 2.0, 1.1]
TINY_VAE = dict(
    base_dim=8,
    z_dim=Z_DIM,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=LATENTS_MEAN,
    latents_std=LATENTS_STD,
)
SIZE = 32


@pytest.fixture(scope="module")
def vae() -> StreamingVAE:
    return StreamingVAE.from_kwargs(TINY_VAE, seed=0)


def latents(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, Z_DIM, frames, SIZE // 8, SIZE // 8, generator=g)


def decode_in_chunks(vae: StreamingVAE, z: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    state = vae.new_decoder_state()
    out, start = [], 0
    for size in sizes:
        out.append(vae.decode_chunk(z[:, :, start : start + size], state))
        start += size
    assert state.latent_frames == z.shape[2]
    return out


@pytest.mark.parametrize("sizes", [[1, 3, 3], [3, 3, 1]])
def test_chunk_by_chunk_decode_equals_whole_clip_decode(vae: StreamingVAE, sizes: list[int]) -> None:
    z = latents(7, seed=1)
    full = vae.decode_full(z)
    assert full.shape == (1, 3, 1 + 4 * 6, SIZE, SIZE)
    assert full.min() >= -1 and full.max() <= 1

    # decode_full is diffusers' decode of the un-normalised latents.
    mean = torch.tensor(LATENTS_MEAN).view(1, -1, 1, 1, 1)
    std = torch.tensor(LATENTS_STD).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        reference = vae.vae.decode(z * std + mean).sample
    torch.testing.assert_close(full, reference, atol=1e-5, rtol=0)

    chunks = decode_in_chunks(vae, z, sizes)
    assert [c.shape[2] for c in chunks] == [1 + 4 * (sizes[0] - 1)] + [4 * s for s in sizes[1:]]
    torch.testing.assert_close(torch.cat(chunks, dim=2), full, atol=1e-5, rtol=0)


def test_interleaved_streams_keep_separate_decoder_state(vae: StreamingVAE) -> None:
    za, zb = latents(7, seed=2), latents(7, seed=3)
    alone_a = decode_in_chunks(vae, za, [1, 3, 3])
    alone_b = decode_in_chunks(vae, zb, [3, 3, 1])

    state_a, state_b = vae.new_decoder_state(), vae.new_decoder_state()
    assert state_a.nbytes() == 0
    a, b = [], []
    b.append(vae.decode_chunk(zb[:, :, 0:3], state_b))
    a.append(vae.decode_chunk(za[:, :, 0:1], state_a))
    a.append(vae.decode_chunk(za[:, :, 1:4], state_a))
    b.append(vae.decode_chunk(zb[:, :, 3:6], state_b))
    a.append(vae.decode_chunk(za[:, :, 4:7], state_a))
    b.append(vae.decode_chunk(zb[:, :, 6:7], state_b))

    for got, want in zip(a + b, alone_a + alone_b, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert state_a.nbytes() > 0

    state_a.reset()
    assert state_a.latent_frames == 0 and state_a.nbytes() == 0
    torch.testing.assert_close(vae.decode_chunk(za[:, :, 0:1], state_a), alone_a[0], atol=1e-5, rtol=0)


def test_encode_image_roundtrip_shapes_and_normalisation(vae: StreamingVAE) -> None:
    g = torch.Generator().manual_seed(4)
    image = torch.rand(2, 3, SIZE, SIZE, generator=g) * 2 - 1
    z = vae.encode_image(image)
    assert z.shape == (2, Z_DIM, 1, SIZE // 8, SIZE // 8)

    with torch.no_grad():
        mu = vae.vae.encode(image.unsqueeze(2)).latent_dist.mean
    mean = torch.tensor(LATENTS_MEAN).view(1, -1, 1, 1, 1)
    std = torch.tensor(LATENTS_STD).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(z, (mu - mean) / std, atol=1e-6, rtol=0)

    frame = vae.decode_full(z)
    assert frame.shape == (2, 3, 1, SIZE, SIZE)


def test_mismatched_latent_statistics_are_refused() -> None:
    with pytest.raises(ValueError, match="z_dim=4"):
        StreamingVAE.from_kwargs({**TINY_VAE, "latents_mean": [0.0] * 16}, seed=0)


def test_from_config_is_seeded_and_leaves_global_rng_alone() -> None:
    config = ModelConfig(
        id="t",
        dit={"num_layers": 1, "patch_size": (1, 2, 2)},
        vae=TINY_VAE,
        text_encoder=None,
        height=SIZE,
        width=SIZE,
        text_len=32,
        latent_frames_per_chunk=1,
        window_frames=2,
    )
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    one = StreamingVAE.from_config(config, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    two = StreamingVAE.from_config(config, seed=5)
    for p, q in zip(one.parameters(), two.parameters(), strict=True):
        assert torch.equal(p, q)
    assert one.temporal_ratio == config.temporal_ratio
    assert one.spatial_ratio == config.spatial_ratio


def test_from_pretrained_loads_a_saved_folder_and_explains_original_checkpoints(
    vae: StreamingVAE, tmp_path
) -> None:
    vae.vae.save_pretrained(tmp_path / "pipeline" / "vae")
    loaded = StreamingVAE.from_pretrained(tmp_path / "pipeline")
    z = latents(2, seed=6)
    torch.testing.assert_close(loaded.decode_full(z), vae.decode_full(z), atol=0, rtol=0)

    with pytest.raises(FileNotFoundError, match="empty"):
        (tmp_path / "empty").mkdir()
        StreamingVAE.from_pretrained(tmp_path / "empty")
    original = tmp_path / "wan" / "Wan2.1_VAE.pth"
    original.parent.mkdir()
    original.write_bytes(b"")
    (tmp_path / "wan" / "config.json").write_text('{"model_type": "t2v"}')
    for where in (original, original.parent):
        with pytest.raises(NotImplementedError, match="convert_wan_to_diffusers"):
            StreamingVAE.from_pretrained(where)


def test_uint8_conversion() -> None:
    frames = torch.tensor([-1.0, 1.0, 0.0, -2.0, 2.0, 2 / 255 - 1]).view(1, 3, 2, 1, 1)
    out = to_uint8(frames)
    assert out.dtype == np.uint8 and out.shape == (1, 2, 1, 1, 3)
    # [B, 3, T, H, W] -> [B, T, H, W, 3]: channel c of frame t is frames[0, c, t].
    assert out[0, :, 0, 0, :].T.tolist() == [[0, 255], [128, 0], [255, 1]]

    image = np.array([[[0, 255, 128]]], dtype=np.uint8)
    x = image_from_uint8(image)
    assert x.shape == (1, 3, 1, 1) and x.dtype == torch.float32
    torch.testing.assert_close(x.flatten(), torch.tensor([-1.0, 1.0, 128 / 255 * 2 - 1]))
    assert np.array_equal(to_uint8(x.unsqueeze(2)).reshape(3), image.reshape(3))


def test_batched_decode_of_several_streams_equals_decoding_each_alone():
    vae = StreamingVAE.from_kwargs(TINY_VAE, seed=0)
    gen = torch.Generator().manual_seed(5)
    chunks = [[torch.randn(1, 4, f, 4, 4, generator=gen) for f in (3, 3, 3)] for _ in range(3)]
    alone = []
    for stream in chunks:
        state = vae.new_decoder_state()
        alone.append([vae.decode_chunk(x, state) for x in stream])
    states = [vae.new_decoder_state() for _ in chunks]
    for c in range(3):
        outs = vae.decode_chunks([stream[c] for stream in chunks], states)
        for s, out in enumerate(outs):
            torch.testing.assert_close(out, alone[s][c], atol=1e-5, rtol=1e-5)
    # A stream at another position cannot join the batch.
    fresh = vae.new_decoder_state()
    with pytest.raises(ValueError, match="different positions"):
        vae.decode_chunks([chunks[0][0], chunks[1][0]], [fresh, states[0]])
