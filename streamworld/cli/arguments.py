"""Argument groups that several commands share, written once: where weights come from and
where the model runs (`serve`, `generate`, `bench`), the engine's knobs (`serve`, `bench`),
and the planner's sampling and cost (`eval pusht --plan`, `examples/plan_pusht.py`).

Building the parser imports nothing heavy, so `streamworld --help` stays quick; the engine
is imported only when a command builds its configuration.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    from ..engine import EngineConfig

KV_MODES = ("clean", "final", "noisy")
# streamworld.pusht.planning.COST_FRAMES, written here so that building a parser imports
# nothing heavy; frame_cost refuses any other value.
COST_FRAMES = ("last", "best")
# streamworld.pusht.planning.WARM_STARTS, for the same reason; run_episode refuses any other.
WARM_STARTS = ("mean", "plan")
# streamworld.pusht.planning.COSTS, for the same reason; run_episode refuses any other.
COSTS = ("frame", "pose")
DEFAULT_MODEL = "pusht"  # the embedded PushT world model: the default of every command


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model (one preset, default pusht) and the weight arguments."""
    group = parser.add_argument_group("model and weights")
    group.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model preset (see `streamworld models`; default: {DEFAULT_MODEL})",
    )
    add_weight_arguments(group)


def add_weight_arguments(group: argparse._ActionsContainer) -> None:
    """Where weights come from and where the model runs (for real-size presets)."""
    group.add_argument(
        "--weights",
        metavar="DIR",
        help="local diffusers-style folder with transformer/, vae/, text_encoder/ and tokenizer/",
    )
    group.add_argument(
        "--dit",
        metavar="PATH",
        help="DiT checkpoint: diffusers folder, original Wan file, CausVid model.pt or Self-Forcing .pt",
    )
    group.add_argument("--vae", metavar="DIR", help="local diffusers AutoencoderKLWan folder")
    group.add_argument("--text-encoder", metavar="DIR", help="local umT5 encoder folder with its tokenizer")
    group.add_argument(
        "--random-weights",
        action="store_true",
        help="run a real-size model with seeded random weights (timing benchmarks only)",
    )
    group.add_argument(
        "--frame-size",
        metavar="HxW",
        help="override the preset's frame size, height x width, e.g. 320x512 (timing studies; "
        "trained weights such as pusht's only work at their own size)",
    )
    group.add_argument(
        "--window",
        type=int,
        metavar="N",
        help="override the preset's attention window (latent frames after the sink frames)",
    )
    group.add_argument(
        "--sink",
        type=int,
        metavar="N",
        help="override the preset's sink frames (latent frames always attended)",
    )
    group.add_argument("--chunk", type=int, metavar="N", help="override the preset's latent frames per chunk")
    group.add_argument(
        "--steps",
        dest="timesteps",  # `distill-decoder --steps` counts training steps
        metavar="T,T,...",
        help="override the preset's denoising timesteps, from noise down, e.g. 1000,750,500,250; the "
        "preset's timestep shift still applies to them (Wan: 5). Distilled checkpoints are trained for "
        "their own (docs/recipes/)",
    )
    _add_runtime_arguments(group)


