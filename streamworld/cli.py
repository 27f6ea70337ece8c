"""`streamworld` command line.

Subcommands: `serve` (the streaming server), `generate` (the sequential reference
generator), `bench` (the engine against the sequential baseline), `train` and `eval` (the
embedded PushT world model), `distill-decoder` (the lite decoder) and `models` (the model
presets).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import __version__


class UsageError(Exception):
    """A problem with the user's arguments or files: printed as one line, exit code 2."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="tiny-wan", help="model preset (see `streamworld models`; default: tiny-wan)"
    )
    _add_weight_args(p)


def _add_weight_args(p: argparse.ArgumentParser) -> None:
    """Where weights come from and where the model runs (for real-size presets)."""
    p.add_argument(
        "--weights",
        metavar="DIR",
        help="local diffusers-style folder with transformer/, vae/, text_encoder/ and tokenizer/",
    )
    p.add_argument(
        "--dit",
        metavar="PATH",
        help="DiT checkpoint: diffusers folder, original Wan file, CausVid model.pt or Self-Forcing .pt",
    )
    p.add_argument("--vae", metavar="DIR", help="local diffusers AutoencoderKLWan folder")
    p.add_argument("--text-encoder", metavar="DIR", help="local umT5 encoder folder with its tokenizer")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="run a real-size model with seeded random weights (timing benchmarks only)",
    )
    p.add_argument(
        "--frame-size",
        metavar="HxW",
        help="override the preset's frame size, height x width, e.g. 320x512 (timing studies; "
        "trained weights such as pusht's only work at their own size)",
    )
    p.add_argument(
        "--window",
        type=int,
        metavar="N",
        help="override the preset's attention window (latent frames after the sink frames)",
    )
    p.add_argument(
        "--decoder",
        choices=("wan", "lite"),
        default="wan",
        help="how latents become frames: wan (the model's VAE decoder, default) or lite "
        "(StreamWorld's small causal decoder, many times cheaper; its weights come from "
        "`streamworld distill-decoder` via --decoder-weights, or are random with --random-weights)",
    )
    p.add_argument("--decoder-weights", metavar="PATH", help="lite decoder weights (.safetensors)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the hot paths with torch.compile while the model loads, so serving never waits "
        "for it: the DiT's elementwise arithmetic, and the lite decoder with --decoder lite (a GPU "
        "needs Triton, a CPU a C++ compiler; adds some 30-60 s to loading; figures in docs/benchmarks.md)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16"
    )
    p.add_argument(
        "--threads",
        type=int,
        help="PyTorch CPU threads (default: PyTorch's, one per core). Use 1 when other busy "
        "processes share the cores: OpenMP threads then lose whole time slices (docs/benchmarks.md)",
    )


def _check_weight_paths(args: argparse.Namespace) -> None:
    for name in ("weights", "dit", "vae", "text_encoder", "decoder_weights"):
        path = getattr(args, name)
        if path is not None and not Path(path).exists():
            raise UsageError(f"--{name.replace('_', '-')}: {path} does not exist")


