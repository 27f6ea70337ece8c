"""The recorded scenes and the state probe of `train pusht --state-weight`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from streamworld.models.presets import PUSHT
from streamworld.pusht.train import smoke_config


@pytest.fixture(scope="module")
def data_12(tmp_path_factory):
    from streamworld.pusht.data import Dataset, DatasetSpec, generate_dataset

    folder = tmp_path_factory.mktemp("pusht-data-states")
    generate_dataset(DatasetSpec(episodes=2, steps=12, size=64, seed=7), folder, workers=1, progress=False)
    return Dataset.load(folder)


def test_the_recorded_scenes_are_the_worlds_scenes_frame_by_frame(data_12):
    """Each row of states.npy is the scene of the frame beside it: replaying the episode's
    actions in the environment gives the same scenes, and the same frames."""
    from streamworld.pusht.data import scene_row
    from streamworld.pusht.world import PushTWorld

    assert data_12.states.shape == (2, 13, 5) and data_12.states.dtype == np.float32
    for episode in range(2):
        world = PushTWorld(64)
        frame = world.reset(data_12.spec.episode_seed(episode))
        rows = [scene_row(world.scene)]
        assert np.array_equal(frame, data_12.frames[episode, 0])
        for action in data_12.actions[episode]:
            world.step(action)
            rows.append(scene_row(world.scene))
        world.close()
        np.testing.assert_allclose(data_12.states[episode], np.array(rows, np.float32), rtol=0, atol=1e-3)
    # the block moves in at least one of the episodes' frames, or the check above says little
    assert np.abs(np.diff(data_12.states[:, :, :2], axis=1)).max() > 1.0


def test_a_data_set_recorded_without_scenes_loads_without_them_and_bad_ones_are_refused(data_12, tmp_path):
    import shutil

    from streamworld.pusht.data import Dataset

    folder = tmp_path / "old"
    shutil.copytree(Path(data_12.frames.filename).parent, folder)
    (folder / "states.npy").unlink()
    assert Dataset.load(folder).states is None
    np.save(folder / "states.npy", np.zeros((2, 12, 5), np.float32))
    with pytest.raises(ValueError, match=r"states\.npy is"):
        Dataset.load(folder)


def test_state_targets_and_errors():
    from streamworld.pusht.state_probe import state_errors, state_targets

    scenes = torch.tensor([[0.0, 512.0, 256.0, 128.0, math.radians(179.0)]])
    target = state_targets(scenes)
    turn = math.radians(179)
    assert torch.allclose(target, torch.tensor([[-1.0, 1.0, 0.0, -0.5, math.cos(turn), math.sin(turn)]]))
    moved = state_targets(torch.tensor([[0.0, 512.0, 259.0, 132.0, math.radians(-179.0)]]))
    position, angle = state_errors(moved, target)
    assert position.item() == pytest.approx(5.0, abs=1e-4)  # world units, across the wrap
    assert angle.item() == pytest.approx(2.0, abs=1e-3)  # degrees, across the wrap


def _trainer(data, tmp_path, name, device="cpu", **overrides):
    from streamworld.pusht.train import TrainConfig, Trainer

    config = TrainConfig(**{"batch_size": 4, "clip_chunks": 2, "seed": 3, **overrides})
    return Trainer(smoke_config(PUSHT).with_prediction("delta"), config, data, tmp_path / name, device)


def test_the_state_term_adds_the_probes_error_on_the_trained_frames_scenes(data_12, tmp_path):
    """Same batch, same draws: the loss with the probe is the pixel loss plus the weight
    times the probe's squared error against the clip frames' recorded scenes, which the
    batch carries; other scenes change that error alone, and its gradient reaches the DiT."""
    plain = _trainer(data_12, tmp_path, "plain")
    probed = _trainer(data_12, tmp_path, "probed", state_weight=0.5)
    probed.dit.load_state_dict(plain.dit.state_dict())
    batch = plain.batcher.sample(4)
    assert batch["states"].shape == (4, plain.batcher.clip, 5)
    seed = plain.gen.get_state()
    pixel, _ = plain.loss(batch)
    probed.gen.set_state(seed)
    total, stats = probed.loss(batch)
    assert stats["loss_state"] > 0.01
    assert total.item() == pytest.approx(pixel.item() + 0.5 * stats["loss_state"], rel=1e-5)
    moved = {**batch, "states": batch["states"] + torch.tensor([0.0, 0.0, 64.0, 0.0, 0.0])}
    probed.gen.set_state(seed)
    other, other_stats = probed.loss(moved)
    assert other_stats["loss_state"] != pytest.approx(stats["loss_state"], rel=1e-3)
    assert other.item() == pytest.approx(pixel.item() + 0.5 * other_stats["loss_state"], rel=1e-5)
    total.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in probed.dit.parameters())
    assert all(p.grad is not None for p in probed.probe.parameters())


def test_the_probe_learns_the_scenes_and_trains_with_the_dit(data_12, tmp_path):
    """A few steps on two episodes: the probe's error falls well below where it starts, and
    the log has its block errors on the frames denoised from pure noise."""
    trainer = _trainer(data_12, tmp_path, "learn", state_weight=1.0, lr=1e-3, warmup_steps=1, total_steps=16)
    rows = [trainer.train_step() for _ in range(16)]
    first = np.mean([r["loss_state"] for r in rows[:3]])
    last = np.mean([r["loss_state"] for r in rows[-3:]])
    assert last < 0.5 * first
    logged = [r for r in rows if "state_block_units" in r]
    assert logged
    assert all(r["state_block_units"] >= 0 and 0 <= r["state_angle_degrees"] <= 180 for r in logged)


def test_a_resumed_run_keeps_its_probe_and_a_checkpoint_without_one_is_refused(data_12, tmp_path):
    trainer = _trainer(data_12, tmp_path, "run", state_weight=0.5)
    trainer.train_step()
    trainer.save_checkpoint()
    resumed = _trainer(data_12, tmp_path, "run", state_weight=0.5)
    assert resumed.step == 1
    for key, value in trainer.probe.state_dict().items():
        assert torch.equal(resumed.probe.state_dict()[key], value), key
    # exported weights hold the DiT alone
    import safetensors.torch

    from streamworld.pusht.train import state_probe_path

    exported = safetensors.torch.load_file(str(trainer.export(tmp_path / "w.safetensors")))
    assert not any("probe" in key or "narrow" in key for key in exported)
    # the probe is exported beside them, as trained
    probe = safetensors.torch.load_file(str(state_probe_path(tmp_path / "w.safetensors")))
    assert state_probe_path(tmp_path / "w.safetensors").name == "w.state-probe.safetensors"
    assert probe.keys() == trainer.probe.state_dict().keys()
    assert all(torch.equal(probe[k], v) for k, v in trainer.probe.state_dict().items())
    # a checkpoint from before the setting holds no probe to resume
    state = torch.load(trainer.checkpoint_path, weights_only=True)
    del state["train_config"]["state_weight"], state["probe"]
    torch.save(state, trainer.checkpoint_path)
    with pytest.raises(ValueError, match="without a state probe"):
        _trainer(data_12, tmp_path, "run", state_weight=0.5)


def test_the_state_weight_is_refused_where_it_cannot_run(data_12, tmp_path):
    from streamworld.pusht.data import Dataset

    with pytest.raises(ValueError, match="--state-weight must be"):
        _trainer(data_12, tmp_path, "neg", state_weight=-1.0)
    with pytest.raises(ValueError, match="cannot be combined"):
        _trainer(data_12, tmp_path, "roll", state_weight=1.0, rollout_share=0.5)
    without = Dataset(data_12.frames, data_12.actions, data_12.spec)
    with pytest.raises(ValueError, match=r"states\.npy"):
        _trainer(without, tmp_path, "nostates", state_weight=1.0)


def test_the_logged_block_errors_count_only_the_served_frames_and_the_loss_only_the_trained():
    from streamworld.pusht.state_probe import state_targets
    from streamworld.pusht.train import state_loss_and_stats

    scenes = torch.tensor([[[100.0, 100.0, 256.0, 256.0, 0.0]] * 3])  # [1, 3, 5]
    probed = state_targets(scenes).clone()
    probed[0, 1, 2] += 8.0 / 256.0  # frame 1: the block 8 world units off
    probed[0, 2, 2] += 80.0 / 256.0  # frame 2: 80 units off, but not trained
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    target = state_targets(scenes)
    loss, stats = state_loss_and_stats(probed, target, mask, torch.tensor([[False, True, True]]))
    assert stats["state_block_units"] == pytest.approx(8.0, abs=1e-4)
    assert stats["state_angle_degrees"] == pytest.approx(0.0, abs=1e-3)
    assert loss.item() == pytest.approx((8.0 / 256.0) ** 2 / 6 / 2, rel=1e-4)
    _, none = state_loss_and_stats(probed, target, mask, torch.tensor([[False, False, True]]))
    assert "state_block_units" not in none


def test_change_targets_are_each_frames_change_since_the_frame_before_its_chunk(data_12, tmp_path):
    """With --state-target change, the batch carries the scene of the frame just before each
    chunk (the stream clip's first context frame for chunk 0, else the previous chunk's last
    frame), and the probe's targets are each clip frame's change since it."""
    from streamworld.pusht.data import Dataset
    from streamworld.pusht.state_probe import change_targets

    # Scenes that name their frame (episode, frame index) show which frame each row came from.
    e, t = data_12.states.shape[:2]
    named = np.zeros_like(data_12.states)
    named[..., 0], named[..., 1] = np.arange(e)[:, None], np.arange(t)[None, :]
    indexed = Dataset(data_12.frames, data_12.actions, data_12.spec, named)
    located = _trainer(indexed, tmp_path, "where", state_weight=0.5, state_target="change")
    where = located.batcher.sample(8)
    chunk, chunks = located.batcher.chunk, located.batcher.clip // located.batcher.chunk
    assert where["states_before"].shape == (8, chunks, 5)
    first = where["states"][:, 0, 1]  # the clip's first frame
    for c in range(chunks):
        assert torch.equal(where["states_before"][:, c, 0], where["states"][:, 0, 0])  # same episode
        assert torch.equal(where["states_before"][:, c, 1], first + c * chunk - 1)

    trainer = _trainer(data_12, tmp_path, "change", state_weight=0.5, state_target="change")
    batch = trainer.batcher.sample(4)
    before = batch["states_before"]
    target, scale = trainer._state_targets(batch)
    assert scale == 32.0
    expected = change_targets(batch["states"], before.repeat_interleave(chunk, 1))
    assert torch.allclose(target, expected)
    # a frame that is its chunk's reference frame again has no change
    assert torch.allclose(
        change_targets(before[:, :1], before[:, :1]), torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    )
    seed = trainer.gen.get_state()
    total, stats = trainer.loss(batch)
    plain = _trainer(data_12, tmp_path, "plain-change")
    plain.dit.load_state_dict(trainer.dit.state_dict())
    plain.gen.set_state(seed)
    pixel, _ = plain.loss(batch)
    assert total.item() == pytest.approx(pixel.item() + 0.5 * stats["loss_state"], rel=1e-5)
    # the same probe scored against the absolute scenes errs differently
    scene = _trainer(data_12, tmp_path, "scene-same", state_weight=0.5)
    scene.dit.load_state_dict(trainer.dit.state_dict())
    scene.probe.load_state_dict(trainer.probe.state_dict())
    scene.gen.set_state(seed)
    _, scene_stats = scene.loss(batch)
    assert scene_stats["loss_state"] != pytest.approx(stats["loss_state"], rel=1e-3)


def test_while_the_probe_warms_up_its_error_does_not_reach_the_dit(data_12, tmp_path):
    """Before --state-warmup steps the DiT's gradient is the pixel loss's alone and the probe
    still learns; from then on the probe's error reaches the DiT."""
    plain = _trainer(data_12, tmp_path, "plain-warm")
    warm = _trainer(data_12, tmp_path, "warm", state_weight=5.0, state_target="change", state_warmup=2)
    warm.dit.load_state_dict(plain.dit.state_dict())
    batch = plain.batcher.sample(4)
    seed = plain.gen.get_state()

    def dit_grads(trainer):
        trainer.dit.zero_grad()
        trainer.gen.set_state(seed)
        loss, _ = trainer.loss(batch)
        loss.backward()
        return [p.grad.clone() for p in trainer.dit.parameters() if p.grad is not None]

    pixel = dit_grads(plain)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(dit_grads(warm), pixel, strict=True))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in warm.probe.parameters())
    warm.step = 2
    joined = dit_grads(warm)
    assert not all(torch.allclose(a, b, atol=1e-7) for a, b in zip(joined, pixel, strict=True))


