"""`streamworld eval pusht`: the world model's rollouts against the real PushT environment."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from ..models import PRESETS
from . import arguments, loading
from .errors import UsageError

# The models of the PushT environment, which the evaluation and the planner drive.
# Episodes planned at once (`--plan --concurrent`), and the planning streams they may hold
# together, N x (samples + 1): the engine reserves K/V pages for each (for the PushT models
# up to 29 MiB a stream, float32), so 272 streams stay under 8 GiB.
MAX_CONCURRENT = 64
MAX_CONCURRENT_STREAMS = 272
# Planning processes side by side (`--plan --processes`): each loads the model and its engine.
MAX_PROCESSES = 64
PUSHT_MODELS = tuple(c.id for c in PRESETS.values() if c.environment == "pusht")


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval",
        help="evaluate the PushT world model against the real environment",
        description=(
            "Roll out the real PushT environment from each seed's initial state with the scripted "
            "controller, give the model the first frame and the same actions, and compare predicted with "
            "true frames per horizon: PSNR, SSIM and the agent's and block's position errors, against the "
            "copy-first-frame baseline. Prints a Markdown table; --json writes every horizon."
        ),
    )
    parser.add_argument(
        "model",
        choices=PUSHT_MODELS,
        help="the model to evaluate: pusht, or pusht-delta (its delta-trained sibling, the better planner)",
    )
    parser.add_argument(
        "--seeds", help="environment seeds, e.g. 0-99 or 1,5,9 (default 0-99; with --plan 0-49)"
    )
    parser.add_argument("--horizon", type=int, default=32, help="future frames compared (default 32)")
    parser.add_argument(
        "--kv-mode",
        action="append",
        dest="kv_modes",
        choices=arguments.KV_MODES,
        help="KV mode to evaluate; repeat for several (default: every mode the model serves: all three, "
        "or clean and final for a model that predicts delta). With --plan: the one KV "
        "mode of the planning streams (default: the preset's, final)",
    )
    parser.add_argument(
        "--teacher-forced",
        action="store_true",
        help="also predict every chunk from the true past (clean K/V committed from the true frames): "
        "the error one chunk ahead, without the drift of a free-running rollout; its block error is "
        "also split by what the block does during the chunk (still, or moving), beside the error of "
        "copying the last true frame",
    )
    parser.add_argument(
        "--steps",
        dest="timesteps",
        metavar="T,T,...",
        help="denoising timesteps instead of the preset's 1000,750,500,250, e.g. 1000 for one step "
        "(with --kv-mode clean: the K/V of `final` would be pure noise); with --plan too",
    )
    parser.add_argument("--dit", metavar="PATH", help="weights to evaluate (default: the shipped ones)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    _add_plan_arguments(parser)
    parser.set_defaults(func=run)


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    plan = parser.add_argument_group(
        "planning (--plan)",
        "Goal-reaching with the model as DINO-WM and stable-worldmodel evaluate it (docs/planning.md): "
        "per seed, a start state and the state the recorded trajectory reaches --goal-steps later; the "
        "cross-entropy method over the agent's targets, each iteration one fork of --samples branches; "
        "model-predictive, replanning from the observed frame; success when agent and block are within "
        "20 world units of the goal and the block within 20 degrees, within --budget steps.",
    )
    plan.add_argument("--plan", action="store_true", help="evaluate planning instead of prediction")
    plan.add_argument("--goal-steps", type=int, default=25, help="steps from start to goal (default 25)")
    plan.add_argument("--budget", type=int, default=50, help="environment steps per episode (default 50)")
    plan.add_argument("--samples", type=int, default=16, help="branches per iteration (default 16)")
    plan.add_argument("--elites", type=int, default=4, help="best candidates kept (default 4)")
    plan.add_argument("--iterations", type=int, default=3, help="iterations per plan (default 3)")
    plan.add_argument("--plan-horizon", type=int, default=24, help="steps each plan covers (default 24)")
    plan.add_argument("--execute", type=int, help="steps run before replanning (default: the horizon)")
    plan.add_argument("--knot-frames", type=int, default=4, help="steps a planned target holds (default 4)")
    _add_parallel_arguments(plan)
    arguments.add_search_arguments(plan)
    plan.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay the DiT's blocks from CUDA graphs (as `serve --cuda-graphs`); CUDA devices only",
    )
    plan.add_argument(
        "--ensemble",
        action="append",
        metavar="MODEL[=PATH]",
        help="also roll every candidate out with this PushT model (its shipped weights, or PATH) and "
        "score a candidate by its cost averaged over the models, as PETS plans through an ensemble; "
        "repeat for more members. Each member is one more engine on --device, with its own noise seed, "
        "so the model itself again is a member too. --kv-mode and --steps apply to every member",
    )
    plan.add_argument(
        "--simulator",
        action="store_true",
        help="roll the candidates out in the true environment instead of the model: what a perfect "
        "model would reach with the same search and cost (CPU; no model is loaded)",
    )
    plan.add_argument(
        "--scene-model",
        type=_scene_model_path,
        metavar="FILE",
        help="roll the candidates out with a scene model instead of the world model: a network that "
        "steps the agent's place and the block's pose (`benchmarks/pusht_state_dynamics.py --save`), "
        "started from the scene the observed frame shows, its scenes drawn as the environment draws "
        "them for the frame cost, or given as poses to --cost pose (CPU). FILE, or `shipped`: the "
        "scene model the package ships, which sees the arena's walls (docs/pusht.md). With --cost "
        "pose it planned 87%% of seeds 0-799 (docs/planning.md)",
    )


def _add_parallel_arguments(plan: argparse._ArgumentGroup) -> None:
    """--concurrent and --processes: several episodes at once, in one process or several."""
    plan.add_argument(
        "--concurrent",
        type=int,
        default=1,
        metavar="N",
        help="episodes planned at once (default 1): their forks share the engine and batch "
        "together where they attend to as many cached frames, more branches per DiT call (at "
        "most 64, and 272 planning streams: N x (samples + 1)). "
        "Batched frames may differ from one-at-a-time ones by float rounding, so an episode's "
        "outcome can differ. On an H100 it planned at about the rate of one episode at a time "
        "(132 branches per wall second against 123), since the episodes' host work shares one "
        "thread, while eight processes side by side, timed without their start-up, planned at "
        "least 308: processes are the way to fill a GPU (--processes; docs/planning.md)",
    )
    plan.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="P",
        help="planning processes side by side (default 1; at most 64, and at most one per seed): "
        "the seeds are dealt out in turn, each process loads the model and runs its own engine on "
        "--device (each with --concurrent episodes at once), and this process writes one report "
        "of all of them. Each process also has its own host thread for the episodes' host work "
        "(the environment, scene fits, costs), which bounds one process's planning on a GPU. "
        "Each process's start-up counts in the report's wall time: on an H100, 16 processes "
        "over 96 seeds planned 215 branches per wall second with it, one process over 16 seeds "
        "154 (docs/planning.md). On a CPU the processes share its cores: at most one per core",
    )


def run(args: argparse.Namespace) -> int:
    from ..pusht.evaluate import evaluate, markdown_table, motion_table, parse_seeds

    try:
        seeds = parse_seeds(args.seeds or ("0-49" if args.plan else "0-99"))
    except ValueError as e:
        raise UsageError(f"--seeds: {e}") from None
    if args.plan:
        return run_plan(args, seeds)
    if args.horizon < 1:
        raise UsageError("--horizon must be at least 1")
    arguments.check_output_folder("--json", args.json)
    model = _load(args)
    # By default every KV mode the model serves ("delta" models do not serve noisy).
    modes = list(dict.fromkeys(args.kv_modes or model.config.kv_modes))
    report = evaluate(model, seeds, modes, horizon=args.horizon, teacher_forced=args.teacher_forced)
    report = {"model": report["model"], **_weights_record(args, model), **report}
    print(markdown_table(report))
    if "teacher_forced_by_motion" in report:
        print()
        print(motion_table(report))
    print("generation frames/s (reference loop, this machine): " + json.dumps(report["generation_fps"]))
    _write(args, report)
    return 0


def _load(args: argparse.Namespace, model_id: str | None = None, dit: str | None = None, flag: str = "--dit"):
    """The model to evaluate (`args.model` with `args.dit`, or `model_id` with `dit`, read from
    the command line's `flag`), once its weights are checked (the callers check the output
    folder first, before any time is spent)."""
    from ..models import get_preset
    from ..models.world_model import WeightPaths

    if model_id is None:
        model_id, dit = args.model, args.dit
    if dit is not None and not Path(dit).exists():
        raise UsageError(f"{flag}: {dit} does not exist")
    # WorldModel.load's own dtype, as eval has always used (eval has no --dtype).
    options = loading.LoadOptions(device=args.device, dtype="float32")
    config = loading.override_preset(get_preset(model_id), args)  # --steps
    _check_kv_modes(args, config, dit)
    if args.plan and args.kv_modes:  # the planning streams' KV mode
        config = dataclasses.replace(config, default_kv_mode=args.kv_modes[0])
    model = loading.load_world_model(config, WeightPaths(dit=dit), options)
    _check_kv_modes(args, model.config, dit)  # weights that predict delta drop `noisy`
    return model


def _ensemble_members(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """--ensemble's members as (model, weights path or None), checked before anything loads."""
    from ..models import get_preset

    members = []
    for spec in args.ensemble or ():
        model_id, equals, path = spec.partition("=")
        if model_id not in PUSHT_MODELS:
            raise UsageError(
                f"--ensemble {spec}: the model must be one of {', '.join(PUSHT_MODELS)}, optionally =PATH"
            )
        if equals and not path:
            raise UsageError(f"--ensemble {spec}: give a weights file after =, or drop the =")
        if path and not Path(path).exists():
            raise UsageError(f"--ensemble {spec}: {path} does not exist")
        _check_kv_modes(args, get_preset(model_id), path or None)  # before any model loads
        members.append((model_id, path or None))
    return members


