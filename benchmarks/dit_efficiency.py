"""How close the causal Wan DiT runs to the GPU's own limit, at a full attention window.

    python benchmarks/dit_efficiency.py --json dit.json [--profile]

Loads `wan2.1-t2v-1.3b` with seeded random weights (bf16; speed does not depend on the
weights' values), fills the K/V window by running the sequential reference loop, then times
each DiT forward of the following chunks with CUDA events, and in the same run the GPU's
bf16 matrix-product rate (a 8192^3 matmul, the best of several). It reports achieved
TFLOP/s for the whole DiT, the share of the matmul rate that is, and with --profile where
the kernel time goes (attention, matrix products, the rest).

FLOP count of one forward (what a matrix unit does; elementwise work is not counted), per
block, with Nq query tokens (F frames x T tokens per frame), Nk keys (context + own frames,
x T), model width D = heads x head dim, FFN width Dff and L text tokens:

    self-attention projections q, k, v, o    4 x 2 Nq D D
    self-attention  (QK^T and PV)            2 x 2 Nq Nk D
    cross-attention projections q, o         2 x 2 Nq D D     (text K/V cached per prompt)
    cross-attention (QK^T and PV)            2 x 2 Nq L D
    feed-forward (two matrices)              2 x 2 Nq D Dff

plus the patch embedding and the head (2 Nq P D each, P = channels x patch volume).

With --paged B[,B...] it also times the engine's own forward: B units at a full window
reading and writing the paged K/V cache as the engine does (`PagedKVBatch`: one gather of
context and own frames per block, the sinks moved), back to back as overlapped dispatch
queues them, with the blocks run eagerly and replayed from a CUDA graph (--cuda-graphs).
Time per forward is then the GPU's time over many queued forwards: where the host cannot
launch kernels as fast as the GPU runs them, the eager figure shows it.

Run it on the GPU machine (PyTorch with CUDA); it refuses to run on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.models import get_preset
from streamworld.models.world_model import WorldModel


def forward_flops(cfg, query_frames: int, key_frames: int) -> float:
    """The documented FLOP count of one DiT forward (module docstring)."""
    d = cfg.dit["num_attention_heads"] * cfg.dit["attention_head_dim"]
    dff, layers = cfg.dit["ffn_dim"], cfg.dit["num_layers"]
    t = cfg.tokens_per_frame
    nq, nk, text = query_frames * t, key_frames * t, cfg.text_len
    per_block = 8 * nq * d * d + 4 * nq * nk * d + 4 * nq * d * d + 4 * nq * text * d + 4 * nq * d * dff
    p = cfg.dit["in_channels"] * math.prod(cfg.dit["patch_size"])
    return layers * per_block + 2 * (2 * nq * p * d)


def attention_flops(cfg, query_frames: int, key_frames: int) -> float:
    d = cfg.dit["num_attention_heads"] * cfg.dit["attention_head_dim"]
    t = cfg.tokens_per_frame
    return cfg.dit["num_layers"] * 4 * (query_frames * t) * (key_frames * t) * d


def matmul_peak_tflops(repeats: int = 20, n: int = 8192) -> float:
    """The best bf16 rate of an n^3 matrix product on this GPU, in TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * n**3 / best / 1e12


class ForwardTimer:
    """Wraps `dit.forward_chunk`: CUDA events and the key frames of every forward."""

    def __init__(self, dit) -> None:
        self.dit, self.inner = dit, dit.forward_chunk
        self.records: list[tuple[torch.cuda.Event, torch.cuda.Event, int, int]] = []
        self.on = False
        dit.forward_chunk = self

    def __call__(self, units):
        if not self.on:
            return self.inner(units)
        (unit,) = units
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(units)
        end.record()
        frames = unit.latents.shape[1]
        self.records.append((start, end, frames, unit.kv.context_frames + frames))
        return out