def test_the_state_target_and_warm_up_are_refused_where_they_cannot_apply(data_12, tmp_path):
    with pytest.raises(ValueError, match="--state-target must be one of scene, change"):
        _trainer(data_12, tmp_path, "bad", state_weight=1.0, state_target="pose")
    with pytest.raises(ValueError, match="--state-warmup must be at least 0"):
        _trainer(data_12, tmp_path, "neg", state_weight=1.0, state_warmup=-1)
    for setting in ({"state_target": "change"}, {"state_warmup": 5}, {"state_turn_weight": 8.0}):
        with pytest.raises(ValueError, match="give --state-weight"):
            _trainer(data_12, tmp_path, "alone", **setting)


def test_the_turn_weight_scales_the_turn_alone_and_keeps_its_angle(data_12, tmp_path):
    from streamworld.pusht.state_probe import CHANGE_SCALE, change_targets, state_errors

    before = torch.tensor([[100.0, 100.0, 256.0, 256.0, 0.3]])
    after = torch.tensor([[110.0, 90.0, 260.0, 250.0, 0.3 + math.radians(4.0)]])
    plain, weighted = change_targets(after, before), change_targets(after, before, 8.0)
    assert torch.equal(weighted[..., :4], plain[..., :4])
    assert torch.allclose(weighted[..., 4:], 8.0 * plain[..., 4:])
    still = change_targets(before, before, 8.0)
    # the angle read off the weighted target is the turn, and its error against no turn is 4 degrees
    _, angle = state_errors(weighted, still, CHANGE_SCALE)
    assert angle.item() == pytest.approx(4.0, abs=1e-3)
    # the trainer's targets use it
    trainer = _trainer(
        data_12, tmp_path, "turn", state_weight=0.5, state_target="change", state_turn_weight=8.0
    )
    batch = trainer.batcher.sample(2)
    target, _ = trainer._state_targets(batch)
    before = batch["states_before"].repeat_interleave(trainer.batcher.chunk, 1)
    assert torch.allclose(target, change_targets(batch["states"], before, 8.0))
    with pytest.raises(ValueError, match="--state-turn-weight must be"):
        _trainer(data_12, tmp_path, "zero", state_weight=0.5, state_target="change", state_turn_weight=0.0)
    with pytest.raises(ValueError, match="give --state-target change"):
        _trainer(data_12, tmp_path, "scene-turn", state_weight=0.5, state_turn_weight=8.0)


