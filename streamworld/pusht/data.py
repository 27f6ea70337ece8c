"""Recording PushT episodes for training: frames and actions, reproducible by seed.

Episode i of a data set with seed s starts from the environment's initial state for seed
`s * 1_000_003 + i + TRAIN_SEED_BASE` and is driven by `ScriptedPolicy` (pushing for
`push_share` of its moves, exploring at random otherwise; jumping its target for
`jump_share` of them) seeded the same way, or, for a `candidate_share` of the episodes
(drawn by the episode's seed), by `proposals.CandidatePolicy`, whose actions are drawn as
the planner draws its candidates. So any episode can be regenerated alone. Evaluation
uses seeds below `TRAIN_SEED_BASE`, so the two never share an initial state.

On disk a data set is a folder with `frames.npy` (uint8 [E, T + 1, S, S, 3]), `actions.npy`
(float32 [E, T, 2], world units; action t takes frame t to frame t + 1), `states.npy`
(float32 [E, T + 1, 5]: each frame's scene, the agent's x, y and the block's x, y, angle, in
world units and radians; data sets recorded before it have none) and `meta.json`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from .policy import PUSH_SHARE

TRAIN_SEED_BASE = 1_000_000
CANDIDATE_DRAW = 17  # mixed into an episode's seed to draw whether it records candidates
# What a training sample on the model's own rollout is taught to predict (`train.py:
# RolloutContext`): the recorded frames, or the environment continued from the scene the
# rollout shows (`pose.py: continue_frames`).
ROLLOUT_TARGETS = ("true", "simulated")
# The unrolled objective's error per pixel (`train.py: TrainConfig.unroll_loss`).
UNROLL_LOSSES = ("l2", "l1")
# What the state probe reads (`train.py: TrainConfig.state_target`): each frame's scene
# (`state_probe.state_targets`) or its change since the frame before its chunk (`change_targets`).
STATE_TARGETS = ("scene", "change")


@dataclass(frozen=True)
class DatasetSpec:
    episodes: int
    steps: int  # actions per episode (frames = steps + 1)
    size: int = 64
    seed: int = 0
    push_share: float = PUSH_SHARE  # of the scripted policy's moves that push the block
    jump_share: float = 0.0  # of its moves whose target jumps and is held (`ScriptedPolicy`)
    candidate_share: float = 0.0  # of the episodes driven by `proposals.CandidatePolicy`

    def __post_init__(self) -> None:
        for name in ("push_share", "jump_share", "candidate_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a share in [0, 1], not {getattr(self, name)}")

    def episode_seed(self, index: int) -> int:
        return self.seed * 1_000_003 + index + TRAIN_SEED_BASE

    def policy(self, index: int):
        """Episode `index`'s policy, seeded by the episode: `CandidatePolicy` for a
        `candidate_share` of the episodes, `ScriptedPolicy` for the rest. The draw is made
        only when the share is above 0, so data sets without it record what they always did."""
        from .policy import ScriptedPolicy
        from .proposals import CandidatePolicy

        seed = self.episode_seed(index)
        share = self.candidate_share
        if share > 0 and np.random.default_rng([seed, CANDIDATE_DRAW]).random() < share:
            return CandidatePolicy(seed)
        return ScriptedPolicy(seed, self.push_share, self.jump_share)


def record_episode(env_seed: int, policy, steps: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(frames [steps + 1, size, size, 3] uint8, actions [steps, 2] float32, scenes
    [steps + 1, 5] float32 (`scene_row`)) of one episode from the environment's start for
    `env_seed`, each action `policy(scene)`."""
    from .world import PushTWorld

    world = PushTWorld(size)
    frames = np.empty((steps + 1, size, size, 3), np.uint8)
    actions = np.empty((steps, 2), np.float32)
    states = np.empty((steps + 1, 5), np.float32)
    frames[0] = world.reset(env_seed)
    states[0] = scene_row(world.scene)
    for t in range(steps):
        actions[t] = policy(world.scene)
        frames[t + 1] = world.step(actions[t])
        states[t + 1] = scene_row(world.scene)
    world.close()
    return frames, actions, states


def scene_row(scene) -> list[float]:
    """A `world.Scene` as one row of `states.npy`: agent x, y, block x, y, angle."""
    return [*scene.agent, *scene.block]


def _record(args: tuple[int, DatasetSpec]) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    index, spec = args
    return index, *record_episode(spec.episode_seed(index), spec.policy(index), spec.steps, spec.size)


def generate_dataset(
    spec: DatasetSpec, out: str | Path, workers: int | None = None, progress: bool = True
) -> Path:
    """Record `spec.episodes` episodes into the folder `out` (created; existing files are replaced)."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frames = np.lib.format.open_memmap(
        out / "frames.npy.partial",
        mode="w+",
        dtype=np.uint8,
        shape=(spec.episodes, spec.steps + 1, spec.size, spec.size, 3),
    )
    actions = np.empty((spec.episodes, spec.steps, 2), np.float32)
    states = np.empty((spec.episodes, spec.steps + 1, 5), np.float32)
    workers = workers or max(1, min(os.cpu_count() or 1, 32))
    start = time.perf_counter()
    jobs = [(i, spec) for i in range(spec.episodes)]
    bar = tqdm(total=spec.episodes, desc="recording PushT episodes", unit="episode", disable=not progress)
    if workers == 1:
        results = map(_record, jobs)
        pool = None
    else:
        pool = mp.get_context("spawn").Pool(workers)
        results = pool.imap_unordered(_record, jobs, chunksize=4)
    try:
        for index, f, a, st in results:
            frames[index] = f
            actions[index] = a
            states[index] = st
            bar.update()
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    frames.flush()
    del frames
    np.save(out / "actions.npy", actions)
    np.save(out / "states.npy", states)
    os.replace(out / "frames.npy.partial", out / "frames.npy")
    meta = {**asdict(spec), "seconds": round(time.perf_counter() - start, 1), "seed_base": TRAIN_SEED_BASE}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


@dataclass
class Dataset:
    frames: np.ndarray  # uint8 [E, T + 1, S, S, 3] (memory-mapped)
    actions: np.ndarray  # float32 [E, T, 2]
    spec: DatasetSpec
    states: np.ndarray | None = None  # float32 [E, T + 1, 5] (`scene_row`); None if not recorded

    @classmethod
    def load(cls, folder: str | Path) -> Dataset:
        folder = Path(folder)
        meta_path = folder / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{folder} holds no PushT data set (no meta.json); record one with --episodes"
            )
        meta = json.loads(meta_path.read_text())
        # The spec's fields as recorded; a field added since (push_share, jump_share) takes
        # its default, which is what data recorded before it was made with.
        spec = DatasetSpec(**{f.name: meta[f.name] for f in fields(DatasetSpec) if f.name in meta})
        frames = np.load(folder / "frames.npy", mmap_mode="r")
        actions = np.load(folder / "actions.npy")
        if frames.shape != (spec.episodes, spec.steps + 1, spec.size, spec.size, 3) or actions.shape != (
            spec.episodes,
            spec.steps,
            2,
        ):
            raise ValueError(f"{folder}: array shapes {frames.shape}, {actions.shape} do not match meta.json")
        states = np.load(folder / "states.npy") if (folder / "states.npy").is_file() else None
        if states is not None and states.shape != (spec.episodes, spec.steps + 1, 5):
            raise ValueError(
                f"{folder}: states.npy is {states.shape}, not {(spec.episodes, spec.steps + 1, 5)}"
            )
        return cls(frames, actions, spec, states)
