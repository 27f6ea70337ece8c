"""`streamworld train pusht`: record PushT episodes and train the embedded world model."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from ..pusht.data import ROLLOUT_TARGETS, STATE_TARGETS, UNROLL_LOSSES
from ..pusht.policy import PUSH_SHARE
from ..pusht.pose import MAX_MISMATCH
from . import arguments
from .errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train the embedded PushT world model",
        description=(
            "Record PushT episodes (when the data folder has none yet) and train the pusht world model "
            "with flow matching. A run stops after --minutes of training (SIGTERM or Ctrl-C stop it "
            "early the same way, after the current step) and saves a checkpoint in --workdir; running "
            "the same command again resumes it, until --total-steps (a resume may change --total-steps, "
            "--compile and --workers; a changed training setting, data spec, --prediction or --init file "
            "is refused, naming it, before any data is recorded). Every run exports the EMA weights "
            "(float16 safetensors), which `streamworld serve --model pusht --dit PATH` serves "
            "instead of the built-in ones. The "
            "recipe is in docs/pusht.md."
        ),
    )
    parser.add_argument("model", choices=("pusht",), help="the model to train (only pusht is trainable)")
    parser.add_argument(
        "--workdir", default="pusht-train", help="checkpoint and output folder (default pusht-train)"
    )
    _add_data_arguments(parser)
    _add_schedule_arguments(parser)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    parser.add_argument("--out", metavar="PATH", help="exported weights (default WORKDIR/pusht.safetensors)")
    parser.add_argument(
        "--prediction",
        choices=("flow", "x0", "delta"),
        help="what the DiT learns to output (default: the preset's, x0): the flow, the clean frames, "
        "or 'delta', their change since the last frame before each chunk (a block that stays put "
        "is then zero; such a model serves kv modes clean and final, not noisy). Served weights "
        "record it: x0 and delta weights load into either config, flow weights only into a flow one",
    )
    parser.add_argument(
        "--init",
        metavar="PATH",
        help="start from these exported weights (fine-tuning) instead of random ones; weights with "
        "fewer blocks than --layers are grown: each new block starts as the identity",
    )
    parser.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="DiT blocks (default: the preset's, 6). The exported weights record it, and every "
        "command that loads them builds that many blocks",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, data set and schedule on the CPU: checks the pipeline in seconds",
    )
    parser.set_defaults(func=run)


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("recorded data")
    group.add_argument(
        "--data", metavar="DIR", help="recorded episodes (default WORKDIR/data; recorded when missing)"
    )
    group.add_argument("--episodes", type=int, default=2000, help="episodes to record (default 2000)")
    group.add_argument("--steps-per-episode", type=int, default=200, help="actions per episode (default 200)")
    group.add_argument("--data-seed", type=int, default=0, help="seed of the recorded data set (default 0)")
    group.add_argument(
        "--push-share",
        type=float,
        default=PUSH_SHARE,
        help=f"share of the scripted controller's moves that push the block (default {PUSH_SHARE})",
    )
    group.add_argument(
        "--jump-share",
        type=float,
        default=0.0,
        help="share of its moves whose target jumps toward the waypoint (up to 40-160 units a jump) and is "
        "held 4 steps, as the planner's candidates move, instead of walking at 8-35 units a step (default 0)",
    )
    group.add_argument(
        "--candidate-share",
        type=float,
        default=0.0,
        help="share of the episodes (drawn by each episode's seed) whose actions are drawn as the planner "
        "draws its candidates instead of by the scripted controller: 24-step stretches of six knots held "
        "4 steps, smooth noise around the agent or around a push or turn toward a goal like the "
        "planning tasks' (default 0)",
    )
    group.add_argument(
        "--workers",
        type=int,
        help="processes that record episodes and simulate rollout targets (default: CPU count)",
    )


def _add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training schedule")
    group.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="wall-time budget of this run's training steps (default 10); recording the data and "
        "loading come before it, compiling is inside it",
    )
    group.add_argument(
        "--total-steps", type=int, default=12_000, help="length of the whole schedule (default 12000)"
    )
    group.add_argument("--batch-size", type=int, default=64, help="clips per step (default 64)")
    group.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    group.add_argument(
        "--warmup-steps",
        type=int,
        default=300,
        help="steps of linear warm-up to --lr, before the cosine decay over the rest of "
        "--total-steps (default 300; a short fine-tuning run wants fewer)",
    )
    group.add_argument(
        "--log-every",
        type=int,
        default=100,
        help="steps averaged into each row of the logged history (default 100; a resume may change it)",
    )
    _add_loss_weight_arguments(group)
    _add_state_probe_arguments(group)
    group.add_argument(
        "--clip-chunks",
        type=int,
        metavar="K",
        help="chunks per training clip. Default: the attention window's chunks and one more (3), with "
        "the episode's first frame as the sink, so that only the last chunk of a clip that starts late "
        "is trained. Given, every clip is a stream of its own from the frame before it and every "
        "chunk is trained exactly as served; K above 3 reaches the chunks after the window is full, "
        "where the served sink moves up to the window (each step then costs more: longer clips). "
        "With --rollout-share, each rollout is one such clip",
    )
    _add_rollout_arguments(parser)
    group.add_argument(
        "--compile",
        action="store_true",
        help="run the training forward through torch.compile: fused kernels, the same losses up to "
        "rounding; the first step compiles (45 s on an H200). Needs Triton on a GPU, a C++ compiler "
        "on the CPU. The forwards of --unroll-share stay eager",
    )
    group.add_argument(
        "--compile-cache",
        metavar="FILE",
        help="with --compile: read the kernels compiled by an earlier run from FILE, if it exists, "
        "and write this run's there at the end, so that a machine whose compile caches are empty "
        "compiles less (docs/pusht.md). The file holds pickled objects and compiled code: use only "
        "one you made",
    )
    group.add_argument("--seed", type=int, default=0, help="training seed (default 0)")


def _add_loss_weight_arguments(group: argparse._ArgumentGroup) -> None:
    """--change-weight, --block-weight: what the loss weighs beyond every pixel."""
    group.add_argument(
        "--change-weight",
        type=float,
        default=0.0,
        help="extra loss weight on pixels that differ from the episode's first frame (default 0)",
    )
    group.add_argument(
        "--block-weight",
        type=float,
        default=0.0,
        help="extra loss weight on pixels where the block is or was at the start (default 0)",
    )


def _add_state_probe_arguments(group: argparse._ArgumentGroup) -> None:
    """--state-weight and the probe's settings (`pusht/state_probe.py`)."""
    group.add_argument(
        "--state-weight",
        type=float,
        default=0.0,
        help="train a small probe that reads each trained frame's scene (the agent's and the "
        "block's place, the block's angle) from the DiT's last hidden states, and add this "
        "times its squared error (positions in [-1, 1], the angle as cosine and sine) to the "
        "loss, so that the network must carry the block's pose. The log's state_block_units "
        "and state_angle_degrees are the probe's block errors on frames denoised from pure "
        "noise after a true clean context, as one step in clean mode predicts them. Needs data "
        "recorded with states.npy (since 2026-12-06); not with --rollout-share. The probe is "
        "kept in the checkpoint and exported beside the weights, as NAME.state-probe.safetensors; "
        "the weights alone serve as before. On pusht-delta, 0.1 and 1 made the frames and planning "
        "worse (round 23) (default 0: none; docs/pusht.md)",
    )
    group.add_argument(
        "--state-target",
        choices=STATE_TARGETS,
        default="scene",
        help="what the probe of --state-weight reads: scene, each frame's scene, or change, the "
        "scene's change since the frame before the frame's chunk (positions in units of 32 world "
        "units, the turn as cosine and sine), which is what a delta model predicts. On pusht-delta, "
        "change at weight 0.01 did not plan better (rounds 24 and 25, docs/pusht.md) (default scene)",
    )
    group.add_argument(
        "--state-warmup",
        type=int,
        default=0,
        metavar="STEPS",
        help="the first STEPS steps train the probe of --state-weight on the hidden states as they "
        "are, sending none of its error into the DiT, so the term starts from a probe that reads "
        "what the network holds (default 0)",
    )
    group.add_argument(
        "--state-turn-weight",
        type=float,
        default=1.0,
        metavar="G",
        help="with --state-target change: multiply the turn's cosine and sine in the probe's "
        "target by G, so its squared error weighs the block's turn G squared times as much; a "
        "chunk's turn of a few degrees otherwise weighs little beside the moves (default 1)",
    )
    group.add_argument(
        "--state-layer",
        type=int,
        metavar="K",
        help="the probe of --state-weight reads the hidden states after the first K blocks, so "
        "that what it asks for feeds the blocks that draw the frame rather than competing with "
        "the pixel head for the last block's features (default: after all of them)",
    )