def test_the_probe_can_read_a_middle_blocks_hidden_states(data_12, tmp_path):
    """With --state-layer K the probe reads the hidden states after the first K blocks: those
    of a forward cut after K blocks, while the frame is the whole DiT's; its gradient reaches
    the first K blocks and none after them."""
    trainer = _trainer(data_12, tmp_path, "middle", state_weight=0.5, state_layer=1)
    last = _trainer(data_12, tmp_path, "last", state_weight=0.5)
    last.dit.load_state_dict(trainer.dit.state_dict())
    batch = trainer.batcher.sample(2)
    seed = trainer.gen.get_state()
    middle = trainer.forward(batch)
    last.gen.set_state(seed)
    whole = last.forward(batch)
    assert torch.equal(middle.pred, whole.pred)
    assert not torch.allclose(middle.hidden, whole.hidden)
    # the states after block 1 are what a one-block DiT with the same first block computes
    dit = trainer.dit
    layers = dit.num_layers
    try:
        dit.num_layers = 1
        trainer.gen.set_state(seed)
        cut = trainer.forward(batch)
    finally:
        dit.num_layers = layers
    assert torch.allclose(middle.hidden, cut.hidden, atol=1e-6)
    # the probe's error reaches the first block only
    trainer.step = trainer.cfg.state_warmup
    hidden = middle.hidden
    probe_loss = trainer.probe(hidden).pow(2).mean()
    probe_loss.backward()
    first = [p for n, p in dit.named_parameters() if ".blocks.0." in n]
    later = [p for n, p in dit.named_parameters() if ".blocks.1." in n]
    assert first and later
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in first)
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in later)


