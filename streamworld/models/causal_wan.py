"""Causal (block-causal, chunk-wise) Wan DiT on diffusers' `WanTransformer3DModel`.

The weights and modules are diffusers' own (`self.transformer` is a `WanTransformer3DModel`),
so every checkpoint in diffusers layout loads as is. What this file adds is the forward:

- a chunk forward split into `embed` -> `run_blocks(start, stop)` -> `head`, so that any
  contiguous range of blocks (a stage) runs on its own, on a batch of chunks ("units") that
  may differ in timestep, context length and frame position;
- self-attention over the unit's own tokens plus the K/V context read through a `KVView`
  (see `streamworld.models.kv`), writing the unit's own K/V back through it;
- per-frame timesteps (one adaptive layer-norm modulation per latent frame);
- cross-attention K/V computed once per prompt (`prepare_text`) and reused;
- optional action conditioning (`streamworld.models.actions`);
- `forward_sequence`: a whole clip in one forward with a block-causal mask, the definition
  the cached forward must equal (and the training forward).

Shapes: B units, F latent frames per unit, P tokens per frame, N = F * P tokens, D model
width, H heads of size d.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from torch import nn

from . import compiling
from .actions import ActionAdapter
from .kv import KVView
from .transfer import to_device

SelfAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class CrossKV:
    """Cross-attention keys and values of one prompt, per block: [L, H, d] each."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class ChunkInput:
    """One unit of work as the model sees it."""

    latents: torch.Tensor  # [C, F, h, w] noisy latents
    timesteps: torch.Tensor  # [F] timestep per latent frame (0..1000 scale), host or device
    text: CrossKV
    kv: KVView
    latent_actions: torch.Tensor | None = None  # [F, r * action_dim], host or device


@dataclass
class StageActivation:
    """What flows between stages: the tokens and the per-frame conditioning."""

    hidden: torch.Tensor  # [B, N, D]
    modulation: torch.Tensor  # [B, F, 6, D] float32, block adaLN input
    temb: torch.Tensor  # [B, F, D], head adaLN input
    num_frames: int


@dataclass
class BlockPlan:
    """A batch's self-attention bookkeeping for `CausalWanDiT.run_planned`."""

    units: list[ChunkInput]
    ctx_frames: list[int]  # context frames per unit
    q_turn: torch.Tensor  # the queries' (and own keys') rotation, `_Elementwise.turn`
    sink_moves: list[tuple[int, tuple[torch.Tensor, torch.Tensor]] | None]  # per unit
    batch: Any = None  # the units' batched K/V reader and writer (`KVView.plan`), or None
    batch_move: tuple[int, torch.Tensor, torch.Tensor] | None = None  # sink tokens, cos, sin [B, 1, 1, d]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved RoPE: channel pairs (2i, 2i+1) rotate by the angle in cos/sin[2i]."""
    return _rotate_by(x, _turn(cos, sin))


def _turn(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation as complex numbers [..., d / 2] (one per channel pair)."""
    return torch.complex(cos[..., 0::2].float(), sin[..., 0::2].float())


def _rotate_by(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Channel pairs as complex numbers times `turn`: one multiplication kernel instead of
    the half a dozen of the real-valued form, with the same result."""
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).type_as(x)


# --- the block's elementwise arithmetic ------------------------------------------------------
# Written as plain functions of tensors so that `CausalWanDiT.compile_elementwise` can fuse
# each one into a kernel or two with torch.compile; eagerly each is a chain of float32
# kernels (casts, norm, multiply, add), which at real sizes cost a third of the DiT's GPU time.


