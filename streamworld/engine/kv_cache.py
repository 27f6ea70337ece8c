"""The K/V tensors behind the page pool, and the paged views the DiT reads and writes.

Each stage has its own preallocated tensors `[num_pages, blocks_in_stage, tokens_per_frame,
heads, head_dim]` on its device; page numbers come from `KVPagePool` (kv_pool.py). Only
the executor of a stage touches its tensors: views are built from page numbers on the
event loop and make their index tensors on the executor thread, on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..models.transfer import tensor_on
from ..models.world_model import WorldModel
from .kv_pool import Stage


def default_pages(
    model: WorldModel,
    wanted: int,
    memory_fraction: float,
    stages: Sequence[Stage] | None = None,
    devices: Sequence[torch.device] | None = None,
) -> int:
    """Pages per stage: `wanted`, capped on each GPU at `memory_fraction` of its free memory
    for the blocks of the stages placed there (all blocks on the model's device by default)."""
    cfg = model.config
    stages = stages or [Stage(0, 0, cfg.num_layers)]
    devices = devices or [model.device] * len(stages)
    blocks: dict[torch.device, int] = {}
    for stage, device in zip(stages, devices, strict=True):
        blocks[device] = blocks.get(device, 0) + stage.num_blocks
    pages = wanted
    element = torch.empty((), dtype=model.dtype).element_size()
    for device, count in blocks.items():
        if device.type != "cuda":
            continue
        free, _ = torch.cuda.mem_get_info(device)
        # Memory PyTorch's allocator holds but does not use is free for the pool too
        # (an engine closed earlier in this process leaves its pool there).
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        # A page in every stage on this device: K and V of one frame for their blocks.
        page_bytes = 2 * count * cfg.tokens_per_frame * model.dit.dim * element
        pages = min(pages, int(memory_fraction * free) // page_bytes)
    return max(pages, 1)


class KVCache:
    """The K and V pages of every stage."""

    def __init__(
        self,
        stages: list[Stage],
        pages_per_stage: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | Sequence[torch.device],
    ) -> None:
        shape = (tokens_per_frame, heads, head_dim)
        devices = [device] * len(stages) if isinstance(device, torch.device) else list(device)
        # Uninitialised: every page is written before it is read. Each stage's on its device.
        self.keys = [
            torch.empty(pages_per_stage, s.num_blocks, *shape, dtype=dtype, device=d)
            for s, d in zip(stages, devices, strict=True)
        ]
        self.values = [torch.empty_like(k) for k in self.keys]

    @classmethod
    def for_model(
        cls,
        model: WorldModel,
        stages: list[Stage],
        pages_per_stage: int,
        devices: Sequence[torch.device] | None = None,
    ) -> KVCache:
        dit = model.dit
        config = model.config
        return cls(
            stages,
            pages_per_stage,
            config.tokens_per_frame,
            dit.heads,
            dit.head_dim,
            model.dtype,
            model.device if devices is None else devices,
        )

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))