def _add_runtime_arguments(group: argparse._ActionsContainer) -> None:
    """How the loaded model runs: decoder, compilation, device, dtype, CPU threads."""
    group.add_argument(
        "--decoder",
        choices=("wan", "lite"),
        default="wan",
        help="how latents become frames: wan (the model's VAE decoder, default) or lite "
        "(StreamWorld's small causal decoder, many times cheaper; its weights come from "
        "`streamworld distill-decoder` via --decoder-weights, or are random with --random-weights)",
    )
    group.add_argument("--decoder-weights", metavar="PATH", help="lite decoder weights (.safetensors)")
    group.add_argument(
        "--compile",
        action="store_true",
        help="compile the hot paths with torch.compile while the model loads, so serving never waits "
        "for it: the DiT's elementwise arithmetic, and the lite decoder with --decoder lite (a GPU "
        "needs Triton, a CPU a C++ compiler; adds some 30-60 s to loading; figures in docs/benchmarks.md)",
    )
    group.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    group.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16"
    )
    group.add_argument(
        "--threads",
        type=int,
        help="PyTorch CPU threads, fixed. Default: serve on a CPU adapts the count to the cores that other "
        "processes leave free (all of them on a quiet machine, fewer beside busy ones; Linux); other "
        "commands use PyTorch's default, one per core (docs/benchmarks.md, CPU threads next to other work)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Stages, ranks, the first-chunk budget and the batch limits (`EngineConfig`)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--stages",
        type=int,
        help="block stages per forward (default 1; with --placement pipeline, one per device; with "
        "replicas, the stages of each replica on its device)",
    )
    group.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="virtual ranks (threads / CUDA streams) that the stages share, without --placement "
        "(default 1; a placement gives each stage its own rank)",
    )
    group.add_argument(
        "--devices",
        metavar="DEV,DEV",
        help="devices to place the model on, e.g. cuda:0,cuda:1 (default: --device); a device named "
        "twice holds two replicas or stages that time-share it",
    )
    group.add_argument(
        "--placement",
        metavar="HOW",
        help="how the model uses --devices: replicas (default: a whole model per device, more "
        "streams), pipeline (the blocks split over the devices in order, faster streams), or a "
        "stage map such as 0-13@cuda:0,14-29@cuda:1,decode@cuda:1 (blocks inclusive; | separates "
        "replicas); see docs/deploy.md",
    )
    group.add_argument(
        "--ttff-budget",
        type=float,
        default=1.0,
        help="seconds from a stream's start to its first chunk's deadline (default 1.0)",
    )
    group.add_argument("--max-batch", type=int, default=16, help="most units in one batch (default 16)")
    group.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay the DiT's blocks from CUDA graphs, one captured per batch shape the second time it "
        "is seen (at most 32 per stage; other batches run as before): far fewer kernel launches where the "
        "host, not the GPU, sets the pace; adds a buffer of --max-batch prompts' cross-attention K/V per "
        "stage (94 MiB each for Wan 1.3B). CUDA only; figures in docs/benchmarks.md",
    )
    group.add_argument(
        "--token-budget",
        type=int,
        default=65536,
        help="most query tokens in one batch (default 65536; the most urgent unit always goes). On an "
        "H200, 8192 (one 480x832 unit) gave one noisy stream 0.50 s to the first frame instead of 1.30 s, "
        "and 16384 (8 units of 320x512) let 8 paced streams meet every deadline (docs/benchmarks.md)",
    )


def check_engine_arguments(args: argparse.Namespace) -> None:
    if args.max_batch < 1 or args.token_budget < 1:
        raise UsageError("--max-batch and --token-budget must be at least 1")
    if (args.stages is not None and args.stages < 1) or args.ranks < 1:
        raise UsageError("--stages and --ranks must be at least 1")
    if args.ranks != 1 and (args.devices or args.placement):
        raise UsageError(
            "--ranks applies without --devices and --placement (a placement gives each stage a rank)"
        )


def engine_config(args: argparse.Namespace, **settings) -> EngineConfig:
    """The `EngineConfig` of the engine arguments; `settings` sets the command's other fields."""
    from ..engine import EngineConfig, SchedulerConfig

    return EngineConfig(
        num_stages=args.stages or 1,
        num_ranks=args.ranks,
        ttff_budget_s=args.ttff_budget,
        cuda_graphs=args.cuda_graphs,
        scheduler=SchedulerConfig(max_batch_units=args.max_batch, token_budget=args.token_budget),
        **settings,
    )


