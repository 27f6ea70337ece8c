"""Pixel space as a latent space: the codec for models that denoise frames directly.

Small world models (the embedded `pusht` model) skip the autoencoder: their "latents" are the
video frames themselves, in [-1, 1], one latent frame per video frame, and the DiT's patch
embedding does the spatial compression. `PixelCodec` gives them the interface of
`StreamingVAE` (decoder state, batched decoding, image encoding), so the engine, the reference
loop and the server treat them like any other model.

With `anchored=True` (config `vae={"kind": "pixels", "anchored": True}`) a stream's first
latent frame is its first frame, and every later latent frame is the difference from that
first frame (the anchor), in [-2, 2]. What does not move is then exactly zero, so the model
spends its capacity on what changes; the copy-the-first-frame predictor is the all-zero
output. The anchor is the decoder's per-stream state, exactly as a causal VAE decoder keeps
its cache: the first latent frame a stream decodes (the encoded first image) sets it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .vae import DecoderState


def frames_from_uint8(video: Tensor) -> Tensor:
    """uint8 videos [B, T, H, W, 3] -> float32 frames [B, 3, T, H, W] in [-1, 1]."""
    return video.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def frames_to_latents(frames: Tensor, anchored: bool) -> Tensor:
    """Frames [B, 3, T, H, W] in [-1, 1] that start a stream -> their latents (training)."""
    if not anchored:
        return frames
    return torch.cat([frames[:, :, :1], frames[:, :, 1:] - frames[:, :, :1]], 2)


class PixelCodec(torch.nn.Module):
    """Pixel latents [B, 3, F, H, W]: the frames in [-1, 1], or differences from the anchor."""

    latent_channels = 3
    temporal_ratio = 1
    spatial_ratio = 1

    def __init__(self, anchored: bool = False) -> None:
        super().__init__()
        self.anchored = anchored
        # Carries the device and dtype that `.to()` gives the codec.
        self.register_buffer("_probe", torch.zeros(()), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self._probe.dtype

    @property
    def device(self) -> torch.device:
        return self._probe.device

    def new_decoder_state(self) -> DecoderState:
        # Plain pixels have no memory. Anchored pixels keep one slot, the anchor frame; states at
        # the same point (started or not) have equal signatures and batch freely.
        return DecoderState.empty(1 if self.anchored else 0)

    @torch.inference_mode()
    def decode_chunk(self, latents: Tensor, state: DecoderState) -> Tensor:
        """[B, 3, F, H, W] latents -> frames in [-1, 1], in the codec's dtype."""
        if latents.ndim != 5 or latents.shape[1] != 3:
            raise ValueError(f"expected latents [B, 3, F, H, W], got {tuple(latents.shape)}")
        if latents.shape[2] == 0:
            raise ValueError("decode_chunk needs at least one latent frame")
        x = latents.to(device=self.device, dtype=self.dtype)
        if self.anchored:
            if not state.started:
                anchor = x[:, :, :1].clone()
                state.feat_cache[0] = anchor
                x = torch.cat([anchor, x[:, :, 1:] + anchor], 2)
            else:
                anchor = state.feat_cache[0]
                if not isinstance(anchor, Tensor) or anchor.shape[0] != x.shape[0]:
                    raise ValueError("decoder state holds no anchor for this batch size")
                x = x + anchor
        state.latent_frames += latents.shape[2]
        return x.clamp(-1.0, 1.0)

    @torch.inference_mode()
    def decode_chunks(self, latents: list[Tensor], states: list[DecoderState]) -> list[Tensor]:
        if len(latents) != len(states) or not latents:
            raise ValueError("decode_chunks needs one state per latent chunk")
        return [self.decode_chunk(x, s) for x, s in zip(latents, states, strict=True)]

    def decode_full(self, latents: Tensor) -> Tensor:
        return self.decode_chunk(latents, self.new_decoder_state())

    @torch.inference_mode()
    def encode_image(self, image: Tensor) -> Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> latents [B, 3, 1, H, W] (a first frame is itself)."""
        if image.ndim != 4 or image.shape[1] != 3:
            raise ValueError(f"expected an image batch [B, 3, H, W], got {tuple(image.shape)}")
        return image.to(device=self.device, dtype=self.dtype).unsqueeze(2)
