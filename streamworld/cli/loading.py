"""The one way a command turns its arguments into a loaded model.

`serve`, `generate`, `bench` and `eval` load a `WorldModel` through `load_world_model`
(where the process does its PyTorch work, with loading errors as one-line usage errors);
`distill-decoder` loads only its teacher VAE, through `load_teacher_vae`. The preset
overrides (--frame-size, --window, --sink, --chunk, --steps), the weight paths and --threads
are read here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    import torch

    from ..engine import Placement, ThreadGovernor
    from ..models.config import ModelConfig
    from ..models.vae import StreamingVAE
    from ..models.world_model import WeightPaths, WorldModel

# What loading raises for bad weights, devices or settings: the user's to fix, not a bug.
LOAD_ERRORS = (ValueError, RuntimeError, FileNotFoundError, NotImplementedError)

_WEIGHT_FLAGS = ("weights", "dit", "vae", "text_encoder", "decoder_weights")


@dataclass(frozen=True)
class LoadOptions:
    """`WorldModel.load`'s keyword arguments."""

    device: str = "auto"
    dtype: str = "auto"
    random_weights: bool = False
    decoder: str = "wan"
    compiled: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadOptions:
        return cls(
            device=args.device,
            dtype=args.dtype,
            random_weights=args.random_weights,
            decoder=args.decoder,
            compiled=args.compile,
        )


def apply_threads(args: argparse.Namespace, adaptive: bool = False) -> ThreadGovernor | None:
    """--threads N fixes PyTorch's CPU thread count. Without it, `adaptive` (serve) starts a
    governor that follows other processes' load on a CPU device (streamworld.engine.cpu_threads);
    otherwise PyTorch's default (one per core) stands."""
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
        return None
    if not adaptive:
        return None
    from ..engine import ThreadGovernor
    from ..models.world_model import resolve_device

    try:
        if resolve_device(args.device).type != "cpu":
            return None
    except RuntimeError:
        return None  # no such device: loading the model says so
    governor = ThreadGovernor.for_torch()
    return governor.start() if governor.available() else None


def check_weight_paths(args: argparse.Namespace) -> None:
    for name in _WEIGHT_FLAGS:
        path = getattr(args, name)
        if path is not None and not Path(path).exists():
            raise UsageError(f"--{name.replace('_', '-')}: {path} does not exist")


def weight_paths(args: argparse.Namespace) -> WeightPaths:
    from ..models.world_model import WeightPaths

    return WeightPaths(
        root=args.weights,
        dit=args.dit,
        vae=args.vae,
        text_encoder=args.text_encoder,
        lite_decoder=args.decoder_weights,
    )


def model_depth(config: ModelConfig, args: argparse.Namespace) -> int:
    """DiT blocks of the model `args` load: the preset's, or what trained weights record
    (`streamworld train pusht --layers`)."""
    from ..models.world_model import recorded_config

    try:
        dit = weight_paths(args).resolve().dit
    except FileNotFoundError:  # a --weights folder that is not there: checked where it loads
        return config.num_layers
    if dit is None or not Path(dit).is_file():
        return config.num_layers
    return recorded_config(config, dit).num_layers


