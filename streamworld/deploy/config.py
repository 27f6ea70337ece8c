"""The deployment file: one typed, validated description of what a server runs.

    streamworld serve --config deploy.yaml          one server
    streamworld ray-serve --config deploy.yaml      replicas on Ray Serve (the `ray:` section)
    streamworld config --print --config deploy.yaml the effective configuration

The file is YAML with the sections `server`, `engine`, `models` (a list) and, for Ray
Serve, `ray`. Every key is the name of the matching `streamworld serve` flag with dashes as
underscores (`--token-budget` is `engine.token_budget`), so the flags' help documents the
keys; flags given on the command line override the file (a model flag applies to every
model of the file). Unknown keys and bad values are refused with the key's path, e.g.
`deploy.yaml: models[0].decoder: must be one of wan, lite`. Paths may start with `~`;
relative paths are relative to the file's folder. docs/deploy.md has the reference.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Bounds on the file itself: it is read whole before anything is checked.
MAX_FILE_BYTES = 1 << 20


class DeployError(ValueError):
    """A deployment file or setting that cannot be used; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class Limits(_Section):
    """Per-session limits (`SessionLimits`); None keeps the server's default."""

    start_timeout: float | None = Field(None, gt=0)
    pause_chunks: int | None = Field(None, ge=1)
    slow_client_timeout: float | None = Field(None, gt=0)
    ack_window: int | None = Field(None, ge=1)
    queue_timeout: float | None = Field(None, gt=0)


class ServerSection(_Section):
    transport: Literal["aiohttp", "asgi"] = "aiohttp"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_connections: int = Field(256, ge=1)
    allow_origin: list[str] = Field(default_factory=list)
    # Better kept out of the file: STREAMWORLD_AUTH_TOKEN is read when this is not set.
    auth_token: str | None = Field(None, min_length=1, repr=False)
    limits: Limits = Field(default_factory=Limits)


class EngineSection(_Section):
    max_sessions: int = Field(8, ge=1)
    max_queue: int = Field(16, ge=0)
    ttff_budget: float = Field(1.0, gt=0)
    max_batch: int = Field(16, ge=1)
    token_budget: int = Field(65536, ge=1)
    cuda_graphs: bool = False
    threads: int | None = Field(None, ge=1)


