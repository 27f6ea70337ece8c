"""The report: figures derived from the viewers' records, the JSON result, the table, the verdict.

Everything here is a pure function of what the viewers recorded and what the server's
/metrics said before and after: per-session figures (`session_metrics`), per-class summaries
(`summarise`), the whole result as one JSON-ready dict (`build_result`), the table printed on
stdout (`format_report`) and the problems that fail a run (`check`). `loadtests/README.md`
defines every figure.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

from loadtests.plan import PRIORITIES, LoadConfig
from loadtests.viewer import SessionRecord

# Stall-free playback needs every chunk before its first frame is due; closer than this
# counts as "on time" (the simulated player's scheduling slack).
PLAYOUT_SLACK_S = 0.005

# The server's counters whose change over the run goes into the result.
SERVER_COUNTERS = (
    "streamworld_frames_generated_total",
    "streamworld_chunk_deadline_miss_total",
    "streamworld_action_to_frame_seconds_sum",
    "streamworld_action_to_frame_seconds_count",
    "streamworld_time_to_first_frame_seconds_count",
    "streamworld_time_to_first_frame_seconds_sum",
)


# --- figures ------------------------------------------------------------------------------------
def playout(times: list[float], frames: list[int], fps: float | None, buffer_s: float) -> dict[str, Any]:
    """A simulated player: starts `buffer_s` after chunk 0 arrives and plays at `fps`; a chunk
    that arrives after its first frame was due stalls playback until it arrives."""
    if not times or not fps:
        return {"on_time": 0, "chunks": len(times), "stalls": 0, "stall_s": 0.0}
    start, played, stall_s, stalls, on_time = times[0] + buffer_s, 0, 0.0, 0, 0
    for t, n in zip(times, frames, strict=True):
        due = start + stall_s + played / fps
        if t <= due + PLAYOUT_SLACK_S:
            on_time += 1
        else:
            stalls += 1
            stall_s += t - due
        played += n
    return {"on_time": on_time, "chunks": len(times), "stalls": stalls, "stall_s": stall_s}


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, interpolated linearly between the two nearest values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def session_metrics(rec: SessionRecord, buffer_s: float) -> dict[str, Any]:
    gaps = [b - a for a, b in zip(rec.chunk_times, rec.chunk_times[1:], strict=False)]
    frames = sum(rec.chunk_frames)
    rtf = None
    if len(rec.chunk_times) > 1 and rec.fps:
        # Chunk 0's frames arrived at the span's start: they took no measured time.
        span = rec.chunk_times[-1] - rec.chunk_times[0]
        rtf = (frames - rec.chunk_frames[0]) / rec.fps / span if span > 0 else None
    return {
        "chunks": len(rec.chunk_times),
        "frames": frames,
        "ttff_s": rec.ttff_s,
        "gaps_s": gaps,
        "jitter_s": statistics.pstdev(gaps) if len(gaps) > 1 else None,
        "real_time_factor": rtf,
        "playout": playout(rec.chunk_times, rec.chunk_frames, rec.fps, buffer_s),
    }


def summarise(records: list[SessionRecord], buffer_s: float) -> dict[str, Any]:
    per = [session_metrics(r, buffer_s) for r in records]
    gaps = [g for m in per for g in m["gaps_s"]]
    on_time = sum(m["playout"]["on_time"] for m in per)
    chunks = sum(m["playout"]["chunks"] for m in per)
    ttffs = [m["ttff_s"] for m in per if m["ttff_s"] is not None]
    rtfs = [m["real_time_factor"] for m in per if m["real_time_factor"] is not None]
    jitters = [m["jitter_s"] for m in per if m["jitter_s"] is not None]
    latencies = [x for r in records for x in r.action_latencies]
    ends: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in records:
        ends[r.end] = ends.get(r.end, 0) + 1
        if r.error_code:
            errors[r.error_code] = errors.get(r.error_code, 0) + 1
        if r.protocol_errors:
            errors["protocol"] = errors.get("protocol", 0) + 1
    return {
        "sessions": len(records),
        "ends": ends,
        "errors": errors,
        "chunks": chunks,
        "frames": sum(m["frames"] for m in per),
        "ttff_s": {"p50": _pct(ttffs, 50), "p95": _pct(ttffs, 95), "max": max(ttffs, default=None)},
        "inter_chunk_s": {"p50": _pct(gaps, 50), "p95": _pct(gaps, 95), "p99": _pct(gaps, 99)},
        "jitter_s": {"mean": statistics.fmean(jitters) if jitters else None},
        "real_time_factor": {"p50": _pct(rtfs, 50), "min": min(rtfs, default=None)},
        "deadline_attainment": on_time / chunks if chunks else None,
        "stalls": {
            "count": sum(m["playout"]["stalls"] for m in per),
            "seconds": sum(m["playout"]["stall_s"] for m in per),
        },
        "action_to_frame_s": {"p50": _pct(latencies, 50), "p95": _pct(latencies, 95), "n": len(latencies)},
    }


# --- the result -----------------------------------------------------------------------------------
def build_result(
    cfg: LoadConfig,
    model: dict[str, Any],
    records: list[SessionRecord],
    wall_s: float,
    before: dict[str, float],
    after: dict[str, float],
    per_instance: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The whole run as one JSON-ready dict; `before` and `after` are the server's /metrics.
    `per_instance`: K/V pages in use after the run per server, where several servers share
    the address (Ray Serve): /metrics then comes from one of them, so pages are judged here."""
    kinds = {k: [r for r in records if r.kind == k] for k in ("normal", "cancel", "slow")}
    # Slow readers lag by design: the overall and per-priority figures leave them out.
    keeping_up = kinds["normal"] + kinds["cancel"]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "client_machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}",
        "config": asdict(cfg),
        "model": model,
        "wall_s": wall_s,
        "overall": summarise(keeping_up, cfg.playout_buffer_s),
        "by_kind": {k: summarise(v, cfg.playout_buffer_s) for k, v in kinds.items() if v},
        "by_priority": {
            p: summarise([r for r in keeping_up if r.priority == p], cfg.playout_buffer_s)
            for p in PRIORITIES
            if any(r.priority == p for r in keeping_up)
        },
        "server": {
            "kv_pages_used_after": (
                after.get("streamworld_kv_pages_used") if per_instance is None else sum(per_instance.values())
            ),
            "instances": None if per_instance is None else _instances(records, per_instance),
            "kv_pages_total": after.get("streamworld_kv_pages_total"),
            "sessions_active_after": after.get("streamworld_sessions_active"),
            # Behind several servers /metrics answers from one of them: no sum of counters.
            "deltas": (
                None
                if per_instance is not None
                else {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SERVER_COUNTERS}
            ),
        },
        "sessions": [{**asdict(r), "metrics": session_metrics(r, cfg.playout_buffer_s)} for r in records],
    }


