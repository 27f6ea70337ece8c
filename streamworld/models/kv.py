"""How the causal DiT reads and writes its self-attention K/V.

The model never owns K/V memory. For every chunk it runs, the caller hands it a `KVView`:
`context(block)` returns the keys and values of the context frames (in attention order)
and `store(block, k, v)` receives the chunk's own keys and values. Which version a view
reads and whether (and where) it writes is the caller's KV-mode logic
(`streamworld.engine.kv_modes`); the sequential reference uses
`streamworld.engine.reference.ContiguousKVCache`, the engine its paged K/V cache.

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
