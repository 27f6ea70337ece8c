"""Plan PushT with a StreamWorld server: many imagined futures per step, the best one acted on.

A PushT task (a start state and the goal that a recorded trajectory reaches `--goal-steps`
later) is solved model-predictively. From the frame the real environment shows, a session
is started on the server and forked into `--samples` branches per iteration, one per
candidate action sequence. The cross-entropy method keeps the candidates whose last
predicted frame is nearest the goal (with `--cost-frames best`, whose nearest frame is).
The first actions of the best one run in the real environment (gym-pusht), and the loop
plans again from the new frame. It stops when the goal is reached (DINO-WM's test: agent
and block within 20 world units, the block within 20 degrees) or the step budget is spent.
`docs/planning.md` explains the protocol.

`--video` writes four panels side by side: the real environment, the predicted frames of
the plan being executed, the goal, and the candidates the plan was chosen from (up to 16,
the chosen one framed in red).

    streamworld serve                       # in another terminal (serves pusht by default)
    python examples/plan_pusht.py --seed 1 --goal-steps 5 --video plan.mp4

`--model pusht-delta` plans with the better planner of the two shipped PushT models (serve
it with `streamworld serve --model pusht-delta`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

from streamworld.cli.arguments import add_search_arguments
from streamworld.cli.eval import PUSHT_MODELS
from streamworld.client import StreamWorldError
from streamworld.planning import CEMConfig, ClientRollouts
from streamworld.pusht.planning import make_task, run_episode, state_error
from streamworld.pusht.proposals import check_count


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream", help="server stream URL")
    p.add_argument(
        "--model",
        default="pusht",
        choices=PUSHT_MODELS,
        help="served PushT model (default pusht)",
    )
    p.add_argument("--seed", type=int, default=1, help="task seed (default 1)")
    p.add_argument("--goal-steps", type=int, default=5, help="steps from start to goal (default 5, easy)")
    p.add_argument("--budget", type=int, default=24, help="environment steps allowed (default 24)")
    p.add_argument("--samples", type=int, default=16, help="branches per fork (default 16)")
    p.add_argument("--iterations", type=int, default=3, help="forks per plan (default 3)")
    p.add_argument("--horizon", type=int, default=8, help="steps each plan covers (default 8)")
    add_search_arguments(p)
    p.add_argument(
        "--video", metavar="OUT.mp4", help="write real | predicted | goal | candidates side by side"
    )
    p.add_argument("--scale", type=int, default=4, help="upscaling of the video frames (default 4)")
    return p


def write_video(path: str, result, goal: np.ndarray, scale: int) -> None:
    """real | predicted | goal | the candidates of the fork the plan came from (the chosen one
    framed in red), one video frame per executed step."""
    from streamworld.media import write_mp4

    steps = [
        (plan, h) for plan, n in zip(result.recorded_plans, result.executed, strict=True) for h in range(n)
    ]
    rows = []
    for i, real in enumerate(result.frames[1:]):
        plan, h = steps[i] if i < len(steps) else (None, 0)
        guess = plan.frames[h] if plan is not None else np.zeros_like(real)
        panels = np.concatenate([real, guess, goal], axis=1).repeat(scale, 0).repeat(scale, 1)
        grid = candidate_grid(plan, h, real.shape[0] * scale) if plan is not None else None
        if grid is None:
            grid = np.zeros((panels.shape[0], panels.shape[0], 3), np.uint8)
        rows.append(np.concatenate([panels, grid], axis=1))
    write_mp4(np.stack(rows), path, fps=10)
    print(f"wrote {path}: {len(rows)} frames, real | predicted | goal | candidates")


def candidate_grid(plan, h: int, side: int) -> np.ndarray | None:
    """Frame h of up to 16 of the plan's candidates in a square grid `side` pixels wide, the
    chosen candidate among them and framed in red."""
    if plan.candidates is None:
        return None
    count = min(len(plan.candidates), 16)
    others = [i for i in range(len(plan.candidates)) if i != plan.chosen]
    order = sorted([*others[: count - 1], plan.chosen])
    g = int(np.ceil(np.sqrt(count)))
    t = side // g
    grid = np.zeros((side, side, 3), np.uint8)
    size = plan.candidates.shape[2]
    pick = np.arange(t) * size // t  # nearest-neighbour resize to t x t
    for slot, i in enumerate(order):
        thumb = plan.candidates[i, h][pick][:, pick].copy()
        if i == plan.chosen:
            thumb[:2] = thumb[-2:] = thumb[:, :2] = thumb[:, -2:] = (255, 0, 0)
        y, x = divmod(slot, g)
        grid[y * t : (y + 1) * t, x * t : (x + 1) * t] = thumb
    return grid


def search_config(args: argparse.Namespace) -> CEMConfig:
    """The cross-entropy search the flags ask for (ValueError if they do not make one)."""
    elites = max(1, min(4, args.samples // 2))
    config = CEMConfig(
        args.horizon,
        args.samples,
        elites,
        args.iterations,
        knot_frames=2,
        noise_beta=args.noise_beta,
        keep_elites=args.keep_elites,
        max_speed=args.max_speed,
    )
    config.check()
    check_count(args.proposals, args.samples)
    return config


async def run(args: argparse.Namespace) -> int:
    task = make_task(args.seed, 64, args.goal_steps)
    config = search_config(args)
    world, _ = task.start(64)
    print(f"task {args.seed}: start {state_error(world.scene, task.goal)[0]:.0f} world units from the goal")
    world.close()
    result = await run_episode(
        lambda observed, _world: ClientRollouts.start(args.url, observed, model=args.model, seed=args.seed),
        task,
        config,
        64,
        budget=args.budget,
        seed=args.seed,
        record=args.video is not None,
        cost_frames=args.cost_frames,
        proposals=args.proposals,
        replan_error=args.replan_error,
        shape_weight=args.shape_weight,
        warm_start=args.warm_start,
        cost=args.cost,
    )
    position, angle = result.final_error
    outcome = "reached" if result.success else "not reached"
    seconds = ", ".join(f"{s:.1f}" for s in result.plan_seconds)
    print(
        f"goal {outcome} after {result.steps} steps and {result.plans} plans ({seconds} s each; "
        f"{result.branches} branches); final error {position:.1f} world units, {angle:.1f} degrees"
    )
    if args.video:
        write_video(args.video, result, task.goal_frame, args.scale)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.goal_steps, args.budget, args.iterations, args.horizon, args.scale) < 1 or args.samples < 2:
        print("error: --samples must be at least 2, and every other count at least 1", file=sys.stderr)
        return 2
    if not (args.replan_error >= 0 and args.shape_weight >= 0):  # also refuses nan
        print("error: --replan-error and --shape-weight must be at least 0", file=sys.stderr)
        return 2
    try:
        search_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args))
    except (StreamWorldError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