class ModelSection(_Section):
    model: str
    # Weights (local paths; nothing is downloaded).
    weights: str | None = None
    dit: str | None = None
    vae: str | None = None
    text_encoder: str | None = None
    decoder: Literal["wan", "lite"] = "wan"
    decoder_weights: str | None = None
    random_weights: bool = False
    compile: bool = False
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Geometry (None: the preset's).
    frame_size: str | None = Field(None, pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")
    window: int | None = Field(None, ge=1)
    sink: int | None = Field(None, ge=0)
    chunk: int | None = Field(None, ge=1)
    steps: list[float] | None = Field(None, min_length=1)
    default_kv_mode: Literal["clean", "final", "noisy"] | None = None
    # Placement (docs/deploy.md).
    devices: list[str] | None = Field(None, min_length=1)
    placement: str | None = None
    stages: int | None = Field(None, ge=1)
    ranks: int = Field(1, ge=1)

    @field_validator("frame_size", mode="before")
    @classmethod
    def _lower_frame_size(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("devices", mode="before")
    @classmethod
    def _split_devices(cls, value: Any) -> Any:
        return value.split(",") if isinstance(value, str) else value

    @field_validator("steps", mode="before")
    @classmethod
    def _split_steps(cls, value: Any) -> Any:
        return value.split(",") if isinstance(value, str) else value


class RaySection(_Section):
    """Ray Serve (`streamworld ray-serve`): replicas of the whole server, one engine each."""

    address: str | None = None  # a running cluster ("auto", "ray://host:10001"); None starts one here
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    # Sessions per replica the autoscaler aims at (default: engine.max_sessions, full replicas).
    target_sessions: float | None = Field(None, gt=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    # A replica leaving (downscale, upgrade) admits no session and waits this long for its
    # live sessions to end before it stops.
    graceful_shutdown_timeout_s: float = Field(600.0, ge=0)
    name: str = "streamworld"


class DeployConfig(_Section):
    server: ServerSection = Field(default_factory=ServerSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    models: list[ModelSection] = Field(min_length=1)
    ray: RaySection | None = None

    def to_yaml(self, redact: bool = True) -> str:
        import yaml

        data = self.model_dump(mode="json")
        note = ""
        if redact and data["server"].get("auth_token"):
            data["server"]["auth_token"] = None
            note = "# server.auth_token is set; not shown (give it with STREAMWORLD_AUTH_TOKEN)\n"
        return note + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


# --- reading ----------------------------------------------------------------------------------
PATH_KEYS = ("weights", "dit", "vae", "text_encoder", "decoder_weights")


def read_file(path: str | os.PathLike) -> dict:
    """The file's content as a dict, paths resolved against its folder."""
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise DeployError(f"{path}: no such file")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise DeployError(f"{path}: larger than {MAX_FILE_BYTES >> 10} KiB; not a deployment file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DeployError(f"{path}: not valid YAML: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise DeployError(f"{path}: expected a mapping with server, engine, models, ray")
    for i, model in enumerate(data.get("models") or []):
        if isinstance(model, dict):
            for key in PATH_KEYS:
                if isinstance(model.get(key), str):
                    model[key] = str(_resolve(model[key], p.parent))
        else:
            raise DeployError(f"{path}: models[{i}]: expected a mapping such as {{model: pusht}}")
    return data


def _resolve(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def validate(data: dict, source: str, flags: dict[str, str] | None = None) -> DeployConfig:
    """`data` as a `DeployConfig`; the first problem as a `DeployError` naming its key (or
    the flag that set it: `flags` maps a key path such as `server.port` to its flag)."""
    try:
        return DeployConfig.model_validate(data)
    except ValidationError as e:
        raise DeployError(_describe(e, source, flags or {})) from None


def _describe(e: ValidationError, source: str, flags: dict[str, str]) -> str:
    error = e.errors()[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
    key = ".".join(str(p) for p in error["loc"] if not isinstance(p, int))
    # An element of a list (steps[1]) was set by the list's flag.
    trimmed = re.sub(r"(\[\d+\])+$", "", loc)
    where = next((flags[k] for k in (loc, trimmed, key) if k in flags), None)
    if error["type"] == "extra_forbidden":
        parent = _section_of(error["loc"])
        known = ", ".join(parent.model_fields) if parent is not None else ""
        return f"{source}: {loc}: unknown key" + (f" (known here: {known})" if known else "")
    if error["type"] == "missing":
        return f"{source}: {loc}: required"
    message = error["msg"]
    for theirs, ours in _WORDING:
        message = message.replace(theirs, ours)
    given = error.get("input")
    secret = "auth_token" in key  # never echoed, even when it is not a string
    shown = "" if secret or isinstance(given, (dict, list)) else f", got {given!r}"
    return f"{where or source + ': ' + loc}: {message[0].lower()}{message[1:]}{shown}"


_WORDING = (
    ("Input should be", "must be"),
    ("String should", "must"),
    ("greater than or equal to", "at least"),
    ("less than or equal to", "at most"),
    ("greater than", "above"),
)


def _section_of(loc: tuple) -> type[BaseModel] | None:
    """The section class in which the unknown key at `loc` sits."""
    section: type[BaseModel] = DeployConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = section.model_fields.get(str(part))
        if field is None:
            return None
        inner = _model_in(field.annotation)
        if inner is None:
            return None
        section = inner
    return section


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def load(path: str | os.PathLike) -> DeployConfig:
    return validate(read_file(path), str(path))
