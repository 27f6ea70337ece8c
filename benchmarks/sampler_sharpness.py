"""Does a better sampler keep a pushed PushT block a T? The served sampler against a
deterministic one, with more steps reaching lower noise.

The PushT model predicts a pushed block as a blurred blob (`docs/pusht.md`, Evaluation).
A model trained with a squared error predicts, from much noise, the mean of the outcomes it
cannot tell apart, and that mean is a blur; a diffusion sampler is meant to resolve it
step by step. This benchmark asks whether the blob is the sampler's or the model's:

- `renoise:STEPS`: the served sampler (CausVid's; `models/schedule.py`): each step's input
  is the last step's clean estimate noised afresh to the step's level. `renoise:1000` is
  the one step that planning serves; a list reaching 10 ends at 1% noise.
- `ddim:STEPS`: the deterministic (DDIM, Euler) sampler: each step's input keeps the noise
  the last step's input held, so no noise is drawn after the first step and the estimate
  is refined rather than replaced. It carries state across steps, which the engine's units
  do not, so it lives here, run through the reference generator.
- `snap:STEPS`: the served sampler, but each chunk's clean K/V (and the frame a delta
  model adds its next chunk to) is committed from the chunk's frames redrawn by the
  environment: the agent and the block's whole pose fitted to each predicted frame
  (`pose.estimate_scene`, whatever its mismatch) and rendered as a sharp scene. The scored frames are
  still the model's own. It asks whether a blob hides a pose the model knows: if it did,
  a sharp context would keep the block a T at the right angle.

For each of `eval`'s episodes (the scripted policy from each seed's start, as `streamworld
eval` scores them) and each sampler, free-running from the first frame in `--kv-mode`, at
8, 16 and 32 frames: the block's position error (the locator's, px), the share of
rollouts whose block is a sharp T (`pose.fit_block` within `evaluate.T_SHAPE_MISMATCH`),
that share among the rollouts whose true block moved more than 1 px since the first
frame, and the angle error where the block is a T.

It also asks whether the planner's cost could read a blob's angle without a T fit: the
block's weight map's third central moments (their first circular harmonic) give the
angle of a sharp T, calibrated here on the true frames, and blurring by any symmetric
kernel leaves them unchanged. `moment_angle_error` is that angle's error on the predicted
blocks whose true block turned 5 degrees or more, beside how far the true block turned
since the first frame (copying the first frame's angle errs that much).

    python benchmarks/sampler_sharpness.py --seeds 0-49 --json sampler_sharpness.json

About 15 minutes on a 2-core CPU with the default samplers and seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from streamworld.engine import ReferenceGenerator
from streamworld.models import get_preset
from streamworld.models.pixels import frames_from_uint8
from streamworld.models.vae import to_uint8
from streamworld.pusht.evaluate import (
    block_angle,
    parse_seeds,
    predict_episode,
    record_eval_episode,
    true_latents,
)
from streamworld.pusht.pose import draw_scene, estimate_scene
from streamworld.pusht.world import PushTWorld, angle_error, locate, palette_weights

HORIZONS = (8, 16, 32)
DEFAULT_SAMPLERS = (
    "renoise:1000",
    "renoise:1000,500,200,100,50,20,10",
    "ddim:1000,875,750,625,500,375,250,125",
    "ddim:" + ",".join(str(1000 - 50 * i) for i in range(20)),
)
MOVED_PX = 1.0  # a block "moved" when its true centroid is this far from frame 0's
TURNED_DEG = 5.0  # the moment angle is scored where the true block turned at least this


class DeterministicSchedule:
    """A `FlowSchedule` whose steps after the first keep the noise of the step before
    (DDIM with eta 0): x' = (1 - s') x0 + s' e, e = (x - (1 - s) x0) / s, where x was the
    last step's input at level s. Steps run in order, one chunk at a time (the reference
    generator's order); it remembers the last input."""

    def __init__(self, schedule) -> None:
        self._schedule, self._last = schedule, None

    def __getattr__(self, name: str):
        return getattr(self._schedule, name)

    def step_input(self, seed, chunk, step, x0_prev, shape, device) -> torch.Tensor:
        s = self._schedule
        if step == 0:
            x = s.step_input(seed, chunk, 0, None, shape, device)
        else:
            before, now = s.sigma(s.timesteps[step - 1]), s.sigma(s.timesteps[step])
            eps = (self._last - (1.0 - before) * x0_prev) / before
            x = (1.0 - now) * x0_prev + now * eps
        self._last = x
        return x


