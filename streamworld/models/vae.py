"""The Wan VAE with a per-stream causal decoder cache.

`StreamingVAE` wraps diffusers' `AutoencoderKLWan`. Its causal decoder turns one latent frame
at a time into video frames, carrying the last frames of every causal convolution's input in
a feature cache. Diffusers keeps that cache on the model; here each stream owns it in a
`DecoderState`, so many streams can decode chunk by chunk, interleaved, from one shared model,
and chunk-by-chunk decoding gives the same frames as decoding the whole clip at once.

Latents outside this module are normalised per channel as Wan does:
`z = (mu - latents_mean) / latents_std`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify
from torch import Tensor

from streamworld.models.config import ModelConfig
from streamworld.models.lite_decoder import LiteDecoder


@dataclass
class DecoderState:
    """One stream's causal decoder cache.

    `feat_cache` has one slot per causal convolution of the decoder; a slot holds the last
    input frames of that convolution ([B, C, <=2, h, w]), diffusers' "Rep" marker, or None
    before the first frame. With a lite decoder a slot is a memory block's input at the last
    frame ([B, C, h, w]) or None before the first. The cached tensors are tied to the batch
    size, device and dtype of the first chunk.
    """

    feat_cache: list[Tensor | str | None]
    latent_frames: int = 0

    @classmethod
    def empty(cls, num_slots: int) -> DecoderState:
        return cls(feat_cache=[None] * num_slots)

    @property
    def started(self) -> bool:
        return self.latent_frames > 0

    def nbytes(self) -> int:
        """Bytes held by the cached feature tensors."""
        return sum(t.numel() * t.element_size() for t in self.feat_cache if isinstance(t, Tensor))

    def fork(self) -> DecoderState:
        """A state that continues from here independently. Decoding replaces slots and never
        writes into a cached tensor, so the two share the tensors they hold now."""
        return DecoderState(list(self.feat_cache), self.latent_frames)

    def reset(self) -> None:
        """Forget everything: the next latent frame decodes as the first of a new stream."""
        self.feat_cache = [None] * len(self.feat_cache)
        self.latent_frames = 0

    def signature(self) -> tuple:
        """States with equal signatures can be decoded together in one batch."""
        slots = tuple(tuple(t.shape[1:]) if isinstance(t, Tensor) else t for t in self.feat_cache)
        return (self.started, *slots)


class StreamingVAE(torch.nn.Module):
    """`AutoencoderKLWan` with normalised latents and per-stream decoder state.

    With a `LiteDecoder` (`use_lite_decoder`), chunks decode through it instead of the Wan
    decoder; the Wan encoder still encodes first frames.
    """

    def __init__(self, vae: AutoencoderKLWan) -> None:
        super().__init__()
        self.vae = vae
        self.vae.eval().requires_grad_(False)
        self.lite: LiteDecoder | None = None
        cfg = vae.config
        z_dim = int(cfg.z_dim)
        if len(cfg.latents_mean) != z_dim or len(cfg.latents_std) != z_dim:
            raise ValueError(
                f"latents_mean and latents_std need z_dim={z_dim} entries, got "
                f"{len(cfg.latents_mean)} and {len(cfg.latents_std)}"
            )
        # [1, C, 1, 1, 1] so they broadcast over [B, C, F, h, w].
        self.register_buffer(
            "latents_mean",
            torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1),
            persistent=False,
        )
        self.register_buffer(
            "latents_std",
            torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1),
            persistent=False,
        )
        self._num_decoder_slots = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        # diffusers' encode keeps its causal cache on the model; one encode at a time.
        self._encode_lock = threading.Lock()

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, vae_kwargs: Mapping[str, Any], *, seed: int) -> StreamingVAE:
        """A randomly initialised VAE; the global RNG is left untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            vae = AutoencoderKLWan(**vae_kwargs)
        return cls(vae)

    @classmethod
    def from_config(cls, config: ModelConfig, *, seed: int) -> StreamingVAE:
        return cls.from_kwargs(config.vae, seed=seed)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> StreamingVAE:
        """Load a diffusers `AutoencoderKLWan` folder, or the `vae/` folder of a pipeline folder."""
        folder = _find_vae_folder(Path(path))
        vae = AutoencoderKLWan.from_pretrained(folder, local_files_only=True, torch_dtype=dtype)
        return cls(vae).to(device)

    def use_lite_decoder(self, decoder: LiteDecoder) -> StreamingVAE:
        """Decode with `decoder` from now on (streams started before keep incompatible state:
        call this before serving)."""
        c = decoder.config
        if (c.latent_channels, c.spatial_ratio, c.temporal_ratio) != (
            self.latent_channels,
            self.spatial_ratio,
            self.temporal_ratio,
        ):
            raise ValueError(
                f"the lite decoder takes {c.latent_channels}-channel latents at {c.spatial_ratio}x "
                f"spatial and {c.temporal_ratio}x temporal ratio; this VAE has {self.latent_channels}, "
                f"{self.spatial_ratio}x and {self.temporal_ratio}x"
            )
        self.lite = decoder.to(self.device, self.dtype).eval().requires_grad_(False)
        return self

    @property
    def decoder_kind(self) -> str:
        """ "lite" when chunks decode through a `LiteDecoder`, else "wan"."""
        return "wan" if self.lite is None else "lite"

    # --- geometry -------------------------------------------------------------------
    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.z_dim)

    @property
    def temporal_ratio(self) -> int:
        return 2 ** sum(bool(x) for x in self.vae.config.temperal_downsample)

    @property
    def spatial_ratio(self) -> int:
        return 2 ** (len(self.vae.config.dim_mult) - 1) * (self.vae.config.patch_size or 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    @property
    def device(self) -> torch.device:
        return self.vae.device

    # --- latent normalisation -------------------------------------------------------
    def normalise(self, mu: Tensor) -> Tensor:
        return (mu - self.latents_mean.to(mu)) / self.latents_std.to(mu)

    def unnormalise(self, z: Tensor) -> Tensor:
        return z * self.latents_std.to(z) + self.latents_mean.to(z)

    # --- decoding -------------------------------------------------------------------
    def new_decoder_state(self) -> DecoderState:
        return DecoderState.empty(self._num_decoder_slots if self.lite is None else self.lite.num_slots)

    @torch.inference_mode()
    def decode_chunk(self, latents: Tensor, state: DecoderState) -> Tensor:
        """Decode the next latent frames of a stream.

        latents: [B, C, F, h, w] normalised. Returns [B, 3, T, H, W] in [-1, 1] in the VAE's
        dtype, with T = 1 + r(F - 1) for the stream's first chunk and T = rF afterwards
        (r = temporal_ratio). Only `state` is updated; the shared model is not.
        """
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"expected latents [B, {self.latent_channels}, F, h, w], got {tuple(latents.shape)}"
            )
        if latents.shape[2] == 0:
            raise ValueError("decode_chunk needs at least one latent frame")
        if self.lite is not None:
            out = self.lite(latents.to(self.device, self.dtype), state.feat_cache, not state.started)
            state.latent_frames += latents.shape[2]
            return out
        z = self.unnormalise(latents.to(device=self.device, dtype=self.dtype))
        # post_quant_conv has a 1x1x1 kernel, so it needs no temporal cache.
        x = self.vae.post_quant_conv(z)
        frames = []
        for i in range(x.shape[2]):
            frames.append(
                self.vae.decoder(
                    x[:, :, i : i + 1],
                    feat_cache=state.feat_cache,
                    feat_idx=[0],
                    first_chunk=not state.started,
                )
            )
            state.latent_frames += 1
        out = torch.cat(frames, dim=2)
        if self.vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        return out.clamp(-1.0, 1.0)

    @torch.inference_mode()
    def decode_chunks(self, latents: list[Tensor], states: list[DecoderState]) -> list[Tensor]:
        """Decode the next chunk of several streams in one batch.

        latents: one [1, C, F, h, w] per stream, all the same shape; states must have equal
        `signature()`s (same position in their streams' frame structure). Each state is
        updated as `decode_chunk` would; the results equal per-stream decoding up to rounding.
        """
        if len(latents) != len(states) or not latents:
            raise ValueError("decode_chunks needs one state per latent chunk")
        if len(latents) == 1:
            return [self.decode_chunk(latents[0], states[0])]
        if len({s.signature() for s in states}) != 1:
            raise ValueError("decoder states at different positions cannot be batched")
        sizes = [x.shape[0] for x in latents]
        batch = DecoderState(
            [
                torch.cat(slot) if isinstance(slot[0], Tensor) else slot[0]
                for slot in zip(*(s.feat_cache for s in states), strict=True)
            ],
            states[0].latent_frames,
        )
        out = self.decode_chunk(torch.cat(latents), batch)
        offsets = np.cumsum([0, *sizes])
        for i, state in enumerate(states):
            state.feat_cache = [
                slot[offsets[i] : offsets[i + 1]].clone() if isinstance(slot, Tensor) else slot
                for slot in batch.feat_cache
            ]
            state.latent_frames = batch.latent_frames
        return [out[offsets[i] : offsets[i + 1]] for i in range(len(states))]

    def decode_full(self, latents: Tensor) -> Tensor:
        """Decode a whole clip [B, C, F, h, w] from the start of a stream: [B, 3, 1 + r(F-1), H, W]."""
        return self.decode_chunk(latents, self.new_decoder_state())

    # --- encoding -------------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, image: Tensor) -> Tensor:
        """Encode images [B, 3, H, W] in [-1, 1] to normalised latents [B, C, 1, h, w] (posterior mean)."""
        if image.ndim != 4 or image.shape[1] != 3:
            raise ValueError(f"expected an image batch [B, 3, H, W], got {tuple(image.shape)}")
        x = image.to(device=self.device, dtype=self.dtype).unsqueeze(2)
        with self._encode_lock:
            mu = self.vae.encode(x).latent_dist.mode()
        return self.normalise(mu)


