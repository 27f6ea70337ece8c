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
    assert main(["generate", "--model", "tiny-wan", "--chunks", "3", "--out", str(out)]) == 0
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


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot be read"),  # a folder
        (b"\xff\xfe[[1, 2]]", "not valid JSON"),
        (b"[[" + b"9" * 5000 + b", 1]]", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b"[[" + b"9" * 401 + b", 1]]", "must hold a list"),
    ],
    ids=["folder", "not-utf8", "integer-too-long", "nested-too-deep", "overflows-a-float"],
)
def test_an_unreadable_actions_file_is_a_one_line_error(tmp_path, capsys, content, message):
    path = tmp_path / "a.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    out = str(tmp_path / "x.npy")
    assert main(["generate", "--model", "pusht", "--actions", str(path), "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_actions_for_a_model_without_actions_is_a_clear_error(tmp_path, capsys):
    actions = tmp_path / "a.json"
    actions.write_text(json.dumps({"actions": [[0.0, 1.0]] * 9}))
    assert (
        main(["generate", "--model", "tiny-wan", "--actions", str(actions), "--out", str(tmp_path / "x.npy")])
        == 2
    )
    assert "takes no actions" in capsys.readouterr().err


def test_generate_serves_the_default_model_and_says_what_it_ignores(tmp_path, capsys):
    from streamworld.models import get_preset

    cfg = get_preset("pusht")
    out = tmp_path / "x.npy"
    frames = cfg.first_chunk_frames  # one chunk
    actions = tmp_path / "a.json"
    actions.write_text(json.dumps([[256.0, 256.0]] * (frames + 5)))
    argv = ["generate", "--chunks", "1", "--prompt", "a cat", "--actions", str(actions), "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert np.load(out).shape == (frames, cfg.height, cfg.width, 3)  # pusht, the default of serve too
    assert "--prompt is ignored: pusht takes no text prompt" in err
    assert f"5 of the {frames + 5} actions in --actions are ignored" in err

    actions.write_text(json.dumps([[256.0, 256.0]] * 2))
    assert main(["generate", "--chunks", "1", "--actions", str(actions), "--out", str(out)]) == 0
    assert f"--actions has 2 actions for {np.load(out).shape[0]} frames" in capsys.readouterr().err


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


def test_bench_baseline_commits_every_chunk_like_the_engines_open_ended_streams(monkeypatch):
    """The engine's measured streams never end, so each of their chunks commits its K/V in
    clean mode; the baseline's streams go on likewise (`open_ended`), not skipping the
    last chunk's commit pass as a stream of known length does."""
    from streamworld.engine.reference import ReferenceGenerator

    seen = []
    generate = ReferenceGenerator.generate

    def spied(self, request):
        seen.append(request)
        return generate(self, request)

    monkeypatch.setattr(ReferenceGenerator, "generate", spied)
    args = [
        "bench",
        "--model",
        "tiny-wan",
        "--streams",
        "1",
        "--duration",
        "1",
        "--unpaced",
        "--kv-mode",
        "clean",
    ]
    assert main(args) == 0
    measured = seen[1:]  # after the warm-up
    assert measured and all(r.open_ended and r.kv_mode == "clean" for r in measured)


def test_a_bench_window_too_short_for_a_chunk_runs_on_until_the_first_one(tmp_path):
    """10 ms is far less than the first chunk takes here: instead of a window of no chunks
    (0 frames/s, a measurement of nothing), the window lasts until the first arrives."""
    out = tmp_path / "short.json"
    args = ["bench", "--model", "tiny-wan", "--no-baseline", "--duration", "0.01", "--json", str(out)]
    assert main(args) == 0
    engine = json.loads(out.read_text())["engine"]
    assert engine["aggregate_fps"] > 0 and sum(s["chunks"] for s in engine["per_stream"]) >= 1


@pytest.mark.slow
def test_bench_runs_engine_and_baseline_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "tiny-wan", "--streams", "2", "--duration", "1", "--unpaced"]
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
    bad_geometry = (
        ["--frame-size", "50x64"],
        ["--frame-size", "64"],
        ["--window", "0"],
        ["--sink", "-1"],
        ["--chunk", "0"],
        ["--steps", "500,750"],
        ["--steps", "1000,x"],
    )
    for bad in bad_geometry:
        assert main(["generate", "--model", "tiny-wan", "--chunks", "1", "--out", str(out), *bad]) == 2
        assert bad[0] in capsys.readouterr().err


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
        (["--pause-chunks", "0"], "--pause-chunks: must be at least 1, got 0"),
        (["--ack-window", "-1"], "--ack-window: must be at least 1, got -1"),
        (["--start-timeout", "0"], "--start-timeout: must be above 0, got 0.0"),
        (["--slow-client-timeout", "nan"], "--slow-client-timeout: must be above 0, got nan"),
    ],
)
def test_serve_refuses_bad_session_limits_before_loading_anything(capsys, args, message):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"streamworld serve: error: {message}"


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_serve_refuses_a_port_out_of_range_before_loading_anything(capsys, monkeypatch, port):
    from streamworld.cli import serve

    monkeypatch.setattr(serve, "load_served_models", lambda *a: pytest.fail("models loaded"))
    assert main(["serve", "--port", port]) == 2
    captured = capsys.readouterr()
    bound = "at most 65535" if port == "99999" else "at least 0"
    assert f"--port: must be {bound}, got {port}" in captured.err
    assert "serving" not in captured.out


