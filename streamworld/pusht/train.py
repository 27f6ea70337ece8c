"""Training the PushT world model (`streamworld train pusht`).

The model is the causal Wan DiT the server runs (`streamworld.models`), trained with flow
matching on recorded episodes (`streamworld.pusht.data`). One training sample is an
episode's first frame (the sink, always clean, as the served model's first-image prefill),
then a clip of L = window + chunk frames, twice:

    [ sink | context copy of the clip | the clip being denoised ]

The clip being denoised attends, chunk by chunk, to the sink, to the context copy of the
earlier chunks inside the attention window, and to its own chunk, with the temporal
positions the cached forward gives them; the context copy attends the same way among
itself. What the context copy holds decides which KV mode a sample trains for:

- `clean`: the true frames, timestep 0 (the commit pass of `clean` mode);
- `final`: the true frames noised to the last denoising step's level (`final` mode keeps
  the K/V of each chunk's last step);
- `noisy`: the very latents being denoised, every chunk at one shared level (`noisy` mode
  reads the K/V earlier chunks wrote at the same step).

- `rollout` (`rollout_share` of each batch): the model's own prediction of the episode, made
  by the serving path from the episode's first frame and its actions (`RolloutContext`; with
  `clip_chunks`, from the frame before the clip, so that each stream clip's later chunks
  have the model's own earlier chunks as context), noised as in `final`; the target is the
  true clip or the environment continued from what the context shows. Serving and planning
  read what the model predicted, not the truth, and errors compound; these samples are meant
  to teach the model to go on from its own drift. Measured on default clips (docs/pusht.md,
  rounds 5-7), they barely lowered it: off by default.

- `unrolled` (`unroll_share` of each batch, stream clips only): no context copy of the truth
  at all. The one-step `clean` sampler (`--steps 1000 --kv-mode clean`, what planning serves)
  is unrolled over the clip: chunk c is predicted from pure noise with the model's own
  predictions of chunks < c as its clean context, and every prediction is compared with the
  true frames, gradients flowing back through the whole rollout. This is an objective over
  rollouts, where the other regimes train one chunk at a time on a given context.

With `state_weight`, a small probe (`state_probe.py`) reads each trained frame's recorded
scene (the agent's and the block's place, the block's angle), or with `state_target`
"change" the scene's change since the frame before its chunk, from the DiT's last hidden
states (or those after `state_layer` blocks), and its squared error joins the loss (after
`state_warmup` steps in which only the probe learns from it): the network has to carry the
block's pose, which the pixel loss alone asks little of. The probe is trained,
checkpointed and exported beside the weights (`state_probe_path`).

Noise levels are drawn half from the served step list and half uniformly. Clips start at
the episode start (every chunk then has its exact serving context) or anywhere later (then
only the last chunk, whose window is full, is trained: it stands for the steady state where
the sink is an old frame). That stand-in is not exact: its context's first chunks never saw
their own past, which a served stream's did. With `clip_chunks`, every clip is instead a
stream of its own, from the frame before it, and every chunk is trained exactly as served;
clips longer than the window reach the steady state itself, where the cached forward moves
the sink up to the window, and the layout holds one copy of the sink per such move:

    [ sink at 0 | sink at 4 | sink at 8 | context copy | the clip being denoised ]

Runs are bounded in wall time (`minutes`) and resume from `checkpoint.pt` in the work
folder, so a long schedule spans several short runs; the learning-rate schedule follows the
global step. The exported weights are the EMA weights in float16, in the checkpoint layout
`WorldModel.load` reads.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import pickle
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import safetensors.torch
import torch

from ..engine import context_frame_indices
from ..models.config import ModelConfig
from ..models.pixels import frames_from_uint8, frames_to_latents
from ..models.schedule import NUM_TRAIN_TIMESTEPS, FlowSchedule
from ..models.world_model import WorldModel, image_as_last_frame, resolve_device
from .adversarial import (
    ADAPTIVE_WEIGHT_CAP,
    ClipDiscriminator,
    adaptive_weight,
    differing_patches,
    discriminator_optimizer,
    discriminator_update,
    generator_loss,
    patch_mean,
    patch_weights,
)
from .data import ROLLOUT_TARGETS, STATE_TARGETS, UNROLL_LOSSES, Dataset, DatasetSpec, generate_dataset
from .pose import MAX_MISMATCH
from .state_probe import (
    CHANGE_SCALE,
    WORLD_HALF,
    StateProbe,
    change_targets,
    state_errors,
    state_targets,
)
from .world import block_mask

REGIMES = ("clean", "final", "noisy")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 64
    total_steps: int = 12_000
    lr: float = 3e-4
    warmup_steps: int = 300
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    # Share of clips that start at the episode's first step.
    start_share: float = 0.3
    # How often each KV-mode regime is drawn (clean, final, noisy).
    regime_weights: tuple[float, float, float] = (0.4, 0.25, 0.35)
    # Share of noise levels drawn from the served step list (the rest are uniform).
    discrete_share: float = 0.5
    # Extra loss weight on pixels that differ from the episode's first frame (the agent and
    # the block where they moved): small moving objects otherwise cost the loss little.
    change_weight: float = 0.0
    # Extra loss weight on pixels where the block is, in the frame or in the first frame (where
    # it was): the block wherever it is or was, moving or not, so that a pushed block costs its
    # whole shape and a still one costs it to dissolve.
    block_weight: float = 0.0
    # Share of each batch whose context is the model's own rollout (`RolloutContext`); the
    # rollouts (episodes x frames; with `clip_chunks`, each one clip) are made again with the
    # current weights every `rollout_every` steps.
    rollout_share: float = 0.0
    rollout_every: int = 100
    rollout_episodes: int = 32
    rollout_frames: int = 32
    # The target of a rollout sample: "true" (the recorded frames) or "simulated" (the
    # environment continued from the scene the rollout's last two context frames show,
    # `pusht/pose.py`), a target the drifted context is consistent with.
    rollout_targets: str = "true"
    # "simulated": the largest fit mismatch of a context block that still counts as a T
    # (`pose.fit_block`); chunks after a block further from a T get no target.
    rollout_max_mismatch: float = MAX_MISMATCH
    # Processes that simulate targets ("simulated"); 1 runs them in the training process.
    rollout_workers: int = 1
    # Share of each batch trained end to end on the unrolled one-step `clean` sampler
    # (`Trainer.unrolled`); needs stream clips (`clip_chunks`), and excludes rollouts.
    unroll_share: float = 0.0
    # The unrolled objective's error per pixel: "l2" (squared) or "l1" (absolute). Where the
    # future is uncertain the squared error is least for the mean of the outcomes, a blur;
    # the absolute error for their median, which does not average two places into one.
    unroll_loss: str = "l2"
    # With unroll_share: the adversarial term's weight, as the ratio of its gradient norm to the
    # unrolled regression's on the rollouts' frames (`adversarial.adaptive_weight`); 0 trains
    # no discriminator. The term joins after `adversarial_start` steps of the discriminator alone.
    adversarial_weight: float = 0.0
    adversarial_start: int = 100
    # The weight of the patches where true clip and rollout do not differ in both hinge
    # losses, against 1 for those that do (`adversarial.patch_weights`): 0 judges the
    # differing patches alone; above 0 the discriminator also learns the still background.
    adversarial_background: float = 0.0
    # The most the term's adaptive weight may be (`adversarial.adaptive_weight`). As the
    # discriminator's verdict goes flat its gradient shrinks and the weight grows: rounds 20
    # and 21 (docs/pusht.md) jumped from round 19's 0.0007-0.004 to 0.2-1.2 as the term joined,
    # and lost the discriminator.
    adversarial_max_scale: float = ADAPTIVE_WEIGHT_CAP
    # The weight of the state probe's squared error in the loss (`state_probe.py`): the probe
    # reads each trained frame's recorded scene (the agent's and the block's place, the
    # block's angle) from the DiT's hidden states. 0 trains no probe. Needs a data set
    # with `states.npy`; the unrolled share and rollouts are not probed.
    state_weight: float = 0.0
    # What the probe reads: "scene", each frame's scene (`state_targets`), or "change", the
    # scene's change since the frame before the frame's chunk (`change_targets`), which is
    # what a `delta` model's output is made of (`benchmarks/state_probe_check.py`).
    state_target: str = "scene"
    # Steps at the start during which the probe learns to read the hidden states as they are
    # and its error sends no gradient into the DiT: the term then starts from a probe that
    # reads what the network holds rather than from a random one (round 23).
    state_warmup: int = 0
    # With state_target "change": the turn's cosine and sine in the probe's target are
    # multiplied by this, so its squared error weighs the turn this squared times as much. A
    # chunk's turn is a few degrees, whose sine is a few hundredths, where the positions'
    # change is tenths: at 1 the term asks little of the turn (round 24).
    state_turn_weight: float = 1.0
    # The blocks after which the probe reads the hidden states; None: all of them (the last
    # block's output, which the pixel head maps to the frame). A middle block's states feed
    # the blocks that draw the frame instead of competing with them for the same features.
    state_layer: int | None = None
    # Run the training forward through torch.compile (fused elementwise kernels; a GPU needs
    # Triton, a CPU a C++ compiler). The first step compiles; the loss equals the eager one
    # up to float rounding. The unrolled objective's forwards stay eager (`Trainer.unrolled`).
    compile: bool = False
    # Chunks per training clip; None: the window's chunks and one more, the sink being the
    # episode's first frame. Given, every clip is trained as a stream of its own from the
    # frame before it (`ClipBatcher`), so longer clips train, exactly as served, the chunks
    # after the window is full, where the cached forward moves the sink (`clip_layout`).
    clip_chunks: int | None = None
    seed: int = 0
    checkpoint_every: int = 500
    log_every: int = 100


# Training settings a resumed run may change: where and how fast it runs, how often it
# logs, and how long the schedule is (the existing run is extended or shortened).
RESUME_MAY_CHANGE = frozenset({"total_steps", "compile", "rollout_workers", "checkpoint_every", "log_every"})


def _differences(prefix: str, saved: dict, now: dict) -> list[str]:
    """'name: saved in the checkpoint, now X' for each setting both have that differs."""
    out = []
    for name in sorted(saved.keys() & now.keys()):
        if name in RESUME_MAY_CHANGE:
            continue
        a, b = saved[name], now[name]
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(f"{prefix}{name}.", a, b)
        elif _plain(a) != _plain(b):
            out.append(f"{prefix}{name}: {a!r} in the checkpoint, {b!r} now")
    return out


def _plain(value):
    """A tuple as the list it may have been saved as."""
    return list(value) if isinstance(value, tuple) else value


def load_checkpoint(path: Path, device) -> dict:
    """A training checkpoint, read as tensors and plain values only (never unpickling code:
    a work folder may come from elsewhere); ValueError for a file that holds anything else."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            f"{path} holds objects other than tensors and plain values (a checkpoint `train pusht` "
            "writes holds none), so it is not loaded; use another --workdir"
        ) from None


