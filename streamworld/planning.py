"""Planning with the world model: the cross-entropy method over action sequences, each
iteration one fork of many branches, model-predictive against a real environment.

A planner asks the model "what happens if I do this?" for many candidate action sequences at
once. With StreamWorld that is one `fork` of a stream started from the observed frame
(`docs/planning.md`): the branches share the observation's K/V pages, are batched together
like any streams, and come back as predicted frames. The cost compares each candidate's last
predicted frame with the goal.

    rollouts = EngineRollouts(engine, frame)      # or ClientRollouts over a server session
    plan = await cem(rollouts, cost, start, CEMConfig())
    ...execute plan.actions[:execute] in the real environment, observe, plan again

The PushT pieces (its cost, expert goals, success test and the model-predictive episode)
are in `streamworld.pusht.planning`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .engine import AsyncEngine, BranchRequest, EngineConfig, StreamRequest, offline_config


@dataclass(frozen=True)
class CEMConfig:
    horizon: int = 8  # video frames each candidate is rolled out for
    samples: int = 16  # candidates (branches) per iteration
    elites: int = 4  # best candidates the next distribution is fitted to
    iterations: int = 3
    knot_frames: int = 2  # actions are held for this many frames (fewer numbers to search)
    init_std: float = 80.0  # of the first distribution around the start action, action units
    min_std: float = 4.0
    low: float = 0.0  # action bounds
    high: float = 512.0
    # Sample-efficiency options after iCEM (Pinneri et al., 2020). `noise_beta`: the samples'
    # noise has power falling as 1/f^beta along the knots (0: white; 2: a random walk's
    # smooth drift). `keep_elites`: the cheapest this many candidates of an iteration join
    # the next iteration's refit with the costs they had; they are not rolled out again.
    noise_beta: float = 0.0
    keep_elites: int = 0
    # `max_speed` > 0: an action moves at most this far (Euclidean, action units) from the one
    # before it, the first from `start` (in `run_episode` the agent's position, which the
    # observed frame shows, not the last target sent); the knots become waypoints the actions head for at
    # that speed, like the scripted policies the PushT model learned from (at most 35 units
    # a step), so candidates stay in the model's training distribution. 0: targets held.
    max_speed: float = 0.0

    @property
    def knots(self) -> int:
        """Held targets per candidate: the horizon in steps of `knot_frames`, rounded up."""
        return -(-self.horizon // self.knot_frames)

    def held(self, knots: np.ndarray) -> np.ndarray:
        """Actions [..., horizon, dim] of knots [..., knots, dim]: each held `knot_frames`
        steps, cut at the horizon."""
        return np.repeat(knots, self.knot_frames, axis=-2)[..., : self.horizon, :]

    def actions(self, knots: np.ndarray, start: np.ndarray) -> np.ndarray:
        """The actions [..., horizon, dim] a candidate of knots [..., knots, dim] stands for:
        `held`, then, with `max_speed`, limited to that speed from `start` (`rate_limited`)."""
        held = self.held(knots)
        return rate_limited(held, start, self.max_speed) if self.max_speed > 0 else held

    def check(self) -> None:
        if self.horizon < 1 or self.samples < 2 or not 1 <= self.elites <= self.samples:
            raise ValueError("need horizon >= 1, samples >= 2 and 1 <= elites <= samples")
        if self.iterations < 1 or self.knot_frames < 1 or self.init_std <= 0 or self.min_std < 0:
            raise ValueError("need iterations >= 1, knot_frames >= 1, init_std > 0 and min_std >= 0")
        if not 0 <= self.noise_beta <= 4 or not 0 <= self.keep_elites <= self.elites:
            raise ValueError("need 0 <= noise_beta <= 4 and 0 <= keep_elites <= elites")
        if not self.max_speed >= 0:
            raise ValueError("need max_speed >= 0 (0: no limit)")


def rate_limited(targets: np.ndarray, start: np.ndarray, max_speed: float) -> np.ndarray:
    """Actions [..., T, dim] that follow `targets` [..., T, dim] from `start` [dim], each at
    most `max_speed` (Euclidean) from the one before: step t moves toward target t and
    reaches it when it is that close."""
    out = np.empty(targets.shape, np.float64)
    previous = np.broadcast_to(np.asarray(start, np.float64), targets[..., 0, :].shape)
    for t in range(targets.shape[-2]):
        step = targets[..., t, :] - previous
        length = np.linalg.norm(step, axis=-1, keepdims=True)
        scale = np.minimum(1.0, max_speed / np.maximum(length, 1e-12))
        previous = out[..., t, :] = previous + step * scale
    return out


class Rollouts(Protocol):
    """candidates [K, H, action_dim] -> predicted frames [K, H, height, width, 3] (uint8),
    frame h being the one action h leads to. Rollouts with `ensemble = True`
    (`EnsembleRollouts`) answer [M, K, H, height, width, 3] instead: M models' predictions."""

    def __call__(self, candidates: np.ndarray) -> Awaitable[np.ndarray]: ...


