"""`streamworld generate`: a clip from the sequential reference generator (no engine)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import arguments, loading
from .errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate a clip with the sequential reference generator",
        description=(
            "Generate a clip chunk by chunk with the sequential reference generator (no engine). "
            "The same model, seed and inputs always give the same frames."
        ),
    )
    arguments.add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    parser.add_argument("--chunks", type=int, default=3, help="number of chunks to generate (default 3)")
    parser.add_argument("--prompt", default="", help="text prompt (models that take prompts)")
    parser.add_argument(
        "--image",
        metavar="PNG",
        help="first frame (image-to-world models; pusht: default the environment's, by --seed)",
    )
    parser.add_argument(
        "--actions",
        metavar="FILE.json",
        help='per-video-frame actions: a JSON list of vectors, or {"actions": [[...], ...]}; the last '
        "is held for the frames after it. Default: pusht holds the agent where the first frame shows it, "
        "other action models get zeros",
    )
    parser.add_argument("--kv-mode", choices=arguments.KV_MODES, help="KV mode (default: the model's)")
    parser.add_argument(
        "--out", required=True, metavar="PATH", help="output .npy (uint8 [T, H, W, 3]) or .mp4"
    )
    parser.set_defaults(func=run)


# Largest --actions file read: 64 MiB of JSON is millions of vectors, far beyond any run.
MAX_ACTIONS_FILE_BYTES = 64 * 2**20


def read_actions(path: str) -> np.ndarray:
    """[frames, action_dim] float32 from a JSON list of vectors or {"actions": [...]}."""
    file = Path(path)
    try:
        if file.stat().st_size > MAX_ACTIONS_FILE_BYTES:
            raise UsageError(f"--actions: {path} is larger than {MAX_ACTIONS_FILE_BYTES // 2**20} MiB")
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise UsageError(f"--actions: {path} does not exist") from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, integers too long, too deep
        raise UsageError(f"--actions: {path} is not valid JSON ({str(e)[:200]})") from None
    except OSError as e:  # a folder, no permission
        raise UsageError(f"--actions: {path} cannot be read ({e.strerror or e})") from None
    if isinstance(data, dict):
        data = data.get("actions")
    try:
        arr = np.asarray(data, dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"--actions: {path} must hold a list of equal-length number lists") from None
    if arr.ndim != 2:
        raise UsageError(f"--actions: {path} must hold a list of vectors, got shape {arr.shape}")
    return arr


def read_image(path: str) -> np.ndarray:
    """The first frame of an image (or video) file as uint8 [H, W, 3]."""
    import av

    try:
        with av.open(path) as container:
            frame = next(container.decode(video=0))
    except (FileNotFoundError, av.error.FileNotFoundError):
        raise UsageError(f"--image: {path} does not exist") from None
    except (av.error.InvalidDataError, StopIteration):
        raise UsageError(f"--image: {path} is not a readable image") from None
    return frame.to_ndarray(format="rgb24")


def _check(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    if out.suffix not in (".npy", ".mp4"):
        raise UsageError(f"--out must end in .npy or .mp4, got {out.name}")
    if not out.parent.exists():
        raise UsageError(f"--out: folder {out.parent} does not exist")
    if args.chunks < 1:
        raise UsageError("--chunks must be at least 1")
    if args.seed < 0:
        raise UsageError("--seed must be at least 0")
    return out


def run(args: argparse.Namespace) -> int:
    from ..engine import GenerationRequest, ReferenceGenerator, on_torch_thread

    out = _check(args)
    actions = read_actions(args.actions) if args.actions else None
    image = read_image(args.image) if args.image else None
    model = loading.load_model(args)
    if args.prompt and not model.config.takes_prompt:
        note(f"--prompt is ignored: {model.config.id} takes no text prompt")
    if image is None and model.config.needs_image:
        from ..scenes import first_frame_source, resting_action

        first_frame = first_frame_source(model.config)
        if first_frame is None:
            raise UsageError(f"model {model.config.id} needs --image")
        image, scene = first_frame(args.seed)
        rest = resting_action(model.config, scene)
        if actions is None and rest is not None:
            actions = np.asarray([rest], dtype=np.float32)  # held for every frame
    request = GenerationRequest(
        seed=args.seed,
        num_chunks=args.chunks,
        prompt=args.prompt,
        image=image,
        actions=actions,
        kv_mode=args.kv_mode,
    )
    start = time.perf_counter()
    try:
        result = on_torch_thread(model.device, lambda: ReferenceGenerator(model).generate(request))
    except ValueError as e:
        raise UsageError(str(e)) from None
    elapsed = time.perf_counter() - start
    _write(result.frames, out, model.config.fps)
    t, h, w, _ = result.frames.shape
    if args.actions:
        _note_actions(len(actions), t, args.chunks)
    print(
        f"wrote {out}: {t} frames of {h}x{w} (height x width, {args.chunks} chunks, kv_mode "
        f"{request.kv_mode or model.config.default_kv_mode}) in {elapsed:.2f} s "
        f"({t / elapsed:.1f} frames/s)"
    )
    return 0


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def _note_actions(given: int, frames: int, chunks: int) -> None:
    """Says where --actions and the clip's length disagree (one action per video frame)."""
    if given > frames:
        note(
            f"{given - frames} of the {given} actions in --actions are ignored: "
            f"{chunks} chunks make {frames} frames (raise --chunks to use them)"
        )
    elif given < frames:
        note(
            f"--actions has {given} actions for {frames} frames: "
            f"the last one is held for the other {frames - given}"
        )


def _write(frames: np.ndarray, out: Path, fps: int) -> None:
    if out.suffix == ".npy":
        np.save(out, frames)
    else:
        from ..media import write_mp4

        write_mp4(frames, out, fps=fps)
