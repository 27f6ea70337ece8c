"""benchmarks/discriminator_check.py: the adversarial term's discriminator trained alone
on cached rollouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "discriminator_check.py"


def _bench():
    return load_script("benchmarks/discriminator_check.py")


@pytest.mark.slow
def test_the_check_trains_every_variant_from_one_start_and_scores_it_on_the_held_out_batch(tmp_path):
    bench = _bench()
    out = tmp_path / "check.json"
    argv = ["--smoke", "--episodes", "2", "--steps-per-episode", "40", "--batch-size", "2", "--batches", "3"]
    argv += ["--steps", "3", "--every", "2", "--workers", "1", "--lr", "1e-3", "2e-3", "--json", str(out)]
    assert bench.main([*argv, "--background", "1", "0", "0.25"]) == 0
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {
        f"{kind} lr {lr}" for kind in ("mean", "masked", "background 0.25") for lr in ("0.001", "0.002")
    }
    for rows in variants.values():
        assert [row["step"] for row in rows] == [0, 2, 3]
        assert rows[0] == next(iter(variants.values()))[0]  # one start for all
        assert rows[-1] != rows[0]  # and each trained from it
        assert 0 < rows[0]["patches"] <= 1 and 0 <= rows[-1]["right"] <= 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "1"], "one held out"),
        (["--lr", "0"], "positive"),
        (["--steps", "0"], "at least 1"),
        (["--background", "1.5"], "in [0, 1]"),
    ],
)
def test_the_check_refuses_settings_it_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        _bench().parse_args(["--smoke", *argv])
    assert message in capsys.readouterr().err
