"""`streamworld bench`: N concurrent streams through the engine for a fixed time, then the
same work through the naive baseline (the streams one after another through the sequential
reference loop) in the same process, and the ratio of the two.

Reported: aggregate and per-stream frames/s, time to first frame, inter-chunk gaps
(p50/p99), chunk deadline attainment, the batch-size histogram and the executors' busy
time. Results go to stdout as a table and, with `--json`, to a JSON file.

With `profile` (CUDA only) the measured window runs under the PyTorch profiler, and the
result says where the GPU time went: kernel time per executor (DiT ranks, VAE decode,
prompt and image encoding), the share of the window in which no kernel ran at all (GPU
idle), and the costliest kernels. The profiler slows the host side, so the throughput
figures of a profiled run are not the ones to quote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone

import numpy as np
import torch

from .engine import (
    AsyncEngine,
    EngineConfig,
    GenerationRequest,
    Placement,
    ReferenceGenerator,
    ReplicaSet,
    StreamRequest,
    on_torch_thread,
    summed_stats,
)
from .models.world_model import WorldModel
from .scenes import first_frame_source

# How long past --duration a measured window waits for its first chunk.
FIRST_CHUNK_WAIT_S = 120.0


@dataclass
class BenchConfig:
    """One bench run: the streams and how they are driven, and the engine they run on.

    `engine` is the engine as a server would configure it; the bench admits every stream
    (`max_streams` becomes `streams`) and, unpaced, lets the scheduler run any chunk ahead.
    """

    streams: int = 4
    duration_s: float = 20.0
    kv_mode: str | None = None
    baseline_kv_mode: str | None = None
    priority: str = "standard"
    prompt: str = "a walk through a forest"
    paced: bool = True  # playback clocks on (real time); off: as fast as possible
    engine: EngineConfig = field(default_factory=EngineConfig)
    baseline: bool = True
    # The baseline is run this many times and its median taken: it runs one unit at a time,
    # so it is bound by the host and swings more from run to run than the engine does.
    baseline_repeats: int = 1
    profile: bool = False  # CUDA only: where the GPU time goes (see the module docstring)
    # Where the model runs: replicas (one engine each, as one pool) and stages on devices.
    # None: one engine on the model's device, `engine.num_stages` stages on `num_ranks` ranks.
    placement: Placement | None = None

    def engine_config(self) -> EngineConfig:
        """The engine this run starts: room for every stream; unpaced, no lookahead limit."""
        scheduler = self.engine.scheduler
        if not self.paced:
            scheduler = replace(scheduler, lookahead_chunks=1e9)
        return replace(self.engine, max_streams=max(self.streams, 1), scheduler=scheduler)

    def to_json(self) -> dict:
        """The run's settings for the result file, `engine` as the engine ran (`engine_config`).
        The engine knobs that BenchConfig used to hold itself stay as top-level keys too, with
        the values they had there, so readers of older results keep working."""
        engine = self.engine
        flat = {
            "num_stages": engine.num_stages,
            "num_ranks": engine.num_ranks,
            "max_batch_units": engine.scheduler.max_batch_units,
            "token_budget": engine.scheduler.token_budget,
            "ttff_budget_s": engine.ttff_budget_s,
            "lookahead_chunks": engine.scheduler.lookahead_chunks,
        }
        # A fault hook is a test's function, not a setting, and JSON cannot hold it.
        settings = asdict(replace(self, engine=replace(self.engine_config(), fault_hook=None)))
        if self.placement is not None:
            flat["placement"] = self.placement.describe()
            flat["replicas"] = len(self.placement.replicas)
            first = self.placement.replicas[0]  # per replica, as the placement sets them
            flat["num_stages"], flat["num_ranks"] = len(first.stages), first.num_ranks
        return {**settings, **flat}


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


def _measured_stream(model: WorldModel, cfg: BenchConfig, seed: int) -> StreamRequest:
    return StreamRequest(
        seed=seed,
        num_chunks=None,
        prompt=_prompt(model, cfg),
        kv_mode=cfg.kv_mode,
        priority=cfg.priority,
        **_inputs(model, seed),
    )


@dataclass
class _Window:
    """What the measured window needs from the engine at its start and its end."""

    dit_busy: list[float]  # per DiT rank
    busy: dict[str, float]  # per kind of executor, summed over its executors
    copies: list[tuple[float, int]]  # per link between stages: seconds copying, bytes moved


def _executors(engines: list[AsyncEngine]) -> dict[str, list]:
    return {
        "dit": [r for e in engines for r in e.ranks],
        "decode": [e.decoder for e in engines],
        "encode": [e.prep for e in engines],
    }


def _snapshot(engines: list[AsyncEngine]) -> _Window:
    return _Window(
        dit_busy=[r.busy_s for e in engines for r in e.ranks],
        busy={k: sum(ex.busy_s for ex in v) for k, v in _executors(engines).items()},
        copies=[(link.copy_s, link.bytes) for e in engines for link in e.runner.links],
    )


def _engines(models: list[WorldModel], cfg: BenchConfig) -> list[AsyncEngine]:
    """One engine per replica of the placement (one engine without a placement)."""
    base = cfg.engine_config()
    if cfg.placement is None:
        return [AsyncEngine(models[0], base)]
    return [
        AsyncEngine(m, replace(base, placement=r))
        for m, r in zip(models, cfg.placement.replicas, strict=True)
    ]


async def _engine_phase(models: list[WorldModel], cfg: BenchConfig) -> dict:
    model = models[0]
    engines = _engines(models, cfg)
    async with ReplicaSet(engines) as replica_set:
        await _warm_up(engines, model, cfg)
        executors = _executors(engines)
        start = _snapshot(engines)
        profiler = _start_profiler() if cfg.profile else None
        sampler = UtilisationSampler(model.device) if model.device.type == "cuda" else None
        t0 = time.monotonic()
        handles = [replica_set.open_stream(_measured_stream(model, cfg, i)) for i in range(cfg.streams)]
        records: list[list[tuple[float, int, bool]]] = [[] for _ in handles]

        async def drain(i: int) -> None:
            async for chunk in handles[i]:
                records[i].append((time.monotonic(), chunk.frames.shape[0], chunk.deadline_missed))

        tasks = [asyncio.create_task(drain(i)) for i in range(len(handles))]
        await asyncio.sleep(cfg.duration_s)
        # A window without a single chunk measures nothing (a short run on a busy machine):
        # it goes on until the first chunk arrives, FIRST_CHUNK_WAIT_S more at most.
        give_up = time.monotonic() + FIRST_CHUNK_WAIT_S
        while not any(records) and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        t1 = time.monotonic()
        admitted = sum(1 for h in handles if h.queue_position == 0)  # before cancelling admits others
        replica_of = [h.replica for h in handles]  # where each ran (a waiting stream may move)
        utilisation = sampler.stop() if sampler is not None else None
        end = _snapshot(engines)
        profile = None
        if profiler is not None:
            threads = {tid: name for name, v in executors.items() for ex in v for tid in ex.thread_ids}
            profile = _stop_profiler(profiler, threads, (t1 - t0) * 1e6)
        for h in handles:
            h.cancel()
        await asyncio.gather(*tasks)
        result = _stream_figures(records, t0, t1)
        result.update(_placement_figures(engines, executors, start, end, t1 - t0, result, replica_of))
        result.update(_executor_figures(model, executors, start, end, t1 - t0))
        result.update(
            kv_pages_total=sum(e.pool.pages_total for e in engines),
            # Streams the engine admitted (the rest waited for K/V pages the whole run).
            streams_admitted=admitted,
            # CUDA: the driver's share of time in which a kernel ran (NVML), sampled over the
            # window without the profiler's overhead; None where NVML is not available.
            gpu_utilisation=utilisation,
            profile=profile,
        )
    return result


async def _warm_up(engines: list[AsyncEngine], model: WorldModel, cfg: BenchConfig) -> None:
    """One short stream on every replica (kernel selection, allocator, prompt cache), not measured."""
    warm = StreamRequest(
        seed=10_000, num_chunks=1, prompt=_prompt(model, cfg), kv_mode=cfg.kv_mode, **_inputs(model, 10_000)
    )
    for engine in engines:
        async for _ in engine.open_stream(warm):
            pass
        engine.stats.batch_sizes.clear()


def _placement_figures(
    engines: list[AsyncEngine],
    executors: dict[str, list],
    start: _Window,
    end: _Window,
    wall: float,
    streams: dict,
    replica_of: list[int],
) -> dict:
    """Batch sizes over every replica, DiT busy time per device, and per-replica figures."""
    sizes: dict[int, int] = defaultdict(int)
    for engine in engines:
        for size, n in engine.stats.batch_sizes.items():
            sizes[size] += n
    for stream, replica in zip(streams["per_stream"], replica_of, strict=True):
        stream["replica"] = replica
    out = {
        "batch_size_histogram": dict(sorted(sizes.items())),
        "device_busy_share": _device_busy(executors["dit"], start, end, wall),
    }
    links = [(r, link) for r, e in enumerate(engines) for link in e.runner.links]  # as _Window.copies
    if any(link.crosses for _, link in links):
        out["stage_copies"] = _copy_figures(links, start, end, wall)
    graphs = summed_stats(g.stats for e in engines for g in e.runner.graphs or [])
    if graphs is not None:  # over the whole run, warm-up included: captures happen there
        out["cuda_graphs"] = graphs
    if len(engines) > 1:
        out["per_replica"] = _replica_figures(streams["per_stream"], replica_of, len(engines))
    return out


def _device_busy(ranks: list, start: _Window, end: _Window, wall: float) -> dict[str, float]:
    """Seconds of DiT work per second of the window, per device (ranks sharing a device add
    up, so two virtual ranks that overlap on one GPU can exceed 1)."""
    out: dict[str, float] = defaultdict(float)
    for rank, b0, b1 in zip(ranks, start.dit_busy, end.dit_busy, strict=True):
        out[str(rank.device)] += (b1 - b0) / wall
    return dict(out)


def _copy_figures(links: list, start: _Window, end: _Window, wall: float) -> list[dict]:
    """Per link between stages on different devices: time its copies took (on the sending
    GPU's side stream, so mostly hidden behind compute) and bytes moved in the window."""
    out = []
    for (replica, link), (s0, b0), (s1, b1) in zip(links, start.copies, end.copies, strict=True):
        if not link.crosses:
            continue
        out.append(
            {
                "replica": replica,
                "link": f"{link.src}->{link.dst}",
                "copy_s": s1 - s0,
                "copy_share": (s1 - s0) / wall,
                "gbytes_per_s": (b1 - b0) / wall / 1e9,
            }
        )
    return out


def _replica_figures(per_stream: list[dict], replica_of: list[int], replicas: int) -> list[dict]:
    out = []
    for r in range(replicas):
        mine = [s for s, owner in zip(per_stream, replica_of, strict=True) if owner == r]
        out.append({"replica": r, "streams": len(mine), "fps": sum(s["fps"] for s in mine)})
    return out


def _stream_figures(records: list[list[tuple[float, int, bool]]], t0: float, t1: float) -> dict:
    """Throughput, first-frame and gap figures from each stream's (time, frames, missed) chunks."""
    wall = t1 - t0
    per_stream = []
    gaps: list[float] = []
    ttffs: list[float] = []
    met = total_chunks = 0
    for rec in records:
        rec = [r for r in rec if r[0] <= t1]  # chunks after the window's end do not count
        frames = sum(n for _, n, _ in rec)
        times = [t for t, _, _ in rec]
        gaps.extend(np.diff(times).tolist())
        ttff = times[0] - t0 if times else None
        if ttff is not None:
            ttffs.append(ttff)
        met += sum(1 for _, _, missed in rec if not missed)
        total_chunks += len(rec)
        per_stream.append({"frames": frames, "fps": frames / wall, "chunks": len(rec), "ttff_s": ttff})
    return {
        "wall_s": wall,
        "aggregate_fps": sum(s["frames"] for s in per_stream) / wall,
        "per_stream": per_stream,
        "chunks": total_chunks,
        "ttff_s": {"mean": statistics.fmean(ttffs) if ttffs else None, "max": max(ttffs, default=None)},
        "inter_chunk_s": {"p50": _percentile(gaps, 50), "p99": _percentile(gaps, 99)},
        "deadline_attainment": met / total_chunks if total_chunks else None,
    }


def _executor_figures(
    model: WorldModel, executors: dict[str, list], start: _Window, end: _Window, wall: float
) -> dict:
    busy = sum(b1 - b0 for b0, b1 in zip(start.dit_busy, end.dit_busy, strict=True)) / (
        wall * len(start.dit_busy)
    )
    all_busy = sum(end.busy.values()) - sum(start.busy.values())
    return {
        # DiT ranks only; decode and prep work are not counted.
        "executor_idle_share": 1.0 - busy,
        # Wall time each kind of executor spent running work (on a GPU: from the first launch
        # to the end of its CUDA stream's sync), as a share of the window.
        "executor_busy_share": {
            k: (end.busy[k] - start.busy[k]) / (wall * len(v)) for k, v in executors.items()
        },
        # On a CPU all executors share one thread: the share of time it had no work.
        "cpu_thread_idle_share": (max(0.0, 1.0 - all_busy / wall) if model.device.type == "cpu" else None),
    }


class UtilisationSampler:
    """Samples NVML's GPU utilisation (the share of its last sample period, 1/6 s to 1 s
    depending on the GPU, in which at least one kernel ran) every `interval` seconds on a
    thread. Needs the `nvidia-ml-py` package (`pip install nvidia-ml-py`)."""

    def __init__(self, device: torch.device, interval: float = 0.1) -> None:
        self.samples: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._device = device
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="streamworld-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.samples.append(float(torch.cuda.utilization(self._device)))
            except Exception as e:  # no pynvml, or NVML refused
                self.error = f"{type(e).__name__}: {e}"
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        if not self.samples:
            return {"mean_percent": None, "samples": 0, "error": self.error or "no samples"}
        return {"mean_percent": statistics.fmean(self.samples), "samples": len(self.samples), "error": None}


def _start_profiler() -> torch.profiler.profile:
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    prof.start()
    return prof


def _stop_profiler(prof: torch.profiler.profile, threads: dict[int | None, str], window_us: float) -> dict:
    prof.stop()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return summarise_gpu_trace(trace.get("traceEvents", []), threads, window_us)


_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def summarise_gpu_trace(events: list[dict], threads: dict[int | None, str], window_us: float) -> dict:
    """Where the GPU time of a profiler trace (Chrome trace events) went.

    Each GPU activity is attributed to the executor whose thread launched it (through the
    launch's correlation id); `threads` maps native thread ids to executor names. GPU busy
    time is the union of all activity intervals, so overlapping streams count once; the
    rest of `window_us` is GPU idle.
    """
    launcher: dict[int, int] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launcher[args["correlation"]] = e.get("tid")
    per_executor: dict[str, float] = defaultdict(float)
    per_kernel: dict[tuple[str, str], float] = defaultdict(float)
    unattributed: dict[str, float] = defaultdict(float)  # launching thread id -> kernel time
    intervals = []
    for e in events:
        if e.get("cat") not in _GPU_CATEGORIES or "dur" not in e:
            continue
        start, dur = float(e["ts"]), float(e["dur"])
        intervals.append((start, start + dur))
        tid = launcher.get((e.get("args") or {}).get("correlation"))
        executor = threads.get(tid) or "other"
        per_executor[executor] += dur
        if executor == "other":
            unattributed[str(tid)] += dur
        per_kernel[(executor, e.get("name", "?"))] += dur
    busy = 0.0
    end = None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]
    return {
        "window_s": window_us / 1e6,
        "gpu_busy_s": busy / 1e6,
        "gpu_idle_share": max(0.0, 1.0 - busy / window_us) if window_us > 0 else None,
        # Summed kernel time; streams that overlap can add up to more than the window.
        "kernel_s": {k: v / 1e6 for k, v in sorted(per_executor.items())},
        "top_kernels_s": [{"executor": ex, "name": name, "s": v / 1e6} for (ex, name), v in top],
        "other_by_thread_s": {k: v / 1e6 for k, v in unattributed.items()},
    }