@dataclass
class Plan:
    actions: np.ndarray  # [H, action_dim]: the best candidate of the last iteration
    cost: float
    frames: np.ndarray  # its predicted frames [H, height, width, 3]
    costs: list[float] = field(default_factory=list)  # the best cost of each iteration
    branches: int = 0  # rolled out in all
    seconds: float = 0.0
    mean: np.ndarray | None = None  # the last distribution's mean [knots, action_dim]
    knots: np.ndarray | None = None  # the plan's own knots [knots, action_dim], `actions` made of them
    # With cem(keep_candidates=True): every candidate's frames of the fork the plan came from
    # [K, H, height, width, 3], the plan being candidates[chosen].
    candidates: np.ndarray | None = None
    chosen: int = 0


async def cem(
    rollouts: Rollouts,
    cost: Callable[[np.ndarray], float],
    start: np.ndarray,
    config: CEMConfig,
    rng: np.random.Generator,
    mean: np.ndarray | None = None,
    keep_candidates: bool = False,
    proposals: np.ndarray | None = None,
) -> Plan:
    """The cross-entropy method: sample `samples` knot sequences around the mean (first:
    `start` held, or `mean`, e.g. the last plan shifted), turn each into actions
    (`config.actions`: knots held, or headed for at `max_speed` from `start`), roll them all out
    as one fork, refit mean and spread to the `elites` cheapest (of these and the
    `keep_elites` carried from the last iteration), `iterations` times. `cost` maps one
    candidate's predicted frames (or whatever the rollouts answer, e.g. poses) to a number
    (lower is better); a cost with a method `many(frames)` is given the whole fork's frames
    at once instead. `keep_candidates` keeps every
    candidate's frames of the fork the plan came from (to show them). `proposals` [P, knots,
    action_dim] (e.g. `pusht.proposals.PushProposals`) take the places of P of the first
    iteration's random samples, after the mean; the cost weighs them like any other. With
    `EnsembleRollouts` a candidate's cost is the mean of its cost under each member, and the
    plan's frames are the first member's."""
    config.check()
    t0 = time.perf_counter()
    knots = config.knots
    dim = len(start)
    mu = np.repeat(np.asarray(start, np.float64)[None], knots, 0) if mean is None else mean.astype(np.float64)
    std = np.full((knots, dim), config.init_std)
    carried, carried_costs = np.empty((0, knots, dim)), np.empty(0)
    best: Plan | None = None
    history = []
    proposed = _proposals(proposals, config.samples - 1, knots, dim)
    for iteration in range(config.iterations):
        noise = colored_noise(rng, (config.samples, knots, dim), config.noise_beta)
        samples = np.clip(mu + std * noise, config.low, config.high)
        samples[0] = np.clip(mu, config.low, config.high)  # the mean itself is always tried
        if iteration == 0 and len(proposed):
            samples[1 : 1 + len(proposed)] = np.clip(proposed, config.low, config.high)
        candidates = config.actions(samples, start).astype(np.float32)
        frames, costs = await _rolled_out(rollouts, cost, candidates)
        pool, pool_costs = np.concatenate([samples, carried]), np.concatenate([costs, carried_costs])
        order = np.argsort(pool_costs, kind="stable")
        elite = pool[order[: config.elites]]
        mu, std = elite.mean(0), np.maximum(elite.std(0), config.min_std)
        carried, carried_costs = pool[order[: config.keep_elites]], pool_costs[order[: config.keep_elites]]
        i = int(np.argmin(costs))
        history.append(float(costs[i]))
        if best is None or costs[i] < best.cost:
            kept = frames if keep_candidates else None
            best = Plan(
                candidates[i], float(costs[i]), frames[i], candidates=kept, chosen=i, knots=samples[i]
            )
    assert best is not None
    best.costs = history
    best.branches = config.samples * config.iterations
    best.seconds = time.perf_counter() - t0
    best.mean = mu  # to warm-start the next plan
    return best


