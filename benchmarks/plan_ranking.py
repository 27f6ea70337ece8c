"""How well the world model ranks a plan's candidates: the model's cost against the truth.

The planner acts on the candidate whose predicted frames its cost likes best, so what a
model is worth to it is how well it orders candidates, more than how far its pixels are
off. For the first plan of each task (`eval pusht --plan`'s tasks, search and cost), every
candidate of every fork is rolled out twice: by the model, as the planner does, and in the
true environment from the same state. Per task it reports:

- the Spearman rank correlation of the two costs over each fork's candidates (1: the
  model orders them as the truth does);
- the model's pick (the candidate the plan acts on): where it came from (the mean, a
  proposal, a random sample; which iteration), its true cost and the true distance of
  the block's middle to the goal's after it, against the start's;
- the best candidate by the truth, its origin, and the regret (the pick's true cost less
  the least true cost among the plan's candidates);
- whether some candidate truly reaches the goal during its steps (24 by default), and whether the
  pick does;
- the final mean (`cem`'s last refit, which the next plan starts from, and which
  DINO-WM's CEM acts on instead of the cheapest candidate), run in the true environment:
  its true cost, block distance and whether it reaches the goal;
- every candidate's two costs, whether it truly reaches the goal, and its origin (`forks`),
  for other ways of choosing to be tried offline.

    python benchmarks/plan_ranking.py --model pusht-delta --proposals 6 --seeds 0-19 --json ranking.json
    python benchmarks/plan_ranking.py --scene-model scene.safetensors --seeds 0-19 --json ranking.json

`--scene-model FILE` ranks with a scene model (`streamworld.pusht.scene_model`) instead of
the world model, as `eval pusht --plan --scene-model` plans with it.

On a CPU the model's rollouts take most of the time: one plan of 16 x 3 is about 40 s on
one core of a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from streamworld.engine import AsyncEngine
from streamworld.models import get_preset
from streamworld.planning import (
    CEMConfig,
    EngineRollouts,
    Rollouts,
    cem,
    close_rollouts,
    planning_engine_config,
)
from streamworld.pusht.evaluate import parse_seeds
from streamworld.pusht.planning import frame_cost, make_task, reached
from streamworld.pusht.proposals import PushProposals, block_middle, check_count
from streamworld.pusht.scene_model import SceneModel, SceneModelRollouts


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 of `values` (ties broken by order, which costs of floats rarely need)."""
    out = np.empty(len(values))
    out[np.argsort(values, kind="stable")] = np.arange(len(values))
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two equal-length arrays."""
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def true_rollouts(world, candidates: np.ndarray, goal) -> tuple[np.ndarray, list[bool], list[float]]:
    """Every candidate run in a replica of `world`: its frames, whether it reaches `goal` at
    some step, and the block middle's distance to the goal's at its end."""
    size = world.size
    frames = np.empty((*candidates.shape[:2], size, size, 3), np.uint8)
    reaches, distances = [], []
    for k, actions in enumerate(candidates):
        twin = world.replica()
        hit = False
        for h, action in enumerate(actions):
            frames[k, h] = twin.step(action)
            hit = hit or reached(twin.scene, goal)
        reaches.append(hit)
        distances.append(float(np.linalg.norm(block_middle(twin.scene.block) - block_middle(goal.block))))
        twin.close()
    return frames, reaches, distances


def origins(iteration: int, samples: int, proposals: int) -> list[str]:
    """Where each candidate of a fork came from (`cem`: the mean first, then the proposals in
    the first iteration, then random samples)."""
    if iteration == 0:
        return ["mean"] + ["proposal"] * proposals + ["random"] * (samples - 1 - proposals)
    return ["mean"] + ["random"] * (samples - 1)


async def first_plan(
    rollouts_for: Callable[[np.ndarray, int], Rollouts],
    size: int,
    seed: int,
    config: CEMConfig,
    proposals: int,
) -> dict:
    """One task's first plan, every fork scored by the model (`rollouts_for(frame, seed)`)
    and by the truth."""
    task = make_task(seed, size)
    world, frame = task.start(size)
    cost = frame_cost(task.goal_frame)
    proposed = PushProposals(task.goal_frame, proposals)(frame, config.knots) if proposals else None
    forks = []

    async def rollouts(candidates: np.ndarray) -> np.ndarray:
        frames = await model(candidates)
        true_frames, reaches, distances = true_rollouts(world, candidates, task.goal)
        forks.append(
            {
                "model_costs": cost.many(frames),
                "true_costs": cost.many(true_frames),
                "reaches": reaches,
                "distances": distances,
                "origins": origins(len(forks), config.samples, 0 if proposed is None else len(proposed)),
            }
        )
        return frames

    model = rollouts_for(frame, seed)
    try:
        rng = np.random.default_rng(seed)
        agent = np.array(world.scene.agent)
        plan = await cem(rollouts, cost, agent, config, rng, proposals=proposed)
    finally:
        await close_rollouts(model)
    mean_actions = config.actions(np.clip(plan.mean, config.low, config.high), agent)
    frames, reaches, distances = true_rollouts(world, mean_actions[None].astype(np.float32), task.goal)
    final_mean = {
        "true_cost": round(float(cost(frames[0])), 2),
        "block_distance": round(distances[0], 1),
        "reaches": reaches[0],
    }
    start = float(np.linalg.norm(block_middle(world.scene.block) - block_middle(task.goal.block)))
    world.close()
    every = {
        "forks": [
            {
                "model_costs": [round(float(c), 3) for c in f["model_costs"]],
                "true_costs": [round(float(c), 3) for c in f["true_costs"]],
                "reaches": [bool(r) for r in f["reaches"]],
                "origins": f["origins"],
            }
            for f in forks
        ]
    }
    return {**summarise(seed, forks, start), "final_mean": final_mean, **every}


def summarise(seed: int, forks: list[dict], start: float) -> dict:
    """The report of one plan (module docstring) from its logged forks."""
    flat = {
        k: np.concatenate([np.asarray(f[k], dtype=object if k == "origins" else None) for f in forks])
        for k in forks[0]
    }
    iteration = np.concatenate([np.full(len(f["origins"]), i) for i, f in enumerate(forks)])
    pick = int(np.argmin(flat["model_costs"]))  # cem keeps the first least cost
    best = int(np.argmin(flat["true_costs"]))
    return {
        "seed": seed,
        "spearman_per_fork": [round(spearman(f["model_costs"], f["true_costs"]), 3) for f in forks],
        "start_block_distance": round(start, 1),
        "pick": {
            "origin": flat["origins"][pick],
            "iteration": int(iteration[pick]),
            "true_cost": round(float(flat["true_costs"][pick]), 2),
            "block_distance": round(float(flat["distances"][pick]), 1),
            "reaches": bool(flat["reaches"][pick]),
        },
        "best_by_truth": {
            "origin": flat["origins"][best],
            "iteration": int(iteration[best]),
            "true_cost": round(float(flat["true_costs"][best]), 2),
            "block_distance": round(float(flat["distances"][best]), 1),
        },
        "regret": round(float(flat["true_costs"][pick] - flat["true_costs"][best]), 2),
        "some_candidate_reaches": bool(np.any(flat["reaches"])),
        "proposals_reaching": int(
            sum(r for r, o in zip(flat["reaches"], flat["origins"], strict=True) if o == "proposal")
        ),
    }


def totals(rows: list[dict]) -> dict:
    """What the rows add up to."""
    pushes = [r for r in rows if r["start_block_distance"] >= 10.0]
    return {
        "tasks": len(rows),
        "spearman_mean": round(float(np.mean([s for r in rows for s in r["spearman_per_fork"]])), 3),
        "regret_median": round(float(np.median([r["regret"] for r in rows])), 2),
        "picks_from": {
            o: sum(r["pick"]["origin"] == o for r in rows) for o in ("mean", "proposal", "random")
        },
        "pushes": len(pushes),
        "pushes_where_the_pick_brings_the_block_nearer": sum(
            r["pick"]["block_distance"] < r["start_block_distance"] for r in pushes
        ),
        "some_candidate_reaches": sum(r["some_candidate_reaches"] for r in rows),
        "pick_reaches": sum(r["pick"]["reaches"] for r in rows),
        "final_mean_truly_cheaper_than_pick": sum(
            r["final_mean"]["true_cost"] < r["pick"]["true_cost"] for r in rows if "final_mean" in r
        ),
        "final_mean_reaches": sum(r["final_mean"]["reaches"] for r in rows if "final_mean" in r),
    }


def search(args: argparse.Namespace) -> CEMConfig:
    """The search of the arguments: by default `eval pusht --plan --noise-beta 2
    --keep-elites 2`'s (24 steps, targets held 4 steps, 16 x 3, the 4 best)."""
    return CEMConfig(
        horizon=args.plan_horizon,
        knot_frames=args.knot_frames,
        samples=args.samples,
        elites=args.elites,
        iterations=args.iterations,
        noise_beta=args.noise_beta,
        keep_elites=args.keep_elites,
        max_speed=args.max_speed,
    )


