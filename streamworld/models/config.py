"""One typed description of a servable world model.

A `ModelConfig` says everything the rest of StreamWorld needs to know about a model: the
Wan DiT, VAE and text encoder configurations (diffusers constructor arguments), the video
geometry, the chunking, the denoising schedule, the attention window and the conditioning
inputs. Presets (`streamworld.models.presets`) are instances of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

KV_MODES = ("clean", "final", "noisy")


@dataclass(frozen=True)
class ModelConfig:
    id: str
    # Constructor arguments of diffusers' WanTransformer3DModel.
    dit: dict[str, Any]
    # Constructor arguments of diffusers' AutoencoderKLWan, or {"kind": "pixels"} for models
    # that denoise frames directly, with "anchored": True for frames as differences from the
    # stream's first frame (`streamworld.models.pixels`).
    vae: dict[str, Any]
    # Constructor arguments of transformers' UMT5Config; None for models without text.
    text_encoder: dict[str, Any] | None
    height: int
    width: int
    fps: int = 16
    # Text context length; prompts are padded with zeros to it, as Wan does.
    text_len: int = 512
    latent_frames_per_chunk: int = 3
    # Denoising steps in the 0..1000 timestep scale, first (noisiest) first.
    denoising_steps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    timestep_shift: float = 5.0
    # Map the step list through the shifted flow-matching grid (Self-Forcing's warp).
    warp_denoising_steps: bool = True
    # What the DiT predicts: "flow" (v = noise - x0), "x0", or "delta" (x0's change since the
    # last latent frame before the chunk; `with_prediction` gives a config that predicts it).
    prediction: str = "flow"
    # Timestep of the commit pass that writes clean K/V (CausVid's `context_noise`).
    context_timestep: float = 0.0
    # Attention context: the first `sink_frames` latent frames of the stream plus the
    # `window_frames` most recent ones.
    sink_frames: int = 1
    window_frames: int = 18
    action_dim: int = 0
    # The range of action values the model was trained on (mapped to [-1, 1] inside it).
    # Clients may send values up to two range widths beyond it on either side
    # (`accepted_action_range`); values further out are refused, not fed to the model.
    action_range: tuple[float, float] = (-1.0, 1.0)
    # 2-d actions that are positions in the frame (x along the width, y down the height, both
    # spanning action_range) are also embedded per token (models/actions.py).
    spatial_actions: bool = False
    needs_image: bool = False
    kv_modes: tuple[str, ...] = KV_MODES
    default_kv_mode: str = "clean"
    # Keyword arguments of `LiteDecoder.for_latents` (widths, blocks) for `--decoder lite`;
    # empty for the defaults sized for Wan latents.
    lite_decoder: dict[str, Any] = field(default_factory=dict)
    # Seed of the random initialisation used when no weights are given.
    init_seed: int = 0
    # True for real models: serving them without weights needs an explicit --random-weights.
    requires_weights: bool = False
    # Weights shipped inside the package (a safetensors file under streamworld/models/weights/),
    # used when no weight paths are given.
    builtin_weights: str | None = None
    description: str = ""
    # The environment the model simulates, where the project has one ("pusht": first frames,
    # scenes, the evaluation and the planner); None for models of open-ended video.
    environment: str | None = None

    def __post_init__(self) -> None:
        if self.default_kv_mode not in self.kv_modes:
            raise ValueError(f"{self.id}: default_kv_mode {self.default_kv_mode!r} not in {self.kv_modes}")
        if self.height % self.spatial_ratio or self.width % self.spatial_ratio:
            raise ValueError(f"{self.id}: frame size must be a multiple of {self.spatial_ratio}")
        if self.vae.get("anchored", False) and not (self.pixel_space and self.needs_image):
            raise ValueError(f"{self.id}: anchored latents need pixel space and a first image")
        if self.spatial_actions and self.action_dim != 2:
            raise ValueError(f"{self.id}: spatial actions are (x, y) positions, so action_dim must be 2")
        if self.prediction == "delta" and "noisy" in self.kv_modes:
            raise ValueError(
                f"{self.id}: a model that predicts 'delta' cannot serve kv_mode 'noisy' (a chunk "
                "starts before the frame it is relative to is final); use with_prediction('delta')"
            )
        if self.window_frames < self.latent_frames_per_chunk:
            raise ValueError(f"{self.id}: window_frames must hold at least one chunk")
        _, ph, pw = self.patch_size
        if self.latent_height % ph or self.latent_width % pw:
            raise ValueError(f"{self.id}: latent size must be a multiple of the patch size {self.patch_size}")

    def with_prediction(self, prediction: str) -> ModelConfig:
        """This config predicting `prediction`. "delta" drops the `noisy` KV mode: in its
        diagonal pipeline a chunk's first steps run before the previous chunk's last frame,
        the one its output is relative to, is final."""
        if prediction != "delta":
            return replace(self, prediction=prediction)
        modes = tuple(m for m in self.kv_modes if m != "noisy")
        default = self.default_kv_mode if self.default_kv_mode in modes else modes[0]
        return replace(self, prediction=prediction, kv_modes=modes, default_kv_mode=default)

    # --- geometry -------------------------------------------------------------------
    @property
    def accepted_action_range(self) -> tuple[float, float]:
        """The action values a request may hold (see `widened_action_range`)."""
        return widened_action_range(self.action_range)

    @property
    def pixel_space(self) -> bool:
        """True when the latents are the frames themselves (no autoencoder)."""
        return self.vae.get("kind") == "pixels"

    @property
    def anchored_pixels(self) -> bool:
        """Pixel latents after the first frame are differences from it (`models/pixels.py`)."""
        return self.pixel_space and bool(self.vae.get("anchored", False))

    @property
    def latent_space(self) -> str:
        """What a latent is: "vae", "pixels" or "pixels-anchored" (recorded in trained weights)."""
        if not self.pixel_space:
            return "vae"
        return "pixels-anchored" if self.anchored_pixels else "pixels"

    @property
    def spatial_ratio(self) -> int:
        if self.pixel_space:
            return 1
        return 2 ** (len(self.vae.get("dim_mult", (1, 2, 4, 4))) - 1)

    @property
    def temporal_ratio(self) -> int:
        if self.pixel_space:
            return 1
        return 2 ** sum(bool(x) for x in self.vae.get("temperal_downsample", (False, True, True)))

    @property
    def latent_channels(self) -> int:
        if self.pixel_space:
            return 3
        return int(self.vae.get("z_dim", 16))

    @property
    def latent_height(self) -> int:
        return self.height // self.spatial_ratio

    @property
    def latent_width(self) -> int:
        return self.width // self.spatial_ratio

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.dit.get("patch_size", (1, 2, 2)))  # type: ignore[return-value]

    @property
    def tokens_per_frame(self) -> int:
        _, ph, pw = self.patch_size
        return (self.latent_height // ph) * (self.latent_width // pw)

    @property
    def num_layers(self) -> int:
        return int(self.dit["num_layers"])

    @property
    def num_steps(self) -> int:
        return len(self.denoising_steps)

    @property
    def takes_prompt(self) -> bool:
        return self.text_encoder is not None

    @property
    def frames_per_chunk(self) -> int:
        """Video frames decoded from a steady-state chunk."""
        return self.latent_frames_per_chunk * self.temporal_ratio

    @property
    def first_chunk_frames(self) -> int:
        """Video frames in chunk 0 (the image, when given, is frame 0 and is not sent)."""
        if self.needs_image:
            return self.frames_per_chunk
        return 1 + self.temporal_ratio * (self.latent_frames_per_chunk - 1)

    @property
    def max_context_frames(self) -> int:
        return self.sink_frames + self.window_frames

    def describe(self) -> dict[str, Any]:
        """The `/v1/models` entry of docs/protocol.md."""
        return {
            "id": self.id,
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "latent_frames_per_chunk": self.latent_frames_per_chunk,
            "frames_per_chunk": self.frames_per_chunk,
            "first_chunk_frames": self.first_chunk_frames,
            "action_dim": self.action_dim,
            "action_range": list(self.action_range) if self.action_dim else None,
            "needs_image": self.needs_image,
            "takes_prompt": self.takes_prompt,
            "kv_modes": list(self.kv_modes),
            "default_kv_mode": self.default_kv_mode,
            "denoising_steps": self.num_steps,
            "description": self.description,
            "environment": self.environment,
        }


def widened_action_range(action_range: tuple[float, float]) -> tuple[float, float]:
    """(low, high) widened by twice its width on each side: (-1, 1) -> (-5, 5), (0, 512) -> (-1024, 1536).

    The margin admits a controller's overshoot and unit-normal test actions; far outside it
    the model's input embedding leaves what it was trained on (1e15 made the output non-finite).
    """
    low, high = action_range
    width = high - low
    return (low - 2 * width, high + 2 * width)
