"""Prometheus metrics (names from docs/protocol.md, all prefixed `streamworld_`).

Event metrics (histograms, counters) are observed by sessions as things happen, through one
`SessionMetrics` per session. State
metrics (sessions, K/V pages, the batch-size histogram kept by each engine) are read from
the engines when `/metrics` is scraped, so they are never stale.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..engine import AsyncEngine, ChunkOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class EngineCollector(Collector):
    """Gauges read from the engines when scraped. A model served by several replicas gets a
    series per replica (label `replica`) for what each holds (sessions, pages, batches); the
    admission queue is one per model. Models with one replica keep their series unlabelled
    by replica, so scrapers of a one-GPU server see no change."""

    def __init__(self, engines: dict[str, Sequence[AsyncEngine]]) -> None:
        self.engines = engines
        self.by_replica = any(len(replicas) > 1 for replicas in engines.values())

    def collect(self) -> Iterable:
        labels = ["model", "replica"] if self.by_replica else ["model"]
        active = GaugeMetricFamily("streamworld_sessions_active", "Streams generating now", labels=labels)
        waiting = GaugeMetricFamily(
            "streamworld_sessions_waiting", "Streams waiting for admission", labels=["model"]
        )
        used = GaugeMetricFamily("streamworld_kv_pages_used", "K/V pages in use", labels=labels)
        total = GaugeMetricFamily("streamworld_kv_pages_total", "K/V pages in the pool", labels=labels)
        batch = HistogramMetricFamily(
            "streamworld_batch_size", "Work units per executed batch", labels=labels
        )
        for model, replicas in self.engines.items():
            waiting.add_metric([model], sum(len(e.waiting) for e in replicas))
            for index, engine in enumerate(replicas):
                key = [model, str(index)] if self.by_replica else [model]
                active.add_metric(key, engine.live_streams())
                used.add_metric(key, engine.pool.pages_used)
                total.add_metric(key, engine.pool.pages_total)
                sizes = engine.stats.batch_sizes
                buckets = [(str(b), sum(n for size, n in sizes.items() if size <= b)) for b in BATCH_BUCKETS]
                buckets.append(("+Inf", sum(sizes.values())))
                batch.add_metric(key, buckets, sum_value=sum(size * n for size, n in sizes.items()))
        yield from (active, waiting, used, total, batch)


class Metrics:
    def __init__(self, engines: dict[str, Sequence[AsyncEngine]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttff = Histogram(
            "streamworld_time_to_first_frame_seconds",
            "From session.start to the first chunk's payload sent",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_chunk = Histogram(
            "streamworld_inter_chunk_seconds",
            "Between consecutive chunks of a session",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.action_to_frame = Histogram(
            "streamworld_action_to_frame_seconds",
            "From an action's arrival to the first frame it conditions being sent",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.deadline_miss = Counter(
            "streamworld_chunk_deadline_miss",
            "Chunks ready after their playback deadline",
            ["model"],
            registry=r,
        )
        self.frames = Counter("streamworld_frames_generated", "Video frames sent", ["model"], registry=r)
        self.finished = Counter(
            "streamworld_sessions_finished", "Sessions ended, by reason", ["model", "reason"], registry=r
        )
        r.register(EngineCollector(engines))
        per_model = (self.ttff, self.inter_chunk, self.action_to_frame, self.deadline_miss, self.frames)
        for model in engines:  # every series exists from the start, at zero
            for metric in per_model:
                metric.labels(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SessionMetrics:
    """What one session observes, for one model: timings of the chunks it sends, how long
    actions take to show, and its end (counted once, whatever path ends it)."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.started_at = time.monotonic()  # time to first frame counts from session.start
        self.last_sent: float | None = None
        # (first frame an action conditions, its arrival), for action_to_frame_seconds.
        self.pending_actions: deque[tuple[int, float]] = deque(maxlen=1024)
        self.counted = False

    def action_arrived(self, first_frame: int) -> None:
        self.pending_actions.append((first_frame, time.monotonic()))

    def chunk_sent(self, chunk: ChunkOutput, first: bool) -> None:
        m, model = self.metrics, self.model
        now = time.monotonic()
        if first:
            m.ttff.labels(model).observe(now - self.started_at)
        else:
            m.inter_chunk.labels(model).observe(now - self.last_sent)
        self.last_sent = now
        num_frames = int(chunk.frames.shape[0])
        m.frames.labels(model).inc(num_frames)
        if chunk.deadline_missed:
            m.deadline_miss.labels(model).inc()
        chunk_started = now - (chunk.timings["total"] + chunk.timings["queued"]) / 1000
        last_frame = chunk.first_frame + num_frames - 1
        while self.pending_actions and self.pending_actions[0][0] <= last_frame:
            _, arrived = self.pending_actions[0]
            if arrived > chunk_started:
                break  # arrived after this chunk started: a later chunk shows it
            self.pending_actions.popleft()
            m.action_to_frame.labels(model).observe(now - arrived)

    def finish(self, reason: str) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.finished.labels(self.model, reason).inc()
