"""Two PushT evaluation reports compared seed by seed (`streamworld compare`).

Both kinds of report that `streamworld eval` writes can be compared:

- **planning** (`eval --plan`): each episode's outcome. Episodes are paired by seed; the
  pairs where exactly one side reached the goal decide. Their split is tested with the exact
  two-sided sign test (McNemar's exact test): the chance of a split at least that uneven if
  either side were as likely as the other to be the one that succeeds. The difference in
  success rate comes with a 95% bootstrap interval over the seeds: how large a gain or loss
  the seeds are consistent with, which a p value alone does not say.
- **prediction** (`eval`): each seed's block and agent errors, PSNR and T shape at the
  report horizons (the report's `per_seed`). Per KV mode and horizon: the means of both
  sides over the seeds where both found the object, the mean difference with a 95%
  bootstrap interval over the seeds (percentile, resampled with a fixed seed), and the
  sign test over the seeds where one side did better.

A side may be several reports, for example one run split over seed ranges. They are merged
when they evaluated the same thing (`PLAN_SETTINGS` / `PREDICTION_SETTINGS` equal) and no
seed appears twice. Sides that evaluated different tasks (`PAIRING_SETTINGS`) are refused:
their seeds are not the same episodes.
"""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# What bounds reading a side: its reports, each report's size, and their sizes together.
MAX_REPORTS = 256
MAX_REPORT_BYTES = 16 << 20
MAX_SIDE_BYTES = 128 << 20

# The settings that make reports of one side the same evaluation, and those both sides must
# share for their seeds to be the same tasks.
PLAN_SETTINGS = (
    "model",
    "weights",
    "prediction",
    "rollouts",
    "scene_model_sha256",
    "kv_mode",
    "timesteps",
    "ensemble",
    "goal_steps",
    "budget",
    "execute",
    "cost_frames",
    "proposals",
    "replan_error",
    "shape_weight",
    "warm_start",
    "cem",
)
# What a report written before a setting existed ran: that setting's only behaviour then.
UNWRITTEN_SETTINGS = {"warm_start": "mean"}
PREDICTION_SETTINGS = (
    "model",
    "weights",
    "prediction",
    "horizon",
    "frame_size",
    "timesteps",
    "t_shape_mismatch",
)
PAIRING_SETTINGS = {"plan": ("goal_steps", "budget"), "prediction": ("frame_size",)}

# Per-seed metrics of a prediction report, and whether a larger value is better.
HIGHER_IS_BETTER = {
    "block_px": False,
    "agent_px": False,
    "psnr": True,
    "block_t_shape": True,
    "block_deg": False,
}
# Metrics that reports before them lack; a comparison leaves out one that a side lacks.
ADDED_METRICS = frozenset({"block_deg"})
# Metrics that depend on when a block counts as a T (the report's `t_shape_mismatch`; absent
# before 2026-12-05, when the bound was 0.35); left out when the sides' bounds differ.
T_METRICS = frozenset({"block_t_shape", "block_deg"})
BOOTSTRAP_RESAMPLES = 10_000


class CompareError(ValueError):
    """A report that cannot be read or compared; the message says which and why."""


@dataclass
class Side:
    """One side of a comparison: its reports merged."""

    kind: str  # "plan" or "prediction"
    spec: str  # as given: files, separated by commas, or glob patterns
    paths: list[str]
    settings: dict  # the settings of its first report (all of its reports share them)
    by_seed: dict  # plan: seed -> episode; prediction: mode -> seed -> {metric: [per horizon]}
    horizons: list[int]  # prediction reports only
    metrics: set[str] = field(default_factory=lambda: set(HIGHER_IS_BETTER))  # those all its reports have


def expand(spec: str) -> list[Path]:
    """The report files of one side: paths separated by commas, each a file or a glob
    pattern (quoted, so that the shell leaves it alone)."""
    paths: list[Path] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if glob.has_magic(part):
            matched = sorted(glob.glob(part))
            if not matched:
                raise CompareError(f"{part}: no file matches")
            paths += [Path(m) for m in matched]
        else:
            paths.append(Path(part))
    if not paths:
        raise CompareError(f"{spec!r} names no report")
    if len(paths) > MAX_REPORTS:
        raise CompareError(f"{spec}: {len(paths)} reports, at most {MAX_REPORTS} a side")
    total = sum(p.stat().st_size for p in paths if p.is_file())
    if total > MAX_SIDE_BYTES:
        raise CompareError(f"{spec}: {total >> 20} MiB of reports, at most {MAX_SIDE_BYTES >> 20} MiB a side")
    return paths