def to_uint8(frames: Tensor) -> np.ndarray:
    """[B, 3, T, H, W] in [-1, 1] -> uint8 array [B, T, H, W, 3]."""
    return uint8_frames(frames).cpu().numpy()


def uint8_frames(frames: Tensor) -> Tensor:
    """`to_uint8` without the copy to the host: a uint8 tensor [B, T, H, W, 3] where the
    frames are."""
    x = ((frames.detach().float() + 1.0) / 2.0 * 255.0).round().clamp(0, 255).to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).contiguous()


def image_from_uint8(image: np.ndarray) -> Tensor:
    """uint8 array [H, W, 3] -> float32 tensor [1, 3, H, W] in [-1, 1]."""
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an RGB image [H, W, 3], got shape {image.shape}")
    x = torch.from_numpy(np.ascontiguousarray(image)).to(torch.float32)
    return (x / 255.0 * 2.0 - 1.0).permute(2, 0, 1).unsqueeze(0).contiguous()


def _find_vae_folder(path: Path) -> Path:
    if path.is_file() and path.suffix in (".pth", ".pt", ".ckpt"):
        raise NotImplementedError(_convert_hint(path))
    if not path.exists():
        raise FileNotFoundError(f"VAE path {path} does not exist")
    if (path / "vae" / "config.json").is_file():
        return path / "vae"
    # Original Wan folders hold Wan2.1_VAE.pth next to the DiT's config.json.
    originals = sorted(path.glob("*VAE*.pth"))
    if originals:
        raise NotImplementedError(_convert_hint(originals[0]))
    if (path / "config.json").is_file():
        class_name = json.loads((path / "config.json").read_text()).get("_class_name", "AutoencoderKLWan")
        if class_name != "AutoencoderKLWan":
            raise ValueError(f"{path / 'config.json'} describes a {class_name}, not an AutoencoderKLWan")
        return path
    raise FileNotFoundError(
        f"no diffusers AutoencoderKLWan under {path}: expected {path / 'vae' / 'config.json'} "
        f"or {path / 'config.json'} with its weights"
    )


def _convert_hint(path: Path) -> str:
    return (
        f"{path} is an original Wan VAE checkpoint; StreamWorld loads the diffusers layout only. "
        "Convert it first with diffusers' scripts/convert_wan_to_diffusers.py and pass the output folder."
    )
