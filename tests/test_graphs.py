"""Which batch shapes get a CUDA graph (`engine/graphs.py`, `CaptureChoice`): plain Python,
so it is checked here on the CPU; tests/test_gpu.py runs it with real graphs."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from streamworld.engine.graphs import CaptureChoice


class Cache:
    """What `StageGraphs.run` does with a `CaptureChoice`, with names in place of graphs."""

    def __init__(self, choice: CaptureChoice) -> None:
        self.choice, self.graphs = choice, OrderedDict()
        self.captured = self.evicted = self.replays = self.eager = 0

    def run(self, key) -> None:
        self.choice.seen(key)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            self.replays += 1
        elif self.choice.admits(key, self.graphs):
            while len(self.graphs) >= self.choice.capacity:
                del self.graphs[self.choice.victim(self.graphs)]
                self.evicted += 1
            self.graphs[key] = True
            self.captured += 1
        else:
            self.eager += 1


def test_a_shape_is_captured_the_second_time_it_is_seen():
    cache = Cache(CaptureChoice(4))
    for key in ("a", "b", "a", "a", "b"):
        cache.run(key)
    assert list(cache.graphs) == ["a", "b"] and (cache.captured, cache.replays, cache.eager) == (2, 1, 2)


def test_more_shapes_taking_turns_than_graphs_are_captured_once_and_the_rest_run_eagerly():
    """40 batch shapes in turn, room for 32 graphs, 30 rounds (counts halve twice): the
    first 32 get one capture each and the other 8 run eagerly; none is evicted. Dropping
    the least recently used graph instead would capture one on every batch from the second
    round on."""
    choice = CaptureChoice(32)
    cache = Cache(choice)
    for _ in range(30):
        for key in range(40):
            cache.run(key)
    assert 2 * choice.half_life < 30 * 40
    assert cache.captured == 32 and cache.evicted == 0
    assert cache.replays == 32 * 28 and cache.eager == 40 + 8 * 29


def test_a_shape_seen_twice_as_often_takes_the_place_of_the_least_seen():
    cache = Cache(CaptureChoice(2, half_life=1000))
    for key in ("a", "b", "a", "b", "a", "a", "c"):  # a: 4, b: 2, c: 1
        cache.run(key)
    assert list(cache.graphs) == ["b", "a"] and cache.eager == 3  # least recently used first
    for _ in range(2):
        cache.run("c")  # 2, then 3: fewer than twice b's 2, so eager
    assert "c" not in cache.graphs and cache.captured == 2 and cache.eager == 5
    cache.run("c")  # 4: b goes
    assert list(cache.graphs) == ["a", "c"] and cache.evicted == 1
    cache.run("c")
    assert cache.replays == 3  # a twice, then c


def test_counts_halve_so_a_new_workload_gets_graphs():
    choice = CaptureChoice(1, half_life=10)
    cache = Cache(choice)
    for _ in range(9):
        cache.run("old")
    assert choice.counts["old"] == 9
    cache.run("new")  # the tenth sighting: every count halves, and a count of 1 goes
    assert choice.counts == {"old": 4}
    for _ in range(7):
        cache.run("new")
    assert choice.counts["new"] == 7 and "new" not in cache.graphs  # fewer than twice old's 4
    cache.run("new")  # 8
    assert list(cache.graphs) == ["new"] and cache.evicted == 1


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        CaptureChoice(0)
