"""How much `train pusht --compile-cache` saves on a machine whose compile caches are empty.

Each run is a whole `streamworld train pusht --compile --total-steps N` process, timed from
its start to its exit, with its own empty Inductor and Triton cache folders: as on a fresh
machine. Pairs run in turn, one without a cache file and one reading the file a first,
untimed run wrote, so that the ratio holds while the machine's speed drifts. The data set
is recorded once before the timed runs.

    python benchmarks/compile_cache.py --json compile_cache.json            # smoke model, CPU
    python benchmarks/compile_cache.py --full --device cuda --json out.json # the pusht model
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def _train(base: list[str], work: Path, cache: Path | None) -> float:
    """One training process with empty compile caches of its own: its wall seconds."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=work, prefix="inductor-"),
        "TRITON_CACHE_DIR": tempfile.mkdtemp(dir=work, prefix="triton-"),
    }
    run_dir = tempfile.mkdtemp(dir=work, prefix="run-")
    command = [*base, "--workdir", run_dir]
    if cache is not None:
        command += ["--compile-cache", str(cache)]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"training failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="the pusht model (default: the smoke model)")
    parser.add_argument("--device", default="cpu", help="training device (default cpu)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    parser.add_argument("--batch-size", type=int, help="clips per step (default: the command's)")
    parser.add_argument("--pairs", type=int, default=3, help="timed pairs (default 3)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.steps < 1:
        parser.error("--pairs and --steps must be at least 1")

    with tempfile.TemporaryDirectory(prefix="compile-cache-bench-") as tmp:
        work = Path(tmp)
        base = [sys.executable, "-m", "streamworld", "train", "pusht", "--compile", "--device", args.device]
        base += ["--data", str(work / "data"), "--total-steps", str(args.steps)]
        base += [] if args.full else ["--smoke"]
        base += ["--batch-size", str(args.batch_size)] if args.batch_size else []
        cache = work / "kernels.bin"
        print("recording the data and writing the cache file (untimed)", flush=True)
        _train(base, work, cache)
        rows = []
        for pair in range(args.pairs):
            without = _train(base, work, None)
            with_cache = _train(base, work, cache)
            rows.append({"without_cache_s": round(without, 2), "with_cache_s": round(with_cache, 2)})
            print(f"pair {pair + 1}: without {without:.1f} s, with the cache {with_cache:.1f} s", flush=True)
        cache_bytes = cache.stat().st_size

    ratios = [r["with_cache_s"] / r["without_cache_s"] for r in rows]
    report = {
        "benchmark": "compile_cache",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "cpus": os.cpu_count(),
        },
        "settings": vars(args),
        "cache_bytes": cache_bytes,
        "pairs": rows,
        "median_without_s": statistics.median(r["without_cache_s"] for r in rows),
        "median_with_cache_s": statistics.median(r["with_cache_s"] for r in rows),
        "median_ratio": round(statistics.median(ratios), 3),
    }
    print(json.dumps({k: v for k, v in report.items() if k.startswith("median") or k == "cache_bytes"}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
