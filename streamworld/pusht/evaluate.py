"""Evaluating the PushT world model against the real environment (`streamworld eval pusht`).

For every seed: reset the environment to that seed's initial state, drive it with the
scripted policy for `horizon` steps, and record the true frames and the actions. The model
gets the first frame and the same actions in lockstep (the sequential reference generator:
the definition the engine's output equals) and predicts the frames that follow. Per horizon
h (frames after the first), over all seeds:

- PSNR and SSIM of the prediction against the true frame, and of the copy-first-frame
  baseline (predicting that nothing moves);
- the distance, in frame pixels, between where the agent (and the T block) is in the true
  frame and in the predicted one, both located the same way (`world.locate`), with the
  baseline's error for comparison, and how often the model lost the object (not visible).
  The mean error is over the seeds where both frames show the object, so a model that
  loses the block where it is hardest to place lowers its mean: read it beside the share
  lost, and compare two models with `streamworld compare`, which pairs the seeds;
- at the horizons of `REPORT_HORIZONS`, how often the predicted block is still a T
  (`block_t_shape`): its fitted T's mismatch (`pose.fit_block`) is within
  `T_SHAPE_MISMATCH`. A block that blurs into a blob, or vanishes, is not;
- at those horizons, where the predicted block is a T, how far its fitted angle is from the
  true block's (`block_angle_deg`, degrees), beside how far the true block has turned since
  the first frame (the copy baseline's angle error). Turning the block is what planning
  through the model fails at most (`docs/planning.md`).

The report keeps each seed's block and agent errors, PSNR, T shape and block angle at those horizons
(`per_seed`), so that `streamworld compare` can test two reports seed by seed.

With `teacher_forced`, one more predictor, `teacher-forced`: every chunk is predicted from
the true past (`clean` mode, each chunk's K/V committed from the true frames instead of the
prediction). Its error is the model's error one chunk ahead; the free-running modes' error
beyond it is drift, the model building on its own mistakes. Its block error is also split
by what the block does during the chunk (`motion_breakdown`): still where it started, still
after an earlier push, or moving, each beside the error of copying the last true frame
before the chunk (predicting that nothing moves from there).

Evaluation seeds are the environment's seeds themselves; training episodes use seeds from
`data.TRAIN_SEED_BASE` on, so no evaluation scene was seen in training.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..engine import GenerationRequest, ReferenceGenerator
from ..models.config import ModelConfig
from ..models.pixels import frames_from_uint8, frames_to_latents
from ..models.world_model import WorldModel
from .policy import ScriptedPolicy
from .pose import fit_block
from .world import PushTWorld, angle_error, locate

# The policy seed of evaluation episode `seed` (disjoint from the training data's).
POLICY_SEED_OFFSET = 500_000
REPORT_HORIZONS = (1, 2, 4, 8, 16, 24, 32)
# The largest mismatch of a fitted T (`pose.fit_block`) at which a predicted block counts as
# a T. True frames stay below it (399 of 400, seeds 0-99 at h = 8, 16, 24, 32); predicted
# blocks fall into sharp T's (mostly below 0.15, angle right within 2 degrees) and blobs
# (0.25 and up, whose fitted angle is off by 26-106 degrees at the median). Reports before
# 2026-12-05 used `pose.MAX_MISMATCH` (0.35), which counted many blobs as T's.
T_SHAPE_MISMATCH = 0.2
# The metrics the report also keeps per seed (`per_seed`), at the report horizons.
PER_SEED_METRICS = ("block_px", "agent_px", "psnr")


# Classes of the block's motion over one chunk (`motion_breakdown`): its move over the chunk
# and its distance from where it started, in frame pixels, against this bound.
STILL_PX = 0.5
MOVE_CLASSES = ("still, where it started", "still, pushed earlier", "moving < 4 px", "moving >= 4 px")


def parse_seeds(text: str) -> list[int]:
    """'0-99', '3', '1,5,9' or '0-9,20-29' -> a sorted list of distinct seeds."""
    seeds: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"bad seed range {part!r}: use e.g. 0-99 or 1,5,9") from None
        if a < 0 or b < a:
            raise ValueError(f"bad seed range {part!r}: use e.g. 0-99 or 1,5,9")
        seeds.update(range(a, b + 1))
    if not seeds:
        raise ValueError("no seeds given")
    if max(seeds) >= POLICY_SEED_OFFSET:
        raise ValueError(
            f"evaluation seeds must be below {POLICY_SEED_OFFSET} (higher ones overlap the training data)"
        )
    return sorted(seeds)


@dataclass
class Episode:
    seed: int
    frames: np.ndarray  # uint8 [horizon + 1, S, S, 3]: frame 0 and the true future
    actions: np.ndarray  # float32 [horizon, 2]
    angles: np.ndarray  # float64 [horizon + 1]: the block's true angle (radians) in each frame


def record_eval_episode(seed: int, horizon: int, size: int) -> Episode:
    world = PushTWorld(size)
    policy = ScriptedPolicy(seed + POLICY_SEED_OFFSET)
    frames = [world.reset(seed)]
    actions, angles = [], [world.scene.block[2]]
    for _ in range(horizon):
        actions.append(policy(world.scene))
        frames.append(world.step(actions[-1]))
        angles.append(world.scene.block[2])
    world.close()
    return Episode(seed, np.stack(frames), np.asarray(actions, np.float32), np.asarray(angles, np.float64))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def _gaussian_window(size: int = 7, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :]).expand(3, 1, size, size).contiguous()


_WINDOW = _gaussian_window()


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of two RGB uint8 images (Gaussian window 7, sigma 1.5, per channel, valid region)."""
    x = torch.from_numpy(a).double().permute(2, 0, 1)[None]
    y = torch.from_numpy(b).double().permute(2, 0, 1)[None]
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, _WINDOW, groups=3)

    mx, my = blur(x), blur(y)
    sxx = blur(x * x) - mx * mx
    syy = blur(y * y) - my * my
    sxy = blur(x * y) - mx * my
    value = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return float(value.mean())


