"""The load generator (`loadtests/`): its plan, its agreement with the server, and short smoke runs
against a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests import run
from streamworld.engine import PRIORITY_CLASSES, EngineConfig
from streamworld.media import FORMATS as SERVER_FORMATS
from tests.test_pusht import pusht, pusht_delta, pusht_server  # noqa: F401 (fixtures)
from tests.test_server import models, start_server  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]


def test_formats_and_priorities_are_the_servers():
    # The load generator keeps its own lists so that it imports nothing of the server; they
    # must still name exactly what the server accepts.
    assert sorted(run.FORMATS) == sorted(SERVER_FORMATS)
    assert sorted(run.PRIORITIES) == sorted(PRIORITY_CLASSES)


def test_documented_command_runs_as_a_script_or_as_a_module():
    # loadtests/README.md documents `python loadtests/run.py` from the repository root.
    for command in (["loadtests/run.py"], ["-m", "loadtests.run"]):
        done = subprocess.run(
            [sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: python loadtests/run.py") and "--arrival-rate" in done.stdout


def test_load_generator_imports_no_server_code():
    # It is a client of the server's protocol: it must run where only websockets is installed.
    probe = (
        "import sys, loadtests.run; print(sorted(m for m in sys.modules if m.split('.')[0] == 'streamworld'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_playout_counts_stalls_against_the_buffer():
    # 4 frames per chunk at 4 frames/s with 0.5 s of buffer: chunk 1 is due at 1.5 s (on time
    # at 1.0), chunk 2 at 2.5 s (arrives at 3.0: one stall of 0.5 s), chunk 3 then at 4.0.
    p = run.playout([0.0, 1.0, 3.0, 3.9], [4, 4, 4, 4], fps=4.0, buffer_s=0.5)
    assert p == {"on_time": 3, "chunks": 4, "stalls": 1, "stall_s": pytest.approx(0.5)}
    assert run.playout([], [], 4.0, 0.5)["chunks"] == 0


def test_plan_is_reproducible_and_follows_the_mixes():
    cfg = run.LoadConfig(
        url="ws://x/v1/stream",
        duration_s=200,
        arrival_rate=2.0,
        cancel_share=0.25,
        slow_share=0.25,
        priorities=run.parse_mix("interactive:1,batch:3", run.PRIORITIES, "p"),
        formats=run.parse_mix("h264", run.FORMATS, "f"),
    )
    plans = run.plan_sessions(cfg)
    assert plans == run.plan_sessions(cfg)
    assert 300 < len(plans) < 500  # about 2/s over 200 s
    assert all(0 <= p.start_at < 200 for p in plans)
    batch = sum(p.priority == "batch" for p in plans) / len(plans)
    assert 0.65 < batch < 0.85 and {p.priority for p in plans} == {"interactive", "batch"}
    assert {p.format for p in plans} == {"h264"}
    cancels = [p for p in plans if p.cancel_after is not None]
    assert not any(p.slow for p in cancels)  # one kind per session
    assert 0.15 < len(cancels) / len(plans) < 0.35
    assert all(1 <= p.cancel_after < max(2, p.num_chunks) for p in cancels)


def test_bad_arguments_exit_with_code_2(capsys):
    base = ["--url", "ws://127.0.0.1:1/v1/stream", "--duration", "1"]
    for argv in (
        [*base, "--sessions", "0"],
        [*base, "--arrival-rate", "1", "--priorities", "urgent:1"],
        [*base, "--arrival-rate", "1", "--slow-factor", "0.5"],
        ["--url", "http://x", "--duration", "1", "--sessions", "1"],
        base,  # neither --arrival-rate nor --sessions
    ):
        with pytest.raises(SystemExit) as exc:
            run.main(argv)
        assert exc.value.code == 2
        assert "error" in capsys.readouterr().err


@pytest.mark.slow
async def test_smoke_run_against_a_server(models, tmp_path):  # noqa: F811
    engine = EngineConfig(max_streams=4, max_queue=32, ttff_budget_s=2.0)
    _server, running = await start_server(models, engine)
    try:
        url = f"ws://127.0.0.1:{running.port}/v1/stream"
        cfg = run.LoadConfig(
            url=url,
            duration_s=3.0,
            model="tiny-act",
            arrival_rate=3.0,
            session_chunks=3.0,
            cancel_share=0.3,
            slow_share=0.3,
            slow_factor=2.0,
            priorities=run.parse_mix("interactive:1,standard:1,batch:1", run.PRIORITIES, "p"),
            formats=run.parse_mix("jpeg:1,h264:1,rgb:1", run.FORMATS, "f"),
            drain_s=60.0,
            seed=3,
        )
        result = await run.run_load(cfg, progress=False)
    finally:
        await running.close()
    sessions = result["sessions"]
    assert len(sessions) == len(run.plan_sessions(cfg)) > 3
    kinds = {s["kind"] for s in sessions}
    assert {"normal", "cancel", "slow"} <= kinds, kinds
    # Every session ended, the way its plan said, with no errors and no protocol breaks.
    for s in sessions:
        assert not s["protocol_errors"], s
        assert s["error_code"] is None, s
        got = len(s["chunk_times"])
        if s["kind"] == "cancel":
            assert s["end"] == "cancelled" and got >= 1, s
        else:
            assert s["end"] == "completed" and got == s["planned_chunks"], s
            assert s["ttff_s"] is not None and s["ttff_s"] > 0
    overall = result["overall"]
    assert overall["errors"] == {}
    assert overall["frames"] > 0 and 0.0 <= overall["deadline_attainment"] <= 1.0
    # tiny-act takes actions: every session sent them and saw frames they condition.
    assert overall["action_to_frame_s"]["n"] > 0
    assert all(s["actions_sent"] > 0 for s in sessions)
    # The server freed everything, and generated at least what the clients received.
    server_side = result["server"]
    assert server_side["kv_pages_used_after"] == 0 and server_side["sessions_active_after"] == 0
    received = sum(sum(s["chunk_frames"]) for s in sessions)
    assert server_side["deltas"]["streamworld_frames_generated_total"] >= received
    assert run.check(result) == []
    # The report and the JSON hold the same run.
    text = run.format_report(result)
    assert "all (not slow)" in text and "KV pages in use after the run 0" in text
    out = tmp_path / "load.json"
    out.write_text(json.dumps(result))
    assert json.loads(out.read_text())["config"]["arrival_rate"] == 3.0


async def test_held_sessions_on_the_default_model_without_prompt_or_image(pusht_server):  # noqa: F811
    # pusht takes no prompt and gets its first frame from the server: the generator must ask
    # /v1/models and send neither.
    cfg = run.LoadConfig(url=pusht_server, duration_s=4.0, sessions=2, cancel_share=0.0, slow_share=0.0)
    result = await run.run_load(cfg, progress=False)
    assert result["model"]["id"] == "pusht"
    for s in result["sessions"]:
        assert s["error_code"] is None and s["end"] == "stopped" and s["chunk_times"], s
    assert result["overall"]["action_to_frame_s"]["n"] > 0
    assert run.check(result) == []


@pytest.mark.slow
async def test_acking_slow_readers_end_cleanly_and_the_server_does_not_run_ahead(pusht_server):  # noqa: F811
    # Slow readers that acknowledge what they read: the server paces them (it generates
    # about what they read, not real time), and they end as planned, without errors.
    cfg = run.LoadConfig(
        url=pusht_server,
        duration_s=8.0,
        sessions=2,
        cancel_share=0.0,
        slow_share=1.0,
        slow_factor=4.0,
        ack=True,
    )
    result = await run.run_load(cfg, progress=False)
    read = sum(len(s["chunk_times"]) for s in result["sessions"])
    for s in result["sessions"]:
        assert s["error_code"] is None and s["end"] == "stopped" and s["kind"] == "slow", s
    generated = result["server"]["deltas"]["streamworld_frames_generated_total"]
    # Real time would be 8 s x 10 fps x 2 sessions = 160 frames (40 chunks); they read about
    # a quarter of that. The server may be ahead of each reader by its ack window (3) and
    # the chunks that had started when the stream paused.
    assert generated <= (read + 2 * 6) * result["model"]["frames_per_chunk"] < 160
    assert run.check(result) == []


def test_the_help_states_each_default_once():
    parser = run.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        text = formatter._expand_help(action) if action.help else ""
        assert text.count("(default") <= 1, f"{action.option_strings}: {text}"
        assert "None" not in text
    help_text = " ".join(parser.format_help().split())  # as one line: the help wraps
    assert "(default 8.0)" in help_text and "(default 30.0)" in help_text


async def test_progress_goes_line_by_line_into_a_log(capsys):
    import asyncio
    import time

    task = asyncio.create_task(run._progress([], 5.0, time.monotonic()))
    await asyncio.sleep(0.05)
    task.cancel()
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n") and "sessions live" in err
