"""Many finite streams at once: one batching engine against the sequential reference.

`train pusht --rollout-share` rolls dozens of recorded episodes out through the model every
few hundred steps. Run one at a time through `ReferenceGenerator`, every stream costs one
DiT call per chunk and denoising step; `engine.generate_all` serves them all from one
engine, whose scheduler batches their units. This times both on the same requests (PushT
first frames and random-walk actions), alternating A B A B so that a drifting machine
affects both alike, and checks that they give the same frames up to float rounding.

    python benchmarks/offline_generation.py --model pusht-delta --streams 64 --json offline.json
    python benchmarks/offline_generation.py --device cuda --streams 64 --json offline-gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

# Run as a script, Python puts benchmarks/ on sys.path, not the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamworld.engine import (
    GenerationRequest,
    ReferenceGenerator,
    StreamRequest,
    generate_all_sync,
    on_torch_thread,
)
from streamworld.models import get_preset
from streamworld.models.world_model import WorldModel, resolve_device
from streamworld.pusht.world import initial_frame


def requests(config, streams: int, chunks: int, kv_mode: str) -> list[StreamRequest]:
    """`streams` PushT streams: episode s's first frame, a random walk of the agent's target."""
    rng = np.random.default_rng(0)
    frames = chunks * config.frames_per_chunk
    low, high = config.action_range
    out = []
    for s in range(streams):
        image, _ = initial_frame(s, config.height)
        walk = rng.uniform(low, high, 2) + np.cumsum(rng.normal(0, 20, (frames, 2)), axis=0)
        actions = np.clip(walk, low, high).astype(np.float32)
        out.append(StreamRequest(seed=s, num_chunks=chunks, image=image, actions=actions, kv_mode=kv_mode))
    return out


def sequential(model: WorldModel, reqs: list[StreamRequest]) -> list[np.ndarray]:
    gen = ReferenceGenerator(model)
    return [
        gen.generate(
            GenerationRequest(r.seed, r.num_chunks, image=r.image, actions=r.actions, kv_mode=r.kv_mode)
        ).frames
        for r in reqs
    ]


def commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def timed(fn, *args) -> tuple[float, list[np.ndarray]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pusht-delta", help="a PushT model: pusht or pusht-delta (default)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--streams", type=int, default=64, help="streams served at once (default 64)")
    p.add_argument("--chunks", type=int, default=5, help="chunks per stream (default 5: a stream clip)")
    p.add_argument("--kv-mode", default="final", help="KV mode of every stream (default final)")
    p.add_argument("--repeats", type=int, default=3, help="A B pairs timed (default 3)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    if min(args.streams, args.chunks, args.repeats) < 1:
        p.error("--streams, --chunks and --repeats must be at least 1")
    config = get_preset(args.model)
    if config.environment != "pusht":
        p.error(f"--model: {args.model} is not a PushT model")
    device = resolve_device(args.device)
    # On a CPU all PyTorch work runs on the engine's one thread (engine/executor.py): a
    # second thread running operators would give the process a second OpenMP team and slow
    # both sides.
    model = on_torch_thread(device, lambda: WorldModel.load(config, device=device))
    reqs = requests(config, args.streams, args.chunks, args.kv_mode)
    on_torch_thread(device, lambda: sequential(model, reqs[:2]))  # warm-up: kernels, allocator
    generate_all_sync(model, reqs[:2])
    rows = []
    for _ in range(args.repeats):
        t_seq, seq = timed(lambda: on_torch_thread(device, lambda: sequential(model, reqs)))
        t_all, batched = timed(generate_all_sync, model, reqs)
        diff = max(
            int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(seq, batched, strict=True)
        )
        rows.append(
            {"sequential_s": round(t_seq, 3), "generate_all_s": round(t_all, 3), "max_frame_diff": diff}
        )
        print(json.dumps(rows[-1]), flush=True)
    frames = sum(len(f) for f in batched)
    seq_s = statistics.median(r["sequential_s"] for r in rows)
    all_s = statistics.median(r["generate_all_s"] for r in rows)
    result = {
        "benchmark": "offline_generation",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": "python benchmarks/offline_generation.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": commit(),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "model": args.model,
        "streams": args.streams,
        "chunks": args.chunks,
        "kv_mode": args.kv_mode,
        "frames": frames,
        "runs": rows,
        "sequential_s_median": seq_s,
        "generate_all_s_median": all_s,
        "speedup": round(seq_s / all_s, 2),
        "speedup_per_pair": [round(r["sequential_s"] / r["generate_all_s"], 2) for r in rows],
        "frames_per_s": {"sequential": round(frames / seq_s, 1), "generate_all": round(frames / all_s, 1)},
    }
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("speedup", "frames_per_s", "sequential_s_median", "generate_all_s_median")
            }
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
