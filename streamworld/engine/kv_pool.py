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

    @property
    def context_frames(self) -> int:
        return len(self.read_pages)

    def context(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.read_pages:
            return None
        local = block - self.stage.start
        idx = torch.tensor(self.read_pages, device=self.pool.keys[self.stage.index].device)
        k = self.pool.keys[self.stage.index][idx, local]
        v = self.pool.values[self.stage.index][idx, local]
        return k.flatten(0, 1), v.flatten(0, 1)

    def store(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        local = block - self.stage.start
        p = self.tokens_per_frame
        keys, values = self.pool.keys[self.stage.index], self.pool.values[self.stage.index]
        for pages in self.write_pages:
            idx = torch.tensor(pages, device=keys.device)
            keys[idx, local] = key.reshape(len(pages), p, *key.shape[1:]).to(keys.dtype)
            values[idx, local] = value.reshape(len(pages), p, *value.shape[1:]).to(values.dtype)
