"""CUDA graphs of a stage's DiT blocks, one per batch shape, captured as shapes recur.

A forward of Wan 1.3B launches some thirty kernels per block, about a thousand per step.
At 320x512 one unit's kernels are short, and the host launching them, not the GPU, sets
the pace (docs/benchmarks.md, DiT efficiency). A CUDA graph launches them all at once.

A graph fixes shapes and addresses, so one is captured per batch shape: the number of
units, their frames, their context length (all equal: only batches whose K/V has one
batched reader, `PagedKVBatch`, are graphed) and how many sink tokens move. A shape is
captured the second time it is seen (the first runs eagerly, which also warms the kernels'
lazy set-up), at most `max_graphs` are kept, and everything else (mixed context lengths,
more units than `max_batch`, the CPU) runs eagerly as before. Once `max_graphs` graphs
exist, a new shape replaces the least-seen one only if it has been seen at least twice as
often (`CaptureChoice`); otherwise it runs eagerly. Replacing the least recently used one
instead recaptured a graph on every batch once more shapes than that took turns, as the
many batch sizes of concurrent planning episodes can, and a capture costs more than an
eager run.

Each graph reads its inputs from buffers of its own that every call refills on the rank's
stream before the replay: the activation, the per-frame modulation, the queries' rotation,
the sinks' move and the K/V page indices. The K/V pages themselves are the cache's fixed
tensors. The prompts' cross-attention K/V are the big input (94 MiB per prompt for Wan
1.3B), so they live in one buffer of `max_batch` slots per stage that all its graphs share,
and a slot is copied only when a different prompt moves into it. The graphs share one
memory pool; an output is copied out right after its replay, before another graph can
reuse that memory. The result equals the eager forward's (the same kernels on the same
values; tests/test_gpu.py checks it).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..models.causal_wan import BlockPlan, CausalWanDiT, ChunkInput, StageActivation
from .kv_cache import PagedKVBatch
from .kv_pool import Stage

log = logging.getLogger("streamworld.engine")
_CAPTURING = threading.Lock()


@dataclass
class GraphStats:
    captured: int = 0  # graphs captured (each a new batch shape)
    replays: int = 0  # batches run through a graph
    eager: int = 0  # batches run eagerly (first sighting of a shape, or not graphable)
    evicted: int = 0  # graphs dropped to keep at most `max_graphs`
    failures: int = 0  # a capture that failed (logged); the stage then runs eagerly

    def to_json(self) -> dict:
        return dict(vars(self))


def summed_stats(stats: Iterable[GraphStats]) -> dict | None:
    """Graph counters added up (over stages, engines or both); None for none at all."""
    counters = [st.to_json() for st in stats]
    return {k: sum(c[k] for c in counters) for k in counters[0]} if counters else None


class CaptureChoice:
    """Which batch shapes get a CUDA graph, from how often each is seen (plain Python).

    A shape is captured the second time it is seen (since the counts last halved: a
    second sighting right at a halving waits for a third). Once `capacity` graphs exist, a new
    shape is captured only if it has been seen at least twice as often as the least-seen
    shape with a graph, which then goes (of equals, the least recently used). A shape seen
    about as often as those kept runs eagerly instead, so shapes taking turns do not make
    every batch a capture (the margin keeps counts that differ by one, as in any cycle,
    from trading places). Every count halves each `half_life` sightings, so a workload
    that changes shapes gets graphs for the new ones within a few half-lives."""

    def __init__(self, capacity: int, half_life: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if half_life is not None and half_life < 1:
            raise ValueError(f"half_life must be at least 1, got {half_life}")
        self.capacity = capacity
        self.half_life = half_life or 16 * capacity
        self.counts: Counter[Hashable] = Counter()
        self._since_halving = 0

    def seen(self, key: Hashable) -> None:
        self.counts[key] += 1
        self._since_halving += 1
        if self._since_halving >= self.half_life:
            self._since_halving = 0
            self.counts = Counter({k: n // 2 for k, n in self.counts.items() if n >= 2})

    def admits(self, key: Hashable, cached: Mapping[Hashable, Any]) -> bool:
        """Whether to capture `key`, which has no graph, now (after `seen(key)`)."""
        n = self.counts[key]
        if n < 2:
            return False
        return len(cached) < self.capacity or n >= 2 * min(self.counts[k] for k in cached)

    def victim(self, cached: Mapping[Hashable, Any]) -> Hashable:
        """The graph to drop for a new one: the least seen; of equals, the first in
        `cached`'s order (least recently used first)."""
        return min(cached, key=lambda k: self.counts[k])


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the input activation [B, N, D]
    modulation: torch.Tensor  # [B, F, 6, D]
    plan: BlockPlan  # its rotation, sink move and K/V indices are the graph's own buffers
    out: torch.Tensor  # the blocks' output, in the graphs' shared pool