def _distance(p: tuple[float, float] | None, q: tuple[float, float] | None) -> float:
    if p is None or q is None:
        return float("nan")
    return float(math.hypot(p[0] - q[0], p[1] - q[1]))


def _nanmean(values: list[float]) -> float:
    """Mean of the finite values; nan when none is (an object never visible)."""
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


def frame_metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    lp, lt = locate(pred), locate(true)
    return {
        "psnr": psnr(pred, true),
        "ssim": ssim(pred, true),
        "agent_px": _distance(lp.agent, lt.agent),
        "block_px": _distance(lp.block, lt.block),
        "agent_lost": float(lt.agent is not None and lp.agent is None),
        "block_lost": float(lt.block is not None and lp.block is None),
    }


def block_angle(frame: np.ndarray) -> float:
    """The angle (radians) of the frame's block where it is visible and fits a T
    (`pose.fit_block`, within `T_SHAPE_MISMATCH`), else nan."""
    fit = fit_block(frame)
    return fit[0][2] if fit is not None and fit[1] <= T_SHAPE_MISMATCH else math.nan


def block_scores(pred: np.ndarray, ep: Episode, horizons: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Per horizon h, the block's position error (px, the locator's) and angle error (degrees;
    nan where the predicted block is no T) of `pred[h - 1]` against the episode's frame h:
    how the benchmarks that replace the model (the physics, a scene model) score their frames."""
    out = {}
    for h in horizons:
        out[h] = {
            "block_px": _distance(locate(pred[h - 1]).block, locate(ep.frames[h]).block),
            "block_deg": angle_error(block_angle(pred[h - 1]), ep.angles[h]),
        }
    return out


def block_summary(rows: list[dict[int, dict[str, float]]], horizons: tuple[int, ...]) -> dict[str, dict]:
    """Per horizon of `block_scores` rows (one per seed): the mean and median block error
    and the median angle error, over the seeds where each is finite (None where none is)."""

    def stat(f, key: str, h: int) -> float | None:
        finite = [r[h][key] for r in rows if not math.isnan(r[h][key])]
        return round(float(f(finite)), 3) if finite else None

    return {
        str(h): {
            "block_px_mean": stat(np.mean, "block_px", h),
            "block_px_median": stat(np.median, "block_px", h),
            "block_deg_median": stat(np.median, "block_deg", h),
        }
        for h in horizons
    }


@dataclass
class _Predictor:
    """What one predictor (a KV mode, or teacher-forced) scored over the seeds."""

    rows: list[list[dict[str, float]]] = field(default_factory=list)  # per seed, per horizon
    seconds: float = 0.0
    # horizon -> per seed, the block's angle error (degrees), nan where the block is no T
    angles: dict[int, list[float]] = field(default_factory=dict)
    motion: list[tuple[str, float, float]] = field(default_factory=list)  # `chunk_motion` rows

    def is_t(self, h: int) -> list[bool]:
        """Per seed, whether the predicted block is a T at horizon `h`."""
        return [not math.isnan(a) for a in self.angles[h]]


def evaluate(
    model: WorldModel,
    seeds: list[int],
    kv_modes: list[str],
    horizon: int = 32,
    noise_seed: int = 0,
    progress: bool = True,
    teacher_forced: bool = False,
) -> dict:
    """Per-horizon metrics of the model in each KV mode (and teacher-forced) and of the
    copy-first-frame baseline."""
    from tqdm import tqdm

    cfg = model.config
    if cfg.environment != "pusht" or cfg.action_dim != 2:
        raise ValueError(f"model {cfg.id} is not a PushT model")
    fpc = cfg.frames_per_chunk
    num_chunks = math.ceil(horizon / fpc)
    generator = ReferenceGenerator(model)
    names = list(kv_modes) + (["teacher-forced"] if teacher_forced else [])
    shape_horizons = [h for h in REPORT_HORIZONS if h <= horizon]
    predictors = {name: _Predictor(angles={h: [] for h in shape_horizons}) for name in names}
    baseline: list[list[dict[str, float]]] = []
    turned: dict[int, list[float]] = {h: [] for h in shape_horizons}  # the copy baseline's angle error
    bar = tqdm(total=len(seeds) * len(names), desc="evaluating pusht", unit="rollout", disable=not progress)
    for seed in seeds:
        ep = record_eval_episode(seed, num_chunks * fpc, cfg.height)
        baseline.append([frame_metrics(ep.frames[0], ep.frames[h]) for h in range(1, horizon + 1)])
        for h in shape_horizons:
            turned[h].append(angle_error(ep.angles[0], ep.angles[h]))
        for name, scored in predictors.items():
            start = time.perf_counter()
            pred = predict_episode(generator, ep, name, num_chunks, noise_seed)  # [T, S, S, 3]: frames 1..
            scored.seconds += time.perf_counter() - start
            scored.rows.append([frame_metrics(pred[h - 1], ep.frames[h]) for h in range(1, horizon + 1)])
            for h in shape_horizons:
                scored.angles[h].append(angle_error(block_angle(pred[h - 1]), ep.angles[h]))
            if name == "teacher-forced":
                scored.motion += chunk_motion(ep, scored.rows[-1], fpc, horizon)
            bar.update()
    bar.close()
    return _report(
        cfg, seeds, horizon, baseline, predictors, turned, frames_made=len(seeds) * num_chunks * fpc
    )


def _report(
    cfg: ModelConfig,
    seeds: list[int],
    horizon: int,
    baseline: list,
    predictors: dict[str, _Predictor],
    turned: dict[int, list[float]],
    frames_made: int,
) -> dict:
    """`evaluate`'s report: per-horizon means, T shapes and angles, speed, and the
    teacher-forced split."""
    forced = predictors.get("teacher-forced")

    def means(by_horizon: dict[int, list[float]]) -> dict[str, float | None]:
        """Per horizon, the mean over the seeds with a value; None (JSON null) where none has
        one (no predicted block is a T there)."""
        return {str(h): _finite_or_none(_nanmean(v)) for h, v in by_horizon.items()}

    return {
        "model": cfg.id,
        "seeds": [seeds[0], seeds[-1]] if seeds == list(range(seeds[0], seeds[-1] + 1)) else seeds,
        "num_seeds": len(seeds),
        "horizon": horizon,
        "frame_size": cfg.height,
        "denoising_steps": cfg.num_steps,
        "timesteps": list(cfg.denoising_steps),
        "t_shape_mismatch": T_SHAPE_MISMATCH,
        "baseline": _summarise(baseline, horizon),
        "modes": {name: _summarise(p.rows, horizon) for name, p in predictors.items()},
        "block_t_shape": {
            name: {str(h): round(float(np.mean(p.is_t(h))), 4) for h in p.angles}
            for name, p in predictors.items()
        },
        # Mean over the seeds where the predicted block is a T (the baseline: every seed).
        "block_angle_deg": {
            "copy first frame": means(turned),
            **{name: means(p.angles) for name, p in predictors.items()},
        },
        "generation_fps": {name: round(frames_made / p.seconds, 1) for name, p in predictors.items()},
        "per_seed": _per_seed(seeds, horizon, predictors),
        **({"teacher_forced_by_motion": motion_breakdown(forced.motion)} if forced is not None else {}),
    }


def _per_seed(seeds: list[int], horizon: int, predictors: dict[str, _Predictor]) -> dict:
    """Each seed's own results at the report horizons, for paired comparisons of two reports
    (`streamworld compare`): per predictor, per metric of `PER_SEED_METRICS`, one row per
    seed, one value per horizon (null where the object was not found), the block's angle
    error (`block_deg`, null where it is no T), and whether the block is a T."""
    hs = [h for h in REPORT_HORIZONS if h <= horizon]
    out: dict = {"seeds": list(seeds), "horizons": hs}
    for name, p in predictors.items():
        out[name] = {
            key: [[_finite_or_none(r[h - 1][key]) for h in hs] for r in p.rows] for key in PER_SEED_METRICS
        }
        out[name]["block_deg"] = [[_finite_or_none(p.angles[h][i]) for h in hs] for i in range(len(seeds))]
        shapes = {h: p.is_t(h) for h in hs}
        out[name]["block_t_shape"] = [[shapes[h][i] for h in hs] for i in range(len(seeds))]
    return out


def _finite_or_none(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def chunk_motion(
    ep: Episode, metrics: list[dict[str, float]], fpc: int, horizon: int
) -> list[tuple[str, float, float]]:
    """For each chunk's last frame h (up to `horizon`): the class of the block's motion over
    the chunk (`MOVE_CLASSES`), the predicted block's error (`metrics[h - 1]`, the prediction's
    `frame_metrics` per horizon), and the error of the last true frame before the chunk
    (frame h - fpc) as a prediction; in frame pixels. Chunks where the block is not found
    in one of those frames or in the first are left out."""
    ends = range(fpc, horizon + 1, fpc)
    blocks = {h: locate(ep.frames[h]).block for h in (0, *ends)}  # each true frame located once
    start = blocks[0]
    rows = []
    for h in ends:
        true, before, error = blocks[h], blocks[h - fpc], metrics[h - 1]["block_px"]
        if None in (start, true, before) or math.isnan(error):
            continue
        moved = _distance(before, true)
        if moved >= STILL_PX:
            kind = MOVE_CLASSES[2] if moved < 4 else MOVE_CLASSES[3]
        else:
            kind = MOVE_CLASSES[0] if _distance(start, true) <= STILL_PX else MOVE_CLASSES[1]
        rows.append((kind, error, moved))
    return rows


def motion_breakdown(rows: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Per motion class, and over all: chunks, the model's mean block error, and the mean
    error of copying the last true frame before the chunk."""
    out = {}
    for kind in (*MOVE_CLASSES, "all"):
        picked = [r for r in rows if kind in ("all", r[0])]
        out[kind] = {
            "chunks": len(picked),
            "model_px": round(_nanmean([r[1] for r in picked]), 3),
            "copy_last_px": round(_nanmean([r[2] for r in picked]), 3),
        }
    return out


