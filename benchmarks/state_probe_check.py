"""How much of the next chunk's scene do a fixed model's hidden states hold? A state probe
(`streamworld.pusht.state_probe`) trained on them alone, on the CPU.

The model stays fixed (default: the shipped `pusht-delta`). It runs once over stream
clips of two chunks, each chunk denoised in one step from pure noise after its true clean
context, as `--steps 1000 --kv-mode clean` predicts one chunk ahead of the true past, and
its last hidden states of the clips' frames are kept (or, with `--layer K`, those after the
first K blocks). A `StateProbe` then trains on the
second chunk's four frames for several epochs to read how the scene changed since the
frame before the chunk: how far the agent and the block moved and how far the block
turned (`change_targets`). A model that predicts each chunk's change draws a still block
as no change wherever it is, so the change, not the place, is what its hidden states
must hold. The probe is scored on the clips of held-out episodes against no change at
all, which is copying the frame before the chunk.

If the probe moves and turns the block better than the copy, the hidden states hold the
block's next pose, whatever the frames then draw of it; if not, the model does not know
where the block goes. Reported: the probe's and the copy's block position error (world
units) and angle error (degrees), split by how far the block truly turns since the frame
before the chunk.

    python benchmarks/state_probe_check.py --json state_probe_check.json

On a 2-core CPU doing nothing else the defaults take about 6 minutes: 1 to record 240
episodes, 5 for the model's forwards over 1,920 clips (about 0.15 s per clip), then the
probe (2026-12-06).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from streamworld.models import get_preset
from streamworld.models.world_model import builtin_weights_path
from streamworld.pusht.data import Dataset, DatasetSpec
from streamworld.pusht.state_probe import CHANGE_SCALE, StateProbe, change_targets, state_errors
from streamworld.pusht.train import ClipBatcher, TrainConfig, Trainer, prepare_data, smoke_config

# The turn of the block since the frame before the chunk, in degrees: the report's bins.
TURN_BINS = ((0.0, 0.5), (0.5, 2.0), (2.0, 5.0), (5.0, 180.0))


def split(data: Dataset, held_out: int) -> tuple[Dataset, Dataset]:
    """The data set's episodes but the last `held_out`, and those."""
    k = data.frames.shape[0] - held_out

    def part(sl: slice) -> Dataset:
        frames = data.frames[sl]
        spec = dataclasses.replace(data.spec, episodes=frames.shape[0])
        return Dataset(frames, data.actions[sl], spec, data.states[sl])

    return part(slice(0, k)), part(slice(k, None))


def fixed_model(args: argparse.Namespace, data: Dataset, work: Path) -> Trainer:
    """A trainer whose forward is the fixed model's on clips in the `clean` regime, each
    chunk denoised in one step from pure noise, with the frames' hidden states after
    `--layer` blocks (default: the last block's)."""
    config = dataclasses.replace(get_preset(args.model), denoising_steps=(1000.0,))
    if args.smoke:
        config = smoke_config(config)
    train = TrainConfig(
        clip_chunks=2,
        regime_weights=(1.0, 0.0, 0.0),
        discrete_share=1.0,
        state_weight=1.0,  # makes the forward return the hidden states
        state_layer=args.layer,
        start_share=0.0,
        seed=args.seed,
    )
    init = None if args.smoke else str(args.dit)
    trainer = Trainer(config, train, data, work, "cpu", init=init)
    trainer.dit.requires_grad_(False).eval()
    return trainer


