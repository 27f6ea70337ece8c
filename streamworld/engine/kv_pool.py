"""K/V page bookkeeping: per-stage free lists, reservations, per-stream page tables.

A page holds the K and V of one latent frame for the blocks of one stage (one page per
version in `noisy` mode). This file only counts and hands out page numbers; the tensors the
numbers index are in kv_cache.py. A stream reserves its worst case at admission, so its
allocations never fail; pages that leave its attention window go back at once, and
`release` returns the rest and the reservation. A page freed by a cancelled stream can be
handed out at once: only its stage's executor touches the tensors, one batch at a time,
so whatever still writes the page is ordered before its next user.

Forks (engine.py): a branch's page table starts as a copy of its parent's, and each page
they share counts one reference per table (`KVPagePool.share`); `free` drops one, and a
page goes back to the free list when the last table lets it go, so it is freed exactly
once. Tables only ever write the frames of their own chunks, which no other table holds
(a fork happens between chunks), so a shared page is never written: `ensure` refuses to
hand one out for writing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_modes import context_frame_indices, retained_frame_indices


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


def pages_needed(num_versions: int, sink_frames: int, window_frames: int, chunk_frames: int) -> int:
    """Worst case per stage: per version the context plus the chunk being written."""
    return num_versions * (sink_frames + window_frames + chunk_frames)


class KVPagePool:
    """Page numbers of all stages; a stream reserves its worst case at admission."""

    def __init__(self, num_stages: int, pages_per_stage: int) -> None:
        self.num_stages = num_stages
        self.pages_per_stage = pages_per_stage
        self._free = [list(range(pages_per_stage - 1, -1, -1)) for _ in range(num_stages)]
        self._refs = [[0] * pages_per_stage for _ in range(num_stages)]  # page tables holding each page
        self.reserved = 0  # pages per stage promised to admitted streams

    @property
    def pages_total(self) -> int:
        return self.pages_per_stage * self.num_stages

    @property
    def pages_used(self) -> int:
        return sum(self.pages_per_stage - len(f) for f in self._free)

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
        page = self._free[stage].pop()
        self._refs[stage][page] = 1
        return page

    def share(self, stage: int, page: int) -> None:
        """One more page table holds `page`."""
        if self._refs[stage][page] < 1:
            raise RuntimeError(f"page {page} of stage {stage} is free and cannot be shared")
        self._refs[stage][page] += 1

    def refs(self, stage: int, page: int) -> int:
        return self._refs[stage][page]

    def free(self, stage: int, page: int) -> None:
        """One page table lets `page` go; it is free once none holds it."""
        refs = self._refs[stage][page]
        if refs < 1:
            raise RuntimeError(f"page {page} of stage {stage} freed twice")
        self._refs[stage][page] = refs - 1
        if refs == 1:
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
            elif self.pool.refs(stage, self.pages[key]) > 1:
                raise RuntimeError(f"frame {f} (stage {stage}, version {version}) is shared with a fork")
            out.append(self.pages[key])
        return out

    def fork(self, reserved: int) -> PageTable:
        """A table for a branch: the same pages (each now held once more) and its own
        reservation of `reserved` pages per stage, which the caller has made."""
        for (stage, _, _), page in self.pages.items():
            self.pool.share(stage, page)
        return PageTable(
            self.pool, self.num_versions, self.sink_frames, self.window_frames, reserved, dict(self.pages)
        )

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