@dataclass
class PagedKVView:
    """A KVView over cache pages for one unit and one stage (see streamworld.models.kv)."""

    cache: KVCache
    stage: Stage
    read_pages: list[int]
    write_pages: list[list[int]]  # per written version, one page per chunk frame
    tokens_per_frame: int
    first_frame: int  # absolute latent frame index of the chunk's first frame
    sink_frames: int  # sink frames at the start of the context
    # Page indices on the cache's device, made once per view (not once per block).
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
            self._read_idx = tensor_on(self.read_pages, self.cache.keys[self.stage.index].device)
        idx = self._read_idx
        # index_select/index_copy_ on one block's [pages, P, H, d] view: the vectorised
        # gather and copy kernels, not advanced indexing's element-by-element ones.
        k = self.cache.keys[self.stage.index][:, local].index_select(0, idx)
        v = self.cache.values[self.stage.index][:, local].index_select(0, idx)
        return k.flatten(0, 1), v.flatten(0, 1)

    def store(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        local = block - self.stage.start
        p = self.tokens_per_frame
        keys, values = self.cache.keys[self.stage.index], self.cache.values[self.stage.index]
        if self._write_idx is None:
            self._write_idx = [tensor_on(pages, keys.device) for pages in self.write_pages]
        for pages, idx in zip(self.write_pages, self._write_idx, strict=True):
            keys[:, local].index_copy_(0, idx, key.reshape(len(pages), p, *key.shape[1:]).to(keys.dtype))
            values[:, local].index_copy_(
                0, idx, value.reshape(len(pages), p, *value.shape[1:]).to(values.dtype)
            )

    @staticmethod
    def plan(views: list[PagedKVView]) -> PagedKVBatch | None:
        """One batched reader/writer for views of one cache and stage whose contexts have the
        same length (None otherwise): each block then costs one gather and one scatter for
        the whole batch instead of several small copies per unit."""
        first = views[0]
        if any(
            v.cache is not first.cache
            or v.stage.index != first.stage.index
            or len(v.read_pages) != len(first.read_pages)
            for v in views
        ):
            return None
        return PagedKVBatch(views)


class PagedKVBatch:
    """The K/V reads and writes of a batch of `PagedKVView`s, one copy per block.

    Copies go through `index_select` and `index_copy_` on one block's `[pages, P, H, d]`
    view of the cache: on an H200 these vectorised kernels move the K/V of 8 streams at
    320x512 in about 60% of the time advanced indexing takes (docs/benchmarks.md).
    """

    def __init__(self, views: list[PagedKVView]) -> None:
        cache, stage = views[0].cache, views[0].stage
        self.keys, self.values = cache.keys[stage.index], cache.values[stage.index]
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
        # Row i of the written K/V goes to page i when every unit writes one version; units
        # that write several versions, or none, need the rows picked.
        frames = max((len(p) for v in views for p in v.write_pages), default=0)
        self.rows = tensor_on(rows, device) if pages and rows != list(range(len(views) * frames)) else None
        # Context then the unit's own frames (as its first written version stores them), so
        # that attention's keys come out of the cache in one gather, without a concatenation.
        self.with_own = (
            tensor_on([p for v in views for p in (*v.read_pages, *v.write_pages[0])], device)
            if reads and all(v.write_pages for v in views)
            else None
        )

    def _indices(self) -> list[torch.Tensor | None]:
        return [self.read, self.write, self.rows, self.with_own]

    def signature(self) -> tuple:
        """What a CUDA graph of this batch depends on (engine/graphs.py): the cache, the
        batch size and which page indices there are, of what length."""
        lengths = tuple(None if t is None else t.numel() for t in self._indices())
        return (id(self.keys), self.start, self.batch, self.p, lengths)

    def static_copy(self) -> PagedKVBatch:
        """The same reader and writer over page indices of its own, for a CUDA graph to read;
        `load` refills them for another batch of the same `signature`."""
        copy = object.__new__(PagedKVBatch)
        copy.__dict__.update(self.__dict__)
        copy.read, copy.write, copy.rows, copy.with_own = (
            None if t is None else t.clone() for t in self._indices()
        )
        return copy

    def load(self, other: PagedKVBatch) -> None:
        """`other`'s page indices into this batch's own (on the current stream)."""
        for mine, theirs in zip(self._indices(), other._indices(), strict=True):
            if mine is not None and theirs is not None:
                mine.copy_(theirs, non_blocking=True)

    def context(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [B, context_frames * P, H, d]."""
        return None if self.read is None else self._gather(block, self.read)

    def context_and_own(self, block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After `store`: keys and values [B, (context_frames + F) * P, H, d] of the context
        followed by the units' own frames, as attention takes them; None where that takes
        more than one gather (no context, nothing written) or would round the units' own K/V
        (the cache holds another dtype than `dtype`)."""
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
