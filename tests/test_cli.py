"""`streamworld generate` and friends, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import av
import numpy as np
import pytest

from streamworld.cli import main
from streamworld.engine import GenerationRequest, ReferenceGenerator


def test_generate_writes_npy_equal_to_the_reference(tmp_path, tiny_model, capsys):
    out = tmp_path / "clip.npy"
    assert (
        main(
            [
                "generate",
                "--model",
                "tiny-wan",
                "--chunks",
                "2",
                "--seed",
                "7",
                "--prompt",
                "hi",
                "--kv-mode",
                "noisy",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    frames = np.load(out)
    expected = ReferenceGenerator(tiny_model).generate(
        GenerationRequest(seed=7, num_chunks=2, prompt="hi", kv_mode="noisy")
    )
    assert frames.dtype == np.uint8
    assert np.array_equal(frames, expected.frames)
    assert "wrote" in capsys.readouterr().out


def test_generate_writes_a_playable_mp4(tmp_path, tiny_model):
    out = tmp_path / "clip.mp4"
    assert main(["generate", "--chunks", "3", "--device", "cpu", "--out", str(out)]) == 0
    cfg = tiny_model.config
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == cfg.first_chunk_frames + 2 * cfg.frames_per_chunk
    assert decoded[0].shape == (cfg.height, cfg.width, 3)
    # Lossy, but the decoded video must resemble what was generated.
    expected = ReferenceGenerator(tiny_model).generate(GenerationRequest(seed=0, num_chunks=3)).frames
    err = np.abs(np.stack(decoded).astype(float) - expected.astype(float)).mean()
    assert err < 12, err


def test_same_inputs_give_identical_files(tmp_path):
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    for out in (a, b):
        assert main(["generate", "--chunks", "1", "--seed", "5", "--device", "cpu", "--out", str(out)]) == 0
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--chunks", "0"], "--chunks must be at least 1"),
        (["--out", "clip.gif"], "--out must end in .npy or .mp4"),
        (["--out", "/no/such/folder/clip.npy"], "does not exist"),
        (["--actions", "/no/such/actions.json"], "does not exist"),
        (["--image", "/no/such/image.png"], "does not exist"),
        (["--dit", "/no/such/ckpt.pt"], "does not exist"),
        (["--model", "wan2.1-t2v-1.3b"], "needs weights"),
    ],
)
def test_bad_arguments_give_a_one_line_error(tmp_path, capsys, args, message):
    argv = ["generate", "--device", "cpu", "--out", str(tmp_path / "x.npy"), *args]
    if "--out" in args:
        argv = ["generate", "--device", "cpu", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1
    assert "Traceback" not in err


def test_actions_for_a_model_without_actions_is_a_clear_error(tmp_path, capsys):
    actions = tmp_path / "a.json"
    actions.write_text(json.dumps({"actions": [[0.0, 1.0]] * 9}))
    assert (
        main(["generate", "--device", "cpu", "--actions", str(actions), "--out", str(tmp_path / "x.npy")])
        == 2
    )
    assert "takes no actions" in capsys.readouterr().err


def test_module_entry_point_and_models_listing():
    out = subprocess.run(
        [sys.executable, "-m", "streamworld", "models", "--json"], capture_output=True, text=True, check=True
    ).stdout
    ids = [m["id"] for m in json.loads(out)["models"]]
    assert {"tiny-wan", "wan2.1-t2v-1.3b"} <= set(ids)
    help_text = subprocess.run(
        [sys.executable, "-m", "streamworld", "generate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--kv-mode" in help_text and "--random-weights" in help_text


def test_bench_runs_engine_and_baseline_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "tiny-wan", "--streams", "2", "--duration", "1.5", "--unpaced"]
    assert main([*args, "--json", str(out)]) == 0
    report = capsys.readouterr().out
    assert "engine   aggregate" in report and "ratio" in report
    result = json.loads(out.read_text())
    engine, base = result["engine"], result["baseline"]
    assert len(engine["per_stream"]) == 2 and all(s["chunks"] >= 1 for s in engine["per_stream"])
    assert engine["aggregate_fps"] > 0 and base["aggregate_fps"] > 0
    assert result["speedup"] == pytest.approx(engine["aggregate_fps"] / base["aggregate_fps"])
    assert 0.0 <= engine["cpu_thread_idle_share"] <= 1.0 and 0.0 <= engine["executor_idle_share"] <= 1.0
    assert sum(engine["batch_size_histogram"].values()) > 0
    assert engine["streams_admitted"] == 2 and set(engine["executor_busy_share"]) == {
        "dit",
        "decode",
        "encode",
    }
    assert main(["bench", "--model", "tiny-wan", "--streams", "0", "--duration", "1"]) == 2
    assert main([*args, "--baseline-repeats", "0"]) == 2
    # The baseline's median of three runs is the one the ratio uses.
    three = tmp_path / "three.json"
    assert main([*args, "--no-baseline", "--json", str(three)]) == 0
    assert "baseline" not in json.loads(three.read_text())
    assert main([*args, "--baseline-repeats", "3", "--json", str(three)]) == 0
    assert "median of 3 runs" in capsys.readouterr().out
    base = json.loads(three.read_text())["baseline"]
    assert len(base["runs_fps"]) == 3
    assert base["aggregate_fps"] == pytest.approx(sorted(base["runs_fps"])[1])
    # A token budget below one unit: the most urgent unit still goes, alone.
    one = tmp_path / "one.json"
    assert main([*args, "--no-baseline", "--token-budget", "1", "--json", str(one)]) == 0
    assert set(json.loads(one.read_text())["engine"]["batch_size_histogram"]) == {"1"}
    assert main([*args, "--token-budget", "0"]) == 2


def test_frame_size_and_window_override_the_preset(tmp_path, capsys):
    out = tmp_path / "small.npy"
    args = ["generate", "--model", "tiny-wan", "--frame-size", "48x64", "--window", "4", "--chunks", "2"]
    assert main([*args, "--out", str(out)]) == 0
    frames = np.load(out)
    assert frames.shape[1:] == (48, 64, 3)
    assert "48x64 (height x width" in capsys.readouterr().out
    for bad in (["--frame-size", "50x64"], ["--frame-size", "64"], ["--window", "0"]):
        assert main(["generate", "--model", "tiny-wan", "--chunks", "1", "--out", str(out), *bad]) == 2
        assert "--frame-size" in capsys.readouterr().err


def test_serve_refuses_bad_batch_limits_before_loading_anything(capsys):
    assert main(["serve", "--token-budget", "0"]) == 2
    assert "--token-budget" in capsys.readouterr().err
    assert main(["serve", "--max-batch", "0"]) == 2


def test_serve_session_limit_flags_set_the_session_limits_and_default_to_them():
    from streamworld.cli import build_parser
    from streamworld.cli.serve import SESSION_LIMIT_FLAGS, serve_config
    from streamworld.server import SessionLimits

    defaults = SessionLimits()
    config = serve_config(build_parser().parse_args(["serve"]))
    assert config.server.limits == defaults
    for limit in SESSION_LIMIT_FLAGS:  # the help states the server's own default
        assert f"(default {getattr(defaults, limit.field):g})" in limit.help
    argv = ["serve", "--start-timeout", "5", "--pause-chunks", "4", "--slow-client-timeout", "2.5"]
    config = serve_config(build_parser().parse_args([*argv, "--ack-window", "6", "--max-sessions", "3"]))
    assert config.server.limits == SessionLimits(
        start_timeout_s=5.0, pause_chunks=4, slow_client_timeout_s=2.5, ack_window=6
    )
    assert config.engine.max_streams == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pause-chunks", "0"], "--pause-chunks must be at least 1"),
        (["--ack-window", "-1"], "--ack-window must be at least 1"),
        (["--start-timeout", "0"], "--start-timeout must be a positive number of seconds"),
        (["--slow-client-timeout", "nan"], "--slow-client-timeout must be a positive number of seconds"),
    ],
)
def test_serve_refuses_bad_session_limits_before_loading_anything(capsys, args, message):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"streamworld serve: error: {message}"


def test_every_command_explains_every_option():
    from streamworld.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.choices and "serve" in a.choices).choices
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_bench_flags_become_one_engine_config_and_the_json_keeps_the_old_keys():
    from streamworld.cli import build_parser
    from streamworld.cli.bench import bench_config

    argv = [
        "bench",
        "--streams",
        "3",
        "--unpaced",
        "--ranks",
        "2",
        "--token-budget",
        "512",
        "--max-batch",
        "4",
    ]
    cfg = bench_config(build_parser().parse_args([*argv, "--ttff-budget", "0.5"]))
    assert (cfg.engine.num_ranks, cfg.engine.ttff_budget_s) == (2, 0.5)
    assert (cfg.engine.scheduler.token_budget, cfg.engine.scheduler.max_batch_units) == (512, 4)
    settings = json.loads(json.dumps(cfg.to_json()))
    assert {k: settings[k] for k in ("streams", "paced", "num_ranks", "token_budget", "max_batch_units")} == {
        "streams": 3,
        "paced": False,
        "num_ranks": 2,
        "token_budget": 512,
        "max_batch_units": 4,
    }
    assert settings["ttff_budget_s"] == 0.5 and settings["lookahead_chunks"] == 2.0
    # The nested engine is the one that ran: room for every stream, no lookahead limit unpaced.
    assert (
        settings["engine"]["max_streams"] == 3 and settings["engine"]["scheduler"]["lookahead_chunks"] > 1e6
    )
