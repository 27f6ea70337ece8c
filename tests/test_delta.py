"""Models that predict "delta": each chunk's change since the last latent frame before it
(x0 = last + output). The engine (exact modes, forks, stages) equals the reference; a zero
output copies the last frame, free-running and teacher-forced; training targets are what
serving adds back; `noisy` is refused (CPU, tiny configs)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest
import torch

from streamworld.engine import AsyncEngine, BranchRequest, ReplicaPlacement, StagePlacement, StreamRequest
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.models.config import KV_MODES
from streamworld.models.presets import PUSHT
from streamworld.models.world_model import WorldModel, image_as_last_frame
from streamworld.pusht.evaluate import record_eval_episode, true_latents
from streamworld.pusht.train import smoke_config, training_target
from tests.conftest import tiny_config
from tests.test_engine import collect, engine_config


def _tiny_delta() -> WorldModel:
    return WorldModel.load(tiny_config(needs_image=True, action_dim=2).with_prediction("delta"))


def _inputs(model: WorldModel, chunks: int, seed: int = 0):
    cfg = model.config
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (cfg.height, cfg.width, 3), dtype=np.uint8)
    frames = 1 + cfg.temporal_ratio * chunks * cfg.latent_frames_per_chunk
    return image, rng.uniform(-1, 1, size=(frames, 2)).astype(np.float32)


def test_a_delta_model_serves_exact_kv_modes_only():
    cfg = tiny_config(needs_image=True, action_dim=2).with_prediction("delta")
    assert cfg.prediction == "delta" and "noisy" not in cfg.kv_modes
    assert cfg.default_kv_mode in cfg.kv_modes
    with pytest.raises(ValueError, match="noisy"):
        dataclasses.replace(cfg, kv_modes=KV_MODES)
    model = WorldModel.load(cfg)
    image, actions = _inputs(model, 1)
    with pytest.raises(ValueError, match="kv_mode 'noisy' is not supported"):
        ReferenceGenerator(model).generate(
            GenerationRequest(0, 1, image=image, actions=actions, kv_mode="noisy")
        )


@pytest.mark.parametrize("kv_mode", ["clean", "final"])
async def test_the_engine_with_stages_and_forks_equals_the_reference(kv_mode):
    """A parent stream on a two-stage placement, forked into two branches (one with its own
    seed and actions): every chunk equals the reference. With random weights and a VAE the
    last frame (the image's latent for the first chunk) is far from zero, so an engine that
    left it out would differ."""
    model = _tiny_delta()
    image, actions = _inputs(model, 6)
    _, mine = _inputs(model, 6, seed=1)
    _, other = _inputs(model, 6, seed=2)
    stages = (StagePlacement(0, 2, "cpu", 0), StagePlacement(2, 4, "cpu", 1))
    config = engine_config(placement=ReplicaPlacement(stages, "cpu"))
    async with AsyncEngine(model, config) as engine:
        request = StreamRequest(seed=3, num_chunks=5, image=image, actions=actions, kv_mode=kv_mode)
        parent = engine.open_stream(request)
        before = [await parent.__anext__()]
        branches = engine.fork(
            parent.id, [BranchRequest(2, actions=mine), BranchRequest(2, actions=other, seed=9)]
        )
        await branches[0].admitted()
        fork = branches[0].stream.fork_chunk
        while before[-1].index < fork - 1:
            before.append(await parent.__anext__())
        parent.cancel()
        results = await asyncio.gather(*(collect(b) for b in branches))
        assert engine.pool.pages_used == 0
    ref = ReferenceGenerator(model)
    f, n = model.config.latent_frames_per_chunk, fork + 2
    start = parent.stream.chunk_video_start(fork)

    def reference(branch_actions: np.ndarray, seed: int) -> torch.Tensor:
        fed = np.concatenate([actions[: start - 1], branch_actions])
        request = GenerationRequest(
            3, n, image=image, actions=fed, kv_mode=kv_mode, seed_changes={fork: seed}
        )
        return ref.generate(request).latents

    first, second = reference(mine, 3), reference(other, 9)
    expected = [first[:, : fork * f], first[:, fork * f :], second[:, fork * f :]]
    for outputs, latents in zip([before[:fork], *results], expected, strict=True):
        torch.testing.assert_close(torch.cat([o.latents for o in outputs], 1), latents, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(first[:, fork * f :], second[:, fork * f :], atol=1e-3)


def _silent_pusht() -> WorldModel:
    """A PushT-shaped delta model whose DiT outputs exactly zero: it predicts "nothing moves"."""
    model = WorldModel.load(smoke_config(PUSHT).with_prediction("delta"), random_weights=True)
    with torch.no_grad():
        model.dit.transformer.proj_out.weight.zero_()
        model.dit.transformer.proj_out.bias.zero_()
    return model


def test_a_zero_delta_copies_the_last_frame_before_each_chunk():
    """Free-running, every frame is the first one; teacher-forced (the true frames as the
    context), each chunk is the last true frame before it: the copy-last-frame predictor."""
    model = _silent_pusht()
    fpc = model.config.frames_per_chunk
    ep = record_eval_episode(3, 3 * fpc, model.config.height)
    assert np.abs(ep.frames[fpc].astype(int) - ep.frames[0].astype(int)).max() > 50  # the agent moves
    gen = ReferenceGenerator(model)
    free = gen.generate(
        GenerationRequest(0, 3, image=ep.frames[0], actions=ep.actions, kv_mode="final")
    ).frames
    assert np.abs(free.astype(int) - ep.frames[0].astype(int)).max() <= 1
    forced = gen.generate(
        GenerationRequest(
            0,
            3,
            image=ep.frames[0],
            actions=ep.actions,
            kv_mode="clean",
            context_latents=true_latents(model, ep.frames),
        )
    ).frames
    for c in range(3):
        copied = np.broadcast_to(ep.frames[c * fpc], forced[c * fpc : (c + 1) * fpc].shape)
        assert np.abs(forced[c * fpc : (c + 1) * fpc].astype(int) - copied.astype(int)).max() <= 1


def test_the_training_target_added_to_the_served_last_frame_gives_the_clip():
    """Serving adds to the DiT's output the last frame before the chunk (the first image's,
    then each chunk's last); a DiT that output exactly the training target would therefore
    reproduce the true clip, teacher-forced, chunk by chunk."""
    model = WorldModel.load(smoke_config(PUSHT).with_prediction("delta"), random_weights=True)
    cfg, sched = model.config, model.schedule
    f = cfg.latent_frames_per_chunk
    ep = record_eval_episode(5, 3 * f, cfg.height)
    clip = true_latents(model, ep.frames)[None]  # [1, C, L, H, W]
    image = model.vae.encode_image(torch.from_numpy(ep.frames[:1]).permute(0, 3, 1, 2) / 127.5 - 1)
    target = training_target(cfg, clip, torch.zeros_like(clip), image, clip)[0]
    assert target.abs().sum() < clip.abs().sum()  # what stands still since the last frame is zero
    last = image_as_last_frame(cfg, image[0])
    for c in range(3):
        x0 = sched.x0_from_flow(clip[0, :, :f], target[:, c * f : (c + 1) * f], 0, last)
        torch.testing.assert_close(x0, clip[0, :, c * f : (c + 1) * f])
        last = x0[:, -1:]


@pytest.mark.slow
def test_train_fine_tunes_x0_weights_to_delta_and_serving_adopts_what_they_record(tmp_path, capsys):
    """`train pusht --prediction delta --init X0_WEIGHTS` starts from the x0 model and trains
    the exact KV modes' contexts only; its export
    records "delta", which loading into the (x0) preset adopts, dropping the noisy mode; flow
    weights stay refused."""
    from streamworld.cli import main as cli_main
    from streamworld.models.world_model import WeightPaths

    x0_dir, delta_dir = tmp_path / "x0", tmp_path / "delta"
    smoke = ["train", "pusht", "--smoke", "--total-steps", "1"]
    assert cli_main([*smoke, "--workdir", str(x0_dir)]) == 0
    x0_weights = str(x0_dir / "pusht.safetensors")
    args = ["train", "pusht", "--smoke", "--total-steps", "4", "--workdir", str(delta_dir)]
    assert cli_main([*args, "--prediction", "delta", "--init", x0_weights]) == 0
    assert "trained to predict 'x0'; fine-tuned to predict 'delta'" in capsys.readouterr().out
    # No sample trains the noisy context, which the model will not serve.
    history = json.loads((delta_dir / "train_summary.json").read_text())["history"]
    assert history and all("loss_noisy" not in h and h["loss"] > 0 for h in history)
    preset = smoke_config(PUSHT)
    served = WorldModel.load(preset, WeightPaths(dit=str(delta_dir / "pusht.safetensors")))
    assert served.config.prediction == "delta" and served.schedule.prediction == "delta"
    assert served.config.kv_modes == ("clean", "final")
    back = WorldModel.load(preset.with_prediction("delta"), WeightPaths(dit=x0_weights))
    assert back.config.prediction == "x0"
    with pytest.raises(ValueError, match="trained to predict 'delta'"):
        WorldModel.load(preset.with_prediction("flow"), WeightPaths(dit=str(delta_dir / "pusht.safetensors")))


async def test_a_served_delta_model_lists_and_keeps_to_its_kv_modes():
    """Over the wire: /v1/models lists clean and final only, a session that asks for noisy is
    refused as unsupported, and a final-mode session streams the reference's frames."""
    import aiohttp

    from tests.test_server import _frames, raw_session, start_server

    model = WorldModel.load(tiny_config().with_prediction("delta"))
    _, running = await start_server({"tiny-wan": model})
    try:
        url, http = f"ws://127.0.0.1:{running.port}/v1/stream", f"http://127.0.0.1:{running.port}"
        async with aiohttp.ClientSession() as s, s.get(f"{http}/v1/models") as r:
            (entry,) = (await r.json())["models"]
        assert entry["kv_modes"] == ["clean", "final"] and entry["default_kv_mode"] in ("clean", "final")
        replies, code = await raw_session(url, {"type": "session.start", "kv_mode": "noisy"})
        assert replies[0]["code"] == "unsupported" and "noisy" in replies[0]["message"] and code == 1008
        frames = await _frames(url, "tiny-wan", 5, 3)
    finally:
        await running.close()
    expected = ReferenceGenerator(model).generate(GenerationRequest(5, 3)).frames
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 2


async def test_the_shipped_delta_pusht_model_serves_scenes_and_plans_as_pusht_does(tmp_path):
    """`pusht-delta` ships its own weights (trained to predict delta, as they record), serves
    clean and final, has the PushT scenes (first frames, resting actions) and is evaluated
    and planned with as `pusht` is."""
    import aiohttp

    from streamworld.cli.main import main
    from streamworld.client import StreamWorldClient
    from streamworld.models import get_preset
    from streamworld.pusht.evaluate import evaluate
    from streamworld.scenes import resting_action
    from tests.test_server import start_server

    config = get_preset("pusht-delta")
    model = WorldModel.load(config)  # the shipped file: a prediction mismatch would raise
    assert (model.config.prediction, model.config.kv_modes) == ("delta", ("clean", "final"))
    _, running = await start_server({"pusht-delta": model})
    try:
        url, http = f"ws://127.0.0.1:{running.port}/v1/stream", f"http://127.0.0.1:{running.port}"
        async with aiohttp.ClientSession() as s, s.get(f"{http}/v1/models") as r:
            (entry,) = (await r.json())["models"]
        async with StreamWorldClient(url, model="pusht-delta", format="rgb", num_chunks=2) as c:
            chunks = [ch async for ch in c.chunks()]
            scene = c.info.raw.get("scene")
    finally:
        await running.close()
    assert (
        entry["environment"] == "pusht"
        and entry["has_default_image"]
        and entry["kv_modes"] == ["clean", "final"]
    )
    assert len(chunks) == 2 and scene is not None and "agent" in scene
    assert resting_action(config, scene) == [float(v) for v in scene["agent"][:2]]
    report = evaluate(model, [0], ["final"], horizon=4, progress=False)
    assert set(report["modes"]) == {"final"} and len(next(iter(report["modes"]["final"].values()))) == 4
    plan = [
        "eval",
        "pusht-delta",
        "--plan",
        "--seeds",
        "0",
        "--budget",
        "2",
        "--samples",
        "2",
        "--elites",
        "1",
    ]
    plan += ["--iterations", "1", "--plan-horizon", "4", "--json", str(tmp_path / "plan.json")]
    assert await asyncio.to_thread(main, plan) == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    assert (report["model"], report["prediction"], report["kv_mode"]) == ("pusht-delta", "delta", "final")
    assert report["episodes"][0]["steps"] >= 1
    assert await asyncio.to_thread(main, [*plan[:2], "--plan", "--kv-mode", "noisy"]) == 2  # a usage error
