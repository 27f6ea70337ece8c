"""A servable world model: causal DiT, VAE, text encoder and schedule, on one device.

`WorldModel.load` builds it from a `ModelConfig` and optional local weight paths. Nothing
is ever downloaded: models whose config says `requires_weights` refuse to start without
weight paths unless random weights are asked for explicitly (benchmarks).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .causal_wan import CausalWanDiT, CrossKV
from .checkpoint import load_dit_state_dict, load_into
from .config import ModelConfig
from .lite_decoder import LiteDecoder, load_lite_decoder
from .pixels import PixelCodec
from .schedule import FlowSchedule
from .text_encoder import PromptCache, TextEncoder
from .vae import StreamingVAE

# Modules that stay float32 when the model runs in bf16/fp16 (small, precision-sensitive).
_FP32_MODULES = ("condition_embedder.time_embedder", "scale_shift_table", "action_adapter")


@dataclass(frozen=True)
class WeightPaths:
    """Local weight locations; `root` is a diffusers-style folder holding all three."""

    root: str | None = None
    dit: str | None = None
    vae: str | None = None
    text_encoder: str | None = None
    # A lite decoder file from `streamworld distill-decoder` (used with decoder="lite").
    lite_decoder: str | None = None

    def resolve(self) -> WeightPaths:
        if self.root is None:
            return self
        root = Path(self.root)
        if not root.exists():
            raise FileNotFoundError(f"weights folder {root} does not exist")

        def pick(explicit: str | None, sub: str) -> str | None:
            if explicit is not None:
                return explicit
            return str(root / sub) if (root / sub).exists() else None

        text_encoder = self.text_encoder
        if text_encoder is None and (root / "text_encoder").exists():
            text_encoder = str(root)  # the text encoder wrapper finds text_encoder/ and tokenizer/
        return WeightPaths(
            None,
            pick(self.dit, "transformer") or str(root),
            pick(self.vae, "vae"),
            text_encoder,
            self.lite_decoder,
        )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but PyTorch sees no CUDA GPU")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


# Default byte budget of the cross-attention K/V cache (on the model's device): about 21
# prompts of Wan 2.1 1.3B (30 blocks x K and V x 512 x 1536 bf16, 94 MiB each).
DEFAULT_TEXT_CACHE_BYTES = 2 * 2**30


class WorldModel:
    def __init__(
        self,
        config: ModelConfig,
        dit: CausalWanDiT,
        vae: StreamingVAE | PixelCodec,
        text_encoder: TextEncoder | None,
        device: torch.device,
        dtype: torch.dtype,
        text_cache_size: int = 64,
        text_cache_bytes: int = DEFAULT_TEXT_CACHE_BYTES,
    ) -> None:
        self.config = config
        self.dit = dit
        self.vae = vae
        self.text_encoder = text_encoder
        self.device = device
        self.dtype = dtype
        self.schedule = FlowSchedule.build(
            config.denoising_steps, config.timestep_shift, config.warp_denoising_steps, config.prediction
        )
        self._text_cache: PromptCache[CrossKV] = PromptCache(
            text_cache_size, text_cache_bytes, lambda ctx: (*ctx.keys, *ctx.values)
        )
        self._text_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        config: ModelConfig,
        weights: WeightPaths | None = None,
        *,
        random_weights: bool = False,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        decoder: str = "wan",
        compiled: bool = False,
    ) -> WorldModel:
        """decoder: "wan" (the model's VAE decoder) or "lite" (`LiteDecoder`: its weights from
        `weights.lite_decoder`, seeded random ones with `random_weights` or for models without
        real weights). compiled: compile the hot paths with torch.compile, now rather than
        while serving: the DiT's elementwise arithmetic (`CausalWanDiT.compile_elementwise`)
        and the lite decoder (`LiteDecoder.compile_for`)."""
        if decoder not in ("wan", "lite"):
            raise ValueError(f"unknown decoder {decoder!r}; use wan or lite")
        weights = (weights or WeightPaths()).resolve()
        dev = device if isinstance(device, torch.device) else resolve_device(device)
        if weights.dit is not None:
            config = recorded_config(config, weights.dit)
        dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
        if config.requires_weights and not random_weights:
            missing = [
                name
                for name, path in (
                    ("DiT", weights.dit),
                    ("VAE", weights.vae),
                    ("text encoder", weights.text_encoder),
                )
                if path is None and (name != "text encoder" or config.takes_prompt)
            ]
            if missing:
                raise ValueError(
                    f"model {config.id} needs weights (missing: {', '.join(missing)}): give a local "
                    "diffusers folder or checkpoint paths (nothing is downloaded), or --random-weights "
                    "for benchmarking"
                )
        # Small models are initialised on the CPU, so their seeded weights (and frames) are the
        # same on every device. Real-size random weights serve timing only: build them in place.
        init_dev = dev if config.requires_weights else torch.device("cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.init_seed)
            with torch.device(init_dev):
                dit = CausalWanDiT(
                    config.dit,
                    action_dim=config.action_dim,
                    action_range=config.action_range,
                    spatial_actions=config.spatial_actions,
                    temporal_ratio=config.temporal_ratio,
                    latent_height=config.latent_height,
                    latent_width=config.latent_width,
                )
        if weights.dit is None and config.builtin_weights is not None and not random_weights:
            weights = WeightPaths(dit=str(builtin_weights_path(config)), vae=weights.vae)
        if weights.dit is not None:
            _check_training_record(config, weights.dit)
            state = load_dit_state_dict(weights.dit)
            load_into(dit, _prefix_transformer(state), what=f"DiT checkpoint {weights.dit}")
        dit.to(dev)
        _cast(dit, dt)
        dit.eval().requires_grad_(False)

        vae: StreamingVAE | PixelCodec
        if config.pixel_space:
            if weights.vae is not None:
                raise ValueError(f"model {config.id} works in pixel space and has no VAE to load")
            vae = PixelCodec(anchored=config.anchored_pixels)
        elif weights.vae is not None:
            vae = StreamingVAE.from_pretrained(weights.vae)
        else:
            vae = StreamingVAE.from_config(config, seed=config.init_seed + 1)
        vae = vae.to(dev, dt).eval().requires_grad_(False)
        if decoder == "lite":
            if not isinstance(vae, StreamingVAE):
                raise ValueError(f"model {config.id} works in pixel space and has no decoder to replace")
            vae.use_lite_decoder(_lite_decoder(config, weights.lite_decoder, random_weights))
        elif weights.lite_decoder is not None:
            raise ValueError("lite decoder weights were given, but the decoder is wan (use --decoder lite)")
        if compiled:
            dit.compile_elementwise(config.latent_frames_per_chunk)
            if isinstance(vae, StreamingVAE) and vae.lite is not None:
                f = config.latent_frames_per_chunk
                vae.lite.compile_for(config.latent_height, config.latent_width, f)

        text_encoder = None
        if config.takes_prompt:
            if weights.text_encoder is not None:
                text_encoder = TextEncoder.from_pretrained(
                    weights.text_encoder, text_len=config.text_len, device=dev, dtype=dt
                )
            else:
                text_encoder = TextEncoder.from_config(
                    config, seed=config.init_seed + 2, device=init_dev, dtype=dt
                )
                text_encoder.model.to(dev)
        if dev.type == "cuda":
            # Initialisation, casts and compile warm-ups were queued on this thread's stream;
            # the engine's executors run on streams of their own that are not ordered after
            # it. (The text encoder's random initialisation, 5.7 B parameters for Wan, was
            # still running when the first prompt was encoded: non-finite cross-attention
            # K/V and "non-finite values in the model output" for a stream's first chunk.)
            torch.cuda.synchronize(dev)
        return cls(config, dit, vae, text_encoder, dev, dt)

    # --- placement --------------------------------------------------------------------------
    def place(
        self, stages: Sequence[tuple[int, int, torch.device | str]], decoder_device: torch.device | str
    ) -> WorldModel:
        """Spreads the model over devices: the DiT's blocks by stage (`CausalWanDiT.place`),
        the decoder (and image encoder) on `decoder_device`. The text encoder and the inputs
        of each step stay on the first stage's device, which becomes `self.device`. Cached
        prompt encodings are dropped (their K/V lived on the old devices)."""
        self.dit.place(stages)
        self.vae.to(torch.device(decoder_device))
        self.device = torch.device(stages[0][2])
        cfg = self.config
        if self.dit.elementwise_compiled:  # warm the compiled code up where the blocks are now
            self.dit.compile_elementwise(cfg.latent_frames_per_chunk)
        lite = getattr(self.vae, "lite", None)
        if lite is not None and lite.compiled:
            lite.compile_for(cfg.latent_height, cfg.latent_width, cfg.latent_frames_per_chunk)
        if self.text_encoder is not None:
            self.text_encoder.model.to(self.device)
        with self._text_lock:
            self._text_cache.clear()
        return self

    @property
    def decoder_device(self) -> torch.device:
        return next(iter(self.vae.parameters()), torch.empty(0, device=self.device)).device

    # --- prompts ----------------------------------------------------------------------------
    def text_context(self, prompt: str) -> CrossKV:
        """Cross-attention K/V for a prompt, computed once and cached (LRU, bounded by entries
        and by bytes of keys and K/V: `text_cache_usage`)."""
        with self._text_lock:
            hit = self._text_cache.get(prompt)
            if hit is not None:
                return hit
        with torch.inference_mode():
            if self.text_encoder is None:
                embeds = torch.zeros(self.config.text_len, self.dit.transformer.config.text_dim)
            else:
                embeds = self.text_encoder.encode(prompt)
            ctx = self.dit.prepare_text(embeds.to(self.device, self.dtype))
            if not bool(torch.stack([torch.isfinite(k).all() for k in (*ctx.keys, *ctx.values)]).all()):
                raise ValueError("the prompt's cross-attention K/V have non-finite values")  # not cached
        with self._text_lock:
            self._text_cache.put(prompt, ctx)
        return ctx

    def text_cache_usage(self) -> tuple[int, int]:
        """(prompts cached, bytes they hold: keys and K/V)."""
        with self._text_lock:
            return len(self._text_cache), self._text_cache.nbytes

    def latent_shape(self, num_frames: int) -> tuple[int, int, int, int]:
        c = self.config
        return (c.latent_channels, num_frames, c.latent_height, c.latent_width)


WEIGHTS_DIR = Path(__file__).parent / "weights"


def image_as_last_frame(config: ModelConfig, image_latent: torch.Tensor) -> torch.Tensor:
    """The first image's latent [C, ..., h, w] as the frame that the first chunk's "delta"
    output is relative to (serving and training targets alike): anchored pixel latents are
    differences from the image, so there it is zero."""
    return torch.zeros_like(image_latent) if config.anchored_pixels else image_latent


def builtin_weights_path(config: ModelConfig) -> Path:
    """The shipped weight file of a model with `builtin_weights`."""
    if config.builtin_weights is None:
        raise ValueError(f"model {config.id} ships no weights")
    path = WEIGHTS_DIR / config.builtin_weights
    if not path.is_file():
        raise FileNotFoundError(
            f"the weights of {config.id} ({path}) are missing from this installation; reinstall "
            f"StreamWorld, or train them with `streamworld train {config.id}`"
        )
    return path


def _lite_decoder(config: ModelConfig, path: str | None, random_weights: bool) -> LiteDecoder:
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"lite decoder weights {path} do not exist")
        return load_lite_decoder(path)
    if config.requires_weights and not random_weights:
        raise ValueError(
            f"the lite decoder of {config.id} needs weights: distill them from the model's VAE with "
            "`streamworld distill-decoder` and pass --decoder-weights, or use --random-weights for timing"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.init_seed + 3)
        return LiteDecoder.for_model(config)


def _training_record(path: str) -> dict[str, str]:
    """The metadata `streamworld train` writes into exported weights ({} for other files)."""
    if not path.endswith(".safetensors") or not Path(path).is_file():
        return {}
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.metadata() or {}


def recorded_config(config: ModelConfig, path: str) -> ModelConfig:
    """`config` as weights exported by `streamworld train` record it: their number of DiT
    blocks (`train pusht --layers` trains deeper models than the preset) and, between the two
    clean-sample outputs "x0" and "delta" (`train pusht --prediction delta`), their output."""
    meta = _training_record(path)
    layers = meta.get("num_layers")
    if layers is not None and int(layers) != config.dit["num_layers"]:
        config = dataclasses.replace(config, dit={**config.dit, "num_layers": int(layers)})
    clean_sample = ("x0", "delta")
    recorded = meta.get("prediction")
    if recorded != config.prediction and recorded in clean_sample and config.prediction in clean_sample:
        config = config.with_prediction(recorded)
    return config


def _check_training_record(config: ModelConfig, path: str) -> None:
    """Weights exported by `streamworld train` record what the DiT predicts and what its latents
    are; both must match the model's config (weights from before latents were recorded were
    trained on plain pixels)."""
    meta = _training_record(path)
    recorded = meta.get("prediction")
    if recorded is None:  # not exported by `streamworld train`
        return
    if recorded != config.prediction:
        raise ValueError(
            f"{path} was trained to predict {recorded!r}, "
            f"but model {config.id} predicts {config.prediction!r}"
        )
    latents = meta.get("latent_space", "pixels")
    if latents != config.latent_space:
        raise ValueError(
            f"{path} was trained on {latents!r} latents, "
            f"but model {config.id} uses {config.latent_space!r} latents"
        )


def _prefix_transformer(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys (diffusers transformer layout) -> CausalWanDiT keys."""
    return {k if k.startswith("action_adapter.") else f"transformer.{k}": v for k, v in state.items()}


def _cast(dit: CausalWanDiT, dtype: torch.dtype) -> None:
    dit.to(dtype)
    if dtype == torch.float32:
        return
    for name, module in dit.named_modules():
        if any(m in name for m in _FP32_MODULES):
            module.float()
    for name, param in dit.named_parameters():
        if name.endswith("scale_shift_table"):
            param.data = param.data.float()
