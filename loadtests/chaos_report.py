"""The chaos suite's verdict: figures from what the run saw, the checks that fail it, the table.

`build_report` turns the raw observations (case outcomes, bystander records, resource
samples, the log scan, the shutdown) into the JSON report; `failures` lists every reason the
run fails (an empty list = exit code 0); `format_table` prints it for a person.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict
from typing import Any

from loadtests.chaos_cases import Outcome, ViewRecord


def quantiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "max": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 4)

    return {"n": len(ordered), "p50": q(0.50), "p95": q(0.95), "p99": q(0.99), "max": round(ordered[-1], 4)}


def view_disturbed(rec: ViewRecord) -> str | None:
    """Why a well-behaved session was disturbed, or None."""
    want_end = "completed" if rec.planned is not None else "stopped"
    expected = list(range(rec.planned if rec.planned is not None else len(rec.chunks)))
    if rec.errors:
        return f"errors {rec.errors[:3]}"
    if rec.chunks != expected:
        return f"chunks {rec.chunks[:16]} instead of {expected[:16]}"
    if rec.end != want_end or rec.close_code != 1000:
        return f"ended {rec.end} with close {rec.close_code}"
    return None


def summarise_views(records: list[ViewRecord]) -> dict[str, Any]:
    gaps = [b - a for rec in records for a, b in zip(rec.arrivals, rec.arrivals[1:], strict=False)]
    disturbed = [
        {"kind": rec.kind, "why": why, "chunks": len(rec.chunks)}
        for rec in records
        if (why := view_disturbed(rec)) is not None
    ]
    return {
        "sessions": len(records),
        "chunks": sum(len(rec.chunks) for rec in records),
        "ends": dict(Counter(rec.end for rec in records)),
        "inter_chunk_s": quantiles(gaps),
        "disturbed": disturbed,
    }


def summarise_cases(outcomes: list[Outcome], keep: int = 50) -> dict[str, Any]:
    by_case: dict[str, Counter] = {}
    for out in outcomes:
        by_case.setdefault(out.case, Counter())[out.verdict] += 1
    reached = Counter((o.case, o.stage_reached) for o in outcomes if o.case.startswith("disconnect:"))
    bad = [asdict(o) for o in outcomes if o.verdict != "ok"]
    return {
        "total": len(outcomes),
        "verdicts": dict(Counter(o.verdict for o in outcomes)),
        "by_case": {case: dict(c) for case, c in sorted(by_case.items())},
        "disconnect_stage_reached": {
            case: {"reached": reached[(case, True)], "missed": reached[(case, False)]}
            for case in sorted({case for case, _ in reached})
        },
        "not_ok": bad[:keep],
        "not_ok_total": len(bad),
    }


def resources(
    samples: list[dict[str, Any]], before: dict | None, after: dict | None, warmup_s: float
) -> dict:
    """Process figures: before the run (idle, warmed), at the end of warm-up, peak, after (idle),
    and the RSS trend under load after warm-up."""
    live = [s for s in samples if s.get("rss_kb") is not None]
    warm = next((s for s in live if s["t"] >= warmup_s), live[-1] if live else None)
    peak = {k: max(s[k] for s in live) for k in ("rss_kb", "threads", "fds")} if live else None
    growth = None
    if warm and after:
        growth = round((after["rss_kb"] - warm["rss_kb"]) / warm["rss_kb"], 4)
    return {
        "before": before,
        "warm": warm,
        "peak": peak,
        "after": after,
        "rss_growth_after_warmup": growth,
        "rss_trend": rss_trend([s for s in live if s["t"] >= warmup_s]),
    }


def rss_trend(samples: list[dict[str, Any]], window_s: float = 300.0) -> dict | None:
    """RSS under load, compared by medians: the first window after warm-up against the last.

    Single samples swing by several percent as sessions come and go, so one sample against
    another says little; medians over a window (five minutes, or a quarter of the run when it is
    shorter) and a least-squares slope say whether memory creeps."""
    if len(samples) < 8:
        return None
    t0, t1 = samples[0]["t"], samples[-1]["t"]
    window = min(window_s, (t1 - t0) / 4)
    first = [s["rss_kb"] for s in samples if s["t"] <= t0 + window]
    last = [s["rss_kb"] for s in samples if s["t"] >= t1 - window]
    ts = [s["t"] for s in samples]
    rs = [s["rss_kb"] for s in samples]
    mt, mr = statistics.fmean(ts), statistics.fmean(rs)
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (r - mr) for t, r in zip(ts, rs, strict=True)) / var if var else 0.0
    first_kb, last_kb = statistics.median(first), statistics.median(last)
    return {
        "window_s": round(window, 1),
        "first_median_kb": round(first_kb),
        "last_median_kb": round(last_kb),
        "growth": round((last_kb - first_kb) / first_kb, 4),
        "slope_mb_per_hour": round(slope * 3600 / 1024, 1),
    }


def failures(report: dict[str, Any], cfg: Any) -> list[str]:
    out: list[str] = []
    idle = report["idle_after"]
    if idle.get("kv_pages_used") != 0:
        out.append(f"K/V pages leaked: {idle.get('kv_pages_used')} in use once idle")
    for key in ("sessions_active", "sessions_waiting", "healthz_sessions"):
        if idle.get(key):
            out.append(f"{key} {idle[key]} once idle")
    log = report["log"]
    for key, what in (("tracebacks", "tracebacks"), ("error_lines", "ERROR lines"), ("http_5xx", "HTTP 5xx")):
        if log and log[key]:
            out.append(f"server log: {log[key]} {what}")
    verdicts = report["cases"]["verdicts"]
    for verdict in ("internal", "undocumented"):
        if verdicts.get(verdict):
            out.append(f"{verdicts[verdict]} chaos replies were {verdict}")
    for group in ("bystanders", "long_stream"):
        if report[group]["disturbed"]:
            out.append(f"{len(report[group]['disturbed'])} {group} sessions disturbed")
    slow_broken = [
        d for d in report["slow_readers"]["disturbed"] if "internal" in d["why"] or "chunks" in d["why"]
    ]
    if slow_broken:
        out.append(f"{len(slow_broken)} slow readers got internal errors or chunks out of order")
    out += resource_failures(report["resources"], cfg)
    sig = report.get("sigterm")
    if sig and sig["problems"]:
        out += [f"SIGTERM: {p}" for p in sig["problems"]]
    return out


def resource_failures(res: dict[str, Any], cfg: Any) -> list[str]:
    out: list[str] = []
    trend = res.get("rss_trend")
    if trend is not None and trend["growth"] > cfg.rss_growth:
        out.append(
            f"RSS median grew {trend['growth']:.1%} from the first {trend['window_s']:.0f} s after"
            f" warm-up to the last (limit {cfg.rss_growth:.0%})"
        )
    warm, before, after = res.get("warm"), res.get("before"), res.get("after")
    if warm and after and after["threads"] - warm["threads"] > cfg.thread_slack:
        out.append(f"threads {warm['threads']} after warm-up -> {after['threads']} idle after the run")
    if before and after and after["fds"] - before["fds"] > cfg.fd_slack:
        out.append(f"open file descriptors {before['fds']} before -> {after['fds']} idle after the run")
    return out


def format_table(report: dict[str, Any]) -> str:
    cases = report["cases"]
    lines = [f"chaos: {report['elapsed_s']:.0f} s, {cases['total']} case outcomes {cases['verdicts']}"]
    lines += [f"  {case:44s} {dict(c)}" for case, c in cases["by_case"].items()]
    for group in ("bystanders", "slow_readers", "long_stream"):
        g = report[group]
        gap = g["inter_chunk_s"]
        lines.append(
            f"{group:13s} sessions {g['sessions']:4d} chunks {g['chunks']:5d}"
            f" disturbed {len(g['disturbed']):3d}"
            f"  gaps p50 {gap['p50']} p95 {gap['p95']} p99 {gap['p99']} max {gap['max']}"
        )
    res = report["resources"]
    for when in ("before", "warm", "peak", "after"):
        s = res.get(when) or {}
        lines.append(
            f"process {when:7s} rss {s.get('rss_kb')} kB threads {s.get('threads')} fds {s.get('fds')}"
        )
    lines.append(
        f"RSS growth after warm-up {res.get('rss_growth_after_warmup')} (one sample to the idle end);"
        f" trend under load {res.get('rss_trend')}; idle after: {report['idle_after']}"
    )
    log = report["log"] or {}
    lines.append(
        f"server log: tracebacks {log.get('tracebacks')} ERROR lines {log.get('error_lines')}"
        f" 5xx {log.get('http_5xx')}"
    )
    if report.get("sigterm"):
        lines.append(f"SIGTERM: {report['sigterm']}")
    lines += [f"FAIL {f}" for f in report["failures"]] or ["PASS"]
    return "\n".join(lines)