def _check_kv_modes(args: argparse.Namespace, config, dit: str | None = None) -> None:
    unserved = [m for m in args.kv_modes or () if m not in config.kv_modes]
    if unserved:
        weights = f" with {dit}" if dit else ""
        raise UsageError(
            f"--kv-mode {unserved[0]}: {config.id}{weights} serves {', '.join(config.kv_modes)} only "
            "(a model that predicts each chunk's change cannot serve noisy)"
        )


def _weights_record(args: argparse.Namespace, model) -> dict:
    """Which weights a report is about: the --dit file's name or the shipped ones, and what
    they predict (x0, or delta: `train pusht --prediction`)."""
    return {"weights": Path(args.dit).name if args.dit else "shipped", "prediction": model.config.prediction}


def _write(args: argparse.Namespace, report: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


def run_plan(args: argparse.Namespace, seeds: list[int]) -> int:
    """`eval pusht --plan`: the planning evaluation (docs/planning.md)."""
    from ..planning import CEMConfig

    config = CEMConfig(
        horizon=args.plan_horizon,
        samples=args.samples,
        elites=args.elites,
        iterations=args.iterations,
        knot_frames=args.knot_frames,
        noise_beta=args.noise_beta,
        keep_elites=args.keep_elites,
        max_speed=args.max_speed,
    )
    _check_plan_arguments(args, config)
    arguments.check_output_folder("--json", args.json)
    processes = min(args.processes, len(seeds))
    progress = _PlanProgress(args, config, seeds)
    try:
        if processes > 1:
            from .plan_processes import plan_in_processes

            plan_in_processes(seeds, config, args, progress.add, processes, _plan_episodes)
        else:
            asyncio.run(_plan_episodes(seeds, config, args, progress.add))
    finally:
        progress.close()
    report = progress.report(True)
    _print_plan_summary(report["summary"])
    if processes > 1:
        print(
            f"{processes} planning processes: "
            f"{report['summary']['branches_per_wall_second']:.1f} branches per wall second"
        )
    if args.concurrent > 1:
        print(
            f"{args.concurrent} episodes at once: "
            f"{report['summary']['branches_per_wall_second']:.1f} branches per wall second"
        )
    _write(args, report)
    return 0


def _check_plan_arguments(args: argparse.Namespace, config) -> None:
    """Every --plan argument checked before anything loads (UsageError with the reason)."""
    try:
        config.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.goal_steps < 1 or args.budget < 1 or (args.execute is not None and args.execute < 1):
        raise UsageError("--goal-steps, --budget and --execute must be at least 1")
    if not 1 <= args.concurrent <= MAX_CONCURRENT:
        raise UsageError(f"--concurrent must be 1 to {MAX_CONCURRENT}, got {args.concurrent}")
    if not 1 <= args.processes <= MAX_PROCESSES:
        raise UsageError(f"--processes must be 1 to {MAX_PROCESSES}, got {args.processes}")
    cores = os.cpu_count() or 1
    if not args.device.startswith("cuda") and args.processes > cores:
        raise UsageError(
            f"--processes {args.processes} on the CPU, which has {cores} cores: at most {cores} "
            "(each process plans on cores of its own, and holds its own model)"
        )
    streams = args.concurrent * (args.samples + 1)
    if args.concurrent > 1 and streams > MAX_CONCURRENT_STREAMS:
        raise UsageError(
            f"--concurrent {args.concurrent} with --samples {args.samples} holds {streams} planning "
            f"streams at once (N x (samples + 1)); at most {MAX_CONCURRENT_STREAMS}, each with its K/V pages"
        )
    if not args.replan_error >= 0:  # also refuses nan
        raise UsageError(f"--replan-error must be at least 0 (0: off), got {args.replan_error}")
    if not args.shape_weight >= 0:
        raise UsageError(f"--shape-weight must be at least 0, got {args.shape_weight}")
    from ..pusht.proposals import check_count

    try:
        check_count(args.proposals, args.samples)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise UsageError(f"--cuda-graphs needs a CUDA --device, not {args.device}")
    if args.teacher_forced:
        raise UsageError("--teacher-forced evaluates prediction: drop it with --plan")
    if args.kv_modes and len(set(args.kv_modes)) > 1:
        raise UsageError("--plan takes one --kv-mode: the KV mode of the planning streams")
    _check_rollouts_without_the_model(args)
    _ensemble_members(args)


def _scene_model_path(text: str) -> Path:
    """--scene-model's value: a file, or `shipped` for the package's own scene model."""
    if text == "shipped":
        from ..pusht.scene_model import SHIPPED

        return SHIPPED
    return Path(text)


def _check_rollouts_without_the_model(args: argparse.Namespace) -> None:
    """--simulator and --scene-model: one at a time, without the world model's options, and
    a scene model file that loads."""
    model_options = (
        args.dit
        or args.cuda_graphs
        or args.device != "cpu"
        or args.kv_modes
        or args.timesteps
        or args.ensemble
    )
    for flag, on in (("--simulator", args.simulator), ("--scene-model", args.scene_model)):
        if on and model_options:
            raise UsageError(
                f"{flag} plans without the world model: drop --dit, --device, --cuda-graphs, --kv-mode, "
                "--steps and --ensemble"
            )
    if args.simulator and args.scene_model:
        raise UsageError("--simulator and --scene-model are two ways to roll out: pick one")
    if args.scene_model:
        from ..pusht.scene_model import SceneModel

        try:
            SceneModel.load(args.scene_model)
        except ValueError as e:
            raise UsageError(f"--scene-model: {e}") from None


def _print_plan_summary(s: dict) -> None:
    print("| episodes | success | mean steps | plan s (mean / p90) | branches/s |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {s['episodes']} | {s['success_rate']:.0%} | {s['mean_steps']:.1f} | "
        f"{s['plan_seconds_mean']:.2f} / {s['plan_seconds_p90']:.2f} | {s['branches_per_second']:.1f} |"
    )


@contextlib.asynccontextmanager
async def _rollouts(args: argparse.Namespace, config):
    """(what plans, frame size, rollouts_for(frame, world, seed), counters()) for
    `_plan_episodes`; counters() gives the engines' batches and CUDA graphs so far (None
    without the world model: `_rollouts_without_the_model`)."""
    from ..engine import AsyncEngine
    from ..planning import EngineRollouts, EnsembleRollouts, planning_engine_config

    if args.simulator or args.scene_model:
        yield _rollouts_without_the_model(args)
        return
    model = _load(args)
    members = [(m, dit, _load(args, m, dit, "--ensemble")) for m, dit in _ensemble_members(args)]
    engine_config = planning_engine_config(config.samples, args.cuda_graphs, args.concurrent)
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(AsyncEngine(model, engine_config))
        others = [await stack.enter_async_context(AsyncEngine(m, engine_config)) for *_, m in members]

        def rollouts_for(frame, world, seed):
            if not others:
                return EngineRollouts(engine, frame, seed)
            # Each member draws its own noise: seeds 1,000,003 apart, as data sets' episodes are.
            engines = [engine, *others]
            return EnsembleRollouts(
                [EngineRollouts(e, frame, seed + 1000003 * i) for i, e in enumerate(engines)]
            )

        yield (
            {
                "model": model.config.id,
                **_weights_record(args, model),
                "rollouts": "model",
                "device": str(model.device),
                "kv_mode": model.config.default_kv_mode,
                "timesteps": list(model.config.denoising_steps),
                "ensemble": [
                    {"model": m.config.id, "weights": Path(dit).name if dit else "shipped"}
                    for _, dit, m in members
                ],
            },
            model.config.height,
            rollouts_for,
            lambda: _engine_counters([engine, *others]),
        )


def _rollouts_without_the_model(args: argparse.Namespace) -> tuple:
    """`_rollouts`' tuple for --simulator (the true environment) or --scene-model (a scene
    model's predictions, drawn), both on the CPU with no engine."""
    from ..models import get_preset

    size = get_preset(args.model).height
    poses = args.cost == "pose"  # the cost reads poses: give them, drawing nothing
    if args.simulator:
        from ..pusht.planning import SimulatorRollouts

        planner = {"model": args.model, "rollouts": "simulator", "device": "cpu"}
        return planner, size, lambda frame, world, seed: SimulatorRollouts(world, poses), lambda: None
    from ..pusht.scene_model import SceneModel, SceneModelRollouts

    scene_model = SceneModel.load(args.scene_model)
    planner = {
        "model": args.model,
        "rollouts": "scene-model",
        "scene_model": args.scene_model.name,
        "scene_model_sha256": hashlib.sha256(args.scene_model.read_bytes()).hexdigest(),
        "scene_model_kind": scene_model.kind,
        "device": "cpu",
    }
    # Only the cost's last frame is read unless the cost reads every frame or a replan
    # compares each step's predicted frame with the real one.
    every_frame = args.cost_frames != "last" or args.replan_error > 0
    return (
        planner,
        size,
        lambda frame, world, seed: SceneModelRollouts(scene_model, frame, every_frame, poses),
        lambda: None,
    )


def _engine_counters(engines: list) -> dict:
    """DiT batches and their mean size over `engines`, and their CUDA graphs' counters: a
    GPU run whose batches do not replay graphs shows it here."""
    from ..engine import summed_stats

    batches = sum(e.stats.batches for e in engines)
    units = sum(size * n for e in engines for size, n in e.stats.batch_sizes.items())
    out = {"dit_batches": batches, "mean_batch_units": round(units / batches, 2) if batches else 0.0}
    graphs = summed_stats(g.stats for e in engines for g in e.runner.graphs or [])
    if graphs is not None:
        out["cuda_graphs"] = graphs
    return out


async def _plan_episodes(seeds: list[int], config, args: argparse.Namespace, on_episode) -> None:
    """Plans every seed's episode, `--concurrent` of them at a time, in this process, and
    calls on_episode(result, planner, counters) as each ends (planner: what plans;
    counters: the engines' counters so far, None in the true environment; after the last
    episode, the run's)."""
    async with _rollouts(args, config) as (planner, size, rollouts_for, counters):
        # On a GPU the frame cost scores each fork's frames there at once; on a CPU NumPy reads
        # them one by one, which is faster there (pusht/batch_locate.py). The pose cost reads
        # on the host.
        on_gpu = planner["device"].startswith("cuda") and args.cost == "frame"
        cost_device = planner["device"] if on_gpu else None
        planned = {**planner, "cost_device": cost_device or "host"}
        slots = asyncio.Semaphore(args.concurrent)

        async def episode(seed: int) -> None:
            async with slots:
                result = await _run_episode(args, config, seed, size, rollouts_for, cost_device)
            on_episode(result, planned, counters())

        await _all_or_none([episode(seed) for seed in seeds])


class _PlanProgress:
    """The episodes of a --plan run as they end, from this process or its planning
    processes: the progress bar, and the report, rewritten to --json after each episode so
    that the episodes so far survive an interrupted run."""

    def __init__(self, args: argparse.Namespace, config, seeds: list[int]):
        from tqdm import tqdm

        self.args, self.config, self.seeds = args, config, seeds
        self.results: list = []
        self.planner: dict | None = None
        self.counters: dict[int, dict | None] = {}  # the latest counters of each process
        self.started = time.perf_counter()
        self.bar = tqdm(total=len(seeds), desc=f"planning {args.model}", unit="episode")

    def add(self, result, planner: dict, counters: dict | None, process: int = 0) -> None:
        self.results.append(result)
        self.planner, self.counters[process] = planner, counters
        self.bar.update()
        self.bar.set_postfix(success=f"{sum(r.success for r in self.results)}/{len(self.results)}")
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.report(False), indent=2) + "\n")

    def report(self, complete: bool) -> dict:
        counters = [c for c in self.counters.values() if c is not None]
        engine = merged_counters(counters) if counters else None
        planner = self.planner or {}
        args, config, seeds = self.args, self.config, self.seeds
        return _plan_report(args, config, seeds, planner, self.results, self.started, complete, engine)

    def close(self) -> None:
        self.bar.close()