class SnappingGenerator(ReferenceGenerator):
    """The reference generator whose clean commits are the chunk's frames redrawn from the
    scene fitted to each of them (`snap:`): the agent's position and the block's whole pose
    (`pose.estimate_scene`, any mismatch), drawn by the environment. Frames where the agent
    or the block is not found are committed as predicted. Anchored pixel models only (the
    PushT presets). Each chunk is denoised twice, once to predict it and once more to commit
    the redrawn frames (the reference loop commits inside its denoising call)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        if not model.config.anchored_pixels:
            raise ValueError("snap: needs a model in anchored pixels (the PushT presets)")
        self.world = PushTWorld(model.config.height)
        self.world.reset(0)
        self.snapped = self.kept = 0
        self._anchor: np.ndarray | None = None
        self._last: torch.Tensor | None = None

    def generate(self, req):
        self._anchor, self._last = req.image, None
        return super().generate(req)

    def denoise_chunk(
        self,
        seed,
        chunk,
        first_frame,
        text,
        cache,
        kv_mode,
        actions,
        context=None,
        last=None,
        read_later=True,
    ):
        if context is not None:
            raise ValueError("snap: commits redrawn frames, not a given context")
        last = self._last if self._last is not None else last
        x0 = super().denoise_chunk(seed, chunk, first_frame, text, cache, kv_mode, actions, None, last, False)
        anchor = frames_from_uint8(torch.from_numpy(self._anchor)[None, None])
        frames = to_uint8(x0.cpu()[None] + anchor)[0]
        redrawn = np.concatenate([self._anchor[None], [self._redraw(f) for f in frames]])
        latents = true_latents(self.model, redrawn).to(x0.device, x0.dtype)
        if read_later:
            super().denoise_chunk(
                seed, chunk, first_frame, text, cache, kv_mode, actions, latents, last, True
            )
        self._last = latents[:, -1:]
        return x0

    def _redraw(self, frame: np.ndarray) -> np.ndarray:
        scene = estimate_scene(frame, max_mismatch=math.inf)  # any blob is fitted
        if scene is None:
            self.kept += 1
            return frame
        self.snapped += 1
        return draw_scene(self.world, scene)


def parse_sampler(text: str) -> tuple[str, tuple[float, ...]]:
    kind, sep, steps = text.partition(":")
    if kind not in ("renoise", "ddim", "snap") or not sep:
        raise argparse.ArgumentTypeError(
            f"a sampler is renoise:STEPS, ddim:STEPS or snap:STEPS, got {text!r}"
        )
    try:
        values = tuple(float(v) for v in steps.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps must be numbers separated by commas: {text!r}") from None
    return kind, values


def third_moment_angle(frame: np.ndarray) -> float:
    """The direction (radians, before calibration) of the first circular harmonic of the
    block weight map's third central moments; nan where no block weight is seen."""
    w = palette_weights(frame)[..., 2]
    mass = w.sum()
    if mass < 1.0:
        return math.nan
    ys, xs = np.mgrid[0 : w.shape[0], 0 : w.shape[1]] + 0.5
    u = xs - (w * xs).sum() / mass
    v = ys - (w * ys).sum() / mass
    r2 = u * u + v * v  # mu30 + mu12 and mu21 + mu03 are the moments of u r^2 and v r^2
    return math.atan2((w * v * r2).sum(), (w * u * r2).sum())


def calibrate(episodes) -> tuple[float, float, float]:
    """The offset of the moment angle from the true angle over every true frame, and the
    error left after it (mean, max; degrees)."""
    pairs = [(third_moment_angle(f), a) for ep in episodes for f, a in zip(ep.frames, ep.angles, strict=True)]
    diffs = np.array([m - a for m, a in pairs if not math.isnan(m)])
    if not len(diffs):
        raise ValueError("no true frame shows the block: nothing to calibrate the moment angle on")
    offset = float(np.angle(np.exp(1j * diffs).mean()))
    errors = [angle_error(m - offset, a) for m, a in pairs if not math.isnan(m)]
    return offset, float(np.mean(errors)), float(np.max(errors))


def load(args: argparse.Namespace, steps: tuple[float, ...]):
    from streamworld.cli.loading import LoadOptions, load_world_model
    from streamworld.models.world_model import WeightPaths

    config = dataclasses.replace(get_preset(args.model), denoising_steps=steps)
    return load_world_model(config, WeightPaths(dit=args.dit), LoadOptions(device="cpu", dtype="float32"))


def score(pred: np.ndarray, ep, offset: float) -> dict[int, dict]:
    """Per horizon, the rollout's block error, T, angle errors and whether the true block
    moved and turned."""
    rows = {}
    start = locate(ep.frames[0]).block
    for h in HORIZONS:
        p, t = locate(pred[h - 1]).block, locate(ep.frames[h]).block
        angle = block_angle(pred[h - 1])
        turned = angle_error(ep.angles[0], ep.angles[h])
        rows[h] = {
            "block_px": math.dist(p, t) if p and t else math.nan,
            "is_t": not math.isnan(angle),
            "angle_deg": angle_error(angle, ep.angles[h]),
            "moved": bool(start and t and math.dist(start, t) > MOVED_PX),
            "turned_deg": turned,
            "moment_deg": angle_error(third_moment_angle(pred[h - 1]) - offset, ep.angles[h]),
        }
    return rows


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return round(float(np.mean(finite)), 3) if finite else None


