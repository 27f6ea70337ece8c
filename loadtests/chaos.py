"""StreamWorld soak and chaos suite: abuse a server for a while, then check it is unharmed.

    python loadtests/chaos.py --duration 120 --json chaos.json [--model tiny-wan] [-- SERVE FLAGS]
    python loadtests/chaos.py --url ws://127.0.0.1:8000/v1/stream --pid PID --duration 600

It starts `streamworld serve` itself (or targets `--url`), and for `--duration` seconds (or
`--sessions` chaos cases) runs `--concurrency` workers of misbehaving clients: TCP resets at
every stage of a session, invalid first messages and invalid messages inside sessions, binary
frames. Meanwhile bystander sessions (which must get every chunk in order), slow readers and
optionally a long stream run. It samples the server process's RSS, threads and open file
descriptors and its `/metrics`, scans its log, optionally SIGTERMs it under load, writes a
JSON report and exits 1 if anything is wrong (`loadtests/README.md` lists the checks).
It imports nothing of the server: it is a client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a script, Python puts loadtests/ on sys.path, not the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtests import chaos_cases as cases
from loadtests.chaos_report import failures, format_table, resources, summarise_cases, summarise_views
from loadtests.proc import ServerProcess, sample_process, scan_log, start_server, wait_ready
from loadtests.server_http import fetch_metrics, fetch_model, http_base

CASE_WEIGHTS = {
    "disconnect:before_start": 1.0,
    "disconnect:queued": 1.5,
    "disconnect:mid_chunk": 1.0,
    "disconnect:after_stop": 1.0,
    "bad_first": 2.0,
    "bad_in_session": 1.0,
    "binary_in_session": 0.5,
}


@dataclass
class ChaosConfig:
    url: str | None = None
    pid: int | None = None
    server_log: str | None = None
    model: str = "tiny-wan"
    device: str = "cpu"
    serve_args: list[str] = field(default_factory=list)
    duration_s: float = 60.0
    sessions: int = 0  # chaos cases to make; 0 = as many as --duration allows
    concurrency: int = 8
    bystanders: int = 2
    bystander_chunks: int = 4
    slow_readers: int = 1
    slow_factor: float = 2.0
    queue_fill: int = 8  # sessions a `queued` disconnect may hold to make the server queue one
    bad_per_session: int = 4
    bad_session_chunks: int = 3
    long_stream_s: float = 0.0
    sigterm: bool = False
    grace_s: float = 20.0
    warmup_s: float = 10.0
    sample_every_s: float = 2.0
    idle_timeout_s: float = 20.0
    startup_timeout_s: float = 180.0
    rss_growth: float = 0.10
    thread_slack: int = 4
    fd_slack: int = 8
    seed: int = 0
    json_path: str | None = None


@dataclass
class Run:
    """What one run shares between its tasks."""

    cfg: ChaosConfig
    url: str
    model: dict[str, Any]
    pid: int | None
    t0: float
    deadline: float
    stop: asyncio.Event
    made: int = 0
    outcomes: list[cases.Outcome] = field(default_factory=list)
    views: dict[str, list[cases.ViewRecord]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def more(self) -> bool:
        return time.monotonic() < self.deadline and (not self.cfg.sessions or self.made < self.cfg.sessions)


async def play_case(run: Run, kind: str, rng: random.Random) -> list[cases.Outcome]:
    url, model, seed = run.url, run.model, rng.randrange(2**31)
    if kind.startswith("disconnect:"):
        return [await cases.disconnect(url, model, kind.split(":", 1)[1], seed, run.cfg.queue_fill)]
    if kind == "bad_first":
        table = cases.bad_first_messages(model)
        name = rng.choice(sorted(table))
        return [await cases.bad_first(url, name, *table[name])]
    if kind == "bad_in_session":
        names = rng.sample(sorted(cases.bad_session_messages(model)), run.cfg.bad_per_session)
        return await cases.bad_in_session(url, model, names, seed, run.cfg.bad_session_chunks)
    return [await cases.binary_in_session(url, model, seed)]


async def chaos_worker(run: Run, worker: int) -> None:
    rng = random.Random(run.cfg.seed * 1009 + worker)
    kinds, weights = list(CASE_WEIGHTS), list(CASE_WEIGHTS.values())
    while run.more():
        run.made += 1
        kind = rng.choices(kinds, weights)[0]
        try:
            run.outcomes += await asyncio.wait_for(play_case(run, kind, rng), 120)
        except (OSError, asyncio.TimeoutError) as e:  # could not connect, or the case hung
            run.outcomes.append(cases.Outcome(kind, "internal", f"{type(e).__name__}: {e}"))


async def view_loop(run: Run, kind: str, slow_factor: float, worker: int) -> None:
    """Back-to-back well-behaved sessions of `bystander_chunks` chunks until the run ends."""
    rng = random.Random(run.cfg.seed * 7919 + worker)
    while time.monotonic() < run.deadline:
        rec = await cases.view(
            run.url, run.model, kind, run.cfg.bystander_chunks, rng.randrange(2**31), slow_factor
        )
        run.views.setdefault(kind, []).append(rec)


async def long_stream(run: Run) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(run.cfg.long_stream_s, stop.set)
    run.views["long_stream"] = [await cases.view(run.url, run.model, "long_stream", None, 1, stop=stop)]


async def http_json(url: str) -> dict[str, Any]:
    def get() -> dict[str, Any]:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    return await asyncio.to_thread(get)


async def snapshot(run: Run) -> dict[str, Any]:
    """One sample: the process's resources and the server's K/V pages and sessions."""
    s: dict[str, Any] = {"t": round(time.monotonic() - run.t0, 2)}
    s.update((sample_process(run.pid) if run.pid else None) or {"rss_kb": None, "threads": None, "fds": None})
    try:
        m = await fetch_metrics(http_base(run.url))
        s["kv_pages_used"] = m.get("streamworld_kv_pages_used")
        s["sessions_active"] = m.get("streamworld_sessions_active")
        s["sessions_waiting"] = m.get("streamworld_sessions_waiting")
        s["healthz_sessions"] = (await http_json(f"{http_base(run.url)}/healthz")).get("sessions")
    except OSError as e:
        s["http_error"] = repr(e)
    return s


async def sampler(run: Run) -> None:
    while not run.stop.is_set():
        run.samples.append(await snapshot(run))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(run.stop.wait(), run.cfg.sample_every_s)


async def wait_idle(run: Run) -> dict[str, Any]:
    """A sample once no page or session is in use (or the last one after `idle_timeout_s`)."""
    deadline = time.monotonic() + run.cfg.idle_timeout_s
    while True:
        s = await snapshot(run)
        busy = any(
            s.get(k) for k in ("kv_pages_used", "sessions_active", "sessions_waiting", "healthz_sessions")
        )
        if (not busy and "http_error" not in s) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.5)


async def sigterm_under_load(run: Run, server: ServerProcess) -> dict[str, Any]:
    """SIGTERM while two sessions stream and one connection has not started: the server must
    exit 0 within the grace, the sessions get `session.done stopped` (close 1000) or 1001."""
    streams = [asyncio.create_task(cases.view(run.url, run.model, "shutdown", None, i)) for i in range(2)]
    idle_ws = await cases.open_ws(run.url)
    idle = asyncio.create_task(cases.drain(idle_ws, run.cfg.grace_s + 10))
    await asyncio.sleep(3.0)  # the streams are past their first chunk
    rc, took = await asyncio.to_thread(server.terminate, run.cfg.grace_s)
    records = await asyncio.gather(*streams)
    _, idle_close = await idle
    problems = []
    if rc != 0:
        problems.append(f"exit code {rc} after {took:.1f} s (grace {run.cfg.grace_s:.0f} s)")
    for rec in records:
        if rec.errors or (rec.close_code != 1001 and (rec.end, rec.close_code) != ("stopped", 1000)):
            problems.append(f"a streaming session ended {rec.end} close {rec.close_code} {rec.errors[:2]}")
    if idle_close != 1001:
        problems.append(f"a connection without a session was closed with {idle_close}, not 1001")
    ends = [(rec.end, rec.close_code, len(rec.chunks)) for rec in records]
    return {
        "exit_code": rc,
        "seconds": round(took, 2),
        "streams": ends,
        "idle_close": idle_close,
        "problems": problems,
    }


async def soak(run: Run) -> tuple[dict | None, dict]:
    """The run itself: (the idle sample before it, the idle sample after it)."""
    cfg = run.cfg
    # One session first, so that what the server sets up lazily is not counted as growth.
    await cases.view(run.url, run.model, "prime", 2, 0)
    before = await wait_idle(run)
    run.t0 = time.monotonic()
    run.deadline = run.t0 + cfg.duration_s
    sampling = asyncio.create_task(sampler(run))
    tasks = [chaos_worker(run, i) for i in range(cfg.concurrency)]
    tasks += [view_loop(run, "bystanders", 0.0, i) for i in range(cfg.bystanders)]
    tasks += [view_loop(run, "slow_readers", cfg.slow_factor, 100 + i) for i in range(cfg.slow_readers)]
    if cfg.long_stream_s > 0:
        tasks.append(long_stream(run))
    await asyncio.gather(*tasks)
    run.stop.set()
    await sampling
    return before, await wait_idle(run)


async def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    server = None
    if cfg.url is None:
        log_path = Path(tempfile.mkdtemp(prefix="chaos-")) / "server.log"
        server = start_server(cfg.model, cfg.device, cfg.serve_args, log_path)
    try:
        if server is not None:
            await wait_ready(server, cfg.startup_timeout_s)
        url = server.url if server else cfg.url
        model = await fetch_model(http_base(url), cfg.model if server or cfg.model else None)
        pid = server.pid if server else cfg.pid
        run = Run(cfg, url, model, pid, time.monotonic(), time.monotonic(), asyncio.Event())
        before, after = await soak(run)
        sig = await sigterm_under_load(run, server) if cfg.sigterm and server else None
        if server is not None and not sig:
            server.terminate(cfg.grace_s)
        log_text = (
            server.log_text() if server else (Path(cfg.server_log).read_text() if cfg.server_log else None)
        )
    finally:
        if server is not None:
            server.kill()
    report = build_report(run, before, after, sig, log_text)
    report["server"] = {"pid": pid, "url": url, "log": str(server.log_path) if server else cfg.server_log}
    return report


def build_report(run: Run, before: dict | None, after: dict, sig: dict | None, log_text: str | None) -> dict:
    cfg = run.cfg
    proc_keys = ("rss_kb", "threads", "fds")

    def proc(s: dict | None) -> dict | None:
        return {k: s[k] for k in proc_keys} if s and s.get("rss_kb") is not None else None

    report = {
        "config": asdict(cfg),
        "model": run.model["id"],
        "elapsed_s": round(time.monotonic() - run.t0, 1),
        "cases": summarise_cases(run.outcomes),
        "bystanders": summarise_views(run.views.get("bystanders", [])),
        "slow_readers": summarise_views(run.views.get("slow_readers", [])),
        "long_stream": summarise_views(run.views.get("long_stream", [])),
        "resources": resources(run.samples, proc(before), proc(after), cfg.warmup_s),
        "idle_after": {k: v for k, v in after.items() if k not in proc_keys},
        "samples": run.samples,
        "log": scan_log(log_text) if log_text is not None else None,
        "sigterm": sig,
    }
    report["failures"] = failures(report, cfg)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python loadtests/chaos.py",
        description="Soak and chaos suite for a StreamWorld server. "
        "Flags after `--` go to `streamworld serve`.",
    )
    d = ChaosConfig()
    target = p.add_argument_group("server")
    target.add_argument("--url", help="ws://HOST:PORT/v1/stream of a running server (default: start one)")
    target.add_argument("--pid", type=int, help="with --url: the server's process id, to sample (Linux)")
    target.add_argument("--server-log", help="with --url: the server's log file, to scan")
    target.add_argument("--model", default=d.model, help=f"model to serve and use (default {d.model})")
    target.add_argument(
        "--device", default=d.device, help=f"device of the started server (default {d.device})"
    )
    run = p.add_argument_group("load")
    run.add_argument("--duration", type=float, default=d.duration_s, help="seconds of chaos (default 60)")
    run.add_argument(
        "--sessions", type=int, default=d.sessions, help="stop after N chaos cases (default 0: none)"
    )
    run.add_argument("--concurrency", type=int, default=d.concurrency, help="chaos workers (default 8)")
    run.add_argument(
        "--bystanders", type=int, default=d.bystanders, help="good sessions at all times (default 2)"
    )
    run.add_argument(
        "--bystander-chunks", type=int, default=d.bystander_chunks, help="chunks each (default 4)"
    )
    run.add_argument("--slow-readers", type=int, default=d.slow_readers, help="slow readers at all times (1)")
    run.add_argument("--slow-factor", type=float, default=d.slow_factor, help="their slowness (default 2)")
    run.add_argument("--long-stream", type=float, default=0.0, metavar="SECONDS", help="one stream kept open")
    run.add_argument("--sigterm", action="store_true", help="SIGTERM the server under load at the end")
    run.add_argument("--grace", type=float, default=d.grace_s, help="seconds it has to exit (default 20)")
    run.add_argument("--queue-fill", type=int, default=d.queue_fill, help="see README (default 8)")
    run.add_argument("--seed", type=int, default=d.seed)
    check = p.add_argument_group("checks")
    check.add_argument(
        "--warmup", type=float, default=d.warmup_s, help="seconds before the RSS baseline (10)"
    )
    check.add_argument("--sample-every", type=float, default=d.sample_every_s, help="seconds (default 2)")
    check.add_argument(
        "--rss-growth",
        type=float,
        default=d.rss_growth,
        help=(
            "limit on RSS growth under load: the median of the last window against the first"
            " after warm-up (default 0.10)"
        ),
    )
    check.add_argument("--thread-slack", type=int, default=d.thread_slack, help="threads (default 4)")
    check.add_argument("--fd-slack", type=int, default=d.fd_slack, help="file descriptors (default 8)")
    check.add_argument("--json", help="write the report here")
    return p


def config_from_args(argv: list[str]) -> ChaosConfig:
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    parser = build_parser()
    a = parser.parse_args(ours)
    if a.url is not None:
        try:
            http_base(a.url)
        except ValueError as e:
            parser.error(str(e))
        if a.sigterm:
            parser.error("--sigterm needs a server the suite starts itself (no --url)")
    if a.duration <= 0 or a.concurrency < 1 or a.sessions < 0 or a.bystander_chunks < 1 or a.slow_factor < 1:
        parser.error("--duration and --concurrency must be positive, --sessions >= 0, --slow-factor >= 1")
    return ChaosConfig(
        url=a.url, pid=a.pid, server_log=a.server_log, model=a.model, device=a.device, serve_args=serve_args,
        duration_s=a.duration, sessions=a.sessions, concurrency=a.concurrency, bystanders=a.bystanders,
        bystander_chunks=a.bystander_chunks, slow_readers=a.slow_readers, slow_factor=a.slow_factor,
        long_stream_s=a.long_stream, queue_fill=a.queue_fill, sigterm=a.sigterm, grace_s=a.grace,
        warmup_s=a.warmup,
        sample_every_s=a.sample_every, rss_growth=a.rss_growth, thread_slack=a.thread_slack,
        fd_slack=a.fd_slack, seed=a.seed, json_path=a.json,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(sys.argv[1:] if argv is None else argv)
    report = asyncio.run(run_chaos(cfg))
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=1, default=str))
    print(format_table(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