def test_a_state_layer_the_model_lacks_is_refused(data_12, tmp_path, capsys):
    from streamworld.cli.main import main as cli_main

    with pytest.raises(ValueError, match="--state-layer 3: the model has 2 blocks"):
        _trainer(data_12, tmp_path, "deep", state_weight=0.5, state_layer=3)
    with pytest.raises(ValueError, match="--state-layer must be at least 1"):
        _trainer(data_12, tmp_path, "zero", state_weight=0.5, state_layer=0)
    with pytest.raises(ValueError, match="needs --state-weight"):
        _trainer(data_12, tmp_path, "alone", state_layer=1)
    work = tmp_path / "cli"
    flags = ["train", "pusht", "--smoke", "--workdir", str(work), "--state-weight", "1", "--state-layer", "9"]
    assert cli_main(flags) == 2
    assert "--state-layer 9: the model has 2 blocks" in capsys.readouterr().err
    assert not (work / "data").exists()  # refused before any data is recorded


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_compiled_steps_with_the_probe_on_a_middle_block_equal_the_eager_ones(data_12, tmp_path, device):
    """`--compile` with every probe option of the rounds on the GPU (change target, warm-up,
    turn weight, a middle block): the same seeds give the same losses, probe and weights as
    the eager steps, up to float rounding (bf16 autocast on a GPU), before and after the
    warm-up; and the probe did learn."""
    from torch._dynamo.utils import counters

    options = dict(
        state_weight=0.5, state_target="change", state_warmup=2, state_turn_weight=4.0, state_layer=1
    )
    torch._dynamo.reset()
    eager = _trainer(data_12, tmp_path, "eager", device, warmup_steps=1, **options)
    compiled = _trainer(data_12, tmp_path, "compiled", device, warmup_steps=1, compile=True, **options)
    tol = 2e-2 if device == "cuda" else 1e-4
    for _ in range(4):
        a, b = eager.train_step(), compiled.train_step()
        assert a["loss"] == pytest.approx(b["loss"], rel=tol)
        assert a["loss_state"] == pytest.approx(b["loss_state"], rel=tol)
    assert counters["stats"]["unique_graphs"] > 0, "torch.compile never ran"
    for key, value in eager.ema.items():
        torch.testing.assert_close(compiled.ema[key], value, rtol=tol, atol=tol, msg=key)
    start = _trainer(data_12, tmp_path, "start", device, **options).probe.state_dict()
    for key, value in eager.probe.state_dict().items():
        torch.testing.assert_close(compiled.probe.state_dict()[key], value, rtol=tol, atol=tol, msg=key)
    assert any(not torch.equal(start[k], v) for k, v in eager.probe.state_dict().items())
