"""First frames for image-to-world models that come with their own environment.

A session (or `generate`, or `bench`) that gives such a model no image starts from the
environment's initial frame for its seed. Today that is PushT; other models need an image.

The server makes these frames in a child process (`ChildProcessFrames`): PushT's physics
engine (chipmunk, through pymunk) is native code that crashed the whole server process
twice in two hours of chaos load (a segfault inside chipmunk while several sessions made
first frames at once), taking every live session with it. In a child, such a crash costs
the one session that asked, which gets an `internal` error; the next request starts a new
child. The command line makes its frames in process.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from .models.config import ModelConfig

log = logging.getLogger(__name__)

# seed -> (image uint8 [H, W, 3], a JSON description of the scene for session.started, or None)
FirstFrame = Callable[[int], tuple[np.ndarray, dict[str, Any] | None]]


def pusht_frame(seed: int, size: int) -> tuple[np.ndarray, dict[str, Any] | None]:
    """PushT's first frame and scene for `seed` (module level: a child process can run it)."""
    from .pusht.world import initial_frame

    image, scene = initial_frame(seed, size)
    return image, scene.to_json()


def first_frame_source(config: ModelConfig, isolated: bool = False) -> FirstFrame | None:
    """The first-frame source of a model, or None when it has no environment. `isolated`
    (the server): made in a child process, see `ChildProcessFrames`."""
    if config.environment != "pusht":
        return None
    make = functools.partial(pusht_frame, size=config.height)
    return ChildProcessFrames(make) if isolated else make


class ChildProcessFrames:
    """A first-frame source that runs `make(seed)` in one child process (started on first
    use, by spawning, so it holds no copy of the server's threads or model), and keeps the
    last `cache_size` frames. A child that dies is replaced, and the call retried once; a
    second death is raised as a RuntimeError. Safe to call from several threads."""

    def __init__(self, make: Callable[[int], Any], cache_size: int = 256, timeout_s: float = 60.0) -> None:
        self.make = make
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self.restarts = 0  # children replaced after dying

    def __call__(self, seed: int) -> Any:
        with self._lock:
            if seed in self._cache:
                self._cache.move_to_end(seed)
                return self._cache[seed]
        result = self._make(seed)
        with self._lock:
            self._cache[seed] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result

    def _make(self, seed: int, retry: bool = True) -> Any:
        pool = self._child()
        try:
            return pool.submit(self.make, seed).result(timeout=self.timeout_s)
        except BrokenProcessPool:
            self._replace(pool)
            if not retry:
                raise RuntimeError(
                    f"the environment's process died making the first frame for seed {seed}"
                ) from None
        log.warning("the first-frame process died (seed %s); starting a new one", seed)
        return self._make(seed, retry=False)

    def _child(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            return self._pool

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self.restarts += 1
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def resting_action(config: ModelConfig, scene: dict[str, Any] | None) -> list[float] | None:
    """The action that leaves a scene as it is, where the model's actions are positions: for
    `pusht` the agent's own position (its target). None where zeros already mean "do nothing"
    or the scene is unknown."""
    if config.environment == "pusht" and scene and "agent" in scene:
        return [float(v) for v in scene["agent"][:2]]
    return None
