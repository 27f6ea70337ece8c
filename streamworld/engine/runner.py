"""The model runner: all work that runs on executor threads, and every tensor the engine
holds between units.

The event loop (engine.py) decides what runs and keeps only metadata (stream.py); the
runner holds, per stream, the prompt's K/V, the first image's latent, the causal
decoder state and, for a model that predicts "delta", the last latent frame of its last
final chunk, and per chunk its inputs and intermediate results (the current step's
latents, the clean estimate, the activation between stages). The methods marked
*executor* run on an executor thread; the others only move references on the loop and
start no tensor work. Whatever a stream held is dropped when it ends.

    prep executor     encode_prompt, encode_image
    rank executors    execute: a batch of DiT units of one stage (embed, blocks, head,
                      flow -> x0), re-run unit by unit when the batch fails
    decode executor   decode: a batch of chunks through the VAE with per-stream state,
                      chunk by chunk when the batch fails
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..models.actions import gather_latent_actions
from ..models.causal_wan import ChunkInput, StageActivation
from ..models.schedule import chunk_noise
from ..models.transfer import to_device
from ..models.vae import image_from_uint8, uint8_frames
from ..models.world_model import WorldModel, image_as_last_frame
from .graphs import StageGraphs, summed_stats
from .kv_cache import KVCache, PagedKVView
from .kv_pool import Stage
from .placement import ReplicaPlacement
from .stage_link import StageLink, stage_links
from .stream import ChunkState, WorkUnit

log = logging.getLogger("streamworld.engine")


@dataclass
class ChunkTensors:
    """One chunk's tensors: its inputs, fixed when it starts, and its latest results."""

    text: Any  # CrossKV of the prompt when the chunk started
    actions: np.ndarray | None  # per-video-frame actions (ChunkState.actions)
    action_offset: int
    latent_actions: torch.Tensor | None = None  # [F, r * action_dim] on the host, made on first use
    x_t: torch.Tensor | None = None  # current step's input latents
    x0: torch.Tensor | None = None  # latest clean estimate
    activation: StageActivation | None = None  # the row between stages
    # The CUDA event after which `activation` has arrived on the next stage's device
    # (stage_link.py); None when it is usable at once.
    activation_copied: Any = None
    # With overlapped dispatch: a CUDA event that completes when the last unit's kernels have
    # run (x0 and x_t are valid on other streams and on the host only after it).
    ready: Any = None


@dataclass
class StreamTensors:
    seed: int
    decoder: Any  # the VAE's causal DecoderState
    prompt: str | None = None  # the prompt whose encoding is wanted
    text: Any = None  # CrossKV of the last prompt encoded
    image_latent: torch.Tensor | None = None  # [C, 1, h, w]
    # "delta" models: the last latent frame of the stream's last final chunk (None: zero).
    last: torch.Tensor | None = None
    chunks: dict[int, ChunkTensors] = field(default_factory=dict)


@dataclass
class Work:
    """One unit of a batch, with all the executor needs."""

    unit: WorkUnit
    seed: int
    first_frame: int
    num_frames: int
    chunk: ChunkTensors
    view: PagedKVView
    # The latent frame before the chunk that a "delta" output is relative to (last stage only:
    # taken when the unit launches, when the K/V dependency has made the previous chunk final).
    last: torch.Tensor | None = None


@dataclass
class UnitResult:
    ok: bool
    error: str | None = None


@dataclass
class DecodeJob:
    """Captured on the loop when a decode batch launches: the stream may end meanwhile."""

    x0s: list[torch.Tensor]
    states: list[Any]
    events: list[Any]  # CUDA events the DiT recorded for these latents (overlapped dispatch)


