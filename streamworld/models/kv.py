"""How the causal DiT reads and writes its self-attention K/V.

The model never owns K/V memory. For every chunk it runs, the caller hands it a `KVView`:
`context(block)` returns the keys and values of the context frames (in attention order)
and `store(block, k, v)` receives the chunk's own keys and values. Which version a view
reads and whether (and where) it writes is the caller's KV-mode logic; the sequential
reference uses `streamworld.engine.reference.ContiguousKVCache`, the engine its page pool.

Keys are stored *after* RoPE, rotated at the absolute latent frame index of their frame,
so a cached key is rotated once and never again. Queries are rotated at their
own absolute positions. Attention depends only on position differences, so the window
frames, which directly precede the chunk, are where they should be. The sink frames keep
positions 0.., and once frames leave the window a gap opens between them and the window;
at read time the model moves the sink keys forward by that gap (one temporal rotation of
the sink frames' keys), so the sinks sit directly before the window. Relative positions therefore never
exceed sink + window + chunk however long the stream runs, and no position table grows:
temporal angles are computed on demand in float64.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVView(Protocol):
    @property
    def context_frames(self) -> int:
        """Number of latent frames in the attention context of this chunk."""
        ...

    @property
    def first_frame(self) -> int:
        """Absolute latent frame index of the chunk's first frame."""
        ...

    @property
    def sink_frames(self) -> int:
        """How many of the context frames (at its start) are sink frames."""
        ...

    def context(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys (rotated at their absolute positions) and values
        [context_frames * tokens_per_frame, heads, head_dim]."""
        ...

    def store(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The chunk's own keys (rotated) and values [F * tokens_per_frame, heads, head_dim]."""
        ...


def context_frame_indices(first_frame: int, sink_frames: int, window_frames: int) -> list[int]:
    """Absolute latent frames a chunk starting at `first_frame` attends to, in order.

    The first `sink_frames` frames of the stream, then the `window_frames` most recent ones.
    """
    sinks = list(range(min(sink_frames, first_frame)))
    recent = range(max(sink_frames, first_frame - window_frames), first_frame)
    return sinks + list(recent)


def retained_frame_indices(next_first_frame: int, sink_frames: int, window_frames: int) -> set[int]:
    """Frames that must stay cached for the chunk starting at `next_first_frame` and later ones."""
    return set(context_frame_indices(next_first_frame, sink_frames, window_frames))


def num_kv_versions(kv_mode: str, num_steps: int) -> int:
    """`noisy` keeps one version of every cached frame per denoising step."""
    return num_steps if kv_mode == "noisy" else 1


def step_kv_access(kv_mode: str, step: int, num_steps: int) -> tuple[int, tuple[int, ...]]:
    """(version read, versions written) by denoising step `step` of a chunk.

    clean: steps read the committed clean K/V and write nothing (the commit pass writes).
    final: steps read version 0; the last step writes it.
    noisy: step k reads and writes version k.
    """
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
