"""Placements: parsing `--devices` / `--placement` and every error a bad one gets."""

from __future__ import annotations

import pytest

from streamworld.engine.placement import (
    PlacementError,
    StagePlacement,
    check_devices,
    parse_placement,
    single_device,
)

BLOCKS = 30  # Wan 1.3B


def test_replicas_put_one_whole_model_on_each_device():
    p = parse_placement("replicas", ["cuda:0", "cuda:1"], BLOCKS)
    assert len(p.replicas) == 2
    for replica, device in zip(p.replicas, ["cuda:0", "cuda:1"], strict=True):
        assert replica.stages == (StagePlacement(0, BLOCKS, device, 0),)
        assert replica.decoder_device == device and replica.home_device == device
    assert p.devices == ("cuda:0", "cuda:1")


def test_replicas_with_stages_time_share_their_device_as_virtual_ranks():
    (replica,) = parse_placement("replicas", ["cpu"], 4, stages=2).replicas
    assert [(s.start, s.stop, s.device, s.rank) for s in replica.stages] == [
        (0, 2, "cpu", 0),
        (2, 4, "cpu", 1),
    ]
    assert replica.num_ranks == 2


def test_a_pipeline_splits_the_blocks_evenly_over_the_devices_in_order():
    (replica,) = parse_placement("pipeline", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], BLOCKS).replicas
    assert [(s.start, s.stop) for s in replica.stages] == [(0, 8), (8, 15), (15, 22), (22, 30)]
    assert [s.device for s in replica.stages] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [s.rank for s in replica.stages] == [0, 1, 2, 3]
    assert replica.decoder_device == "cuda:3"  # the last stage's device
    assert sum(s.blocks for s in replica.stages) == BLOCKS


def test_a_pipeline_with_more_stages_than_devices_shares_them_in_order():
    (replica,) = parse_placement("pipeline", ["cuda:0", "cuda:1"], BLOCKS, stages=4).replicas
    assert [s.device for s in replica.stages] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


def test_an_explicit_map_with_a_decoder_and_two_replicas():
    spec = "0-13@cuda:0,14-29@cuda:1,decode@cuda:0|0-14@cuda:2,15-29@cuda:3"
    a, b = parse_placement(spec, [], BLOCKS).replicas
    assert [(s.start, s.stop, s.device) for s in a.stages] == [(0, 14, "cuda:0"), (14, 30, "cuda:1")]
    assert a.decoder_device == "cuda:0" and b.decoder_device == "cuda:3"
    assert a.describe() == "0-13@cuda:0,14-29@cuda:1,decode@cuda:0"
    assert parse_placement(a.describe(), [], BLOCKS).replicas == (a,)  # describe() reads back


def test_single_device_keeps_the_old_stage_and_rank_arrangement():
    (replica,) = single_device("cpu", 4, stages=3, ranks=2).replicas
    assert [(s.start, s.stop, s.rank) for s in replica.stages] == [(0, 1, 0), (1, 3, 1), (3, 4, 0)]


@pytest.mark.parametrize(
    "spec, devices, stages, message",
    [
        ("replicas", [], None, "needs at least one device"),
        ("pipeline", ["cuda:0", "cuda:1"], 40, "40 stages but the model has only 30 blocks"),
        ("pipeline", ["cuda:0", "cuda:1", "cuda:2"], 2, "fewer than the 3 devices"),
        ("0-9@cuda:0,11-29@cuda:1", [], None, "skips blocks: '11-29@cuda:1' starts at 11, expected 10"),
        ("0-9@cuda:0,5-29@cuda:1", [], None, "repeats blocks"),
        ("0-9@cuda:0,10-19@cuda:1", [], None, "leaves blocks 20-29 unplaced"),
        ("0-9@cuda:0,10-39@cuda:1", [], None, "goes past the model's 30 blocks"),
        ("0-9,10-29@cuda:1", [], None, "must look like 0-13@cuda:0"),
        ("a-b@cuda:0", [], None, "blocks must be a range like 0-13"),
        ("0-29@cuda:0,decode@cuda:0,decode@cuda:1", [], None, "places the decoder twice"),
        ("decode@cuda:0", [], None, "places no blocks"),
        ("", [], None, "is empty"),
    ],
)
def test_a_bad_placement_is_one_line_that_says_what_is_wrong(spec, devices, stages, message):
    with pytest.raises(PlacementError) as err:
        parse_placement(spec, devices, BLOCKS, stages)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_device_is_named():
    p = parse_placement("replicas", ["cuda:0", "cuda:7"], BLOCKS)
    seen = {"cuda:0"}
    with pytest.raises(PlacementError, match="device 'cuda:7': this machine has 1 CUDA device"):
        check_devices(p, lambda d: None if d in seen else "this machine has 1 CUDA device")


def test_a_stage_link_copies_only_between_devices_and_counts_what_it_moved():
    import torch

    from streamworld.engine.stage_link import StageLink, stage_links

    x = [torch.ones(2, 3), torch.zeros(4)]
    same = StageLink(torch.device("cpu"), torch.device("cpu"))
    out, event = same.send(x)
    assert not same.crosses and event is None and out[0] is x[0] and same.bytes == 0
    # A device without streams on the receiving side (meta: shapes only) takes a plain copy.
    cross = StageLink(torch.device("cpu"), torch.device("meta"))
    out, event = cross.send(x)
    assert cross.crosses and event is None
    assert [t.device.type for t in out] == ["meta", "meta"] and [t.shape for t in out] == [(2, 3), (4,)]
    assert cross.bytes == (6 + 4) * 4 and cross.copy_s >= 0.0
    links = stage_links([torch.device("cpu"), torch.device("cpu"), torch.device("meta")])
    assert [(link.src.type, link.dst.type, link.crosses) for link in links] == [
        ("cpu", "cpu", False),
        ("cpu", "meta", True),
    ]


@pytest.mark.slow
def test_the_multi_gpu_study_script_runs_its_pipeline_part_dry(tmp_path):
    """benchmarks/multi_gpu.py waits for a host with several GPUs; its dry run (every GPU on
    one device, here the CPU, with the small test model) checks its plumbing meanwhile."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "benchmarks/multi_gpu.py",
        "--out",
        str(tmp_path),
        "--dry-run",
        "--model",
        "tiny-wan",
    ]
    cmd += ["--gpus", "2", "--duration", "1", "--only", "pipelines"]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((tmp_path / "summary.json").read_text())["pipeline_480x832_one_stream"]
    assert set(runs) == {"lite-1gpu", "lite-2gpu", "wan-1gpu", "wan-2gpu"}
    for name, run in runs.items():
        assert "error" not in run and run["fps"] > 0, (name, run)
    assert "--placement" in runs["wan-2gpu"]["command"] and "--placement" not in runs["wan-1gpu"]["command"]