def test_serve_that_fails_to_load_stops_its_thread_governor(capsys):
    """The governor `serve` starts on a CPU must not outlive it when loading fails: left
    running, it went on changing the process's PyTorch thread count (and with it the bits of
    every later CPU result in the process)."""
    import threading

    import torch

    before = torch.get_num_threads()
    assert main(["serve", "--decoder", "lite", "--port", "0"]) == 2  # fails while loading
    assert "no VAE decoder to replace" in capsys.readouterr().err
    assert not [t for t in threading.enumerate() if t.name == "streamworld-threads"]
    from streamworld.engine.executor import cpu_worker

    assert cpu_worker().submit(torch.get_num_threads).result() == before


@pytest.mark.parametrize("host", ["in-use", "no-such-host.invalid"])
def test_serve_refuses_an_address_it_cannot_listen_on_before_loading_anything(capsys, monkeypatch, host):
    import socket

    from streamworld.cli import serve

    monkeypatch.setattr(serve, "load_served_models", lambda *a: pytest.fail("models loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        address = ["--host", "127.0.0.1"] if host == "in-use" else ["--host", host]
        assert main(["serve", *address, "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert f"cannot listen on {address[1]}:{port}" in captured.err
    assert "serving" not in captured.out


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


def test_serve_on_port_zero_announces_the_port_it_listens_on_and_says_when_it_stops():
    import re
    import signal
    import urllib.request

    argv = [sys.executable, "-m", "streamworld", "serve", "--model", "tiny-wan", "--port", "0"]
    argv += ["--threads", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = ""
        for line in proc.stdout:  # the banner comes once the port listens
            if "serving" in line:
                banner = line
                break
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/", banner)
        assert match and int(match.group(1)) > 0, f"no port in the banner: {banner!r}"
        with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/healthz", timeout=10) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "stopping: draining live sessions" in rest
    assert f"stopped serving at http://127.0.0.1:{match.group(1)}/" in rest


def test_generate_pusht_without_actions_holds_the_agent_where_the_scene_puts_it(tmp_path):
    held, corner = tmp_path / "held.npy", tmp_path / "corner.npy"
    actions = tmp_path / "corner.json"
    actions.write_text(json.dumps([[0.0, 0.0]]))  # what zeros would do: pull the agent to a corner
    base = ["generate", "--seed", "2", "--chunks", "3"]
    assert main([*base, "--out", str(held)]) == 0
    assert main([*base, "--actions", str(actions), "--out", str(corner)]) == 0

    def drift(path) -> float:
        frames = np.load(path).astype(np.float32)
        return float(np.abs(frames[-1] - frames[0]).mean())

    assert drift(held) < drift(corner) / 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "cuda:0"], "pusht: device 'cuda:0': PyTorch sees no CUDA GPU here"),
        (["--placement", "0-1@cpu"], "pusht: --placement leaves blocks 2-5 unplaced (the model has 6)"),
        (["--placement", "pipeline", "--stages", "9"], "pusht: 9 stages but the model has only 6 blocks"),
        (["--placement", "0-2@cpu,4-5@cpu"], "skips blocks"),
        (["--devices", "tpu:0"], "not a device name"),
        (["--devices", "meta"], "meta devices are not supported"),
        (["--placement", "pipeline", "--ranks", "2"], "--ranks applies without --devices and --placement"),
    ],
)
def test_serve_refuses_a_bad_placement_before_loading_anything(capsys, monkeypatch, args, message):
    from streamworld.cli import serve

    monkeypatch.setattr(serve, "load_served_models", lambda *a: pytest.fail("models loaded"))
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_serve_placement_flags_become_replicas_and_stages():
    from streamworld.cli import build_parser
    from streamworld.cli.serve import serve_config

    def placed(*argv: str):
        return serve_config(build_parser().parse_args(["serve", *argv])).placements["pusht"]

    assert placed().describe() == "0-5@cpu,decode@cpu"
    two = placed("--devices", "cpu,cpu")
    assert len(two.replicas) == 2
    pipeline = placed("--devices", "cpu,cpu", "--placement", "pipeline", "--stages", "3")
    assert pipeline.describe() == "0-1@cpu,2-3@cpu,4-5@cpu,decode@cpu"
    assert [s.rank for s in pipeline.replicas[0].stages] == [0, 1, 2]
    assert placed("--stages", "2", "--ranks", "2").describe() == "0-2@cpu,3-5@cpu,decode@cpu"


@pytest.mark.slow
def test_bench_spreads_streams_over_replicas_and_reports_each(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "tiny-wan", "--streams", "4", "--duration", "1.5", "--unpaced"]
    assert main([*args, "--devices", "cpu,cpu", "--json", str(out)]) == 0
    report = capsys.readouterr().out
    assert "replica  0:" in report and "replica  1:" in report
    result = json.loads(out.read_text())
    replicas = result["engine"]["per_replica"]
    assert [r["streams"] for r in replicas] == [2, 2]
    assert all(r["fps"] > 0 for r in replicas)
    assert {s["replica"] for s in result["engine"]["per_stream"]} == {0, 1}
    assert result["config"]["replicas"] == 2 and "baseline" in result


def test_bench_of_a_stage_pipeline_reports_its_stages_and_no_copies_on_one_device(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "tiny-wan", "--streams", "2", "--duration", "1", "--unpaced", "--no-baseline"]
    assert main([*args, "--devices", "cpu,cpu", "--placement", "pipeline", "--json", str(out)]) == 0
    assert "2 stage(s), 2 rank(s)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["config"]["num_stages"], result["config"]["num_ranks"]) == (2, 2)
    assert set(result["engine"]["device_busy_share"]) == {"cpu"}
    assert "stage_copies" not in result["engine"]  # two stages on one device copy nothing


@pytest.mark.parametrize("command", ["bench", "serve"])
def test_cuda_graphs_on_a_cpu_is_a_one_line_error_before_anything_loads(capsys, command):
    assert main([command, "--model", "tiny-wan", "--device", "cpu", "--cuda-graphs"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--cuda-graphs needs CUDA devices, not cpu" in err
    assert len(err.splitlines()) == 1


def test_the_engine_refuses_cuda_graphs_on_a_cpu(tiny_model):
    from streamworld.engine import AsyncEngine, EngineConfig

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; stage 0 is on cpu"):
        AsyncEngine(tiny_model, EngineConfig(cuda_graphs=True))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--samples", "8", "--elites", "9"], "1 <= elites <= samples"),
        (["--plan-horizon", "0"], "need horizon >= 1"),
        (["--budget", "0"], "--goal-steps, --budget and --execute must be at least 1"),
        (["--json", "/no/such/folder/plan.json"], "does not exist"),
        (["--cuda-graphs"], "--cuda-graphs needs a CUDA --device, not cpu"),
        (["--shape-weight", "-1"], "--shape-weight must be at least 0"),
        (["--ensemble", "wan"], "--ensemble wan: the model must be one of pusht, pusht-delta"),
        (["--ensemble", "pusht=/no/such.safetensors"], "/no/such.safetensors does not exist"),
        (["--ensemble", "pusht", "--simulator"], "--kv-mode, --steps and --ensemble"),
        (["--ensemble", "pusht="], "give a weights file after ="),
        (["--kv-mode", "noisy", "--ensemble", "pusht-delta"], "pusht-delta serves clean, final only"),
        (["--shape-weight", "nan"], "--shape-weight must be at least 0"),
        (["--replan-error", "nan"], "--replan-error must be at least 0"),
        (["--replan-error", "-1"], "--replan-error must be at least 0"),
    ],
)
def test_bad_planning_arguments_give_a_one_line_error_before_the_model_loads(capsys, args, message):
    assert main(["eval", "pusht", "--plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
