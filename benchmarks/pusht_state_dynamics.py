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
step ahead and 8 through rollouts of 8 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamworld.pusht.data import PUSH_SHARE, DatasetSpec, scene_row
from streamworld.pusht.evaluate import block_scores, block_summary, parse_seeds, record_eval_episode
from streamworld.pusht.pose import draw_scene
from streamworld.pusht.world import PushTWorld, Scene

HORIZONS = (8, 16, 24, 32)
SIZE = 64
INPUTS, OUTPUTS = 8, 5
BATCH = 1024  # samples per training step: scenes, or rollout steps
MAX_ROLLOUT = 32


def record_scenes(args: tuple[int, DatasetSpec]) -> tuple[np.ndarray, np.ndarray]:
    """One training episode's scenes [steps + 1, 5] and actions [steps, 2], the frames not
    drawn (the same seeds and policy as `data.record_episode`)."""
    from streamworld.pusht.policy import ScriptedPolicy

    index, spec = args
    seed = spec.episode_seed(index)
    world = PushTWorld(SIZE)
    policy = ScriptedPolicy(seed, spec.push_share, spec.jump_share)
    world.reset(seed)
    scenes, actions = [scene_row(world.scene)], []
    for _ in range(spec.steps):
        actions.append(policy(world.scene))
        world.advance(actions[-1])
        scenes.append(scene_row(world.scene))
    world.close()
    return np.asarray(scenes, np.float64), np.asarray(actions, np.float64)


def _xp(a):
    """The array library of `a`: the scene functions below take NumPy arrays (rollouts) and
    tensors (training through rollouts) alike."""
    return torch if isinstance(a, torch.Tensor) else np


def _rotate(x, y, angle):
    xp = _xp(angle)
    c, s = xp.cos(angle), xp.sin(angle)
    return c * x + s * y, -s * x + c * y  # into a frame turned by `angle`


def features(before, now, action):
    """[N, 8]: the agent's place and last step's move, and the action's target, in the
    block's frame (world units / 100), and the block's last turn (radians)."""
    xp = _xp(now)
    bx, by, ba = now[:, 2], now[:, 3], now[:, 4]
    ax, ay = _rotate(now[:, 0] - bx, now[:, 1] - by, ba)
    vx, vy = _rotate(now[:, 0] - before[:, 0], now[:, 1] - before[:, 1], ba)
    tx, ty = _rotate(action[:, 0] - bx, action[:, 1] - by, ba)
    turn = (now[:, 4] - before[:, 4] + math.pi) % (2 * math.pi) - math.pi
    moved = xp.hypot(now[:, 2] - before[:, 2], now[:, 3] - before[:, 3])  # the block's last move
    return xp.stack([ax / 100, ay / 100, vx / 10, vy / 10, tx / 100, ty / 100, moved / 10, turn * 10], 1)


def targets(now, after):
    """[N, 5]: one step's change of the block (x, y in its frame, world units; turn, in
    centiradians) and of the agent (in the block's frame), scaled to about unit size."""
    ba = now[:, 4]
    dbx, dby = _rotate(after[:, 2] - now[:, 2], after[:, 3] - now[:, 3], ba)
    dax, day = _rotate(after[:, 0] - now[:, 0], after[:, 1] - now[:, 1], ba)
    turn = (after[:, 4] - now[:, 4] + math.pi) % (2 * math.pi) - math.pi
    return _xp(now).stack([dbx, dby, turn * 100, dax / 10, day / 10], 1)


def apply(now, change):
    """The scene after `change` (`targets`' units) from `now` [N, 5]."""
    xp = _xp(now)
    c, s = xp.cos(now[:, 4]), xp.sin(now[:, 4])
    dbx, dby, turn, dax, day = (change[:, k] for k in range(5))
    return xp.stack(
        [
            now[:, 0] + (c * dax - s * day) * 10,
            now[:, 1] + (s * dax + c * day) * 10,
            now[:, 2] + c * dbx - s * dby,
            now[:, 3] + s * dbx + c * dby,
            now[:, 4] + turn / 100,
        ],
        1,
    )


def make_net(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(INPUTS, width),
        nn.SiLU(),
        nn.Linear(width, width),
        nn.SiLU(),
        nn.Linear(width, width),
        nn.SiLU(),
        nn.Linear(width, OUTPUTS),
    )


def rollout_loss(net: nn.Module, scale: torch.Tensor, episodes, taken, k: int, gen) -> torch.Tensor:
    """The objective over rollouts: `BATCH // k` rollouts of k steps, each from a true scene
    (and the one before it) under the episode's actions, scored at every step by the
    change that would take the true scene to the predicted one (`targets`, scaled)."""
    n, last = BATCH // k, episodes.shape[1] - k  # starts 1 .. steps - k
    e = torch.randint(0, episodes.shape[0], (n,), generator=gen)
    t = torch.randint(1, last, (n,), generator=gen)
    before, now, loss = episodes[e, t - 1], episodes[e, t], 0.0
    for j in range(k):
        change = net(features(before, now, taken[e, t + j])) * scale
        before, now = now, apply(now, change)
        loss = loss + ((targets(episodes[e, t + j + 1], now) / scale) ** 2).mean()
    return loss / k


