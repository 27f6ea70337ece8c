"""Reading Wan DiT checkpoints and loading them into a model.

`load_dit_state_dict` accepts the layouts Wan-family weights are published in (a diffusers
folder, an original Wan state dict, a CausVid `generator` or Self-Forcing `generator_ema`
checkpoint) and returns one state dict in diffusers `WanTransformer3DModel` key names.
`load_into` loads a state dict only when its keys and shapes fit the module exactly, and
otherwise says which keys are missing, unexpected or of the wrong shape.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import safetensors.torch
import torch

__all__ = ["CheckpointLayoutError", "load_dit_state_dict", "load_into"]

SUPPORTED_LAYOUTS = (
    "Supported DiT checkpoint layouts: a diffusers folder (the transformer folder or a pipeline "
    "folder with transformer/), an original Wan state dict (.safetensors/.pt/.pth/.bin), "
    "a CausVid checkpoint (`generator`), a Self-Forcing checkpoint (`generator_ema`)."
)

ADAPTER_PREFIX = "action_adapter."

# How many keys of each kind an error message lists before summarising the rest.
_SHOWN_KEYS = 10

_WEIGHTS_NAME = "diffusion_pytorch_model"
# Tried in order; the first one present in the folder is read.
_FOLDER_WEIGHT_FILES = (
    f"{_WEIGHTS_NAME}.safetensors.index.json",
    f"{_WEIGHTS_NAME}.safetensors",
    f"{_WEIGHTS_NAME}.bin.index.json",
    f"{_WEIGHTS_NAME}.bin",
)

# Containers that training code wraps a generator's state dict in, most preferred first:
# Self-Forcing saves both `generator` and its EMA, and the EMA is the one to serve.
_CONTAINER_KEYS = ("generator_ema", "generator", "state_dict", "model")

# Wrapper modules (FSDP, activation checkpointing, torch.compile) that can appear anywhere
# in a key; none of them is ever a real Wan module name.
_WRAPPER_SEGMENT = re.compile(r"(?:^|(?<=\.))(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
# Prefixes stripped while every DiT key carries them: CausVid and Self-Forcing keep the
# DiT as `self.model`, DDP adds `module.`, ComfyUI-style files add `diffusion_model.`.
_COMMON_PREFIXES = ("module.", "model.", "diffusion_model.")

_ORIGINAL_MARKER = re.compile(
    r"^(?:blocks\.\d+\.(?:self_attn|cross_attn)\.|head\.head\.|(?:time|text)_embedding\.)"
)
_DIFFUSERS_MARKER = re.compile(r"^(?:blocks\.\d+\.attn[12]\.|condition_embedder\.|proj_out\.)")


def _rule(pattern: str, template: str) -> tuple[re.Pattern[str], str]:
    return re.compile(pattern), template


_LEAF = r"(?P<leaf>weight|bias)"
_BLOCK = r"blocks\.(?P<n>\d+)"

# Original Wan name -> diffusers name. Each pattern must match the whole key and the first
# matching rule wins, so every key is renamed exactly once: that is what lets norm2 and norm3
# trade places and keeps `head.modulation` apart from `blocks.N.modulation`. Keys that match
# no rule keep their name (patch_embedding.* is already the same in both layouts).
_ORIGINAL_TO_DIFFUSERS = (
    _rule(rf"time_embedding\.0\.{_LEAF}", r"condition_embedder.time_embedder.linear_1.\g<leaf>"),
    _rule(rf"time_embedding\.2\.{_LEAF}", r"condition_embedder.time_embedder.linear_2.\g<leaf>"),
    _rule(rf"time_projection\.1\.{_LEAF}", r"condition_embedder.time_proj.\g<leaf>"),
    _rule(rf"text_embedding\.0\.{_LEAF}", r"condition_embedder.text_embedder.linear_1.\g<leaf>"),
    _rule(rf"text_embedding\.2\.{_LEAF}", r"condition_embedder.text_embedder.linear_2.\g<leaf>"),
    # I2V image embedding: LayerNorm, Linear, GELU, Linear, LayerNorm.
    _rule(rf"img_emb\.proj\.0\.{_LEAF}", r"condition_embedder.image_embedder.norm1.\g<leaf>"),
    _rule(rf"img_emb\.proj\.1\.{_LEAF}", r"condition_embedder.image_embedder.ff.net.0.proj.\g<leaf>"),
    _rule(rf"img_emb\.proj\.3\.{_LEAF}", r"condition_embedder.image_embedder.ff.net.2.\g<leaf>"),
    _rule(rf"img_emb\.proj\.4\.{_LEAF}", r"condition_embedder.image_embedder.norm2.\g<leaf>"),
    _rule(r"img_emb\.emb_pos", r"condition_embedder.image_embedder.pos_embed"),
    _rule(r"head\.modulation", r"scale_shift_table"),
    _rule(rf"head\.head\.{_LEAF}", r"proj_out.\g<leaf>"),
    _rule(rf"{_BLOCK}\.modulation", r"blocks.\g<n>.scale_shift_table"),
    _rule(rf"{_BLOCK}\.self_attn\.q\.{_LEAF}", r"blocks.\g<n>.attn1.to_q.\g<leaf>"),
    _rule(rf"{_BLOCK}\.self_attn\.k\.{_LEAF}", r"blocks.\g<n>.attn1.to_k.\g<leaf>"),
    _rule(rf"{_BLOCK}\.self_attn\.v\.{_LEAF}", r"blocks.\g<n>.attn1.to_v.\g<leaf>"),
    _rule(rf"{_BLOCK}\.self_attn\.o\.{_LEAF}", r"blocks.\g<n>.attn1.to_out.0.\g<leaf>"),
    _rule(rf"{_BLOCK}\.self_attn\.norm_q\.{_LEAF}", r"blocks.\g<n>.attn1.norm_q.\g<leaf>"),
    _rule(rf"{_BLOCK}\.self_attn\.norm_k\.{_LEAF}", r"blocks.\g<n>.attn1.norm_k.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.q\.{_LEAF}", r"blocks.\g<n>.attn2.to_q.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.k\.{_LEAF}", r"blocks.\g<n>.attn2.to_k.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.v\.{_LEAF}", r"blocks.\g<n>.attn2.to_v.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.o\.{_LEAF}", r"blocks.\g<n>.attn2.to_out.0.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.norm_q\.{_LEAF}", r"blocks.\g<n>.attn2.norm_q.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.norm_k\.{_LEAF}", r"blocks.\g<n>.attn2.norm_k.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.k_img\.{_LEAF}", r"blocks.\g<n>.attn2.add_k_proj.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.v_img\.{_LEAF}", r"blocks.\g<n>.attn2.add_v_proj.\g<leaf>"),
    _rule(rf"{_BLOCK}\.cross_attn\.norm_k_img\.{_LEAF}", r"blocks.\g<n>.attn2.norm_added_k.\g<leaf>"),
    # Wan applies norm3 before cross-attention and norm2 before the FFN; diffusers names
    # them the other way round.
    _rule(rf"{_BLOCK}\.norm3\.{_LEAF}", r"blocks.\g<n>.norm2.\g<leaf>"),
    _rule(rf"{_BLOCK}\.norm2\.{_LEAF}", r"blocks.\g<n>.norm3.\g<leaf>"),
    _rule(rf"{_BLOCK}\.ffn\.0\.{_LEAF}", r"blocks.\g<n>.ffn.net.0.proj.\g<leaf>"),
    _rule(rf"{_BLOCK}\.ffn\.2\.{_LEAF}", r"blocks.\g<n>.ffn.net.2.\g<leaf>"),
)


class CheckpointLayoutError(ValueError):
    """A checkpoint that cannot be read, or whose keys or shapes do not fit the model."""

    def __init__(
        self,
        summary: str,
        *,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        # key -> (checkpoint shape, model shape)
        self.mismatched = dict(sorted((mismatched or {}).items()))
        lines = [summary]
        lines += _key_list("missing keys", self.missing)
        lines += _key_list("unexpected keys", self.unexpected)
        lines += _key_list(
            "shape mismatches",
            [
                f"{key}: checkpoint {tuple(got)} vs model {tuple(want)}"
                for key, (got, want) in self.mismatched.items()
            ],
        )
        super().__init__("\n".join(lines))


def _key_list(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    lines = [f"  {title} ({len(items)}):"]
    lines += [f"    {item}" for item in items[:_SHOWN_KEYS]]
    if len(items) > _SHOWN_KEYS:
        lines.append(f"    ... and {len(items) - _SHOWN_KEYS} more")
    return lines


def load_dit_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a Wan DiT checkpoint in any supported layout, in diffusers key names.

    `path` is a diffusers transformer folder, a diffusers pipeline folder (with
    `transformer/`), or one file: an original Wan state dict, a CausVid checkpoint or a
    Self-Forcing checkpoint. Keys under `action_adapter.` are returned unchanged.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"DiT checkpoint {path} does not exist. {SUPPORTED_LAYOUTS}")
    raw = _read_folder(path) if path.is_dir() else _read_file(path)
    state_dict = _strip_wrappers(_unwrap_containers(raw, path))
    return _to_diffusers_names(state_dict, path)


def load_into(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], *, what: str) -> None:
    """Load `state_dict` into `module` if its keys and shapes match exactly.

    Values are cast to the dtype of the module's own tensors. On any mismatch nothing is
    loaded and a `CheckpointLayoutError` names the missing, unexpected and misshapen keys.
    """
    expected = module.state_dict()
    missing = expected.keys() - state_dict.keys()
    unexpected = state_dict.keys() - expected.keys()
    mismatched = {
        key: (tuple(state_dict[key].shape), tuple(expected[key].shape))
        for key in expected.keys() & state_dict.keys()
        if state_dict[key].shape != expected[key].shape
    }
    if missing or unexpected or mismatched:
        counts = f"{len(missing)} missing, {len(unexpected)} unexpected, {len(mismatched)} misshapen keys"
        raise CheckpointLayoutError(
            f"{what} does not fit {type(module).__name__} ({counts}). {SUPPORTED_LAYOUTS}",
            missing=missing,
            unexpected=unexpected,
            mismatched=mismatched,
        )
    module.load_state_dict(state_dict, strict=True)


# --- reading ----------------------------------------------------------------------------


def _read_folder(folder: Path) -> dict[str, object]:
    has_weights = any((folder / name).is_file() for name in _FOLDER_WEIGHT_FILES)
    if not has_weights and (folder / "transformer").is_dir():
        folder = folder / "transformer"
    for name in _FOLDER_WEIGHT_FILES:
        weights = folder / name
        if not weights.is_file():
            continue
        if not name.endswith(".index.json"):
            return _read_file(weights)
        try:
            weight_map = json.loads(weights.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointLayoutError(f"DiT checkpoint index {weights} is unreadable: {exc}") from exc
        names = list(weight_map.values()) if isinstance(weight_map, dict) else [None]
        if not all(isinstance(s, str) and s and Path(s).name == s for s in names):
            raise CheckpointLayoutError(
                f"DiT checkpoint index {weights}: its weight_map must name shard files in the same folder"
            )
        state_dict: dict[str, object] = {}
        for shard in sorted(set(names)):
            state_dict.update(_read_file(folder / shard))
        return state_dict
    raise FileNotFoundError(
        f"DiT checkpoint folder {folder} holds none of {', '.join(_FOLDER_WEIGHT_FILES)}"
        f" (nor a transformer/ subfolder that does). {SUPPORTED_LAYOUTS}"
    )


def _read_file(file: Path) -> dict[str, object]:
    if not file.is_file():
        raise FileNotFoundError(f"DiT checkpoint file {file} does not exist")
    try:
        if file.suffix == ".safetensors":
            return safetensors.torch.load_file(file, device="cpu")
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors, pickle and zip errors share no base class
        raise CheckpointLayoutError(
            f"DiT checkpoint {file} is unreadable: {exc}. {SUPPORTED_LAYOUTS}"
        ) from exc
    if not isinstance(loaded, Mapping):
        raise CheckpointLayoutError(
            f"DiT checkpoint {file} holds a {type(loaded).__name__}, not a state dict. {SUPPORTED_LAYOUTS}"
        )
    return dict(loaded)


# --- layout detection -------------------------------------------------------------------


def _is_tensor_dict(obj: object) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _unwrap_containers(obj: Mapping[str, object], path: Path) -> dict[str, torch.Tensor]:
    while not _is_tensor_dict(obj):
        inner = next((obj[key] for key in _CONTAINER_KEYS if isinstance(obj.get(key), Mapping)), None)
        if inner is None:
            top = ", ".join(sorted(map(str, obj))[:_SHOWN_KEYS]) or "nothing"
            raise CheckpointLayoutError(
                f"DiT checkpoint {path} is not a state dict and has none of the containers "
                f"{', '.join(_CONTAINER_KEYS)} (top-level keys: {top}). {SUPPORTED_LAYOUTS}"
            )
        obj = inner
    return dict(obj)  # type: ignore[arg-type]


def _strip_wrappers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state_dict = {_WRAPPER_SEGMENT.sub("", key): value for key, value in state_dict.items()}
    while True:
        # The adapter may be saved next to the DiT wrapper rather than inside it, so only
        # the DiT keys decide whether a prefix is common.
        dit_keys = [key for key in state_dict if not key.startswith(ADAPTER_PREFIX)]
        prefix = next(
            (p for p in _COMMON_PREFIXES if dit_keys and all(k.startswith(p) for k in dit_keys)), None
        )
        if prefix is None:
            return state_dict
        state_dict = {key.removeprefix(prefix): value for key, value in state_dict.items()}


def _to_diffusers_names(state_dict: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    dit_keys = [key for key in state_dict if not key.startswith(ADAPTER_PREFIX)]
    original = any(_ORIGINAL_MARKER.match(key) for key in dit_keys)
    diffusers = any(_DIFFUSERS_MARKER.match(key) for key in dit_keys)
    if original and diffusers:
        raise CheckpointLayoutError(
            f"DiT checkpoint {path} mixes original Wan and diffusers key names. {SUPPORTED_LAYOUTS}"
        )
    if not original:
        return state_dict
    renamed: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        new_key = key if key.startswith(ADAPTER_PREFIX) else _diffusers_name(key)
        if new_key in renamed:
            raise CheckpointLayoutError(f"DiT checkpoint {path}: two keys map to {new_key}")
        renamed[new_key] = value
    return renamed


def _diffusers_name(original_key: str) -> str:
    for pattern, template in _ORIGINAL_TO_DIFFUSERS:
        match = pattern.fullmatch(original_key)
        if match:
            return match.expand(template)
    return original_key