def merged_counters(counters: list[dict]) -> dict:
    """The engine counters (`_engine_counters`) of several planning processes as one: batches
    and graph counters summed, the mean batch weighted by each process's batches."""
    batches = sum(c["dit_batches"] for c in counters)
    units = sum(c["dit_batches"] * c["mean_batch_units"] for c in counters)
    out = {"dit_batches": batches, "mean_batch_units": round(units / batches, 2) if batches else 0.0}
    graphs = [c["cuda_graphs"] for c in counters if "cuda_graphs" in c]
    if graphs:
        out["cuda_graphs"] = {key: sum(g[key] for g in graphs) for key in graphs[0]}
    return out


async def _run_episode(args: argparse.Namespace, config, seed: int, size: int, rollouts_for, cost_device):
    """One model-predictive episode of `seed` with the command's search and cost."""
    from ..pusht.planning import make_task, run_episode

    return await run_episode(
        lambda frame, world: rollouts_for(frame, world, seed),
        make_task(seed, size, args.goal_steps),
        config,
        size,
        budget=args.budget,
        execute=args.execute,
        seed=seed,
        cost_frames=args.cost_frames,
        cost_device=cost_device,
        proposals=args.proposals,
        replan_error=args.replan_error,
        shape_weight=args.shape_weight,
        warm_start=args.warm_start,
        cost=args.cost,
    )