def _modulated_norm(x: torch.Tensor, mods: torch.Tensor, i: int, eps: float) -> torch.Tensor:
    """Wan's adaLN: layer norm (float32, no affine), then per frame shift mods[:, :, i] and
    scale mods[:, :, i + 1]. x [B, N, D]; mods [B, F, 6, D] float32. Returns x's dtype."""
    b, n, d = x.shape
    f = mods.shape[1]
    h = F.layer_norm(x.float(), (d,), eps=eps).view(b, f, n // f, d)
    return (h * (1 + mods[:, :, i + 1, None]) + mods[:, :, i, None]).view(b, n, d).type_as(x)


def _gated_residual(x: torch.Tensor, y: torch.Tensor, mods: torch.Tensor, i: int) -> torch.Tensor:
    """x + y * mods[:, :, i] in float32, per frame; x, y [B, N, D], mods [B, F, 6, D]."""
    b, n, d = x.shape
    grid = (b, mods.shape[1], n // mods.shape[1], d)
    return (x.float().view(grid) + y.float().view(grid) * mods[:, :, i, None]).view(b, n, d).type_as(x)


# One function per use, so that torch.compile specialises each on its own (the index is a
# constant inside) and no function needs more than the four shape variants warmed up.
def _attention_norm(x: torch.Tensor, mods: torch.Tensor, eps: float) -> torch.Tensor:
    return _modulated_norm(x, mods, 0, eps)


def _ffn_norm(x: torch.Tensor, mods: torch.Tensor, eps: float) -> torch.Tensor:
    return _modulated_norm(x, mods, 3, eps)


def _attention_residual(x: torch.Tensor, y: torch.Tensor, mods: torch.Tensor) -> torch.Tensor:
    return _gated_residual(x, y, mods, 2)


def _ffn_residual(x: torch.Tensor, y: torch.Tensor, mods: torch.Tensor) -> torch.Tensor:
    return _gated_residual(x, y, mods, 5)


def _affine_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Layer norm with weight and bias in float32, returned in x's dtype."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).type_as(x)


def _rotate_real(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """`_rotate_by` in real arithmetic (turn [..., d / 2, 2] = cos, sin), which torch.compile
    fuses into one kernel."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = turn[..., 0], turn[..., 1]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).type_as(x)


def _rotate_traced(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`_rotate` for a whole forward traced by torch.compile (the training forward): real
    arithmetic, since Inductor generates no code for complex numbers."""
    return _rotate_real(x, torch.stack([cos[..., 0::2].float(), sin[..., 0::2].float()], dim=-1))


@dataclass(frozen=True)
class _Elementwise:
    attention_norm: Callable[..., torch.Tensor] = _attention_norm
    attention_residual: Callable[..., torch.Tensor] = _attention_residual
    ffn_norm: Callable[..., torch.Tensor] = _ffn_norm
    ffn_residual: Callable[..., torch.Tensor] = _ffn_residual
    affine_norm: Callable[..., torch.Tensor] = _affine_norm
    rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _rotate_by
    compiled: bool = False

    def turn(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """What `rotate` multiplies by: complex numbers eagerly, (cos, sin) pairs compiled."""
        if not self.compiled:
            return _turn(cos, sin)
        return torch.stack([cos[..., 0::2].float(), sin[..., 0::2].float()], dim=-1)


_EAGER = _Elementwise()
_COMPILED: _Elementwise | None = None


def _compiled_elementwise() -> _Elementwise:
    """The elementwise functions through torch.compile, compiled lazily, once per process,
    with only the batch dimension dynamic (`streamworld.models.compiling`). A model then
    needs four variants per function (one unit or a batch; one-frame or full chunks),
    compiled by `compile_elementwise`.
    """
    global _COMPILED
    if _COMPILED is None:

        def fuse(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            return compiling.BatchCompiled(fn, min_ndim=3)  # [B, ...]: not the weights

        _COMPILED = _Elementwise(
            fuse(_attention_norm),
            fuse(_attention_residual),
            fuse(_ffn_norm),
            fuse(_ffn_residual),
            fuse(_affine_norm),
            fuse(_rotate_real),
            compiled=True,
        )
    return _COMPILED


class CausalWanDiT(nn.Module):
    def __init__(
        self,
        dit_config: dict,
        *,
        action_dim: int = 0,
        action_range: tuple[float, float] = (-1.0, 1.0),
        spatial_actions: bool = False,
        temporal_ratio: int = 4,
        latent_height: int,
        latent_width: int,
    ) -> None:
        super().__init__()
        if dit_config.get("image_dim") or dit_config.get("added_kv_proj_dim"):
            raise NotImplementedError("Wan I2V image cross-attention (image_dim) is not supported")
        self.transformer = WanTransformer3DModel(**dit_config)
        cfg = self.transformer.config
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.attention_head_dim
        self.dim = self.heads * self.head_dim
        self.patch_size = tuple(cfg.patch_size)
        self.num_layers = cfg.num_layers
        self.latent_height = latent_height
        self.latent_width = latent_width
        _, ph, pw = self.patch_size
        self.grid = (latent_height // ph, latent_width // pw)
        self.tokens_per_frame = self.grid[0] * self.grid[1]
        self.action_adapter = (
            ActionAdapter(
                action_dim, temporal_ratio, self.dim, action_range, self.grid if spatial_actions else None
            )
            if action_dim
            else None
        )
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ops = _EAGER

    # --- placement ----------------------------------------------------------------------
    def place(self, stages: Sequence[tuple[int, int, torch.device | str]]) -> CausalWanDiT:
        """Puts blocks [start, stop) of each stage on its device: the embeddings (patches,
        timesteps, text, actions) with the first stage, the output norm and projection with
        the last. Stages must cover every block once, in order. The prompt's cross-attention
        K/V then live with their blocks (`prepare_text`), and each stage's rotary tables on
        its own device."""
        ranges = [(a, b, torch.device(d)) for a, b, d in stages]
        if not ranges or ranges[0][0] != 0 or ranges[-1][1] != self.num_layers:
            raise ValueError(
                f"stages {[(a, b) for a, b, _ in ranges]} must cover blocks 0-{self.num_layers - 1}"
            )
        for (_, stop, _), (start, _, _) in itertools.pairwise(ranges):
            if start != stop:
                raise ValueError(f"stages must be contiguous: one ends at {stop}, the next starts at {start}")
        tr = self.transformer
        first, last = ranges[0][2], ranges[-1][2]
        for start, stop, device in ranges:
            for block in tr.blocks[start:stop]:
                block.to(device)
        tr.patch_embedding.to(first)
        tr.condition_embedder.to(first)
        tr.rope.to(first)
        if self.action_adapter is not None:
            self.action_adapter.to(first)
        tr.norm_out.to(last)
        tr.proj_out.to(last)
        tr.scale_shift_table.data = tr.scale_shift_table.data.to(last)
        return self

    @property
    def block_devices(self) -> list[torch.device]:
        """The device of each block."""
        return [block.attn1.to_q.weight.device for block in self.transformer.blocks]

    def compile_elementwise(self, frames_per_chunk: int) -> CausalWanDiT:
        """Fuse the blocks' elementwise arithmetic (adaLN, gated residuals, RoPE) with
        torch.compile, and compile it now, for the model's device and dtype: single units
        and batches, one-frame and `frames_per_chunk`-frame units (the shapes torch.compile
        specialises on), so that serving never waits for a compilation (other shapes then run
        eagerly, `streamworld.models.compiling.BatchCompiled`). Needs a working
        torch.compile backend (Triton on CUDA, a C++ compiler on the CPU). Results equal the
        eager ones up to float rounding."""
        ops = _compiled_elementwise()
        dtype = self.transformer.proj_out.weight.dtype
        p, d, hd = self.tokens_per_frame, self.dim, self.head_dim
        # One block per device stands for the others there (placed stages, `place`).
        first_block = {dev: i for i, dev in reversed(list(enumerate(self.block_devices)))}
        with torch.inference_mode(), compiling.warming():
            for (dev, i), b in itertools.product(first_block.items(), (1, 2)):
                norm2 = self.transformer.blocks[i].norm2
                for f in sorted({1, frames_per_chunk}):
                    x = torch.zeros(b, f * p, d, device=dev, dtype=dtype)
                    mods = torch.zeros(b, f, 6, d, device=dev)
                    ops.attention_norm(x, mods, norm2.eps)
                    ops.ffn_norm(x, mods, norm2.eps)
                    y = torch.zeros_like(x)  # not x itself: aliasing is part of the guards
                    ops.attention_residual(x, y, mods)
                    ops.ffn_residual(x, y, mods)
                    if norm2.elementwise_affine:
                        ops.affine_norm(x, norm2.weight, norm2.bias, norm2.eps)
                    q = torch.zeros(b, f * p, self.heads, hd, device=dev, dtype=dtype)
                    ops.rotate(q, ops.turn(*(torch.ones(b, f * p, 1, hd, device=dev),) * 2))
        self._ops = ops
        return self

    @property
    def elementwise_compiled(self) -> bool:
        return self._ops.compiled

    # --- positions ----------------------------------------------------------------------
    def rope(self, num_frames: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_frames, P, d] for temporal positions 0..num_frames-1 (float32), on
        `device` (default: the last block's)."""
        device = device or self.transformer.proj_out.weight.device
        cache = self._rope_cache.get(device)
        if cache is None or cache[0].shape[0] < num_frames:
            cache = self._build_rope(max(num_frames, 64), device)
            self._rope_cache[device] = cache
        return cache[0][:num_frames], cache[1][:num_frames]

    def _build_rope(self, num_frames: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Wan splits each head into temporal, height and width parts, each rotated by its own
        # axis position (theta 10000). Angles in float64 on the CPU, as diffusers' table does.
        rope = self.transformer.rope
        gh, gw = self.grid

        def axis(dim: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
            angles = torch.outer(torch.arange(n, dtype=torch.float64, device="cpu"), inv_freq)
            return angles.cos().repeat_interleave(2, dim=1), angles.sin().repeat_interleave(2, dim=1)

        axes = [axis(rope.t_dim, num_frames), axis(rope.h_dim, gh), axis(rope.w_dim, gw)]

        def grid(t: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            parts = (
                t.view(num_frames, 1, 1, -1).expand(num_frames, gh, gw, -1),
                h.view(1, gh, 1, -1).expand(num_frames, gh, gw, -1),
                w.view(1, 1, gw, -1).expand(num_frames, gh, gw, -1),
            )
            return torch.cat(parts, dim=-1).reshape(num_frames, gh * gw, -1).float().to(device)

        return grid(*(a[0] for a in axes)), grid(*(a[1] for a in axes))

    def _temporal_angles(self, positions: Sequence[int]) -> torch.Tensor:
        """Temporal RoPE angles [n, t_dim] (pairs repeated), float64 on the CPU, so that
        positions in the hours of a long stream keep their precision."""
        t_dim = self.transformer.rope.t_dim
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, t_dim, 2, dtype=torch.float64) / t_dim))
        pos = torch.as_tensor(list(positions), dtype=torch.float64)
        return torch.outer(pos, inv_freq).repeat_interleave(2, dim=1)

    def rope_at(
        self, frames: Sequence[int], device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(frames), P, d] for any absolute temporal positions (no table, so
        no limit on how long a stream runs), on `device` (default: the last block's)."""
        device = device or self.transformer.proj_out.weight.device
        cos, sin = self.rope(1, device)  # the spatial (height, width) parts do not depend on time
        t_dim = self.transformer.rope.t_dim
        angles = self._temporal_angles(frames)
        n, p = angles.shape[0], cos.shape[1]

        def full(t: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            t = to_device(t.float(), device).view(n, 1, t_dim).expand(n, p, t_dim)
            return torch.cat([t, table[:, :, t_dim:].expand(n, p, -1)], dim=-1)

        return full(angles.cos(), cos), full(angles.sin(), sin)

    def temporal_shift(
        self, frames: int, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [d] that move already rotated keys `frames` positions later in time
        (the height and width channels are left as they are), on `device` (default: the
        last block's)."""
        device = device or self.transformer.proj_out.weight.device
        angles = self._temporal_angles([frames])[0]
        rest = self.head_dim - angles.shape[0]
        cos = torch.cat([angles.cos(), torch.ones(rest, dtype=torch.float64)])
        sin = torch.cat([angles.sin(), torch.zeros(rest, dtype=torch.float64)])
        return to_device(cos.float(), device), to_device(sin.float(), device)

    # --- conditioning -------------------------------------------------------------------
    def prepare_text(self, text_embeds: torch.Tensor) -> CrossKV:
        """Cross-attention K/V of every block for one prompt; text_embeds [L, text_dim]."""
        ctx = self.transformer.condition_embedder.text_embedder(text_embeds.unsqueeze(0))  # [1, L, D]
        on_device = {ctx.device: ctx}  # the text's context, copied once to each block's device
        keys, values = [], []
        for blk in self.transformer.blocks:
            attn = blk.attn2
            device = attn.to_k.weight.device
            here = on_device.setdefault(device, ctx.to(device))
            keys.append(attn.norm_k(attn.to_k(here))[0].unflatten(-1, (self.heads, self.head_dim)))
            values.append(attn.to_v(here)[0].unflatten(-1, (self.heads, self.head_dim)))
        return CrossKV(keys, values)

    def _conditioning(
        self, timesteps: torch.Tensor, latent_actions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """timesteps [B, F] -> (modulation [B, F, 6, D] float32, temb [B, F, D])."""
        cond = self.transformer.condition_embedder
        b, f = timesteps.shape
        freq = cond.timesteps_proj(timesteps.reshape(-1))
        emb_dtype = cond.time_embedder.linear_1.weight.dtype
        temb = cond.time_embedder(freq.to(emb_dtype))
        if self.action_adapter is not None:
            if latent_actions is None:
                raise ValueError("this model takes actions; latent_actions is missing")
            temb = temb + self.action_adapter(latent_actions.reshape(b * f, -1).to(temb.dtype))
        dtype = self.transformer.proj_out.weight.dtype
        temb = temb.to(dtype)
        modulation = cond.time_proj(cond.act_fn(temb)).float().view(b, f, 6, self.dim)
        return modulation, temb.view(b, f, self.dim)

    # --- the stage forward --------------------------------------------------------------
    def embed(self, units: Sequence[ChunkInput]) -> StageActivation:
        """Stage prologue: patchify the units' latents and build their conditioning."""
        dtype = self.transformer.proj_out.weight.dtype
        latents = torch.stack([u.latents for u in units]).to(dtype)  # [B, C, F, h, w]
        hidden = self.transformer.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()
        # Timesteps and actions may come from the host: stacked there, copied once per batch.
        timesteps = to_device(torch.stack([u.timesteps for u in units]).float(), hidden.device)
        actions = None
        if self.action_adapter is not None:
            if any(u.latent_actions is None for u in units):
                raise ValueError("this model takes actions; a unit has none")
            actions = to_device(torch.stack([u.latent_actions for u in units]), hidden.device)  # type: ignore[misc]
        modulation, temb = self._conditioning(timesteps, actions)
        hidden = self._add_spatial_actions(hidden, actions)
        return StageActivation(hidden, modulation, temb, num_frames=latents.shape[2])

    def _add_spatial_actions(self, hidden: torch.Tensor, actions: torch.Tensor | None) -> torch.Tensor:
        """hidden [B, F * P, D] plus the per-token action features, for spatial-action models."""
        if self.action_adapter is None or actions is None:
            return hidden
        tokens = self.action_adapter.spatial_tokens(actions)
        return hidden if tokens is None else hidden + tokens.to(hidden.dtype)

    def run_blocks(
        self, act: StageActivation, units: Sequence[ChunkInput], start: int, stop: int
    ) -> StageActivation:
        """Blocks [start, stop) on a batch of units, reading and writing K/V through their views.

        Keys are rotated once, at the absolute positions of their frames, and cached that
        way (`streamworld.models.kv`): the context is read as it is, and only the sink frames
        are moved forward to sit directly before the window. Units whose contexts have the
        same length attend in one batched call; otherwise each unit attends over exactly its
        own keys (one call per unit), so no compute is spent on padding. Every other
        operation of the block runs on the whole batch.
        """
        plan = self.plan_blocks(act, units)
        return self.run_planned(act, plan, self.stacked_text(units), start, stop)

    @staticmethod
    def stacked_text(units: Sequence[ChunkInput]) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """block -> the units' cross-attention keys and values [B, L, H, d], stacked."""

        def text(index: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                torch.stack([u.text.keys[index] for u in units]),
                torch.stack([u.text.values[index] for u in units]),
            )

        return text

    def plan_blocks(self, act: StageActivation, units: Sequence[ChunkInput]) -> BlockPlan:
        """What `run_planned` needs besides the activation and the prompts: the queries'
        rotation, how the sinks move, and the batched K/V reader and writer when every unit
        has the same context length (host work and small copies only)."""
        ctx_frames = [u.kv.context_frames for u in units]
        p = self.tokens_per_frame
        device = act.hidden.device
        # Units at the same position (a fork's branches) share one rotation and one sink move:
        # each is built on the host and copied once per batch, not once per unit.
        rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for u in units:
            first = u.kv.first_frame
            if first not in rotations:
                cos, sin = self.rope_at(range(first, first + act.num_frames), device)
                rotations[first] = (cos.flatten(0, 1), sin.flatten(0, 1))
        q_cos = torch.stack([rotations[u.kv.first_frame][0] for u in units]).unsqueeze(2)  # [B, N, 1, d]
        q_sin = torch.stack([rotations[u.kv.first_frame][1] for u in units]).unsqueeze(2)
        # Sink frames sit at absolute positions 0..; the window frames right before the chunk.
        # Moving the sinks up by the gap keeps every relative position within the context.
        shifts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        sink_moves: list[tuple[int, tuple[torch.Tensor, torch.Tensor]] | None] = []
        for u, c in zip(units, ctx_frames, strict=True):
            gap = u.kv.first_frame - c
            sinks = u.kv.sink_frames
            if sinks and gap and gap not in shifts:
                shifts[gap] = self.temporal_shift(gap, device)
            sink_moves.append((sinks * p, shifts[gap]) if sinks and gap else None)
        uniform = all(c == ctx_frames[0] for c in ctx_frames)
        batch = _batch_plan(units) if uniform else None
        batch_move = None
        if batch is not None and any(m is not None for m in sink_moves):
            # Every unit that moves its sinks has the same number of them; the rest turn by 0.
            n = next(m for m in sink_moves if m is not None)[0]
            identity = (torch.ones_like(q_cos[0, 0, 0]), torch.zeros_like(q_cos[0, 0, 0]))
            moves = [identity if m is None else m[1] for m in sink_moves]
            cos = torch.stack([c for c, _ in moves])[:, None, None]  # [B, 1, 1, d]
            sin = torch.stack([s for _, s in moves])[:, None, None]
            batch_move = (n, cos, sin)
        return BlockPlan(list(units), ctx_frames, self._ops.turn(q_cos, q_sin), sink_moves, batch, batch_move)

    def run_planned(
        self,
        act: StageActivation,
        plan: BlockPlan,
        text: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        start: int,
        stop: int,
    ) -> StageActivation:
        """Blocks [start, stop) as `plan` says; `text(block)` gives the units' cross-attention
        keys and values [B, L, H, d]. With a batched K/V plan this is kernels only, with no
        host synchronisation, so that it can be captured in a CUDA graph
        (`streamworld.engine.graphs`)."""
        ops, batch, q_turn = self._ops, plan.batch, plan.q_turn
        for index in range(start, stop):

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int = index) -> torch.Tensor:
                k = ops.rotate(k, q_turn)
                if batch is not None:
                    batch.store(index, k, v)
                    q = ops.rotate(q, q_turn)
                    both = batch.context_and_own(index, k.dtype)
                    if both is None:
                        ctx = batch.context(index)
                        if ctx is None:
                            return _sdpa(q, k, v, None)
                        both = (
                            torch.cat([ctx[0].to(k.dtype), k], dim=1),
                            torch.cat([ctx[1].to(v.dtype), v], dim=1),
                        )
                    keys, values = both
                    if plan.batch_move is not None:  # the sinks lead the context
                        n, cos, sin = plan.batch_move
                        keys[:, :n] = _rotate(keys[:, :n], cos, sin)
                    return _sdpa(q, keys, values, None)
                return self._attend_each(plan, index, q, k, v)

            act.hidden = self._block(index, act, attend, *text(index))
        return act

    def _attend_each(
        self, plan: BlockPlan, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Self-attention unit by unit (contexts of different lengths, or no batched K/V)."""
        keys, values = [], []
        for i, unit in enumerate(plan.units):
            ctx = unit.kv.context(index)
            unit.kv.store(index, k[i], v[i])
            if ctx is None or not plan.ctx_frames[i]:
                keys.append(k[i])
                values.append(v[i])
                continue
            ctx_k, ctx_v = ctx[0].to(k.dtype), ctx[1].to(v.dtype)
            move = plan.sink_moves[i]
            if move is None:
                keys.append(torch.cat([ctx_k, k[i]]))
            else:
                n, (cos, sin) = move
                keys.append(torch.cat([_rotate(ctx_k[:n], cos, sin), ctx_k[n:], k[i]]))
            values.append(torch.cat([ctx_v, v[i]]))
        q = self._ops.rotate(q, plan.q_turn)
        if all(c == plan.ctx_frames[0] for c in plan.ctx_frames):
            return _sdpa(q, torch.stack(keys), torch.stack(values), None)
        return torch.cat(
            [_sdpa(q[i : i + 1], keys[i][None], values[i][None], None) for i in range(len(plan.units))]
        )

    def head(self, act: StageActivation) -> torch.Tensor:
        """Stage epilogue: the predicted flow [B, C, F, h, w] (float32)."""
        tr = self.transformer
        b, n, d = act.hidden.shape
        f = act.num_frames
        shift, scale = (tr.scale_shift_table.unsqueeze(0) + act.temb.unsqueeze(2)).unbind(2)  # [B, F, D]
        x = act.hidden.view(b, f, n // f, d)
        x = (tr.norm_out(x.float()) * (1 + scale.unsqueeze(2)) + shift.unsqueeze(2)).type_as(act.hidden)
        x = tr.proj_out(x)  # [B, F, P, C * pt * ph * pw]
        pt, ph, pw = self.patch_size
        gh, gw = self.grid
        x = x.view(b, f, gh, gw, pt, ph, pw, -1)
        # (B, F, gh, gw, pt, ph, pw, C) -> (B, C, F*pt, gh*ph, gw*pw)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, f * pt, gh * ph, gw * pw)
        return x.float()

    def forward_chunk(self, units: Sequence[ChunkInput]) -> torch.Tensor:
        """All blocks on a batch of units: flow [B, C, F, h, w]."""
        act = self.embed(units)
        act = self.run_blocks(act, units, 0, self.num_layers)
        return self.head(act)

    # --- whole-sequence forward (definition and training) ---------------------------------
    def forward_sequence(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        text: CrossKV,
        chunk_ids: torch.Tensor,
        latent_actions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flow for a whole clip [B, C, T, h, w] with block-causal attention.

        timesteps [B, T]; chunk_ids [T] non-decreasing: a frame attends to every frame whose
        chunk id is not larger than its own. Positions are absolute frame indices.
        """
        t = latents.shape[2]
        chunk_ids = chunk_ids.to(latents.device)
        frame_mask = chunk_ids[:, None] >= chunk_ids[None, :]
        positions = torch.arange(t, device=latents.device)
        return self.forward_masked(latents, timesteps, text, positions, frame_mask, latent_actions)

    def forward_masked(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        text: CrossKV,
        positions: torch.Tensor,
        frame_mask: torch.Tensor,
        latent_actions: torch.Tensor | None = None,
        max_position: int | None = None,
        with_hidden: bool = False,
        hidden_after: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Flow [B, C, T, h, w] for frames with explicit temporal positions and frame mask;
        with `with_hidden`, (flow, the hidden states [B, T * P, D] after the first
        `hidden_after` blocks, by default all: the last block's).

        positions [T]: each frame's temporal RoPE position; frame_mask [T, T] bool: query
        frame i attends to key frame j. Training uses it to put a clean (or noisy) copy of the
        context next to the frames being denoised, each attending as the cached forward would.
        `max_position`: the largest of `positions` when the caller knows it (read from the
        tensor otherwise, which torch.compile cannot trace without a graph break).
        """
        dtype = self.transformer.proj_out.weight.dtype
        b, _, t = latents.shape[:3]
        hidden = self.transformer.patch_embedding(latents.to(dtype)).flatten(2).transpose(1, 2).contiguous()
        modulation, temb = self._conditioning(timesteps.float(), latent_actions)
        if latent_actions is not None:
            hidden = self._add_spatial_actions(hidden, latent_actions.to(hidden.device))
        act = StageActivation(hidden, modulation, temb, num_frames=t)
        positions = positions.to(hidden.device)
        cos, sin = self.rope((int(positions.max()) if max_position is None else max_position) + 1)
        cos, sin = cos[positions].flatten(0, 1)[:, None], sin[positions].flatten(0, 1)[:, None]  # [T*P, 1, d]
        p = self.tokens_per_frame
        mask = frame_mask.to(hidden.device).repeat_interleave(p, 0).repeat_interleave(p, 1)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
            rotate = _rotate_traced if torch.compiler.is_compiling() else _rotate
            return _sdpa(rotate(q, cos, sin), rotate(k, cos, sin), v, mask)

        kept_after = self.num_layers if hidden_after is None else hidden_after
        if not 1 <= kept_after <= self.num_layers:
            raise ValueError(f"hidden_after must be in [1, {self.num_layers}], got {hidden_after}")
        kept = None
        for index in range(self.num_layers):
            text_k = text.keys[index].unsqueeze(0).expand(b, -1, -1, -1)
            text_v = text.values[index].unsqueeze(0).expand(b, -1, -1, -1)
            act.hidden = self._block(index, act, attend, text_k, text_v)
            if index + 1 == kept_after:
                kept = act.hidden
        flow = self.head(act)
        return (flow, kept) if with_hidden else flow

    # --- one transformer block ------------------------------------------------------------
    def _block(
        self,
        index: int,
        act: StageActivation,
        self_attention: SelfAttention,
        text_k: torch.Tensor,
        text_v: torch.Tensor,
    ) -> torch.Tensor:
        blk = self.transformer.blocks[index]
        ops = self._ops
        x = act.hidden
        # [B, F, 6, D]: shift, scale, gate of self-attention, then of the feed-forward.
        mods = blk.scale_shift_table.unsqueeze(0) + act.modulation

        h = ops.attention_norm(x, mods, blk.norm1.eps)
        a = blk.attn1
        q = a.norm_q(a.to_q(h)).unflatten(-1, (self.heads, self.head_dim))
        k = a.norm_k(a.to_k(h)).unflatten(-1, (self.heads, self.head_dim))
        v = a.to_v(h).unflatten(-1, (self.heads, self.head_dim))
        out = a.to_out[0](self_attention(q, k, v, index).flatten(2))
        x = ops.attention_residual(x, out, mods)

        n2 = blk.norm2
        if n2.elementwise_affine:
            h = ops.affine_norm(x, n2.weight, n2.bias, n2.eps)
        else:
            h = n2(x.float()).type_as(x)
        c = blk.attn2
        q = c.norm_q(c.to_q(h)).unflatten(-1, (self.heads, self.head_dim))
        x = x + c.to_out[0](_sdpa(q, text_k.to(q.dtype), text_v.to(q.dtype), None).flatten(2))

        h = ops.ffn_norm(x, mods, blk.norm3.eps)
        return ops.ffn_residual(x, blk.ffn(h), mods)


def _batch_plan(units: Sequence[ChunkInput]) -> Any:
    """The views' batched K/V reader/writer, when they offer one (`plan`) and agree."""
    kind = type(units[0].kv)
    plan = getattr(kind, "plan", None)
    if plan is None or any(type(u.kv) is not kind for u in units):
        return None
    return plan([u.kv for u in units])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention on [B, S, H, d] tensors; mask broadcastable to [B, H, Sq, Sk] (True = attend)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)
