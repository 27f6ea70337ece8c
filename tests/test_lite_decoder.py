"""The lite decoder (`--decoder lite`), its distillation, and the compiled paths (`--compile`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from streamworld.cli import main
from streamworld.engine.engine import AsyncEngine
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.engine.stream import StreamRequest
from streamworld.models.lite_decoder import LiteDecoder, load_lite_decoder, save_lite_decoder
from streamworld.models.vae import StreamingVAE
from streamworld.models.world_model import WorldModel, _lite_decoder
from tests.conftest import tiny_config
from tests.test_engine import assert_matches, collect, engine_config


def _lite_vae(seed: int = 0) -> StreamingVAE:
    cfg = tiny_config()
    vae = StreamingVAE.from_config(cfg, seed=1)
    torch.manual_seed(seed)
    lite = LiteDecoder.for_model(cfg)
    return vae.use_lite_decoder(lite)


def test_chunk_by_chunk_and_batched_decoding_equal_the_whole_clip():
    vae = _lite_vae()
    z = torch.randn(2, 4, 6, 8, 8)
    full = vae.decode_full(z)
    assert full.shape == (2, 3, 1 + 4 * 5, 64, 64)  # Wan's frame count: 1 + r (F - 1)
    states = [vae.new_decoder_state() for _ in range(2)]
    parts = [vae.decode_chunks([z[i : i + 1, :, s : s + 3] for i in range(2)], states) for s in (0, 3)]
    assert [p.shape[2] for p in parts[0]] == [9, 9] and [p.shape[2] for p in parts[1]] == [12, 12]
    for i in range(2):
        torch.testing.assert_close(torch.cat([parts[0][i], parts[1][i]], dim=2), full[i : i + 1])
    # The memory blocks carry the past: a different first chunk changes the second one's frames.
    other = vae.new_decoder_state()
    vae.decode_chunk(torch.randn(1, 4, 3, 8, 8), other)
    assert not torch.allclose(vae.decode_chunk(z[:1, :, 3:], other), parts[1][0])
    assert vae.decoder_kind == "lite" and states[0].nbytes() > 0
    # A stream's state holds one frame per memory block, not views of the whole chunk.
    alone = vae.new_decoder_state()
    vae.decode_chunk(z[:1, :, :3], alone)
    for slot in alone.feat_cache:
        assert slot.untyped_storage().nbytes() == slot.numel() * slot.element_size()


def test_weights_round_trip_and_bad_files_are_refused(tmp_path):
    vae = _lite_vae(seed=3)
    path = tmp_path / "lite.safetensors"
    save_lite_decoder(vae.lite, str(path))
    loaded = load_lite_decoder(str(path))
    assert loaded.config == vae.lite.config
    z = torch.randn(1, 4, 3, 8, 8)
    again = StreamingVAE.from_config(tiny_config(), seed=1).use_lite_decoder(loaded)
    torch.testing.assert_close(again.decode_full(z), vae.decode_full(z))

    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a StreamWorld lite decoder"):
        load_lite_decoder(str(tmp_path / "other.safetensors"))
    wrong = LiteDecoder.for_latents(16, 8, 4, widths=(8, 8, 8, 8), blocks=(1, 1, 1, 1))
    with pytest.raises(ValueError, match="16-channel latents"):
        StreamingVAE.from_config(tiny_config(), seed=1).use_lite_decoder(wrong)


def test_real_models_need_distilled_weights_unless_random():
    real = tiny_config(requires_weights=True)
    with pytest.raises(ValueError, match="distill-decoder"):
        _lite_decoder(real, None, random_weights=False)
    assert isinstance(_lite_decoder(real, None, random_weights=True), LiteDecoder)
    with pytest.raises(ValueError, match="pixel space"):
        WorldModel.load(dataclasses.replace(tiny_config(), vae={"kind": "pixels"}), decoder="lite")


async def _engine(model: WorldModel, seeds: list[int]) -> tuple[list, dict]:
    async with AsyncEngine(model, engine_config()) as engine:
        requests = [StreamRequest(seed=s, num_chunks=2, prompt="p", kv_mode="noisy") for s in seeds]
        handles = [engine.open_stream(r) for r in requests]
        return [await collect(h) for h in handles], dict(engine.stats.batch_sizes)


def _reference(model: WorldModel, seed: int):
    return ReferenceGenerator(model).generate(
        GenerationRequest(seed=seed, num_chunks=2, prompt="p", kv_mode="noisy")
    )


async def test_engine_streams_decode_through_the_lite_decoder_as_the_reference_does():
    model = WorldModel.load(tiny_config(), decoder="lite")
    expected = _reference(model, 4)
    outs, _ = await _engine(model, [4])
    assert_matches(outs[0], expected)
    wan = _reference(WorldModel.load(tiny_config()), 4)
    torch.testing.assert_close(wan.latents, expected.latents)  # same DiT, another decoder
    assert not np.array_equal(wan.frames, expected.frames)


@pytest.mark.slow
async def test_compiled_elementwise_equals_eager_for_units_and_batches():
    model = WorldModel.load(tiny_config())
    eager = {s: _reference(model, s) for s in (0, 1, 2)}
    model.dit.compile_elementwise(model.config.latent_frames_per_chunk)
    assert model.dit.elementwise_compiled
    torch.testing.assert_close(_reference(model, 0).latents, eager[0].latents, atol=1e-4, rtol=1e-4)
    # Three streams through the engine: batches of several units take the compiled path too,
    # and the executors compile nothing (batch sizes other than those compiled for included).
    graphs = counters["stats"]["unique_graphs"]
    outs, batches = await _engine(model, [0, 1, 2])
    assert max(batches) > 2
    assert counters["stats"]["unique_graphs"] == graphs
    for seed, out in zip((0, 1, 2), outs, strict=True):
        assert_matches(out, eager[seed])


@pytest.mark.slow
def test_compiled_lite_decoder_equals_eager_for_streams_and_batches():
    eager, compiled = _lite_vae(seed=4), _lite_vae(seed=4)
    compiled.lite.compile_for(8, 8, 3)  # tiny-wan: 8x8 latents, 3 per chunk
    assert compiled.lite.compiled and not eager.lite.compiled
    z = torch.randn(3, 4, 6, 8, 8)

    def decode(vae: StreamingVAE) -> tuple[list[torch.Tensor], list]:
        """Two chunks of a batch of 3 (another size than compiled for), then one stream."""
        states = [vae.new_decoder_state() for _ in range(3)]
        out = [
            x
            for s in (0, 3)
            for x in vae.decode_chunks([z[i : i + 1, :, s : s + 3] for i in range(3)], states)
        ]
        return [*out, vae.decode_chunk(z[:1, :, :3], vae.new_decoder_state())], states

    graphs = counters["stats"]["unique_graphs"]
    (got, states), (expected, _) = decode(compiled), decode(eager)
    for x, y in zip(got, expected, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    # Batches over the decoder's batch limit (32-bit indexing) decode in parts: 2 + 1 here.
    assert compiled.lite.batch_limit >= 3  # tiny frames: far from the limit
    compiled.lite.batch_limit = 2
    got_parts, states_parts = decode(compiled)
    for x, y in zip(got_parts, expected, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for a, b in zip(states_parts, states, strict=True):
        for x, y in zip(a.feat_cache, b.feat_cache, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    # A size it was not compiled for decodes eagerly, correctly, and compiles nothing.
    other = torch.randn(1, 4, 3, 4, 6)
    torch.testing.assert_close(compiled.decode_full(other), eager.decode_full(other))
    assert counters["stats"]["unique_graphs"] == graphs  # serving never compiles
    for slot in states[0].feat_cache:  # a compact state through the compiled path too
        assert slot.untyped_storage().nbytes() == slot.numel() * slot.element_size()


def _videos(folder, n: int = 3, frames: int = 30) -> None:
    from streamworld.media import write_mp4

    rng = np.random.default_rng(0)
    folder.mkdir()
    for v in range(n):
        clip = np.zeros((frames, 48, 80, 3), np.uint8)  # another size: resized and cropped
        clip[:] = rng.integers(0, 255, 3)
        for t in range(frames):
            x = (3 * t + 11 * v) % 60
            clip[t, 12:36, x : x + 20] = (220, 60, 40)
        write_mp4(clip, folder / f"v{v}.mp4", fps=16)


@pytest.mark.slow
def test_distill_decoder_cli_trains_weights_that_serve(tmp_path, capsys):
    videos = tmp_path / "videos"
    _videos(videos)
    out = tmp_path / "lite.safetensors"
    summary = tmp_path / "summary.json"
    args = ["distill-decoder", "--model", "tiny-wan", "--videos", str(videos), "--device", "cpu"]
    train = ["--steps", "40", "--clip-latent-frames", "3", "--json", str(summary)]
    assert main([*args, "--out", str(out), *train]) == 0

    report = json.loads(summary.read_text())
    assert report["final_loss"] < report["first_loss"]
    assert report["held_out_psnr_db"] > report["held_out_psnr_db_before"]
    assert "held-out PSNR" in capsys.readouterr().out
    npy = tmp_path / "x.npy"
    gen = ["generate", "--model", "tiny-wan", "--chunks", "2", "--decoder", "lite", "--out", str(npy)]
    assert main([*gen, "--decoder-weights", str(out)]) == 0
    assert np.load(npy).shape == (9 + 12, 64, 64, 3)

    assert main([*args, "--out", str(tmp_path / "y.safetensors")[:-12] + ".bin"]) == 2
    assert "--out must be a .safetensors path" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    empty = ["distill-decoder", "--model", "tiny-wan", "--videos", str(tmp_path / "empty")]
    assert main([*empty, "--out", str(out)]) == 2
    assert "no videos" in capsys.readouterr().err
    assert main(["distill-decoder", "--model", "pusht", "--videos", str(videos), "--out", str(out)]) == 2
    assert "pixel space" in capsys.readouterr().err
    assert main([*gen, "--decoder-weights", str(tmp_path / "missing.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    no_vae = ["distill-decoder", "--model", "tiny-wan", "--weights", str(tmp_path / "empty")]
    assert main([*no_vae, "--videos", str(videos), "--out", str(out)]) == 2
    assert "has no vae/ folder" in capsys.readouterr().err
    assert main(["serve", "--decoder", "lite"]) == 2  # pusht alone: nothing to replace
    assert "no VAE decoder to replace" in capsys.readouterr().err
