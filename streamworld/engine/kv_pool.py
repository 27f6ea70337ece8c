"""The K/V page pool: preallocated memory, per-stream page tables, admission.

A page holds the K and V of one latent frame for the blocks of one stage (one page per
version in `noisy` mode). Each stage has its own preallocated tensors
`[num_pages, blocks_in_stage, tokens_per_frame, heads, head_dim]`; only that stage's
executor touches them, one batch at a time, so a page freed by a cancelled stream can be
handed out at once: whatever still writes it is ordered before its next user.

Bookkeeping (this file's `PageTable`, the reservation counters) is plain Python; tensors are
only touched inside `PagedKVView`, which runs on the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.kv import context_frame_indices, retained_frame_indices
from ..models.transfer import tensor_on


class PoolExhausted(RuntimeError):
    pass


@dataclass(frozen=True)
class Stage:
    index: int
    start: int  # first block
    stop: int  # one past the last block

    @property
    def num_blocks(self) -> int:
        return self.stop - self.start


def split_stages(num_blocks: int, num_stages: int) -> list[Stage]:
    """Contiguous, nearly equal block ranges."""
    if not 1 <= num_stages <= num_blocks:
        raise ValueError(f"num_stages must be between 1 and the number of blocks ({num_blocks})")
    bounds = [round(i * num_blocks / num_stages) for i in range(num_stages + 1)]
    return [Stage(i, bounds[i], bounds[i + 1]) for i in range(num_stages)]


class KVPagePool:
    """Pages of all stages; a stream reserves its worst case at admission."""

    def __init__(
        self,
        stages: list[Stage],
        pages_per_stage: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.stages = stages
        self.pages_per_stage = pages_per_stage
        shape = (tokens_per_frame, heads, head_dim)
        # Uninitialised: every page is written before it is read.
        self.keys = [
            torch.empty(pages_per_stage, s.num_blocks, *shape, dtype=dtype, device=device) for s in stages
        ]
        self.values = [torch.empty_like(k) for k in self.keys]
        self._free = [list(range(pages_per_stage - 1, -1, -1)) for _ in stages]
        self.reserved = 0  # pages per stage promised to admitted streams

    @property
    def pages_total(self) -> int:
        return self.pages_per_stage * len(self.stages)

    @property
    def pages_used(self) -> int:
        return sum(self.pages_per_stage - len(f) for f in self._free)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def can_reserve(self, pages: int) -> bool:
        return self.reserved + pages <= self.pages_per_stage

    def reserve(self, pages: int) -> None:
        if not self.can_reserve(pages):
            raise PoolExhausted(
                f"{pages} pages per stage do not fit ({self.reserved}/{self.pages_per_stage} reserved)"
            )
        self.reserved += pages

    def unreserve(self, pages: int) -> None:
        self.reserved -= pages

    def allocate(self, stage: int) -> int:
        if not self._free[stage]:
            raise PoolExhausted(f"stage {stage} has no free page")
        return self._free[stage].pop()

    def free(self, stage: int, page: int) -> None:
        self._free[stage].append(page)


@dataclass
class PageTable:
    """One stream's pages: (stage, version, latent frame) -> page."""

    pool: KVPagePool
    num_versions: int
    sink_frames: int
    window_frames: int
    reserved: int
    pages: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def ensure(self, stage: int, version: int, frames: range) -> list[int]:
        """Pages for frames about to be written, allocated on first use."""
        out = []
        for f in frames:
            key = (stage, version, f)
            if key not in self.pages:
                self.pages[key] = self.pool.allocate(stage)
            out.append(self.pages[key])
        return out

    def context_pages(self, stage: int, version: int, first_frame: int) -> list[int]:
        frames = context_frame_indices(first_frame, self.sink_frames, self.window_frames)
        try:
            return [self.pages[(stage, version, f)] for f in frames]
        except KeyError as e:
            raise RuntimeError(
                f"K/V of frame {e.args[0][2]} (stage {stage}, version {version}) missing"
            ) from None

    def evict(self, stage: int, version: int, next_first_frame: int) -> None:
        """Frees the pages of a version that no chunk from `next_first_frame` on reads."""
        keep = retained_frame_indices(next_first_frame, self.sink_frames, self.window_frames)
        for key in [k for k in self.pages if k[0] == stage and k[1] == version and k[2] not in keep]:
            if key[2] < next_first_frame:
                self.pool.free(stage, self.pages.pop(key))

    def release(self) -> None:
        """Returns every page and the reservation."""
        for (stage, _, _), page in self.pages.items():
            self.pool.free(stage, page)
        self.pages.clear()
        self.pool.unreserve(self.reserved)
        self.reserved = 0


def pages_needed(num_versions: int, sink_frames: int, window_frames: int, chunk_frames: int) -> int:
    """Worst case per stage: per version the context plus the chunk being written."""
    return num_versions * (sink_frames + window_frames + chunk_frames)


