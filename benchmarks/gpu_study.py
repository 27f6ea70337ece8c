"""The GPU study at real model scale: `wan2.1-t2v-1.3b --random-weights` (speed does not
depend on weight values) through `streamworld bench`'s engine and baseline phases, with each
geometry loaded once. GPU only.

    python benchmarks/gpu_study.py --out study/            # every run
    python benchmarks/gpu_study.py --out study/ --runs 480-1-noisy,320-8-noisy-paced

Runs (name: streams, KV mode, pacing, what it answers):

- 480x832, 18-frame window, 3 latent frames per chunk, 4 steps:
  `480-1-{noisy,final,clean}`: one stream, unpaced, each KV mode against the sequential
  loop in the same mode (frames/s and time to first frame end to end);
  `480-1-noisy-profile`: the same under the PyTorch profiler (where the GPU time goes);
  `480-2-noisy`: 2 streams, unpaced, against the `clean` sequential baseline.
- 320x512, 6-frame window:
  `320-N-noisy-paced` for N in 4, 6, 8, 10, 12: N real-time streams, no baseline (how many
  hold 16 frames/s with 99% of deadlines);
  `320-8-noisy`: 8 streams, unpaced, against the `clean` sequential baseline, then the
  same under the profiler and with cuDNN autotuning (`torch.backends.cudnn.benchmark`).
- `480-1-noisy-tb8k`: a token budget of one 480x832 unit per batch; `480-1-noisy-paced`:
  real-time pacing (the time to first frame of an interactive session).
- Runs named `...-lite`, `...-compile` and `...-fast` load the model with the lite decoder,
  with the DiT's elementwise arithmetic compiled, or both (`--decoder lite`, `--compile`):
  `480-1-{noisy,final,clean}-fast`, `480-1-noisy-{lite,compile}` (each change alone),
  `480-1-noisy-fast-paced`, `480-2-noisy-fast`, `320-N-noisy-paced-fast`, `320-8-noisy-fast`,
  `320-8-noisy-fast-tb16k` and `320-{8,10}-noisy-paced-fast-tb16k` (a token budget of 8
  units), and the two profiles `480-1-noisy-fast-profile`, `320-8-noisy-fast-profile`. Their
  baselines run the same model, so each ratio compares the engine with the sequential loop
  on equal components.

- CUDA graphs (`--cuda-graphs`), side by side with the same runs without them, no baseline:
  `480-1-noisy-{fast,compile}-nb[-graphs]` (one stream with the lite and with the Wan
  decoder), `320-{1,8}-noisy-fast-tb16k-nb[-graphs]` (unpaced) and the real-time capacity
  curve `320-N-noisy-paced-fast-tb16k[-graphs]` for N in 10, 12, 14, 16.

Each run writes `<name>.json` (the `streamworld bench` result, plus the seconds the model
took to load) into `--out`, and the driver prints one summary line per run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch

from streamworld.bench import BenchConfig, format_report, run_bench, write_json
from streamworld.engine import EngineConfig, SchedulerConfig
from streamworld.models import get_preset
from streamworld.models.world_model import WorldModel

GEOMETRIES = {
    "480": dict(height=480, width=832, window_frames=18),
    "320": dict(height=320, width=512, window_frames=6),
}


# Model variants (`WorldModel.load` options); a run named "...-fast" loads "fast", etc.
VARIANTS = {
    "": {},
    "lite": {"decoder": "lite"},
    "compile": {"compiled": True},
    "fast": {"decoder": "lite", "compiled": True},
}


def _variant(name: str) -> str:
    for v in ("fast", "lite", "compile"):
        if f"-{v}" in name:
            return v
    return ""


def _engine(token_budget: int, cuda_graphs: bool = False) -> EngineConfig:
    """The default engine with another per-batch token budget."""
    return EngineConfig(scheduler=SchedulerConfig(token_budget=token_budget), cuda_graphs=cuda_graphs)


def _graph_runs() -> list[tuple[str, str, BenchConfig]]:
    """Each run without CUDA graphs and then with them."""
    runs = []
    for graphs in (False, True):
        tail = "-graphs" if graphs else ""
        for v in ("fast", "compile"):
            engine = _engine(8192, graphs)
            cfg = BenchConfig(1, 15.0, "noisy", paced=False, baseline=False, engine=engine)
            runs.append((f"480-1-noisy-{v}-nb{tail}", "480", cfg))
        for n in (1, 8):
            cfg = BenchConfig(n, 15.0, "noisy", paced=False, baseline=False, engine=_engine(16384, graphs))
            runs.append((f"320-{n}-noisy-fast-tb16k-nb{tail}", "320", cfg))
        for n in (10, 12, 14, 16):
            cfg = BenchConfig(n, 20.0, "noisy", baseline=False, engine=_engine(16384, graphs))
            runs.append((f"320-{n}-noisy-paced-fast-tb16k{tail}", "320", cfg))
    return runs


def _fast_runs() -> list[tuple[str, str, BenchConfig]]:
    """The lite decoder and the compiled elementwise DiT arithmetic, alone and together."""
    return _fast_480_runs() + _fast_320_runs() + _fast_profile_runs()


def _fast_480_runs() -> list[tuple[str, str, BenchConfig]]:
    """480x832: each KV mode, each change alone and paced (one unit per batch), then 2 streams."""
    runs = []
    for mode in ("noisy", "final", "clean"):
        runs.append(
            (
                f"480-1-{mode}-fast",
                "480",
                BenchConfig(1, 15.0, mode, mode, paced=False, engine=_engine(token_budget=8192)),
            )
        )
    for v in ("lite", "compile"):
        runs.append(
            (
                f"480-1-noisy-{v}",
                "480",
                BenchConfig(1, 15.0, "noisy", "noisy", paced=False, engine=_engine(token_budget=8192)),
            )
        )
    runs.append(
        (
            "480-1-noisy-fast-paced",
            "480",
            BenchConfig(1, 15.0, "noisy", "noisy", engine=_engine(token_budget=8192)),
        )
    )
    runs.append(("480-2-noisy-fast", "480", BenchConfig(2, 15.0, "noisy", "clean", paced=False)))
    return runs


def _fast_320_runs() -> list[tuple[str, str, BenchConfig]]:
    """320x512: how many real-time streams hold, and 8 unpaced streams, with and without a 16k budget."""
    runs = []
    for n in (4, 6, 8, 10, 12):
        runs.append((f"320-{n}-noisy-paced-fast", "320", BenchConfig(n, 20.0, "noisy", baseline=False)))
    runs.append(("320-8-noisy-fast", "320", BenchConfig(8, 15.0, "noisy", "clean", paced=False)))
    # A token budget of 8 units of 320x512 (the pipelined units of the next chunks wait).
    # The target's ratio: the host-bound baseline's median of 3 runs.
    runs.append(
        (
            "320-8-noisy-fast-tb16k",
            "320",
            BenchConfig(
                8, 15.0, "noisy", "clean", paced=False, engine=_engine(token_budget=16384), baseline_repeats=3
            ),
        )
    )
    for n in (8, 10):
        runs.append(
            (
                f"320-{n}-noisy-paced-fast-tb16k",
                "320",
                BenchConfig(n, 20.0, "noisy", baseline=False, engine=_engine(token_budget=16384)),
            )
        )
    return runs


def _fast_profile_runs() -> list[tuple[str, str, BenchConfig]]:
    runs = []
    for geometry, streams in (("480", 1), ("320", 8)):
        runs.append(
            (
                f"{geometry}-{streams}-noisy-fast-profile",
                geometry,
                BenchConfig(
                    streams,
                    8.0,
                    "noisy",
                    paced=False,
                    baseline=False,
                    profile=True,
                    engine=_engine(token_budget=8192 if geometry == "480" else 65536),
                ),
            )
        )
    return runs


def _runs() -> list[tuple[str, str, BenchConfig]]:
    runs = []
    for mode in ("noisy", "final", "clean"):
        runs.append((f"480-1-{mode}", "480", BenchConfig(1, 15.0, mode, mode, paced=False)))
    # One unit per batch at this size (batching gains nothing here): does chunk 0 come sooner?
    runs.append(
        (
            "480-1-noisy-tb8k",
            "480",
            BenchConfig(1, 15.0, "noisy", "noisy", paced=False, engine=_engine(token_budget=8192)),
        )
    )
    runs.append(("480-1-noisy-paced", "480", BenchConfig(1, 15.0, "noisy", "noisy")))
    runs.append(
        (
            "480-1-noisy-profile",
            "480",
            BenchConfig(1, 8.0, "noisy", paced=False, baseline=False, profile=True),
        )
    )
    runs.append(("480-2-noisy", "480", BenchConfig(2, 15.0, "noisy", "clean", paced=False)))
    for n in (4, 6, 8, 10, 12):
        runs.append((f"320-{n}-noisy-paced", "320", BenchConfig(n, 20.0, "noisy", baseline=False)))
    runs.append(("320-8-noisy", "320", BenchConfig(8, 15.0, "noisy", "clean", paced=False)))
    runs.append(
        (
            "320-8-noisy-profile",
            "320",
            BenchConfig(8, 8.0, "noisy", paced=False, baseline=False, profile=True),
        )
    )
    # cuDNN autotuning for the VAE's convolutions; process-wide, so it stays on after this run.
    runs.append(("320-8-noisy-cudnn-benchmark", "320", BenchConfig(8, 15.0, "noisy", "clean", paced=False)))
    return runs + _fast_runs() + _graph_runs()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for the JSON results")
    parser.add_argument("--runs", help="comma-separated run names (default: all)")
    parser.add_argument("--duration-scale", type=float, default=1.0, help="multiply every run's duration")
    return parser.parse_args(argv)


def _select_runs(
    runs: list[tuple[str, str, BenchConfig]], names: str | None
) -> list[tuple[str, str, BenchConfig]] | None:
    """The runs named in `--runs`, in the order given (all without it); None after reporting unknown names."""
    if not names:
        return runs
    wanted = names.split(",")
    unknown = sorted(set(wanted) - {name for name, _, _ in runs})
    if unknown:
        print(f"error: unknown runs {unknown}; known: {[n for n, _, _ in runs]}", file=sys.stderr)
        return None
    by_name = {r[0]: r for r in runs}
    return [by_name[n] for n in wanted]


def _load_model(geometry: str, variant: str) -> tuple[WorldModel, float]:
    """The 1.3B model with random weights at `geometry`, and the seconds it took to load."""
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    config = dataclasses.replace(get_preset("wan2.1-t2v-1.3b"), **GEOMETRIES[geometry])
    model = WorldModel.load(config, random_weights=True, device="cuda", dtype="bfloat16", **VARIANTS[variant])
    load_s = time.perf_counter() - t0
    print(
        f"--- loaded {config.height}x{config.width} {variant or 'eager, wan decoder'} in {load_s:.1f} s",
        flush=True,
    )
    return model, load_s


def _bench(name: str, cfg: BenchConfig, model: WorldModel, load_s: float) -> dict:
    """One run's `streamworld bench` result, printed, with what the study adds to it."""
    if name.endswith("cudnn-benchmark"):
        torch.backends.cudnn.benchmark = True
    print(f"=== {name}", flush=True)
    result = run_bench(model, cfg)
    result["run"] = name
    result["model_load_s"] = load_s
    result["decoder"] = model.vae.decoder_kind
    result["compiled_elementwise"] = model.dit.elementwise_compiled
    result["cuda_graphs_on"] = cfg.engine.cuda_graphs
    lite = getattr(model.vae, "lite", None)
    result["compiled_decoder"] = lite is not None and lite.compiled
    result["geometry"] = f"{model.config.height}x{model.config.width}, window {model.config.window_frames}"
    print(format_report(result), flush=True)
    result["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the GPU study needs a CUDA device", file=sys.stderr)
        return 2
    runs = _select_runs(_runs(), args.runs)
    if runs is None:
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models: dict[str, tuple[WorldModel, float]] = {}
    for name, geometry, cfg in runs:
        key = f"{geometry}{_variant(name)}"
        if key not in models:
            models.clear()  # one model on the GPU at a time
            model = None  # the last reference, so that the load can reuse its memory
            models[key] = _load_model(geometry, _variant(name))
        model, load_s = models[key]
        cfg = dataclasses.replace(cfg, duration_s=cfg.duration_s * args.duration_scale)
        result = _bench(name, cfg, model, load_s)
        write_json(result, str(out / f"{name}.json"))
        torch.cuda.synchronize()
        gc.collect()  # whatever the run left in reference cycles, before the next sizes its pool
        torch.cuda.empty_cache()
    print(json.dumps({"runs": [r[0] for r in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
