"""Wan 1.3B across several GPUs: every placement of the multi-GPU study, each run once.

    python benchmarks/multi_gpu.py --out multi/            # on a host with 4 (or 2) GPUs
    python benchmarks/multi_gpu.py --out dry/ --dry-run    # the same runs, short, on one GPU

`wan2.1-t2v-1.3b --random-weights`, bf16, 4 steps, 3 latent frames per chunk. Each run is
one `streamworld bench` (or, for the served run, `streamworld serve` under
`loadtests/run.py`) in its own process, so that no run inherits another's GPU memory; each
writes its JSON into `--out`, and `summary.json` collects the figures:

1. One 480x832 stream, `noisy`, unpaced, a stage pipeline over 1, 2 and 4 GPUs, with the
   lite decoder and with the Wan VAE decoder: frames/s, first frame, per-GPU busy share,
   copy time between stages.
2. Real-time 320x512 streams on replicas over 1, 2 and 4 GPUs: the most streams that keep
   >= 99% of chunk deadlines at 16 frames/s (stream counts tried in steps of 4 per GPU).
3. Mixed, on 4 GPUs: 2 replicas of 2-stage pipelines, 4 replicas, one 4-stage pipeline,
   16 paced 320x512 streams each.
4. Served: `streamworld serve` with a replica per GPU under `loadtests/run.py` (held
   sessions, then Poisson arrivals with cancellations): first frame, inter-chunk p99,
   deadlines, errors, and every K/V page back.

`--dry-run` runs the same code paths on one GPU: every "GPU" is `cuda:0` (the stages and
replicas time-share it), runs last 4 s, the capacity search tries two counts, and
`--compile` is left out. Its figures check the script, not the hardware.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAN = "wan2.1-t2v-1.3b"


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.dry = args.dry_run
        self.model = args.model
        # A dry run puts every "GPU" on cuda:0, or on the CPU where there is no GPU (tests).
        self.home = "cuda:0" if args.has_cuda else "cpu"
        self.base = ["--model", args.model, "--no-baseline"] + (
            ["--random-weights"] if args.model == WAN else []
        )
        # The study's geometries are Wan's; a small test model keeps its own.
        wan = args.model == WAN
        self.small = ["--frame-size", "320x512", "--window", "6", "--token-budget", "16384"] if wan else []
        self.large = ["--token-budget", "8192"] if wan else []
        self.gpus = [g for g in (1, 2, 4) if g <= args.gpus]
        self.duration = min(4.0, args.duration) if self.dry else args.duration
        self.summary: dict = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "dry_run": self.dry,
        }

    def devices(self, n: int) -> str:
        return ",".join(self.home if self.dry else f"cuda:{i}" for i in range(n))

    def bench(self, name: str, *flags: str) -> dict:
        """One `streamworld bench` run in its own process; its JSON, or the error."""
        path = self.out / f"{name}.json"
        extra = [] if self.dry else ["--compile"]
        cmd = [
            sys.executable,
            "-m",
            "streamworld",
            "bench",
            *self.base,
            *extra,
            "--duration",
            str(self.duration),
        ]
        cmd += [*flags, "--json", str(path)]
        print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-2000:], sep="\n", flush=True)
            return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"], "command": cmd[3:]}
        result = json.loads(path.read_text())
        return {"command": cmd[3:], **_figures(result)}

    def pipelines(self) -> None:
        runs = {}
        for decoder in ("lite", "wan"):
            for n in self.gpus:
                placement = ["--devices", self.devices(n), "--placement", "pipeline"] if n > 1 else []
                runs[f"{decoder}-{n}gpu"] = self.bench(
                    f"pipeline-480-{decoder}-{n}gpu",
                    *("--streams", "1", "--unpaced", "--kv-mode", "noisy", "--decoder", decoder),
                    *self.large,
                    *placement,
                )
        self.summary["pipeline_480x832_one_stream"] = runs

    def capacity(self) -> None:
        """The most paced 320x512 streams at >= 99% of deadlines, per GPU count."""
        found = {}
        for n in self.gpus:
            counts = [8 * n, 12 * n] if self.dry else [4 * k * n for k in range(2, 9)]
            best, tried = 0, {}
            for count in counts:
                placement = ["--devices", self.devices(n)] if n > 1 else []
                r = self.bench(
                    f"replicas-320-{n}gpu-{count}",
                    *(
                        "--streams",
                        str(count),
                        "--kv-mode",
                        "noisy",
                        "--decoder",
                        "lite",
                        *self.small,
                        *placement,
                    ),
                )
                tried[count] = r
                if r.get("deadline_attainment", 0.0) < 0.99:
                    break
                best = count
            found[f"{n}gpu"] = {"streams_held": best, "runs": tried}
        self.summary["replicas_320x512_capacity"] = found

    def mixed(self) -> None:
        if 4 not in self.gpus:
            return
        d = self.devices(4).split(",")
        layouts = {
            "2 replicas of 2 stages": f"0-14@{d[0]},15-29@{d[1]}|0-14@{d[2]},15-29@{d[3]}",
            "4 replicas": "replicas",
            "one 4-stage pipeline": "pipeline",
        }
        runs = {}
        for label, placement in layouts.items():
            runs[label] = self.bench(
                f"mixed-{label.replace(' ', '-')}",
                *("--streams", "16", "--kv-mode", "noisy", "--decoder", "lite", *self.small),
                *("--devices", ",".join(d), "--placement", placement),
            )
        self.summary["mixed_4gpu_16_streams"] = runs


def _figures(result: dict) -> dict:
    """What the study's tables need from one `streamworld bench` result."""
    e = result["engine"]
    return {
        "fps": e.get("aggregate_fps"),
        "ttff_s": e.get("ttff_s"),
        "inter_chunk_p99_s": (e.get("inter_chunk_s") or {}).get("p99"),
        "deadline_attainment": e.get("deadline_attainment"),
        "device_busy_share": e.get("device_busy_share"),
        "stage_copies": e.get("stage_copies"),
        "per_replica": e.get("per_replica"),
    }