def _batched_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[1, ...] tensors -> their [...] copies on the host, with one copy (one wait for the
    device) per shape and dtype rather than one per tensor: a fork's branches decode
    together. Rows of one copy share its buffer."""
    out: list = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append(i)
    for idx in groups.values():
        batch = (torch.cat([tensors[i] for i in idx]) if len(idx) > 1 else tensors[idx[0]]).cpu()
        for row, i in enumerate(idx):
            out[i] = batch[row]
    return out


@dataclass
class Decoded:
    # Both are rows of one host buffer per decode batch (`_batched_to_host`).
    frames: np.ndarray  # [T, H, W, 3] uint8
    latents: torch.Tensor  # [C, F, h, w] float32 on the host
    signature: tuple  # the decoder state's after this chunk


def placed_devices(
    model: WorldModel, placement: ReplicaPlacement
) -> tuple[list[torch.device], list[torch.device]]:
    """The device of each stage and of each rank, checked against where the model's blocks
    are (`WorldModel.place`): a placement the model does not match is refused."""
    cfg = model.config
    if placement.stages[-1].stop != cfg.num_layers:
        raise ValueError(f"the placement covers {placement.stages[-1].stop} of {cfg.num_layers} blocks")
    blocks = model.dit.block_devices
    stage_devices = [_resolved(torch.device(s.device)) for s in placement.stages]
    for s, device in zip(placement.stages, stage_devices, strict=True):
        placed = {_resolved(d) for d in blocks[s.start : s.stop]}
        if placed != {device}:
            raise ValueError(
                f"blocks {s.start}-{s.stop - 1} are on {sorted(map(str, placed))}, but the placement puts "
                f"them on {device} (WorldModel.place moves them)"
            )
    if stage_devices[0] != _resolved(model.device):
        raise ValueError(f"the first stage is on {stage_devices[0]}, the model's inputs on {model.device}")
    ranks: dict[int, torch.device] = {}
    for s, device in zip(placement.stages, stage_devices, strict=True):
        if ranks.setdefault(s.rank, device) != device:
            raise ValueError(
                f"rank {s.rank} has stages on {ranks[s.rank]} and on {device}: one device per rank"
            )
    # A rank with no stage (more ranks than stages on one device) sits on the first device.
    return stage_devices, [ranks.get(r, stage_devices[0]) for r in range(placement.num_ranks)]


def _resolved(device: torch.device) -> torch.device:
    """cuda -> cuda:<current>, so that devices compare as the same when they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ModelRunner:
    def __init__(
        self,
        model: WorldModel,
        stages: list[Stage],
        cache: KVCache,
        overlap: bool,
        fault_hook: Callable[[], Any] = lambda: None,
        stage_devices: list[torch.device] | None = None,
        cuda_graphs: int = 0,
    ) -> None:
        self.model = model
        self.stages = stages
        # Where each stage runs (engine placement); tensors a stage reads from another stage
        # (activation rows, the step's latents, the clean estimate) are copied here first.
        self.stage_devices = stage_devices or [model.device] * len(stages)
        self.links = stage_links(self.stage_devices)  # stage i -> stage i + 1
        self.cache = cache
        # Checking for non-finite values waits for the GPU; overlapped dispatch checks at decode.
        self.overlap = overlap
        self.fault_hook = fault_hook
        self.streams: dict[int, StreamTensors] = {}
        self.delta = model.config.prediction == "delta"
        # Per stage, CUDA graphs of its blocks for batches of up to `cuda_graphs` units
        # (graphs.py); None: every batch runs eagerly.
        placed = zip(stages, self.stage_devices, strict=True)
        self.graphs = [StageGraphs(model.dit, s, d, cuda_graphs) for s, d in placed] if cuda_graphs else None

    def graph_stats(self) -> dict | None:
        """The CUDA graphs' counters summed over the stages (graphs.py); None without graphs."""
        return summed_stats(g.stats for g in self.graphs or [])

    def release(self) -> None:
        """Drops the K/V cache's tensors, the graphs and every stream's tensors (the engine
        is closed; the graphs' counters stay)."""
        for graphs in self.graphs or []:
            graphs.release()
        self.cache.keys.clear()
        self.cache.values.clear()
        self.streams.clear()

    # --- loop side: references only -----------------------------------------------------------
    def open_stream(self, stream_id: int, seed: int) -> tuple:
        """Makes the stream's state; returns its decoder signature."""
        state = StreamTensors(seed, self.model.vae.new_decoder_state())
        self.streams[stream_id] = state
        return state.decoder.signature()

    def fork_stream(self, parent_id: int, branch_id: int, seed: int) -> None:
        """A branch's state: the parent's prompt K/V and first image (shared, read-only) and
        a fork of its decoder state (the parent is between chunks: no decode in flight)."""
        parent = self.streams[parent_id]
        self.streams[branch_id] = StreamTensors(
            seed, parent.decoder.fork(), parent.prompt, parent.text, parent.image_latent, last=parent.last
        )

    def close_stream(self, stream_id: int) -> None:
        # A decode in flight keeps its own references (DecodeJob): nothing is reset under it.
        self.streams.pop(stream_id, None)

    def want_prompt(self, stream_id: int, prompt: str) -> None:
        self.streams[stream_id].prompt = prompt

    def begin_chunk(self, stream_id: int, chunk: ChunkState) -> None:
        """The chunk's inputs: the prompt encoded now, its actions, and for the first image's
        chunk the image's latent as its (already clean) result."""
        state = self.streams[stream_id]
        tensors = ChunkTensors(state.text, chunk.actions, chunk.action_offset)
        if chunk.denoised:
            tensors.x0 = state.image_latent
            if self.delta:
                state.last = image_as_last_frame(self.model.config, state.image_latent)
        state.chunks[chunk.index] = tensors

    def chunk_denoised(self, stream_id: int, index: int) -> None:
        """The chunk's x0 is final: a "delta" model's next chunk is relative to its last frame."""
        if self.delta:
            state = self.streams[stream_id]
            state.last = state.chunks[index].x0[:, -1:]

    def drop_chunk(self, stream_id: int, index: int) -> None:
        state = self.streams.get(stream_id)
        if state is not None:
            state.chunks.pop(index, None)

    def work(self, unit: WorkUnit, chunk: ChunkState, read: list[int], writes: list[list[int]]) -> Work:
        """A unit with its K/V view over the given pages (`writes`: per written version)."""
        cfg, stage = self.model.config, self.stages[unit.stage]
        first = chunk.first_frame
        view = PagedKVView(
            self.cache, stage, read, writes, cfg.tokens_per_frame, first, min(cfg.sink_frames, first)
        )
        state = self.streams[unit.stream]
        last = state.last if unit.stage == len(self.stages) - 1 else None  # where x0 is made
        return Work(unit, state.seed, first, chunk.num_frames, state.chunks[chunk.index], view, last)

    def decode_job(self, picked: list[tuple[int, int]]) -> DecodeJob:
        """(stream id, chunk index) pairs -> what their decode needs."""
        chunks = [self.streams[sid].chunks[c] for sid, c in picked]
        events = list({id(t.ready): t.ready for t in chunks if t.ready is not None}.values())
        return DecodeJob([t.x0 for t in chunks], [self.streams[sid].decoder for sid, _ in picked], events)

    # --- executor: prompts and first images ---------------------------------------------------
    def encode_prompt(self, stream_id: int, prompt: str) -> None:
        """*executor* Encodes `prompt`; keeps it if it is still the stream's wanted prompt."""
        text = self.model.text_context(prompt)
        state = self.streams.get(stream_id)
        if state is not None and state.prompt == prompt:
            state.text = text

    def encode_image(self, stream_id: int, image: np.ndarray) -> None:
        """*executor* The first image's latent [C, 1, h, w]."""
        model = self.model
        pixels = image_from_uint8(image).to(model.decoder_device, model.dtype)  # the VAE's device
        latent = model.vae.encode_image(pixels)[0].float()
        state = self.streams.get(stream_id)
        if state is not None:
            state.image_latent = latent

    # --- executor: DiT batches ----------------------------------------------------------------
    def execute(self, stage: Stage, works: list[Work]) -> list[UnitResult]:
        """*executor* Runs one batch; on failure, each unit alone."""
        try:
            return self._execute_batch(stage, works)
        except Exception as e:
            if len(works) == 1:
                log.warning("unit %s failed", works[0].unit, exc_info=True)
                return [UnitResult(False, f"{type(e).__name__}: {e}")]
        results = []
        for w in works:
            try:
                results.extend(self._execute_batch(stage, [w]))
            except Exception as e:
                log.warning("unit %s failed", w.unit, exc_info=True)
                results.append(UnitResult(False, f"{type(e).__name__}: {e}"))
        return results

    def _execute_batch(self, stage: Stage, works: list[Work]) -> list[UnitResult]:
        model = self.model
        inputs = self._inputs(stage, works)
        x_ts = [i.latents for i in inputs]
        act = model.dit.embed(inputs) if stage.index == 0 else self._received(works)
        if self.graphs is not None:
            act = self.graphs[stage.index].run(act, inputs)
        else:
            act = model.dit.run_blocks(act, inputs, stage.start, stage.stop)
        if stage.index == len(self.stages) - 1:
            outputs = self._head(act, works, x_ts)
        else:
            outputs = self._rows(act, x_ts, self.links[stage.index])
        ready = None
        if self.overlap and model.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # on the rank's stream, after every kernel of this batch
        # Results are kept only once the whole batch has run: a failed batch leaves no trace.
        results = []
        for w, (ok, error, x_t, x0, activation, copied) in zip(works, outputs, strict=True):
            if ok:
                if w.unit.stage == 0 and w.unit.phase >= 0:
                    w.chunk.x_t = x_t
                w.chunk.activation, w.chunk.activation_copied = activation, copied
                w.chunk.ready = ready
                if x0 is not None:
                    w.chunk.x0 = x0
            results.append(UnitResult(ok, error))
        return results

    @staticmethod
    def _received(works: list[Work]) -> StageActivation:
        """The previous stage's rows of these units, on this stage's device, as one batch."""
        rows = [w.chunk.activation for w in works]
        for w in works:
            r = w.chunk.activation
            StageLink.receive([r.hidden, r.modulation, r.temb], w.chunk.activation_copied)
        return StageActivation(
            torch.cat([r.hidden for r in rows]),
            torch.cat([r.modulation for r in rows]),
            torch.cat([r.temb for r in rows]),
            rows[0].num_frames,
        )

    def _inputs(self, stage: Stage, works: list[Work]) -> list[ChunkInput]:
        """The batch's DiT inputs (`_input`). The units that re-noise their last x0 at one
        step do it together, in one set of kernels for all of them rather than one per unit:
        the same arithmetic, element by element, as `FlowSchedule.noised`."""
        noises: dict = {}  # units that draw the same noise share it (a fork's branches)
        inputs: list[ChunkInput] = []
        renoised: dict[tuple, list[tuple[int, torch.Tensor]]] = {}  # (step, shape) -> [(i, x0)]
        for i, w in enumerate(works):
            hook = self.fault_hook()
            if hook is not None:
                hook(w.unit)
            chunk_input, x0 = self._input(stage, w, noises)
            if x0 is not None:
                renoised.setdefault((w.unit.phase, tuple(x0.shape)), []).append((i, x0))
            inputs.append(chunk_input)
        for (step, _), rows in renoised.items():
            noise = torch.stack([inputs[i].latents for i, _ in rows])
            x_t = self.model.schedule.renoise(torch.stack([x0 for _, x0 in rows]), noise, step)
            for j, (i, _) in enumerate(rows):
                inputs[i] = replace(inputs[i], latents=x_t[j])
        return inputs

    def _input(self, stage: Stage, w: Work, noises: dict) -> tuple[ChunkInput, torch.Tensor | None]:
        """The unit's DiT input: the step's noised latents (stage 0) or the chunk's current
        ones, its timesteps, prompt, K/V view and actions. `noises` holds the noise this batch
        has drawn so far, by (seed, chunk, step, shape): branches of one fork keep their
        parent's seed, so a fork of 16 draws and copies each step's noise once, not 16 times.
        A unit whose step re-noises the last x0 comes with the noise as its latents and that
        x0, for `_inputs` to combine."""
        model, sched = self.model, self.model.schedule
        phase, chunk = w.unit.phase, w.chunk
        device = self.stage_devices[stage.index]
        renoise = None
        # The last stage made x0, stage 0 x_t: copied where this stage runs, when it differs.
        if phase >= 0:
            t = sched.timesteps[phase]
            if stage.index == 0:
                shape = model.latent_shape(w.num_frames)
                x0 = None if chunk.x0 is None else chunk.x0.to(device)
                key = (w.seed, w.unit.chunk, phase, shape)
                if key not in noises:
                    noises[key] = to_device(chunk_noise(*key), device)
                x_t = noises[key]
                if phase > 0 and x0 is not None:
                    renoise = x0
                else:
                    x_t = sched.noised(x_t, phase, x0)  # the noise itself, or an error
            else:
                x_t = chunk.x_t.to(device)
        else:
            t, x_t = model.config.context_timestep, chunk.x0.to(device)
        # Timesteps and actions stay on the host: the DiT's prologue copies the batch's at once.
        timesteps = torch.full((w.num_frames,), t)
        return ChunkInput(x_t, timesteps, chunk.text, w.view, self._latent_actions(w)), renoise

    def _latent_actions(self, w: Work) -> torch.Tensor | None:
        chunk = w.chunk
        if chunk.actions is None:
            return None
        if chunk.latent_actions is None:
            r = self.model.config.temporal_ratio
            chunk.latent_actions = gather_latent_actions(
                torch.from_numpy(chunk.actions), w.first_frame, w.num_frames, r, offset=chunk.action_offset
            )
        return chunk.latent_actions

    def _head(self, act: StageActivation, works: list[Work], x_ts: list) -> list[tuple]:
        """Last stage: flow -> clean estimate per unit (the commit pass keeps its x0)."""
        sched = self.model.schedule
        flow = self.model.dit.head(act)
        out = []
        for i, w in enumerate(works):
            x0 = w.chunk.x0
            if w.unit.phase >= 0:
                last = None if w.last is None else w.last.to(flow.device)
                x0 = sched.x0_from_flow(x_ts[i], flow[i], w.unit.phase, last)
            ok = self.overlap or bool(torch.isfinite(x0).all())
            out.append((ok, None if ok else "non-finite values in the model output", x_ts[i], x0, None, None))
        return out

    def _rows(self, act: StageActivation, x_ts: list, link: StageLink) -> list[tuple]:
        """Other stages: each unit's row of the activation, sent towards the next stage's
        device (checked here, before the copy, so that the check reads no copy)."""
        ok = [self.overlap or bool(torch.isfinite(act.hidden[i]).all()) for i in range(len(x_ts))]
        (hidden, modulation, temb), copied = link.send([act.hidden, act.modulation, act.temb])
        out = []
        for i in range(len(x_ts)):
            row = StageActivation(hidden[i : i + 1], modulation[i : i + 1], temb[i : i + 1], act.num_frames)
            out.append((ok[i], None if ok[i] else "non-finite activations", x_ts[i], None, row, copied))
        return out

    # --- executor: decoding -------------------------------------------------------------------
    def decode(self, job: DecodeJob) -> tuple[list[Decoded | BaseException], float]:
        """*executor* Decodes a batch of chunks; one result or error per chunk, and seconds."""
        start = time.perf_counter()
        for event in job.events:  # the DiT's kernels for these latents have run
            torch.cuda.current_stream().wait_event(event)
        x0s, states = job.x0s, job.states
        results: list = [None] * len(x0s)
        todo = list(range(len(x0s)))
        if self.overlap:
            finite = torch.stack([torch.isfinite(x).all() for x in x0s]).tolist()
            for i in [i for i in todo if not finite[i]]:
                results[i] = ValueError("non-finite values in the model output")
            todo = [i for i in todo if finite[i]]
        latents = [x0s[i].unsqueeze(0).to(self.model.dtype) for i in todo]
        videos = self._decode_videos(latents, [states[i] for i in todo]) if todo else []
        done = []
        for i, v in zip(todo, videos, strict=True):
            if isinstance(v, BaseException):
                results[i] = v
            else:
                done.append((i, v))
        # uint8 on the device first: the copies to the host move a quarter of the bytes.
        frames = _batched_to_host([uint8_frames(v) for _, v in done])
        hosted = _batched_to_host([x0s[i].unsqueeze(0).float() for i, _ in done])
        for (i, _), f, x in zip(done, frames, hosted, strict=True):
            results[i] = Decoded(f.numpy(), x, states[i].signature())
        return results, time.perf_counter() - start

    def _decode_videos(self, latents: list[torch.Tensor], states: list[Any]) -> list:
        vae = self.model.vae
        try:
            return vae.decode_chunks(latents, states)
        except Exception:
            if len(latents) == 1:
                raise
        # One bad stream must not end the others: decode each alone.
        videos: list = []
        for x, state in zip(latents, states, strict=True):
            try:
                videos.append(vae.decode_chunk(x, state))
            except Exception as e:
                videos.append(e)
        return videos
