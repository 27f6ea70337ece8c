"""The embedded PushT model: environment, data, training CLI, evaluation, serving and the robot loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from streamworld.cli import main as cli_main
from streamworld.client import StreamWorldClient
from streamworld.engine import AsyncEngine, EngineConfig, StreamRequest
from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.models import get_preset
from streamworld.models.pixels import PixelCodec, frames_to_latents
from streamworld.models.world_model import WorldModel, builtin_weights_path
from streamworld.pusht.data import Dataset, DatasetSpec, generate_dataset, record_episode
from streamworld.pusht.evaluate import evaluate, markdown_table, parse_seeds, psnr, record_eval_episode, ssim
from streamworld.pusht.policy import ScriptedPolicy
from streamworld.pusht.proposals import CandidatePolicy
from streamworld.pusht.world import PushTWorld, block_mask, initial_frame, locate, palette_weights
from streamworld.server.app import ServerConfig, StreamWorldServer
from tests.conftest import load_script
from tests.test_engine import assert_matches, collect, engine_config
from tests.test_server import RunningServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pusht() -> WorldModel:
    return WorldModel.load(get_preset("pusht"))


@pytest.fixture(scope="module")
def pusht_delta() -> WorldModel:
    return WorldModel.load(get_preset("pusht-delta"))


# --- environment, policy, data -----------------------------------------------------------
def test_frames_are_reproducible_by_seed_and_locate_finds_the_agent():
    a, scene_a = initial_frame(7)
    b, scene_b = initial_frame(7)
    c, _ = initial_frame(8)
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and scene_a == scene_b
    assert not np.array_equal(a, c)
    world, policy = PushTWorld(64), ScriptedPolicy(3)
    world.reset(3)
    for _ in range(20):
        frame = world.step(policy(world.scene))
        found = locate(frame).agent
        x, y = world.scene.agent
        assert found is not None and np.hypot(found[0] - x / 8, found[1] - y / 8) < 0.3


def test_locate_reports_a_missing_agent():
    blank = np.full((64, 64, 3), 255, np.uint8)
    assert locate(blank).agent is None and locate(blank).block is None


def test_dataset_is_reproducible_and_episodes_regenerate_alone(tmp_path):
    spec = DatasetSpec(episodes=3, steps=12, size=64, seed=5)
    generate_dataset(spec, tmp_path / "d", workers=1, progress=False)
    data = Dataset.load(tmp_path / "d")
    assert data.frames.shape == (3, 13, 64, 64, 3) and data.actions.shape == (3, 12, 2)
    frames, actions, states = record_episode(spec.episode_seed(2), spec.policy(2), 12, 64)
    assert np.array_equal(data.frames[2], frames) and np.array_equal(data.actions[2], actions)
    assert np.array_equal(data.states[2], states)
    assert np.all((data.actions >= 0) & (data.actions <= 512))
    # The actions move the agent: frames change over an episode.
    assert np.abs(data.frames[0, -1].astype(int) - data.frames[0, 0]).sum() > 0


def test_push_share_is_recorded_and_drives_the_controller(tmp_path):
    spec = DatasetSpec(episodes=2, steps=30, size=64, seed=2, push_share=1.0)
    generate_dataset(spec, tmp_path / "d", workers=1, progress=False)
    assert Dataset.load(tmp_path / "d").spec == spec
    # The share changes what the controller does: same seed, different moves.
    _, actions_all, _ = record_episode(7, ScriptedPolicy(7, push_share=1.0), 30, 64)
    _, actions_none, _ = record_episode(7, ScriptedPolicy(7, push_share=0.0), 30, 64)
    assert not np.allclose(actions_all, actions_none)
    with pytest.raises(ValueError, match="push_share"):
        DatasetSpec(episodes=1, steps=1, push_share=1.5)


def test_jump_share_holds_targets_that_jump_as_the_planner_does(tmp_path):
    """With every move jumping, the target moves at most 160 units (+ jitter) at a time and is
    held for the next 3 steps; the walking controller never moves it more than 35 + jitter.
    The share is recorded with the data set."""
    spec = DatasetSpec(episodes=1, steps=24, size=64, seed=3, jump_share=1.0)
    generate_dataset(spec, tmp_path / "d", workers=1, progress=False)
    assert Dataset.load(tmp_path / "d").spec == spec
    _, jumping, _ = record_episode(7, ScriptedPolicy(7, jump_share=1.0), 120, 64)
    _, walking, _ = record_episode(7, ScriptedPolicy(7), 120, 64)
    steps = np.linalg.norm(np.diff(jumping, axis=0), axis=1)
    assert steps.max() <= 160.0 + 10.0 and steps.max() > 60.0
    moved = np.flatnonzero(steps > 10.0)
    assert len(moved) >= 10 and np.all(np.diff(moved) >= 4)  # each jump held 4 steps at least
    assert np.linalg.norm(np.diff(walking, axis=0), axis=1).max() <= 35.0 + 10.0
    with pytest.raises(ValueError, match="jump_share"):
        DatasetSpec(episodes=1, steps=1, jump_share=-0.1)


def test_candidate_share_drives_a_share_of_episodes_as_the_planner_draws_candidates(tmp_path):
    """A `candidate_share` of the episodes, drawn by seed, records `CandidatePolicy`'s
    actions and the rest the scripted policy's, as without the share; the data set records
    the share and its episodes still regenerate alone."""
    spec = DatasetSpec(40, 24, 64, seed=1, push_share=0.85, jump_share=0.3, candidate_share=0.5)
    scripted = dataclasses.replace(spec, candidate_share=0.0)
    kinds = []
    for index in range(40):
        _, actions, _ = record_episode(spec.episode_seed(index), spec.policy(index), 24, 64)
        seed = spec.episode_seed(index)
        _, planned, _ = record_episode(seed, CandidatePolicy(seed), 24, 64)
        kinds.append(np.array_equal(actions, planned))
        if not kinds[-1]:  # the scripted policy's episode, as before
            _, before, _ = record_episode(seed, scripted.policy(index), 24, 64)
            np.testing.assert_array_equal(before, actions)
    assert 10 <= sum(kinds) <= 30
    everyone = dataclasses.replace(spec, candidate_share=1.0)
    assert all(isinstance(everyone.policy(i), CandidatePolicy) for i in range(5))
    assert not any(isinstance(scripted.policy(i), CandidatePolicy) for i in range(40))
    small = dataclasses.replace(spec, episodes=3)
    generate_dataset(small, tmp_path / "d", workers=1, progress=False)
    data = Dataset.load(tmp_path / "d")
    assert data.spec == small
    for index in range(3):
        _, actions, _ = record_episode(small.episode_seed(index), small.policy(index), 24, 64)
        np.testing.assert_array_equal(data.actions[index], actions)
    with pytest.raises(ValueError, match="candidate_share"):
        DatasetSpec(episodes=1, steps=1, candidate_share=1.5)


def test_block_mask_finds_the_block_the_locator_finds():
    world = PushTWorld(64)
    frame = world.reset(3)
    for _ in range(6):
        frame = world.step(np.array([200.0, 200.0]))
    world.close()
    expected = palette_weights(frame)[..., 2] > 0.5  # walls are zero there, and hold no block
    frames = torch.from_numpy(frame).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0  # [1, 3, 1, S, S]
    mask = block_mask(frames)
    assert mask.shape == (1, 1, 1, 64, 64) and mask.dtype == torch.bool
    assert expected.sum() > 50 and np.array_equal(mask[0, 0, 0].numpy(), expected)


@pytest.mark.slow
def test_train_cli_stops_on_sigterm_with_a_checkpoint_and_the_weights(tmp_path, capsys, monkeypatch):
    """SIGTERM (as `timeout` sends it) ends the run after the current step like --minutes
    does: exit 0, a checkpoint to resume from, the exported weights and a summary naming it;
    the process's own handlers are back afterwards."""
    import os
    import signal

    from streamworld.pusht.train import Trainer

    step = Trainer.train_step

    def train_step(self):
        out = step(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "train_step", train_step)
    before, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    work = tmp_path / "w"
    assert cli_main(["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "4"]) == 0
    summary = json.loads((work / "train_summary.json").read_text())
    assert summary["step"] == 2 and summary["stopped_by"] == "SIGTERM"
    assert (work / "pusht.safetensors").is_file() and (work / "checkpoint.pt").is_file()
    assert "stopped at step 2 of 4 (SIGTERM)" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before_int
    monkeypatch.setattr(Trainer, "train_step", step)
    assert cli_main(["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "4"]) == 0
    resumed = json.loads((work / "train_summary.json").read_text())
    assert resumed["step"] == 4 and resumed["steps_this_run"] == 2 and resumed["stopped_by"] == "total_steps"
    settings = resumed["settings"]  # what was trained, beside how far
    assert settings["train"]["total_steps"] == 4 and settings["train"]["unroll_loss"] == "l2"
    assert settings["prediction"] == "x0" and settings["init"] is None and settings["data"]["episodes"] == 4


@pytest.mark.slow
def test_train_cli_smoke_run_resumes_and_exports_loadable_weights(tmp_path, capsys):
    work = tmp_path / "w"
    assert cli_main(["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "2"]) == 0
    first = json.loads((work / "train_summary.json").read_text())
    assert first["step"] == 2
    assert cli_main(["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "4"]) == 0
    second = json.loads((work / "train_summary.json").read_text())
    assert second["step"] == 4 and second["steps_this_run"] == 2  # resumed, not restarted
    from streamworld.models.world_model import WeightPaths
    from streamworld.pusht.train import smoke_config

    weights = WeightPaths(dit=str(work / "pusht.safetensors"))
    model = WorldModel.load(smoke_config(get_preset("pusht")), weights)
    exported = model.dit.transformer.proj_out.weight
    random = WorldModel.load(smoke_config(get_preset("pusht")), random_weights=True)
    assert not torch.equal(exported, random.dit.transformer.proj_out.weight)
    # Weights trained for the other parameterisation are refused, not served wrongly.
    flow = tmp_path / "flow"
    args = ["train", "pusht", "--smoke", "--workdir", str(flow), "--total-steps", "1", "--prediction", "flow"]
    assert cli_main(args) == 0
    with pytest.raises(ValueError, match="flow"):
        WorldModel.load(smoke_config(get_preset("pusht")), WeightPaths(dit=str(flow / "pusht.safetensors")))
    # So are weights trained on other latents (here: plain pixels, as before anchoring).
    plain = dataclasses.replace(smoke_config(get_preset("pusht")), vae={"kind": "pixels"})
    with pytest.raises(ValueError, match="pixels-anchored"):
        WorldModel.load(plain, weights)


class _Ran:
    """Unpickling this runs code; a checkpoint must never be read that way."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled code ran')",))


def test_train_cli_refuses_a_checkpoint_that_holds_more_than_tensors(tmp_path, capsys):
    work = tmp_path / "w"
    work.mkdir()
    torch.save({"step": 1, "payload": _Ran()}, work / "checkpoint.pt")
    args = ["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "2"]
    assert cli_main(args) == 2
    assert "holds objects other than tensors" in capsys.readouterr().err


@pytest.mark.slow
def test_train_cli_refuses_to_resume_with_other_settings(tmp_path, capsys, monkeypatch):
    """A checkpoint resumes only under the settings it was trained with (the schedule's
    length aside), checked before any data is recorded; the message names what differs."""
    from streamworld.pusht import train as train_module

    work = tmp_path / "w"
    base = ["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "2"]
    assert cli_main(base) == 0
    capsys.readouterr()
    checkpoint = (work / "checkpoint.pt").read_bytes()

    def no_data(*args, **kwargs):
        raise AssertionError("data recorded before the resume was checked")

    monkeypatch.setattr(train_module, "prepare_data", no_data)
    refusals = [
        (["--block-weight", "1"], "block_weight: 0.0 in the checkpoint, 1.0 now"),
        (["--data-seed", "9"], "data.seed: 0 in the checkpoint, 9 now"),
        (["--prediction", "delta"], "different model configuration"),
    ]
    for flags, message in refusals:
        assert cli_main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "another --workdir" in err, err
    assert (work / "checkpoint.pt").read_bytes() == checkpoint  # refused runs left it alone
    monkeypatch.undo()
    assert cli_main([*base[:-1], "3"]) == 0  # a longer schedule resumes
    assert json.loads((work / "train_summary.json").read_text())["step"] == 3
    # In Python: the Trainer checks too, and one given no run settings keeps the recorded ones.
    from streamworld.pusht.data import DatasetSpec
    from streamworld.pusht.train import TrainConfig, Trainer, prepare_data, smoke_config

    state = torch.load(work / "checkpoint.pt", weights_only=False)
    recorded, config = state["run_settings"], TrainConfig(**state["train_config"])
    data = prepare_data(work / "data", DatasetSpec(**recorded["data"]))
    model = smoke_config(get_preset("pusht"))
    with pytest.raises(ValueError, match=r"lr: 0\.0003 in the checkpoint, 0\.001 now"):
        Trainer(model, dataclasses.replace(config, lr=1e-3), data, work, "cpu")
    trainer = Trainer(model, config, data, work, "cpu")
    assert trainer.step == 3 and trainer.run_settings == recorded
    trainer.save_checkpoint()
    assert torch.load(work / "checkpoint.pt", weights_only=False)["run_settings"] == recorded


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--minutes", "0"),
        ("--block-weight", "-1"),
        ("--block-weight", "nan"),
        ("--state-weight", "-1"),
        ("--state-weight", "nan"),
        ("--state-warmup", "-1"),
        ("--push-share", "1.5"),
        ("--jump-share", "2"),
        ("--candidate-share", "-0.5"),
        ("--rollout-share", "1.5"),
        ("--rollout-every", "0"),
        ("--rollout-max-mismatch", "-0.1"),
        ("--layers", "0"),
        ("--warmup-steps", "-1"),
        ("--log-every", "0"),
    ],
)
def test_train_cli_rejects_bad_arguments(tmp_path, capsys, flag, value):
    assert cli_main(["train", "pusht", "--smoke", "--workdir", str(tmp_path), flag, value]) == 2
    assert flag in capsys.readouterr().err


def _train_configs(*argv: str):
    """`train pusht`'s (model config, data spec, training config, device) for `argv`."""
    import argparse

    from streamworld.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    return train_cli._configs(parser.parse_args(["train", "pusht", *argv]))


@pytest.mark.parametrize("smoke", [[], ["--smoke"]])
def test_train_cli_passes_compile_to_the_trainer(smoke):
    for flags, compiled in (([], False), (["--compile"], True)):
        assert _train_configs(*smoke, *flags)[2].compile is compiled


@pytest.mark.parametrize("smoke", [[], ["--smoke"]])
def test_train_cli_passes_the_candidate_share_to_the_data_set(smoke):
    for flags, share in (([], 0.0), (["--candidate-share", "0.7"], 0.7)):
        assert _train_configs(*smoke, *flags)[1].candidate_share == share


@pytest.mark.parametrize("smoke", [[], ["--smoke"]])
def test_train_cli_passes_the_state_weight_to_the_trainer(smoke):
    for flags, weight in (([], 0.0), (["--state-weight", "0.3"], 0.3)):
        assert _train_configs(*smoke, *flags)[2].state_weight == weight
    flags = ["--state-weight", "0.1", "--state-target", "change", "--state-warmup", "40"]
    flags += ["--state-turn-weight", "8", "--state-layer", "2"]
    config = _train_configs(*smoke, *flags)[2]
    assert (config.state_target, config.state_warmup, config.state_turn_weight) == ("change", 40, 8.0)
    assert config.state_layer == 2
    assert _train_configs(*smoke)[2].state_target == "scene"


@pytest.mark.parametrize(
    "flags", [["--state-target", "change"], ["--state-warmup", "10"], ["--state-turn-weight", "8"]]
)
def test_train_cli_refuses_the_probes_settings_without_the_probe(tmp_path, capsys, flags):
    assert cli_main(["train", "pusht", "--smoke", "--workdir", str(tmp_path), *flags]) == 2
    assert "give --state-weight" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # refused before any data is recorded


def test_train_cli_sets_the_warm_up_and_the_logging_interval():
    from streamworld.pusht.train import _lr_at

    default = _train_configs()[2]
    assert (default.warmup_steps, default.log_every) == (300, 100)
    config = _train_configs("--warmup-steps", "20", "--log-every", "5", "--total-steps", "100")[2]
    assert (config.warmup_steps, config.log_every) == (20, 5)
    assert _lr_at(19, config) == pytest.approx(config.lr)  # warmed up, then half-way down the decay:
    assert _lr_at(60, config) == pytest.approx(config.lr * (1 + config.min_lr_ratio) / 2)


@pytest.mark.slow
def test_train_cli_trains_on_its_own_rollouts(tmp_path):
    work = tmp_path / "w"
    argv = [
        "train",
        "pusht",
        "--smoke",
        "--workdir",
        str(work),
        "--total-steps",
        "3",
        "--rollout-share",
        "0.5",
    ]
    assert cli_main(argv) == 0
    summary = json.loads((work / "train_summary.json").read_text())
    assert summary["step"] == 3 and summary["rollout_refreshes"] == 2  # steps 0 and 2 (every 2 in --smoke)
    assert all("loss_rollout" in entry for entry in summary["history"])


@pytest.mark.slow
def test_train_cli_trains_stream_clips_on_its_own_rollouts(tmp_path, capsys):
    """`--clip-chunks` with `--rollout-share`: rollouts are stream clips, every batch has
    rollout samples; one-chunk clips, which leave no chunk with the model's own context, are
    refused."""
    work = tmp_path / "w"
    argv = ["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "3", "--clip-chunks", "3"]
    assert cli_main([*argv, "--rollout-share", "0.5"]) == 0
    summary = json.loads((work / "train_summary.json").read_text())
    assert summary["step"] == 3 and summary["rollout_refreshes"] == 2
    assert all("loss_rollout" in entry for entry in summary["history"])
    argv[-1] = "1"
    assert cli_main([*argv, "--rollout-share", "0.5"]) == 2
    assert "needs 2 chunks or more" in capsys.readouterr().err


@pytest.mark.slow
def test_train_cli_with_simulated_targets_trains_on_when_no_frame_shows_a_t(tmp_path):
    """The smoke model's random weights draw no T, so no rollout chunk gets a simulated
    target: every batch is made of true-context clips, and the summary says so."""
    work = tmp_path / "w"
    argv = ["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "3", "--workers", "1"]
    argv += ["--rollout-share", "0.5", "--rollout-targets", "simulated"]
    assert cli_main(argv) == 0
    summary = json.loads((work / "train_summary.json").read_text())
    assert summary["step"] == 3 and summary["rollout_refreshes"] == 2
    assert summary["rollout_chunks_with_target"] == 0.0 and summary["rollout_batches_without"] == 3
    assert not any("loss_rollout" in entry for entry in summary["history"])


# --- anchored pixel latents --------------------------------------------------------------
def test_anchored_pixels_decode_chunk_by_chunk_to_the_frames():
    rng = torch.Generator().manual_seed(0)
    frames = torch.rand(2, 3, 9, 8, 8, generator=rng) * 2 - 1  # two streams, 9 frames each
    latents = frames_to_latents(frames, anchored=True)
    assert torch.equal(latents[:, :, 0], frames[:, :, 0])
    assert torch.allclose(latents[:, :, 1:], frames[:, :, 1:] - frames[:, :, :1])
    codec = PixelCodec(anchored=True)
    states = [codec.new_decoder_state() for _ in range(2)]
    decoded, sizes = [], []
    for a, b in ((0, 1), (1, 5), (5, 9)):  # the first image, then chunks of 4
        out = codec.decode_chunks([latents[i : i + 1, :, a:b] for i in range(2)], states)
        decoded.append(torch.cat(out))
        sizes.append([s.nbytes() for s in states])
    assert torch.allclose(torch.cat(decoded, 2), frames, atol=1e-6)
    assert sizes[0] == sizes[1] == sizes[2] and sizes[0][0] == 3 * 8 * 8 * 4  # the anchor alone
    # Plain pixels are the identity, and a stream's still frames are all-zero anchored latents.
    assert torch.equal(frames_to_latents(frames, anchored=False), frames)
    still = frames[:, :, :1].expand(-1, -1, 4, -1, -1)
    assert frames_to_latents(still, anchored=True)[:, :, 1:].abs().max() == 0


# --- the shipped model -------------------------------------------------------------------
def test_shipped_weights_are_small_and_load_exactly(pusht):
    path = builtin_weights_path(pusht.config)
    assert path.stat().st_size <= 16 * 1024 * 1024
    # Loading is strict (every key, every shape), and the weights are not the seeded init.
    random = WorldModel.load(get_preset("pusht"), random_weights=True)
    w, r = pusht.dit.transformer.proj_out.weight, random.dit.transformer.proj_out.weight
    assert not torch.equal(w, r)


@pytest.mark.parametrize("kv_mode", ["clean", "final", "noisy"])
async def test_engine_serves_pusht_exactly_in_every_kv_mode(pusht, kv_mode):
    image, _ = initial_frame(1)
    actions = np.random.default_rng(0).uniform(100, 400, (8, 2)).astype(np.float32)
    async with AsyncEngine(pusht, engine_config()) as engine:
        handles = [
            engine.open_stream(
                StreamRequest(seed=s, num_chunks=2, image=image, actions=actions, kv_mode=kv_mode)
            )
            for s in (0, 1)
        ]
        results = await asyncio.gather(*(collect(h) for h in handles))
    gen = ReferenceGenerator(pusht)
    for seed, outputs in zip((0, 1), results, strict=True):
        expected = gen.generate(
            GenerationRequest(seed=seed, num_chunks=2, image=image, actions=actions, kv_mode=kv_mode)
        )
        assert_matches(outputs, expected)


def test_metrics_and_seed_ranges():
    a, _ = initial_frame(0)
    b, _ = initial_frame(1)
    assert psnr(a, a) == 99.0 and ssim(a, a) == pytest.approx(1.0)
    assert psnr(a, b) < 40 and ssim(a, b) < 1.0
    assert parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    for bad in ("", "5-2", "x", "499999-500000"):  # the last overlaps the training data's seeds
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_evaluate_reports_every_horizon_for_model_and_baseline(pusht):
    report = evaluate(pusht, [0, 1], ["clean", "noisy"], horizon=8, progress=False)
    assert set(report["modes"]) == {"clean", "noisy"}
    for values in [report["baseline"], *report["modes"].values()]:
        assert len(values["psnr"]) == 8 and all(np.isfinite(values["psnr"]))
    # The baseline at horizon 1 is the true frame 0 against frame 1: nearly identical.
    assert report["baseline"]["psnr"][0] > 30
    table = markdown_table(report)
    assert "copy first frame" in table and "model, noisy" in table and "h=8" in table
    assert "| model, clean | block lost (share) | 0.00 |" in table  # beside the error it leaves out
    # A chunk ahead of the true first frame the shipped model draws the block as a T.
    assert set(report["block_t_shape"]) == {"clean", "noisy"}
    for shares in report["block_t_shape"].values():
        assert list(shares) == ["1", "2", "4", "8"] and shares["1"] == 1.0
        assert all(0 <= v <= 1 for v in shares.values())
    assert "| model, noisy | block is a T (share) | 1.00 |" in table
    # Each seed's own results, at the report horizons: their means are the report's means.
    per_seed = report["per_seed"]
    assert per_seed["seeds"] == [0, 1] and per_seed["horizons"] == [1, 2, 4, 8]
    for mode in ("clean", "noisy"):
        for metric in ("block_px", "agent_px", "psnr"):
            rows = per_seed[mode][metric]
            assert len(rows) == 2 and all(len(r) == 4 for r in rows)
            for i, h in enumerate(per_seed["horizons"]):
                found = [r[i] for r in rows if r[i] is not None]
                assert np.mean(found) == pytest.approx(report["modes"][mode][metric][h - 1], abs=1e-3)
        shapes, angles = per_seed[mode]["block_t_shape"], per_seed[mode]["block_deg"]
        for i, h in enumerate(per_seed["horizons"]):
            assert np.mean([r[i] for r in shapes]) == report["block_t_shape"][mode][str(h)]
            # Angles in [0, 180] where the block is a T; their mean is the report's.
            found = [r[i] for r in angles if r[i] is not None]
            assert all(0 <= a <= 180 for a in found)
            assert np.mean(found) == pytest.approx(report["block_angle_deg"][mode][str(h)], abs=1e-3)
        # One chunk ahead of the true first frame the block is a T, its angle right within a few degrees.
        assert all(r[0] is not None and r[0] < 5 for r in angles)
    assert "| model, clean | block angle error, T only (deg) |" in table
    json.dumps(per_seed, allow_nan=False)  # strict JSON: a lost object is null, not NaN
    json.dumps(report["block_angle_deg"], allow_nan=False)  # no T at a horizon: null


def test_the_angle_mean_is_null_where_no_block_is_a_t():
    """A horizon where no predicted block is a T has no mean angle: null in the JSON, "n/a"
    in the table, where a NaN would make the report invalid JSON."""
    from streamworld.pusht.evaluate import _Predictor, _report

    cfg = get_preset("pusht")
    metrics = {
        "psnr": 30.0,
        "ssim": 0.9,
        "agent_px": 0.5,
        "block_px": 1.0,
        "agent_lost": 0.0,
        "block_lost": 0.0,
    }
    rows = [[metrics] * 2]
    blob = _Predictor(rows=rows, seconds=1.0, angles={1: [math.nan], 2: [3.0]})
    report = _report(cfg, [0], 2, rows, {"clean": blob}, {1: [0.5], 2: [1.0]}, frames_made=2)
    assert report["block_angle_deg"]["clean"] == {"1": None, "2": 3.0}
    json.dumps(report["block_angle_deg"], allow_nan=False)
    assert "| model, clean | block angle error, T only (deg) | n/a | 3.0 |" in markdown_table(report, (1, 2))


def test_block_angles_of_true_frames_match_the_recorded_ones():
    """The fitted angle of the true frames is the environment's own (the fit's error aside),
    and the copy baseline's angle error is how far the block has turned."""
    from streamworld.pusht.evaluate import block_angle, record_eval_episode
    from streamworld.pusht.world import angle_error

    assert angle_error(math.radians(359), math.radians(1)) == pytest.approx(2.0)
    assert angle_error(0.5, 0.5) == 0 and math.isnan(angle_error(math.nan, 0.5))
    turned = []
    for seed in range(4):
        ep = record_eval_episode(seed, 24, 64)
        assert ep.angles.shape == (25,)
        errors = [angle_error(block_angle(ep.frames[h]), ep.angles[h]) for h in (0, 8, 16, 24)]
        assert np.nanmax(errors) < 2.5 and sum(math.isnan(e) for e in errors) <= 1
        turned.append(angle_error(ep.angles[0], ep.angles[24]))
    assert max(turned) > 5  # some block turns, so the test above could fail


def test_teacher_forced_evaluation_predicts_from_the_true_past(pusht):
    """Teacher-forced, the first chunk is the free-running clean prediction (nothing before it
    differs); the later chunks see the true frames instead of the predicted ones, and change."""
    report = evaluate(pusht, [0, 1], ["clean"], horizon=8, progress=False, teacher_forced=True)
    assert list(report["modes"]) == ["clean", "teacher-forced"]
    free, forced = report["modes"]["clean"], report["modes"]["teacher-forced"]
    fpc = pusht.config.frames_per_chunk
    assert forced["psnr"][:fpc] == free["psnr"][:fpc]
    assert forced["psnr"][fpc:] != free["psnr"][fpc:]
    assert "| model, teacher-forced |" in markdown_table(report)
    by_motion = report["teacher_forced_by_motion"]
    assert by_motion["all"]["chunks"] == sum(v["chunks"] for k, v in by_motion.items() if k != "all") > 0


def test_teacher_forced_error_is_split_by_what_the_block_does():
    """`chunk_motion` classes each chunk by the block's true motion, and scores a prediction
    beside copying the last true frame before the chunk: a perfect prediction errs 0, and
    that copy, given as the prediction, errs exactly as much as the copy column says."""
    from streamworld.pusht.evaluate import (
        MOVE_CLASSES,
        chunk_motion,
        frame_metrics,
        motion_breakdown,
        motion_table,
    )

    def motion(pred):  # pred[h - 1] predicts frame h
        return chunk_motion(ep, [frame_metrics(pred[h - 1], ep.frames[h]) for h in range(1, 33)], 4, 32)

    ep = record_eval_episode(1, 32, 64)  # seed 1's block starts still, is pushed, then stops
    exact = motion(ep.frames[1:])
    assert {kind for kind, _, _ in exact} == set(MOVE_CLASSES)
    assert all(err == 0 for _, err, _ in exact)
    for kind, _, moved in exact:
        assert (moved >= 0.5) == kind.startswith("moving")
        assert moved < 4 if kind == "moving < 4 px" else True
    copy_last = np.stack([ep.frames[4 * ((i + 3) // 4) - 4] for i in range(1, 33)])  # frame i predicted
    for (kind, err, moved), (kind_exact, _, _) in zip(motion(copy_last), exact, strict=True):
        assert kind == kind_exact and err == pytest.approx(moved)
    summary = motion_breakdown(exact)
    assert summary["all"]["chunks"] == len(exact) == 8 and summary["all"]["model_px"] == 0
    assert summary["moving >= 4 px"]["copy_last_px"] >= 4
    assert "| still, pushed earlier |" in motion_table({"teacher_forced_by_motion": summary})


def test_eval_cli_refuses_prediction_options_with_plan(capsys):
    assert cli_main(["eval", "pusht", "--plan", "--teacher-forced"]) == 2
    assert "evaluates prediction" in capsys.readouterr().err
    assert cli_main(["eval", "pusht", "--plan", "--kv-mode", "final", "--kv-mode", "clean"]) == 2
    assert "one --kv-mode" in capsys.readouterr().err
    for option in (["--kv-mode", "clean"], ["--steps", "1000"]):
        assert cli_main(["eval", "pusht", "--plan", "--simulator", *option]) == 2
        assert "plans without the world model" in capsys.readouterr().err


def test_eval_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = cli_main(
        ["eval", "pusht", "--seeds", "0-1", "--horizon", "4", "--kv-mode", "final", "--json", str(out)]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["num_seeds"] == 2 and list(report["modes"]) == ["final"]
    assert report["weights"] == "shipped" and report["prediction"] == "x0"
    assert "| model, final |" in capsys.readouterr().out


def test_eval_cli_records_the_weights_and_evaluates_the_modes_they_serve(tmp_path):
    """Weights that record "delta" (here the shipped tensors relabelled) are evaluated as a
    delta model, by default in the two KV modes it serves; the report names them."""
    import safetensors.torch

    shipped = builtin_weights_path(get_preset("pusht"))
    with safetensors.safe_open(str(shipped), "pt") as f:
        meta = {**(f.metadata() or {}), "prediction": "delta"}
    tensors = safetensors.torch.load_file(str(shipped))
    delta = tmp_path / "delta.safetensors"
    safetensors.torch.save_file(tensors, str(delta), metadata=meta)
    out = tmp_path / "eval.json"
    argv = ["eval", "pusht", "--seeds", "0", "--horizon", "4", "--dit", str(delta), "--json", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["weights"] == "delta.safetensors" and report["prediction"] == "delta"
    assert list(report["modes"]) == ["clean", "final"]


def test_eval_cli_takes_other_denoising_steps(tmp_path, capsys):
    out = tmp_path / "eval.json"
    argv = ["eval", "pusht", "--seeds", "0", "--horizon", "4", "--kv-mode", "clean", "--steps", "1000"]
    assert cli_main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["denoising_steps"] == 1 and report["timesteps"] == [1000.0]
    assert cli_main([*argv[:-1], "750,900"]) == 2  # must decrease
    assert "--steps must decrease" in capsys.readouterr().err


def test_generate_cli_starts_pusht_from_the_environment(tmp_path):
    out = tmp_path / "clip.npy"
    assert cli_main(["generate", "--model", "pusht", "--chunks", "1", "--seed", "4", "--out", str(out)]) == 0
    assert np.load(out).shape == (4, 64, 64, 3)


# --- serving and the robot loop ------------------------------------------------------------
@pytest.fixture
async def pusht_server(pusht, pusht_delta):
    # Real-time pacing (the default scheduler): the robot loop's stream is interactive, and
    # interactive streams start just in time for their playback deadlines.
    config = EngineConfig(max_streams=4)
    models = {"pusht": pusht, "pusht-delta": pusht_delta}
    server = StreamWorldServer(models, config, ServerConfig(), default_model="pusht")
    running = await RunningServer(server.build_app()).start()
    yield f"ws://127.0.0.1:{running.port}/v1/stream"
    await running.close()


async def test_session_without_image_starts_from_the_environment_of_its_seed(pusht, pusht_server):
    actions = np.tile([[300.0, 200.0]], (8, 1))
    async with StreamWorldClient(
        pusht_server, seed=6, num_chunks=2, format="rgb", action_policy="wait"
    ) as client:
        assert client.info.model == "pusht"
        image, scene = initial_frame(6)
        assert client.info.raw["scene"] == scene.to_json()
        await client.send_actions(actions, frame=0)
        frames = np.concatenate([c.frames async for c in client.chunks()])
    expected = ReferenceGenerator(pusht).generate(
        GenerationRequest(seed=6, num_chunks=2, image=image, actions=actions.astype(np.float32))
    )
    assert np.abs(frames.astype(int) - expected.frames.astype(int)).max() <= 2


def _example(name: str):
    """An example script of examples/, imported as a module."""
    return load_script(f"examples/{name}.py")


async def test_robot_loop_example_runs_against_a_server(pusht_server, tmp_path, capsys):
    robot_loop = _example("robot_loop")
    video = tmp_path / "loop.mp4"
    args = robot_loop.build_parser().parse_args(
        ["--url", pusht_server, "--chunks", "2", "--video", str(video)]
    )
    assert await robot_loop.run(args) == 0
    out = capsys.readouterr().out
    assert "loop latency" in out and video.stat().st_size > 0
    import av

    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 8 and frames[0].shape == (256, 512, 3)
    # The same loop with the delta-trained sibling, in its default (final) mode.
    args = robot_loop.build_parser().parse_args(
        ["--url", pusht_server, "--chunks", "2", "--model", "pusht-delta"]
    )
    assert await robot_loop.run(args) == 0
    out = capsys.readouterr().out
    assert ": pusht-delta, kv_mode final" in out and "loop latency" in out


async def _run_example(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def test_interactive_client_streams_actions_from_a_file_into_an_mp4(pusht_server, tmp_path):
    actions = tmp_path / "actions.json"
    actions.write_text(json.dumps({"actions": [[300.0, 200.0]] * 8}))
    out = tmp_path / "clip.mp4"
    client = str(ROOT / "examples" / "interactive_client.py")
    code, stdout, stderr = await _run_example(
        client, "--url", pusht_server, "--actions", str(actions), "--chunks", "2", "--out", str(out)
    )
    assert code == 0, stderr
    assert str(out) in stdout
    import av

    with av.open(str(out)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 8 and frames[0].shape == (256, 256, 3)  # enlarged 4 times by default
    # Keyboard mode needs a terminal: a clear error and exit code 2, no session.
    code, _, stderr = await _run_example(client, "--url", pusht_server, "--keyboard")
    assert code == 2 and "terminal" in stderr.lower()
    # An actions file that is not UTF-8: a clear error, no traceback.
    actions.write_bytes(b"\xff\xfe[[1, 2]]")
    code, _, stderr = await _run_example(client, "--url", pusht_server, "--actions", str(actions))
    assert code == 2 and "not valid JSON" in stderr and "Traceback" not in stderr


def test_init_without_spatial_actions_starts_from_exactly_the_old_model(tmp_path):
    """Fine-tuning weights trained before the spatial action embedding: the new path starts
    at zero, so the first model equals the old one."""
    from streamworld.models.world_model import WeightPaths
    from streamworld.pusht.train import TrainConfig, Trainer, smoke_config

    new_cfg = smoke_config(get_preset("pusht"))
    assert new_cfg.spatial_actions
    old_cfg = dataclasses.replace(new_cfg, spatial_actions=False)
    spec = DatasetSpec(episodes=2, steps=20, size=64, seed=1)
    generate_dataset(spec, tmp_path / "d", workers=1, progress=False)
    data = Dataset.load(tmp_path / "d")
    weights = Trainer(old_cfg, TrainConfig(total_steps=1), data, tmp_path / "old", "cpu").export(
        tmp_path / "old.safetensors"
    )
    trainer = Trainer(new_cfg, TrainConfig(total_steps=1), data, tmp_path / "t", "cpu", weights)
    old_model = WorldModel.load(old_cfg, WeightPaths(dit=str(weights)))
    old = old_model.dit
    new = trainer.dit.eval()
    assert new.action_adapter.spatial is not None and old.action_adapter.spatial is None
    cfg = old_cfg
    f = cfg.latent_frames_per_chunk
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 3, 2 * f, cfg.height, cfg.width, generator=g)
    t = torch.full((1, 2 * f), 500.0)
    acts = torch.rand(1, 2 * f, 2, generator=g) * 512
    chunk_ids = torch.arange(2).repeat_interleave(f)
    text = old_model.text_context("")
    with torch.no_grad():
        a = old.forward_sequence(latents, t, text, chunk_ids, acts)
        b = new.forward_sequence(latents, t, text, chunk_ids, acts)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Without the zero start the new path would change the output.
    torch.nn.init.normal_(new.action_adapter.spatial.net[2].weight)
    with torch.no_grad():
        c = new.forward_sequence(latents, t, text, chunk_ids, acts)
    assert (c - a).abs().max() > 1e-3


async def test_plan_pusht_example_plans_through_a_server(pusht_server, tmp_path, capsys):
    plan_pusht = _example("plan_pusht")
    video = tmp_path / "plan.mp4"
    args = plan_pusht.build_parser().parse_args(
        ["--url", pusht_server, "--samples", "3", "--iterations", "2", "--horizon", "4", "--budget", "4",
         "--noise-beta", "2", "--keep-elites", "1", "--cost-frames", "best", "--proposals", "2",
         "--video", str(video)]
    )  # fmt: skip
    assert await plan_pusht.run(args) == 0
    out = capsys.readouterr().out
    assert "after 4 steps and 1 plans" in out or "goal reached" in out
    import av

    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) >= 1 and frames[0].shape == (256, 1024, 3)
    assert plan_pusht.main(["--samples", "1"]) == 2
    assert plan_pusht.main(["--keep-elites", "5"]) == 2  # more than the 4 elites
    assert "keep_elites <= elites" in capsys.readouterr().err
    assert plan_pusht.main(["--samples", "4", "--proposals", "4"]) == 2
    assert "--proposals must be 0 to 3" in capsys.readouterr().err


def test_plan_video_shows_the_candidates_with_the_chosen_one_framed():
    from streamworld.planning import Plan

    plan_pusht = _example("plan_pusht")
    rng = np.random.default_rng(0)
    candidates = rng.integers(0, 200, (20, 3, 64, 64, 3), dtype=np.uint8)  # no pure red in them
    plan = Plan(candidates[18, :, :1, :1, :2], 0.0, candidates[18], candidates=candidates, chosen=18)
    grid = plan_pusht.candidate_grid(plan, 2, 256)
    assert grid.shape == (256, 256, 3)
    # 16 of the 20 in a 4 x 4 grid of 64-pixel cells: the first 15 others, then the chosen one.
    shown = [*range(15), 18]
    for slot, i in enumerate(shown):
        y, x = divmod(slot, 4)
        cell = grid[y * 64 : (y + 1) * 64, x * 64 : (x + 1) * 64]
        framed = (cell[:2] == (255, 0, 0)).all()
        assert framed == (i == 18)
        assert np.array_equal(cell[2:-2, 2:-2], candidates[i, 2][2:-2, 2:-2])
    assert plan_pusht.candidate_grid(Plan(plan.actions, 0.0, plan.frames), 0, 256) is None
