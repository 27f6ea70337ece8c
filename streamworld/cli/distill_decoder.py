"""`streamworld distill-decoder`: train the lite decoder to imitate a model's Wan VAE decoder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import loading
from .errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "distill-decoder",
        help="train the lite decoder (--decoder lite) to imitate a model's Wan VAE decoder",
        description=(
            "Distil StreamWorld's lite causal decoder from a model's Wan VAE: clips of your videos are "
            "encoded and decoded by the VAE once (the targets), then the lite decoder learns to produce "
            "the same frames from the same latents. Reports the PSNR against the VAE decoder on held-out "
            "clips and writes a .safetensors file for `serve`/`bench --decoder lite --decoder-weights`."
        ),
    )
    parser.add_argument("--model", default="wan2.1-t2v-1.3b", help="model preset (default: wan2.1-t2v-1.3b)")
    parser.add_argument("--vae", metavar="DIR", help="local diffusers AutoencoderKLWan folder (the teacher)")
    parser.add_argument("--weights", metavar="DIR", help="a diffusers-style model folder holding vae/")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="distil from a seeded random VAE (checks the pipeline only; the result is useless)",
    )
    parser.add_argument(
        "--videos", required=True, metavar="DIR", help="folder of training videos (mp4, webm, mkv, mov, ...)"
    )
    parser.add_argument("--out", required=True, metavar="PATH", help="output .safetensors file")
    parser.add_argument("--frame-size", metavar="HxW", help="training frame size (default: the model's)")
    parser.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    parser.add_argument("--batch-size", type=int, default=4, help="clips per step (default 4)")
    parser.add_argument(
        "--clip-latent-frames",
        type=int,
        default=6,
        help="latent frames per clip (default 6: a first chunk and a steady-state one)",
    )
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    parser.add_argument("--max-clips", type=int, default=400, help="most clips read (default 400)")
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    parser.add_argument("--json", metavar="PATH", help="write the training summary as JSON")
    parser.set_defaults(func=run)


def _student_config(args: argparse.Namespace):
    """The preset the lite decoder is distilled for, with --frame-size; checks the numbers."""
    from ..models import get_preset

    try:
        config = get_preset(args.model)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    if config.pixel_space:
        raise UsageError(f"model {config.id} works in pixel space: it has no VAE decoder to distil")
    config = loading.override_preset(config, args)
    for name in ("steps", "batch_size", "clip_latent_frames", "max_clips"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    return config


def _video_files(folder: str) -> list:
    from ..models.distill import video_files

    try:
        return video_files(folder)
    except loading.LOAD_ERRORS as e:
        raise UsageError(str(e)) from None


def _clips(args: argparse.Namespace, config, files: list) -> list:
    """Clips of the videos at the model's size, each as long as --clip-latent-frames decode to."""
    from ..models.distill import read_clips

    frames = 1 + config.temporal_ratio * (args.clip_latent_frames - 1)
    try:
        clips = list(read_clips(files, config.height, config.width, frames, args.max_clips))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if len(clips) < 2:
        raise UsageError(
            f"the videos under {args.videos} give {len(clips)} clip(s) of {frames} frames; "
            "at least 2 are needed"
        )
    print(f"{len(clips)} clips of {frames} frames at {config.height}x{config.width} from {len(files)} videos")
    return clips


def run(args: argparse.Namespace) -> int:
    config = _student_config(args)
    out = Path(args.out)
    if out.suffix != ".safetensors" or not out.resolve().parent.exists():
        raise UsageError(f"--out must be a .safetensors path in an existing folder, got {out}")
    vae_path = loading.teacher_vae_path(args, config)
    device = loading.resolve_device(args.device)
    files = _video_files(args.videos)
    vae = loading.load_teacher_vae(config, vae_path, device)
    teacher = str(vae_path) if vae_path else f"{config.id} random VAE (seed {config.init_seed + 1})"
    summary = _distill(args, config, vae, _clips(args, config, files), device, teacher, out)
    print(
        f"wrote {out}: held-out PSNR against the VAE decoder {summary['held_out_psnr_db']:.2f} dB "
        f"(before training {summary['held_out_psnr_db_before']:.2f} dB), {summary['train_s']:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def _distill(args: argparse.Namespace, config, vae, clips: list, device, teacher: str, out: Path) -> dict:
    """Trains a fresh lite decoder on the teacher's outputs, saves it to --out, returns the summary."""
    import torch

    from ..models.distill import DistillConfig, distill, save, teacher_set
    from ..models.lite_decoder import LiteDecoder

    data = teacher_set(vae, clips)
    clips.clear()  # the teacher set holds what training needs; the raw clips can go
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        decoder = LiteDecoder.for_model(config)
    dcfg = DistillConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        latent_frames=args.clip_latent_frames,
        lr=args.lr,
        max_clips=args.max_clips,
        seed=args.seed,
    )
    summary = distill(decoder, data, dcfg, device)
    summary["teacher"] = teacher
    save(decoder, str(out), summary, teacher)
    return summary