def _baseline_phase(model: WorldModel, cfg: BenchConfig, chunks_per_stream: int) -> dict:
    gen = ReferenceGenerator(model)
    mode = cfg.baseline_kv_mode or cfg.kv_mode
    warm = GenerationRequest(
        seed=10_000, num_chunks=1, prompt=_prompt(model, cfg), kv_mode=mode, **_inputs(model, 10_000)
    )
    gen.generate(warm)
    runs = []
    for _ in range(cfg.baseline_repeats):
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
                    open_ended=True,  # as the engine's measured streams are: every chunk commits
                    **_inputs(model, i),
                )
            )
            frames += result.frames.shape[0]
        _sync(model)
        runs.append((frames, time.perf_counter() - t0))
    frames, wall = sorted(runs, key=lambda r: r[0] / r[1])[len(runs) // 2]  # the median run
    return {
        "kv_mode": mode or model.config.default_kv_mode,
        "chunks_per_stream": chunks_per_stream,
        "frames": frames,
        "wall_s": wall,
        "aggregate_fps": frames / wall,
        "runs_fps": [f / w for f, w in runs],
    }


def _sync(model: WorldModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def machine_description(model: WorldModel) -> str:
    if model.device.type == "cuda":
        return f"{torch.cuda.get_device_name(model.device)}, PyTorch {torch.__version__}"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, PyTorch {torch.__version__}"


def run_bench(models: WorldModel | list[WorldModel], cfg: BenchConfig) -> dict:
    """`models`: the model, or one per replica of `cfg.placement`. The sequential baseline
    runs on the first, on its device; a model spread over several devices has none."""
    models = [models] if isinstance(models, WorldModel) else list(models)
    model = models[0]
    engine = asyncio.run(_engine_phase(models, cfg))
    result = {
        "model": model.config.id,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": machine_description(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "config": cfg.to_json(),
        "engine": engine,
    }
    spread = cfg.placement is not None and len(cfg.placement.replicas[0].devices) > 1
    if cfg.baseline and spread:
        result["baseline_skipped"] = "the reference loop runs on one device; this model spans several"
    elif cfg.baseline:
        per_stream = max(1, round(engine["chunks"] / max(cfg.streams, 1)))
        # Where the engine runs it (on a CPU, the process's PyTorch thread): a like-for-like ratio.
        base = on_torch_thread(model.device, lambda: _baseline_phase(model, cfg, per_stream))
        result["baseline"] = base
        result["speedup"] = engine["aggregate_fps"] / base["aggregate_fps"]
    return result


def _num(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_report(result: dict) -> str:
    """The result as the table `streamworld bench` prints (also for results read back from JSON)."""
    cfg = result["config"]
    lines = [
        f"model {result['model']} ({result['dtype']}) on {result['machine']}, {result['date']}",
        f"{cfg['streams']} streams, {cfg['duration_s']:.0f} s, kv_mode {cfg['kv_mode'] or 'default'}, "
        f"{'paced (real-time clocks)' if cfg['paced'] else 'unpaced'}, {cfg['num_stages']} stage(s), "
        f"{cfg['num_ranks']} rank(s)",
        *([f"placement {cfg['placement']}"] if cfg.get("placement") else []),
        *_engine_lines(result["engine"], cfg["streams"]),
        *_placement_lines(result["engine"]),
        *_gpu_lines(result["engine"]),
    ]
    if "baseline_skipped" in result:
        lines.append(f"baseline skipped: {result['baseline_skipped']}")
    if "baseline" in result:
        b = result["baseline"]
        runs = b.get("runs_fps", [])
        spread = f"; median of {len(runs)} runs, {min(runs):.1f}-{max(runs):.1f}" if len(runs) > 1 else ""
        lines.append(
            f"baseline {b['aggregate_fps']:.1f} frames/s (streams one after another, "
            f"{b['chunks_per_stream']} chunks each, kv_mode {b['kv_mode']}{spread})"
        )
        lines.append(f"ratio    engine / baseline = {result['speedup']:.2f}x")
    return "\n".join(lines)


def _engine_lines(e: dict, streams: int) -> list[str]:
    admitted = e.get("streams_admitted", streams)
    cpu_idle = e.get("cpu_thread_idle_share")
    return [
        f"engine   aggregate {e['aggregate_fps']:.1f} frames/s; per stream "
        + ", ".join(f"{s['fps']:.1f}" for s in e["per_stream"])
        + (
            f" ({admitted} of {streams} streams admitted; the rest waited for K/V pages)"
            if admitted < streams
            else ""
        ),
        f"         time to first frame mean {_num(e['ttff_s']['mean'])} s, max {_num(e['ttff_s']['max'])} s; "
        f"inter-chunk p50 {_num(e['inter_chunk_s']['p50'], '.3f')} s, "
        f"p99 {_num(e['inter_chunk_s']['p99'], '.3f')} s",
        f"         deadlines met {_num(e['deadline_attainment'], '.1%')}; "
        f"DiT executor idle {e['executor_idle_share']:.1%}"
        + (f" (the one CPU thread: {cpu_idle:.1%})" if cpu_idle is not None else "")
        + f"; batch sizes {e['batch_size_histogram']}",
        "         executors busy "
        + ", ".join(f"{k} {v:.1%}" for k, v in e.get("executor_busy_share", {}).items()),
    ]


def _placement_lines(e: dict) -> list[str]:
    lines = []
    busy = e.get("device_busy_share") or {}
    if len(busy) > 1 or e.get("per_replica"):
        lines.append("devices  DiT busy " + ", ".join(f"{d} {v:.1%}" for d, v in busy.items()))
    for c in e.get("stage_copies") or []:
        lines.append(
            f"copies   replica {c['replica']} {c['link']}: {c['copy_s']:.3f} s "
            f"({c['copy_share']:.1%} of the window), {c['gbytes_per_s']:.2f} GB/s"
        )
    graphs = e.get("cuda_graphs")
    if graphs:
        lines.append(
            f"graphs   {graphs['captured']} captured, {graphs['replays']} batches replayed, "
            f"{graphs['eager']} eager, {graphs['evicted']} evicted, {graphs['failures']} failed captures "
            "(whole run)"
        )
    for r in e.get("per_replica") or []:
        lines.append(f"replica  {r['replica']}: {r['streams']} streams, {r['fps']:.1f} frames/s")
    return lines


def _gpu_lines(e: dict) -> list[str]:
    lines = []
    util = e.get("gpu_utilisation")
    if util:
        lines.append(
            "gpu      "
            + (
                f"utilisation {util['mean_percent']:.1f}% (NVML, {util['samples']} samples: share of time "
                "a kernel ran)"
                if util["mean_percent"] is not None
                else f"utilisation not measured ({util['error']})"
            )
        )
    prof = e.get("profile")
    if prof:
        lines.append(
            f"profile  GPU idle {_num(prof['gpu_idle_share'], '.1%')} of {prof['window_s']:.1f} s; "
            "kernel time "
            + ", ".join(f"{k} {v:.2f} s" for k, v in prof["kernel_s"].items())
            + " (throughput figures of a profiled run are slowed by the profiler)"
        )
    return lines


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