def _median(values: list[float]) -> float | None:
    """The median of the finite values, rounded; None where there are none (JSON has no nan)."""
    finite = [v for v in values if not math.isnan(v)]
    return round(float(np.median(finite)), 1) if finite else None


def summarise(rows: list[dict[int, dict]]) -> dict:
    out = {}
    for h in HORIZONS:
        r = [row[h] for row in rows]
        moved = [x for x in r if x["moved"]]
        turned = [x for x in r if x["turned_deg"] >= TURNED_DEG]
        t_angles = [x["angle_deg"] for x in r if x["is_t"]]
        out[str(h)] = {
            "block_px": _mean([x["block_px"] for x in r]),
            "t_share": round(float(np.mean([x["is_t"] for x in r])), 3),
            "moved": len(moved),
            "moved_t": sum(x["is_t"] for x in moved),
            "angle_deg_where_t": round(float(np.mean(t_angles)), 2) if t_angles else None,
            "turned": len(turned),
            "moment_angle_error_median": _median([x["moment_deg"] for x in turned]),
            "turned_since_start_median": (
                round(float(np.median([x["turned_deg"] for x in turned])), 1) if turned else None
            ),
        }
    return out


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    size = get_preset(args.model).height
    episodes = [record_eval_episode(seed, max(HORIZONS), size) for seed in args.seeds]
    offset, true_mean, true_max = calibrate(episodes)
    samplers = {}
    for kind, steps in args.samplers:
        model = load(args, steps)
        if kind == "ddim":
            model.schedule = DeterministicSchedule(model.schedule)
        generator = SnappingGenerator(model) if kind == "snap" else ReferenceGenerator(model)
        num_chunks = math.ceil(max(HORIZONS) / model.config.frames_per_chunk)
        rows, start = [], time.perf_counter()
        for ep in episodes:
            pred = predict_episode(generator, ep, args.kv_mode, num_chunks, args.noise_seed)
            rows.append(score(pred, ep, offset))
        name = f"{kind}:{','.join(f'{s:g}' for s in steps)}"
        samplers[name] = {
            "steps": len(steps),
            "seconds": round(time.perf_counter() - start, 1),
            "horizons": summarise(rows),
        }
        if kind == "snap":
            samplers[name]["frames_redrawn"] = generator.snapped
            samplers[name]["frames_kept"] = generator.kept
        print(name, json.dumps(samplers[name]["horizons"]), flush=True)
    return {
        "benchmark": "sampler_sharpness",
        "model": args.model,
        "weights": Path(args.dit).name if args.dit else "shipped",
        "kv_mode": args.kv_mode,
        "noise_seed": args.noise_seed,
        "seeds": [args.seeds[0], args.seeds[-1], len(args.seeds)],
        "moment_angle_on_true_frames": {
            "offset_deg": round(math.degrees(offset), 2),
            "error_mean_deg": round(true_mean, 2),
            "error_max_deg": round(true_max, 1),
        },
        "samplers": samplers,
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _degrees(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}°"


def table(report: dict) -> str:
    lines = [
        "| sampler | frames | block error (px) | sharp T | moved blocks a T | moment angle error (median) "
        "| true turn since frame 0 (median) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in report["samplers"].items():
        for h, r in s["horizons"].items():
            lines.append(
                f"| `{name}` | {h} | {_number(r['block_px'])} | {r['t_share']:.0%} "
                f"| {r['moved_t']} of {r['moved']} "
                f"| {_degrees(r['moment_angle_error_median'])} | {_degrees(r['turned_since_start_median'])} |"
            )
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="pusht-delta", choices=["pusht", "pusht-delta"], help="default pusht-delta"
    )
    parser.add_argument("--dit", help="weights instead of the shipped ones (a .safetensors file)")
    parser.add_argument(
        "--kv-mode", default="clean", choices=["clean", "final"], help="K/V of earlier chunks (default clean)"
    )
    parser.add_argument(
        "--seeds", type=parse_seeds, default=parse_seeds("0-49"), help="eval episode seeds (default 0-49)"
    )
    parser.add_argument(
        "--sampler",
        dest="samplers",
        type=parse_sampler,
        action="append",
        help="renoise:STEPS, ddim:STEPS or snap:STEPS (timesteps 1000 to 1, decreasing), "
        "repeatable; default: " + "; ".join(DEFAULT_SAMPLERS),
    )
    parser.add_argument("--noise-seed", type=int, default=0, help="the rollouts' noise seed (default 0)")
    parser.add_argument("--json", type=Path, help="write the report here")
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    args.samplers = args.samplers or [parse_sampler(s) for s in DEFAULT_SAMPLERS]
    for _, steps in args.samplers:
        if not steps or any(not 0 < s <= 1000 for s in steps) or list(steps) != sorted(steps, reverse=True):
            parser.error(f"--sampler: steps must decrease within (0, 1000]: {list(steps)}")
    if args.dit and not Path(args.dit).is_file():
        parser.error(f"--dit: {args.dit} does not exist")
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist")
    report = run(args)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