def _add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training on the model's own rollouts")
    group.add_argument(
        "--rollout-share",
        type=float,
        default=0.0,
        help="share of each batch whose context is the model's own rollout of the episode instead of "
        "the true frames; with --clip-chunks, a stream clip's earlier chunks are the model's own, as "
        "served, and every later chunk is trained (default 0; docs/pusht.md)",
    )
    _add_unroll_arguments(group)
    group.add_argument(
        "--rollout-targets",
        choices=ROLLOUT_TARGETS,
        default="true",
        help="target of a rollout sample: the recorded frames (true), or the environment continued "
        "from the scene the rollout's last context frames show (simulated; default true)",
    )
    group.add_argument(
        "--rollout-max-mismatch",
        type=float,
        default=MAX_MISMATCH,
        help="with --rollout-targets simulated: how far a context block may be from a T shape "
        "(the fit's squared error per pixel of the T; 99%% of true frames stay below 0.16) and still get a "
        f"simulated target (default {MAX_MISMATCH}; `eval` counts a block as a T within 0.2, since "
        "blurred blobs fit a T within 0.25-0.4 with their angle far off: docs/pusht.md)",
    )
    group.add_argument(
        "--rollout-every",
        type=int,
        default=100,
        help="steps between two rounds of rollouts with the current weights (default 100)",
    )
    group.add_argument(
        "--rollout-episodes", type=int, default=32, help="episodes rolled out per round (default 32)"
    )
    group.add_argument(
        "--rollout-frames",
        type=int,
        default=32,
        help="frames per rollout, whole chunks (default 32; ignored with --clip-chunks: a rollout is then "
        "one clip)",
    )