class StageGraphs:
    """The CUDA graphs of one stage (blocks `stage.start` to `stage.stop - 1`) on `device`."""

    def __init__(
        self,
        dit: CausalWanDiT,
        stage: Stage,
        device: torch.device,
        max_batch: int,
        max_graphs: int = 32,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; stage {stage.index} is on {device}")
        self.dit, self.stage, self.device = dit, stage, device
        self.max_batch, self.max_graphs = max_batch, max_graphs
        self.stats = GraphStats()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self._choice = CaptureChoice(max_graphs)
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None  # where graphs are captured
        self._text: tuple[torch.Tensor, torch.Tensor] | None = None  # [blocks, max_batch, L, H, d]
        self._slots: list[Any] = []  # per text slot: a weak reference to the CrossKV in it

    def run(self, act: StageActivation, units: list[ChunkInput]) -> StageActivation:
        """The stage's blocks on a batch: replayed from a graph where one fits."""
        dit, stage = self.dit, self.stage
        plan = dit.plan_blocks(act, units)
        key = self._key(act, plan, units)
        entry = None if key is None else self._graphs.get(key)
        if key is not None:
            self._choice.seen(key)
        if (
            entry is None
            and key is not None
            and not self.stats.failures
            and self._choice.admits(key, self._graphs)
        ):
            try:
                entry = self._keep(key, self._capture(act, plan, units))
            except Exception:  # the stage runs eagerly from now on, as without graphs
                log.warning("stage %d: CUDA graph capture failed; eager now", stage.index, exc_info=True)
                self.stats.failures += 1
        if entry is None:
            self.stats.eager += 1
            return dit.run_planned(act, plan, dit.stacked_text(units), stage.start, stage.stop)
        self._graphs.move_to_end(key)
        self._load(entry, act, plan, units)
        entry.graph.replay()
        self.stats.replays += 1
        # Copied out at once: the next replay of any graph may reuse the pool's memory.
        return StageActivation(entry.out.clone(), act.modulation, act.temb, act.num_frames)

    def release(self) -> None:
        """Drops every graph and buffer (the K/V cache they point into is going); `stats` stay."""
        self._graphs.clear()
        self._choice = CaptureChoice(self.max_graphs)
        self._text, self._slots, self._pool = None, [], None

    def _key(self, act: StageActivation, plan: BlockPlan, units: list[ChunkInput]) -> tuple | None:
        """What a graph's shapes depend on; None where no graph applies."""
        batch = plan.batch
        if not isinstance(batch, PagedKVBatch) or len(units) > self.max_batch:
            return None
        text = units[0].text.keys[self.stage.start]
        if self._text is not None and text.shape != self._text[0].shape[2:]:
            return None  # prompts of another length than the slots hold
        if any(u.text.keys[self.stage.start].shape != text.shape for u in units):
            return None
        move = None if plan.batch_move is None else plan.batch_move[0]
        return (
            tuple(act.hidden.shape),
            act.hidden.dtype,
            tuple(act.modulation.shape),
            tuple(plan.q_turn.shape),
            plan.q_turn.dtype,
            batch.signature(),
            move,
        )

    def _keep(self, key: tuple, entry: _Graph) -> _Graph:
        """A captured graph into the stage's graphs, after dropping what `CaptureChoice`
        picks to make room (never `key`, which is not there yet)."""
        while len(self._graphs) >= self.max_graphs:
            del self._graphs[self._choice.victim(self._graphs)]
            self.stats.evicted += 1
        self._graphs[key] = entry
        self.stats.captured += 1
        log.info("stage %d: CUDA graph %d captured for %s", self.stage.index, self.stats.captured, key[0])
        return entry

    def _capture(self, act: StageActivation, plan: BlockPlan, units: list[ChunkInput]) -> _Graph:
        dit, stage = self.dit, self.stage
        if self._text is None:
            self._text = self._text_slots(units[0])
            self._slots = [None] * self.max_batch
            self._pool = torch.cuda.graph_pool_handle()
        b = len(units)
        move = plan.batch_move
        static = BlockPlan(
            [],  # the batched path reads no unit
            [],
            plan.q_turn.clone(),
            [],
            plan.batch.static_copy(),
            None if move is None else (move[0], move[1].clone(), move[2].clone()),
        )
        hidden, modulation = act.hidden.clone(), act.modulation.clone()
        text_k, text_v = self._text

        def text(index: int) -> tuple[torch.Tensor, torch.Tensor]:
            return text_k[index - stage.start, :b], text_v[index - stage.start, :b]

        graph = torch.cuda.CUDAGraph()
        # Captured on a stream of its own (the rank's may be the default stream, which cannot
        # capture) and replayed on the rank's. Nothing runs while capturing, so nothing needs
        # to wait for the device (`torch.cuda.graph` synchronises it, which fails while another
        # rank captures). Other threads (the decoder, other ranks) go on with their work; in
        # "thread_local" mode only this thread's calls are checked. One capture at a time in
        # the process.
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with _CAPTURING, torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                inputs = StageActivation(hidden, modulation, act.temb, act.num_frames)
                out = dit.run_planned(inputs, static, text, stage.start, stage.stop).hidden
            finally:
                graph.capture_end()
        return _Graph(graph, hidden, modulation, static, out)

    def _text_slots(self, unit: ChunkInput) -> tuple[torch.Tensor, torch.Tensor]:
        k = unit.text.keys[self.stage.start]
        shape = (self.stage.num_blocks, self.max_batch, *k.shape)
        return (
            torch.empty(shape, dtype=k.dtype, device=self.device),
            torch.empty(shape, dtype=unit.text.values[self.stage.start].dtype, device=self.device),
        )

    def _load(self, entry: _Graph, act: StageActivation, plan: BlockPlan, units: list[ChunkInput]) -> None:
        """The batch's inputs into the graph's buffers, on the current (the rank's) stream."""
        entry.hidden.copy_(act.hidden)
        entry.modulation.copy_(act.modulation)
        entry.plan.q_turn.copy_(plan.q_turn)
        if plan.batch_move is not None and entry.plan.batch_move is not None:
            entry.plan.batch_move[1].copy_(plan.batch_move[1])
            entry.plan.batch_move[2].copy_(plan.batch_move[2])
        entry.plan.batch.load(plan.batch)
        assert self._text is not None
        text_k, text_v = self._text
        start, stop = self.stage.start, self.stage.stop
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for i, u in enumerate(units):
            held = self._slots[i]
            if held is not None and held() is u.text:
                continue
            for j in range(stop - start):
                dst += [text_k[j, i], text_v[j, i]]
                src += [u.text.keys[start + j], u.text.values[start + j]]
            self._slots[i] = weakref.ref(u.text)
        if dst:
            torch._foreach_copy_(dst, src)
