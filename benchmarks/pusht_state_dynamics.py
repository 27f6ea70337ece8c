"""Can PushT's pushes be learned from the training data at all? A small network that
predicts the scene (the agent's place, the block's pose) instead of frames, trained on
the same kind of data, rolled out free-running as `streamworld eval` rolls the world model.

The world model's block is 4.48 px off at 32 frames (`pusht-delta`, one step), while the
true physics started from what the first frame shows is 0.94 px off
(`benchmarks/pusht_physics_floor.py`). Between them lies learning the pushes. This script
asks how far a model gets that is given the scene itself, exactly, with the strongest
help a scene model can have: each step's input is the agent's place and velocity and the
action's target in the block's own frame (so a push looks the same wherever the block
is), and it predicts one step's change of the block's pose (in that frame) and of the
agent's place. It is trained with a squared error on episodes recorded as `train pusht`
records them (`--push-share`, scenes only, no frames drawn): one step ahead, or through
rollouts of `--rollout-steps` steps that go on from their own predictions. It is then
rolled out from each eval episode's exact start under its actions for 32 steps; the
scenes it predicts are drawn by the environment and scored with `evaluate.block_scores`,
as the physics floor's are.

If such a model, which never has to draw or read a frame, stays far above the floor, the
pushes are what is hard to learn, whatever draws the frames; if it comes near, a world
model that carries the block's pose (and draws the block from it) is worth building.

    python benchmarks/pusht_state_dynamics.py --json state_dynamics.json
    python benchmarks/pusht_state_dynamics.py --rollout-steps 8 --json state_dynamics.json

On a 2-core CPU with the defaults (1,500 episodes, 20,000 steps) about 3.5 minutes one
step ahead and 8 through rollouts of 8 steps. The model itself is
`streamworld.pusht.scene_model`: `--save FILE` writes it, for `--load FILE` (score it again)
and `streamworld eval pusht --plan --scene-model FILE` (plan with it). `--device cuda` trains
on a GPU, where a step takes about as long for any `--batch` (the rollouts' many small
operations bound it), and `--train-minutes` ends training on time.

The block error under the eval's scripted actions does not tell how a model plans
(`docs/planning.md`). So the model is also judged under actions like the planner's
(`--judge-candidates`, the report's `candidates`): from each eval seed's task start, 24-step
candidates drawn as the planner draws them toward the task's goal, the block's error
against the environment's at 8, 16 and 24 steps, and apart, at 24 steps, for the candidates
whose true T came within 10 world units of a wall and for those whose true end lies within
twice the success test's tolerances of the goal, where plans are decided (with how often
the model's end passes the success test exactly when the true one does).
`--candidate-share` records that share of the training episodes with such actions
(`proposals.CandidatePolicy`).

`--kind velocities` steps the physics' own state instead of the scene: the agent's and the
block's velocities are carried, and the agent is stepped exactly as the environment steps
it (`scene_model.py`); `--kind walls` also sees how near the arena's walls are, which
every other kind, seeing the step from the block alone, cannot. The report's `one_step` is
the block's error one step ahead from the true state on held-out candidate-like episodes,
which
`benchmarks/pusht_step_determinism.py` measures for the physics itself. `--data FILE` keeps
the recorded episodes (5-9 minutes of a run on two cores) for the next run with the same
data options.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import platform
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from streamworld.pusht.data import PUSH_SHARE, DatasetSpec, scene_row
from streamworld.pusht.evaluate import block_scores, block_summary, parse_seeds, record_eval_episode
from streamworld.pusht.planning import ANGLE_TOLERANCE, POSITION_TOLERANCE, make_task, reached, state_error
from streamworld.pusht.proposals import CandidatePolicy, block_middle
from streamworld.pusht.scene_model import KINDS, SceneModel, draw_scenes, state_row, wall_gap
from streamworld.pusht.world import WORLD_SIZE, PushTWorld, Scene, angle_error

HORIZONS = (8, 16, 24, 32)
CANDIDATE_HORIZONS = (8, 16, 24)  # a plan's candidates cover 24 steps
SIZE = 64
BATCH = 1024  # default samples per training step: scenes, or rollout steps
MAX_ROLLOUT = 32
JUDGE_SEED = 50_000  # added to an eval seed for the candidates it is judged under
ONE_STEP_EPISODES, ONE_STEP_SEED = 20, 7  # held out: training data is seed 2 by default
NEAR_WALL = 10.0  # world units: candidates whose true T came this near a wall are also summed apart
# Candidates whose true end is within twice the success test's tolerances of the goal
# (world units over agent and block, degrees) are summed apart too: where plans are decided.
NEAR_GOAL = (2 * POSITION_TOLERANCE, 2 * math.degrees(ANGLE_TOLERANCE))
MOVED = 0.1  # world units: one-step errors are scored where the true block moved this much
TAIL = 200  # the final loss is the mean over this many last steps


def record_scenes(args: tuple[int, DatasetSpec]) -> tuple[np.ndarray, np.ndarray]:
    """One training episode's states [steps + 1, 10] (`scene_model.state_row`: the scene and
    the velocities) and actions [steps, 2], the frames not drawn: the seeds and policy of
    `data.record_episode` (`DatasetSpec.policy`)."""
    index, spec = args
    world, policy = PushTWorld(SIZE), spec.policy(index)
    world.reset(spec.episode_seed(index))
    scenes, actions = [state_row(world)], []
    for _ in range(spec.steps):
        actions.append(policy(world.scene))
        world.advance(actions[-1])
        scenes.append(state_row(world))
    world.close()
    return np.asarray(scenes, np.float64), np.asarray(actions, np.float64)


def rollout_loss(model: SceneModel, episodes, taken, k: int, gen, batch: int = BATCH) -> torch.Tensor:
    """The objective over rollouts: `batch // k` rollouts of k steps, each from a true state
    (and the one before it) under the episode's actions, scored at every step by how far
    the predicted state is from the true one (`SceneModel.errors`: the change that would
    take the true scene to the predicted one, scaled)."""
    n, last = batch // k, episodes.shape[1] - k  # starts 1 .. steps - k
    e = torch.randint(0, episodes.shape[0], (n,), generator=gen).to(episodes.device)
    t = torch.randint(1, last, (n,), generator=gen).to(episodes.device)
    episodes = episodes[..., : model.columns]
    before, now, loss = episodes[e, t - 1], episodes[e, t], 0.0
    for j in range(k):
        before, now = now, model.step(before, now, taken[e, t + j])
        loss = loss + (model.errors(episodes[e, t + j + 1], now) ** 2).mean()
    return loss / k


def one_step_samples(
    model: SceneModel, scenes: list[np.ndarray], actions: list[np.ndarray], device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every step of the episodes as the model's (`inputs`, `changes`), float32 on `device`."""
    x, y = [], []
    for s, a in zip(scenes, actions, strict=True):
        s = s[:, : model.columns]
        before = np.concatenate([s[:1], s[:-2]])  # the first step has no move before it
        x.append(model.inputs(before, s[:-1], a))
        y.append(model.changes(s[:-1], s[1:]))
    return tuple(torch.tensor(np.concatenate(v), dtype=torch.float32, device=device) for v in (x, y))


