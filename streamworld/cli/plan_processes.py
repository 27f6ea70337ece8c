"""`eval pusht --plan --processes P`: the episodes of one planning evaluation in P processes
side by side, each with its own model, engine and host thread, reported as one run.

One process plans its episodes on one host thread (the environment, the scene fits, the
costs, the scheduler), which on a GPU leaves the GPU mostly idle whatever `--concurrent`
batches (docs/benchmarks.md); processes side by side run that host work in parallel. The
processes are spawned (CUDA cannot be forked), get every P-th seed, and send each finished
episode back over a queue, so the parent's progress bar and --json follow the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import queue
import traceback
from collections.abc import Callable

from .errors import UsageError

# How long the parent waits on the queue before it checks for processes that died without
# a word (killed by the OS, for example).
_POLL_SECONDS = 1.0
_TRACEBACK_CHARS = 4000


class PlanningProcessError(RuntimeError):
    """A planning process failed or died; the run stops, and the others with it."""


def plan_in_processes(
    seeds: list[int],
    config,
    args: argparse.Namespace,
    on_episode: Callable,
    processes: int,
    plan: Callable,
    target: Callable | None = None,
) -> None:
    """Plans `seeds` in `processes` spawned processes, each running `plan(its seeds, config,
    args, on_episode)` (`eval._plan_episodes`, passed in, so that this module does not import
    the command's), and calls on_episode(result, planner, counters, process) here as each
    episode ends. Returns when every process is done. When
    one fails, stops the rest and raises: UsageError for the user's own mistake (as one
    process would), else PlanningProcessError with the process's traceback. `target`
    replaces the process's work (tests)."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // processes)
    workers = [
        context.Process(
            target=target or _plan_share,
            args=(index, seeds[index::processes], config, args, messages, threads, plan),
            name=f"streamworld-plan-{index}",
            daemon=True,
        )
        for index in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        _collect(workers, messages, on_episode)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        for worker in workers:
            worker.join()


def _collect(workers: list, messages, on_episode: Callable) -> None:
    running = set(range(len(workers)))
    while running:
        try:
            kind, index, payload = messages.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            for index in sorted(running):
                code = workers[index].exitcode
                if code is not None and code != 0:
                    raise PlanningProcessError(
                        f"planning process {index} exited with code {code} before it finished"
                    ) from None
            continue
        if kind == "episode":
            on_episode(*payload, process=index)
        elif kind == "done":
            running.discard(index)
        elif kind == "usage":
            raise UsageError(payload)
        else:  # "failed"
            raise PlanningProcessError(f"planning process {index} failed:\n{payload}")


def _plan_share(index: int, seeds: list[int], config, args, messages, threads: int, plan: Callable) -> None:
    """One planning process: its seeds through `plan`, each episode sent back."""
    import torch

    torch.set_num_threads(threads)  # the processes share the machine's cores

    def sent(result, planner: dict, counters) -> None:
        messages.put(("episode", index, (result, planner, counters)))

    # Failures go to the parent as messages, and the process ends quietly: the parent
    # prints one report of them (a usage error as one line, as in one process).
    try:
        asyncio.run(plan(seeds, config, args, sent))
    except UsageError as e:
        messages.put(("usage", index, str(e)))
        return
    except KeyboardInterrupt:  # Ctrl-C reaches the parent too, which stops the run
        return
    except Exception:
        messages.put(("failed", index, traceback.format_exc()[-_TRACEBACK_CHARS:]))
        return
    messages.put(("done", index, None))
