"""Pixel space as a latent space: the codec for models that denoise frames directly.

Small world models (the embedded `pusht` model) skip the autoencoder: their "latents" are the
video frames themselves, in [-1, 1], one latent frame per video frame, and the DiT's patch
embedding does the spatial compression. `PixelCodec` gives them the interface of
`StreamingVAE` (decoder state, batched decoding, image encoding), so the engine, the reference
loop and the server treat them like any other model; decoding is a clamp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .vae import DecoderState


class PixelCodec(torch.nn.Module):
    """The identity latent space: latents [B, 3, F, H, W] are frames in [-1, 1]."""

    latent_channels = 3
    temporal_ratio = 1
    spatial_ratio = 1

    def __init__(self) -> None:
        super().__init__()
        # Carries the device and dtype that `.to()` gives the codec.
        self.register_buffer("_anchor", torch.zeros(()), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor.dtype

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    def new_decoder_state(self) -> DecoderState:
        # Decoding has no memory, so every state has the same signature and batches freely.
        return DecoderState.empty(0)

    @torch.inference_mode()
    def decode_chunk(self, latents: Tensor, state: DecoderState) -> Tensor:
        """[B, 3, F, H, W] latents -> the same frames clamped to [-1, 1], in the codec's dtype."""
        if latents.ndim != 5 or latents.shape[1] != 3:
            raise ValueError(f"expected latents [B, 3, F, H, W], got {tuple(latents.shape)}")
        if latents.shape[2] == 0:
            raise ValueError("decode_chunk needs at least one latent frame")
        state.latent_frames += latents.shape[2]
        return latents.to(device=self.device, dtype=self.dtype).clamp(-1.0, 1.0)

    @torch.inference_mode()
    def decode_chunks(self, latents: list[Tensor], states: list[DecoderState]) -> list[Tensor]:
        if len(latents) != len(states) or not latents:
            raise ValueError("decode_chunks needs one state per latent chunk")
        return [self.decode_chunk(x, s) for x, s in zip(latents, states, strict=True)]

    def decode_full(self, latents: Tensor) -> Tensor:
        return self.decode_chunk(latents, self.new_decoder_state())

    @torch.inference_mode()
    def encode_image(self, image: Tensor) -> Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> latents [B, 3, 1, H, W]."""
        if image.ndim != 4 or image.shape[1] != 3:
            raise ValueError(f"expected an image batch [B, 3, H, W], got {tuple(image.shape)}")
        return image.to(device=self.device, dtype=self.dtype).unsqueeze(2)