def _add_unroll_arguments(group: argparse._ArgumentGroup) -> None:
    """--unroll-share and --unroll-loss: training end to end on the model's own rollouts."""
    group.add_argument(
        "--unroll-share",
        type=float,
        default=0.0,
        help="share of each batch trained end to end on whole rollouts: the one-step clean sampler "
        "(what `--steps 1000 --kv-mode clean` serves) is unrolled over each stream clip, every chunk "
        "predicted from noise with the model's own earlier chunks as context, and every prediction "
        "is compared with the true frames, the gradient flowing back through the rollout. Needs "
        "--clip-chunks; not with --rollout-share; rounded to whole clips of the batch, and refused "
        "where that is none; a forward per chunk, eager even with --compile (default 0; docs/pusht.md)",
    )
    group.add_argument(
        "--unroll-loss",
        choices=UNROLL_LOSSES,
        default="l2",
        help="the unrolled objective's error per pixel: l2 (squared, the default) or l1 (absolute). "
        "Where the future is uncertain the squared error is least for a blur of the outcomes, the "
        "absolute error for their median; in a CPU pilot l1 lost the block more often, not less "
        "(docs/pusht.md); with --unroll-share only",
    )
    _add_adversarial_arguments(group)


def _add_adversarial_arguments(group: argparse._ArgumentGroup) -> None:
    """--adversarial-*: a discriminator's verdict on the unrolled rollouts."""
    group.add_argument(
        "--adversarial-weight",
        type=float,
        default=0.0,
        help="with --unroll-share: also train a discriminator that tells true clips from the "
        "unrolled rollouts of the same first frame and actions, and add its verdict on the "
        "rollouts to their loss, weighted so that its gradient on the rollouts' frames is this "
        "many times the regression's (the logged loss then includes the term, loss_unrolled is "
        "the regression alone; on pusht-delta 0.5 changed nothing measurable, 1 and 2 lost the "
        "discriminator and 2 broke the rollouts). A squared error rewards a blur where the "
        "future is uncertain; the "
        "discriminator rewards one sharp future. Its hinge losses count the patches where "
        "the true clip and the rollout differ. The discriminator is "
        "kept in the checkpoint, not in the exported weights (default 0: none; docs/pusht.md)",
    )
    group.add_argument(
        "--adversarial-start",
        type=int,
        default=100,
        help="steps the discriminator trains alone before its verdict joins the loss; with "
        "--adversarial-weight only (default 100)",
    )
    group.add_argument(
        "--adversarial-max-scale",
        type=float,
        help="the most the adversarial term's adaptive weight may be. A discriminator whose "
        "verdict goes flat has a small gradient, so the weight that gives its gradient "
        "--adversarial-weight times the regression's grows: on pusht-delta, rounds 20 and 21 "
        "jumped from round 19's 0.0007-0.004 to 0.2-1.2 as the term joined and lost the "
        "discriminator. The log's adversarial_scale and adversarial_capped (the share of "
        "steps at this bound) show it; with --adversarial-weight only "
        "(default: VQGAN's bound of 1e4, in effect none; docs/pusht.md)",
    )
    group.add_argument(
        "--adversarial-background",
        type=float,
        default=0.0,
        help="in [0, 1]: the weight, in both hinge losses, of the patches where the true clip and "
        "the rollout do not differ, against 1 for those that do. 0 judges the differing patches "
        "alone; above 0 the discriminator also learns the still background, which a strong "
        "--adversarial-weight can otherwise change unchecked; with --adversarial-weight only "
        "(default 0; 0.1 still lets the discriminator learn the differing patches nearly as fast, "
        "but with --adversarial-weight 1 it did not keep the discriminator from falling to "
        "chance; docs/pusht.md)",
    )