async def run(args: argparse.Namespace) -> dict:
    from streamworld.cli.loading import LoadOptions, load_world_model
    from streamworld.models.world_model import WeightPaths

    config = search(args)
    size = get_preset(args.model).height
    rows = []
    if args.scene_model:
        scene_model = SceneModel.load(args.scene_model)
        for seed in args.seeds:
            rows.append(
                await first_plan(
                    lambda f, s: SceneModelRollouts(scene_model, f), size, seed, config, args.proposals
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    else:
        model = load_world_model(
            get_preset(args.model),
            WeightPaths(dit=args.dit),
            LoadOptions(device=args.device, dtype="float32"),
        )
        async with AsyncEngine(model, planning_engine_config(config.samples)) as engine:
            for seed in args.seeds:
                rows.append(
                    await first_plan(
                        lambda f, s: EngineRollouts(engine, f, s), size, seed, config, args.proposals
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    return {
        "benchmark": "plan_ranking",
        "model": args.model,
        "weights": Path(args.dit).name if args.dit else "shipped",
        "scene_model": args.scene_model.name if args.scene_model else None,
        "device": args.device,
        "proposals": args.proposals,
        "cem": vars(config),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "totals": totals(rows),
        "tasks": rows,
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="pusht-delta", choices=["pusht", "pusht-delta"], help="default pusht-delta"
    )
    parser.add_argument(
        "--dit", help="weights to rank with instead of the shipped ones (a .safetensors file)"
    )
    parser.add_argument(
        "--seeds", type=parse_seeds, default=parse_seeds("0-19"), help="task seeds (default 0-19)"
    )
    parser.add_argument("--proposals", type=int, default=6, help="push and turn proposals (default 6)")
    parser.add_argument("--samples", type=int, default=16, help="branches per fork (default 16)")
    parser.add_argument("--elites", type=int, default=4, help="best candidates refitted to (default 4)")
    parser.add_argument("--iterations", type=int, default=3, help="forks per plan (default 3)")
    parser.add_argument("--plan-horizon", type=int, default=24, help="steps each plan covers (default 24)")
    parser.add_argument("--knot-frames", type=int, default=4, help="steps a planned target holds (default 4)")
    parser.add_argument(
        "--noise-beta", type=float, default=2.0, help="colour of the sampling noise (default 2)"
    )
    parser.add_argument(
        "--keep-elites", type=int, default=2, help="elites carried to the next fork (default 2)"
    )
    parser.add_argument(
        "--max-speed",
        type=float,
        default=0.0,
        help="most an action moves a step; 0: targets held (default 0)",
    )
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu or cuda[:N] (default cpu)")
    parser.add_argument(
        "--scene-model",
        type=Path,
        metavar="FILE",
        help="rank with a scene model (`benchmarks/pusht_state_dynamics.py --save`) instead of the world "
        "model, as `eval pusht --plan --scene-model` plans with it",
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    try:
        check_count(args.proposals, args.samples)
        search(args).check()
    except ValueError as e:
        parser.error(str(e))
    if args.dit and not Path(args.dit).is_file():
        parser.error(f"--dit: {args.dit} does not exist")
    if args.scene_model and args.dit:
        parser.error("--scene-model ranks without the world model: drop --dit")
    if args.scene_model:
        try:
            SceneModel.load(args.scene_model)
        except ValueError as e:
            parser.error(f"--scene-model: {e}")
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist")
    report = asyncio.run(run(args))
    print(json.dumps(report["totals"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
