"""Does the adversarial term's discriminator learn? A check on cached rollouts, before a
training round spends GPU time on it.

`train pusht --adversarial-weight` trains a `ClipDiscriminator` to tell true stream clips
from the one-step sampler's rollouts of the same sinks and actions (`docs/pusht.md`, "An
adversarial term on the rollouts"). In round 18 its loss stayed at chance. This benchmark
trains the discriminator alone, with the model fixed: it records a few episodes, unrolls
the model over `--batches` batches of stream clips once, trains one discriminator per
variant on all but the last batch in turn, and scores each on the last, held-out batch
every `--every` steps. The variants are, at each `--lr`, each `--background` B: the
hinge losses weigh the patches where clip and rollout differ at 1 and the others at B
(`train pusht --adversarial-background`). B = 1 is the mean over all patches ("mean"),
B = 0 the differing patches alone ("masked", training's default). All start from the
same weights.

Reported per variant and scoring step, on the held-out batch: the mean loss over all
patches, and over the patches that differ (their share is `patches`) the mean true and
rolled-out logits and the share of those patches whose true logit is the higher. A
discriminator that learns opens a gap between the two logits where they differ.

    python benchmarks/discriminator_check.py --steps 60 --json discriminator_check.json

On a 2-core CPU, about a minute for the rollouts and 2 s per step and variant (the
defaults, 60 steps of two variants: some 5 minutes; four variants took 582 s).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from streamworld.models import get_preset
from streamworld.models.pixels import frames_to_latents
from streamworld.models.world_model import builtin_weights_path
from streamworld.pusht.adversarial import (
    ClipDiscriminator,
    differing_patches,
    discriminator_loss,
    discriminator_optimizer,
    discriminator_update,
    patch_weights,
)
from streamworld.pusht.data import DatasetSpec
from streamworld.pusht.train import TrainConfig, Trainer, prepare_data, smoke_config

SHIPPED = builtin_weights_path(get_preset("pusht-delta"))


def rollout_batches(args: argparse.Namespace, folder: Path) -> list[tuple[torch.Tensor, ...]]:
    """`--batches` batches of (sink, true latents, rolled-out latents, actions)."""
    config = get_preset("pusht-delta")
    if args.smoke:
        config = smoke_config(config)
    spec = DatasetSpec(
        episodes=args.episodes, steps=args.steps_per_episode, size=config.height, seed=2, push_share=0.85
    )
    data = prepare_data(folder / "data", spec, workers=args.workers, progress=False)
    train = TrainConfig(
        batch_size=args.batch_size, clip_chunks=5, unroll_share=1.0, seed=args.seed, lr=args.lr[0]
    )
    init = None if args.smoke else str(args.dit)
    trainer = Trainer(config, train, data, folder / "work", "cpu", init=init)
    batches = []
    for _ in range(args.batches):
        batch = trainer.next_batch()
        latents = frames_to_latents(batch["frames"], config.anchored_pixels)
        noise = torch.randn(latents[:, :, 1:].shape, generator=trainer.gen)
        with torch.no_grad():
            fake = trainer.unrolled(batch["frames"], batch["actions"], noise)
        batches.append((latents[:, :, :1], latents[:, :, 1:], fake, batch["actions"]))
    return batches


@torch.no_grad()
def score(disc: ClipDiscriminator, held_out: tuple[torch.Tensor, ...]) -> dict[str, float]:
    sink, real, fake, actions = held_out
    d_real, d_fake = disc(sink, real, actions), disc(sink, fake, actions)
    where = differing_patches(real, fake, d_real.shape[2:]) > 0
    return {
        "loss_all_patches": round(float(discriminator_loss(d_real, d_fake)), 5),
        "patches": round(float(where.float().mean()), 4),
        "real": round(float(d_real[where].mean()), 5),
        "fake": round(float(d_fake[where].mean()), 5),
        "right": round(float((d_real[where] > d_fake[where]).float().mean()), 4),
    }


def train_variants(
    args: argparse.Namespace, batches: list[tuple[torch.Tensor, ...]]
) -> dict[str, list[dict]]:
    """Each variant's discriminator trained on batches[:-1] in turn, scored on batches[-1]."""
    size = batches[0][1].shape[-1]
    variants = {}
    for lr in args.lr:
        for background in args.background:
            torch.manual_seed(args.seed)
            disc = ClipDiscriminator(size)
            opt = discriminator_optimizer(disc, lr)
            kind = {1.0: "mean", 0.0: "masked"}.get(background, f"background {background:g}")
            variants[f"{kind} lr {lr:g}"] = (disc, opt, background)
    history: dict[str, list[dict]] = {name: [] for name in variants}
    for name, (disc, _, _) in variants.items():
        history[name].append({"step": 0, **score(disc, batches[-1])})
    for step in range(1, args.steps + 1):
        sink, real, fake, actions = batches[(step - 1) % (len(batches) - 1)]
        for name, (disc, opt, background) in variants.items():
            where = patch_weights(differing_patches(real, fake, disc.grid(real.shape[2])), background)
            discriminator_update(disc, opt, sink, real, fake, actions, where)  # as training's step
            if step % args.every == 0 or step == args.steps:
                history[name].append({"step": step, **score(disc, batches[-1])})
                row = history[name][-1]
                print(
                    f"step {step:4d} {name:18s} loss {row['loss_all_patches']:.4f} | where they differ "
                    f"({row['patches']:.2f}): true {row['real']:+.3f} rollout {row['fake']:+.3f} "
                    f"right {row['right']:.2f}",
                    flush=True,
                )
    return history


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--dit", type=Path, default=SHIPPED, help="the model's weights (default: the shipped pusht-delta)"
    )
    p.add_argument("--episodes", type=int, default=8, help="episodes recorded (default 8)")
    p.add_argument("--steps-per-episode", type=int, default=150, help="(default 150)")
    p.add_argument("--batch-size", type=int, default=8, help="clips per batch (default 8)")
    p.add_argument(
        "--batches", type=int, default=5, help="batches unrolled; the last is held out (default 5)"
    )
    p.add_argument("--steps", type=int, default=60, help="discriminator steps (default 60)")
    p.add_argument("--every", type=int, default=20, help="score every this many steps (default 20)")
    p.add_argument("--lr", type=float, nargs="+", default=[1.9e-4], help="learning rates (default 1.9e-4)")
    p.add_argument(
        "--background",
        type=float,
        nargs="+",
        default=[1.0, 0.0],
        help="weights of the patches that do not differ, in [0, 1] (default 1 0: mean and masked)",
    )
    p.add_argument("--seed", type=int, default=18, help="(default 18)")
    p.add_argument("--workers", type=int, default=2, help="processes recording episodes (default 2)")
    p.add_argument("--smoke", action="store_true", help="the tiny smoke model, random weights (tests)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    for name in ("episodes", "steps_per_episode", "batch_size", "steps", "every", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.batches < 2:
        p.error("--batches must be at least 2: one to train on and one held out")
    if not all(0 <= b <= 1 for b in args.background):
        p.error("--background must be in [0, 1]")
    if not all(lr > 0 for lr in args.lr):
        p.error("--lr must be positive")
    if not args.smoke and not args.dit.is_file():
        p.error(f"--dit: {args.dit} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        batches = rollout_batches(args, Path(tmp))
    print(f"rollouts ready after {time.perf_counter() - start:.0f} s", flush=True)
    history = train_variants(args, batches)
    report = {
        "benchmark": "discriminator_check",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "settings": {k: v.name if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
        "seconds": round(time.perf_counter() - start, 1),
        "variants": history,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
