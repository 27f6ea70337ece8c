"""`streamworld bench`: N concurrent streams through the engine for a fixed time, then the
same work through the naive baseline (the streams one after another through the sequential
reference loop) in the same process, and the ratio of the two.

Reported: aggregate and per-stream frames/s, time to first frame, inter-chunk gaps
(p50/p99), chunk deadline attainment, the batch-size histogram and the executors' idle
share. Results go to stdout as a table and, with `--json`, to a JSON file.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import numpy as np
import torch

from .engine.engine import AsyncEngine, EngineConfig
from .engine.executor import on_torch_thread
from .engine.reference import GenerationRequest, ReferenceGenerator
from .engine.scheduler import SchedulerConfig
from .engine.stream import StreamRequest
from .models.world_model import WorldModel
from .scenes import first_frame_source


@dataclass
class BenchConfig:
    streams: int = 4
    duration_s: float = 20.0
    kv_mode: str | None = None
    baseline_kv_mode: str | None = None
    priority: str = "standard"
    prompt: str = "a walk through a forest"
    paced: bool = True  # playback clocks on (real time); off: as fast as possible
    num_stages: int = 1
    num_ranks: int = 1
    max_batch_units: int = 16
    token_budget: int = 65536
    ttff_budget_s: float = 1.0
    lookahead_chunks: float = 2.0
    baseline: bool = True


def _inputs(model: WorldModel, seed: int) -> dict:
    """The first image an image-to-world model needs (its environment's, or mid-grey)."""
    cfg = model.config
    if not cfg.needs_image:
        return {}
    source = first_frame_source(cfg)
    if source is not None:
        return {"image": source(seed)[0]}
    return {"image": np.full((cfg.height, cfg.width, 3), 128, np.uint8)}


def _prompt(model: WorldModel, cfg: BenchConfig) -> str:
    return cfg.prompt if model.config.takes_prompt else ""


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _engine_phase(model: WorldModel, cfg: BenchConfig) -> dict:
    sched = SchedulerConfig(
        lookahead_chunks=cfg.lookahead_chunks if cfg.paced else 1e9,
        max_batch_units=cfg.max_batch_units,
        token_budget=cfg.token_budget,
    )
    engine_cfg = EngineConfig(
        num_stages=cfg.num_stages,
        num_ranks=cfg.num_ranks,
        max_streams=max(cfg.streams, 1),
        ttff_budget_s=cfg.ttff_budget_s,
        scheduler=sched,
    )
    async with AsyncEngine(model, engine_cfg) as engine:
        # Warm-up (kernel selection, allocator, prompt cache), not measured.
        warm = engine.open_stream(
            StreamRequest(
                seed=10_000,
                num_chunks=1,
                prompt=_prompt(model, cfg),
                kv_mode=cfg.kv_mode,
                **_inputs(model, 10_000),
            )
        )
        async for _ in warm:
            pass
        engine.stats.batch_sizes.clear()
        busy0 = [r.busy_s for r in engine.ranks]
        all_busy0 = sum(ex.busy_s for ex in (*engine.ranks, engine.decoder, engine.prep))
        t0 = time.monotonic()
        handles = [
            engine.open_stream(
                StreamRequest(
                    seed=i,
                    num_chunks=None,
                    prompt=_prompt(model, cfg),
                    kv_mode=cfg.kv_mode,
                    priority=cfg.priority,
                    **_inputs(model, i),
                )
            )
            for i in range(cfg.streams)
        ]
        records: list[list[tuple[float, int, bool]]] = [[] for _ in handles]

        async def drain(i: int) -> None:
            async for chunk in handles[i]:
                records[i].append((time.monotonic(), chunk.frames.shape[0], chunk.deadline_missed))

        tasks = [asyncio.create_task(drain(i)) for i in range(len(handles))]
        await asyncio.sleep(cfg.duration_s)
        t1 = time.monotonic()
        busy1 = [r.busy_s for r in engine.ranks]
        all_busy1 = sum(ex.busy_s for ex in (*engine.ranks, engine.decoder, engine.prep))
        for h in handles:
            h.cancel()
        await asyncio.gather(*tasks)
        batch_hist = dict(sorted(engine.stats.batch_sizes.items()))
        pages_total = engine.pool.pages_total

    wall = t1 - t0
    per_stream = []
    gaps: list[float] = []
    ttffs: list[float] = []
    met = total_chunks = 0
    for rec in records:
        rec = [r for r in rec if r[0] <= t1]
        frames = sum(n for _, n, _ in rec)
        times = [t for t, _, _ in rec]
        gaps.extend(np.diff(times).tolist())
        ttff = times[0] - t0 if times else None
        if ttff is not None:
            ttffs.append(ttff)
        met += sum(1 for _, _, missed in rec if not missed)
        total_chunks += len(rec)
        per_stream.append({"frames": frames, "fps": frames / wall, "chunks": len(rec), "ttff_s": ttff})
    busy = sum(b1 - b0 for b0, b1 in zip(busy0, busy1, strict=True)) / (wall * len(busy0))
    return {
        "wall_s": wall,
        "aggregate_fps": sum(s["frames"] for s in per_stream) / wall,
        "per_stream": per_stream,
        "chunks": total_chunks,
        "ttff_s": {"mean": statistics.fmean(ttffs) if ttffs else None, "max": max(ttffs, default=None)},
        "inter_chunk_s": {"p50": _percentile(gaps, 50), "p99": _percentile(gaps, 99)},
        "deadline_attainment": met / total_chunks if total_chunks else None,
        "batch_size_histogram": batch_hist,
        # DiT ranks only; decode and prep work are not counted.
        "executor_idle_share": 1.0 - busy,
        # On a CPU all executors share one thread: the share of time it had no work.
        "cpu_thread_idle_share": (
            max(0.0, 1.0 - (all_busy1 - all_busy0) / wall) if model.device.type == "cpu" else None
        ),
        "kv_pages_total": pages_total,
    }


def _baseline_phase(model: WorldModel, cfg: BenchConfig, chunks_per_stream: int) -> dict:
    gen = ReferenceGenerator(model)
    mode = cfg.baseline_kv_mode or cfg.kv_mode
    warm = GenerationRequest(
        seed=10_000, num_chunks=1, prompt=_prompt(model, cfg), kv_mode=mode, **_inputs(model, 10_000)
    )
    gen.generate(warm)
    _sync(model)
    t0 = time.perf_counter()
    frames = 0
    for i in range(cfg.streams):
        result = gen.generate(
            GenerationRequest(
                seed=i,
                num_chunks=chunks_per_stream,
                prompt=_prompt(model, cfg),
                kv_mode=mode,
                **_inputs(model, i),
            )
        )
        frames += result.frames.shape[0]
    _sync(model)
    wall = time.perf_counter() - t0
    return {
        "kv_mode": mode or model.config.default_kv_mode,
        "chunks_per_stream": chunks_per_stream,
        "frames": frames,
        "wall_s": wall,
        "aggregate_fps": frames / wall,
    }


def _sync(model: WorldModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def machine_description(model: WorldModel) -> str:
    if model.device.type == "cuda":
        return f"{torch.cuda.get_device_name(model.device)}, PyTorch {torch.__version__}"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, PyTorch {torch.__version__}"


def run_bench(model: WorldModel, cfg: BenchConfig) -> dict:
    engine = asyncio.run(_engine_phase(model, cfg))
    result = {
        "model": model.config.id,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": machine_description(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "config": asdict(cfg),
        "engine": engine,
    }
    if cfg.baseline:
        per_stream = max(1, round(engine["chunks"] / max(cfg.streams, 1)))
        # Where the engine runs it (on a CPU, the process's PyTorch thread): a like-for-like ratio.
        base = on_torch_thread(model.device, lambda: _baseline_phase(model, cfg, per_stream))
        result["baseline"] = base
        result["speedup"] = engine["aggregate_fps"] / base["aggregate_fps"]
    return result


def format_report(result: dict) -> str:
    e = result["engine"]
    cfg = result["config"]

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        f"model {result['model']} ({result['dtype']}) on {result['machine']}, {result['date']}",
        f"{cfg['streams']} streams, {cfg['duration_s']:.0f} s, kv_mode {cfg['kv_mode'] or 'default'}, "
        f"{'paced (real-time clocks)' if cfg['paced'] else 'unpaced'}, {cfg['num_stages']} stage(s), "
        f"{cfg['num_ranks']} rank(s)",
        f"engine   aggregate {e['aggregate_fps']:.1f} frames/s; per stream "
        + ", ".join(f"{s['fps']:.1f}" for s in e["per_stream"]),
        f"         time to first frame mean {f(e['ttff_s']['mean'])} s, max {f(e['ttff_s']['max'])} s; "
        f"inter-chunk p50 {f(e['inter_chunk_s']['p50'], '.3f')} s, "
        f"p99 {f(e['inter_chunk_s']['p99'], '.3f')} s",
        f"         deadlines met {f(e['deadline_attainment'], '.1%')}; "
        f"DiT executor idle {e['executor_idle_share']:.1%}"
        + (
            f" (the one CPU thread: {e['cpu_thread_idle_share']:.1%})"
            if e.get("cpu_thread_idle_share") is not None
            else ""
        )
        + f"; batch sizes {e['batch_size_histogram']}",
    ]
    if "baseline" in result:
        b = result["baseline"]
        lines.append(
            f"baseline {b['aggregate_fps']:.1f} frames/s (streams one after another, "
            f"{b['chunks_per_stream']} chunks each, kv_mode {b['kv_mode']})"
        )
        lines.append(f"ratio    engine / baseline = {result['speedup']:.2f}x")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