@torch.no_grad()
def hidden_states(trainer: Trainer, data: Dataset, clips: int, batch_size: int, desc: str):
    """(hidden states [N, F, P, D] float16, scenes [N, F, 5]) of `clips` clips of `data`'s
    episodes, F frames each."""
    from tqdm import tqdm

    trainer.batcher = ClipBatcher(data, trainer.mcfg, trainer.device, trainer.gen, 0.0, 2)
    p = trainer.dit.tokens_per_frame
    hidden, scenes = [], []
    for start in tqdm(range(0, clips, batch_size), desc=desc, unit="batch"):
        batch = trainer.batcher.sample(min(batch_size, clips - start))
        h = trainer.forward(batch).hidden
        hidden.append(h.unflatten(1, (-1, p)).half())
        scenes.append(batch["states"].float())
    return torch.cat(hidden), torch.cat(scenes)


def second_chunk(hidden: torch.Tensor, scenes: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The second chunk's hidden states [N, chunk, P, D] and its scenes' change since the
    frame before it [N, chunk, STATE_DIM], from clips' [N, 2 * chunk, P, D] and [N, 2 * chunk, 5]."""
    return hidden[:, chunk:], change_targets(scenes[:, chunk:], scenes[:, chunk - 1 : chunk])


def train_probe(args: argparse.Namespace, hidden: torch.Tensor, targets: torch.Tensor) -> tuple:
    """A `StateProbe` trained on every frame [N, F, P, D] with its targets [N, F, STATE_DIM]
    for `--epochs` epochs; (probe, logged rows)."""
    torch.manual_seed(args.seed)
    p, d = hidden.shape[2:]
    probe = StateProbe(d, p)
    frames = hidden.flatten(0, 1)
    targets = targets.flatten(0, 1)
    steps = args.epochs * -(-len(frames) // args.probe_batch)
    opt = torch.optim.AdamW(probe.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps)
    history = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(frames))
        total = 0.0
        for i in range(0, len(frames), args.probe_batch):
            pick = order[i : i + args.probe_batch]
            pred = probe(frames[pick].float())[:, 0]  # each row is one frame of P tokens
            loss = (pred - targets[pick]).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            total += float(loss.detach()) * len(pick)
        history.append({"epoch": epoch + 1, "loss_state": round(total / len(frames), 6)})
        print(f"epoch {epoch + 1:3d} probe loss {history[-1]['loss_state']:.6f}", flush=True)
    return probe.eval(), history


@torch.no_grad()
def score(probe: StateProbe, hidden: torch.Tensor, truth: torch.Tensor) -> dict:
    """The probe and the copy (no change) on held-out frames [N, F, P, D] whose true
    change is `truth` [N, F, STATE_DIM], by how far the block truly turns."""
    probed = probe(hidden.float().flatten(1, 2))
    still = torch.zeros(5)
    copy = change_targets(still, still).expand_as(truth)  # no move, no turn
    probe_units, probe_degrees = state_errors(probed, truth, CHANGE_SCALE)
    copy_units, copy_degrees = state_errors(copy, truth, CHANGE_SCALE)
    errors = torch.stack([probe_units, probe_degrees, copy_units, copy_degrees], -1).flatten(0, 1)
    turn = errors[:, 3]  # the copy's angle error is how far the block truly turned
    report = {"frames": len(errors), "all": _means(errors)}
    for low, high in TURN_BINS:
        inside = (turn >= low) & (turn < high)
        report[f"turn {low:g}-{high:g} degrees"] = _means(errors[inside])
    return report


def _means(errors: torch.Tensor) -> dict:
    names = ("probe_block_units", "probe_angle_degrees", "copy_block_units", "copy_angle_degrees")
    if not len(errors):
        return {"frames": 0}
    means = errors.mean(0)
    return {"frames": len(errors), **{n: round(float(v), 3) for n, v in zip(names, means, strict=True)}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    shipped = builtin_weights_path(get_preset("pusht-delta"))
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--model", default="pusht-delta", help="the model preset (default pusht-delta)")
    p.add_argument("--dit", type=Path, default=shipped, help="its weights (default: the shipped pusht-delta)")
    p.add_argument("--data", type=Path, help="a data set folder with states.npy (recorded there if empty)")
    p.add_argument(
        "--features",
        type=Path,
        help="a file of the model's hidden states and the scenes: read if it exists, written "
        "after the forwards otherwise, so that another probe setting skips them",
    )
    p.add_argument("--episodes", type=int, default=240, help="episodes recorded (default 240)")
    p.add_argument("--held-out", type=int, default=40, help="of them, the last ones scored (default 40)")
    p.add_argument("--steps-per-episode", type=int, default=150, help="(default 150)")
    p.add_argument("--clips", type=int, default=1536, help="clips the probe trains on (default 1536)")
    p.add_argument("--held-out-clips", type=int, default=384, help="held-out clips scored (default 384)")
    p.add_argument("--batch-size", type=int, default=32, help="clips per forward of the model (default 32)")
    p.add_argument("--epochs", type=int, default=40, help="the probe's epochs (default 40)")
    p.add_argument("--probe-batch", type=int, default=256, help="frames per probe step (default 256)")
    p.add_argument("--lr", type=float, default=1e-3, help="the probe's peak learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument("--workers", type=int, default=2, help="processes recording episodes (default 2)")
    p.add_argument(
        "--layer",
        type=int,
        metavar="K",
        help="read the hidden states after the first K blocks (default: after all of them, the last "
        "block's, which the pixel head maps to the frame)",
    )
    p.add_argument("--smoke", action="store_true", help="the tiny smoke model, random weights (tests)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    counts = (
        "episodes",
        "held_out",
        "steps_per_episode",
        "clips",
        "held_out_clips",
        "batch_size",
        "epochs",
        "probe_batch",
    )
    for name in counts:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.held_out >= args.episodes:
        p.error("--held-out must be fewer than --episodes: the probe trains on the rest")
    if not args.lr > 0:
        p.error("--lr must be positive")
    config = get_preset(args.model)
    layers = (smoke_config(config) if args.smoke else config).num_layers
    if args.layer is not None and not 1 <= args.layer <= layers:
        p.error(f"--layer must be in [1, {layers}]: the model has {layers} blocks")
    if not args.smoke and not args.dit.is_file():
        p.error(f"--dit: {args.dit} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.data or Path(tmp) / "data"
        spec = DatasetSpec(
            episodes=args.episodes, steps=args.steps_per_episode, size=64, seed=7, push_share=0.85
        )
        data = prepare_data(folder, spec, workers=args.workers)
        if data.states is None:
            sys.exit(f"--data: {folder} was recorded without states.npy; record it again into a new folder")
        train_data, held_out = split(data, args.held_out)
        model = fixed_model(args, train_data, Path(tmp) / "work")
        seconds = {"data": time.perf_counter() - start}
        if args.features is not None and args.features.is_file():
            features = torch.load(args.features, weights_only=True)
            if features.get("layer") != args.layer:  # files without it hold the last block's
                kept = features["layer"] or "all"
                sys.exit(f"--features: {args.features} holds the states after {kept} blocks, not --layer's")
        else:
            features = {
                "train": hidden_states(model, train_data, args.clips, args.batch_size, "clips"),
                "held_out": hidden_states(
                    model, held_out, args.held_out_clips, args.batch_size, "held-out clips"
                ),
            }
            if args.features is not None:
                torch.save({**features, "layer": args.layer}, args.features)
        (train_hidden, train_scenes), (test_hidden, test_scenes) = features["train"], features["held_out"]
        seconds["forwards"] = time.perf_counter() - start - sum(seconds.values())
        chunk = model.batcher.chunk
        probe, history = train_probe(args, *second_chunk(train_hidden, train_scenes, chunk))
        seconds["probe"] = time.perf_counter() - start - sum(seconds.values())
        scores = score(probe, *second_chunk(test_hidden, test_scenes, chunk))
    report = {
        "benchmark": "state_probe_check",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "settings": {k: v.name if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "history": history,
        "held_out": scores,
    }
    print(json.dumps(report["held_out"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
