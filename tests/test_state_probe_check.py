"""benchmarks/state_probe_check.py: a state probe trained on a fixed model's hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "state_probe_check.py"


def _bench():
    return load_script("benchmarks/state_probe_check.py")


def test_the_score_sets_the_probe_against_no_change_since_the_frame_before_the_chunk():
    """Two clips of two chunks of 2 frames; the block turns 1 degree a frame in the first,
    and 10 in the second, and moves 3 units a frame in the second. A probe that reads the
    true change errs by nothing; the copy (no change) by the change since the frame before
    the second chunk, binned by the turn."""
    bench = _bench()
    scenes = torch.zeros(2, 4, 5)
    scenes[..., :4] = 256.0
    scenes[0, :, 4] = torch.deg2rad(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    scenes[1, :, 4] = torch.deg2rad(torch.tensor([0.0, 10.0, 20.0, 30.0]))
    scenes[1, :, 2] = torch.tensor([256.0, 259.0, 262.0, 265.0])
    hidden, truth = bench.second_chunk(torch.zeros(2, 4, 1, 1), scenes, chunk=2)
    assert hidden.shape == (2, 2, 1, 1) and truth.shape == (2, 2, 6)

    def reads_the_truth(h: torch.Tensor) -> torch.Tensor:
        assert h.shape == (2, 2, 1)  # the second chunk's frames, tokens flattened
        return truth

    report = bench.score(reads_the_truth, hidden, truth)
    assert report["frames"] == 4
    assert report["all"]["probe_angle_degrees"] == pytest.approx(0.0, abs=1e-3)
    assert report["all"]["probe_block_units"] == pytest.approx(0.0, abs=1e-3)
    assert report["all"]["copy_angle_degrees"] == pytest.approx((1 + 2 + 10 + 20) / 4, abs=1e-3)
    assert report["all"]["copy_block_units"] == pytest.approx((3 + 6) / 4, abs=1e-3)
    assert report["turn 0.5-2 degrees"]["frames"] == 1  # the 1-degree turn
    assert report["turn 2-5 degrees"]["frames"] == 1
    assert report["turn 5-180 degrees"]["frames"] == 2
    assert report["turn 0-0.5 degrees"] == {"frames": 0}


def test_the_check_scores_a_probe_trained_on_cached_hidden_states(tmp_path):
    bench = _bench()
    out = tmp_path / "check.json"
    argv = ["--smoke", "--episodes", "3", "--held-out", "1", "--steps-per-episode", "30", "--workers", "1"]
    argv += ["--clips", "6", "--held-out-clips", "3", "--batch-size", "4", "--epochs", "4"]
    argv += ["--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    held_out = report["held_out"]
    assert held_out["frames"] == 3 * 4  # the second chunk's 4 frames of each held-out clip
    assert held_out["all"]["copy_block_units"] >= 0
    bins = [v for k, v in held_out.items() if k.startswith("turn")]
    assert sum(b["frames"] for b in bins) == held_out["frames"]
    assert [row["epoch"] for row in report["history"]] == [1, 2, 3, 4]
    assert report["history"][-1]["loss_state"] < report["history"][0]["loss_state"]
    assert set(report["seconds"]) == {"data", "forwards", "probe"}


def test_the_probe_learns_each_frame_from_its_own_hidden_states():
    """Hidden states that hold each frame's scene (a fixed linear map of it, per frame):
    the probe learns it to well below the scenes' own variance, which a probe that saw
    every target in a batch for each frame would not go below."""
    import argparse

    from streamworld.pusht.state_probe import state_targets

    bench = _bench()
    gen = torch.Generator().manual_seed(0)
    scenes = torch.rand(64, 4, 5, generator=gen) * torch.tensor([512.0, 512, 512, 512, 6.28])
    targets = state_targets(scenes)
    mix = torch.randn(6, 4 * 8, generator=gen)
    hidden = (targets @ mix).unflatten(-1, (4, 8)).half()  # [N, F, P=4, D=8]
    args = argparse.Namespace(epochs=40, probe_batch=32, lr=3e-3, seed=0)
    _, history = bench.train_probe(args, hidden, targets)
    variance = targets.var(dim=(0, 1)).mean().item()
    assert history[-1]["loss_state"] < 0.1 * variance


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--held-out", "5", "--episodes", "5"], "fewer than --episodes"),
        (["--lr", "0"], "positive"),
        (["--epochs", "0"], "at least 1"),
        (["--layer", "3"], "--layer must be in [1, 2]"),
        (["--layer", "0"], "--layer must be in [1, 2]"),
    ],
)
def test_the_check_refuses_settings_it_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        _bench().parse_args(["--smoke", *argv])
    assert message in capsys.readouterr().err


def test_the_check_reads_a_middle_block_and_keeps_its_states_apart(tmp_path, capsys):
    """--layer 1 keeps the states after the first block; a features file kept for one layer
    is refused for another instead of being scored as if it were that layer's."""
    bench = _bench()
    features = tmp_path / "features.pt"
    argv = ["--smoke", "--episodes", "3", "--held-out", "1", "--steps-per-episode", "30", "--workers", "1"]
    argv += ["--clips", "4", "--held-out-clips", "2", "--batch-size", "4", "--epochs", "2"]
    argv += ["--data", str(tmp_path / "data"), "--features", str(features)]
    assert bench.main([*argv, "--layer", "1"]) == 0
    kept = torch.load(features, weights_only=True)
    assert kept["layer"] == 1
    last = tmp_path / "last.pt"
    assert bench.main([*argv[:-1], str(last)]) == 0
    whole = torch.load(last, weights_only=True)
    assert whole["layer"] is None
    # the same clips (the same seed), read after another block
    assert torch.equal(kept["train"][1], whole["train"][1])
    assert kept["train"][0].shape == whole["train"][0].shape
    assert not torch.equal(kept["train"][0], whole["train"][0])
    with pytest.raises(SystemExit, match="after 1 blocks, not --layer's"):
        bench.main(argv)
