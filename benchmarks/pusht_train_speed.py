"""How fast `streamworld train pusht` trains, for the shipped model shape and larger ones.

Each variant builds a `Trainer` on a small recorded data set, runs `--warmup` steps, then
times `--steps` training steps (synchronised on a GPU). It reports steps/s, clips/s, peak
GPU memory and an analytic count of the model's FLOPs per step, so the rate can be read
against the device's own limit (`--peak-tflops`: an H200's dense bf16 is 989). With
`--profile`, the first variant's kernels are profiled over three steps. `--compile both`
times each variant eagerly and through torch.compile (`train pusht --compile`), one after
the other; the first step's time, which includes the compilation, is reported apart.

    python benchmarks/pusht_train_speed.py --device cuda --compile both --json train_speed.json

A variant is `name=layers,heads,ffn,batch[,clip_chunks[,unroll_share]]` (the width is
heads x 32, as in the shipped model; `clip_chunks` as `train pusht --clip-chunks`, longer
stream clips that train every chunk; each row says how many chunks a clip trains on
average; `unroll_share` as `train pusht --unroll-share`, that share of each batch trained
on the unrolled one-step sampler); the defaults are the shipped shape at batch 128 and
512, 10 layers, and width 256:

    python benchmarks/pusht_train_speed.py --device cuda --compile on shipped=6,6,768,128 \
        stream5=6,6,768,128,5 unroll5=6,6,768,128,5,0.25
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from streamworld.bench import write_json
from streamworld.models.config import ModelConfig
from streamworld.models.presets import PUSHT
from streamworld.pusht.data import DatasetSpec
from streamworld.pusht.train import TrainConfig, Trainer, clip_layout, prepare_data

DEFAULT_VARIANTS = (
    "shipped=6,6,768,128",
    "batch512=6,6,768,512",
    "10-layers=10,6,768,128",
    "width256=6,8,1024,128",
)


def variant_config(layers: int, heads: int, ffn: int) -> ModelConfig:
    dit = {**PUSHT.dit, "num_layers": layers, "num_attention_heads": heads, "ffn_dim": ffn}
    return dataclasses.replace(PUSHT, dit=dit, builtin_weights=None)


def model_flops(
    config: ModelConfig, batch: int, chunks: int | None = None, unrolled: int = 0
) -> float | None:
    """FLOPs of one training step (forward and backward): 6 x matrix parameters x tokens for
    the blocks' linear layers, and 12 x head width x attended (query, key) pairs x heads for
    self-attention (the frame mask's pairs only); `unrolled` of the `batch` clips run the
    unrolled sampler's forwards instead, one per chunk (None where the code timed has no
    `unroll_layouts`: the script also times older commits)."""
    d = config.dit
    width = d["num_attention_heads"] * d["attention_head_dim"]
    per_block = 4 * width * width + 2 * width * d["ffn_dim"] + 2 * width * width  # self, ffn, cross q/out
    tokens_per_frame = (config.height // d["patch_size"][1]) * (config.width // d["patch_size"][2])

    def flops(mask: torch.Tensor) -> float:
        tokens = mask.shape[0] * tokens_per_frame
        pairs = int(mask.sum()) * tokens_per_frame**2
        return 6 * d["num_layers"] * per_block * tokens + 12 * d["num_layers"] * pairs * width

    total = (batch - unrolled) * flops(clip_layout(config, chunks=chunks)[1])
    if unrolled:
        try:
            from streamworld.pusht.train import unroll_layouts
        except ImportError:
            return None
        assert chunks is not None, "the unrolled objective needs stream clips"
        # cut[1], the mask: also in the plain tuples of the commit that introduced the cuts.
        total += unrolled * sum(flops(cut[1]) for cut in unroll_layouts(config, chunks))
    return float(total)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(data, spec: str, device: str, warmup: int, steps: int, profile: bool, compiled: bool) -> dict:
    name, shape = spec.split("=")
    layers, heads, ffn, batch, *rest = shape.split(",")
    layers, heads, ffn, batch = int(layers), int(heads), int(ffn), int(batch)
    clip_chunks = int(rest[0]) if rest else None
    unroll_share = float(rest[1]) if len(rest) > 1 else 0.0
    config = variant_config(layers, heads, ffn)
    # unroll_share only where asked: older commits, without it, are timed too.
    unroll = {"unroll_share": unroll_share} if unroll_share else {}
    train_config = TrainConfig(
        batch_size=batch, total_steps=10**9, compile=compiled, clip_chunks=clip_chunks, **unroll
    )
    trainer = Trainer(config, train_config, data, tempfile.mkdtemp(), device)
    dev = trainer.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    trainer.train_step()
    _sync(dev)
    first = time.perf_counter() - start
    for _ in range(warmup):
        trainer.train_step()
    _sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    _sync(dev)
    seconds = (time.perf_counter() - start) / steps
    flops = model_flops(config, batch, clip_chunks, round(unroll_share * batch))
    # Chunks a clip trains, on average over 512 clips (default clips: all of those that start
    # at the episode start, the last of the others; stream clips: all).
    trained = float(trainer.batcher.sample(512)["loss_chunks"].float().sum(1).mean())
    row = {
        "name": name,
        "compiled": compiled,
        "first_step_s": round(first, 2),
        "layers": layers,
        "width": heads * config.dit["attention_head_dim"],
        "ffn": ffn,
        "batch": batch,
        "clip_chunks": trainer.batcher.num_chunks,
        "unroll_share": unroll_share,
        "chunks_trained_per_clip": round(trained, 2),
        "chunks_trained_per_second": round(batch * trained / seconds, 1),
        "parameters_m": round(sum(p.numel() for p in trainer.dit.parameters()) / 1e6, 2),
        "step_ms": round(seconds * 1e3, 1),
        "steps_per_second": round(1 / seconds, 2),
        "clips_per_second": round(batch / seconds, 1),
        "model_tflop_per_step": None if flops is None else round(flops / 1e12, 6),
        "model_tflops": None if flops is None else round(flops / seconds / 1e12, 3),
    }
    if dev.type == "cuda":
        row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 1)
    if profile:
        _profile(trainer)
    return row


def _profile(trainer: Trainer) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            trainer.train_step()
        _sync(trainer.device)
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument(
        "variants",
        nargs="*",
        default=list(DEFAULT_VARIANTS),
        help="name=layers,heads,ffn,batch[,clip_chunks[,unroll_share]]",
    )
    p.add_argument("--episodes", type=int, default=256, help="episodes of the recorded data (default 256)")
    p.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "pusht-train-speed-data"))
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--steps", type=int, default=25, help="timed steps (default 25)")
    p.add_argument("--profile", action="store_true", help="profile the first variant's kernels")
    p.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        default="off",
        help="the training forward eager (off), through torch.compile (on), or each variant both "
        "ways (default off)",
    )
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 TFLOP/s")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    if min(args.episodes, args.steps) < 1 or args.warmup < 0:
        p.error("--episodes and --steps must be at least 1, --warmup at least 0")
    for v in args.variants:
        if v.count("=") != 1 or len(v.split("=")[1].split(",")) not in (4, 5, 6):
            p.error(f"a variant is name=layers,heads,ffn,batch[,clip_chunks[,unroll_share]], not {v!r}")
    data = prepare_data(args.data, DatasetSpec(episodes=args.episodes, steps=150, seed=1, push_share=0.85))
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    rows = []
    for i, (v, compiled) in enumerate(itertools.product(args.variants, modes)):
        rows.append(measure(data, v, args.device, args.warmup, args.steps, args.profile and i == 0, compiled))
        tflops = rows[-1]["model_tflops"]
        rows[-1]["share_of_peak"] = None if tflops is None else round(tflops / args.peak_tflops, 4)
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "benchmark": "pusht_train_speed",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "variants": rows,
    }
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