def _configs(args: argparse.Namespace):
    """(model config, data set spec, training config, device); --smoke shrinks all of them."""
    from ..models import get_preset
    from ..pusht.data import DatasetSpec
    from ..pusht.train import TrainConfig, smoke_config

    config = get_preset(args.model)
    if args.prediction is not None:
        config = config.with_prediction(args.prediction)
    if args.layers is not None:
        config = dataclasses.replace(config, dit={**config.dit, "num_layers": args.layers})
    spec = DatasetSpec(
        episodes=args.episodes,
        steps=args.steps_per_episode,
        size=config.height,
        seed=args.data_seed,
        push_share=args.push_share,
        jump_share=args.jump_share,
        candidate_share=args.candidate_share,
    )
    train_config = TrainConfig(
        batch_size=args.batch_size,
        total_steps=args.total_steps,
        warmup_steps=args.warmup_steps,
        log_every=args.log_every,
        lr=args.lr,
        seed=args.seed,
        change_weight=args.change_weight,
        block_weight=args.block_weight,
        **_state_probe_options(args),
        compile=args.compile,
        clip_chunks=args.clip_chunks,
        **_rollout_options(args),
    )
    if not args.smoke:
        return config, spec, train_config, args.device
    config = smoke_config(config)
    spec = dataclasses.replace(spec, episodes=4, steps=40, size=config.height)
    train_config = TrainConfig(
        batch_size=2,
        total_steps=min(args.total_steps, 4),
        warmup_steps=2,
        log_every=2,
        checkpoint_every=2,
        change_weight=args.change_weight,
        block_weight=args.block_weight,
        **_state_probe_options(args),
        compile=args.compile,
        clip_chunks=args.clip_chunks,
        **{**_rollout_options(args), "rollout_episodes": 2, "rollout_frames": 12, "rollout_every": 2},
    )
    return config, spec, train_config, "cpu"


def _state_probe_options(args: argparse.Namespace) -> dict:
    names = ("state_weight", "state_target", "state_warmup", "state_turn_weight", "state_layer")
    return {name: getattr(args, name) for name in names}


def _rollout_options(args: argparse.Namespace) -> dict:
    return {
        "rollout_share": args.rollout_share,
        "unroll_share": args.unroll_share,
        "unroll_loss": args.unroll_loss,
        "adversarial_weight": args.adversarial_weight,
        "adversarial_start": args.adversarial_start,
        "adversarial_background": args.adversarial_background,
        **(
            {}
            if args.adversarial_max_scale is None
            else {"adversarial_max_scale": args.adversarial_max_scale}
        ),
        "rollout_every": args.rollout_every,
        "rollout_episodes": args.rollout_episodes,
        "rollout_frames": args.rollout_frames,
        "rollout_targets": args.rollout_targets,
        "rollout_max_mismatch": args.rollout_max_mismatch,
        "rollout_workers": args.workers or max(1, min(os.cpu_count() or 1, 32)),
    }


def _check(args: argparse.Namespace, workdir: Path) -> None:
    for name in (
        "change_weight",
        "block_weight",
        "state_weight",
        "state_warmup",
        "rollout_max_mismatch",
        "adversarial_weight",
        "adversarial_start",
        "warmup_steps",
    ):
        if not getattr(args, name) >= 0:  # also refuses nan
            raise UsageError(f"--{name.replace('_', '-')} must be at least 0")
    for name in (
        "push_share",
        "jump_share",
        "candidate_share",
        "rollout_share",
        "unroll_share",
        "adversarial_background",
    ):
        if not 0 <= getattr(args, name) <= 1:
            raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1]")
    for name in (
        "episodes",
        "steps_per_episode",
        "total_steps",
        "batch_size",
        "log_every",
        "rollout_every",
        "rollout_episodes",
        "rollout_frames",
    ):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.layers is not None and args.layers < 1:
        raise UsageError("--layers must be at least 1")
    if args.clip_chunks is not None and args.clip_chunks < 1:
        raise UsageError("--clip-chunks must be at least 1")
    if args.clip_chunks is not None and args.clip_chunks < 2 and args.rollout_share > 0:
        raise UsageError(
            "--rollout-share with --clip-chunks needs 2 chunks or more: "
            "a clip's first chunk has no own context"
        )
    if args.minutes <= 0:
        raise UsageError("--minutes must be positive")
    if workdir.exists() and not workdir.is_dir():
        raise UsageError(f"--workdir: {workdir} is a file")
    arguments.check_output_folder("--out", args.out)
    if args.compile_cache is not None and not args.compile:
        raise UsageError("--compile-cache needs --compile: without it nothing is compiled")
    arguments.check_output_folder("--compile-cache", args.compile_cache)


