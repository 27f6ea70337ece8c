"""The sequential reference generator: one stream, chunk by chunk, no engine.

This is the ground truth. The engine, whatever it batches, pipelines or cancels, must
produce the frames this loop produces for the same model, seed and inputs. Keep it plain.

Per chunk c (latent frames f0 .. f0+F-1, f0 = c*F, plus 1 when a first image was given):

    x = noise(seed, c, 0)
    for k in 0..S-1:
        if k > 0: x = (1 - sigma_k) * x0 + sigma_k * noise(seed, c, k)
        v = DiT(x, t_k, context = KV version read by step k)   # may write K/V (kv mode)
        x0 = x - sigma_k * v
    clean mode: DiT(x0, t = context_timestep) writes the chunk's clean K/V (commit pass),
        except for the last chunk, which no later chunk reads
    frames = causal VAE decode of x0 (per-stream decoder cache)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.actions import gather_latent_actions
from ..models.causal_wan import ChunkInput, CrossKV
from ..models.vae import DecoderState, image_from_uint8, to_uint8
from ..models.world_model import WorldModel, image_as_last_frame
from .kv_modes import (
    commit_kv_access,
    context_frame_indices,
    num_kv_versions,
    prefill_kv_access,
    retained_frame_indices,
    step_kv_access,
)
from .request import validate
from .stream import hold_actions


class ContiguousKVCache:
    """Plain per-stream K/V store for the reference: version -> frame -> block -> (k, v)."""

    def __init__(self, num_versions: int, num_blocks: int, tokens_per_frame: int, sink: int, window: int):
        self.versions: list[dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]]] = [
            {} for _ in range(num_versions)
        ]
        self.num_blocks = num_blocks
        self.tokens_per_frame = tokens_per_frame
        self.sink = sink
        self.window = window

    def view(self, first_frame: int, read: int, write: tuple[int, ...]) -> _ReferenceView:
        frames = context_frame_indices(first_frame, self.sink, self.window)
        present = [f for f in frames if f in self.versions[read]]
        if present != frames:
            raise RuntimeError(
                f"K/V of frames {sorted(set(frames) - set(present))} missing in version {read}"
            )
        return _ReferenceView(self, first_frame, frames, read, write)

    def evict(self, next_first_frame: int) -> None:
        keep = retained_frame_indices(next_first_frame, self.sink, self.window)
        for version in self.versions:
            for frame in [f for f in version if f not in keep]:
                del version[frame]

    def nbytes(self) -> int:
        total = 0
        for version in self.versions:
            for blocks in version.values():
                total += sum(k.nbytes + v.nbytes for kv in blocks if kv is not None for k, v in [kv])
        return total

    def num_frames(self) -> int:
        return sum(len(v) for v in self.versions)


@dataclass
class _ReferenceView:
    cache: ContiguousKVCache
    first_frame: int
    frames: list[int]
    read: int
    write: tuple[int, ...]

    @property
    def context_frames(self) -> int:
        return len(self.frames)

    @property
    def sink_frames(self) -> int:
        return min(self.cache.sink, self.first_frame)

    def context(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.frames:
            return None
        kvs = [self.cache.versions[self.read][f][block] for f in self.frames]
        return torch.cat([k for k, _ in kvs]), torch.cat([v for _, v in kvs])

    def store(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        p = self.cache.tokens_per_frame
        for version in self.write:
            frames = self.cache.versions[version]
            for i in range(key.shape[0] // p):
                slot = frames.setdefault(self.first_frame + i, [None] * self.cache.num_blocks)
                slot[block] = (key[i * p : (i + 1) * p].clone(), value[i * p : (i + 1) * p].clone())


@dataclass
class GenerationRequest:
    seed: int
    num_chunks: int
    prompt: str = ""
    # chunk index -> prompt used from that chunk on (the protocol's `prompt` message).
    prompt_changes: dict[int, str] = field(default_factory=dict)
    # chunk index -> seed of that chunk's noise from there on (a fork's branch).
    seed_changes: dict[int, int] = field(default_factory=dict)
    image: np.ndarray | None = None  # [H, W, 3] uint8, frame 0 of image-to-world models
    actions: np.ndarray | None = None  # [N, action_dim] float32, one row per video frame
    kv_mode: str | None = None
    # Teacher forcing (evaluation): the true latents of the generated frames [C, T_latent, h, w].
    # In `clean` mode each chunk's K/V is then committed from these instead of the chunk's
    # prediction, so every chunk is predicted one chunk ahead of the true past.
    context_latents: torch.Tensor | None = None
    # The stream goes on after `num_chunks`, as a live stream of unknown length does: its
    # last chunk commits its K/V too (a like-for-like baseline for an open-ended stream).
    open_ended: bool = False


@dataclass
class GenerationResult:
    latents: torch.Tensor  # [C, T_latent, h, w] float32, generated frames only
    frames: np.ndarray  # [T, H, W, 3] uint8, generated frames only
    chunk_frames: list[int]  # video frames per chunk
    kv_bytes: list[int] = field(default_factory=list)  # K/V bytes held after each chunk
    decoder_bytes: list[int] = field(default_factory=list)  # causal decoder cache bytes after each chunk


def _context_latents(
    model: WorldModel, req: GenerationRequest, kv_mode: str, frames: int
) -> torch.Tensor | None:
    """The request's teacher-forcing latents on the model's device, checked."""
    if req.context_latents is None:
        return None
    if kv_mode != "clean":
        raise ValueError(f"teacher forcing commits clean K/V: it needs kv_mode 'clean', not {kv_mode!r}")
    expected = tuple(model.latent_shape(frames))
    if tuple(req.context_latents.shape) != expected:
        raise ValueError(
            f"context_latents must have shape {expected}, got {tuple(req.context_latents.shape)}"
        )
    return req.context_latents.to(model.device, torch.float32)


class ReferenceGenerator:
    def __init__(self, model: WorldModel) -> None:
        self.model = model

    @torch.inference_mode()
    def generate(self, req: GenerationRequest) -> GenerationResult:
        model, cfg = self.model, self.model.config
        kv_mode = validate(
            cfg, num_chunks=req.num_chunks, image=req.image, actions=req.actions, kv_mode=req.kv_mode
        )
        steps = model.schedule.num_steps
        fpc = cfg.latent_frames_per_chunk
        offset = 1 if cfg.needs_image else 0
        total_latent = offset + req.num_chunks * fpc
        truth = _context_latents(model, req, kv_mode, req.num_chunks * fpc)
        num_video = 1 + cfg.temporal_ratio * (total_latent - 1)
        actions = None
        if cfg.action_dim:
            actions = torch.from_numpy(hold_actions(req.actions, num_video, cfg.action_dim))

        cache = ContiguousKVCache(
            num_kv_versions(kv_mode, steps),
            cfg.num_layers,
            cfg.tokens_per_frame,
            cfg.sink_frames,
            cfg.window_frames,
        )
        decoder = model.vae.new_decoder_state()
        text = model.text_context(req.prompt)

        last = None  # the latent frame before the next chunk ("delta" predictions add it)
        if req.image is not None:
            last = image_as_last_frame(
                cfg, self._prefill_image(req.image, text, cache, decoder, kv_mode, actions)
            )

        latents, frames, chunk_frames, kv_bytes, decoder_bytes = [], [], [], [], []
        seed = req.seed
        for c in range(req.num_chunks):
            if c in req.prompt_changes:
                text = model.text_context(req.prompt_changes[c])
            seed = req.seed_changes.get(c, seed)
            first = offset + c * fpc
            true = None if truth is None else truth[:, c * fpc : (c + 1) * fpc]
            read_later = req.open_ended or c < req.num_chunks - 1  # else the last K/V is never read
            x0 = self.denoise_chunk(seed, c, first, text, cache, kv_mode, actions, true, last, read_later)
            last = (x0 if true is None else true)[:, -1:]
            cache.evict(first + fpc)
            video = self._decode(x0, decoder)
            latents.append(x0.cpu())
            frames.append(video)
            chunk_frames.append(video.shape[0])
            kv_bytes.append(cache.nbytes())
            decoder_bytes.append(decoder.nbytes())
        return GenerationResult(
            torch.cat(latents, dim=1), np.concatenate(frames), chunk_frames, kv_bytes, decoder_bytes
        )

    def denoise_chunk(
        self,
        seed: int,
        chunk: int,
        first_frame: int,
        text: CrossKV,
        cache: ContiguousKVCache,
        kv_mode: str,
        actions: torch.Tensor | None,
        context: torch.Tensor | None = None,
        last: torch.Tensor | None = None,
        read_later: bool = True,
    ) -> torch.Tensor:
        """Clean latents x0 [C, F, h, w] of one chunk; writes its K/V as the mode says (a
        `clean` commit from `context` instead of x0 where given: teacher forcing), except
        the commit of a chunk that no later chunk reads (`read_later` False). `last` is the
        latent frame before the chunk, which a "delta" output is relative to."""
        model, cfg = self.model, self.model.config
        sched = model.schedule
        fpc = cfg.latent_frames_per_chunk
        shape = model.latent_shape(fpc)
        latent_actions = None
        if actions is not None:
            latent_actions = gather_latent_actions(actions, first_frame, fpc, cfg.temporal_ratio).to(
                model.device
            )

        def forward(x: torch.Tensor, t: float, access: tuple[int, tuple[int, ...]]) -> torch.Tensor:
            view = cache.view(first_frame, *access)
            timesteps = torch.full((fpc,), t, device=model.device)
            unit = ChunkInput(x, timesteps, text, view, latent_actions)
            return model.dit.forward_chunk([unit])[0]

        x0 = None
        for k in range(sched.num_steps):
            x = sched.step_input(seed, chunk, k, x0, shape, model.device)
            flow = forward(x, sched.timesteps[k], step_kv_access(kv_mode, k, sched.num_steps))
            x0 = sched.x0_from_flow(x, flow, k, last)
        commit = commit_kv_access(kv_mode)
        if commit is not None and read_later:
            forward(x0 if context is None else context, cfg.context_timestep, commit)
        return x0

    def _prefill_image(
        self,
        image: np.ndarray,
        text: CrossKV,
        cache: ContiguousKVCache,
        decoder: DecoderState,
        kv_mode: str,
        actions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Encode the first frame, write its clean K/V (latent frame 0), warm the decoder;
        returns the frame's latent [C, 1, h, w]."""
        model, cfg = self.model, self.model.config
        vae = model.vae
        pixels = image_from_uint8(image).to(model.device, model.dtype)
        z0 = vae.encode_image(pixels)[0].float()  # [C, 1, h, w]
        latent_actions = None
        if actions is not None:
            latent_actions = gather_latent_actions(actions, 0, 1, cfg.temporal_ratio).to(model.device)
        view = cache.view(0, *prefill_kv_access(kv_mode, model.schedule.num_steps))
        timesteps = torch.full((1,), cfg.context_timestep, device=model.device)
        model.dit.forward_chunk([ChunkInput(z0, timesteps, text, view, latent_actions)])
        vae.decode_chunk(z0.unsqueeze(0).to(model.dtype), decoder)
        return z0

    def _decode(self, x0: torch.Tensor, decoder: DecoderState) -> np.ndarray:
        video = self.model.vae.decode_chunk(x0.unsqueeze(0).to(self.model.dtype), decoder)
        return to_uint8(video)[0]