def _instances(records: list[SessionRecord], pages: dict[str, float]) -> dict[str, dict]:
    """Per server instance: sessions it held and K/V pages it still held after the run."""
    ids = sorted({r.instance for r in records if r.instance is not None} | set(pages))
    return {
        i: {"sessions": sum(1 for r in records if r.instance == i), "kv_pages_used_after": pages.get(i)}
        for i in ids
    }


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


# --- the table and the verdict ------------------------------------------------------------------
TABLE_HEADER = (
    "class",
    "sessions",
    "chunks",
    "ttff p50/p95 s",
    "gap p50/p95/p99 s",
    "jitter s",
    "rtf p50",
    "deadlines",
    "stalls (s)",
    "action->frame p50/p95 s",
    "errors",
)


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table_row(name: str, s: dict[str, Any]) -> tuple[str, ...]:
    """One summary (from `summarise`) as the table's cells, in TABLE_HEADER's order."""
    ttff, gap, act = s["ttff_s"], s["inter_chunk_s"], s["action_to_frame_s"]
    deadlines = "-" if s["deadline_attainment"] is None else f"{100 * s['deadline_attainment']:.1f}%"
    return (
        name,
        str(s["sessions"]),
        str(s["chunks"]),
        f"{_f(ttff['p50'], '{:.2f}')}/{_f(ttff['p95'], '{:.2f}')}",
        f"{_f(gap['p50'])}/{_f(gap['p95'])}/{_f(gap['p99'])}",
        _f(s["jitter_s"]["mean"]),
        _f(s["real_time_factor"]["p50"], "{:.2f}"),
        deadlines,
        f"{s['stalls']['count']} ({s['stalls']['seconds']:.1f})",
        f"{_f(act['p50'])}/{_f(act['p95'])}",
        ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "none",
    )


def format_report(result: dict[str, Any]) -> str:
    cfg = result["config"]
    load = (
        f"{cfg['sessions']} sessions held"
        if cfg["sessions"] is not None
        else f"Poisson arrivals {cfg['arrival_rate']}/s, mean {cfg['session_chunks']} chunks per session"
    )
    rows = [("all (not slow)", result["overall"])] + [(k, v) for k, v in result["by_kind"].items()]
    rows += [(f"  {p}", v) for p, v in result["by_priority"].items()]
    table = [TABLE_HEADER] + [_table_row(name, s) for name, s in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(TABLE_HEADER))]
    lines = [f"{cfg['url']}  model {result['model']['id']}  {cfg['duration_s']:.0f} s, {load}"]
    for row in table:
        # The class name is left-aligned, the figures right-aligned; errors, last, run on unpadded.
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)]
        lines.append("  ".join([*cells, row[-1]]))
    server = result["server"]
    d = server["deltas"]
    if d is None:
        lines.append("server: several instances behind one address; /metrics counters are per instance")
    else:
        lines.append(
            f"server: frames generated {d['streamworld_frames_generated_total']:.0f}, deadline misses "
            f"{d['streamworld_chunk_deadline_miss_total']:.0f}, KV pages in use after the run "
            f"{_f(server['kv_pages_used_after'], '{:.0f}')} of {_f(server['kv_pages_total'], '{:.0f}')}"
        )
    if server.get("instances"):
        parts = [
            f"{i} {v['sessions']} sessions, {_f(v['kv_pages_used_after'], '{:.0f}')} pages after"
            for i, v in server["instances"].items()
        ]
        lines.append(f"servers: {len(parts)} instances: " + "; ".join(parts))
    return "\n".join(lines)


def check(result: dict[str, Any]) -> list[str]:
    """What makes the run a failure (not a slow server: a broken one)."""
    problems = []
    if result["server"]["kv_pages_used_after"] not in (0, 0.0, None):
        pages = result["server"]["kv_pages_used_after"]
        problems.append(f"{pages:.0f} KV pages still in use after every session ended")
    silent = [
        i for i, v in (result["server"].get("instances") or {}).items() if v["kv_pages_used_after"] is None
    ]
    if silent:
        problems.append(f"server instances {silent} never reported their K/V pages after the run")
    broken = [s["index"] for s in result["sessions"] if s["protocol_errors"]]
    if broken:
        problems.append(f"sessions {broken[:10]} saw protocol errors")
    return problems