def _apply_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamworld",
        description="Real-time serving of autoregressive video diffusion world models.",
    )
    parser.add_argument("--version", action="version", version=f"streamworld {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the WebSocket streaming server",
        description=(
            "Serve one or more models on one port: the browser demo at /, /healthz, /metrics, /v1/models "
            "and WebSocket streams at /v1/stream (protocol: docs/protocol.md). Stops cleanly on Ctrl-C "
            "or SIGTERM: live sessions get session.done."
        ),
    )
    serve.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="MODEL",
        help="model to serve; repeat for several (default: pusht). The first is the default model.",
    )
    _add_weight_args(serve)  # they apply to the real-size models, or to the only model served
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--max-sessions",
        type=int,
        default=8,
        help="sessions per model that fit the K/V pool in their worst case (default 8)",
    )
    serve.add_argument(
        "--max-queue", type=int, default=16, help="sessions that may wait for admission (default 16)"
    )
    serve.add_argument("--stages", type=int, default=1, help="block stages per forward (default 1)")
    serve.add_argument(
        "--ranks", type=int, default=1, help="virtual ranks (threads / CUDA streams) (default 1)"
    )
    serve.add_argument(
        "--ttff-budget",
        type=float,
        default=1.0,
        help="seconds from a session's start to its first chunk's deadline (default 1.0)",
    )
    _add_batch_args(serve)
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser(
        "generate",
        help="generate a clip with the sequential reference generator",
        description=(
            "Generate a clip chunk by chunk with the sequential reference generator (no engine). "
            "The same model, seed and inputs always give the same frames."
        ),
    )
    _add_model_args(gen)
    gen.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    gen.add_argument("--chunks", type=int, default=3, help="number of chunks to generate (default 3)")
    gen.add_argument("--prompt", default="", help="text prompt (models that take prompts)")
    gen.add_argument(
        "--image",
        metavar="PNG",
        help="first frame (image-to-world models; pusht: default the environment's, by --seed)",
    )
    gen.add_argument(
        "--actions",
        metavar="FILE.json",
        help='per-video-frame actions: a JSON list of vectors, or {"actions": [[...], ...]}',
    )
    gen.add_argument("--kv-mode", choices=("clean", "final", "noisy"), help="KV mode (default: the model's)")
    gen.add_argument("--out", required=True, metavar="PATH", help="output .npy (uint8 [T, H, W, 3]) or .mp4")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser(
        "bench",
        help="N concurrent streams through the engine vs. the sequential baseline",
        description=(
            "Run N streams through the engine for a fixed time, then the same streams one after another "
            "through the sequential reference loop (the naive baseline) in the same process. Prints "
            "aggregate and per-stream frames/s, time to first frame, inter-chunk p50/p99, deadline "
            "attainment, the batch-size histogram, executor idle share and the engine/baseline ratio."
        ),
    )
    _add_model_args(bench)
    bench.add_argument("--streams", type=int, default=4, help="concurrent streams (default 4)")
    bench.add_argument("--duration", type=float, default=20.0, help="seconds of engine run (default 20)")
    bench.add_argument(
        "--kv-mode", choices=("clean", "final", "noisy"), help="KV mode (default: the model's)"
    )
    bench.add_argument(
        "--baseline-kv-mode",
        choices=("clean", "final", "noisy"),
        help="KV mode of the sequential baseline (default: same as --kv-mode)",
    )
    bench.add_argument("--priority", choices=("interactive", "standard", "batch"), default="standard")
    bench.add_argument("--prompt", default="a walk through a forest")
    bench.add_argument(
        "--unpaced",
        action="store_true",
        help="no playback clocks: every stream runs as fast as it can (throughput)",
    )
    bench.add_argument("--stages", type=int, default=1, help="block stages per forward (default 1)")
    bench.add_argument(
        "--ranks", type=int, default=1, help="virtual ranks (threads / CUDA streams) (default 1)"
    )
    _add_batch_args(bench)
    bench.add_argument(
        "--ttff-budget",
        type=float,
        default=1.0,
        help="seconds from start to chunk 0's deadline (default 1.0)",
    )
    bench.add_argument("--no-baseline", action="store_true", help="skip the sequential baseline")
    bench.add_argument(
        "--baseline-repeats",
        type=int,
        default=1,
        metavar="N",
        help="run the sequential baseline N times and take the median for the ratio (default 1); "
        "it runs one unit at a time, so it is host-bound and varies more between runs than the engine",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="CUDA only: run the measured window under the PyTorch profiler and report GPU kernel "
        "time per executor (DiT, decode, encode), GPU idle share and the costliest kernels "
        "(the profiler slows the run: quote throughput from a run without it)",
    )
    bench.add_argument("--json", metavar="PATH", help="write the full result as JSON")
    bench.set_defaults(func=cmd_bench)

    train = sub.add_parser(
        "train",
        help="train the embedded PushT world model",
        description=(
            "Record PushT episodes (when the data folder has none yet) and train the pusht world model "
            "with flow matching. A run stops after --minutes and saves a checkpoint in --workdir; running "
            "the same command again resumes it, until --total-steps. Every run exports the EMA weights "
            "(float16 safetensors), which `streamworld serve --model pusht --dit PATH` serves "
            "instead of the built-in ones. The "
            "recipe is in docs/pusht.md."
        ),
    )
    train.add_argument("model", choices=("pusht",), help="the model to train (only pusht is trainable)")
    train.add_argument(
        "--workdir", default="pusht-train", help="checkpoint and output folder (default pusht-train)"
    )
    train.add_argument(
        "--data", metavar="DIR", help="recorded episodes (default WORKDIR/data; recorded when missing)"
    )
    train.add_argument("--episodes", type=int, default=2000, help="episodes to record (default 2000)")
    train.add_argument("--steps-per-episode", type=int, default=200, help="actions per episode (default 200)")
    train.add_argument("--data-seed", type=int, default=0, help="seed of the recorded data set (default 0)")
    train.add_argument("--workers", type=int, help="processes that record episodes (default: CPU count)")
    train.add_argument(
        "--minutes", type=float, default=10.0, help="wall-time budget of this run (default 10)"
    )
    train.add_argument(
        "--total-steps", type=int, default=12_000, help="length of the whole schedule (default 12000)"
    )
    train.add_argument("--batch-size", type=int, default=64, help="clips per step (default 64)")
    train.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    train.add_argument(
        "--change-weight",
        type=float,
        default=0.0,
        help="extra loss weight on pixels that differ from the episode's first frame (default 0)",
    )
    train.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    train.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    train.add_argument("--out", metavar="PATH", help="exported weights (default WORKDIR/pusht.safetensors)")
    train.add_argument(
        "--prediction",
        choices=("flow", "x0"),
        help="what the DiT learns to output (default: the preset's, x0); the served preset must match",
    )
    train.add_argument(
        "--init",
        metavar="PATH",
        help="start from these exported weights (fine-tuning) instead of random ones",
    )
    train.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, data set and schedule on the CPU: checks the pipeline in seconds",
    )
    train.set_defaults(func=cmd_train)

    ev = sub.add_parser(
        "eval",
        help="evaluate the PushT world model against the real environment",
        description=(
            "Roll out the real PushT environment from each seed's initial state with the scripted "
            "controller, give the model the first frame and the same actions, and compare predicted with "
            "true frames per horizon: PSNR, SSIM and the agent's and block's position errors, against the "
            "copy-first-frame baseline. Prints a Markdown table; --json writes every horizon."
        ),
    )
    ev.add_argument("model", choices=("pusht",), help="the model to evaluate")
    ev.add_argument("--seeds", default="0-99", help="environment seeds, e.g. 0-99 or 1,5,9 (default 0-99)")
    ev.add_argument("--horizon", type=int, default=32, help="future frames compared (default 32)")
    ev.add_argument(
        "--kv-mode",
        action="append",
        dest="kv_modes",
        choices=("clean", "final", "noisy"),
        help="KV mode to evaluate; repeat for several (default: all three)",
    )
    ev.add_argument("--dit", metavar="PATH", help="weights to evaluate (default: the shipped ones)")
    ev.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ev.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    ev.set_defaults(func=cmd_eval)

    distill = sub.add_parser(
        "distill-decoder",
        help="train the lite decoder (--decoder lite) to imitate a model's Wan VAE decoder",
        description=(
            "Distil StreamWorld's lite causal decoder from a model's Wan VAE: clips of your videos are "
            "encoded and decoded by the VAE once (the targets), then the lite decoder learns to produce "
            "the same frames from the same latents. Reports the PSNR against the VAE decoder on held-out "
            "clips and writes a .safetensors file for `serve`/`bench --decoder lite --decoder-weights`."
        ),
    )
    distill.add_argument("--model", default="wan2.1-t2v-1.3b", help="model preset (default: wan2.1-t2v-1.3b)")
    distill.add_argument("--vae", metavar="DIR", help="local diffusers AutoencoderKLWan folder (the teacher)")
    distill.add_argument("--weights", metavar="DIR", help="a diffusers-style model folder holding vae/")
    distill.add_argument(
        "--random-weights",
        action="store_true",
        help="distil from a seeded random VAE (checks the pipeline only; the result is useless)",
    )
    distill.add_argument(
        "--videos", required=True, metavar="DIR", help="folder of training videos (mp4, webm, mkv, mov, ...)"
    )
    distill.add_argument("--out", required=True, metavar="PATH", help="output .safetensors file")
    distill.add_argument("--frame-size", metavar="HxW", help="training frame size (default: the model's)")
    distill.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    distill.add_argument("--batch-size", type=int, default=4, help="clips per step (default 4)")
    distill.add_argument(
        "--clip-latent-frames",
        type=int,
        default=6,
        help="latent frames per clip (default 6: a first chunk and a steady-state one)",
    )
    distill.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    distill.add_argument("--max-clips", type=int, default=400, help="most clips read (default 400)")
    distill.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    distill.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    distill.add_argument("--json", metavar="PATH", help="write the training summary as JSON")
    distill.set_defaults(func=cmd_distill_decoder)

    models = sub.add_parser("models", help="list the model presets")
    models.add_argument("--json", action="store_true", help="print the /v1/models entries as JSON")
    models.set_defaults(func=cmd_models)
    return parser


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-batch", type=int, default=16, help="most units in one batch (default 16)")
    parser.add_argument(
        "--token-budget",
        type=int,
        default=65536,
        help="most query tokens in one batch (default 65536; the most urgent unit always goes). On an "
        "H200, 8192 (one 480x832 unit) gave one noisy stream 0.50 s to the first frame instead of 1.30 s, "
        "and 16384 (8 units of 320x512) let 8 paced streams meet every deadline (docs/benchmarks.md)",
    )