def train(
    scenes: list[np.ndarray],
    actions: list[np.ndarray],
    steps: int,
    width: int,
    seed: int,
    progress: bool,
    rollout_steps: int = 1,
):
    """The scene model, trained one step ahead (`rollout_steps` 1) or through rollouts of
    that many steps (`rollout_loss`)."""
    from tqdm import tqdm

    episodes = torch.tensor(np.stack(scenes), dtype=torch.float32)  # [E, steps + 1, 5]
    taken = torch.tensor(np.stack(actions), dtype=torch.float32)  # [E, steps, 2]

    x, y = [], []
    for s, a in zip(scenes, actions, strict=True):
        before = np.concatenate([s[:1], s[:-2]])  # the first step has no move before it
        x.append(features(before, s[:-1], a))
        y.append(targets(s[:-1], s[1:]))
    x_all = torch.tensor(np.concatenate(x), dtype=torch.float32)
    y_all = torch.tensor(np.concatenate(y), dtype=torch.float32)
    scale = y_all.std(0).clamp_min(1e-3)
    torch.manual_seed(seed)
    net = make_net(width)
    peak, warm = 2e-3, max(1, steps // 20)
    opt = torch.optim.AdamW(net.parameters(), lr=peak, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in tqdm(range(steps), desc="training the scene model", unit="step", disable=not progress):
        for group in opt.param_groups:  # linear warm-up, then a cosine to zero
            group["lr"] = peak * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        if rollout_steps == 1:
            i = torch.randint(0, len(x_all), (BATCH,), generator=gen)
            loss = ((net(x_all[i]) - y_all[i] / scale) ** 2).mean()
        else:
            loss = rollout_loss(net, scale, episodes, taken, rollout_steps, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    net.eval()
    return net, scale, float(np.mean(losses[-200:])), len(x_all)


def roll_out(net: nn.Module, scale: torch.Tensor, start: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """Scenes [len(actions), 5] predicted from `start` (at rest) under `actions`."""
    before, now, out = start[None], start[None], []
    with torch.no_grad():
        for a in actions:
            change = net(torch.tensor(features(before, now, a[None]), dtype=torch.float32)) * scale
            before, now = now, apply(now, change.numpy().astype(np.float64))
            out.append(now[0])
    return np.stack(out)


def record(spec: DatasetSpec, workers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every training episode's (scenes, actions), in `workers` processes."""
    from tqdm import tqdm

    jobs = [(i, spec) for i in range(spec.episodes)]
    if workers == 1:
        return [record_scenes(job) for job in tqdm(jobs, desc="recording scenes", unit="episode")]
    with mp.get_context("spawn").Pool(workers) as pool:
        found = pool.imap(record_scenes, jobs, chunksize=8)
        return list(tqdm(found, total=len(jobs), desc="recording scenes", unit="episode"))


def score_rollouts(net: nn.Module, scale: torch.Tensor, seeds: list[int]) -> list[dict]:
    """Per eval seed, `evaluate.block_scores` of the scenes rolled out from its exact start,
    drawn by the environment."""
    from tqdm import tqdm

    world = PushTWorld(SIZE)
    rows = []
    for seed in tqdm(seeds, desc="rolling out", unit="seed"):
        ep = record_eval_episode(seed, max(HORIZONS), SIZE)
        world.reset(seed)
        start = np.asarray(scene_row(world.scene), np.float64)
        pred = roll_out(net, scale, start, ep.actions.astype(np.float64))
        world.reset(0)
        scenes = [Scene((r[0], r[1]), (r[2], r[3], r[4])) for r in pred.tolist()]
        rows.append(block_scores(np.stack([draw_scene(world, c) for c in scenes]), ep, HORIZONS))
    world.close()
    return rows


def run(args: argparse.Namespace) -> dict:
    spec = DatasetSpec(args.episodes, args.steps_per_episode, SIZE, args.data_seed, args.push_share)
    started = time.perf_counter()
    recorded = record(spec, args.workers)
    record_seconds = time.perf_counter() - started
    net, scale, loss, samples = train(
        [s for s, _ in recorded],
        [a for _, a in recorded],
        args.train_steps,
        args.width,
        args.seed,
        True,
        args.rollout_steps,
    )
    train_seconds = time.perf_counter() - started - record_seconds
    rows = score_rollouts(net, scale, args.seeds)
    return {
        "benchmark": "pusht_state_dynamics",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "data": {
            "episodes": spec.episodes,
            "steps": spec.steps,
            "seed": spec.seed,
            "push_share": spec.push_share,
        },
        "model": {
            "width": args.width,
            "train_steps": args.train_steps,
            "rollout_steps": args.rollout_steps,
            "samples": samples,
            "final_loss": round(loss, 5),
        },
        "seeds": [args.seeds[0], args.seeds[-1], len(args.seeds)],
        "seconds": {"record": round(record_seconds, 1), "train": round(train_seconds, 1)},
        "horizons": block_summary(rows, HORIZONS),
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        "--train-steps", type=int, default=20000, help="training steps of 1024 samples (default 20000)"
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
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    parser.add_argument("--workers", type=int, default=2, help="recording processes (default 2)")
    parser.add_argument(
        "--seeds", type=parse_seeds, default=parse_seeds("0-99"), help="eval episode seeds (default 0-99)"
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    for name in ("episodes", "steps_per_episode", "train_steps", "width", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= args.rollout_steps <= MAX_ROLLOUT:
        parser.error(f"--rollout-steps must be 1 to {MAX_ROLLOUT}")
    if args.steps_per_episode < args.rollout_steps + 2:
        parser.error("--steps-per-episode must be at least --rollout-steps + 2")
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json: the folder {args.json.parent} does not exist")
    report = run(args)
    print(json.dumps(report["horizons"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
