"""The deployment file: examples valid, round trip, errors that name the key, flags over it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from streamworld.cli import main
from streamworld.deploy.config import MAX_FILE_BYTES, DeployError, load

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "deploy").glob("*.yaml"))


def _config(argv: list[str]):
    """What `serve` would run with `argv`, parsed as `main` parses it (which finds the flags
    given), without checking that this machine has the devices."""
    from streamworld.cli.deployment import given_dests
    from streamworld.cli.main import build_parser
    from streamworld.cli.serve import serve_config

    args = build_parser().parse_args(["config", *argv])
    args.given = given_dests(args.command_parser, argv)
    return serve_config(args, devices_here=False)


def test_the_examples_are_valid_and_name_what_they_serve():
    assert {p.name for p in EXAMPLES} >= {
        "cpu-pusht.yaml",
        "h200-wan-1.3b.yaml",
        "4gpu-wan.yaml",
        "ray-cpu.yaml",
    }
    for path in EXAMPLES:
        assert main(["config", "--config", str(path)]) == 0, path
    four = _config(["--config", str(ROOT / "deploy" / "4gpu-wan.yaml")])
    placed = four.placements["wan2.1-t2v-1.3b"]
    assert len(placed.replicas) == 2 and [len(r.stages) for r in placed.replicas] == [2, 2]


def test_print_round_trips(tmp_path, capsys):
    source = ROOT / "deploy" / "ray-cpu.yaml"
    assert main(["config", "--print", "--config", str(source)]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load(printed) == load(source)
    assert load(printed).engine.threads == 1 and load(printed).ray.min_replicas == 2


def test_the_token_is_not_printed(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text("server: {auth_token: s3cret}\nmodels: [{model: pusht}]\n")
    assert main(["config", "--print", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "auth_token: null" in out and "not shown" in out
    assert _config(["--config", str(path)]).server.auth_token == "s3cret"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "models: [{model: pusht}]\nsevrer: {}\n",
            "sevrer: unknown key (known here: server, engine, models, ray)",
        ),
        ("models: [{model: pusht, decodr: lite}]\n", "models[0].decodr: unknown key"),
        ("server: {limits: {pause: 1}}\nmodels: [{model: pusht}]\n", "server.limits.pause: unknown key"),
        ("models: [{model: pusht, decoder: big}]\n", "models[0].decoder: must be 'wan' or 'lite', got 'big'"),
        (
            "server: {port: 70000}\nmodels: [{model: pusht}]\n",
            "server.port: must be at most 65535, got 70000",
        ),
        ("engine: {max_sessions: 0}\nmodels: [{model: pusht}]\n", "engine.max_sessions: must be at least 1"),
        (
            "engine: {token_budget: lots}\nmodels: [{model: pusht}]\n",
            "engine.token_budget: must be a valid integer",
        ),
        ("models: []\n", "models: list should have at least 1 item"),
        ("server: {}\n", "models: required"),
        ("models: [{model: pusht, frame_size: 64by64}]\n", "models[0].frame_size: must match pattern"),
        ("models: [pusht]\n", "models[0]: expected a mapping"),
        ("- a list\n", "expected a mapping with server, engine, models, ray"),
        ("models: [{model: pusht\n", "not valid YAML"),
        ("models: [{model: nosuch}]\n", "unknown model 'nosuch'"),
        ("models: [{model: pusht, placement: 0-2@cpu}]\n", "pusht: --placement leaves blocks 3-5 unplaced"),
        ("models: [{model: pusht, steps: [250, 500]}]\n", "--steps must decrease"),
    ],
)
def test_each_bad_key_or_value_names_itself(tmp_path, capsys, text, message):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_bounded_and_missing_files(tmp_path, capsys):
    assert main(["config", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(DeployError, match="larger than"):
        load(big)


def test_flags_given_override_the_file_and_others_do_not(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "server": {"port": 9000, "limits": {"ack_window": 5}},
                "engine": {"max_sessions": 3, "token_budget": 4096},
                "models": [{"model": "pusht", "device": "cpu"}, {"model": "tiny-wan", "window": 4}],
            }
        )
    )
    base = _config(["--config", str(path)])
    assert (base.port, base.engine.max_streams, base.engine.scheduler.token_budget) == (9000, 3, 4096)
    assert base.server.limits.ack_window == 5 and base.model_ids == ["pusht", "tiny-wan"]
    # A flag equal to its default still overrides: it was given.
    over = _config(["--config", str(path), "--port", "8000", "--ack-window", "2", "--window", "5"])
    assert (over.port, over.engine.max_streams, over.server.limits.ack_window) == (8000, 3, 2)
    assert [m.window for m in over.deploy.models] == [5, 5]  # a model flag: every model of the file
    picked = _config(["--config", str(path), "--model", "tiny-wan"])
    assert picked.model_ids == ["tiny-wan"] and picked.deploy.models[0].window == 4


def test_model_flag_for_a_model_not_in_the_file(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text("models: [{model: pusht}]\n")
    assert main(["config", "--config", str(path), "--model", "tiny-wan"]) == 2
    assert "--model tiny-wan: not in" in capsys.readouterr().err


def test_relative_paths_are_relative_to_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "d.yaml"
    path.write_text("models: [{model: pusht, decoder_weights: ../w/lite.safetensors, dit: ~/x.pt}]\n")
    model = load(path).models[0]
    assert model.decoder_weights == str((tmp_path / "w" / "lite.safetensors").resolve())
    assert model.dit == str(Path("~/x.pt").expanduser())


def test_serve_with_a_config_loads_its_models_with_their_settings(tmp_path, monkeypatch):
    """The file reaches loading: the model's geometry and the engine's limits."""
    from streamworld.cli import serve

    path = tmp_path / "d.yaml"
    path.write_text("engine: {max_sessions: 2}\nmodels: [{model: tiny-wan, window: 4, sink: 2, chunk: 2}]\n")
    seen = {}

    def fake_run(config, models):
        seen["config"], seen["models"] = config, models

    monkeypatch.setattr(serve, "_run_server", fake_run)
    monkeypatch.setattr(serve, "check_address", lambda host, port: None)
    assert main(["serve", "--config", str(path), "--threads", "1"]) == 0
    model = seen["models"]["tiny-wan"][0]
    assert (model.config.window_frames, model.config.sink_frames, model.config.latent_frames_per_chunk) == (
        4,
        2,
        2,
    )
    assert seen["config"].engine.max_streams == 2


def test_the_kuberay_manifest_runs_the_app_builder_on_an_example_file():
    manifest = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    module, _, name = app["import_path"].partition(":")
    import importlib

    assert callable(getattr(importlib.import_module(module), name))
    config = app["args"]["config"]
    assert (ROOT / "deploy" / Path(config).name).is_file()  # the image holds deploy/ at /app/deploy


def test_abbreviated_flags_are_refused_rather_than_dropped(tmp_path, capsys):
    """With a file, only flags given by their full name are found as overrides: an
    abbreviation would otherwise parse and then be lost, so it is refused."""
    path = tmp_path / "d.yaml"
    path.write_text("models: [{model: pusht}]\n")
    with pytest.raises(SystemExit) as exc:
        main(["config", "--config", str(path), "--max-sess", "4"])
    assert exc.value.code == 2 and "--max-sess" in capsys.readouterr().err


def test_flag_errors_name_the_flag_and_a_token_is_never_echoed(tmp_path, capsys):
    assert main(["config", "--steps", "1000,x"]) == 2
    assert capsys.readouterr().err.startswith("streamworld config: error: --steps:")
    path = tmp_path / "d.yaml"
    path.write_text("server: {auth_token: 123456789}\nmodels: [{model: pusht}]\n")
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "server.auth_token" in err and "123456789" not in err


def test_values_the_flags_took_still_load(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("models: [{model: tiny-wan, dtype: float16, frame_size: 48X64}]\n")
    model = load(path).models[0]
    assert (model.dtype, model.frame_size) == ("float16", "48x64")


def test_every_models_weights_are_checked_before_any_loads(tmp_path, capsys, monkeypatch):
    from streamworld.cli import serve

    monkeypatch.setattr(serve, "load_served_models", lambda *a: pytest.fail("models loaded"))
    path = tmp_path / "d.yaml"
    path.write_text("models: [{model: pusht}, {model: tiny-wan, dit: nowhere.pt}]\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tiny-wan (models[1])" in err and "nowhere.pt does not exist" in err
