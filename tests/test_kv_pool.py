"""K/V page bookkeeping alone: reservations, allocation, window eviction, release."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from streamworld.engine.kv_modes import context_frame_indices, num_kv_versions
from streamworld.engine.kv_pool import KVPagePool, PageTable, PoolExhausted, pages_needed, split_stages

SINK, WINDOW, CHUNK = 1, 6, 3


def table(pool: KVPagePool, versions: int = 1) -> PageTable:
    need = pages_needed(versions, SINK, WINDOW, CHUNK)
    pool.reserve(need)
    return PageTable(pool, versions, SINK, WINDOW, need)


def run_chunks(t: PageTable, chunks: int, stages: int, versions: int) -> int:
    """Writes `chunks` chunks as the engine does (allocate, then evict what left the
    window); returns the most pages the table held at once."""
    most = 0
    for c in range(chunks):
        first = c * CHUNK
        for stage in range(stages):
            for v in range(versions):
                if first:
                    assert len(t.context_pages(stage, v, first)) == len(
                        context_frame_indices(first, SINK, WINDOW)
                    )
                t.ensure(stage, v, range(first, first + CHUNK))
                most = max(most, len(t.pages))
                t.evict(stage, v, first + CHUNK)
    return most


def test_admission_arithmetic_is_the_worst_case_per_version():
    assert pages_needed(1, SINK, WINDOW, CHUNK) == SINK + WINDOW + CHUNK
    assert pages_needed(num_kv_versions("noisy", 4), SINK, WINDOW, CHUNK) == 4 * (SINK + WINDOW + CHUNK)
    pool = KVPagePool(2, 25)
    assert pool.pages_total == 50
    assert pool.can_reserve(25) and not pool.can_reserve(26)
    pool.reserve(20)
    assert not pool.can_reserve(6) and pool.can_reserve(5)
    with pytest.raises(PoolExhausted):
        pool.reserve(6)
    pool.unreserve(20)
    assert pool.reserved == 0


@pytest.mark.parametrize("versions", [1, 4])
def test_a_stream_never_holds_more_than_it_reserved_and_returns_every_page(versions):
    pool = KVPagePool(2, 100)
    t = table(pool, versions)
    most = run_chunks(t, chunks=12, stages=2, versions=versions)
    # Per stage and version: sinks + window + the chunk being written, never more.
    assert most <= 2 * versions * (SINK + WINDOW + CHUNK)
    assert most <= 2 * t.reserved
    # After the window filled, only the sinks and the window stay.
    assert len(t.pages) == 2 * versions * (SINK + WINDOW)
    assert pool.pages_used == len(t.pages)
    t.release()
    assert pool.pages_used == 0 and pool.reserved == 0 and t.pages == {}


def test_eviction_frees_exactly_the_frames_that_left_the_window():
    pool = KVPagePool(1, 100)
    t = table(pool)
    run_chunks(t, chunks=5, stages=1, versions=1)  # frames 0..14 written
    kept = sorted(f for (_, _, f) in t.pages)
    assert kept == context_frame_indices(15, SINK, WINDOW) == [0, 9, 10, 11, 12, 13, 14]
    assert pool.pages_used == 7


def test_pages_go_back_to_the_pool_and_are_handed_out_again():
    pool = KVPagePool(1, 4)
    pages = [pool.allocate(0) for _ in range(4)]
    assert sorted(pages) == [0, 1, 2, 3]
    with pytest.raises(PoolExhausted):
        pool.allocate(0)
    pool.free(0, pages[2])
    assert pool.allocate(0) == pages[2]


def test_reading_a_frame_that_was_never_written_is_an_error():
    t = table(KVPagePool(1, 100))
    t.ensure(0, 0, range(0, 3))
    with pytest.raises(RuntimeError, match="missing"):
        t.context_pages(0, 0, 6)  # frames 3..5 were never written


def test_stages_cover_the_blocks_contiguously():
    stages = split_stages(30, 4)
    assert [(s.start, s.stop) for s in stages] == [(0, 8), (8, 15), (15, 22), (22, 30)]
    with pytest.raises(ValueError):
        split_stages(3, 4)


ENGINE = Path(__file__).resolve().parent.parent / "streamworld"


def _imports(path: Path) -> set[Path | str]:
    """Project modules (as files) and outside packages (as names) one file imports."""
    out: set[Path | str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level == 0:
                out.add((node.module or "").split(".")[0])
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split("."))
            out.add(
                target.with_suffix(".py") if target.with_suffix(".py").exists() else target / "__init__.py"
            )
    return out


def _reaches_torch(path: Path, seen: set[Path]) -> bool:
    if path in seen:
        return False
    seen.add(path)
    for dep in _imports(path):
        if dep == "torch":
            return True
        if isinstance(dep, Path) and dep.name != "__init__.py" and _reaches_torch(dep, seen):
            return True
    return False


@pytest.mark.parametrize(
    "module", ["scheduler", "stream", "kv_pool", "kv_modes", "request", "config", "placement"]
)
def test_the_engine_bookkeeping_imports_no_torch(module):
    """The scheduler's world is metadata: neither it nor what it imports touches torch."""
    assert not _reaches_torch(ENGINE / "engine" / f"{module}.py", set())


def test_the_torch_check_sees_torch():
    assert _reaches_torch(ENGINE / "engine" / "runner.py", set())
