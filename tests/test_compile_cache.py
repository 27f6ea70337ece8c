"""`streamworld.compile_cache` and `train pusht --compile-cache`: kernels compiled by one
process are used by the next, on a machine whose own compile cache is empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from streamworld import compile_cache
from streamworld.cli import main as cli_main

# Compiles a small function on the CPU in a process of its own, with its own empty Inductor
# cache folder, and prints what the file calls returned and Inductor's cache counters.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from streamworld import compile_cache

    path, read_first = sys.argv[1], sys.argv[2] == "read"
    out = {"saved_before": compile_cache.save(path + ".unused")}
    if read_first:
        out["read"] = compile_cache.load(path)
    f = torch.compile(lambda x: (x.sin() * 2 + 1).cumsum(0))
    assert torch.allclose(f(torch.arange(8.0)), (torch.arange(8.0).sin() * 2 + 1).cumsum(0))
    out["written"] = compile_cache.save(path)
    out["inductor"] = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    print(json.dumps(out))
    """
)


def _compile_in_a_fresh_process(tmp_path, name: str, path, read_first: bool) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), "read" if read_first else "compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three processes compile on the CPU: about 50 s
def test_kernels_saved_by_one_process_are_cache_hits_in_the_next(tmp_path):
    path = tmp_path / "kernels.bin"
    first = _compile_in_a_fresh_process(tmp_path, "first", path, read_first=False)
    assert first["saved_before"] is None and not (tmp_path / "kernels.bin.unused").exists()
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1  # an empty folder compiles
    assert first["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert first["written"] == path.stat().st_size > 0
    second = _compile_in_a_fresh_process(tmp_path, "second", path, read_first=True)
    assert second["read"] == first["written"]
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1  # from the file alone
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    # A file torch cannot read is skipped: the process compiles as without one.
    path.write_bytes(b"not a cache")
    third = _compile_in_a_fresh_process(tmp_path, "third", path, read_first=True)
    assert third["read"] is None and third["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert path.stat().st_size == third["written"] > len(b"not a cache")  # replaced whole


def test_a_missing_file_reads_nothing_and_a_large_one_is_refused_unread(tmp_path, monkeypatch):
    assert compile_cache.load(tmp_path / "none.bin") is None
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 100)
    monkeypatch.setattr(compile_cache, "MAX_BYTES", 99)
    monkeypatch.setattr(type(big), "read_bytes", lambda self: pytest.fail("read before the size check"))
    with pytest.raises(ValueError, match="100 bytes, over the 99"):
        compile_cache.load(big)


def test_train_cli_reads_the_cache_before_training_and_writes_it_after(tmp_path, capsys, monkeypatch):
    """The wiring, without compiling: the file is read before the data is recorded and
    written after the last step, and the summary says how much of each."""
    import streamworld.pusht.train as train_module

    calls = []
    work = tmp_path / "work"

    def load(path):
        calls.append(("load", str(path), (work / "data").exists()))
        return 123

    def save(path):
        calls.append(("save", str(path), (work / "checkpoint.pt").exists()))
        return 456

    monkeypatch.setattr(compile_cache, "load", load)
    monkeypatch.setattr(compile_cache, "save", save)
    monkeypatch.setattr(train_module.torch, "compile", lambda fn, **kwargs: fn)  # eager: fast
    cache = tmp_path / "kernels.bin"
    flags = ["train", "pusht", "--smoke", "--workdir", str(work), "--total-steps", "2"]
    assert cli_main([*flags, "--compile", "--compile-cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert [c[:2] for c in calls] == [("load", str(cache)), ("save", str(cache))]
    assert calls[0][2] is False, "the cache is read before the data is recorded"
    assert calls[1][2] is True, "the cache is written after the last step's checkpoint"
    assert "read 0.0 MB of compiled kernels" in out and "wrote 0.0 MB of compiled kernels" in out
    summary = json.loads((work / "train_summary.json").read_text())
    assert summary["compile_cache"] == {"read_bytes": 123, "written_bytes": 456}


def test_train_cli_refuses_a_compile_cache_without_compile_or_its_folder(tmp_path, capsys):
    flags = ["train", "pusht", "--smoke", "--workdir", str(tmp_path / "work")]
    assert cli_main([*flags, "--compile-cache", str(tmp_path / "k.bin")]) == 2
    assert "--compile-cache needs --compile" in capsys.readouterr().err
    assert cli_main([*flags, "--compile", "--compile-cache", str(tmp_path / "no" / "k.bin")]) == 2
    assert "--compile-cache: folder" in capsys.readouterr().err
    assert not (tmp_path / "work" / "data").exists()


def test_the_benchmark_pairs_runs_without_and_with_the_file_and_reports_the_pairs_ratio(
    tmp_path, monkeypatch
):
    """`benchmarks/compile_cache.py` without training: a first run writes the file, then each
    pair runs without it and with it, in that order, and the report's ratio is the median
    of the pairs' ratios."""
    from tests.conftest import load_script

    bench = load_script("benchmarks/compile_cache.py")
    runs, seconds = [], iter([0.0, 10.0, 4.0, 20.0, 12.0, 10.0, 9.0])

    def train(base, work, cache):
        runs.append(cache.name if cache else None)
        assert "--compile" in base and "--smoke" in base and "--total-steps" in base
        if cache is not None and not cache.exists():
            cache.write_bytes(b"k" * 7)
        return next(seconds)

    monkeypatch.setattr(bench, "_train", train)
    out = tmp_path / "report.json"
    assert bench.main(["--pairs", "3", "--json", str(out)]) == 0
    assert runs == ["kernels.bin", None, "kernels.bin", None, "kernels.bin", None, "kernels.bin"]
    report = json.loads(out.read_text())
    assert report["pairs"] == [
        {"without_cache_s": 10.0, "with_cache_s": 4.0},
        {"without_cache_s": 20.0, "with_cache_s": 12.0},
        {"without_cache_s": 10.0, "with_cache_s": 9.0},
    ]
    assert report["median_ratio"] == 0.6  # of 0.4, 0.6 and 0.9
    medians = (report["median_without_s"], report["median_with_cache_s"])
    assert medians == (10.0, 9.0) and report["cache_bytes"] == 7