def _check_batch_args(args: argparse.Namespace) -> None:
    if args.max_batch < 1 or args.token_budget < 1:
        raise UsageError("--max-batch and --token-budget must be at least 1")


def _override(config, args: argparse.Namespace):
    """The preset with --frame-size and --window applied."""
    import dataclasses

    changes: dict = {}
    if args.frame_size is not None:
        h, sep, w = args.frame_size.lower().partition("x")
        if not (sep and h.isdigit() and w.isdigit() and int(h) > 0 and int(w) > 0):
            raise UsageError(f"--frame-size must look like 320x512, got {args.frame_size!r}")
        changes.update(height=int(h), width=int(w))
    if getattr(args, "window", None) is not None:  # distill-decoder has no --window
        changes["window_frames"] = args.window
    if not changes:
        return config
    try:
        return dataclasses.replace(config, **changes)
    except ValueError as e:
        raise UsageError(f"--frame-size/--window: {e}") from None


def _weight_paths(args: argparse.Namespace):
    from .models.world_model import WeightPaths

    return WeightPaths(
        root=args.weights,
        dit=args.dit,
        vae=args.vae,
        text_encoder=args.text_encoder,
        lite_decoder=args.decoder_weights,
    )


def _load_options(args: argparse.Namespace) -> dict:
    """`WorldModel.load` keyword arguments from the weight arguments."""
    return dict(
        random_weights=args.random_weights,
        device=args.device,
        dtype=args.dtype,
        decoder=args.decoder,
        compiled=args.compile,
    )