def check_resume(
    path: Path,
    state: dict | None,
    model_config: ModelConfig,
    train_config: TrainConfig,
    run_settings: dict | None = None,
) -> None:
    """Refuse to resume the checkpoint at `path` (its loaded `state`, or None to load it
    here; nothing to check if there is none) when it was trained for another model or with
    other settings: the run would be a mix of two recipes, recorded as the second.
    `RESUME_MAY_CHANGE` may differ; settings a checkpoint predates are not compared."""
    if state is None:
        if not path.is_file():
            return
        state = load_checkpoint(path, "cpu")
    if state["model_config"] != asdict(model_config):
        raise ValueError(f"{path} was trained for a different model configuration; use another --workdir")
    differences = _differences("", state.get("train_config", {}), asdict(train_config))
    differences += _differences("", state.get("run_settings", {}), run_settings or {})
    if differences:
        raise ValueError(
            f"{path} was trained with other settings ("
            + "; ".join(differences)
            + "); run the command that started it to resume, or use another --workdir "
            "(with --init set to its exported weights to fine-tune from them)"
        )


def clip_length(config: ModelConfig, chunks: int | None = None) -> int:
    """Frames in a training clip: `chunks` chunks, by default whole chunks covering the window
    plus one chunk (whose window is full)."""
    chunk = config.latent_frames_per_chunk
    return (chunks or -(-config.window_frames // chunk) + 1) * chunk


def sink_gaps(config: ModelConfig, chunks: int) -> list[int]:
    """How far the cached forward moves the sink up for each of a stream's first `chunks`
    chunks (`CausalWanDiT.plan_blocks`): 0 until the window is full, then the frames
    between the sink and the window, so that the sink sits right before the window."""
    gaps = []
    for c in range(chunks):
        first = 1 + c * config.latent_frames_per_chunk
        gaps.append(first - len(context_frame_indices(first, config.sink_frames, config.window_frames)))
    return gaps


def clip_layout(
    config: ModelConfig, device: torch.device | str = "cpu", chunks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temporal positions [S + 2L] and frame mask [S + 2L, S + 2L] of
    [sink copies | context copy | clip], for a clip of `chunks` chunks (`clip_length`).

    Chunk c of either copy sees what the cached forward shows its first frame: the sink, at
    the position the cached forward moves it to, and the window's frames (from the context
    copy), plus its own chunk. There is one copy of the sink per distinct move (S of them, 1
    for clips that end before the window is first exceeded); each sees only itself, as the
    first image's prefill does, so all have the sink's features, at their own position.
    """
    if config.sink_frames != 1:
        raise ValueError("the training layout assumes one sink frame (the first image)")
    n, chunk = clip_length(config, chunks), config.latent_frames_per_chunk
    gaps = sink_gaps(config, n // chunk)
    moves = sorted(set(gaps))
    s = len(moves)
    total = s + 2 * n
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[range(s), range(s)] = True
    for c, gap in enumerate(gaps):
        first = 1 + c * chunk
        own = [s - 1 + f for f in range(first, first + chunk)]
        window = [s - 1 + f for f in context_frame_indices(first, 1, config.window_frames) if f]
        for q in own:
            mask[q, [moves.index(gap), *window, *own]] = True
            mask[q + n, [moves.index(gap), *window]] = True
            mask[q + n, [o + n for o in own]] = True
    positions = torch.cat([torch.tensor(moves), torch.arange(1, n + 1), torch.arange(1, n + 1)])
    return positions.to(device), mask.to(device)


def unrolled_count(share: float, batch: int) -> int:
    """How many clips of a batch the unrolled objective takes (the last ones; `Trainer.objective`)."""
    return round(share * batch)


def _check_state_probe(cfg: TrainConfig) -> None:
    """ValueError where the state probe's settings cannot run with the rest of `cfg`."""
    if not 0 <= cfg.state_weight < math.inf:
        raise ValueError(f"--state-weight must be finite and at least 0, got {cfg.state_weight}")
    if cfg.state_weight and cfg.rollout_share > 0:
        raise ValueError("--state-weight and --rollout-share (rollout_share) cannot be combined: choose one")
    if cfg.state_target not in STATE_TARGETS:
        known = ", ".join(STATE_TARGETS)
        raise ValueError(f"--state-target must be one of {known}, got {cfg.state_target!r}")
    if not cfg.state_warmup >= 0:
        raise ValueError(f"--state-warmup must be at least 0, got {cfg.state_warmup}")
    if not 0 < cfg.state_turn_weight < math.inf:
        raise ValueError(f"--state-turn-weight must be finite and above 0, got {cfg.state_turn_weight}")
    settings = ("state_target", "state_warmup", "state_turn_weight")
    if not cfg.state_weight and any(getattr(cfg, n) != getattr(TrainConfig, n) for n in settings):
        raise ValueError(
            "--state-target, --state-warmup and --state-turn-weight apply to the state probe: "
            "give --state-weight"
        )
    if cfg.state_layer is not None and not (cfg.state_weight and cfg.state_layer >= 1):
        raise ValueError(f"--state-layer must be at least 1 and needs --state-weight, got {cfg.state_layer}")
    if cfg.state_turn_weight != 1.0 and cfg.state_target != "change":
        raise ValueError("--state-turn-weight weighs the change's turn: give --state-target change")


def check_train_config(cfg: TrainConfig, model_config: ModelConfig) -> None:
    """ValueError where `cfg` cannot train `model_config`: the unrolled objective and its
    adversarial term (`check_unroll`), the state probe's settings, and a `state_layer` the
    model has no block for."""
    check_unroll(cfg)
    _check_state_probe(cfg)
    layers = model_config.num_layers
    if cfg.state_layer is not None and cfg.state_layer > layers:
        raise ValueError(f"--state-layer {cfg.state_layer}: the model has {layers} blocks")


def check_unroll(cfg: TrainConfig) -> None:
    """ValueError where `cfg.unroll_share` cannot run with the rest of `cfg`."""
    if not 0 <= cfg.unroll_share <= 1:
        raise ValueError(f"--unroll-share (unroll_share) must be in [0, 1], got {cfg.unroll_share}")
    if cfg.unroll_loss not in UNROLL_LOSSES:
        raise ValueError(f"--unroll-loss must be one of {', '.join(UNROLL_LOSSES)}, got {cfg.unroll_loss!r}")
    if not (0 <= cfg.adversarial_weight < math.inf) or cfg.adversarial_start < 0:
        raise ValueError(
            "--adversarial-weight must be finite, and neither it nor --adversarial-start negative"
        )
    if not 0 <= cfg.adversarial_background <= 1:
        raise ValueError(f"--adversarial-background must be in [0, 1], got {cfg.adversarial_background}")
    if not 0 < cfg.adversarial_max_scale <= ADAPTIVE_WEIGHT_CAP:
        raise ValueError(
            f"--adversarial-max-scale must be above 0 and at most {ADAPTIVE_WEIGHT_CAP:g}, "
            f"got {cfg.adversarial_max_scale}"
        )
    if not cfg.adversarial_weight:
        for name in ("adversarial_start", "adversarial_background", "adversarial_max_scale"):
            if getattr(cfg, name) != getattr(TrainConfig, name):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} applies to the adversarial term: give --adversarial-weight too")
    if cfg.unroll_share == 0:
        if cfg.unroll_loss != "l2":
            raise ValueError("--unroll-loss applies to the unrolled objective: give --unroll-share too")
        if cfg.adversarial_weight:
            raise ValueError("--adversarial-weight judges the unrolled rollouts: give --unroll-share too")
        return
    if cfg.clip_chunks is None:
        raise ValueError("--unroll-share unrolls stream clips: give --clip-chunks (clip_chunks) too")
    if cfg.rollout_share > 0:
        raise ValueError("--unroll-share and --rollout-share (rollout_share) cannot be combined: choose one")
    if unrolled_count(cfg.unroll_share, cfg.batch_size) == 0:
        raise ValueError(
            f"--unroll-share {cfg.unroll_share} of a batch of {cfg.batch_size} clips rounds to no "
            "clip: raise the share or --batch-size"
        )


class UnrollCut(NamedTuple):
    """What the unrolled sampler runs for one chunk (`unroll_layouts`)."""

    positions: torch.Tensor  # [F] temporal positions of the frames kept
    mask: torch.Tensor  # [F, F] their frame mask
    sinks: int  # copies of the sink kept, first
    max_position: int  # the largest of `positions`
    frames: torch.Tensor  # [F] the kept frames' places in the whole layout


def unroll_layouts(config: ModelConfig, chunks: int, device: torch.device | str = "cpu") -> list[UnrollCut]:
    """Per chunk c of a stream clip of `chunks` chunks, the part of the whole layout
    (`clip_layout`) that the clip's chunk c reads, directly or through the frames it reads:
    [the sink copies that chunk c and the context before it use | context copy of chunks 0 ..
    c-1 | the clip's chunk c]. What the unrolled sampler (`Trainer.unrolled`) runs for chunk
    c. The set is closed: nothing cut away is attended by what is kept, so the kept frames
    compute what they compute in the whole layout. A layout whose chunk c reads anything else
    (a later context chunk, another clip chunk) is refused."""
    positions, mask = clip_layout(config, "cpu", chunks)
    n, chunk = clip_length(config, chunks), config.latent_frames_per_chunk
    sinks = len(positions) - 2 * n
    cuts = []
    for c in range(chunks):
        keep = torch.zeros(len(positions), dtype=torch.bool)
        keep[sinks + n + c * chunk : sinks + n + (c + 1) * chunk] = True
        while not torch.equal(grown := keep | mask[keep].any(0), keep):
            keep = grown
        context = [True] * (c * chunk) + [False] * (n - c * chunk)
        if keep[sinks : sinks + n].tolist() != context or int(keep[sinks + n :].sum()) != chunk:
            raise RuntimeError(
                f"chunk {c} of the unrolled sampler reads frames other than the sinks, the context "
                "before it and itself"
            )
        index = keep.nonzero()[:, 0]
        cuts.append(
            UnrollCut(
                positions[index].to(device),
                mask[index][:, index].to(device),
                int(keep[:sinks].sum()),
                int(positions[index].max()),
                index.to(device),
            )
        )
    return cuts


class ClipBatcher:
    """Draws training samples from a data set held on the training device."""

    def __init__(
        self,
        data: Dataset,
        config: ModelConfig,
        device: torch.device,
        generator: torch.Generator,
        start_share: float,
        chunks: int | None = None,
    ) -> None:
        """`chunks`: chunks per clip (default: the window's and one more); given, every clip is
        a stream of its own (`stream_clips`)."""
        if data.spec.size != config.height or config.height != config.width:
            raise ValueError(
                f"data set frames are {data.spec.size}px; model {config.id} needs {config.height}px"
            )
        self.chunk = config.latent_frames_per_chunk
        self.window = config.window_frames
        self.positions, self.frame_mask = clip_layout(config, device, chunks)
        self.clip = clip_length(config, chunks)
        self.sinks = len(self.positions) - 2 * self.clip  # copies of the sink (clip_layout)
        # Default clips keep the episode's first frame as their sink, so that a clip that
        # starts late has an old sink, as a long stream has; but its first chunks are then
        # context without their own past, so only its last chunk, whose window is full, is
        # trained. Stream clips instead start from the frame before the clip, as a stream
        # started there would: every chunk has exactly its served context and is trained, and
        # clips longer than the window reach the chunks where the sink has moved.
        self.stream_clips = chunks is not None
        self.max_position = int(self.positions.max())
        self.num_chunks = self.clip // self.chunk
        if data.spec.steps < self.clip + 1:
            raise ValueError(
                f"episodes need at least {self.clip + 1} steps for this model, have {data.spec.steps}"
            )
        self.frames = torch.from_numpy(np.array(data.frames)).to(device)  # uint8 [E, T+1, S, S, 3]
        self.actions = torch.from_numpy(data.actions).to(device)  # [E, T, 2]
        # The recorded scenes [E, T+1, 5], where the data set has them (`data.py`).
        self.states = None if data.states is None else torch.from_numpy(data.states).to(device)
        self.device = device
        self.gen = generator
        self.start_share = start_share
        self.steps = data.spec.steps
        # Chunks whose attention window is full: the only ones trained on clips that start late.
        first_frames = [1 + c * self.chunk for c in range(self.num_chunks)]
        self.full_window = torch.tensor([f >= 1 + self.window for f in first_frames], device=device)

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        g, dev, n = self.gen, self.device, self.clip
        episodes = torch.randint(0, self.frames.shape[0], (batch_size,), generator=g, device=dev)
        late = torch.randint(2, self.steps - n + 2, (batch_size,), generator=g, device=dev)
        at_start = torch.rand(batch_size, generator=g, device=dev) < self.start_share
        start = torch.where(at_start, torch.ones_like(late), late)
        index = start[:, None] + torch.arange(n, device=dev)  # video frames of the clip
        clip = self.frames[episodes[:, None], index]  # [B, L, S, S, 3]
        sink = self.frames[episodes, start - 1 if self.stream_clips else 0][:, None]
        frames = frames_from_uint8(torch.cat([sink, clip], 1))  # [B, 3, 1+L, S, S]
        actions = self.actions[episodes[:, None], index - 1]  # action that produced each clip frame
        loss_chunks = at_start[:, None] | self.full_window[None, :] | self.stream_clips  # [B, chunks]
        batch = {"frames": frames, "actions": actions, "loss_chunks": loss_chunks}
        if self.states is not None:
            batch["states"] = self.states[episodes[:, None], index]  # each clip frame's scene
            # [B, chunks]: the scene of the frame just before each chunk
            before = start[:, None] + torch.arange(0, n, self.chunk, device=dev) - 1
            batch["states_before"] = self.states[episodes[:, None], before]
        return batch


def own_process_group() -> None:
    """In a worker process: leave the trainer's process group. `timeout` and a terminal
    signal the whole group; a worker killed mid-task would leave the trainer's `pool.map`
    waiting for ever, where the trainer means to finish its step, save and export
    (`cli/train.py`). The pool still ends its workers itself (SIGTERM to each), and a
    worker whose trainer dies ends when its task pipe closes."""
    os.setpgrp()


class RolloutContext:
    """The model's own predictions of recorded episodes, as context for training samples.

    `refresh` rolls `episodes` random episodes out with their recorded actions through an
    in-process engine, all at once and batched (`engine.generate_all`: what a server
    serves, equal to the sequential reference generator up to float rounding), in `final`
    mode, with the weights as they are. With default clips each rollout starts from the episode's first
    frame and runs `frames` frames, and `sample` draws clips that end with a chunk whose
    window is full, inside a rollout: the rollout's frames at the same steps as the context
    copy. Only that last chunk is trained: the others have no drifted context before them.
    With stream clips (`ClipBatcher(chunks=K)`) each rollout is one clip instead: a stream
    started from a random frame (the clip's sink) for the clip's K chunks, so that every
    chunk after the first has the model's own earlier chunks as its context, exactly as
    served, and is trained; the first chunk's context is the true sink alone, and its
    target the true chunk.

    The target of a chunk with the model's context is either the true frames
    (`targets="true"`) or the environment continued from the scene that the context's last
    two frames show (`"simulated"`, `pusht/pose.py: continue_frames`; chunks whose frames do
    not show both objects, or a block within `max_mismatch` of a T, are not trained).
    """

    def __init__(
        self,
        model: WorldModel,
        batcher: ClipBatcher,
        episodes: int,
        frames: int,
        generator: torch.Generator,
        targets: str = "true",
        workers: int = 1,
        max_mismatch: float = MAX_MISMATCH,
    ) -> None:
        chunk, n = batcher.chunk, batcher.clip
        self.stream = batcher.stream_clips
        if self.stream:
            frames = n  # each rollout is one stream clip
        if frames < n or frames % chunk:
            raise ValueError(
                f"rollouts need whole chunks of {chunk} frames and at least {n} frames, got {frames}"
            )
        if batcher.steps < frames:
            raise ValueError(f"episodes have {batcher.steps} steps; rollouts of {frames} frames need as many")
        if model.config.first_chunk_frames != model.config.frames_per_chunk:
            raise ValueError("rollout context assumes a first chunk as long as the others")
        if targets not in ROLLOUT_TARGETS:
            raise ValueError(f"rollout targets must be one of {ROLLOUT_TARGETS}, got {targets!r}")
        self.model, self.batcher, self.gen = model, batcher, generator
        self.num_episodes, self.num_frames = episodes, frames
        self.targets, self.workers, self.max_mismatch = targets, workers, max_mismatch
        self.episodes: torch.Tensor | None = None  # [R] data set episodes of the rollouts
        self.starts: torch.Tensor | None = None  # [R] the step of each rollout's first frame, 1 up
        self.seeds: torch.Tensor | None = None  # [R] their noise seeds
        self.frames: torch.Tensor | None = None  # uint8 [R, frames, S, S, 3]: frames 1..frames
        # "simulated": uint8 [R, chunks, chunk, S, S, 3], the target of trained chunk c, and
        # [R, chunks] bool, which ones exist.
        self.simulated: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        # The first chunk trained on the model's context: by default the first whose window is
        # full; in a stream clip the second (the first has the true sink alone before it).
        self.first_chunk = 1 if self.stream else n // chunk - 1
        self.refreshes = 0
        self.skipped = 0  # batches made without rollout samples, since no chunk had a target
        self.chunks_simulated = 0  # "simulated": chunks simulated so far,
        self.chunks_with_target = 0  # and those of them given a target
        self.simulate_seconds = 0.0
        self._pool = None

    @torch.no_grad()
    def refresh(self) -> None:
        from ..engine import StreamRequest, generate_all_sync

        b, dev = self.batcher, self.batcher.device
        r = self.num_episodes
        episodes = torch.randint(0, b.frames.shape[0], (r,), generator=self.gen, device=dev)
        if self.stream:  # the clip's first frame, as ClipBatcher draws it: the sink is the one before
            starts = torch.randint(1, b.steps - self.num_frames + 2, (r,), generator=self.gen, device=dev)
        else:
            starts = torch.ones(r, dtype=torch.long, device=dev)
        seeds = torch.randint(0, 2**31 - 1, (r,), generator=self.gen, device=dev)
        requests = [
            StreamRequest(
                seed=seed,
                num_chunks=self.num_frames // b.chunk,
                image=b.frames[e, start - 1].cpu().numpy(),
                actions=b.actions[e, start - 1 : start - 1 + self.num_frames].cpu().numpy(),
                kv_mode="final",
            )
            for e, start, seed in zip(episodes.tolist(), starts.tolist(), seeds.tolist(), strict=True)
        ]
        # All rollouts at once, batched, as a server serves them. On a CPU the engine works on
        # a thread of its own (engine/executor.py), a second OpenMP team beside training's; a
        # 60-step run on 2 cores (batch 8, 3-chunk clips) made 0.19 steps/s with and without
        # rollouts, so it did not show there.
        frames = generate_all_sync(self.model, requests)
        self.episodes, self.starts, self.seeds = episodes, starts, seeds
        self.frames = torch.from_numpy(np.stack(frames)).to(dev)
        chunks = self.num_frames // b.chunk
        self.valid = torch.zeros(len(episodes), chunks, dtype=torch.bool, device=dev)
        # A stream clip's first chunk has the true sink alone as context: trained on the truth.
        self.valid[:, 0 if self.stream else self.first_chunk :] = True
        if self.targets == "simulated":
            self._simulate()
        self.refreshes += 1

    def _simulate(self) -> None:
        """The simulated target of every trained chunk of every rollout."""
        from .pose import continue_frames

        assert self.frames is not None and self.episodes is not None and self.valid is not None
        assert self.starts is not None
        start = time.perf_counter()
        b, k = self.batcher, self.batcher.chunk
        own = self.frames.cpu().numpy()
        # The actions of each rollout, from its first frame's (the action before frame f is f - 1).
        steps = (self.starts - 1)[:, None] + torch.arange(own.shape[1], device=self.starts.device)
        actions = b.actions[self.episodes[:, None], steps].cpu().numpy()
        pairs = [(r, c) for r in range(len(own)) for c in range(self.first_chunk, own.shape[1] // k)]
        # The context's last frame before chunk c is the rollout's frame c k (from its start), at c k - 1.
        jobs = [
            (own[r, c * k - 2], own[r, c * k - 1], actions[r, c * k : (c + 1) * k], self.max_mismatch)
            for r, c in pairs
        ]
        if self.workers > 1 and self._pool is None:
            self._pool = mp.get_context("spawn").Pool(self.workers, initializer=own_process_group)
        pool = self._pool
        results = pool.map(continue_frames, jobs, chunksize=4) if pool else map(continue_frames, jobs)
        simulated = np.zeros((*self.valid.shape, k, *own.shape[2:]), np.uint8)
        for (r, c), frames in zip(pairs, results, strict=True):
            self.valid[r, c] = frames is not None
            if frames is not None:
                simulated[r, c] = frames
        self.simulated = torch.from_numpy(simulated).to(b.device)
        self.chunks_simulated += len(pairs)
        self.chunks_with_target += int(self.valid[:, self.first_chunk :].sum())
        self.simulate_seconds += time.perf_counter() - start

    @property
    def has_targets(self) -> bool:
        """Whether some chunk with the model's own context before it has a target."""
        return self.valid is not None and bool(self.valid[:, self.first_chunk :].any())

    def close(self) -> None:
        """Stop the simulation processes, if any."""
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        if self.frames is None or self.episodes is None or self.valid is None:
            raise RuntimeError("refresh() the rollouts before sampling them")
        if not self.has_targets:
            raise RuntimeError(
                "no rollout chunk has a target: no context frame shows the agent and a T-shaped block"
            )
        if self.stream:
            return self._sample_streams(batch_size)
        b, g, dev = self.batcher, self.gen, self.batcher.device
        n, chunk = b.clip, b.chunk
        # The trained chunk c starts at frame 1 + c * chunk; the clip ends with it and starts at
        # frame 1 at the earliest, so c >= n / chunk - 1 (its window is then full).
        candidates = self.valid.nonzero()
        drawn = candidates[torch.randint(0, len(candidates), (batch_size,), generator=g, device=dev)]
        pick, c = drawn[:, 0], drawn[:, 1]
        index = (1 + (c + 1) * chunk - n)[:, None] + torch.arange(n, device=dev)  # frames of the clip
        episodes = self.episodes[pick]
        clip = b.frames[episodes[:, None], index]
        if self.targets == "simulated":
            assert self.simulated is not None
            clip[:, -chunk:] = self.simulated[pick, c]
        sink = b.frames[episodes, 0][:, None]
        own = self.frames[pick[:, None], index - 1]  # the rollout's frame f is at f - 1

        loss_chunks = torch.zeros(batch_size, n // chunk, dtype=torch.bool, device=dev)
        loss_chunks[:, -1] = True
        return {
            "frames": frames_from_uint8(torch.cat([sink, clip], 1)),
            "actions": b.actions[episodes[:, None], index - 1],
            "loss_chunks": loss_chunks,
            "own": frames_from_uint8(own),
        }

    def _sample_streams(self, batch_size: int) -> dict[str, torch.Tensor]:
        """Stream-clip samples: whole rollouts, each the clip from its start, its sink the frame
        before; every chunk with a target is trained (`valid`)."""
        assert self.frames is not None and self.episodes is not None and self.starts is not None
        assert self.valid is not None
        b, dev, k = self.batcher, self.batcher.device, self.batcher.chunk
        useful = self.valid[:, self.first_chunk :].any(1).nonzero()[:, 0]  # rollouts with a target
        pick = useful[torch.randint(0, len(useful), (batch_size,), generator=self.gen, device=dev)]
        episodes, starts = self.episodes[pick], self.starts[pick]
        index = starts[:, None] + torch.arange(b.clip, device=dev)  # the clip's frames
        clip = b.frames[episodes[:, None], index]
        valid = self.valid[pick]
        if self.targets == "simulated":
            assert self.simulated is not None
            simulated = self.simulated[pick].flatten(1, 2)  # [B, L, S, S, 3]
            chosen = valid.clone()
            chosen[:, 0] = False  # the first chunk's target is the true chunk
            chosen = chosen.repeat_interleave(k, 1)[:, :, None, None, None]
            clip = torch.where(chosen, simulated, clip)
        sink = b.frames[episodes, starts - 1][:, None]
        return {
            "frames": frames_from_uint8(torch.cat([sink, clip], 1)),
            "actions": b.actions[episodes[:, None], index - 1],
            "loss_chunks": valid,
            "own": frames_from_uint8(self.frames[pick]),
        }


def merge_batches(
    clips: dict[str, torch.Tensor], rollouts: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One batch of `clips` (true context) and `rollouts` (own context); `own_mask` says which."""
    own_mask = torch.cat(
        [
            torch.zeros(len(clips["frames"]), dtype=torch.bool, device=clips["frames"].device),
            torch.ones(len(rollouts["frames"]), dtype=torch.bool, device=rollouts["frames"].device),
        ]
    )
    merged = {k: torch.cat([clips[k], rollouts[k]]) for k in ("frames", "actions", "loss_chunks")}
    own = torch.cat([torch.zeros_like(clips["frames"][:, :, 1:]), rollouts["own"]])
    return {**merged, "own": own, "own_mask": own_mask}


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _add_new_spatial_actions(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    """Weights trained before the spatial action embedding existed: fill in its own (zero
    output) initial values, so fine-tuning starts from exactly the old model. True if added."""
    prefix = "action_adapter.spatial."
    new = [k for k in own if k.startswith(prefix)]
    if not new or any(k in state for k in new):
        return False
    state.update({k: own[k] for k in new})
    return True


# A block's outputs into the residual stream: zero them and the block is the identity.
_BLOCK_OUTPUTS = ("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2")


def _block_count(state: dict[str, torch.Tensor]) -> int:
    found = {int(k.split(".")[2]) for k in state if k.startswith("transformer.blocks.")}
    return max(found) + 1 if found else 0


def grow_blocks(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (n blocks) spread over a model of N > n blocks (`own`, its initial values),
    computing exactly what `state` computes: one new block follows each of the first N - n
    old blocks (old block i goes to i + min(i, N - n)), and the new blocks keep their own
    initial values with their outputs zeroed, so each adds nothing until training moves it."""
    old, new = _block_count(state), _block_count(own)
    extra = new - old
    grown = {k: v for k, v in state.items() if not k.startswith("transformer.blocks.")}
    for key, value in state.items():
        if key.startswith("transformer.blocks."):
            _, _, index, rest = key.split(".", 3)
            i = int(index)
            grown[f"transformer.blocks.{i + min(i, extra)}.{rest}"] = value
    for key, value in own.items():
        if key.startswith("transformer.blocks.") and key not in grown:
            zero = any(f".{name}." in key for name in _BLOCK_OUTPUTS)
            grown[key] = torch.zeros_like(value) if zero else value
    return grown


def training_target(
    config: ModelConfig, x0: torch.Tensor, noise: torch.Tensor, sink: torch.Tensor, context: torch.Tensor
) -> torch.Tensor:
    """What the DiT should output for a clip's latents x0 [B, C, L, H, W] (L whole chunks
    after the first frame's latent `sink`): the flow, x0, or for "delta" x0's change since
    the last frame before each chunk. That frame is taken from the chunk's context (the true
    latents, or the model's own for rollout samples), as serving takes the model's own."""
    if config.prediction == "flow":
        return noise - x0
    if config.prediction == "x0":
        return x0
    n, chunk = x0.shape[2], config.latent_frames_per_chunk
    last = torch.cat([image_as_last_frame(config, sink), context[:, :, chunk - 1 : n - 1 : chunk]], 2)
    return x0 - last.repeat_interleave(chunk, 2)


def _load_init(model: WorldModel, init: str | Path) -> None:
    """Fine-tuning: start from exported weights (ignored when resuming a checkpoint). Weights
    with fewer blocks than the model are grown into it (`grow_blocks`)."""
    from ..models.checkpoint import load_dit_state_dict, load_into
    from ..models.world_model import _check_training_record, _prefix_transformer, recorded_config

    # Same latents, and the same prediction but for x0 <-> delta (the same network, whose
    # output learns to leave out the last frame).
    recorded = recorded_config(model.config, str(init)).prediction
    if recorded != model.config.prediction:
        wanted = model.config.prediction
        print(f"note: {init} was trained to predict {recorded!r}; fine-tuned to predict {wanted!r}")
    _check_training_record(model.config.with_prediction(recorded), str(init))
    state = _prefix_transformer(load_dit_state_dict(str(init)))
    own = model.dit.state_dict()
    if _add_new_spatial_actions(own, state):
        print(f"note: {init} has no spatial action embedding; it starts at zero")
    old, new = _block_count(state), model.config.num_layers
    if 0 < old < new:
        print(f"note: {init} has {old} blocks; grown to {new} (the new blocks start as the identity)")
        state = grow_blocks(own, state)
    load_into(model.dit, state, what=f"--init {init}")


class TeacherForced(NamedTuple):
    """`Trainer.forward` of a batch of B clips of L frames."""

    pred: torch.Tensor  # the model's output for the clips' frames [B, C, L, h, w]
    target: torch.Tensor  # what it is trained to output [B, C, L, h, w]
    regime: torch.Tensor  # [B] each clip's context: 0 clean, 1 final, 2 noisy
    own: torch.Tensor  # [B] bool: the context is the model's own rollout
    served: torch.Tensor  # [B, L] bool: denoised from pure noise after a true clean context
    hidden: torch.Tensor | None  # with the state probe, the frames' hidden states [B, L * P, D] it reads


class Trainer:
    def __init__(
        self,
        model_config: ModelConfig,
        train_config: TrainConfig,
        data: Dataset,
        workdir: str | Path,
        device: str = "auto",
        init: str | Path | None = None,
        run_settings: dict | None = None,
    ) -> None:
        check_train_config(train_config, model_config)
        self.mcfg = model_config
        self.cfg = train_config
        # What else defines the run (the CLI's data spec and start weights): kept in the
        # checkpoint, and a resume with other values is refused (`check_resume`).
        self.run_settings = run_settings or {}
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.device = resolve_device(device)
        model = WorldModel.load(model_config, random_weights=True, device=self.device, dtype=torch.float32)
        if init is not None:
            _load_init(model, init)
        self.model = model  # rollouts are served with it (`RolloutContext`)
        self.dit = model.dit.requires_grad_(True).train()
        self.steps_sigma = torch.tensor([t / 1000.0 for t in model.schedule.timesteps], device=self.device)
        self.ema = {k: v.detach().clone() for k, v in self.dit.state_dict().items()}
        self._forward = (
            torch.compile(self.dit.forward_masked) if train_config.compile else self.dit.forward_masked
        )
        self.step = 0
        self.gen = torch.Generator(device=self.device).manual_seed(train_config.seed)
        self.batcher = ClipBatcher(
            data, model_config, self.device, self.gen, train_config.start_share, train_config.clip_chunks
        )
        self.probe = self._state_probe()
        self.opt = self._optimizer()
        self.rollouts = self._rollout_context()
        # The unrolled sampler's part of the layout for each chunk (`unrolled`): stream clips only.
        self.unroll_cuts = (
            unroll_layouts(model_config, self.batcher.num_chunks, self.device)
            if self.batcher.stream_clips
            else []
        )
        self.text_zeros = torch.zeros(
            model_config.text_len, self.dit.transformer.config.text_dim, device=self.device
        )
        # With `adversarial_weight`: the discriminator of the unrolled rollouts and its optimiser.
        self.disc, self.disc_opt = self._discriminator()
        self.history: list[dict] = []
        # Set (to a reason, e.g. "SIGTERM") to end `run` after the current step, with a
        # checkpoint, as if its time were up (`cli/train.py` sets it on SIGTERM and Ctrl-C).
        self.stop_requested: str | None = None
        self._load_checkpoint()

    def _rollout_context(self) -> RolloutContext | None:
        """The model's own rollouts as context (`rollout_share` > 0), or None."""
        cfg = self.cfg
        if not 0 <= cfg.rollout_share <= 1:
            raise ValueError(f"rollout_share must be in [0, 1], got {cfg.rollout_share}")
        if cfg.rollout_share == 0:
            return None
        if self.batcher.stream_clips and self.batcher.num_chunks < 2:
            raise ValueError(
                "rollouts on stream clips need clips of 2 chunks or more: the first has no own context"
            )
        return RolloutContext(
            self.model,
            self.batcher,
            cfg.rollout_episodes,
            cfg.rollout_frames,
            self.gen,
            targets=cfg.rollout_targets,
            workers=cfg.rollout_workers,
            max_mismatch=cfg.rollout_max_mismatch,
        )

    def _state_probe(self) -> StateProbe | None:
        """The state probe (`state_weight`), from the run's seed, on the training device."""
        if not self.cfg.state_weight:
            return None
        if self.batcher.states is None:
            raise ValueError(
                "--state-weight needs the recorded scenes (states.npy), which this data set was "
                "recorded without: record it again into a new --data folder"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            probe = StateProbe(self.dit.dim, self.dit.tokens_per_frame)
        return probe.to(self.device).train()

    def _optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the DiT (and the state probe), with no weight decay on vectors, norms
        and tables."""
        decay, no_decay = [], []
        named = list(self.dit.named_parameters())
        if self.probe is not None:
            named += [(f"probe.{name}", p) for name, p in self.probe.named_parameters()]
        for name, p in named:
            (no_decay if p.ndim < 2 or "norm" in name or "table" in name else decay).append(p)
        return torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.cfg.lr,
            betas=(0.9, 0.99),
        )

    def _discriminator(self) -> tuple[ClipDiscriminator | None, torch.optim.Optimizer | None]:
        """The discriminator (`adversarial_weight`), from the run's seed, and its optimiser."""
        if not self.cfg.adversarial_weight:
            return None, None
        with torch.random.fork_rng(devices=[]):  # its initial weights follow the run's seed
            torch.default_generator.manual_seed(self.cfg.seed)  # built on the CPU
            disc = ClipDiscriminator(self.mcfg.height).to(self.device).train()
        return disc, discriminator_optimizer(disc, self.cfg.lr)

    # --- checkpoints ------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.workdir / "checkpoint.pt"

    def _load_checkpoint(self) -> None:
        if not self.checkpoint_path.is_file():
            return
        state = load_checkpoint(self.checkpoint_path, self.device)
        check_resume(self.checkpoint_path, state, self.mcfg, self.cfg, self.run_settings)
        if not self.run_settings:  # a caller that gives none keeps what the checkpoint records
            self.run_settings = state.get("run_settings", {})
        self.dit.load_state_dict(state["dit"])
        self.ema = state["ema"]
        self.opt.load_state_dict(state["opt"])
        for key, part, what in (
            ("disc", self.disc, "a discriminator (--adversarial-weight)"),
            ("probe", self.probe, "a state probe (--state-weight)"),
        ):
            if (part is not None) != (key in state):  # a checkpoint from before the setting
                raise ValueError(
                    f"{self.checkpoint_path} was trained {'without' if part is not None else 'with'} "
                    f"{what}; use another --workdir, with --init set to its exported weights"
                )
        if self.disc is not None:
            self.disc.load_state_dict(state["disc"])
            self.disc_opt.load_state_dict(state["disc_opt"])
        if self.probe is not None:
            self.probe.load_state_dict(state["probe"])
        self.step = state["step"]
        self.history = state.get("history", [])
        self.gen.set_state(state["rng"].cpu())

    def save_checkpoint(self) -> None:
        state = {
            "dit": self.dit.state_dict(),
            "ema": self.ema,
            "opt": self.opt.state_dict(),
            "step": self.step,
            "history": self.history,
            "rng": self.gen.get_state(),
            "model_config": asdict(self.mcfg),
            "train_config": asdict(self.cfg),
            "run_settings": self.run_settings,
        }
        if self.disc is not None:
            state["disc"] = self.disc.state_dict()
            state["disc_opt"] = self.disc_opt.state_dict()
        if self.probe is not None:
            state["probe"] = self.probe.state_dict()
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint_path)

    def export(self, path: str | Path) -> Path:
        """EMA weights, float16, in the layout `WorldModel.load` reads (diffusers transformer keys)."""
        out = {}
        for key, value in self.ema.items():
            name = key[len("transformer.") :] if key.startswith("transformer.") else key
            out[name] = value.detach().to("cpu", torch.float16).contiguous()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "model": self.mcfg.id,
            "num_layers": str(self.mcfg.dit["num_layers"]),
            "prediction": self.mcfg.prediction,
            "latent_space": self.mcfg.latent_space,
            "step": str(self.step),
            "train_config": json.dumps(asdict(self.cfg)),
        }
        _save_whole(out, path, meta)
        if self.probe is not None:
            probe = {k: v.detach().to("cpu").contiguous() for k, v in self.probe.state_dict().items()}
            _save_whole(probe, state_probe_path(path), {"step": str(self.step), "model": self.mcfg.id})
        return path

    # --- one step ---------------------------------------------------------------------
    def _sigmas(self, b: int, chunks: int) -> torch.Tensor:
        g, dev = self.gen, self.device
        uniform = torch.rand(b, chunks, generator=g, device=dev).clamp_min(1e-3)
        discrete = self.steps_sigma[
            torch.randint(0, len(self.steps_sigma), (b, chunks), generator=g, device=dev)
        ]
        pick = torch.rand(b, chunks, generator=g, device=dev) < self.cfg.discrete_share
        return torch.where(pick, discrete, uniform)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The teacher-forced loss of a batch (`forward`), with the state probe's term."""
        out = self.forward(batch)
        err = self._weighted_error(out.pred, out.target, batch["frames"])  # [B, L]
        mask = batch["loss_chunks"].repeat_interleave(self.batcher.chunk, 1).float()
        loss = (err * mask).sum() / mask.sum().clamp_min(1.0)
        with torch.no_grad():
            per_sample = (err * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        stats = _regime_losses(per_sample, out.regime, out.own)
        if out.hidden is not None:
            # While the probe warms up, it reads the hidden states without shaping them.
            warm = self.step >= self.cfg.state_warmup
            probed = self.probe(out.hidden if warm else out.hidden.detach())  # [B, L, STATE_DIM]
            target, scale = self._state_targets(batch)
            state_loss, more = state_loss_and_stats(probed, target, mask, out.served, scale)
            loss = loss + self.cfg.state_weight * state_loss
            stats.update(more)
        return loss, stats

    def _state_targets(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """The probe's targets for the clip frames of `batch` [B, L, STATE_DIM] (`state_target`),
        and the world units of one unit of their positions."""
        scenes = batch["states"].float()
        if self.cfg.state_target == "scene":
            return state_targets(scenes), WORLD_HALF
        before = batch["states_before"].float().repeat_interleave(self.batcher.chunk, 1)
        return change_targets(scenes, before, self.cfg.state_turn_weight), CHANGE_SCALE

    def forward(self, batch: dict[str, torch.Tensor]) -> TeacherForced:
        """The training forward of a batch of clips, each in a context regime and at noise
        levels drawn from the trainer's generator; with the state probe, also the trained
        frames' hidden states that the probe reads."""
        g, dev = self.gen, self.device
        frames, actions = batch["frames"], batch["actions"]
        b = frames.shape[0]
        n, chunk = self.batcher.clip, self.batcher.chunk
        chunks = n // chunk
        latents0 = frames_to_latents(frames, self.mcfg.anchored_pixels)
        sink, x0 = latents0[:, :, :1], latents0[:, :, 1:]
        weights = torch.tensor(served_regimes(self.cfg.regime_weights, self.mcfg), device=dev)
        regime = torch.multinomial(weights, b, replacement=True, generator=g)  # 0 clean, 1 final, 2 noisy
        own = batch.get("own_mask", torch.zeros(b, dtype=torch.bool, device=dev))
        regime = torch.where(own, torch.ones_like(regime), regime)  # own context: as `final` keeps it
        sigma = self._sigmas(b, chunks)
        sigma = torch.where((regime == 2)[:, None], sigma[:, :1].expand(-1, chunks), sigma)
        sigma_f = sigma.repeat_interleave(chunk, 1)  # [B, L]
        noise = torch.randn(x0.shape, generator=g, device=dev)
        s = sigma_f[:, None, :, None, None]
        x_t = (1 - s) * x0 + s * noise
        last = self.steps_sigma[-1]
        ctx_noise = torch.randn(x0.shape, generator=g, device=dev)
        x0_ctx = x0
        if own.any():
            own_frames = torch.cat([frames[:, :, :1], batch["own"]], 2)
            own_latents = frames_to_latents(own_frames, self.mcfg.anchored_pixels)[:, :, 1:]
            x0_ctx = torch.where(own[:, None, None, None, None], own_latents, x0)
        ctx_final = (1 - last) * x0_ctx + last * ctx_noise
        r = regime[:, None, None, None, None]
        ctx = torch.where(r == 0, x0, torch.where(r == 1, ctx_final, x_t))
        ctx_sigma = torch.where(
            (regime == 0)[:, None],
            torch.zeros_like(sigma_f),
            torch.where((regime == 1)[:, None], last.expand_as(sigma_f), sigma_f),
        )
        pred, hidden = self._layout_forward(sink, ctx, ctx_sigma, x_t, sigma_f, actions)
        return TeacherForced(
            pred=pred,
            target=training_target(self.mcfg, x0, noise, sink, x0_ctx),
            regime=regime,
            own=own,
            served=(regime == 0)[:, None] & (sigma_f >= 1.0),  # as the one-step `clean` sampler serves
            hidden=hidden,
        )

    def _layout_forward(
        self,
        sink: torch.Tensor,
        ctx: torch.Tensor,
        ctx_sigma: torch.Tensor,
        x_t: torch.Tensor,
        sigma_f: torch.Tensor,
        actions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The DiT over the clip layout `[sink copies | context copy | clip being denoised]`:
        its output for the clip's frames [B, C, L, h, w] (float32) and, with the state probe,
        their hidden states [B, L * P, D] after `state_layer` blocks (else None)."""
        b, dev = x_t.shape[0], self.device
        sinks, n = self.batcher.sinks, self.batcher.clip
        latents = torch.cat([sink.expand(-1, -1, sinks, -1, -1), ctx, x_t], 2)
        timesteps = torch.cat([torch.zeros(b, sinks, device=dev), ctx_sigma, sigma_f], 1) * 1000.0
        zero = torch.zeros(b, sinks, actions.shape[-1], device=dev)
        latent_actions = torch.cat([zero, actions, actions], 1)
        text = self.dit.prepare_text(self.text_zeros)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = self._forward(
                latents,
                timesteps,
                text,
                self.batcher.positions,
                self.batcher.frame_mask,
                latent_actions,
                max_position=self.batcher.max_position,
                with_hidden=self.probe is not None,
                hidden_after=self.cfg.state_layer,
            )
        flow, hidden = out if self.probe is not None else (out, None)
        if hidden is not None:
            hidden = hidden[:, (sinks + n) * self.dit.tokens_per_frame :]
        return flow[:, :, sinks + n :].float(), hidden

    def unrolled(self, frames: torch.Tensor, actions: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The one-step `clean` sampler unrolled over stream clips, differentiably: clean
        latents [B, C, L, h, w] of each clip, chunk by chunk, as `--steps 1000 --kv-mode clean`
        serves them from the clip's sink and actions with `noise` [B, C, L, h, w] as each
        chunk's noise (the reference generator's, given the same noise).

        Chunk c is denoised in one step from pure noise at t = 1000 with the model's own
        predictions of the earlier chunks as its context at the config's context timestep
        (0 for every preset), as `clean` mode commits them. Each chunk is one forward over
        the part of the clip layout it reads (`unroll_layouts`): the sink copies it uses,
        the context copy of the chunks before it and its own noisy chunk. These forwards
        have a shape per chunk, so they run eagerly even with `compile`, which would
        compile each shape."""
        if not self.batcher.stream_clips:
            raise ValueError("the unrolled sampler unrolls stream clips: give clip_chunks")
        chunk = self.batcher.chunk
        b, dev = frames.shape[0], frames.device
        sink = frames_to_latents(frames[:, :, :1], self.mcfg.anchored_pixels)
        t = float(NUM_TRAIN_TIMESTEPS)  # one step: sigma 1, the input is the noise itself
        committed = self.mcfg.context_timestep  # the sink's prefill and every commit pass
        schedule = FlowSchedule((t,), self.mcfg.prediction)
        text = self.dit.prepare_text(self.text_zeros)
        last = image_as_last_frame(self.mcfg, sink)  # what the first chunk's "delta" adds to
        predicted: list[torch.Tensor] = []
        for c, cut in enumerate(self.unroll_cuts):
            mine = slice(c * chunk, (c + 1) * chunk)  # chunk c in the clip
            timesteps = torch.cat(
                [
                    torch.full((b, cut.sinks + c * chunk), committed, device=dev),
                    torch.full((b, chunk), t, device=dev),
                ],
                1,
            )
            zero = torch.zeros(b, cut.sinks, actions.shape[-1], device=dev)
            latent_actions = torch.cat([zero, actions[:, : c * chunk], actions[:, mine]], 1)
            latents = torch.cat([sink.expand(-1, -1, cut.sinks, -1, -1), *predicted, noise[:, :, mine]], 2)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = self.dit.forward_masked(
                    latents,
                    timesteps,
                    text,
                    cut.positions,
                    cut.mask,
                    latent_actions,
                    max_position=cut.max_position,
                )
            x0 = schedule.x0_from_flow(noise[:, :, mine], out[:, :, -chunk:].float(), 0, last)
            predicted.append(x0)
            last = x0[:, :, -1:]
        return torch.cat(predicted, 2)

    def unrolled_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The unrolled sampler's error against the true clip (`unrolled`), over every chunk,
        squared or absolute (`unroll_loss`), with the change and block weights; stats: the
        mean and the last chunk's. With `adversarial_weight`, the discriminator first takes a
        step on these clips and rollouts, and after `adversarial_start` steps its verdict on
        the rollouts joins the loss (`adversarial_term`)."""
        frames = batch["frames"]
        latents = frames_to_latents(frames, self.mcfg.anchored_pixels)
        sink, x0 = latents[:, :, :1], latents[:, :, 1:]
        noise = torch.randn(x0.shape, generator=self.gen, device=self.device)
        pred = self.unrolled(frames, batch["actions"], noise)
        err = self._weighted_error(pred, x0, frames, self.cfg.unroll_loss)  # [B, L]
        last = err[:, -self.batcher.chunk :]
        stats = {
            "loss_unrolled": float(err.detach().mean()),
            "loss_unrolled_last": float(last.detach().mean()),
        }
        loss = err.mean()
        if self.disc is None:
            return loss, stats
        differing = differing_patches(x0, pred, self.disc.grid(x0.shape[2]))
        where = patch_weights(differing, self.cfg.adversarial_background)
        stats["disc_patches"] = float(differing.mean())
        stats |= self.discriminator_step(sink, x0, pred.detach(), batch["actions"], where)
        if self.step >= self.cfg.adversarial_start:
            loss, more = self.adversarial_term(loss, sink, pred, batch["actions"], where)
            stats |= more
        return loss, stats

    def discriminator_step(
        self,
        sink: torch.Tensor,
        real: torch.Tensor,
        fake: torch.Tensor,
        actions: torch.Tensor,
        where: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimiser step of the discriminator: true clips against (detached) rollouts of
        the same sinks and actions, at the peak learning rate throughout (no warm-up or
        decay: it starts from scratch, and must keep up with the sampler it judges). With
        `where` (`differing_patches`, or `patch_weights`), the loss and the logged scores are
        over the patches where clip and rollout differ (weighed): elsewhere there is nothing
        to tell apart."""
        assert self.disc is not None
        loss, d_real, d_fake = discriminator_update(
            self.disc, self.disc_opt, sink, real, fake, actions, where
        )
        return {
            "loss_disc": float(loss),
            "disc_real": float(patch_mean(d_real, where)),
            "disc_fake": float(patch_mean(d_fake, where)),
        }

    def adversarial_term(
        self,
        regression: torch.Tensor,
        sink: torch.Tensor,
        pred: torch.Tensor,
        actions: torch.Tensor,
        where: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`regression` plus the discriminator's verdict on the rollouts `pred` (over the
        patches `where`, if given), weighted so that its gradient with respect to the
        rollouts' frames is `adversarial_weight` times the regression's (`adaptive_weight`).
        The discriminator's own weights get no gradient."""
        assert self.disc is not None
        self.disc.requires_grad_(False)
        try:
            adversarial = generator_loss(self.disc(sink, pred, actions), where)
        finally:
            self.disc.requires_grad_(True)
        cap = self.cfg.adversarial_max_scale
        weight = adaptive_weight(regression, adversarial, pred, self.cfg.adversarial_weight, cap)
        stats = {
            "loss_adversarial": float(adversarial.detach()),
            "adversarial_scale": float(weight),
            "adversarial_capped": float(weight >= cap),  # logged as the share of steps
        }
        return regression + weight * adversarial, stats

    def objective(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's loss: `loss` on the batch, or with `unroll_share` the last share of its
        samples on `unrolled_loss` instead, the two weighted by their samples."""
        b = len(batch["frames"])
        u = unrolled_count(self.cfg.unroll_share, b)
        if not u:
            return self.loss(batch)
        unrolled, stats = self.unrolled_loss({k: v[b - u :] for k, v in batch.items()})
        if u == b:
            return unrolled, stats
        loss, more = self.loss({k: v[: b - u] for k, v in batch.items()})
        return (loss * (b - u) + unrolled * u) / b, {**more, **stats}

    def _weighted_error(
        self, pred: torch.Tensor, target: torch.Tensor, frames: torch.Tensor, norm: str = "l2"
    ) -> torch.Tensor:
        """Squared (or with `norm` "l1" absolute) error per sample and frame [B, L], with the
        change and block weights."""
        err = (pred - target).abs() if norm == "l1" else (pred - target).pow(2)
        if self.cfg.change_weight:
            changed = (frames[:, :, 1:] - frames[:, :, :1]).abs().amax(1, keepdim=True) > 0.1
            err = err * (1.0 + self.cfg.change_weight * changed)
        if self.cfg.block_weight:
            block = block_mask(frames)
            err = err * (1.0 + self.cfg.block_weight * (block[:, :, 1:] | block[:, :, :1]))
        return err.mean(dim=(1, 3, 4))

    def next_batch(self) -> dict[str, torch.Tensor]:
        """Clips with their true context, and with `rollout_share` the rest with the model's
        own (made again every `rollout_every` steps)."""
        size = self.cfg.batch_size
        own = round(self.cfg.rollout_share * size) if self.rollouts is not None else 0
        if not own:
            return self.batcher.sample(size)
        assert self.rollouts is not None
        if self.rollouts.frames is None or self.step % self.cfg.rollout_every == 0:
            self.rollouts.refresh()
        if not self.rollouts.has_targets:  # "simulated", and no rollout frame shows a T
            self.rollouts.skipped += 1
            return self.batcher.sample(size)
        return merge_batches(self.batcher.sample(size - own), self.rollouts.sample(own))

    def train_step(self) -> dict[str, float]:
        lr = _lr_at(self.step, self.cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss, stats = self.objective(self.next_batch())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.dit.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        self._update_ema()
        return {"loss": float(loss.detach()), "lr": lr, "grad_norm": float(grad_norm), **stats}

    def _update_ema(self) -> None:
        """EMA of the weights, one fused update for the floating-point tensors."""
        decay = min(self.cfg.ema_decay, (1 + self.step) / (10 + self.step))
        floats, targets = [], []
        with torch.no_grad():
            for k, v in self.dit.state_dict().items():
                if v.dtype.is_floating_point:
                    floats.append(v)
                    targets.append(self.ema[k])
                else:
                    self.ema[k].copy_(v)
            torch._foreach_lerp_(targets, floats, 1 - decay)

    def run(self, minutes: float, progress: bool = True) -> dict:
        """Train until `total_steps`, `minutes` of wall time or `stop_requested`,
        checkpointing on the way and at the end."""
        from tqdm import tqdm

        start = time.perf_counter()
        deadline = start + minutes * 60.0
        first = self.step
        bar = tqdm(
            total=self.cfg.total_steps,
            initial=self.step,
            desc="training pusht",
            unit="step",
            disable=not progress,
        )
        window: list[dict] = []
        try:
            while (
                self.step < self.cfg.total_steps
                and time.perf_counter() < deadline
                and self.stop_requested is None
            ):
                window.append(self.train_step())
                bar.update()
                if self.step % self.cfg.log_every == 0 or self.step == self.cfg.total_steps:
                    entry = {"step": self.step, **_mean(window)}
                    self.history.append(entry)
                    bar.set_postfix(loss=f"{entry['loss']:.4f}")
                    window = []
                if self.step % self.cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.save_checkpoint()
            if self.rollouts is not None:
                self.rollouts.close()
        elapsed = time.perf_counter() - start
        return {
            "steps_this_run": self.step - first,
            "step": self.step,
            "total_steps": self.cfg.total_steps,
            "seconds": round(elapsed, 1),
            "steps_per_second": round((self.step - first) / max(elapsed, 1e-9), 2),
            "stopped_by": self._stopped_by(),
            "rollout_refreshes": self.rollouts.refreshes if self.rollouts is not None else 0,
            **self._rollout_summary(),
            "last": self.history[-1] if self.history else None,
        }

    def _stopped_by(self) -> str:
        """Why `run` ended: "total_steps", a signal's name, or "minutes"."""
        if self.step >= self.cfg.total_steps:
            return "total_steps"
        return self.stop_requested or "minutes"

    def _rollout_summary(self) -> dict:
        r = self.rollouts
        if r is None or r.targets != "simulated" or not r.chunks_simulated:
            return {}
        return {
            "rollout_simulate_seconds": round(r.simulate_seconds, 1),
            "rollout_chunks_with_target": round(r.chunks_with_target / r.chunks_simulated, 3),
            "rollout_batches_without": r.skipped,
        }


def served_regimes(weights: tuple[float, float, float], config: ModelConfig) -> tuple[float, float, float]:
    """The context regimes' (clean, final, noisy) sampling weights for a model: without the
    noisy context when the model does not serve `noisy` mode (models that predict "delta")."""
    return weights if "noisy" in config.kv_modes else (weights[0], weights[1], 0.0)


def _regime_losses(per_sample: torch.Tensor, regime: torch.Tensor, own: torch.Tensor) -> dict[str, float]:
    """Mean loss of the samples of each regime present (rollout samples apart)."""
    stats = {}
    for i, name in enumerate(REGIMES):
        sel = (regime == i) & ~own
        if sel.any():
            stats[f"loss_{name}"] = float(per_sample[sel].mean())
    if own.any():
        stats["loss_rollout"] = float(per_sample[own].mean())
    return stats


def _save_whole(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")  # a run stopped mid-write leaves no half file
    safetensors.torch.save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def state_probe_path(weights: str | Path) -> Path:
    """Where `Trainer.export` writes the state probe beside the weights at `weights`."""
    weights = Path(weights)
    return weights.with_name(weights.name.removesuffix(".safetensors") + ".state-probe.safetensors")


def state_loss_and_stats(
    probed: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    served: torch.Tensor,
    scale: float = WORLD_HALF,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The state probe's squared error over the trained frames (`mask` [B, L] > 0) from its
    predictions and targets [B, L, STATE_DIM] (whose positions are in units of `scale` world
    units), and for the log its block errors (world units, degrees) on the frames of `served`
    [B, L] (bool): those denoised from pure noise after a true clean context, as the
    one-step `clean` sampler predicts a chunk one ahead of the true past, from the context
    and the actions alone."""
    err = (probed - target).pow(2).mean(-1)
    loss = (err * mask).sum() / mask.sum().clamp_min(1.0)
    stats = {"loss_state": float(loss.detach())}
    with torch.no_grad():
        served = (mask > 0) & served
        if served.any():
            position, angle = state_errors(probed[served], target[served], scale)
            stats["state_block_units"] = float(position.mean())
            stats["state_angle_degrees"] = float(angle.mean())
    return loss, stats


def _mean(rows: list[dict]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {
        k: round(sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r), 5) for k in sorted(keys)
    }


def prepare_data(
    folder: str | Path, spec: DatasetSpec, workers: int | None = None, progress: bool = True
) -> Dataset:
    """The data set in `folder`, recorded first when it is not there yet."""
    folder = Path(folder)
    if not (folder / "meta.json").is_file():
        generate_dataset(spec, folder, workers=workers, progress=progress)
    data = Dataset.load(folder)
    if data.spec != spec:
        print(f"note: using the data set already in {folder} ({data.spec}), not {spec}")
    return data


def smoke_config(config: ModelConfig) -> ModelConfig:
    """A much smaller model with the same geometry, for CPU smoke runs and tests."""
    dit = {**config.dit, "num_layers": 2, "num_attention_heads": 2, "ffn_dim": 64}
    return replace(config, dit=dit, builtin_weights=None)
