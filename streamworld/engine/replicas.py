"""Replicas: several engines that serve one model as one pool of capacity.

Each replica is a whole `AsyncEngine` with its own weights, K/V pool, executors and decoder
(placed by a `Placement`, placement.py). A new stream goes to the replica that can admit it
soonest (`scheduler.choose_replica`: free pages, then fewest live streams of its class) and
runs there for its whole life: its K/V lives there. While no replica can admit it, it
waits in the queue of the replica with the shortest queue; when pages free up on a
replica whose own queue is then empty, the longest-waiting stream of the others that fits
there moves over and is admitted, so no stream waits on one replica while another has
room. The admission queue's bound (`max_queue`) counts every replica's waiting streams
together, and `Overloaded` is raised past it, as for one engine.

`ReplicaSet` offers what the server uses of an engine (`open_stream`, `start`, `close`,
`live_streams`, `waiting`, `pages_used`); with one engine it behaves exactly as that engine.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from .engine import AsyncEngine
from .handle import StreamHandle
from .request import PRIORITY_CLASSES, Overloaded, StreamRequest
from .scheduler import ReplicaLoad, choose_replica


class ReplicaSet:
    def __init__(self, engines: Sequence[AsyncEngine], max_queue: int | None = None) -> None:
        if not engines:
            raise ValueError("a replica set needs at least one engine")
        self.engines = list(engines)
        self.max_queue = self.engines[0].config.max_queue if max_queue is None else max_queue
        ids = itertools.count(1)
        for index, engine in enumerate(self.engines):
            engine.replica = index
            engine.share_ids(ids)
            engine.on_capacity = self._capacity_freed

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        for engine in self.engines:
            await engine.start()

    async def close(self) -> None:
        await asyncio.gather(*(engine.close() for engine in self.engines))

    async def __aenter__(self) -> ReplicaSet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- streams -------------------------------------------------------------------------------
    def open_stream(self, request: StreamRequest) -> StreamHandle:
        """Places a new stream on a replica (see the module's docstring) and opens it there."""
        need = self.engines[0].admission_need(request)  # also validates the request
        able = [e for e in self.engines if need <= e.pool.pages_per_stage]  # pools big enough
        if not able:
            return self.engines[0].open_stream(request)  # raises Unsupported: it fits nowhere
        priority = PRIORITY_CLASSES[request.priority]
        loads = {
            e.replica: ReplicaLoad(
                index=e.replica,
                admits_now=e.admits_now(need),
                free_pages=e.pool.pages_per_stage - e.pool.reserved,
                waiting=len(e.waiting),
                live_in_class=sum(1 for s in e.streams.values() if s.live and s.priority == priority),
            )
            for e in able
        }
        chosen = self.engines[choose_replica(list(loads.values()))]
        if not loads[chosen.replica].admits_now and self.waiting >= self.max_queue:
            raise Overloaded("the server is at capacity and its admission queue is full")
        return chosen.open_stream(request)

    def _capacity_freed(self, engine: AsyncEngine) -> None:
        """Pages came free on `engine` after its own queue had its turn: the longest-waiting
        stream of the other replicas that fits there moves over."""
        if engine.waiting:
            return
        while True:
            candidates = [
                (other.streams[sid].created_at, other, sid)
                for other in self.engines
                if other is not engine
                for sid in other.waiting
                if engine.admits_now(engine._pages_for(other.streams[sid].kv_mode))
            ]
            if not candidates:
                return
            _, other, sid = min(candidates, key=lambda c: c[0])
            engine.adopt_waiting(other.release_waiting(sid))
            if engine.waiting:  # adopted but not admitted: nothing more fits here
                return

    # --- what the server reads -----------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return sum(len(e.waiting) for e in self.engines)

    def live_streams(self) -> int:
        return sum(e.live_streams() for e in self.engines)

    @property
    def pages_used(self) -> int:
        return sum(e.pages_used for e in self.engines)
