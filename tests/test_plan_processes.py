"""`eval pusht --plan --processes`: episodes planned in processes side by side, one report."""

import argparse
import json
import os

import pytest

from streamworld.cli import main
from streamworld.cli.eval import _plan_episodes, merged_counters
from streamworld.cli.plan_processes import PlanningProcessError, plan_in_processes

SEARCH = ["--samples", "8", "--elites", "2", "--iterations", "2", "--plan-horizon", "8"]
SEARCH += ["--budget", "16", "--goal-steps", "2"]


@pytest.mark.slow
def test_processes_reach_what_one_process_reaches_and_write_one_report(tmp_path, capsys):
    """In the true environment (no model, so no float rounding between runs) two processes
    end every episode exactly as one process does, and their report lists them in the
    order of the seeds, with the processes recorded."""
    reports = []
    for processes in ("1", "2"):
        out = tmp_path / f"plan{processes}.json"
        args = ["eval", "pusht", "--plan", "--simulator", "--seeds", "0-3", *SEARCH]
        assert main([*args, "--processes", processes, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    one, two = reports
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["complete"] and [e["seed"] for e in two["episodes"]] == [0, 1, 2, 3]
    keys = ("seed", "success", "steps", "plans", "branches", "final_position_error")
    assert [[e[k] for k in keys] for e in two["episodes"]] == [[e[k] for k in keys] for e in one["episodes"]]
    assert two["summary"]["episodes"] == 4
    assert two["summary"]["success_rate"] == one["summary"]["success_rate"]
    assert "2 planning processes:" in capsys.readouterr().out


def test_processes_are_at_most_one_per_seed_and_checked(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["eval", "pusht", "--plan", "--simulator", "--seeds", "5", *SEARCH]
    assert main([*args, "--processes", str(min(2, os.cpu_count() or 1)), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["processes"] == 1 and [e["seed"] for e in report["episodes"]] == [5]
    capsys.readouterr()
    for bad in ("0", "65"):
        assert main([*args, "--processes", bad]) == 2
        assert "--processes must be 1 to 64" in capsys.readouterr().err
    cores = os.cpu_count() or 1
    if cores < 64:
        assert main([*args, "--processes", str(cores + 1)]) == 2
        assert f"on the CPU, which has {cores} cores: at most {cores}" in capsys.readouterr().err


def _dies(index, seeds, config, args, messages, threads, plan):
    os._exit(3)  # as a process the OS kills: no word to the parent


def _reports(index, seeds, config, args, messages, threads, plan):
    for seed in seeds:
        messages.put(("episode", index, (seed, {"process": index}, {"threads": threads})))
    messages.put(("done", index, None))


@pytest.mark.slow
def test_a_failing_process_stops_the_run_with_its_traceback():
    """The real planning process, given a model that does not exist: its error and where it
    came from reach the parent, which stops the run."""
    args = argparse.Namespace(simulator=True, model="no-such-model", concurrent=1)
    with pytest.raises(
        PlanningProcessError, match=r"(?s)planning process [01] failed:.*unknown model 'no-such-model'"
    ):
        plan_in_processes([0, 1], None, args, lambda *a, **k: None, 2, _plan_episodes)


@pytest.mark.slow
def test_a_usage_error_in_a_process_is_one_line_and_exit_code_2(tmp_path, capsys):
    """Weights that do not exist are found where the model loads, in the processes: the
    user sees the same one-line error and exit code as from one process."""
    missing = tmp_path / "missing.safetensors"
    processes = str(min(2, os.cpu_count() or 1))  # on the CPU, at most one per core
    assert (
        main(["eval", "pusht", "--plan", "--dit", str(missing), "--processes", processes, "--seeds", "0-1"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"streamworld eval: error: --dit: {missing} does not exist" in err


def test_a_process_that_dies_without_a_word_stops_the_run():
    with pytest.raises(PlanningProcessError, match="planning process 0 exited with code 3"):
        plan_in_processes([0, 1], None, None, lambda *a, **k: None, 1, None, target=_dies)


def test_every_process_gets_every_pth_seed_and_its_episodes_come_back():
    seen = []
    plan_in_processes(
        [10, 11, 12, 13, 14],
        None,
        None,
        lambda *a, process: seen.append((process, *a)),
        2,
        None,
        target=_reports,
    )
    threads = max(1, (os.cpu_count() or 1) // 2)
    expected = [
        (i, s, {"process": i}, {"threads": threads}) for i, s in ((0, 10), (0, 12), (0, 14), (1, 11), (1, 13))
    ]
    assert sorted(seen, key=lambda e: (e[0], e[1])) == expected


def test_merged_counters_sum_batches_and_graphs_and_weigh_the_mean_batch():
    a = {"dit_batches": 10, "mean_batch_units": 2.0, "cuda_graphs": {"replays": 8, "eager": 2}}
    b = {"dit_batches": 30, "mean_batch_units": 6.0, "cuda_graphs": {"replays": 20, "eager": 10}}
    assert merged_counters([a, b]) == {
        "dit_batches": 40,
        "mean_batch_units": 5.0,
        "cuda_graphs": {"replays": 28, "eager": 12},
    }
    assert merged_counters([{"dit_batches": 0, "mean_batch_units": 0.0}]) == {
        "dit_batches": 0,
        "mean_batch_units": 0.0,
    }