async def _all_or_none(coroutines: list) -> None:
    """Runs the coroutines as tasks; if one fails (or the run is interrupted), cancels the
    rest and waits for them before raising."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _plan_report(
    args: argparse.Namespace,
    config,
    seeds: list[int],
    planner: dict,
    results: list,
    started: float,
    complete: bool,
    engine: dict | None = None,
) -> dict:
    """The --plan JSON: the planner, the search, the summary, the engine's counters (through
    the model) and the episodes in seed order."""
    from ..pusht.planning import summary

    order = {seed: i for i, seed in enumerate(seeds)}
    return {
        **planner,
        "complete": complete,
        "seeds": seeds,
        "goal_steps": args.goal_steps,
        "budget": args.budget,
        "execute": args.execute or config.horizon,
        "cost": args.cost,
        "cost_frames": args.cost_frames,
        "proposals": args.proposals,
        "replan_error": args.replan_error,
        "shape_weight": args.shape_weight,
        "warm_start": args.warm_start,
        "concurrent": args.concurrent,
        "processes": min(args.processes, len(seeds)),
        "cem": vars(config),
        "summary": summary(results, time.perf_counter() - started),
        **({} if engine is None else {"engine": engine}),
        "episodes": [r.to_json() for r in sorted(results, key=lambda r: order[r.seed])],
    }
