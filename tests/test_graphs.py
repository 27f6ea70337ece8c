"""Which batch shapes get a CUDA graph (`engine/graphs.py`): `StageGraphs.run` with its
`CaptureChoice`, on the CPU, with the model's forward, the capture and the replay stubbed
out (tests/test_gpu.py runs them for real)."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from streamworld.engine.graphs import CaptureChoice, GraphStats, StageGraphs, _Graph

ACT = SimpleNamespace(modulation=None, temb=None, num_frames=1)


def stage_graphs(capacity: int, half_life: int | None = None) -> StageGraphs:
    """A `StageGraphs` whose batches are named by their shape: `run(ACT, [key])`."""
    graphs = object.__new__(StageGraphs)
    graphs.stage = SimpleNamespace(index=0, start=0, stop=1)
    graphs.max_batch, graphs.max_graphs = 8, capacity
    graphs.stats = GraphStats()
    graphs._graphs = OrderedDict()
    graphs._choice = CaptureChoice(capacity, half_life)
    graphs.dit = SimpleNamespace(
        plan_blocks=lambda act, units: None, run_planned=lambda *a: "eager", stacked_text=lambda u: None
    )
    graphs._key = lambda act, plan, units: (units[0],)  # a shape is a tuple
    replay = SimpleNamespace(replay=lambda: None)
    graphs._capture = lambda act, plan, units: _Graph(replay, None, None, None, torch.zeros(1))
    graphs._load = lambda *a: None
    return graphs


def run(graphs: StageGraphs, keys) -> None:
    for key in keys:
        graphs.run(ACT, [key])


def kept(graphs: StageGraphs) -> list:
    """The shapes with a graph, least recently used first."""
    return [key for (key,) in graphs._graphs]


def counted(graphs: StageGraphs) -> tuple:
    s = graphs.stats
    return s.captured, s.evicted, s.replays, s.eager


def test_a_shape_is_captured_the_second_time_it_is_seen():
    graphs = stage_graphs(4)
    run(graphs, ["a", "b", "a", "a", "b"])
    assert kept(graphs) == ["a", "b"]
    assert counted(graphs) == (2, 0, 3, 2)  # a capture's batch is replayed from its graph


def test_more_shapes_taking_turns_than_graphs_are_captured_once_and_the_rest_run_eagerly():
    """40 batch shapes in turn, room for 32 graphs, 30 rounds (counts halve twice): the
    first 32 get one capture each and the other 8 run eagerly; none is evicted. Dropping
    the least recently used graph instead would capture one on every batch from the second
    round on."""
    graphs = stage_graphs(32)
    run(graphs, list(range(40)) * 30)
    assert 2 * graphs._choice.half_life < 30 * 40
    assert counted(graphs) == (32, 0, 32 * 29, 40 + 8 * 29)


def test_a_shape_seen_twice_as_often_takes_the_place_of_the_least_seen():
    graphs = stage_graphs(2, half_life=1000)
    run(graphs, ["a", "b", "a", "b", "a", "a", "c"])  # a: 4, b: 2, c: 1
    assert kept(graphs) == ["b", "a"] and graphs.stats.eager == 3  # least recently used first
    run(graphs, ["c", "c"])  # 2, then 3: fewer than twice b's 2, so eager
    assert "c" not in kept(graphs) and counted(graphs) == (2, 0, 4, 5)
    run(graphs, ["c"])  # 4: b goes
    assert kept(graphs) == ["a", "c"] and counted(graphs) == (3, 1, 5, 5)
    run(graphs, ["c"])
    assert counted(graphs) == (3, 1, 6, 5)


def test_counts_halve_so_a_new_workload_gets_graphs():
    graphs = stage_graphs(1, half_life=10)
    run(graphs, ["old"] * 9)
    assert graphs._choice.counts[("old",)] == 9
    run(graphs, ["new"])  # the tenth sighting: every count halves, and a count of 1 goes
    assert graphs._choice.counts == {("old",): 4}
    run(graphs, ["new"] * 7)
    assert graphs._choice.counts[("new",)] == 7 and "new" not in kept(graphs)  # fewer than twice 4
    run(graphs, ["new"])  # 8
    assert kept(graphs) == ["new"] and graphs.stats.evicted == 1


def test_a_failed_capture_leaves_the_stage_eager():
    graphs = stage_graphs(4)

    def fail(act, plan, units):
        raise RuntimeError("capture failed")

    graphs._capture = fail
    run(graphs, ["a"] * 4)
    assert graphs._graphs == {} and graphs.stats.failures == 1 and graphs.stats.eager == 4


def test_capacity_and_half_life_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        CaptureChoice(0)
    with pytest.raises(ValueError, match="half_life"):
        CaptureChoice(2, half_life=0)
