"""`streamworld compare`: two evaluation reports, seed by seed (`streamworld/pusht/compare.py`)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from streamworld.cli import main
from streamworld.pusht.compare import (
    BOOTSTRAP_RESAMPLES,
    MAX_REPORT_BYTES,
    MAX_REPORTS,
    CompareError,
    bootstrap_interval,
    compare,
    format_comparison,
    load_side,
    sign_test,
)

CEM = {"horizon": 24, "samples": 16, "elites": 4, "iterations": 3}


def plan_report(successes: dict[int, bool], steps: int = 20, **settings) -> dict:
    """A planning report as `eval --plan` writes it, with the fields compare reads; a goal
    reached takes `steps` steps."""
    return {
        "model": "pusht-delta",
        "weights": "shipped",
        "goal_steps": 25,
        "budget": 50,
        "cem": CEM,
        **settings,
        "summary": {"episodes": len(successes)},
        "episodes": [{"seed": s, "success": ok, "steps": steps if ok else 50} for s, ok in successes.items()],
    }


def prediction_report(
    block: dict[int, list],
    shapes: dict[int, list] | None = None,
    horizons: tuple[int, ...] = (8, 32),
    modes: tuple[str, ...] = ("clean",),
    angles: dict[int, list] | None = None,
    **settings,
) -> dict:
    """A prediction report with per-seed results for each of `modes` (the same values in
    each), at `horizons` (8 and 32 by default); without `angles`, as reports were before
    they kept the block's angle error."""
    seeds = list(block)
    n = len(horizons)
    rows = {
        "block_px": [block[s] for s in seeds],
        "agent_px": [[0.3] * n for _ in seeds],
        "psnr": [[30.0] * n for _ in seeds],
        "block_t_shape": [(shapes or {}).get(s, [True] * n) for s in seeds],
        **({"block_deg": [angles[s] for s in seeds]} if angles is not None else {}),
    }
    return {
        "model": "pusht-delta",
        "weights": "shipped",
        "horizon": 32,
        "frame_size": 64,
        **settings,
        "modes": {m: {} for m in modes},
        "per_seed": {"seeds": seeds, "horizons": list(horizons), **{m: rows for m in modes}},
    }