def run(args: argparse.Namespace) -> int:
    from ..pusht.train import Trainer, check_resume, check_train_config, prepare_data

    workdir = Path(args.workdir)
    _check(args, workdir)
    config, spec, train_config, device = _configs(args)
    try:  # before any data is recorded
        check_train_config(train_config, config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    data_dir = Path(args.data) if args.data else workdir / "data"
    # What defines the run besides the training config; a resume must match it.
    run_settings = {
        "prediction": config.prediction,
        "init": Path(args.init).name if args.init else None,
        "data": dataclasses.asdict(spec),
    }
    try:  # a resume with other settings is refused before any data is recorded
        check_resume(workdir / "checkpoint.pt", None, config, train_config, run_settings)
        read = _load_compile_cache(args.compile_cache)
        data = prepare_data(data_dir, spec, workers=args.workers)
        if args.init is not None and not Path(args.init).is_file():
            raise UsageError(f"--init: {args.init} does not exist")
        trainer = Trainer(
            config, train_config, data, workdir, device=device, init=args.init, run_settings=run_settings
        )
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    with _stop_on_signals(trainer):  # through the export: a signal then changes nothing
        summary = trainer.run(args.minutes)
        if args.compile_cache:
            written = _save_compile_cache(args.compile_cache)
            summary["compile_cache"] = {"read_bytes": read, "written_bytes": written}
        out = trainer.export(args.out or workdir / f"{args.model}.safetensors")
        summary["weights"] = str(out)
        summary["weights_bytes"] = out.stat().st_size
        # What this run trained (a resume is refused unless it matches): its schedule and
        # objective, data and start.
        settings = {**run_settings, "train": dataclasses.asdict(train_config)}
        (workdir / "train_summary.json").write_text(
            json.dumps({**summary, "settings": settings, "history": trainer.history}, indent=2) + "\n"
        )
    print(json.dumps(summary, indent=2))
    if trainer.step < train_config.total_steps:
        print(
            f"stopped at step {trainer.step} of {train_config.total_steps}"
            f"{f' ({trainer.stop_requested})' if trainer.stop_requested else ''}: "
            "run the same command again to resume"
        )
    return 0


def _load_compile_cache(path: str | None) -> int | None:
    """--compile-cache: the kernels of an earlier run handed to torch.compile; the bytes
    read, or None (no file yet, or not one torch could read: this run compiles them)."""
    from .. import compile_cache

    if path is None:
        return None
    try:
        read = compile_cache.load(path)
    except ValueError as e:
        raise UsageError(f"--compile-cache: {e}") from None
    if read is None:
        what = "no kernels read from it" if Path(path).is_file() else "not there yet"
        print(f"compile cache {path}: {what}; this run compiles them and writes it at the end")
    else:
        print(f"compile cache {path}: read {read / 1e6:.1f} MB of compiled kernels")
    return read


def _save_compile_cache(path: str) -> int | None:
    from .. import compile_cache

    written = compile_cache.save(path)
    if written is None:
        print(f"compile cache {path}: nothing was compiled, left as it was")
    else:
        print(f"compile cache {path}: wrote {written / 1e6:.1f} MB of compiled kernels")
    return written


@contextlib.contextmanager
def _stop_on_signals(trainer) -> Iterator[None]:
    """SIGTERM (what `timeout` and job schedulers send) or Ctrl-C end the training after
    its current step, with a checkpoint and the exported weights, as --minutes does; a
    second one stops at once (the checkpoint is still written, the weights are not)."""

    def request_stop(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if trainer.stop_requested is not None:
            raise KeyboardInterrupt
        trainer.stop_requested = name
        print(
            f"\n{name}: stopping after this step, then saving a checkpoint and the weights "
            "(send it again to stop at once)",
            file=sys.stderr,
        )

    if threading.current_thread() is not threading.main_thread():  # handlers live there only
        yield
        return
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, request_stop) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():  # None: a handler not set from Python
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