def override_preset(config: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """The preset with --frame-size, --window, --sink, --chunk, --steps and --default-kv-mode applied."""
    changes: dict = {}
    frame_size = getattr(args, "frame_size", None)  # commands without --frame-size: eval
    if frame_size is not None:
        h, sep, w = frame_size.lower().partition("x")
        if not (sep and h.isdigit() and w.isdigit() and int(h) > 0 and int(w) > 0):
            raise UsageError(f"--frame-size must look like 320x512, got {frame_size!r}")
        changes.update(height=int(h), width=int(w))
    changes.update(_geometry_changes(args))
    if not changes:
        return config
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as e:
        raise UsageError(f"--frame-size/--window/--sink/--chunk: {e}") from None


def _geometry_changes(args: argparse.Namespace) -> dict:
    """--window, --sink, --chunk, --steps and --default-kv-mode as `ModelConfig` fields (the
    commands that lack one of them have no such attribute)."""
    changes: dict = {}
    for flag, name, least in (
        ("window", "window_frames", 1),
        ("sink", "sink_frames", 0),
        ("chunk", "latent_frames_per_chunk", 1),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            if value < least:
                raise UsageError(f"--{flag} must be at least {least}, got {value}")
            changes[name] = value
    steps = getattr(args, "timesteps", None)  # --steps
    if steps is not None:
        changes["denoising_steps"] = parse_steps(steps)
    if getattr(args, "default_kv_mode", None) is not None:
        changes["default_kv_mode"] = args.default_kv_mode
    return changes


def parse_steps(steps: str | list) -> tuple[float, ...]:
    """Denoising timesteps, from `1000,750,500,250` or a list: decreasing, in (0, 1000]."""
    items = steps.split(",") if isinstance(steps, str) else list(steps)
    try:
        values = tuple(float(v) for v in items)
    except (TypeError, ValueError):
        raise UsageError(f"--steps must be numbers such as 1000,750,500,250, got {steps!r}") from None
    ok = values and all(0 < v <= 1000 for v in values)
    if not ok or any(b >= a for a, b in itertools.pairwise(values)):
        raise UsageError(f"--steps must decrease within (0, 1000], e.g. 1000,750,500,250; got {steps!r}")
    return values


def preset(args: argparse.Namespace) -> ModelConfig:
    """--model's preset with the overrides applied."""
    from ..models import get_preset

    try:
        return override_preset(get_preset(args.model), args)
    except KeyError as e:
        raise UsageError(e.args[0]) from None


def load_world_model(
    config: ModelConfig, weights: WeightPaths | None, options: LoadOptions, label: str = ""
) -> WorldModel:
    """Loads where this process does its PyTorch work for the device (`on_torch_thread`: on a
    CPU the engine's shared worker thread), as the engine and the reference generator run.
    `label` prefixes a loading error (which of several models failed)."""
    from ..engine import on_torch_thread
    from ..models.world_model import WorldModel, resolve_device

    try:
        return on_torch_thread(
            resolve_device(options.device),
            lambda: WorldModel.load(config, weights, **dataclasses.asdict(options)),
        )
    except LOAD_ERRORS as e:
        raise UsageError(f"{label}{e}") from None


def load_model(args: argparse.Namespace) -> WorldModel:
    """The model of --model and the weight arguments (`generate`, `bench`)."""
    apply_threads(args)
    config = preset(args)
    weights = weight_paths(args)
    check_weight_paths(args)
    return load_world_model(config, weights, LoadOptions.from_args(args))


def teacher_vae_path(args: argparse.Namespace, config: ModelConfig) -> str | None:
    """The VAE folder of --vae or --weights; None for a seeded random teacher."""
    from ..models.world_model import WeightPaths

    vae_path = WeightPaths(root=args.weights, vae=args.vae).resolve().vae if args.weights else args.vae
    if args.weights and vae_path is None:
        raise UsageError(f"--weights: {args.weights} has no vae/ folder; give the teacher with --vae")
    if vae_path is None and config.requires_weights and not args.random_weights:
        raise UsageError(f"{config.id}: give the teacher VAE with --vae or --weights (or --random-weights)")
    return vae_path


def resolve_device(device: str) -> torch.device:
    from ..models.world_model import resolve_device

    try:
        return resolve_device(device)
    except LOAD_ERRORS as e:
        raise UsageError(str(e)) from None


def load_teacher_vae(config: ModelConfig, vae_path: str | None, device: torch.device) -> StreamingVAE:
    """The VAE at `vae_path`, or the preset's seeded random one (it checks the pipeline only)."""
    from ..models.vae import StreamingVAE
    from ..models.world_model import resolve_dtype

    try:
        dtype = resolve_dtype("auto", device)
        if vae_path is not None:
            return StreamingVAE.from_pretrained(vae_path, device=device, dtype=dtype)
        return StreamingVAE.from_config(config, seed=config.init_seed + 1).to(device, dtype)
    except LOAD_ERRORS as e:
        raise UsageError(str(e)) from None


def placement(
    args: argparse.Namespace, num_layers: int, label: str = "", devices_here: bool = True
) -> Placement:
    """Where a model of `num_layers` blocks runs: --devices and --placement, or without them
    --stages and --ranks on --device (one replica). Checked here; with `devices_here`, also
    that this machine has the devices (`streamworld config` checks files for other machines)."""
    from ..engine import PlacementError, check_devices, parse_placement, single_device
    from ..models.world_model import resolve_device

    def home() -> str:
        return str(resolve_device(args.device)) if devices_here or args.device == "auto" else args.device

    try:
        if not args.devices and not args.placement:
            placed = single_device(home(), num_layers, args.stages or 1, args.ranks)
        else:
            devices = args.devices.split(",") if args.devices else [home()]
            placed = parse_placement(args.placement or "replicas", devices, num_layers, args.stages)
            if devices_here:
                check_devices(placed, device_problem)
    except PlacementError as e:
        raise UsageError(f"{label}{e}") from None
    except RuntimeError as e:  # resolve_device: no such device
        raise UsageError(f"{label}--device: {e}") from None
    elsewhere = {s.device for r in placed.replicas for s in r.stages if not s.device.startswith("cuda")}
    if getattr(args, "cuda_graphs", False) and elsewhere:
        raise UsageError(f"{label}--cuda-graphs needs CUDA devices, not {', '.join(sorted(elsewhere))}")
    return placed


def device_problem(device: str) -> str | None:
    """Why `device` cannot be used here, or None."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        return "not a device name (cpu, cuda or cuda:N)"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"{dev.type} devices are not supported (cpu, cuda or cuda:N)"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "PyTorch sees no CUDA GPU here"
    if dev.index is not None and dev.index >= count:
        return f"this machine has {count} CUDA device{'s' if count != 1 else ''} (cuda:0-{count - 1})"
    return None


def load_placed(
    config: ModelConfig, weights: WeightPaths | None, options: LoadOptions, placed: Placement, label: str = ""
) -> list[WorldModel]:
    """One model per replica of `placed`, its blocks and decoder where the replica says.
    Replicas that use the same single device share one model (the weights are read-only)."""
    models: dict[tuple, WorldModel] = {}
    out = []
    for replica in placed.replicas:
        key = replica.devices if len(replica.devices) == 1 else ("replica", len(out))
        if key not in models:
            here = dataclasses.replace(options, device=replica.home_device)
            model = load_world_model(config, weights, here, label)
            if len(replica.devices) > 1:
                stages = [(s.start, s.stop, s.device) for s in replica.stages]
                from ..engine import on_torch_thread

                on_torch_thread(
                    model.device, lambda m=model, s=stages, d=replica.decoder_device: m.place(s, d)
                )
            models[key] = model
        out.append(models[key])
    return out