def check_output_folder(flag: str, path: str | None) -> None:
    """An output file's folder must exist before hours of work go into it."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise UsageError(f"{flag}: folder {Path(path).parent} does not exist")


def add_search_arguments(group: argparse._ActionsContainer) -> None:
    """The planner's options after iCEM (--noise-beta, --keep-elites), a speed limit on its
    actions (--max-speed), which predicted frames its cost reads (--cost-frames) and push and
    turn proposals (--proposals), what its cost scores (--cost) and the weight of its frame
    cost's shape term (--shape-weight), and replanning when the real block strays from the
    prediction (--replan-error); all but the cost and the shape weight off by default."""
    group.add_argument(
        "--noise-beta",
        type=float,
        default=0.0,
        help="colour of the sampling noise along a plan's targets, 0-4: power falls as 1/f^beta, so 0 is "
        "white and 2 drifts smoothly like a random walk (iCEM; default 0)",
    )
    group.add_argument(
        "--keep-elites",
        type=int,
        default=0,
        help="cheapest candidates of each iteration carried into the next one's refit, with their costs, "
        "not rolled out again (iCEM; at most the elites kept; default 0)",
    )
    group.add_argument(
        "--max-speed",
        type=float,
        default=0.0,
        help="actions head for a plan's targets at most this far a step (action units, Euclidean) instead "
        "of jumping to them, so candidates move like the scripted data the PushT model learned from (at "
        "most 35 a step); 0: targets held (default 0)",
    )
    group.add_argument(
        "--cost-frames",
        choices=COST_FRAMES,
        default="last",
        help="which predicted frames a candidate is scored on: its last, or its nearest to the goal (the "
        "success test holds at any step the environment passes through; default last)",
    )
    group.add_argument(
        "--proposals",
        type=int,
        default=0,
        help="up to this many paths, read from the observed and goal frames, take the places of random "
        "candidates in each plan's first iteration: pushes (round the block if need be, behind it, push it "
        "toward the goal, then to the agent's goal place) and turns (push one end of the T across, for a "
        "block near its goal but turned away from it; these come first then); the model predicts them and "
        "the cost weighs them like the rest (0-10, fewer than --samples; default 0)",
    )
    _add_cost_and_replanning_arguments(group)


def _add_cost_and_replanning_arguments(group: argparse._ActionsContainer) -> None:
    """--cost (what a candidate is scored on), --shape-weight (the frame cost's shape term),
    --replan-error (replanning on surprise) and --warm-start (what a plan after the first
    starts from)."""
    group.add_argument(
        "--cost",
        choices=COSTS,
        default="frame",
        help="what a candidate is scored on: frame, the pixel distances of the agent and the block "
        "located in its predicted frame from their places in the goal frame, plus the shape term "
        "(--shape-weight); or pose, the success test itself: the larger of the distance of agent and "
        "block together over 20 world units and the block's angle error over 20 degrees (below 1: the "
        "goal is reached), against the pose read off the goal frame, from the poses the rollouts "
        "predict (--scene-model, --simulator) or read off the predicted frames (default frame)",
    )
    group.add_argument(
        "--shape-weight",
        type=float,
        default=200.0,
        metavar="W",
        help="weight of the frame cost's shape term, the mean squared difference of the block's blurred "
        "colour maps, which carries the block's angle, beside the agent's and the block's distances in "
        "pixels (default 200; --cost pose has no shape term)",
    )
    group.add_argument(
        "--replan-error",
        type=float,
        default=0.0,
        metavar="PX",
        help="stop executing a plan and plan again as soon as the block in the real frame lies more than "
        "PX pixels (of the 64 px frame; 1 px = 8 world units) from where the plan predicted it for that "
        "step, or is seen in only one of the two; a plan that goes as predicted runs on (0: off; default 0)",
    )
    group.add_argument(
        "--warm-start",
        choices=WARM_STARTS,
        default="mean",
        help="what each plan after the first samples around, moved past the steps executed: the last "
        "plan's final distribution (mean; the mean of its elites, which may average two different ways "
        "round the block), or the plan it chose (plan), which the new plan then tries first, so a push "
        "cut short by --execute or --replan-error can go on as planned (default mean)",
    )