def read_report(path: Path) -> dict:
    if not path.is_file():
        raise CompareError(f"{path}: no such file")
    if path.stat().st_size > MAX_REPORT_BYTES:
        raise CompareError(f"{path}: larger than {MAX_REPORT_BYTES >> 20} MiB; not an evaluation report")
    try:
        report = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompareError(f"{path}: not JSON ({e})") from None
    if not isinstance(report, dict):
        raise CompareError(f"{path}: not an evaluation report (a JSON object)")
    return report


def report_kind(report: dict, path: Path) -> str:
    if isinstance(report.get("episodes"), list) and "cem" in report:
        return "plan"
    if isinstance(report.get("modes"), dict):
        if "per_seed" not in report:
            raise CompareError(
                f"{path}: a prediction report without per-seed results (written before `eval` kept "
                "them); evaluate again to compare it"
            )
        return "prediction"
    raise CompareError(f"{path}: neither a planning nor a prediction report of `streamworld eval`")


def load_side(spec: str) -> Side:
    """The reports of `spec` (`expand`), checked and merged."""
    side: Side | None = None
    for path in expand(spec):
        report = read_report(path)
        kind = report_kind(report, path)
        names = PLAN_SETTINGS if kind == "plan" else (*PREDICTION_SETTINGS, "modes")
        settings = {k: report.get(k, UNWRITTEN_SETTINGS.get(k)) for k in names}
        if kind == "prediction":  # the predictors evaluated, not their means
            settings["modes"] = sorted(report["modes"])
        if side is None:
            side = Side(kind, spec, [], settings, {}, [])
        elif kind != side.kind:
            raise CompareError(f"{path}: a {kind} report, where {side.paths[0]} is a {side.kind} report")
        else:
            for k in names:
                if settings[k] != side.settings[k]:
                    raise CompareError(
                        f"{path}: {k} is {settings[k]!r}, where {side.paths[0]} has {side.settings[k]!r}; "
                        "the reports of one side must be one evaluation"
                    )
        side.paths.append(str(path))
        if kind == "plan":
            _merge_episodes(side, report, path)
        else:
            _merge_per_seed(side, report, path)
    assert side is not None
    return side


def _merge_episodes(side: Side, report: dict, path: Path) -> None:
    for episode in report["episodes"]:
        if (
            not isinstance(episode, dict)
            or not isinstance(episode.get("seed"), int)
            or not isinstance(episode.get("success"), bool)
            or _number(episode.get("steps")) is None
        ):
            raise CompareError(f"{path}: an episode without an integer seed, a success flag and its steps")
        seed = episode["seed"]
        if seed in side.by_seed:
            raise CompareError(f"{path}: seed {seed} appears twice in one side")
        side.by_seed[seed] = episode


def _merge_per_seed(side: Side, report: dict, path: Path) -> None:
    per_seed = report["per_seed"]
    try:
        seeds, horizons = list(per_seed["seeds"]), list(per_seed["horizons"])
    except (KeyError, TypeError):
        raise CompareError(f"{path}: per_seed has no seeds and horizons") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in seeds + horizons):
        raise CompareError(f"{path}: per_seed's seeds and horizons must be integers")
    if len(set(horizons)) != len(horizons) or len(set(seeds)) != len(seeds):
        raise CompareError(f"{path}: per_seed names a seed or a horizon twice")
    if side.horizons and horizons != side.horizons:
        raise CompareError(f"{path}: per-seed horizons {horizons}, where {side.paths[0]} has {side.horizons}")
    side.horizons = horizons
    for mode in report["modes"]:
        rows = per_seed.get(mode)
        if not isinstance(rows, dict):
            raise CompareError(f"{path}: per_seed has no results for {mode}")
        side.metrics &= set(HIGHER_IS_BETTER) - (ADDED_METRICS - rows.keys())
        table = side.by_seed.setdefault(mode, {})
        for i, seed in enumerate(seeds):
            if seed in table:
                raise CompareError(f"{path}: seed {seed} appears twice in one side")
            try:
                values = {metric: [_number(v) for v in _row(rows[metric][i])] for metric in side.metrics}
            except (KeyError, IndexError, TypeError):
                values = None
            if values is None or any(len(v) != len(horizons) for v in values.values()):
                raise CompareError(f"{path}: per_seed of {mode} misses seed {seed}'s results at some horizon")
            table[seed] = values