@dataclass
class PagedKVView:
    """A KVView over pool pages for one unit and one stage (see streamworld.models.kv)."""

    pool: KVPagePool
    stage: Stage
    read_pages: list[int]
    write_pages: list[list[int]]  # per written version, one page per chunk frame
    tokens_per_frame: int
    first_frame: int  # absolute latent frame index of the chunk's first frame
    sink_frames: int  # sink frames at the start of the context
    # Page indices on the pool's device, made once per view (not once per block).
    _read_idx: torch.Tensor | None = field(default=None, init=False, repr=False)
    _write_idx: list[torch.Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def context_frames(self) -> int:
        return len(self.read_pages)

    def context(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.read_pages:
            return None
        local = block - self.stage.start
        if self._read_idx is None:
            self._read_idx = tensor_on(self.read_pages, self.pool.keys[self.stage.index].device)
        idx = self._read_idx
        # index_select/index_copy_ on one block's [pages, P, H, d] view: the vectorised
        # gather and copy kernels, not advanced indexing's element-by-element ones.
        k = self.pool.keys[self.stage.index][:, local].index_select(0, idx)
        v = self.pool.values[self.stage.index][:, local].index_select(0, idx)
        return k.flatten(0, 1), v.flatten(0, 1)

    def store(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        local = block - self.stage.start
        p = self.tokens_per_frame
        keys, values = self.pool.keys[self.stage.index], self.pool.values[self.stage.index]
        if self._write_idx is None:
            self._write_idx = [tensor_on(pages, keys.device) for pages in self.write_pages]
        for pages, idx in zip(self.write_pages, self._write_idx, strict=True):
            keys[:, local].index_copy_(0, idx, key.reshape(len(pages), p, *key.shape[1:]).to(keys.dtype))
            values[:, local].index_copy_(
                0, idx, value.reshape(len(pages), p, *value.shape[1:]).to(values.dtype)
            )

    @staticmethod
    def plan(views: list[PagedKVView]) -> PagedKVBatch | None:
        """One batched reader/writer for views of one pool and stage whose contexts have the
        same length (None otherwise): each block then costs one gather and one scatter for
        the whole batch instead of several small copies per unit."""
        first = views[0]
        if any(
            v.pool is not first.pool
            or v.stage.index != first.stage.index
            or len(v.read_pages) != len(first.read_pages)
            for v in views
        ):
            return None
        return PagedKVBatch(views)


class PagedKVBatch:
    """The K/V reads and writes of a batch of `PagedKVView`s, one copy per block.

    Copies go through `index_select` and `index_copy_` on one block's `[pages, P, H, d]`
    view of the pool: on an H200 these vectorised kernels move the K/V of 8 streams at
    320x512 in about 60% of the time advanced indexing takes (docs/benchmarks.md).
    """

    def __init__(self, views: list[PagedKVView]) -> None:
        pool, stage = views[0].pool, views[0].stage
        self.keys, self.values = pool.keys[stage.index], pool.values[stage.index]
        self.start = stage.start
        self.p = views[0].tokens_per_frame
        self.batch = len(views)
        device = self.keys.device
        reads = views[0].read_pages
        self.read = tensor_on([p for v in views for p in v.read_pages], device) if reads else None
        pages, rows = [], []
        for i, v in enumerate(views):
            for version_pages in v.write_pages:
                pages.extend(version_pages)
                rows.extend(i * len(version_pages) + j for j in range(len(version_pages)))
        self.write = tensor_on(pages, device) if pages else None
        # Row i of the written K/V goes to page i unless some unit writes several versions.
        self.rows = tensor_on(rows, device) if pages and rows != list(range(len(rows))) else None
        # Context then the unit's own frames (as its first written version stores them), so
        # that attention's keys come out of the pool in one gather, without a concatenation.
        self.with_own = (
            tensor_on([p for v in views for p in (*v.read_pages, *v.write_pages[0])], device)
            if reads and all(v.write_pages for v in views)
            else None
        )

    def context(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [B, context_frames * P, H, d]."""
        return None if self.read is None else self._gather(block, self.read)

    def context_and_own(self, block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After `store`: keys and values [B, (context_frames + F) * P, H, d] of the context
        followed by the units' own frames, as attention takes them; None where that takes
        more than one gather (no context, nothing written) or would round the units' own K/V
        (the pool holds another dtype than `dtype`)."""
        if self.with_own is None or self.keys.dtype != dtype:
            return None
        return self._gather(block, self.with_own)

    def _gather(self, block: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = block - self.start
        k = self.keys[:, local].index_select(0, index)
        v = self.values[:, local].index_select(0, index)
        return k.view(self.batch, -1, *k.shape[2:]), v.view(self.batch, -1, *v.shape[2:])

    def store(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The units' own keys and values [B, F * P, H, d]."""
        if self.write is None:
            return
        local = block - self.start
        shape = (-1, self.p, *key.shape[2:])
        key, value = key.reshape(shape), value.reshape(shape)
        if self.rows is not None:
            key, value = key[self.rows], value[self.rows]
        self.keys[:, local].index_copy_(0, self.write, key.to(self.keys.dtype))
        self.values[:, local].index_copy_(0, self.write, value.to(self.values.dtype))