async def _rolled_out(
    rollouts: Rollouts, cost: Callable[[np.ndarray], float], candidates: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The fork's predicted frames [K, H, ...] and costs [K]; from an ensemble, each member's
    frames are scored and the costs averaged, and the frames are the first member's."""
    frames = await rollouts(candidates)
    if getattr(rollouts, "ensemble", False):
        return frames[0], np.mean([_scored(cost, member) for member in frames], axis=0)
    return frames, _scored(cost, frames)


def _scored(cost: Callable[[np.ndarray], float], frames: np.ndarray) -> np.ndarray:
    """Each candidate's cost; a cost with `many(frames)` scores the whole fork at once."""
    many = getattr(cost, "many", None)
    return np.asarray(many(frames)) if many is not None else np.array([cost(f) for f in frames])


def _proposals(proposals: np.ndarray | None, room: int, knots: int, dim: int) -> np.ndarray:
    if proposals is None:
        return np.empty((0, knots, dim))
    proposals = np.asarray(proposals, np.float64)
    if proposals.ndim != 3 or proposals.shape[1:] != (knots, dim):
        raise ValueError(f"proposals must be [P, {knots}, {dim}] (knots, action_dim), got {proposals.shape}")
    if len(proposals) > room:
        raise ValueError(f"{len(proposals)} proposals leave no room: at most samples - 1 = {room}")
    return proposals


def colored_noise(rng: np.random.Generator, shape: tuple[int, ...], beta: float) -> np.ndarray:
    """Standard normal noise of `shape` [samples, time, ...] whose power along the time axis
    falls as 1/f^beta: white for beta 0, smoother as beta grows. Drawn in the frequency
    domain; every element has variance 1 (the spectrum's scale is divided out exactly)."""
    n = shape[1]
    if beta == 0 or n < 2:
        return rng.standard_normal(shape)
    freqs = np.fft.rfftfreq(n)
    freqs[0] = freqs[1]  # the constant term as strong as the slowest wave
    scale = freqs ** (-beta / 2)
    # irfft keeps only the real part of the constant term (and of the Nyquist term for even
    # n), which a white spectrum draws with twice the variance of the other terms' parts.
    real_only = np.zeros(len(freqs), bool)
    real_only[0] = True
    real_only[-1] |= n % 2 == 0
    scale = np.where(real_only, np.sqrt(2.0) * scale, scale)
    extra = (1,) * (len(shape) - 2)
    spectrum_shape = (shape[0], len(freqs), *shape[2:])
    spectrum = rng.standard_normal(spectrum_shape) + 1j * rng.standard_normal(spectrum_shape)
    x = np.fft.irfft(spectrum * scale.reshape(-1, *extra), n=n, axis=1)
    # The variance each term adds, over n^2: a real-only term its scale^2; every other term
    # adds itself and its conjugate, 2 Re(X e^(i theta)), of variance 4 scale^2.
    variance = np.where(real_only, 1.0, 4.0) * scale**2
    return x / (np.sqrt(variance.sum()) / n)


def planning_engine_config(branches: int, cuda_graphs: bool = False, planners: int = 1) -> EngineConfig:
    """An in-process engine for `EngineRollouts` with forks of up to `branches`, for
    `planners` planners at once: every observed stream and branch live at once, a batch
    large enough for the forks of all planners in flight (the scheduler batches those that
    attend to as many cached frames), and no deadline applies (a plan waits for its
    forks)."""
    return dataclasses.replace(
        offline_config(planners * (branches + 1), batch_units=planners * branches),
        max_fork_branches=branches,
        cuda_graphs=cuda_graphs,
    )


class EngineRollouts:
    """Rollouts as forks of one stream of an in-process engine, started from `image` (a
    model that takes a first frame and actions). The stream uses the `wait` action policy
    and is given no actions, so it never generates a chunk itself: every fork branches from
    the observed frame, and all of them share its K/V pages."""

    def __init__(self, engine: AsyncEngine, image: np.ndarray, seed: int = 0) -> None:
        cfg = engine.model.config
        if not cfg.needs_image or not cfg.action_dim:
            raise ValueError(f"model {cfg.id} does not start from a frame and take actions")
        self.engine = engine
        self.frames_per_chunk = cfg.frames_per_chunk
        self.handle = engine.open_stream(StreamRequest(seed=seed, image=image, action_policy="wait"))

    async def __call__(self, candidates: np.ndarray) -> np.ndarray:
        chunks = -(-candidates.shape[1] // self.frames_per_chunk)
        handles = self.handle.fork([BranchRequest(chunks, actions=c) for c in candidates])
        return await _predicted(handles, candidates.shape[1])

    def close(self) -> None:
        self.handle.cancel()


class ClientRollouts:
    """Rollouts as forks of a session on a StreamWorld server (`StreamWorldClient`, started
    with the observed frame as `image`, `action_policy="wait"` and no actions); `start`
    opens such a session, and `close` then ends it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.frames_per_chunk = client.info.frames_per_chunk
        self._owned = False

    @classmethod
    async def start(
        cls, url: str, image: np.ndarray, model: str | None = None, **options: Any
    ) -> ClientRollouts:
        """A session on `url` started from `image` (further `StreamWorldClient` options)."""
        from .client import StreamWorldClient

        client = StreamWorldClient(
            url, model=model, image=image, format="rgb", action_policy="wait", **options
        )
        await client.start()
        rollouts = cls(client)
        rollouts._owned = True
        return rollouts

    async def close(self) -> None:
        if self._owned:
            await self.client.close()

    async def __call__(self, candidates: np.ndarray) -> np.ndarray:
        chunks = -(-candidates.shape[1] // self.frames_per_chunk)
        branches = await self.client.fork(
            [{"num_chunks": chunks, "actions": c} for c in candidates], format="rgb"
        )
        return await _predicted([b.chunks() for b in branches], candidates.shape[1])


class EnsembleRollouts:
    """The same candidates rolled out by several models (each member `Rollouts`, e.g. an
    `EngineRollouts` per model), concurrently: frames [M, K, H, height, width, 3], member m's
    at [m]. `cem` averages each candidate's cost over the members, as PETS plans through an
    ensemble, so a candidate that one model predicts wrongly is ranked by what the others
    predict too. `close` closes every member."""

    ensemble = True

    def __init__(self, members: list[Rollouts]) -> None:
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = list(members)

    async def __call__(self, candidates: np.ndarray) -> np.ndarray:
        return np.stack(await asyncio.gather(*(m(candidates) for m in self.members)))

    async def close(self) -> None:
        """Close every member, even when one of them fails to close (the first error is raised)."""
        errors = []
        for member in self.members:
            try:
                await close_rollouts(member)
            except Exception as e:  # the others are still closed
                errors.append(e)
        if errors:
            raise errors[0]


async def close_rollouts(rollouts: Rollouts) -> None:
    """`rollouts.close()`, if it has one, awaited when it returns an awaitable."""
    closed = getattr(rollouts, "close", lambda: None)()
    if inspect.isawaitable(closed):
        await closed


async def _predicted(branches: list[Any], horizon: int) -> np.ndarray:
    """The first `horizon` frames of each branch (async iterables of chunks), stacked."""

    async def frames(chunks: Any) -> np.ndarray:
        return np.concatenate([c.frames async for c in chunks])[:horizon]

    return np.stack(await asyncio.gather(*(frames(b) for b in branches)))
