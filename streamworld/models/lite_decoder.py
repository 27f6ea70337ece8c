"""A small causal video decoder: a cheaper stand-in for the Wan VAE decoder.

The Wan VAE decoder is 3-D convolutions at full resolution with a causal cache; at 480x832 it
costs about as much GPU time per chunk as the whole DiT (docs/benchmarks.md). Real-time
demos of causal Wan models decode with a small distilled decoder instead. `LiteDecoder` is
StreamWorld's: it maps the same normalised latents to the same frame layout as the Wan
decoder, with 2-D convolutions only, and is trained to imitate it (`distill_lite_decoder`,
`streamworld distill-decoder`).

Architecture, per latent frame t (all frames of a chunk run in parallel, layer by layer):

    x = 3 tanh(z / 3)                     soft clamp of the latents
    stem: conv3x3 C -> w0
    for each resolution level i:
        memory blocks: y_t = relu(x_t + f([x_t, x_{t-1}])), f = conv3x3 x3 with ReLUs
        (not at the last level) upsample x2 nearest, conv3x3 w_i -> w_{i+1};
            on a temporal level, conv1x1 to 2 w_{i+1} and split into two frames in time
    head: relu, conv3x3 -> 3, clamp to [-1, 1]

Each memory block's only state is its input at the previous frame, so a stream's
`DecoderState` holds one [B, w, h, w] tensor per block, and decoding chunk by chunk equals
decoding the whole clip at once. As with Wan, the stream's first latent frame gives one video
frame (the last of the frames it expands to) and every later one gives `temporal_ratio`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import compiling

if TYPE_CHECKING:
    from .config import ModelConfig

# Widths per resolution level (latent resolution first) and memory blocks per level, for
# latents from the Wan 2.1 VAE (16 channels, 8x spatial, 4x temporal).
DEFAULT_WIDTHS = (256, 128, 64, 64)
DEFAULT_BLOCKS = (3, 3, 3, 1)


@dataclass(frozen=True)
class LiteDecoderConfig:
    latent_channels: int = 16
    spatial_ratio: int = 8
    temporal_ratio: int = 4
    widths: tuple[int, ...] = DEFAULT_WIDTHS
    blocks: tuple[int, ...] = DEFAULT_BLOCKS

    def __post_init__(self) -> None:
        levels = _log2(self.spatial_ratio, "spatial_ratio") + 1
        if len(self.widths) != levels or len(self.blocks) != levels:
            raise ValueError(
                f"a spatial ratio of {self.spatial_ratio} needs {levels} widths and block counts, "
                f"got {len(self.widths)} and {len(self.blocks)}"
            )
        if _log2(self.temporal_ratio, "temporal_ratio") > levels - 1:
            raise ValueError("the temporal ratio may not exceed the spatial ratio")

    @property
    def temporal_levels(self) -> int:
        return _log2(self.temporal_ratio, "temporal_ratio")


def _log2(n: int, what: str) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")
    return n.bit_length() - 1


class MemoryBlock(nn.Module):
    """A residual block that sees its input at this frame and at the previous one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(2 * width, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
        )

    def forward(self, x: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """x [B, T, C, h, w]; prev [B, C, h, w] (the input at the frame before x's first) or
        None at the start of a stream. Returns the output and the new state (x's last frame)."""
        b, t = x.shape[:2]
        first = torch.zeros_like(x[:, 0]) if prev is None else prev.to(x)
        shifted = torch.cat([first.unsqueeze(1), x[:, :-1]], dim=1)
        y = self.body(torch.cat([x, shifted], dim=2).flatten(0, 1))
        # A copy: a view would keep the whole chunk's input alive in the stream's state.
        return F.relu(x + y.unflatten(0, (b, t))), x[:, -1].clone()


# Inductor turns off its channels-last layout optimisation when a convolution's input has a
# dynamic size (here the batch), and cuDNN's bf16 kernels then convert every convolution's
# input and output between layouts. Forcing it keeps the decoder channels-last throughout.
COMPILE_OPTIONS = {"force_layout_optimization": True}

# Compiled kernels index with 32-bit integers where their tensors allow, and guard on it: a
# batch whose largest intermediate tensor has more elements than this would miss every
# compiled variant and decode eagerly (8 streams at 480x832 do). Such batches decode in parts.
INDEX_LIMIT = 2**31 - 1


class LiteDecoder(nn.Module):
    """Normalised latents [B, C, F, h, w] -> frames [B, 3, T, H, W] in [-1, 1], causally."""

    def __init__(self, config: LiteDecoderConfig) -> None:
        super().__init__()
        self.config = config
        w = config.widths
        self.stem = nn.Conv2d(config.latent_channels, w[0], 3, padding=1)
        self.levels = nn.ModuleList()
        for i, width in enumerate(w):
            level = nn.Module()
            level.memory = nn.ModuleList(MemoryBlock(width) for _ in range(config.blocks[i]))
            if i + 1 < len(w):
                level.up = nn.Conv2d(width, w[i + 1], 3, padding=1)
                # Temporal expansion on the first levels, as the Wan decoder does.
                if i < config.temporal_levels:
                    level.split = nn.Conv2d(w[i + 1], 2 * w[i + 1], 1)
            self.levels.append(level)
        self.head = nn.Conv2d(w[-1], 3, 3, padding=1)
        self._compiled: compiling.BatchCompiled | None = None
        # The largest batch one compiled call decodes (set by `compile_for`); more streams
        # decode in parts of at most this many.
        self.batch_limit: int | None = None

    @property
    def num_slots(self) -> int:
        """State tensors per stream: one per memory block."""
        return sum(self.config.blocks)

    def forward(self, latents: Tensor, state: list[Tensor | None], first_chunk: bool) -> Tensor:
        """Decode the next latent frames of a stream; `state` (one entry per memory block) is
        updated in place. Returns [B, 3, T, H, W], T = 1 + r(F - 1) on the first chunk and rF
        after it."""
        if len(state) != self.num_slots:
            raise ValueError(f"the decoder state needs {self.num_slots} slots, got {len(state)}")
        if any(s is None for s in state):
            # The start of a stream: the frame "before" it is zeros.
            zeros = self._zero_state(latents)
            state[:] = [z if s is None else s for s, z in zip(state, zeros, strict=True)]
        if self._compiled is None:
            out, state[:] = self._decode(latents, list(state))
        else:
            out, new_state = self._decode_compiled(latents, list(state))
            # Compiled code may return the state as views of whole-chunk buffers: copies keep
            # the stream's state small and its strides those the compiled variants expect.
            state[:] = [s.clone(memory_format=torch.contiguous_format) for s in new_state]
        if first_chunk:
            # The first latent frame stands for one video frame: keep the last of its r.
            out = out[:, self.config.temporal_ratio - 1 :]
        return out.transpose(1, 2)

    def _decode(self, latents: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """latents [B, C, F, h, w] and one state tensor per memory block -> frames
        [B, T', 3, H, W] clamped to [-1, 1] (T' = rF) and the new state: a pure function, the
        one `compile_for` compiles."""
        b, _, f = latents.shape[:3]
        x = latents.transpose(1, 2).flatten(0, 1)  # [B * F, C, h, w]
        x = F.relu(self.stem(3.0 * torch.tanh(x / 3.0)))
        x = x.unflatten(0, (b, f))
        new_state = []
        slot = 0
        for level in self.levels:
            for block in level.memory:
                x, prev = block(x, state[slot])
                new_state.append(prev)
                slot += 1
            if hasattr(level, "up"):
                t = x.shape[1]
                y = F.interpolate(x.flatten(0, 1), scale_factor=2.0, mode="nearest")
                y = F.relu(level.up(y))
                if hasattr(level, "split"):
                    # [B * T, 2C, H, W] -> [B, 2T, C, H, W]: each frame becomes two in time.
                    y = level.split(y).unflatten(1, (2, -1)).flatten(0, 1)
                    t *= 2
                x = y.unflatten(0, (b, t))
        out = self.head(F.relu(x.flatten(0, 1))).unflatten(0, (b, x.shape[1]))
        return out.clamp(-1.0, 1.0), new_state

    def _decode_compiled(self, latents: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """`_decode` through the compiled variants, in parts of at most `batch_limit` streams."""
        assert self._compiled is not None
        step = self.batch_limit or latents.shape[0]
        if latents.shape[0] <= step:
            return self._compiled(latents, state)
        parts = [
            self._compiled(latents[i : i + step], [s[i : i + step] for s in state])
            for i in range(0, latents.shape[0], step)
        ]
        outs, states = zip(*parts, strict=True)
        return torch.cat(outs), [torch.cat(slot) for slot in zip(*states, strict=True)]

    def _zero_state(self, latents: Tensor) -> list[Tensor]:
        """The state at the start of a stream: zeros shaped like each block's input."""
        b, h, w = latents.shape[0], *latents.shape[3:]
        shapes = []
        for i, (width, blocks) in enumerate(zip(self.config.widths, self.config.blocks, strict=True)):
            shapes += [(b, width, h << i, w << i)] * blocks
        return [latents.new_zeros(shape) for shape in shapes]

    def compile_for(self, latent_height: int, latent_width: int, latent_frames: int) -> LiteDecoder:
        """Decode through torch.compile from now on, compiled now for chunks of
        `latent_frames` latent frames of that size, on the decoder's device and dtype: one
        stream and batches of several (the two variants torch.compile makes when only the
        batch size varies, `streamworld.models.compiling`), so that serving never waits for
        a compilation (other shapes then decode eagerly). Fuses the ReLUs, residual adds and
        layout changes around the convolutions; figures in docs/benchmarks.md.
        Batches larger than `batch_limit` (32-bit indexing, set here) decode in parts.
        Needs a working torch.compile backend (Triton on CUDA, a C++ compiler on the CPU).
        Results equal eager ones up to float rounding."""
        compiled = compiling.BatchCompiled(self._decode, min_ndim=4, options=dict(COMPILE_OPTIONS))
        weight = self.stem.weight
        with torch.inference_mode(), compiling.warming():
            for b in (1, 2):
                z = torch.zeros(
                    b,
                    self.config.latent_channels,
                    latent_frames,
                    latent_height,
                    latent_width,
                    device=weight.device,
                    dtype=weight.dtype,
                )
                compiled(z, self._zero_state(z))
            # One stream's largest intermediate tensor, from an eager decode.
            with _LargestOutput() as largest:
                self._decode(z[:1], self._zero_state(z[:1]))
        self.batch_limit = max(1, INDEX_LIMIT // largest.numel)
        self._compiled = compiled
        return self

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @classmethod
    def for_latents(
        cls,
        latent_channels: int,
        spatial_ratio: int,
        temporal_ratio: int,
        widths: Sequence[int] | None = None,
        blocks: Sequence[int] | None = None,
    ) -> LiteDecoder:
        levels = _log2(spatial_ratio, "spatial_ratio") + 1
        widths = tuple(widths) if widths is not None else _fit(DEFAULT_WIDTHS, levels)
        blocks = tuple(blocks) if blocks is not None else _fit(DEFAULT_BLOCKS, levels)
        return cls(LiteDecoderConfig(latent_channels, spatial_ratio, temporal_ratio, widths, blocks))

    @classmethod
    def for_model(cls, config: ModelConfig) -> LiteDecoder:
        """A (randomly initialised) lite decoder for a model's latents, sized by
        `ModelConfig.lite_decoder`."""
        return cls.for_latents(
            config.latent_channels, config.spatial_ratio, config.temporal_ratio, **config.lite_decoder
        )

    def describe(self) -> dict:
        c = self.config
        return {
            "latent_channels": c.latent_channels,
            "spatial_ratio": c.spatial_ratio,
            "temporal_ratio": c.temporal_ratio,
            "widths": list(c.widths),
            "blocks": list(c.blocks),
            "parameters": sum(p.numel() for p in self.parameters()),
        }


class _LargestOutput(TorchDispatchMode):
    """Records the most elements any operator's output has while it is active."""

    numel = 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _fit(values: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The default per-level values for n levels: the first n - 1 and the last one."""
    if n <= len(values):
        return (*values[: n - 1], values[-1])
    return (*values[:-1], *([values[-2]] * (n - len(values))), values[-1])


def lite_config_from_metadata(meta: dict[str, str]) -> LiteDecoderConfig:
    """The config recorded in a lite decoder's safetensors metadata."""
    try:
        return LiteDecoderConfig(
            latent_channels=int(meta["latent_channels"]),
            spatial_ratio=int(meta["spatial_ratio"]),
            temporal_ratio=int(meta["temporal_ratio"]),
            widths=_ints(meta["widths"]),
            blocks=_ints(meta["blocks"]),
        )
    except KeyError as e:
        raise ValueError(f"not a StreamWorld lite decoder file: metadata {e.args[0]!r} is missing") from None


def lite_metadata(config: LiteDecoderConfig) -> dict[str, str]:
    return {
        "format": "streamworld-lite-decoder",
        "latent_channels": str(config.latent_channels),
        "spatial_ratio": str(config.spatial_ratio),
        "temporal_ratio": str(config.temporal_ratio),
        "widths": ",".join(map(str, config.widths)),
        "blocks": ",".join(map(str, config.blocks)),
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def save_lite_decoder(decoder: LiteDecoder, path: str, extra: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().float().cpu().contiguous() for k, v in decoder.state_dict().items()}
    save_file(state, path, metadata={**lite_metadata(decoder.config), **(extra or {})})


def load_lite_decoder(path: str) -> LiteDecoder:
    """A lite decoder from a file written by `save_lite_decoder` (`streamworld distill-decoder`)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "streamworld-lite-decoder":
            raise ValueError(f"{path} is not a StreamWorld lite decoder (see `streamworld distill-decoder`)")
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    decoder = LiteDecoder(lite_config_from_metadata(meta))
    decoder.load_state_dict(state)
    return decoder