def _row(row) -> list:
    if not isinstance(row, list):
        raise TypeError("a per-seed row is a list")
    return row


def _number(value) -> float | None:
    """A per-seed value as a float: None for a missing one (null, or not finite)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def sign_test(wins: int, losses: int) -> float:
    """The exact two-sided sign test: the chance, when each decided pair goes either way with
    probability 1/2, of a split at least as uneven as `wins` to `losses` (1.0 for none)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap_interval(differences: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of `differences` (one per seed)."""
    if len(differences) < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    n, means = len(differences), []
    block = max(1, (1 << 22) // n)  # resamples drawn at once: about 32 MiB of indices
    for start in range(0, resamples, block):
        picks = rng.integers(0, n, size=(min(block, resamples - start), n))
        means.append(differences[picks].mean(axis=1))
    low, high = np.percentile(np.concatenate(means), [2.5, 97.5])
    return (float(low), float(high))


def compare(a: Side, b: Side, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict:
    """B against A, seed by seed. Differences are B minus A."""
    if a.kind != b.kind:
        raise CompareError(f"cannot compare a {a.kind} report with a {b.kind} report")
    for k in PAIRING_SETTINGS[a.kind]:
        if a.settings[k] != b.settings[k]:
            raise CompareError(
                f"the sides differ in {k} ({a.settings[k]!r} against {b.settings[k]!r}): their seeds are "
                "not the same tasks"
            )
    out = {
        "kind": a.kind,
        "a": {"spec": a.spec, "reports": a.paths, "settings": a.settings},
        "b": {"spec": b.spec, "reports": b.paths, "settings": b.settings},
    }
    if a.kind == "plan":
        out.update(_compare_plans(a, b, resamples, seed))
    else:
        common = [h for h in a.horizons if h in b.horizons]
        if not common:
            raise CompareError(f"the sides share no horizon ({a.horizons} against {b.horizons})")
        out.update(_compare_predictions(a, b, common, resamples, seed))
    return out


def _paired_seeds(a: dict, b: dict) -> tuple[list[int], dict]:
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise CompareError("the two sides share no seed")
    return seeds, {"only_a": len(set(a) - set(b)), "only_b": len(set(b) - set(a))}


def _compare_plans(a: Side, b: Side, resamples: int, seed: int) -> dict:
    seeds, unpaired = _paired_seeds(a.by_seed, b.by_seed)
    both = [s for s in seeds if a.by_seed[s]["success"] and b.by_seed[s]["success"]]
    only_a = [s for s in seeds if a.by_seed[s]["success"] and not b.by_seed[s]["success"]]
    only_b = [s for s in seeds if b.by_seed[s]["success"] and not a.by_seed[s]["success"]]
    steps = np.array([b.by_seed[s]["steps"] - a.by_seed[s]["steps"] for s in both], dtype=float)
    # Per seed: +1 where B alone reached the goal, -1 where A alone did, 0 otherwise.
    gained = np.array([bool(b.by_seed[s]["success"]) - bool(a.by_seed[s]["success"]) for s in seeds], float)
    low, high = bootstrap_interval(gained, resamples, seed)
    return {
        "success_difference": float(gained.mean()),
        "success_difference_interval": None if math.isnan(low) else [low, high],  # None: one seed
        "seeds": len(seeds),
        "unpaired_seeds": unpaired,
        "success_a": len(both) + len(only_a),
        "success_b": len(both) + len(only_b),
        "both": len(both),
        "neither": len(seeds) - len(both) - len(only_a) - len(only_b),
        "only_a": only_a,
        "only_b": only_b,
        "p": sign_test(len(only_b), len(only_a)),
        "steps_difference_when_both": float(steps.mean()) if len(steps) else None,
    }


def _compare_predictions(a: Side, b: Side, horizons: list[int], resamples: int, seed: int) -> dict:
    modes = [m for m in a.by_seed if m in b.by_seed]
    if not modes:
        raise CompareError(
            f"the sides share no KV mode ({', '.join(a.by_seed)} against {', '.join(b.by_seed)})"
        )
    # Within a side every mode holds the same seeds, so the first mode's pairing is every mode's.
    seeds, unpaired = _paired_seeds(a.by_seed[modes[0]], b.by_seed[modes[0]])
    bound = "t_shape_mismatch"
    other_bound = sorted(T_METRICS & a.metrics & b.metrics) if a.settings[bound] != b.settings[bound] else []
    results: dict = {}
    for mode in modes:
        ta, tb = a.by_seed[mode], b.by_seed[mode]
        results[mode] = {}
        for metric, higher in HIGHER_IS_BETTER.items():
            if metric not in a.metrics or metric not in b.metrics or metric in other_bound:
                continue
            rows = []
            for h in horizons:
                ia, ib = a.horizons.index(h), b.horizons.index(h)
                pairs = [(ta[s][metric][ia], tb[s][metric][ib]) for s in seeds]
                rows.append(_paired_metric(pairs, higher, resamples, seed))
            results[mode][metric] = rows
    return {
        "seeds": len(seeds),
        "unpaired_seeds": unpaired,
        "horizons": horizons,
        "left_out": {
            "modes_only_a": [m for m in a.by_seed if m not in b.by_seed],
            "modes_only_b": [m for m in b.by_seed if m not in a.by_seed],
            "horizons_only_a": [h for h in a.horizons if h not in horizons],
            "horizons_only_b": [h for h in b.horizons if h not in horizons],
            "metrics_only_a": sorted(a.metrics - b.metrics),
            "metrics_only_b": sorted(b.metrics - a.metrics),
            "metrics_other_t_bound": other_bound,
        },
        "modes": results,
    }


def _paired_metric(pairs: list[tuple], higher_is_better: bool, resamples: int, seed: int) -> dict:
    """One metric at one horizon over the seeds: means, the mean difference B - A with its
    interval, and the sign test over the seeds that one side did better on. Seeds without a
    value on a side (the object not found there, or in the true frame) are left out and
    counted by side, with the sign test of which side lost more."""
    kept = [(x, y) for x, y in pairs if x is not None and y is not None]
    lost_a = sum(1 for x, y in pairs if x is None and y is not None)
    lost_b = sum(1 for x, y in pairs if y is None and x is not None)
    x = np.array([p[0] for p in kept], dtype=float)
    y = np.array([p[1] for p in kept], dtype=float)
    d = y - x
    b_better = int(np.sum(d > 0) if higher_is_better else np.sum(d < 0))
    a_better = int(np.sum(d < 0) if higher_is_better else np.sum(d > 0))
    low, high = bootstrap_interval(d, resamples, seed) if len(kept) else (math.nan, math.nan)
    return {
        "seeds": len(kept),
        "missing": {"a_only": lost_a, "b_only": lost_b, "both": len(pairs) - len(kept) - lost_a - lost_b},
        "missing_p": sign_test(lost_a, lost_b),
        "mean_a": float(x.mean()) if len(kept) else None,
        "mean_b": float(y.mean()) if len(kept) else None,
        "difference": float(d.mean()) if len(kept) else None,
        "interval": None if math.isnan(low) else [low, high],
        "b_better": b_better,
        "a_better": a_better,
        "p": sign_test(b_better, a_better),
    }


def _side_line(side: dict) -> str:
    count = len(side["reports"])
    return side["spec"] if count == 1 else f"{side['spec']} ({count} reports)"


def _p(value: float) -> str:
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}"


METRIC_LABELS = {
    "block_px": "block error (px)",
    "agent_px": "agent error (px)",
    "psnr": "PSNR (dB)",
    "block_t_shape": "block is a T (share)",
    "block_deg": "block angle error, T only (deg)",
}
LEFT_OUT_LABELS = (
    ("modes_only_a", "modes only in A"),
    ("modes_only_b", "modes only in B"),
    ("horizons_only_a", "horizons only in A"),
    ("horizons_only_b", "horizons only in B"),
    ("metrics_only_a", "metrics only in A (the other's reports predate them)"),
    ("metrics_only_b", "metrics only in B (the other's reports predate them)"),
    (
        "metrics_other_t_bound",
        "metrics measured with another bound for a T (0.35 before 2026-12-05)",
    ),
)


def format_comparison(
    result: dict, metrics: tuple[str, ...] = ("block_px", "block_t_shape", "block_deg", "psnr")
) -> str:
    """The comparison as text: which reports, the seeds paired, and a Markdown table."""
    lines = [f"{name}: {_side_line(result[name.lower()])}" for name in ("A", "B")]
    unpaired = result["unpaired_seeds"]
    paired = f"{result['seeds']} seeds in both"
    if unpaired["only_a"] or unpaired["only_b"]:
        paired += f" (left out: {unpaired['only_a']} only in A, {unpaired['only_b']} only in B)"
    lines.append(paired)
    if result["kind"] == "plan":
        return "\n".join([*lines, "", *_plan_table(result)])
    left_out = result["left_out"]
    lines += [
        f"left out, {what}: {', '.join(map(str, left_out[key]))}"
        for key, what in LEFT_OUT_LABELS
        if left_out[key]
    ]
    return "\n".join([*lines, "", *_prediction_table(result, metrics)])


def _plan_table(result: dict) -> list[str]:
    n = result["seeds"]
    lines = [
        "| goals reached | A | B | both | A only | B only | neither | p (exact sign test) |",
        "|---|---|---|---|---|---|---|---|",
        f"| of {n} | {result['success_a']} ({result['success_a'] / n:.0%}) | "
        f"{result['success_b']} ({result['success_b'] / n:.0%}) | {result['both']} | "
        f"{len(result['only_a'])} | {len(result['only_b'])} | {result['neither']} | {_p(result['p'])} |",
    ]
    if result["success_difference_interval"] is not None:
        low, high = result["success_difference_interval"]
        lines.append(
            f"\nsuccess rate, B - A: {_points(result['success_difference'])} points "
            f"(95% interval {_points(low)} to {_points(high)}, bootstrap over the seeds)"
        )
    if result["steps_difference_when_both"] is not None:
        steps = round(result["steps_difference_when_both"], 1) + 0.0  # no "-0.0"
        lines.append(f"\nsteps to the goal, B - A, over the goals both reached: {steps:+.1f}")
    return lines


def _points(share: float) -> str:
    """A difference of two success rates in percentage points, signed, without "-0.0"."""
    return f"{round(100 * share, 1) + 0.0:+.1f}"


def _prediction_table(result: dict, metrics: tuple[str, ...]) -> list[str]:
    lines = [
        "| mode | metric | h | seeds | A | B | B - A (95% interval) | B better / A better | p (sign test) "
        "| not found: in A only / in B only (p) / in both |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, per_metric in result["modes"].items():
        for metric in (m for m in metrics if m in per_metric):  # both sides have it
            for h, row in zip(result["horizons"], per_metric[metric], strict=True):
                lines.append(f"| {mode} | {METRIC_LABELS[metric]} | {h} | {_prediction_cells(row)} |")
    return lines


def _prediction_cells(row: dict) -> str:
    """One `_paired_metric` row's cells after the horizon."""
    lost = row["missing"]
    found = ""
    if any(lost.values()):
        found = f"{lost['a_only']} / {lost['b_only']} ({_p(row['missing_p'])}) / {lost['both']}"
    if row["mean_a"] is None:
        return f"0 | n/a | n/a | | | | {found}"
    interval = "" if row["interval"] is None else f" ({row['interval'][0]:+.2f}, {row['interval'][1]:+.2f})"
    return (
        f"{row['seeds']} | {row['mean_a']:.2f} | {row['mean_b']:.2f} | {row['difference']:+.2f}{interval} | "
        f"{row['b_better']} / {row['a_better']} | {_p(row['p'])} | {found}"
    )