def motion_table(report: dict) -> str:
    """`teacher_forced_by_motion` as a Markdown table."""
    lines = [
        "| block over the chunk (teacher-forced) | chunks | model block error (px) "
        "| copy last true frame (px) |",
        "|---|---|---|---|",
    ]
    for kind, v in report["teacher_forced_by_motion"].items():
        lines.append(
            f"| {kind} | {v['chunks']} | {_cell(v['model_px'], 2)} | {_cell(v['copy_last_px'], 2)} |"
        )
    return "\n".join(lines)


def _summarise(per_seed: list[list[dict[str, float]]], horizon: int) -> dict[str, list[float]]:
    """Per metric, its mean over the seeds at each horizon."""
    keys = per_seed[0][0].keys()
    return {k: [round(_nanmean([s[h][k] for s in per_seed]), 4) for h in range(horizon)] for k in keys}


def predict_episode(
    generator: ReferenceGenerator, ep: Episode, mode: str, num_chunks: int, noise_seed: int
) -> np.ndarray:
    """The frames after the first that `mode` (a KV mode, or teacher-forced) predicts."""
    forced = mode == "teacher-forced"
    request = GenerationRequest(
        seed=noise_seed,
        num_chunks=num_chunks,
        image=ep.frames[0],
        actions=ep.actions,
        kv_mode="clean" if forced else mode,
        context_latents=true_latents(generator.model, ep.frames) if forced else None,
    )
    return generator.generate(request).frames


