"""The session plan: who arrives when, for how long, and as what kind of viewer.

A run's configuration (`LoadConfig`) is turned into one `SessionPlan` per session before any
connection opens, from one seeded random generator, so that the same `--seed` offers the
same load: arrival times (Poisson, or all at once for held sessions), lengths, which
sessions cancel or read slowly, and each one's priority and wire format drawn from the mixes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# The server's priority classes and wire formats. The load generator is a client and does not
# import the server; tests/test_loadtests.py pins these against the server's own lists.
PRIORITIES = ("interactive", "standard", "batch")
FORMATS = ("jpeg", "h264", "fmp4", "rgb")


def parse_mix(text: str, allowed: tuple[str, ...], what: str) -> dict[str, float]:
    """ "interactive:1,standard:2" -> normalised weights; a bare name means weight 1."""
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.strip().partition(":")
        if name not in allowed:
            raise ValueError(f"{what}: unknown {name!r} (choose from {', '.join(allowed)})")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"{what}: weight {weight!r} is not a number") from None
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"{what}: weight of {name} must be a finite number >= 0")
        mix[name] = mix.get(name, 0.0) + w
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"{what}: weights must not all be 0")
    return {k: v / total for k, v in mix.items()}


@dataclass
class LoadConfig:
    url: str
    duration_s: float
    model: str | None = None
    arrival_rate: float | None = None
    sessions: int | None = None
    session_chunks: float = 8.0
    cancel_share: float = 0.1
    slow_share: float = 0.1
    slow_factor: float = 3.0
    priorities: dict[str, float] = field(default_factory=lambda: {"standard": 1.0})
    formats: dict[str, float] = field(default_factory=lambda: {"jpeg": 1.0})
    kv_mode: str | None = None
    prompt: str = "a walk through a forest"
    playout_buffer_s: float = 0.5
    send_actions: bool = True
    ack: bool = False  # acknowledge each chunk once read (the protocol's `ack` extension)
    drain_s: float = 30.0
    seed: int = 0


@dataclass
class SessionPlan:
    index: int
    start_at: float  # seconds after the run's start
    num_chunks: int | None  # None: until the run ends
    priority: str
    format: str
    slow: bool
    cancel_after: int | None  # drop the connection after this many chunks
    seed: int


def plan_sessions(cfg: LoadConfig) -> list[SessionPlan]:
    # One generator for the whole plan, drawn in a fixed order: the plan depends on the seed only.
    rng = random.Random(cfg.seed)
    starts: list[float] = []
    if cfg.sessions is not None:
        starts = [0.0] * cfg.sessions
    else:
        assert cfg.arrival_rate is not None
        t = rng.expovariate(cfg.arrival_rate)
        while t < cfg.duration_s:
            starts.append(t)
            t += rng.expovariate(cfg.arrival_rate)
    plans = []
    for i, start in enumerate(starts):
        length = None
        if cfg.session_chunks > 0 and cfg.sessions is None:
            length = max(1, round(rng.expovariate(1.0 / cfg.session_chunks)))
        cancel = None
        if rng.random() < cfg.cancel_share:
            upto = length if length is not None else max(2, round(cfg.session_chunks) or 8)
            cancel = rng.randint(1, max(1, upto - 1))
        plans.append(
            SessionPlan(
                index=i,
                start_at=start,
                num_chunks=length,
                priority=_draw(rng, cfg.priorities),
                format=_draw(rng, cfg.formats),
                # A cancelling session reads at full speed: each session is one kind.
                slow=cancel is None and rng.random() < cfg.slow_share,
                cancel_after=cancel,
                seed=cfg.seed * 100_003 + i,
            )
        )
    return plans


def _draw(rng: random.Random, mix: dict[str, float]) -> str:
    x, acc = rng.random(), 0.0
    for name, w in mix.items():
        acc += w
        if x < acc:
            return name
    # Rounding can leave the weights' sum a hair under 1.
    return next(reversed(mix))