def _load_model(args: argparse.Namespace):
    _apply_threads(args)
    from .engine.executor import on_torch_thread
    from .models import get_preset
    from .models.world_model import WorldModel, resolve_device

    try:
        config = _override(get_preset(args.model), args)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    weights = _weight_paths(args)
    _check_weight_paths(args)
    try:
        return on_torch_thread(
            resolve_device(args.device),
            lambda: WorldModel.load(config, weights, **_load_options(args)),
        )
    except (ValueError, RuntimeError, FileNotFoundError, NotImplementedError) as e:
        raise UsageError(str(e).splitlines()[0] if "\n" not in str(e) else str(e)) from None


def _read_actions(path: str) -> np.ndarray:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--actions: {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--actions: {path} is not valid JSON ({e})") from None
    if isinstance(data, dict):
        data = data.get("actions")
    try:
        arr = np.asarray(data, dtype=np.float32)
    except (TypeError, ValueError):
        raise UsageError(f"--actions: {path} must hold a list of equal-length number lists") from None
    if arr.ndim != 2:
        raise UsageError(f"--actions: {path} must hold a list of vectors, got shape {arr.shape}")
    return arr


def _read_image(path: str) -> np.ndarray:
    import av

    try:
        with av.open(path) as container:
            frame = next(container.decode(video=0))
    except (FileNotFoundError, av.error.FileNotFoundError):
        raise UsageError(f"--image: {path} does not exist") from None
    except (av.error.InvalidDataError, StopIteration):
        raise UsageError(f"--image: {path} is not a readable image") from None
    return frame.to_ndarray(format="rgb24")


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine.executor import on_torch_thread
    from .engine.reference import GenerationRequest, ReferenceGenerator
    from .server.media import write_mp4

    out = Path(args.out)
    if out.suffix not in (".npy", ".mp4"):
        raise UsageError(f"--out must end in .npy or .mp4, got {out.name}")
    if not out.parent.exists():
        raise UsageError(f"--out: folder {out.parent} does not exist")
    if args.chunks < 1:
        raise UsageError("--chunks must be at least 1")
    if args.seed < 0:
        raise UsageError("--seed must be at least 0")
    actions = _read_actions(args.actions) if args.actions else None
    image = _read_image(args.image) if args.image else None
    model = _load_model(args)
    if image is None and model.config.needs_image:
        from .scenes import first_frame_source

        first_frame = first_frame_source(model.config)
        if first_frame is None:
            raise UsageError(f"model {model.config.id} needs --image")
        image, _ = first_frame(args.seed)
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
    if out.suffix == ".npy":
        np.save(out, result.frames)
    else:
        write_mp4(result.frames, out, fps=model.config.fps)
    t, h, w, _ = result.frames.shape
    print(
        f"wrote {out}: {t} frames of {h}x{w} (height x width, {args.chunks} chunks, kv_mode "
        f"{request.kv_mode or model.config.default_kv_mode}) in {elapsed:.2f} s "
        f"({t / elapsed:.1f} frames/s)"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from aiohttp import web

    from .engine.engine import EngineConfig
    from .engine.executor import on_torch_thread
    from .engine.scheduler import SchedulerConfig
    from .models import PRESETS
    from .models.world_model import WeightPaths, WorldModel, resolve_device
    from .server.app import StreamWorldServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model_ids = args.models or ["pusht"]
    unknown = [m for m in model_ids if m not in PRESETS]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r}; known models: {', '.join(sorted(PRESETS))}")
    if len(set(model_ids)) != len(model_ids):
        raise UsageError("each --model may be given once")
    if args.max_sessions < 1 or args.max_queue < 0:
        raise UsageError("--max-sessions must be at least 1 and --max-queue at least 0")
    _check_batch_args(args)
    _apply_threads(args)
    _check_weight_paths(args)
    weights = _weight_paths(args)
    models = {}
    if args.decoder == "lite" and all(PRESETS[m].pixel_space for m in model_ids):
        raise UsageError("--decoder lite: the served models have no VAE decoder to replace")
    for mid in model_ids:
        config = _override(PRESETS[mid], args)
        options = _load_options(args)
        if config.pixel_space:
            options["decoder"] = "wan"  # --decoder lite applies to the models with a VAE
        if config.requires_weights or len(model_ids) == 1:
            model_weights = weights
        else:  # a small model next to others: its own weights, but the lite decoder's if given
            lite = options["decoder"] == "lite"
            model_weights = WeightPaths(lite_decoder=args.decoder_weights) if lite else None
        try:
            models[mid] = on_torch_thread(
                resolve_device(args.device),
                lambda config=config, w=model_weights, o=options: WorldModel.load(config, w, **o),
            )
        except (ValueError, RuntimeError, FileNotFoundError, NotImplementedError) as e:
            raise UsageError(f"{mid}: {e}") from None
        if args.stages > config.num_layers:
            raise UsageError(f"--stages must be at most {config.num_layers} for {mid}")
    engine_config = EngineConfig(
        num_stages=args.stages,
        num_ranks=args.ranks,
        max_streams=args.max_sessions,
        max_queue=args.max_queue,
        ttff_budget_s=args.ttff_budget,
        scheduler=SchedulerConfig(max_batch_units=args.max_batch, token_budget=args.token_budget),
    )
    server = StreamWorldServer(models, engine_config, default_model=model_ids[0])
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    print(
        f"StreamWorld serving {', '.join(model_ids)} at http://{args.host}:{args.port}/ "
        f"(streams: ws://{args.host}:{args.port}/v1/stream); Ctrl-C stops",
        flush=True,
    )
    try:
        web.run_app(server.build_app(), host=args.host, port=args.port, print=None, shutdown_timeout=10.0)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, format_report, run_bench, write_json
    from .engine import EngineConfig, SchedulerConfig

    if args.streams < 1 or args.duration <= 0:
        raise UsageError("--streams must be at least 1 and --duration positive")
    if args.baseline_repeats < 1:
        raise UsageError("--baseline-repeats must be at least 1")
    _check_batch_args(args)
    if args.json and not Path(args.json).resolve().parent.exists():
        raise UsageError(f"--json: folder {Path(args.json).parent} does not exist")
    model = _load_model(args)
    if args.profile and model.device.type != "cuda":
        raise UsageError("--profile reads GPU kernel times and needs a CUDA device (--device cuda)")
    if args.stages > model.config.num_layers:
        raise UsageError(f"--stages must be at most {model.config.num_layers} (the model's blocks)")
    cfg = BenchConfig(
        streams=args.streams,
        duration_s=args.duration,
        kv_mode=args.kv_mode,
        baseline_kv_mode=args.baseline_kv_mode,
        priority=args.priority,
        prompt=args.prompt,
        paced=not args.unpaced,
        engine=EngineConfig(
            num_stages=args.stages,
            num_ranks=args.ranks,
            ttff_budget_s=args.ttff_budget,
            scheduler=SchedulerConfig(max_batch_units=args.max_batch, token_budget=args.token_budget),
        ),
        baseline=not args.no_baseline,
        baseline_repeats=args.baseline_repeats,
        profile=args.profile,
    )
    result = run_bench(model, cfg)
    print(format_report(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .models import get_preset
    from .pusht.data import DatasetSpec
    from .pusht.train import TrainConfig, Trainer, prepare_data, smoke_config

    config = get_preset(args.model)
    if args.prediction is not None:
        config = dataclasses.replace(config, prediction=args.prediction)
    workdir = Path(args.workdir)
    spec = DatasetSpec(
        episodes=args.episodes, steps=args.steps_per_episode, size=config.height, seed=args.data_seed
    )
    train_config = TrainConfig(
        batch_size=args.batch_size,
        total_steps=args.total_steps,
        lr=args.lr,
        seed=args.seed,
        change_weight=args.change_weight,
    )
    device = args.device
    if args.smoke:
        config = smoke_config(config)
        spec = DatasetSpec(episodes=4, steps=40, size=config.height, seed=args.data_seed)
        train_config = TrainConfig(
            batch_size=2,
            total_steps=min(args.total_steps, 4),
            warmup_steps=2,
            log_every=2,
            checkpoint_every=2,
            change_weight=args.change_weight,
        )
        device = "cpu"
    if not args.change_weight >= 0:  # also refuses nan
        raise UsageError("--change-weight must be at least 0")
    for name in ("episodes", "steps_per_episode", "total_steps", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.minutes <= 0:
        raise UsageError("--minutes must be positive")
    if workdir.exists() and not workdir.is_dir():
        raise UsageError(f"--workdir: {workdir} is a file")
    if args.out is not None and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out: folder {Path(args.out).parent} does not exist")
    data_dir = Path(args.data) if args.data else workdir / "data"
    try:
        data = prepare_data(data_dir, spec, workers=args.workers)
        if args.init is not None and not Path(args.init).is_file():
            raise UsageError(f"--init: {args.init} does not exist")
        trainer = Trainer(config, train_config, data, workdir, device=device, init=args.init)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    summary = trainer.run(args.minutes)
    out = trainer.export(args.out or workdir / f"{args.model}.safetensors")
    summary["weights"] = str(out)
    summary["weights_bytes"] = out.stat().st_size
    (workdir / "train_summary.json").write_text(
        json.dumps({**summary, "history": trainer.history}, indent=2) + "\n"
    )
    print(json.dumps(summary, indent=2))
    if trainer.step < train_config.total_steps:
        print(
            f"stopped at step {trainer.step} of {train_config.total_steps}: "
            "run the same command again to resume"
        )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .models import get_preset
    from .models.world_model import WeightPaths, WorldModel
    from .pusht.evaluate import evaluate, markdown_table, parse_seeds

    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        raise UsageError(f"--seeds: {e}") from None
    if args.horizon < 1:
        raise UsageError("--horizon must be at least 1")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"--json: folder {Path(args.json).parent} does not exist")
    if args.dit is not None and not Path(args.dit).exists():
        raise UsageError(f"--dit: {args.dit} does not exist")
    try:
        model = WorldModel.load(get_preset(args.model), WeightPaths(dit=args.dit), device=args.device)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    modes = list(dict.fromkeys(args.kv_modes or ["clean", "final", "noisy"]))
    report = evaluate(model, seeds, modes, horizon=args.horizon)
    print(markdown_table(report))
    print("generation frames/s (reference loop, this machine): " + json.dumps(report["generation_fps"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_distill_decoder(args: argparse.Namespace) -> int:
    import torch

    from .models import get_preset
    from .models.distill import DistillConfig, distill, read_clips, save, teacher_set, video_files
    from .models.lite_decoder import LiteDecoder
    from .models.vae import StreamingVAE
    from .models.world_model import WeightPaths, resolve_device, resolve_dtype

    try:
        config = get_preset(args.model)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    if config.pixel_space:
        raise UsageError(f"model {config.id} works in pixel space: it has no VAE decoder to distil")
    config = _override(config, args)
    for name in ("steps", "batch_size", "clip_latent_frames", "max_clips"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    out = Path(args.out)
    if out.suffix != ".safetensors" or not out.resolve().parent.exists():
        raise UsageError(f"--out must be a .safetensors path in an existing folder, got {out}")
    vae_path = WeightPaths(root=args.weights, vae=args.vae).resolve().vae if args.weights else args.vae
    if args.weights and vae_path is None:
        raise UsageError(f"--weights: {args.weights} has no vae/ folder; give the teacher with --vae")
    if vae_path is None and config.requires_weights and not args.random_weights:
        raise UsageError(f"{config.id}: give the teacher VAE with --vae or --weights (or --random-weights)")
    try:
        device = resolve_device(args.device)
        files = video_files(args.videos)
        dtype = resolve_dtype("auto", device)
        if vae_path is not None:
            vae = StreamingVAE.from_pretrained(vae_path, device=device, dtype=dtype)
        else:
            vae = StreamingVAE.from_config(config, seed=config.init_seed + 1).to(device, dtype)
    except (ValueError, RuntimeError, FileNotFoundError, NotImplementedError) as e:
        raise UsageError(str(e)) from None
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
    data = teacher_set(vae, clips)
    del clips
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
    teacher = str(vae_path) if vae_path else f"{config.id} random VAE (seed {config.init_seed + 1})"
    summary["teacher"] = teacher
    save(decoder, str(out), summary, teacher)
    print(
        f"wrote {out}: held-out PSNR against the VAE decoder {summary['held_out_psnr_db']:.2f} dB "
        f"(before training {summary['held_out_psnr_db_before']:.2f} dB), {summary['train_s']:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .models import PRESETS

    entries = [c.describe() for c in PRESETS.values()]
    if args.json:
        print(json.dumps({"models": entries}, indent=2))
        return 0
    for e in entries:
        size = f"{e['width']}x{e['height']} @ {e['fps']} fps, {e['frames_per_chunk']} frames/chunk"
        inputs = f"actions {e['action_dim']}, prompt {e['takes_prompt']}, image {e['needs_image']}"
        print(f"{e['id']:18} {size}, {inputs}: {e['description']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as e:
        print(f"streamworld {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"streamworld {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