def train(
    scenes: list[np.ndarray],
    actions: list[np.ndarray],
    steps: int,
    width: int,
    seed: int,
    progress: bool,
    rollout_steps: int = 1,
    device: str = "cpu",
    batch: int = BATCH,
    seconds: float = 0.0,
    max_grad_norm: float = 0.0,
    kind: str = "moves",
) -> tuple[SceneModel, float, int, int]:
    """The scene model (on the CPU, in eval mode), trained on `device` one step ahead
    (`rollout_steps` 1) or through rollouts of that many steps (`rollout_loss`); its mean
    loss over the last 200 steps, the number of one-step samples, and the steps taken.
    With `seconds`, training also ends when that much time has passed, its learning rate's
    schedule following whichever of the steps or the time is further along. `max_grad_norm`
    (0: off) clips the gradient's norm. `Diverged` if the loss stops being finite."""
    from tqdm import tqdm

    episodes = torch.tensor(np.stack(scenes), dtype=torch.float32, device=device)  # [E, steps + 1, 10]
    taken = torch.tensor(np.stack(actions), dtype=torch.float32, device=device)  # [E, steps, 2]

    torch.manual_seed(seed)
    model = SceneModel(width, kind=kind).to(device)
    x_all, y_all = one_step_samples(model, scenes, actions, device)
    model.scale.copy_(y_all.std(0).clamp_min(1e-3))
    peak, warm = 2e-3, max(1, steps // 20)
    opt = torch.optim.AdamW(model.parameters(), lr=peak, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)  # on the CPU, so a run draws the same batches anywhere
    # The last TAIL losses in place (a list of every step's loss grew 0.5-2 MB a step on a CPU)
    last, finished, started = torch.zeros(TAIL, device=device), 0, time.perf_counter()
    for step in tqdm(range(steps), desc="training the scene model", unit="step", disable=not progress):
        done = max(step / steps, (time.perf_counter() - started) / seconds if seconds else 0.0)
        if done >= 1:
            break
        for group in opt.param_groups:  # linear warm-up, then a cosine to zero
            group["lr"] = peak * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * done))
        if rollout_steps == 1:
            i = torch.randint(0, len(x_all), (batch,), generator=gen).to(device)
            loss = ((model(x_all[i]) - y_all[i] / model.scale) ** 2).mean()
        else:
            loss = rollout_loss(model, episodes, taken, rollout_steps, gen, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        last[finished % TAIL] = loss.detach()
        finished += 1
        if step % 100 == 0 and not torch.isfinite(loss):  # a NaN stays: a late look finds it
            raise Diverged(f"the training loss is {loss.item()} at step {step}")
    tail = last[: min(finished, TAIL)].mean().item()
    if not math.isfinite(tail):
        raise Diverged(f"the training loss is {tail} over the last steps")
    return model.cpu().eval(), tail, len(x_all), finished


class Diverged(RuntimeError):
    """Training's loss stopped being finite: no model to save."""


def record(spec: DatasetSpec, workers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every training episode's (scenes, actions), in `workers` processes (`record_scenes`)."""
    from tqdm import tqdm

    jobs = [(i, spec) for i in range(spec.episodes)]
    if workers == 1:
        return [record_scenes(job) for job in tqdm(jobs, desc="recording scenes", unit="episode")]
    with mp.get_context("spawn").Pool(workers) as pool:
        found = pool.imap(record_scenes, jobs, chunksize=8)
        return list(tqdm(found, total=len(jobs), desc="recording scenes", unit="episode"))


def recorded(spec: DatasetSpec, workers: int, path: Path | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """`record(spec, workers)`, or the episodes an earlier run with the same `spec` saved at
    `path` (`--data`), which a run that records saves there."""
    if path is None:
        return record(spec, workers)
    about = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if path.is_file():
        try:
            with np.load(path) as saved:
                spec_saved, states, actions = str(saved["spec"]), saved["states"], saved["actions"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise SystemExit(f"--data {path}: not episodes this script saved ({e})") from None
        if spec_saved != about:
            raise SystemExit(f"--data {path}: recorded for {spec_saved}, not for this run's {about}")
        return list(zip(states, actions, strict=True))
    episodes = record(spec, workers)
    with path.open("wb") as f:
        np.savez(
            f,
            spec=about,
            states=np.stack([s for s, _ in episodes]),
            actions=np.stack([a for _, a in episodes]),
        )
    return episodes


def one_step_errors(model: SceneModel, episodes: int = ONE_STEP_EPISODES) -> dict:
    """The block's error one step ahead from the true state (and the one before it) over
    held-out episodes driven like the planner's candidates, on the steps whose true block
    moved (`benchmarks/pusht_step_determinism.py` measures the same for the physics
    itself): how well the network fits one step, apart from its rollouts' drift."""
    spec = DatasetSpec(episodes, 150, SIZE, ONE_STEP_SEED, candidate_share=1.0)
    errors, moves = [], []
    for index in range(episodes):
        states, actions = record_scenes((index, spec))
        states = states[:, : model.columns]
        before = np.concatenate([states[:1], states[:-2]])
        with torch.no_grad():
            step = model.step(*(torch.tensor(v, dtype=torch.float32) for v in (before, states[:-1], actions)))
        step = step.double().numpy()
        errors.append(np.hypot(*(step[:, 2:4] - states[1:, 2:4]).T))
        moves.append(np.hypot(*(states[1:, 2:4] - states[:-1, 2:4]).T))
    error, move = np.concatenate(errors), np.concatenate(moves)
    scored = error[move >= MOVED] * SIZE / WORLD_SIZE
    return {
        "steps_scored": len(scored),
        "block_px_mean": round(float(scored.mean()), 4),
        "block_px_median": round(float(np.median(scored)), 4),
        "block_px_p90": round(float(np.quantile(scored, 0.9)), 4),
    }


def score_rollouts(model: SceneModel, seeds: list[int]) -> list[dict]:
    """Per eval seed, `evaluate.block_scores` of the scenes rolled out from its exact start,
    drawn by the environment."""
    from tqdm import tqdm

    world = PushTWorld(SIZE)
    rows = []
    for seed in tqdm(seeds, desc="rolling out", unit="seed"):
        ep = record_eval_episode(seed, max(HORIZONS), SIZE)
        world.reset(seed)
        start = np.asarray(scene_row(world.scene), np.float64)
        pred = model.roll_out(start[None], ep.actions[None].astype(np.float64))[0]
        world.reset(0)
        rows.append(block_scores(draw_scenes(world, pred), ep, HORIZONS))
    world.close()
    return rows


def score_candidates(model: SceneModel, seeds: list[int], per_seed: int) -> dict[str, dict]:
    """The model's error under actions like the planner's: from each eval seed's task start
    (`planning.make_task`), `per_seed` candidates of `CandidatePolicy` toward the task's
    goal, rolled out by the model (from the true scene, at rest) and by the environment
    (`candidate_errors`). Per horizon, over all candidates and over those whose true block moved
    more than a pixel: the block's middle's distance (pixels at 64 px) and angle error; and
    apart, the candidates near a wall and those ending near the goal (`_candidate_summary`)."""
    from tqdm import tqdm

    errors, facts = [], []
    for seed in tqdm(seeds, desc="judging under candidates", unit="seed"):
        task = make_task(seed, SIZE)
        world, _ = task.start(SIZE)
        policy = CandidatePolicy(seed + JUDGE_SEED)
        candidates = np.stack([policy.candidate(world.scene, task.goal) for _ in range(per_seed)])
        seed_errors, seed_facts = candidate_errors(model, world, candidates, task.goal)
        world.close()
        errors.append(seed_errors)
        facts.append(seed_facts)
    return _candidate_summary(
        np.concatenate(errors), {k: np.concatenate([f[k] for f in facts]) for k in facts[0]}
    )


def candidate_errors(
    model: SceneModel, world: PushTWorld, candidates: np.ndarray, goal: Scene
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Errors [K, H, (pixels, degrees)] of the model's block (its middle, its angle) under
    candidates [K, H, 2] rolled out from `world`'s scene at rest, against the environment's
    from `world` as it is; and per candidate: whether the true block's middle moved more
    than a pixel (`moved`) and how near it came to a wall (`wall_gap`, `scene_model.wall_gap`,
    least over its steps), how far the true end is from `goal` (`goal_units`,
    `goal_degrees`: `planning.state_error`), and whether the true and the predicted ends pass
    the success test (`reached`, `predicted_reached`)."""
    px = SIZE / WORLD_SIZE
    start = np.array([scene_row(world.scene)], np.float64)
    predicted = model.roll_out(np.repeat(start, len(candidates), 0), candidates)
    errors, k_all = np.empty((*candidates.shape[:2], 2)), len(candidates)
    facts = {"moved": np.empty(k_all, bool), "wall_gap": np.full(k_all, np.inf)}
    facts |= {"goal_units": np.empty(k_all), "goal_degrees": np.empty(k_all)}
    facts |= {"reached": np.empty(k_all, bool), "predicted_reached": np.empty(k_all, bool)}
    for k, (actions, guess) in enumerate(zip(candidates, predicted, strict=True)):
        twin = world.replica()
        for h, action in enumerate(actions):
            twin.advance(action)
            true, row = twin.scene.block, guess[h, 2:]
            facts["wall_gap"][k] = min(facts["wall_gap"][k], wall_gap(true))
            errors[k, h] = (
                np.linalg.norm(block_middle(true) - block_middle(tuple(row))) * px,
                angle_error(true[2], float(row[2])),
            )
        end = twin.scene
        facts["moved"][k] = np.linalg.norm(block_middle(end.block) - block_middle(world.scene.block)) * px > 1
        facts["goal_units"][k], facts["goal_degrees"][k] = state_error(end, goal)
        facts["reached"][k] = reached(end, goal)
        guessed = Scene(tuple(guess[-1, :2]), tuple(guess[-1, 2:5]))
        facts["predicted_reached"][k] = reached(guessed, goal)
        twin.close()
    return errors, facts


def _candidate_summary(errors: np.ndarray, facts: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per horizon of `CANDIDATE_HORIZONS`, `score_candidates`' summary of errors
    [candidates, horizon, (px, degrees)] and their `candidate_errors` facts; and at the
    last step, apart: the candidates whose true T came within `NEAR_WALL` of a wall (how
    many, their mean error and their share of the error), and those whose true end lies
    within twice the success test's tolerances of the goal
    (`NEAR_GOAL`): how many, their mean error, how many truly reach the goal, and the share
    of them whose predicted end passes the success test exactly when the true one does."""
    moved, last = facts["moved"], errors[:, -1, 0]
    out = {}
    for h in CANDIDATE_HORIZONS:
        at = errors[:, h - 1]
        out[str(h)] = {
            "block_px_mean": round(float(at[:, 0].mean()), 3),
            "block_px_median": round(float(np.median(at[:, 0])), 3),
            "block_deg_median": round(float(np.median(at[:, 1])), 3),
            "moved_block_px_mean": round(float(at[moved, 0].mean()), 3) if moved.any() else None,
            "moved_block_deg_median": round(float(np.median(at[moved, 1])), 3) if moved.any() else None,
        }
    walled = facts["wall_gap"] < NEAR_WALL
    summary = {"candidates": len(moved), "moved": int(moved.sum()), "horizons": out}
    summary["near_wall"] = {
        "within_units": NEAR_WALL,
        "candidates": int(walled.sum()),
        "block_px_mean": round(float(last[walled].mean()), 3) if walled.any() else None,
        "share_of_error": round(float(last[walled].sum() / last.sum()), 3) if last.sum() else None,
    }
    units, degrees = NEAR_GOAL
    near = (facts["goal_units"] < units) & (facts["goal_degrees"] < degrees)
    agree = facts["reached"][near] == facts["predicted_reached"][near]
    summary["near_goal"] = {
        "within_units_degrees": [units, degrees],
        "candidates": int(near.sum()),
        "reached": int(facts["reached"].sum()),
        "block_px_mean": round(float(last[near].mean()), 3) if near.any() else None,
        "success_test_agrees": round(float(agree.mean()), 3) if near.any() else None,
    }
    return summary


def save(model: SceneModel, path: Path, spec: DatasetSpec, trained: dict) -> dict:
    """Write the model with its data's and training's settings; the report's file name and
    sha256."""
    data = {
        "episodes": spec.episodes,
        "data_seed": spec.seed,
        "jump_share": spec.jump_share,
        "candidate_share": spec.candidate_share,
    }
    model.save(path, {**data, **trained})
    return {"saved": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def record_and_train(args: argparse.Namespace) -> tuple[SceneModel, dict]:
    """The model trained as `args` say, on episodes recorded for it (written to `--save`),
    and the report's data, model and seconds."""
    spec = DatasetSpec(
        args.episodes,
        args.steps_per_episode,
        SIZE,
        args.data_seed,
        args.push_share,
        args.jump_share,
        args.candidate_share,
    )
    started = time.perf_counter()
    episodes = recorded(spec, args.workers, args.data)
    record_seconds = time.perf_counter() - started
    model, loss, samples, taken_steps = train(
        [s for s, _ in episodes],
        [a for _, a in episodes],
        args.train_steps,
        args.width,
        args.seed,
        True,
        args.rollout_steps,
        args.device,
        args.batch,
        args.train_minutes * 60,
        args.max_grad_norm,
        args.kind,
    )
    train_seconds = time.perf_counter() - started - record_seconds
    trained = {
        "kind": args.kind,
        "train_steps": taken_steps,
        "rollout_steps": args.rollout_steps,
        "batch": args.batch,
    }
    if args.max_grad_norm:
        trained["max_grad_norm"] = args.max_grad_norm
    saved = save(model, args.save, spec, trained) if args.save else {}
    return model, {
        "data": {k: v for k, v in dataclasses.asdict(spec).items() if k != "size"},  # SIZE is fixed
        "model": {
            "width": args.width,
            **trained,
            "train_minutes": args.train_minutes,
            "samples": samples,
            "final_loss": round(loss, 5),
            **saved,
        },
        "seconds": {"record": round(record_seconds, 1), "train": round(train_seconds, 1)},
    }


def run(args: argparse.Namespace) -> dict:
    """Train a model (or `--load` one) and score its rollouts from the eval seeds' starts."""
    if args.load:
        model = SceneModel.load(args.load)
        sha256 = hashlib.sha256(args.load.read_bytes()).hexdigest()
        about = {"model": {"loaded": args.load.name, "sha256": sha256, **model.metadata}}
    else:
        model, about = record_and_train(args)
    one_step = one_step_errors(model)
    rows = score_rollouts(model, args.seeds)
    judged = (
        {"candidates": score_candidates(model, args.seeds, args.judge_candidates)}
        if args.judge_candidates
        else {}
    )
    return {
        "benchmark": "pusht_state_dynamics",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        **about,
        "seeds": [args.seeds[0], args.seeds[-1], len(args.seeds)],
        "horizons": block_summary(rows, HORIZONS),
        "one_step": one_step,
        **judged,
    }


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """What the training episodes are: how many, how long, and which actions."""
    parser.add_argument(
        "--episodes", type=int, default=1500, help="training episodes to record (default 1500)"
    )
    parser.add_argument(
        "--steps-per-episode", type=int, default=150, help="actions per episode (default 150)"
    )
    parser.add_argument("--data-seed", type=int, default=2, help="seed of the recorded episodes (default 2)")
    parser.add_argument(
        "--push-share",
        type=float,
        default=0.85,
        help=f"the policy's share of pushes (default 0.85, as the world model's rounds since 4; "
        f"train pusht's own default is {PUSH_SHARE})",
    )
    parser.add_argument(
        "--jump-share",
        type=float,
        default=0.0,
        help="the policy's share of moves whose target jumps and is held, as the planner's candidates' "
        "targets do (train pusht --jump-share; default 0)",
    )
    parser.add_argument(
        "--candidate-share",
        type=float,
        default=0.0,
        help="the share of episodes recorded with actions like the planner's candidates instead of "
        "the scripted policy: 24-step stretches of colored noise around the agent or around a push or "
        "turn proposal toward a goal like the tasks' (streamworld.pusht.proposals.CandidatePolicy; "
        "default 0)",
    )


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """How the network trains: steps, time, batch, rollouts and width."""
    parser.add_argument(
        "--train-steps", type=int, default=20000, help="training steps of --batch samples (default 20000)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=BATCH,
        help=f"samples per training step: scenes, or rollout steps (--batch / --rollout-steps rollouts) "
        f"(default {BATCH}; on a GPU, larger batches cost about as much time per step)",
    )
    parser.add_argument(
        "--train-minutes",
        type=float,
        default=0.0,
        help="also end training after this many minutes, the learning rate's cosine following the "
        "time where it is further along than the steps (default 0: no time limit)",
    )
    parser.add_argument(
        "--rollout-steps",
        type=int,
        default=1,
        help="train through rollouts of this many steps, from true scenes under the episodes' "
        "actions, scored at every step (default 1: one step ahead, as the world model's "
        f"teacher-forced objective); at most {MAX_ROLLOUT}",
    )
    parser.add_argument("--width", type=int, default=256, help="the network's width (default 256)")
    parser.add_argument(
        "--kind",
        choices=KINDS,
        default="moves",
        help="the state the model steps: the scene, with the agent's and the block's last moves as "
        "inputs (moves, the default), or the physics' state with the agent's and the block's "
        "velocities, the agent stepped exactly as the environment steps it (velocities), or "
        "that state with the arena's walls as inputs too (walls)",
    )
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=0.0,
        help="clip the gradient's norm to this (default 0: not clipped; the median norm is about 6 "
        "through rollouts of 8). Whatever it is, a training loss that stops being finite ends the run "
        "with an error and saves nothing",
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_data_arguments(parser)
    _add_training_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    parser.add_argument("--workers", type=int, default=2, help="recording processes (default 2)")
    parser.add_argument(
        "--data",
        type=Path,
        metavar="FILE",
        help="keep the recorded episodes here (.npz): a run finding the file trains on its episodes "
        "instead of recording them, if they were recorded with the same data options (refused "
        "otherwise); a run not finding it records and writes it",
    )
    parser.add_argument(
        "--seeds", type=parse_seeds, default=parse_seeds("0-99"), help="eval episode seeds (default 0-99)"
    )
    parser.add_argument(
        "--judge-candidates",
        type=int,
        default=8,
        metavar="N",
        help="also judge the model under N candidates like the planner's per eval seed, from the "
        "task's start toward its goal, against the environment (the report's `candidates`; default 8, "
        "0: not judged)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where to train: cpu or cuda (default cpu; the rollouts run on the CPU)",
    )
    parser.add_argument(
        "--save",
        type=Path,
        help="write the trained scene model here (.safetensors), for "
        "`streamworld eval pusht --plan --scene-model FILE`",
    )
    parser.add_argument(
        "--load",
        type=Path,
        metavar="FILE",
        help="score a scene model --save wrote instead of training one (the data and training options "
        "are then not used)",
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    for name in ("episodes", "steps_per_episode", "train_steps", "width", "workers", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= args.rollout_steps <= MAX_ROLLOUT:
        parser.error(f"--rollout-steps must be 1 to {MAX_ROLLOUT}")
    if not 0 <= args.candidate_share <= 1:
        parser.error("--candidate-share is a share from 0 to 1")
    if args.judge_candidates < 0:
        parser.error("--judge-candidates must be at least 0")
    if not args.max_grad_norm >= 0:
        parser.error("--max-grad-norm must be at least 0")
    if not args.train_minutes >= 0:
        parser.error("--train-minutes must be at least 0")
    if args.batch < args.rollout_steps:
        parser.error("--batch must be at least --rollout-steps (one rollout)")
    if args.steps_per_episode < args.rollout_steps + 2:
        parser.error("--steps-per-episode must be at least --rollout-steps + 2")
    for name in ("json", "save", "data"):
        path = getattr(args, name)
        if path and not path.parent.is_dir():
            parser.error(f"--{name}: the folder {path.parent} does not exist")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    try:
        report = run(args)
    except Diverged as error:
        parser.exit(1, f"pusht_state_dynamics.py: training diverged: {error}\n")
    print(json.dumps(report["horizons"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