def served(study: Study) -> None:
    """`streamworld serve` with a replica per GPU under the load generator."""
    n = max(study.gpus)
    port = _free_port()
    cmd = [sys.executable, "-m", "streamworld", "serve", *[f for f in study.base if f != "--no-baseline"]]
    cmd += [
        *study.small,
        "--decoder",
        "lite",
        "--port",
        str(port),
        "--max-sessions",
        "16",
        "--max-queue",
        "32",
    ]
    if n > 1:
        cmd += ["--devices", study.devices(n)]
    if not study.dry:
        cmd.append("--compile")
    print(f"[served] {' '.join(cmd[3:])}", flush=True)
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(port, server)
        url = f"ws://127.0.0.1:{port}/v1/stream"
        runs = {}
        for label, load in (("held", ["--sessions", str(8 * n)]), ("poisson", ["--arrival-rate", str(n)])):
            path = study.out / f"served-{label}.json"
            lt = [sys.executable, "loadtests/run.py", "--url", url, "--duration", str(study.duration * 3)]
            lt += [*load, "--cancel-share", "0.2", "--quiet", "--json", str(path)]
            done = subprocess.run(lt, cwd=ROOT, capture_output=True, text=True)
            result = json.loads(path.read_text()) if path.exists() else {}
            overall = result.get("overall", {})
            runs[label] = {
                "exit_code": done.returncode,  # 1: pages not back or protocol errors
                "ttff_p50_s": (overall.get("ttff_s") or {}).get("p50"),
                "inter_chunk_p99_s": (overall.get("inter_chunk_s") or {}).get("p99"),
                "deadline_attainment": overall.get("deadline_attainment"),
                "errors": overall.get("errors"),
                "kv_pages_used_after": (result.get("server") or {}).get("kv_pages_used_after"),
            }
        study.summary[f"served_{n}gpu"] = runs
    finally:
        server.terminate()
        server.wait(timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start") from None
            time.sleep(1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for every run's JSON and summary.json")
    p.add_argument("--gpus", type=int, help="GPUs to use (default: all PyTorch sees; 1 with --dry-run)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per bench run (default 20)")
    p.add_argument("--dry-run", action="store_true", help="every run short, on cuda:0 only (see above)")
    p.add_argument("--only", help="comma list of pipelines,capacity,mixed,served (default: all)")
    p.add_argument("--model", default=WAN, help=f"model preset (default {WAN}; others keep their geometry)")
    args = p.parse_args()
    import torch

    args.has_cuda = torch.cuda.is_available()
    if args.gpus is None:
        args.gpus = 4 if args.dry_run else torch.cuda.device_count()
    if not args.dry_run and args.gpus > torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus}: PyTorch sees {torch.cuda.device_count()} GPUs (try --dry-run)")
    study = Study(args)
    parts = {"pipelines": study.pipelines, "capacity": study.capacity, "mixed": study.mixed}
    parts["served"] = lambda: served(study)
    for name in (args.only or ",".join(parts)).split(","):
        parts[name]()
        (study.out / "summary.json").write_text(json.dumps(study.summary, indent=1))
    print(json.dumps(study.summary, indent=1))


if __name__ == "__main__":
    main()