def profile_categories(model: WorldModel, gen: ReferenceGenerator, request: GenerationRequest) -> dict:
    """Kernel time of one more chunk by kind (attention, matrix products, the rest)."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        gen.generate(request)
        torch.cuda.synchronize()
    kinds: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        us = e.device_time
        top[e.name] += us
        if "flash" in name or "fmha" in name or "attention" in name or "sdpa" in name:
            kinds["attention"] += us
        elif "gemm" in name or "cutlass" in name or "sm90" in name or "nvjet" in name or "matmul" in name:
            kinds["matrix products"] += us
        elif "conv" in name:
            kinds["convolution (VAE)"] += us
        elif "copy" in name or "cat" in name or "index" in name or "gather" in name:
            kinds["copies, gathers, concatenation"] += us
        else:
            kinds["elementwise, norms, other"] += us
    total = sum(kinds.values())
    return {
        "kernel_ms": total / 1e3,
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [
            {"name": k[:120], "ms": v / 1e3} for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]
        ],
    }


def paged_forward(model: WorldModel, batch: int, graphed: bool, repeats: int = 30) -> dict:
    """The engine's paged DiT forward of `batch` units at a full window (module docstring)."""
    from streamworld.engine.graphs import StageGraphs
    from streamworld.engine.kv_cache import KVCache, PagedKVView
    from streamworld.engine.kv_pool import Stage
    from streamworld.models.causal_wan import ChunkInput

    cfg, dit = model.config, model.dit
    f, ctx = cfg.latent_frames_per_chunk, cfg.sink_frames + cfg.window_frames
    stage = Stage(0, 0, cfg.num_layers)
    cache = KVCache.for_model(model, [stage], batch * (ctx + f))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    text = model.text_context("a walk")
    first = 4 * ctx  # far enough in that the sinks move
    units = []
    for i in range(batch):
        base = i * (ctx + f)
        pages = list(range(base, base + ctx)), [list(range(base + ctx, base + ctx + f))]
        view = PagedKVView(cache, stage, *pages, cfg.tokens_per_frame, first, cfg.sink_frames)
        latents = torch.randn(model.latent_shape(f), device="cuda")
        units.append(ChunkInput(latents, torch.full((f,), 500.0, device="cuda"), text, view))
    graphs = StageGraphs(dit, stage, torch.device("cuda"), batch) if graphed else None

    def forward() -> torch.Tensor:
        act = dit.embed(units)
        act = graphs.run(act, units) if graphs else dit.run_blocks(act, units, 0, cfg.num_layers)
        return dit.head(act)

    with torch.inference_mode():
        for _ in range(3):  # a graph is captured at the second
            forward()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(repeats):
            forward()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
    per_forward = start.elapsed_time(end) / 1000 / repeats
    flops = forward_flops(cfg, f, ctx + f) * batch
    del cache
    return {
        "batch": batch,
        "cuda_graphs": graphed,
        "forward_s": per_forward,
        "host_s_per_forward": host / repeats,
        "forward_tflop": flops / 1e12,
        "achieved_tflops": flops / per_forward / 1e12,
    }


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("dit_efficiency.py measures a GPU; PyTorch sees none here")
    h, w = (int(v) for v in args.frame_size.split("x"))
    cfg = dataclasses.replace(
        get_preset("wan2.1-t2v-1.3b"), height=h, width=w, window_frames=args.window, sink_frames=args.sink
    )
    model = WorldModel.load(
        cfg, random_weights=True, device="cuda", dtype="bfloat16", decoder="lite", compiled=args.compile
    )
    gen = ReferenceGenerator(model)
    timer = ForwardTimer(model.dit)
    fpc = cfg.latent_frames_per_chunk
    fill = math.ceil((args.sink + args.window) / fpc) + 1  # chunks until the window is full
    request = GenerationRequest(
        seed=0, num_chunks=fill + args.chunks, prompt="a walk", kv_mode=args.kv_mode, open_ended=True
    )

    # Warm-up run (kernel selection, allocator), then the measured one.
    gen.generate(dataclasses.replace(request, num_chunks=fill + 1))
    torch.cuda.synchronize()
    timer.on = True
    t0 = time.perf_counter()
    gen.generate(request)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    timer.on = False
    full = max(r[3] for r in timer.records)
    measured = [r for r in timer.records if r[3] == full]
    seconds = [s.elapsed_time(e) / 1000 for s, e, _, _ in measured]
    flops = forward_flops(cfg, measured[0][2], full)
    attn = attention_flops(cfg, measured[0][2], full)
    per_forward = sorted(seconds)[len(seconds) // 2]
    peak = matmul_peak_tflops()
    achieved = flops / per_forward / 1e12
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": vars(args),
        "query_frames": measured[0][2],
        "key_frames": full,
        "tokens_per_frame": cfg.tokens_per_frame,
        "forwards_measured": len(seconds),
        "forward_s": {"median": per_forward, "min": min(seconds), "max": max(seconds)},
        "forward_tflop": flops / 1e12,
        "attention_tflop": attn / 1e12,
        "achieved_tflops": achieved,
        "matmul_peak_tflops": peak,
        "efficiency": achieved / peak,
        "wall_s_of_measured_run": wall,
    }
    if args.paged:
        result["paged"] = []
        for batch in (int(b) for b in args.paged.split(",")):
            for graphed in (False, True):
                row = paged_forward(model, batch, graphed)
                row["efficiency"] = row["achieved_tflops"] / peak
                result["paged"].append(row)
                torch.cuda.empty_cache()
    if args.profile:
        result["profile_one_run"] = profile_categories(
            model, gen, dataclasses.replace(request, num_chunks=fill + 1)
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--frame-size", default="480x832", help="height x width (default 480x832)")
    p.add_argument("--window", type=int, default=18, help="attention window in latent frames (default 18)")
    p.add_argument("--sink", type=int, default=3, help="sink frames (default 3)")
    p.add_argument("--chunks", type=int, default=4, help="chunks measured at a full window (default 4)")
    p.add_argument("--kv-mode", default="final", choices=("clean", "final", "noisy"), help="default final")
    p.add_argument("--compile", action="store_true", help="the compiled elementwise paths (--compile)")
    p.add_argument("--profile", action="store_true", help="kernel time by kind over one more run")
    p.add_argument("--paged", metavar="B,B", help="also the engine's paged forward at these batch sizes")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    result = run(args)
    r = result
    print(
        f"{r['machine']}: one DiT forward of {r['query_frames']} frames over {r['key_frames']} "
        f"({r['tokens_per_frame']} tokens each): {r['forward_s']['median'] * 1e3:.1f} ms median of "
        f"{r['forwards_measured']}, {r['forward_tflop']:.1f} TFLOP ({r['attention_tflop']:.1f} attention): "
        f"{r['achieved_tflops']:.0f} TFLOP/s = {r['efficiency']:.1%} of the bf16 matmul rate measured "
        f"here ({r['matmul_peak_tflops']:.0f} TFLOP/s)"
    )
    for row in result.get("paged", []):
        how = "CUDA graph" if row["cuda_graphs"] else "eager blocks"
        print(
            f"engine forward, {row['batch']} unit(s), {how}: "
            f"{row['forward_s'] * 1e3:.1f} ms on the GPU (host {row['host_s_per_forward'] * 1e3:.1f} ms), "
            f"{row['achieved_tflops']:.0f} TFLOP/s = {row['efficiency']:.1%}"
        )
    if "profile_one_run" in result:
        prof = result["profile_one_run"]
        print(f"kernel time of one run: {prof['kernel_ms']:.0f} ms")
        for kind, ms in prof["by_kind_ms"].items():
            print(f"  {kind:34s} {ms:8.1f} ms  {ms / prof['kernel_ms']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
