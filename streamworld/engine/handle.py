"""StreamHandle: what a caller holds for one stream (the server's session holds nothing else).

It reads the stream's status and error, pushes actions and prompts, pauses the playback
clock, stops or cancels, and iterates over the decoded chunks as they come.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np

from .request import BranchRequest, StreamError
from .stream import ChunkOutput, Stream


class StreamControl(Protocol):
    """What a handle asks of the engine (AsyncEngine provides it)."""

    def queue_position(self, stream_id: int) -> int: ...
    def push_actions(self, stream_id: int, actions: np.ndarray, frame: int | None = None) -> None: ...
    def set_prompt(self, stream_id: int, prompt: str) -> None: ...
    def set_paused(self, stream_id: int, paused: bool) -> None: ...
    def stop(self, stream_id: int) -> None: ...
    def cancel(self, stream_id: int, reason: str = "cancelled") -> None: ...
    def fork(self, stream_id: int, branches: list[BranchRequest]) -> list[StreamHandle]: ...


class StreamHandle:
    """What a caller holds for one stream: an async iterator of decoded chunks."""

    def __init__(self, engine: StreamControl, stream: Stream) -> None:
        self._engine = engine
        self.stream = stream
        self._admitted = asyncio.Event()
        if stream.status not in ("waiting", "forking"):
            self._admitted.set()

    @property
    def id(self) -> int:
        return self.stream.id

    def rebind(self, engine: StreamControl) -> None:
        """Moves the handle to the engine that holds its stream now (a replica set moves
        waiting streams between replicas)."""
        self._engine = engine

    @property
    def replica(self) -> int:
        """Which replica of its model runs the stream (0 for a model with one)."""
        return getattr(self._engine, "replica", 0)

    @property
    def queue_position(self) -> int:
        """1-based position in the admission queue; 0 once admitted."""
        return self._engine.queue_position(self.stream.id)

    @property
    def status(self) -> str:
        """waiting, running, completed, cancelled or error."""
        return self.stream.status

    @property
    def live(self) -> bool:
        return self.stream.live

    @property
    def error(self) -> str | None:
        """Why the stream failed (status `error`), else None."""
        return self.stream.error

    @property
    def actions_known(self) -> int:
        """Video frames whose actions are known (the next appended action's frame)."""
        return self.stream.actions.known

    def set_paused(self, paused: bool) -> None:
        """Pauses or resumes the stream's playback clock (backpressure)."""
        self._engine.set_paused(self.id, paused)

    async def admitted(self) -> None:
        """Returns once the stream holds its pages (or has ended without them)."""
        await self._admitted.wait()

    def push_actions(self, actions: np.ndarray, frame: int | None = None) -> None:
        self._engine.push_actions(self.id, actions, frame)

    def set_prompt(self, prompt: str) -> None:
        self._engine.set_prompt(self.id, prompt)

    def cancel(self) -> None:
        self._engine.cancel(self.id)

    def fork(self, branches: list[BranchRequest]) -> list[StreamHandle]:
        """Branches of this stream (`AsyncEngine.fork`); each handle starts once the stream
        reaches the fork point."""
        return self._engine.fork(self.id, branches)

    @property
    def backlog(self) -> int:
        """Chunks delivered to this handle and not yet taken from it."""
        return self.stream.output.qsize()

    @property
    def fork_chunk(self) -> int | None:
        """A branch's first chunk (known once it has started), else None."""
        return self.stream.fork_chunk

    def stop(self) -> None:
        self._engine.stop(self.id)

    def __aiter__(self) -> StreamHandle:
        return self

    async def __anext__(self) -> ChunkOutput:
        item = await self.stream.output.get()
        if item is None:
            self.stream.output.put_nowait(None)  # later calls end too
            if self.stream.status == "error":
                raise StreamError(self.stream.error or "stream failed")
            raise StopAsyncIteration
        return item