def write(tmp_path: Path, name: str, report: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return str(path)


def brute_sign_test(wins: int, losses: int) -> float:
    """The two-sided exact test by enumeration: of all 2**n ways the n decided pairs can
    split, the share whose split is no likelier than the one observed."""
    n = wins + losses
    ways = [0] * (n + 1)  # ways[k]: outcomes in which the first side wins k pairs
    for outcome in itertools.product((0, 1), repeat=n):
        ways[sum(outcome)] += 1
    return sum(w for w in ways if w <= ways[wins]) / 2**n


@pytest.mark.parametrize("wins,losses", [(0, 0), (5, 0), (0, 5), (3, 3), (7, 2), (1, 9), (6, 5)])
def test_sign_test_is_the_exact_two_sided_binomial_test(wins, losses):
    assert sign_test(wins, losses) == pytest.approx(min(1.0, brute_sign_test(wins, losses)))


def test_sign_test_values_the_docs_quote():
    # 39 goals only one way, 25 only the other (docs/planning.md): p = 0.10.
    assert sign_test(39, 25) == pytest.approx(0.1034, abs=1e-4)
    assert sign_test(25, 39) == sign_test(39, 25)


def test_bootstrap_interval_holds_the_mean_and_narrows_with_more_seeds():
    rng = np.random.default_rng(1)
    few, many = rng.normal(1.0, 1.0, 20), rng.normal(1.0, 1.0, 500)
    low_f, high_f = bootstrap_interval(few, 2000, 0)
    low_m, high_m = bootstrap_interval(many, 2000, 0)
    assert low_f < few.mean() < high_f and low_m < many.mean() < high_m
    assert high_m - low_m < (high_f - low_f) / 2
    assert bootstrap_interval(np.full(10, 0.5), 500, 0) == pytest.approx((0.5, 0.5))
    assert all(math.isnan(v) for v in bootstrap_interval(np.array([1.0]), 500, 0))


def test_plans_are_paired_by_seed_across_split_reports(tmp_path, capsys):
    # A reaches seeds 0-5, B reaches 2-9: 4 both, 2 A only, 4 B only; seed 10 only in A.
    a = [
        write(tmp_path, "a-0-4.json", plan_report({s: s <= 5 for s in range(5)})),
        write(tmp_path, "a-5-10.json", plan_report({s: s <= 5 for s in range(5, 11)})),
    ]
    b = write(
        tmp_path, "b.json", plan_report({s: s >= 2 for s in range(10)}, steps=25, weights="r17.safetensors")
    )
    result = compare(load_side(",".join(a)), load_side(b))
    assert result["seeds"] == 10 and result["unpaired_seeds"] == {"only_a": 1, "only_b": 0}
    assert (result["success_a"], result["success_b"], result["both"], result["neither"]) == (6, 8, 4, 0)
    assert result["only_a"] == [0, 1] and result["only_b"] == [6, 7, 8, 9]
    assert result["p"] == pytest.approx(sign_test(4, 2))
    assert result["steps_difference_when_both"] == 5.0  # B took 25 steps where A took 20
    # B gained 4 seeds and lost 2 of 10: +0.2, and the interval of the per-seed mean holds it
    assert result["success_difference"] == pytest.approx(0.2)
    low, high = result["success_difference_interval"]
    assert -1 <= low < 0.2 < high <= 1
    assert (low, high) == pytest.approx(
        bootstrap_interval(np.array([-1, -1, 0, 0, 0, 0, 1, 1, 1, 1], float), BOOTSTRAP_RESAMPLES, 0)
    )
    # The same through the command line, with a glob for A, and the JSON it writes.
    out = tmp_path / "cmp.json"
    assert main(["compare", str(tmp_path / "a-*.json"), b, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| of 10 | 6 (60%) | 8 (80%) | 4 | 2 | 4 | 0 |" in text
    assert "left out: 1 only in A, 0 only in B" in text and "(2 reports)" in text
    assert "over the goals both reached: +5.0" in text
    assert f"success rate, B - A: +20.0 points (95% interval {100 * low:+.1f} to {100 * high:+.1f}" in text
    assert json.loads(out.read_text())["only_b"] == [6, 7, 8, 9]
    # A side against itself: no difference, and an interval that is that point
    assert compare(load_side(b), load_side(b))["success_difference_interval"] == [0.0, 0.0]
    # One seed in common: no interval, in the JSON as null and none printed
    one = write(tmp_path, "one.json", plan_report({3: False}))
    single = compare(load_side(",".join(a)), load_side(one))
    assert single["success_difference"] == -1.0 and single["success_difference_interval"] is None
    assert "success rate" not in format_comparison(single)


def test_predictions_are_compared_per_horizon_with_lost_blocks_left_out(tmp_path):
    # B places the block 1 px better at h=32 on seeds 0-2, worse on 3; seed 4's block is lost by B.
    a = prediction_report({0: [1.0, 5.0], 1: [1.0, 6.0], 2: [2.0, 4.0], 3: [1.0, 3.0], 4: [1.0, 4.0]})
    b = prediction_report(
        {0: [1.0, 4.0], 1: [1.0, 5.0], 2: [2.0, 3.0], 3: [1.0, 5.0], 4: [1.0, None]},
        shapes={0: [True, False], 1: [True, False], 2: [True, False]},
        weights="r17.safetensors",
    )
    result = compare(load_side(write(tmp_path, "a.json", a)), load_side(write(tmp_path, "b.json", b)))
    assert result["horizons"] == [8, 32]
    h8, h32 = result["modes"]["clean"]["block_px"]
    assert h8["difference"] == 0.0 and (h8["b_better"], h8["a_better"], h8["p"]) == (0, 0, 1.0)
    assert h32["seeds"] == 4 and h32["missing"] == {"a_only": 0, "b_only": 1, "both": 0}
    assert h32["missing_p"] == sign_test(0, 1)
    assert h32["mean_a"] == pytest.approx(4.5) and h32["mean_b"] == pytest.approx(4.25)
    assert h32["difference"] == pytest.approx(-0.25)
    assert (h32["b_better"], h32["a_better"]) == (3, 1) and h32["p"] == pytest.approx(sign_test(3, 1))
    low, high = h32["interval"]
    assert low <= -0.25 <= high
    # A T kept is better: B lost the T on three seeds at h=32.
    shape32 = result["modes"]["clean"]["block_t_shape"][1]
    assert (shape32["mean_a"], shape32["mean_b"], shape32["b_better"], shape32["a_better"]) == (
        1.0,
        0.4,
        0,
        3,
    )
    table = format_comparison(result)
    assert "| clean | block error (px) | 32 | 4 | 4.50 | 4.25 | -0.25 (" in table
    assert "| 3 / 1 | 0.625 | 0 / 1 (1.000) / 0 |" in table  # B better on 3 seeds, A on 1; B lost a block
    assert "| clean | block is a T (share) | 32 | 5 | 1.00 | 0.40 |" in table


def test_block_angles_are_compared_where_both_sides_have_them(tmp_path, capsys):
    # B turns the block better on seeds 0-2 at h=32; seed 3's block is no T in A.
    block = {s: [1.0, 4.0] for s in range(4)}
    a_angles = {0: [2.0, 20.0], 1: [1.0, 15.0], 2: [3.0, 30.0], 3: [1.0, None]}
    b_angles = {0: [2.0, 5.0], 1: [1.0, 10.0], 2: [3.0, 12.0], 3: [1.0, 8.0]}
    a = write(tmp_path, "a.json", prediction_report(block, angles=a_angles, t_shape_mismatch=0.2))
    b = write(
        tmp_path,
        "b.json",
        prediction_report(block, angles=b_angles, weights="r17.safetensors", t_shape_mismatch=0.2),
    )
    result = compare(load_side(a), load_side(b))
    h32 = result["modes"]["clean"]["block_deg"][1]
    assert h32["seeds"] == 3 and h32["missing"] == {"a_only": 1, "b_only": 0, "both": 0}
    assert h32["difference"] == pytest.approx(-38 / 3) and (h32["b_better"], h32["a_better"]) == (3, 0)
    assert (
        "| clean | block angle error, T only (deg) | 32 | 3 | 21.67 | 9.00 | -12.67 ("
        in format_comparison(result)
    )
    # A report from before the angles, whose T bound was looser: both T metrics are left
    # out, and the output says why.
    old = write(tmp_path, "old.json", prediction_report(block))
    assert main(["compare", old, b]) == 0
    text = capsys.readouterr().out
    assert "left out, metrics only in B (the other's reports predate them): block_deg" in text
    assert (
        "left out, metrics measured with another bound for a T (0.35 before 2026-12-05): block_t_shape"
        in text
    )
    assert "block angle error" not in text and "block is a T" not in text
    assert "| clean | block error (px) | 32 | 4 |" in text
    # Two old reports share their bound: the T share is compared.
    assert "| clean | block is a T (share) | 32 |" in format_comparison(
        compare(load_side(old), load_side(old))
    )
    # Merged with an older report, a side keeps only what all of its reports have; here the
    # bounds differ within the side, which is refused.
    old4 = write(tmp_path, "old-4.json", prediction_report({4: [1.0, 4.0]}, t_shape_mismatch=0.2))
    merged = load_side(f"{a},{old4}")
    assert "block_deg" not in merged.metrics and "block_px" in merged.metrics
    with pytest.raises(CompareError, match="t_shape_mismatch"):
        load_side(f"{a},{old}")


def test_reports_that_cannot_be_compared_are_refused(tmp_path):
    plan = write(tmp_path, "plan.json", plan_report({0: True}))
    prediction = write(tmp_path, "pred.json", prediction_report({0: [1.0, 2.0]}))
    cases = {
        "a planning report with a prediction report": (plan, prediction, "cannot compare"),
        "another goal": (
            plan,
            write(tmp_path, "g.json", plan_report({0: True}, goal_steps=10)),
            "goal_steps",
        ),
        "one side mixing searches": (
            plan + "," + write(tmp_path, "s.json", plan_report({1: True}, cem={**CEM, "samples": 32})),
            plan,
            "one side must be one evaluation",
        ),
        "one side mixing warm starts": (
            plan + "," + write(tmp_path, "w.json", plan_report({1: True}, warm_start="plan")),
            plan,
            "warm_start is 'plan'",
        ),
        "one side mixing scene models": (
            write(tmp_path, "s1.json", plan_report({0: True}, scene_model_sha256="a" * 64))
            + ","
            + write(tmp_path, "s2.json", plan_report({1: True}, scene_model_sha256="b" * 64)),
            plan,
            "scene_model_sha256 is 'bbbb",
        ),
        "a seed twice in one side": (plan + "," + plan, plan, "seed 0 appears twice"),
        "no shared seed": (plan, write(tmp_path, "o.json", plan_report({5: True})), "share no seed"),
        "one side mixing KV modes": (
            prediction
            + ","
            + write(tmp_path, "m.json", prediction_report({1: [1.0, 2.0]}, modes=("final",))),
            prediction,
            "modes is",
        ),
        "one side mixing horizons": (
            prediction
            + ","
            + write(tmp_path, "h.json", prediction_report({1: [1.0, 2.0]}, horizons=(4, 32))),
            prediction,
            "per-seed horizons",
        ),
        "no shared KV mode": (
            prediction,
            write(tmp_path, "f.json", prediction_report({0: [1.0, 2.0]}, modes=("final",))),
            "share no KV mode",
        ),
        "no shared horizon": (
            prediction,
            write(tmp_path, "n.json", prediction_report({0: [1.0, 2.0]}, horizons=(1, 2))),
            "share no horizon",
        ),
    }
    for why, (a, b, message) in cases.items():
        with pytest.raises(CompareError, match=message):
            compare(load_side(a), load_side(b))
        assert main(["compare", a, b]) == 2, why


def test_a_report_written_before_a_setting_existed_ran_its_only_behaviour(tmp_path):
    """Reports without `warm_start` (written before it existed) warm-started from the mean:
    they join a side of reports that say so."""
    older = write(tmp_path, "older.json", plan_report({0: True}))
    newer = write(tmp_path, "newer.json", plan_report({1: False}, warm_start="mean"))
    side = load_side(older + "," + newer)
    assert side.settings["warm_start"] == "mean" and len(side.paths) == 2


def test_files_that_are_not_reports_are_refused_with_the_reason(tmp_path, capsys):
    old = prediction_report({0: [1.0, 2.0]})
    del old["per_seed"]
    (tmp_path / "text.json").write_text("not json")
    cases = {
        str(tmp_path / "missing.json"): "no such file",
        str(tmp_path / "none-*.json"): "no file matches",
        write(tmp_path, "old.json", old): "without per-seed results",
        str(tmp_path / "text.json"): "not JSON",
        write(tmp_path, "list.json", [1, 2]): "a JSON object",
        write(tmp_path, "other.json", {"summary": {}}): "neither a planning nor a prediction report",
        ",": "names no report",
        write(
            tmp_path, "short.json", prediction_report({0: [1.0]})
        ): "misses seed 0's results at some horizon",
        write(
            tmp_path, "episode.json", {**plan_report({0: True}), "episodes": [{"seed": 0, "success": True}]}
        ): ("an episode without an integer seed, a success flag and its steps"),
    }
    text_row = prediction_report({0: [1.0, 2.0]})
    text_row["per_seed"]["clean"]["block_px"] = ["ab"]
    list_seed = prediction_report({0: [1.0, 2.0]})
    list_seed["per_seed"]["seeds"] = [[0]]
    cases[write(tmp_path, "text-row.json", text_row)] = "misses seed 0's results at some horizon"
    cases[write(tmp_path, "list-seed.json", list_seed)] = "seeds and horizons must be integers"
    twice = prediction_report({0: [1.0, 2.0]}, horizons=(8, 8))
    cases[write(tmp_path, "twice.json", twice)] = "names a seed or a horizon twice"
    for spec, message in cases.items():
        with pytest.raises(CompareError, match=message):
            load_side(spec)
        assert main(["compare", spec, spec]) == 2
        assert message in capsys.readouterr().err
    big = tmp_path / "big.json"
    with big.open("wb") as f:  # sparse: no disk is spent
        f.truncate(MAX_REPORT_BYTES + 1)
    with pytest.raises(CompareError, match="larger than 16 MiB"):
        load_side(str(big))
    with pytest.raises(CompareError, match="MiB of reports, at most 128 MiB a side"):
        load_side(",".join([str(big)] * 9))
    many = ",".join([str(tmp_path / "text.json")] * (MAX_REPORTS + 1))
    with pytest.raises(CompareError, match=f"at most {MAX_REPORTS}"):
        load_side(many)
    report = write(tmp_path, "plan.json", plan_report({0: True}))
    assert main(["compare", report, report, "--resamples", "5"]) == 2
    assert "--resamples must be between 100 and 100000" in capsys.readouterr().err
    assert main(["compare", report, report, "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "--json: folder" in capsys.readouterr().err
    assert main(["compare", report, report, "--resamples", "100"]) == 0  # the same reports compare


def test_predictions_pair_horizons_by_value_and_say_what_was_left_out(tmp_path, capsys):
    """B has one more horizon and one more KV mode than A: values are paired by horizon, not
    by position, and the output names what only one side has. A non-finite value counts as
    a missing one."""
    a = prediction_report({0: [1.0, 4.0], 1: [2.0, float("nan")]})  # horizons 8, 32
    b = prediction_report(
        {0: [1.5, 9.0, 3.0], 1: [2.5, 9.0, 5.0]}, horizons=(8, 16, 32), modes=("clean", "final")
    )
    pa, pb = write(tmp_path, "a.json", a), write(tmp_path, "b.json", b)
    result = compare(load_side(pa), load_side(pb))
    assert result["horizons"] == [8, 32] and list(result["modes"]) == ["clean"]
    assert result["left_out"] == {
        "modes_only_a": [],
        "modes_only_b": ["final"],
        "horizons_only_a": [],
        "horizons_only_b": [16],
        "metrics_only_a": [],
        "metrics_only_b": [],
        "metrics_other_t_bound": [],
    }
    h8, h32 = result["modes"]["clean"]["block_px"]
    assert (h8["mean_a"], h8["mean_b"], h8["difference"]) == (1.5, 2.0, 0.5)
    assert (h32["mean_a"], h32["mean_b"], h32["seeds"]) == (4.0, 3.0, 1)  # seed 1's NaN left out
    assert h32["missing"] == {"a_only": 1, "b_only": 0, "both": 0}
    assert main(["compare", pa, pb]) == 0
    text = capsys.readouterr().out
    assert "left out, modes only in B: final" in text and "left out, horizons only in B: 16" in text


def test_the_bootstrap_interval_is_drawn_in_blocks_the_same_way():
    """Many seeds: the resamples are drawn in blocks, and the interval still holds the mean."""
    rng = np.random.default_rng(3)
    d = rng.normal(0.2, 1.0, 5000)
    low, high = bootstrap_interval(d, 2000, 0)
    assert low < d.mean() < high and high - low < 0.1


def test_the_plan_breakdown_splits_goals_by_what_the_task_asks(tmp_path, capsys):
    """benchmarks/plan_breakdown.py: each task lands in one bin of each split (turns only
    for goals that move the block), and each side's goals are counted in their task's bin,
    over the seeds every side has."""
    from tests.conftest import load_script

    bench = load_script("benchmarks/plan_breakdown.py")
    demands = {s: bench.task_demands(s, 25) for s in range(12)}
    assert {move < 1 for move, _ in demands.values()} == {True, False}  # both kinds of goal
    assert all(0 <= turn <= 180 for _, turn in demands.values())
    a = write(tmp_path, "a.json", plan_report({s: s % 2 == 0 for s in range(12)}))
    b = write(tmp_path, "b.json", plan_report({s: s < 6 for s in range(13)}))  # seed 12: A lacks it
    out = tmp_path / "rows.json"
    assert bench.main([a, b, "--names", "even,low", "--json", str(out)]) == 0
    assert "12 seeds shared by every side; goals reached: even 6, low 6" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    moves = [r for r in rows if r["split"] == "block move"]
    turns = [r for r in rows if r["split"] == "block turn"]
    assert sum(r["tasks"] for r in moves) == 12
    assert sum(r["tasks"] for r in turns) == sum(move >= 1 for move, _ in demands.values())
    still = [s for s, (move, _) in demands.items() if move < 1]
    assert moves[0]["tasks"] == len(still) and moves[0]["reached"] == {
        "even": sum(s % 2 == 0 for s in still),
        "low": sum(s < 6 for s in still),
    }
    assert sum(r["reached"]["even"] for r in moves) == 6
    with pytest.raises(SystemExit):
        bench.main([a, b, "--names", "one"])
    assert "--names gives 1 names for 2 sides" in capsys.readouterr().err