def true_latents(model: WorldModel, frames: np.ndarray) -> torch.Tensor:
    """The latents of an episode's frames after the first (uint8 [T + 1, S, S, 3]), as the
    model reads them: [C, T, S, S]."""
    video = frames_from_uint8(torch.from_numpy(np.ascontiguousarray(frames))[None])
    return frames_to_latents(video, model.config.anchored_pixels)[0, :, 1:]


def _cell(value: float | None, digits: int) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(report: dict, horizons: tuple[int, ...] = REPORT_HORIZONS) -> str:
    """The report as a Markdown table: one row per (predictor, horizon)."""
    hs = [h for h in horizons if h <= report["horizon"]]
    lines = [
        "| predictor | metric | " + " | ".join(f"h={h}" for h in hs) + " |",
        "|---|---|" + "---|" * len(hs),
    ]
    metrics = [
        ("psnr", "PSNR (dB)", 2),
        ("ssim", "SSIM", 3),
        ("agent_px", "agent error (px)", 2),
        ("block_px", "block error (px)", 2),
        ("agent_lost", "agent lost (share)", 2),
        ("block_lost", "block lost (share)", 2),
    ]
    predictors = [("copy first frame", report["baseline"])] + [
        (f"model, {m}", v) for m, v in report["modes"].items()
    ]
    for name, values in predictors:
        for key, label, digits in metrics:
            if name == "copy first frame" and key in ("agent_lost", "block_lost"):
                continue
            cells = [_cell(values[key][h - 1], digits) for h in hs]
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    for mode, shares in report.get("block_t_shape", {}).items():
        cells = [_cell(shares.get(str(h), math.nan), 2) for h in hs]
        lines.append(f"| model, {mode} | block is a T (share) | " + " | ".join(cells) + " |")
    for name, angles in report.get("block_angle_deg", {}).items():
        cells = " | ".join(_cell(angles.get(str(h), math.nan), 1) for h in hs)
        if name == "copy first frame":
            lines.append(f"| {name} | block turned since frame 0 (deg) | {cells} |")
        else:
            lines.append(f"| model, {name} | block angle error, T only (deg) | {cells} |")
    return "\n".join(lines)
