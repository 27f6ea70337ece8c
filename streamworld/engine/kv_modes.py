"""The KV modes in one place: what every unit of a chunk reads, writes and waits for.

A chunk runs its units in a fixed linear order: all stages of denoising step 0, then of
step 1, ..., then (in `clean` mode) the commit pass; so a chunk's progress is one integer.
The first-image prefill runs as chunk -1 with the single phase PREFILL.

    mode    forwards/chunk  versions  step k reads  step k writes   commit pass
    clean   S + 1 (S last)  1         v0            nothing         reads v0, writes v0
    final   S               1         v0            v0 (k = S-1)    none
    noisy   S               S         vk            vk              none

A stream's last chunk is read by no later chunk, so in `clean` mode it skips its commit
pass (S forwards): the pass writes K/V only, never frames. A stream that has started its
last chunk can no longer be forked, so nothing else reads that K/V either.

A unit `(chunk c, phase, stage g)` may run once chunk c-1 has written, at stage g, the
version it reads (`context_dependency`): in `noisy` mode that is c-1's step k, so chunk c
can run step k while chunk c-1 runs step k+1 (the diagonal pipeline).

The attention context of a chunk starting at latent frame f: the first `sink_frames` frames
of the stream, then the `window_frames` frames before f. Frames that no later chunk reads
leave the cache at once.
"""

from __future__ import annotations

COMMIT = -1  # phase of the clean-mode commit pass
PREFILL = -2  # phase of the first-image prefill (chunk -1)
PREFILL_CHUNK = -1


def chunk_phases(kv_mode: str, num_steps: int, read_later: bool = True) -> list[int]:
    """Phases of a generated chunk in execution order; a chunk that no later chunk reads
    (`read_later` False: its stream's last) has no commit pass."""
    return list(range(num_steps)) + ([COMMIT] if kv_mode == "clean" and read_later else [])


def unit_index(phases: list[int], phase: int, stage: int, num_stages: int) -> int:
    """Position of (phase, stage) in a chunk's linear order."""
    return phases.index(phase) * num_stages + stage


def context_dependency(kv_mode: str, phase: int, num_steps: int) -> int:
    """The phase of the previous chunk whose K/V (at the same stage) a unit reads.

    noisy: step k reads what the previous chunk wrote at step k; final: what it wrote at its
    last step; clean: what its commit pass wrote. The commit pass reads what the steps read.
    """
    if kv_mode == "noisy":
        return phase
    if kv_mode == "final":
        return num_steps - 1
    return COMMIT


def num_kv_versions(kv_mode: str, num_steps: int) -> int:
    """`noisy` keeps one version of every cached frame per denoising step."""
    return num_steps if kv_mode == "noisy" else 1


def step_kv_access(kv_mode: str, step: int, num_steps: int) -> tuple[int, tuple[int, ...]]:
    """(version read, versions written) by denoising step `step` of a chunk."""
    if kv_mode == "clean":
        return 0, ()
    if kv_mode == "final":
        return 0, ((0,) if step == num_steps - 1 else ())
    if kv_mode == "noisy":
        return step, (step,)
    raise ValueError(f"unknown kv_mode {kv_mode!r}")


def commit_kv_access(kv_mode: str) -> tuple[int, tuple[int, ...]] | None:
    """(version read, versions written) by the commit pass; None when the mode has none."""
    return (0, (0,)) if kv_mode == "clean" else None


def prefill_kv_access(kv_mode: str, num_steps: int) -> tuple[int, tuple[int, ...]]:
    """The first-image prefill writes its clean K/V into every version."""
    return 0, tuple(range(num_kv_versions(kv_mode, num_steps)))


def unit_kv_access(kv_mode: str, phase: int, num_steps: int) -> tuple[int, tuple[int, ...]]:
    """(version read, versions written) by a unit of any phase."""
    if phase == PREFILL:
        return prefill_kv_access(kv_mode, num_steps)
    if phase == COMMIT:
        access = commit_kv_access(kv_mode)
        if access is None:
            raise ValueError(f"kv_mode {kv_mode!r} has no commit pass")
        return access
    return step_kv_access(kv_mode, phase, num_steps)


def context_frame_indices(first_frame: int, sink_frames: int, window_frames: int) -> list[int]:
    """Absolute latent frames a chunk starting at `first_frame` attends to, in order.

    The first `sink_frames` frames of the stream, then the `window_frames` most recent ones.
    """
    sinks = list(range(min(sink_frames, first_frame)))
    recent = range(max(sink_frames, first_frame - window_frames), first_frame)
    return sinks + list(recent)


def context_frame_count(first_frame: int, sink_frames: int, window_frames: int) -> int:
    """`len(context_frame_indices(...))` without building the list: the scheduler batches
    only units of one context length (scheduler.py)."""
    sinks = min(sink_frames, first_frame)
    return sinks + max(0, first_frame - max(sink_frames, first_frame - window_frames))


def retained_frame_indices(next_first_frame: int, sink_frames: int, window_frames: int) -> set[int]:
    """Frames that must stay cached for the chunk starting at `next_first_frame` and later ones."""
    return set(context_frame_indices(next_first_frame, sink_frames, window_frames))
