"""Flags and the deployment file, as one `DeployConfig` (streamworld/deploy/config.py).

Every file key is the name of a `serve` flag with dashes as underscores; `KEYS` pairs each
key with the flag's attribute (`dest`). Without `--config` the flags alone make the
configuration; with it, the file does, and only the flags actually given override it (a
model flag applies to every model of the file; `--model` picks models of the file).
Back from the configuration, `model_namespace` gives one model's settings in the flags'
shape, so that the loading helpers (loading.py) serve both paths.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from .errors import UsageError


class Key(NamedTuple):
    section: str  # "server", "server.limits", "engine" or "model"
    key: str
    dest: str  # the argparse attribute

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


SERVER_KEYS = ("transport", "host", "port", "log_level", "max_connections", "auth_token")
LIMIT_KEYS = ("start_timeout", "pause_chunks", "slow_client_timeout", "ack_window", "queue_timeout")
ENGINE_KEYS = (
    "max_sessions",
    "max_queue",
    "ttff_budget",
    "max_batch",
    "token_budget",
    "cuda_graphs",
    "threads",
)
MODEL_KEYS = (
    "weights",
    "dit",
    "vae",
    "text_encoder",
    "decoder",
    "decoder_weights",
    "random_weights",
    "compile",
    "device",
    "dtype",
    "frame_size",
    "window",
    "sink",
    "chunk",
    "steps",
    "default_kv_mode",
    "devices",
    "placement",
    "stages",
    "ranks",
)
# Weights that belong to one model: without a file they go to the real-size models, or to
# the only model served (a small model beside others keeps its own).
OWN_WEIGHTS = ("weights", "dit", "vae", "text_encoder")

KEYS = (
    *(Key("server", k, k) for k in SERVER_KEYS),
    Key("server", "allow_origin", "allowed_origins"),
    # The limits' dests are `SessionLimits` fields: seconds end in _s.
    *(Key("server.limits", k, k + "_s" if k.endswith("timeout") else k) for k in LIMIT_KEYS),
    *(Key("engine", k, k) for k in ENGINE_KEYS),
    *(Key("model", k, "timesteps" if k == "steps" else k) for k in MODEL_KEYS),
)


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The attributes that `argv` (a command's own arguments) sets explicitly: parsed again
    with every default suppressed, only what was given remains."""
    quiet = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            kwargs = {"dest": action.dest, "default": argparse.SUPPRESS}
            if action.nargs == 0:  # store_true / store_const
                kwargs.update(action="store_const", const=action.const)
            else:
                kwargs.update(action="append" if isinstance(action, argparse._AppendAction) else "store")
            quiet.add_argument(*action.option_strings, **kwargs)
    known, _ = quiet.parse_known_args(argv)
    return set(vars(known))


def deploy_config(args: argparse.Namespace):
    """The effective `DeployConfig` of the flags and `--config`; a `UsageError` names the
    key or flag at fault. Over a file, the flags in `args.given` (set by `main`) override
    it; arguments parsed elsewhere without `given` leave the file as it is."""
    from ..deploy.config import DeployError, read_file, validate

    given = getattr(args, "given", set())
    try:
        if args.config:
            data, source = read_file(args.config), args.config
            _pick_models(data, args.models, source)
        else:
            data, source = {"models": _flag_models(args)}, "the flags"
            given = {k.dest for k in KEYS if getattr(args, k.dest, None) is not None}
        flags = _apply_flags(data, args, given)
        return validate(data, source, flags)
    except DeployError as e:
        raise UsageError(str(e)) from None


def _pick_models(data: dict, wanted: list[str] | None, source: str) -> None:
    if not wanted:
        return
    models = data.get("models") or []
    by_id = {m.get("model"): m for m in models if isinstance(m, dict)}
    missing = [m for m in wanted if m not in by_id]
    if missing:
        raise UsageError(f"--model {missing[0]}: not in {source} (its models: {', '.join(map(str, by_id))})")
    data["models"] = [by_id[m] for m in wanted]


def _flag_models(args: argparse.Namespace) -> list[dict]:
    """--model (default pusht); serve.config_of checks the ids, from flags or a file."""
    from .arguments import DEFAULT_MODEL

    return [{"model": m} for m in args.models or [DEFAULT_MODEL]]


def _apply_flags(data: dict, args: argparse.Namespace, given: set[str]) -> dict[str, str]:
    """Writes the given flags into `data`; returns which flag set which key path."""
    from ..models import PRESETS

    flags: dict[str, str] = {}
    models = [m for m in data.get("models") or [] if isinstance(m, dict)]
    for k in KEYS:
        if k.dest not in given:
            continue
        value = getattr(args, k.dest)
        if k.section == "model":
            for i, model in enumerate(models):
                preset = PRESETS.get(model.get("model"))
                alone = len(models) == 1 or (preset is not None and preset.requires_weights)
                if k.key in OWN_WEIGHTS and not args.config and not alone:
                    continue
                model[k.key] = value
                flags[f"models[{i}].{k.key}"] = k.flag
            continue
        section = data
        for part in k.section.split("."):
            section = section.setdefault(part, {})
            if not isinstance(section, dict):
                raise UsageError(f"{k.section}: expected a mapping")
        section[k.key] = value
        flags[f"{k.section}.{k.key}"] = k.flag
    return flags


def model_namespace(deploy, index: int) -> argparse.Namespace:
    """Model `index` of `deploy` with the engine's settings, in the shape of parsed flags."""
    model = deploy.models[index]
    values = {k.dest: getattr(model, k.key) for k in KEYS if k.section == "model"}
    values["devices"] = ",".join(model.devices) if model.devices else None
    values["timesteps"] = list(model.steps) if model.steps else None
    values["model"] = model.model
    values.update({k: getattr(deploy.engine, k) for k in ENGINE_KEYS})
    return argparse.Namespace(**values)
