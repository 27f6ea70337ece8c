"""StreamWorld load generator: many WebSocket sessions against a running server.

    python loadtests/run.py --url ws://127.0.0.1:8000/v1/stream --duration 60 --json out.json \\
        [--model M] [--arrival-rate PER_S | --sessions N] [options]

Two ways to offer load:

- `--arrival-rate R`: open loop. Sessions arrive as a Poisson process of R per second for
  `--duration` seconds, whatever the server's state, each with its own length
  (`--session-chunks`, exponentially distributed around the mean; 0 = until the run ends).
  Sessions with a length run to completion after the run's end (up to `--drain` seconds).
- `--sessions N`: N sessions start together and run until the run ends (unless they are
  cancelling ones).

Each session draws a priority and a wire format from the mixes given, and may be a
cancelling session (it drops the connection, with no `session.stop`, after a random share
of its chunks) or a slow reader (it reads each chunk `--slow-factor` times slower than real
time, so the server's backpressure must hold it back without hurting the others). For
action models every session sends one action per video frame at the stream's frame rate.

The client does not decode video: it checks each payload against its announced size and
times its arrival. Per session and overall it reports time to first frame, inter-chunk
gaps (p50/p95/p99) and their jitter, the real-time factor, chunk deadline attainment
against a simulated playout buffer (playback starts `--playout-buffer` seconds after the
first chunk; a chunk that arrives after its first frame was due stalls playback until it
arrives), stalls (count and seconds), action-to-frame latency (from sending the action for
frame n to receiving the chunk that holds frame n+1) and errors by kind. It reads the
server's /metrics before and after, and checks that the KV pages go back to 0 once every
session has ended.

Output: a table on stdout and, with `--json`, everything as JSON. Exit code 0 when the run
completed (whatever it measured), 1 when the server's KV pages did not return to 0 or a
session broke the protocol, 2 for bad arguments.

The code is split by concern: `plan.py` draws the sessions, `viewer.py` plays one session
and records what it saw, `report.py` derives the figures, the JSON and the table,
`server_http.py` reads the server's /v1/models and /metrics, and this file ties them
together. It runs as a script (`python loadtests/run.py`) or as `python -m loadtests.run`,
and imports nothing of the server: the load generator is a client.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a script, Python puts loadtests/ itself on sys.path, not the repository root that
    # holds the `loadtests` package its siblings are imported from.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtests.plan import FORMATS, PRIORITIES, LoadConfig, SessionPlan, parse_mix, plan_sessions
from loadtests.report import (
    build_result,
    check,
    format_report,
    playout,
    session_metrics,
    summarise,
    write_json,
)
from loadtests.server_http import fetch_metrics, fetch_model, http_base, wait_instances_free, wait_pages_free
from loadtests.viewer import SessionRecord, Viewer

# The load generator's import surface (tests, notebooks): `from loadtests import run` gives
# the plan, the run and the figures without knowing which sibling owns each.
__all__ = [
    "FORMATS",
    "PRIORITIES",
    "LoadConfig",
    "SessionPlan",
    "SessionRecord",
    "Viewer",
    "build_parser",
    "check",
    "config_from_args",
    "format_report",
    "main",
    "parse_mix",
    "plan_sessions",
    "playout",
    "run_load",
    "session_metrics",
    "summarise",
]


# --- the run -----------------------------------------------------------------------------------
async def run_load(cfg: LoadConfig, progress: bool = True) -> dict[str, Any]:
    base = http_base(cfg.url)
    model = await fetch_model(base, cfg.model)
    before = await fetch_metrics(base)
    plans = plan_sessions(cfg)
    stop_event = asyncio.Event()
    t0 = time.monotonic()
    viewers = [Viewer(cfg, model, p, t0, stop_event) for p in plans]

    async def launch(v: Viewer) -> SessionRecord:
        await asyncio.sleep(max(0.0, v.plan.start_at - (time.monotonic() - t0)))
        return await v.run()

    tasks = [asyncio.create_task(launch(v)) for v in viewers]
    ticker = asyncio.create_task(_progress(viewers, cfg.duration_s, t0)) if progress else None
    await asyncio.sleep(cfg.duration_s)
    stop_event.set()
    # Sessions with a length of their own run to completion after the offered load ends, up
    # to the drain time; the rest were told to stop by the event.
    _, pending = await asyncio.wait(tasks, timeout=cfg.drain_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if ticker is not None:
        ticker.cancel()
        print(file=sys.stderr)
    wall = time.monotonic() - t0
    after = await wait_pages_free(base)
    records = [v.rec for v in viewers]
    instances = {r.instance for r in records if r.instance is not None}
    per_instance = await wait_instances_free(base, instances) if instances else None
    return build_result(cfg, model, records, wall, before, after, per_instance)


async def _progress(viewers: list[Viewer], duration: float, t0: float) -> None:
    """One line rewritten in place on a terminal; a line every 10 s into a log file."""
    tty = sys.stderr.isatty()
    while True:
        t = time.monotonic() - t0
        live = sum(1 for v in viewers if v.rec.started_at is not None and v.rec.end == "unfinished")
        chunks = sum(len(v.rec.chunk_times) for v in viewers)
        line = f"{min(t, duration):6.1f}/{duration:.0f} s  sessions live {live:3d}  chunks {chunks:6d}"
        print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
        await asyncio.sleep(1.0 if tty else 10.0)


# --- command line --------------------------------------------------------------------------------
def _add_session_mix(p: argparse.ArgumentParser) -> None:
    """What the offered sessions are like: length, cancellations, slow readers, priorities, formats."""
    p.add_argument(
        "--session-chunks",
        type=float,
        default=8.0,
        help="mean session length in chunks (exponential) with --arrival-rate; 0 = until the run ends "
        "(default %(default)s)",
    )
    p.add_argument(
        "--cancel-share",
        type=float,
        default=0.1,
        help="share of sessions that disconnect (default %(default)s)",
    )
    p.add_argument(
        "--slow-share",
        type=float,
        default=0.1,
        help="share of sessions that read slowly (default %(default)s)",
    )
    p.add_argument(
        "--slow-factor",
        type=float,
        default=3.0,
        help="a slow reader takes this many times real time (default %(default)s)",
    )
    p.add_argument(
        "--priorities",
        default="interactive:1,standard:2,batch:1",
        help="priority mix, name:weight,... (default %(default)s)",
    )
    p.add_argument(
        "--formats",
        default="jpeg:1,h264:1",
        help="wire format mix, name:weight,... (default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python loadtests/run.py",
        description=__doc__.split("\n\n")[0] + " Open-loop Poisson arrivals (--arrival-rate) or N held "
        "sessions (--sessions); reports latency, jitter, real-time factor, playout deadlines, stalls, "
        "action-to-frame latency and errors, and checks the server frees every KV page.",
    )
    p.add_argument("--url", required=True, help="the server's stream endpoint, ws://HOST:PORT/v1/stream")
    p.add_argument("--duration", type=float, required=True, help="seconds of offered load")
    p.add_argument("--json", metavar="OUT", help="write the full result (every session) as JSON")
    p.add_argument("--model", help="model id (default: the server's default model)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--arrival-rate", type=float, metavar="PER_S", help="Poisson arrivals per second")
    load.add_argument("--sessions", type=int, metavar="N", help="N sessions held for the whole run")
    _add_session_mix(p)
    p.add_argument("--kv-mode", choices=("clean", "final", "noisy"), help="KV mode (default: the model's)")
    p.add_argument(
        "--prompt",
        default="a walk through a forest",
        help="prompt (text models only; default %(default)r)",
    )
    p.add_argument(
        "--playout-buffer",
        type=float,
        default=0.5,
        help="seconds the simulated player buffers first (default %(default)s)",
    )
    p.add_argument("--no-actions", action="store_true", help="do not send actions to action models")
    p.add_argument(
        "--ack",
        action="store_true",
        help="acknowledge each chunk once read (protocol extension): the server then holds a slow "
        "reader's lag to a few chunks by pausing its stream, instead of letting socket buffers fill",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="seconds for sessions to end after the run (default %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the session plan (arrivals, mixes, lengths; default %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    if args.duration <= 0:
        raise ValueError("--duration must be positive")
    if args.arrival_rate is not None and args.arrival_rate <= 0:
        raise ValueError("--arrival-rate must be positive")
    if args.sessions is not None and args.sessions < 1:
        raise ValueError("--sessions must be at least 1")
    for name in ("cancel_share", "slow_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be between 0 and 1")
    if args.slow_factor <= 1.0:
        raise ValueError("--slow-factor must be above 1 (a slow reader reads slower than real time)")
    if args.session_chunks < 0 or args.playout_buffer < 0 or args.drain < 0:
        raise ValueError("--session-chunks, --playout-buffer and --drain must be at least 0")
    http_base(args.url)
    return LoadConfig(
        url=args.url,
        duration_s=args.duration,
        model=args.model,
        arrival_rate=args.arrival_rate,
        sessions=args.sessions,
        session_chunks=args.session_chunks,
        cancel_share=args.cancel_share,
        slow_share=args.slow_share,
        slow_factor=args.slow_factor,
        priorities=parse_mix(args.priorities, PRIORITIES, "--priorities"),
        formats=parse_mix(args.formats, FORMATS, "--formats"),
        kv_mode=args.kv_mode,
        prompt=args.prompt,
        playout_buffer_s=args.playout_buffer,
        send_actions=not args.no_actions,
        ack=args.ack,
        drain_s=args.drain,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        parser.exit(2, f"{parser.prog}: error: --json: folder {Path(args.json).parent} does not exist\n")
    try:
        result = asyncio.run(run_load(cfg, progress=not args.quiet))
    except OSError as e:
        print(f"{parser.prog}: cannot reach the server at {http_base(cfg.url)}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    problems = check(result)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
