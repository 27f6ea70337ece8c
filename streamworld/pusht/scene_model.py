"""A PushT model of the scene instead of the frames: a small network that steps the agent's
place and the block's pose forward under an action, and rollouts for the planner drawn from
the scenes it predicts.

It is the dynamics half of a world model that carries the block's pose (docs/pusht.md,
"Learning the pushes is what is hard, not drawing them"). `benchmarks/pusht_state_dynamics.py`
trains it, one step ahead or through rollouts, and writes it with `--save`;
`streamworld eval pusht --plan --scene-model FILE` (or `shipped`, `SHIPPED`) plans with it
in the world model's place, starting each plan from the scene `pose.estimate_scene` reads
off the observed frame, at rest, as the world model starts each plan from that frame alone.

Three kinds of model (`KINDS`), all seeing each step in the block's own frame (so a push
looks the same wherever the block is):

- `moves` (the first kind): the state is the scene [N, 5]; a step's input is the agent's
  place and last move and the action's target, and the output is one step's change of the
  block's pose (in that frame) and of the agent's place (`features`, `targets`, `apply`).
- `velocities`: the state is the physics' own, [N, 10] (`state_row`): the scene, the
  agent's velocity and the block's velocity and spin. The agent is a kinematic body that
  nothing pushes back, so its step is computed exactly as the environment computes it
  (`agent_step`); the network predicts the block's change of pose and the velocity it is
  left with, which the environment carries into the next step's first substep
  (`velocity_features`, `velocity_targets`, `velocity_apply`). Given that state, a step's
  outcome is nearly determined (docs/pusht.md); given the scene and its last move alone,
  it is not.
- `walls`: the `velocities` kind that also sees how near the arena's four walls are
  (`wall_features`). Seen from the block alone, a push into a wall looks like a push in
  the open, and most of the other kinds' error under the planner's candidates is there.

The scene functions take NumPy arrays and tensors alike.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .data import scene_row
from .pose import block_corners, draw_scene, estimate_scene, process_world
from .world import WORLD_SIZE, PushTWorld, Scene

INPUTS, OUTPUTS = 8, 5  # the `moves` kind's; also a scene's columns
KINDS = ("moves", "velocities", "walls")
STATE_COLUMNS = {"moves": 5, "velocities": 10, "walls": 10}
VELOCITY_INPUTS, VELOCITY_OUTPUTS = 11, 6
WALL_INPUTS = 12
# The arena's walls: gym-pusht's segments at 5 and 506 world units, 2 units thick, so the
# block meets their faces at 7 and 504. A wall further than WALL_REACH from the block's
# origin cannot touch the T within a step: its farthest point is 121 units from the origin,
# and a step moves the block less than 60 (`pose.MAX_STEP`).
WALL_FACES, WALL_REACH = (7.0, 504.0), 200.0
# gym-pusht's control: each 0.1-s step is 10 substeps of 0.01 s, in each of which the PD
# control sets the agent's velocity and the physics moves it (a test holds these to it).
K_P, K_V, SUBSTEPS, DT = 100.0, 20.0, 10, 0.01
FORMAT = "streamworld-pusht-scene-model/1"
MAX_FILE_BYTES = 16 << 20  # a width-256 model is about 0.6 MB
MAX_WIDTH = 1024
# The scene model the package ships (`eval --plan --scene-model shipped`): a `walls` model,
# width 256, trained through rollouts of 8 on 4,500 episodes drawn like the planner's
# candidates (docs/pusht.md, "The arena's walls"; its metadata holds the options).
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "weights" / "pusht-scene.safetensors"


def _xp(a):
    """The array library of `a`: NumPy for arrays, torch for tensors."""
    return torch if isinstance(a, torch.Tensor) else np


def _rotate(x, y, angle):
    xp = _xp(angle)
    c, s = xp.cos(angle), xp.sin(angle)
    return c * x + s * y, -s * x + c * y  # into a frame turned by `angle`


def _length(x, y):
    """hypot(x, y), for tensors with a gradient of 0 where both are 0 (hypot's is NaN there,
    and a predicted move below float32's resolution is exactly 0)."""
    if _xp(x) is np:
        return np.hypot(x, y)
    squared = x * x + y * y
    some = squared > 0
    return torch.where(some, torch.sqrt(torch.where(some, squared, torch.ones_like(squared))), 0.0)


def features(before, now, action):
    """[N, 8]: the agent's place and last step's move, and the action's target, in the
    block's frame (world units / 100), and the block's last turn (radians)."""
    xp = _xp(now)
    bx, by, ba = now[:, 2], now[:, 3], now[:, 4]
    ax, ay = _rotate(now[:, 0] - bx, now[:, 1] - by, ba)
    vx, vy = _rotate(now[:, 0] - before[:, 0], now[:, 1] - before[:, 1], ba)
    tx, ty = _rotate(action[:, 0] - bx, action[:, 1] - by, ba)
    turn = (now[:, 4] - before[:, 4] + math.pi) % (2 * math.pi) - math.pi
    moved = _length(now[:, 2] - before[:, 2], now[:, 3] - before[:, 3])  # the block's last move
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


def state_row(world: PushTWorld) -> list[float]:
    """The physics' state of `world` as one row of the `velocities` kind: the scene
    (`data.scene_row`), the agent's velocity, the block's velocity and its spin (world units
    and radians per second)."""
    env = world.env
    return [*scene_row(world.scene), *env.agent.velocity, *env.block.velocity, env.block.angular_velocity]


def _agent_coefficients() -> tuple[float, ...]:
    """The agent's step as a linear map: its place and velocity after one step are
    `p * place + v * velocity + t * target` for the (p, v, t) of each, found by running the
    environment's substeps on one unit at a time."""
    out = []
    for unit in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)):
        place, velocity, target = unit
        for _ in range(SUBSTEPS):
            velocity = velocity + (K_P * (target - place) + K_V * (0 - velocity)) * DT
            place = place + velocity * DT
        out.append((place, velocity))
    (pp, vp), (pv, vv), (pt, vt) = out
    return pp, pv, pt, vp, vv, vt


_AGENT = _agent_coefficients()


def agent_step(place, velocity, action):
    """The agent's place and velocity [N, 2] after one step toward `action` [N, 2] (clipped
    to the world, as `PushTWorld.advance` clips it): the environment's substeps, a linear
    map of the three (equal to its numbers to float64's rounding)."""
    pp, pv, pt, vp, vv, vt = _AGENT
    target = _xp(place).clip(action, 0.0, WORLD_SIZE)
    return pp * place + pv * velocity + pt * target, vp * place + vv * velocity + vt * target


def velocity_features(now, action):
    """[N, 11]: the `velocities` kind's input, in the block's frame: the agent's place, its
    velocity, the action's target and the agent's place after the step (world units / 100;
    velocities / 1000), and the block's velocity (/ 1000) and spin (/ 10)."""
    xp = _xp(now)
    bx, by, ba = now[:, 2], now[:, 3], now[:, 4]
    end, _ = agent_step(now[:, 0:2], now[:, 5:7], action)
    ax, ay = _rotate(now[:, 0] - bx, now[:, 1] - by, ba)
    avx, avy = _rotate(now[:, 5], now[:, 6], ba)
    target = xp.clip(action, 0.0, WORLD_SIZE)
    tx, ty = _rotate(target[:, 0] - bx, target[:, 1] - by, ba)
    ex, ey = _rotate(end[:, 0] - bx, end[:, 1] - by, ba)
    bvx, bvy = _rotate(now[:, 7], now[:, 8], ba)
    columns = [ax / 100, ay / 100, avx / 1000, avy / 1000, tx / 100, ty / 100, ex / 100, ey / 100]
    return xp.stack([*columns, bvx / 1000, bvy / 1000, now[:, 9] / 10], 1)


def wall_features(now):
    """[N, 12]: the `walls` kind's extra input, how near each of the arena's four walls is,
    in the block's frame: per wall, its closeness (1 with its face at the block's origin,
    0 at `WALL_REACH` and beyond) and that closeness times the direction toward it. A block
    far from every wall sees zeros, so away from the walls a push still looks the same
    wherever the block is."""
    xp = _xp(now)
    bx, by, ba = now[:, 2], now[:, 3], now[:, 4]
    low, high = WALL_FACES
    columns = []
    walls = ((bx - low, -1.0, 0.0), (high - bx, 1.0, 0.0), (by - low, 0.0, -1.0), (high - by, 0.0, 1.0))
    for gap, dx, dy in walls:  # the gap to each wall's face and the direction toward it
        near = (1 - gap / WALL_REACH).clip(0.0, 1.0)
        nx, ny = _rotate(dx, dy, ba)
        columns += [near, near * nx, near * ny]
    return xp.stack(columns, 1)


def wall_gap(block: tuple[float, float, float]) -> float:
    """How far (world units) the T at pose `block` (x, y, angle) is from the nearest wall's
    face: negative where it presses into one."""
    corners, (low, high) = block_corners(block), WALL_FACES
    return float(min(corners.min() - low, high - corners.max()))


def velocity_targets(now, after):
    """[N, 6]: one step's change of the block's pose (`targets`' first three) and the
    block's velocity (/ 100, in `now`'s block frame) and spin after it."""
    bvx, bvy = _rotate(after[:, 7], after[:, 8], now[:, 4])
    pose = targets(now, after)
    return _xp(now).stack([pose[:, 0], pose[:, 1], pose[:, 2], bvx / 100, bvy / 100, after[:, 9]], 1)


def velocity_apply(now, change, action):
    """The state [N, 10] after `change` (`velocity_targets`' units) from `now` under
    `action`: the agent stepped exactly (`agent_step`), the block by the change."""
    xp = _xp(now)
    place, velocity = agent_step(now[:, 0:2], now[:, 5:7], action)
    c, s = xp.cos(now[:, 4]), xp.sin(now[:, 4])
    dbx, dby, turn, bvx, bvy, spin = (change[:, k] for k in range(VELOCITY_OUTPUTS))
    block = [now[:, 2] + c * dbx - s * dby, now[:, 3] + s * dbx + c * dby, now[:, 4] + turn / 100]
    block_velocity = [(c * bvx - s * bvy) * 100, (s * bvx + c * bvy) * 100]
    return xp.stack(
        [place[:, 0], place[:, 1], *block, velocity[:, 0], velocity[:, 1], *block_velocity, spin], 1
    )


def draw_scenes(world: PushTWorld, scenes: np.ndarray) -> np.ndarray:
    """Frames [N, H, W, 3] uint8 of scenes [N, 5] (agent x, y, block x, y, angle), each
    drawn at rest on `world` (`pose.draw_scene`)."""
    return np.stack([draw_scene(world, Scene((r[0], r[1]), (r[2], r[3], r[4]))) for r in scenes.tolist()])


class SceneModel(nn.Module):
    """The network (three hidden layers of `width`, SiLU) and the scale of its targets: it
    predicts each change divided by `scale` (the changes' standard deviation in its training
    data). `kind` (`KINDS`) is the state it steps: the scene alone (`moves`) or the physics'
    state with the velocities (`velocities`)."""

    def __init__(self, width: int = 256, scale: torch.Tensor | None = None, kind: str = "moves") -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown scene model kind {kind!r}, expected one of {KINDS}")
        self.width, self.kind = width, kind
        inputs, outputs = {
            "moves": (INPUTS, OUTPUTS),
            "velocities": (VELOCITY_INPUTS, VELOCITY_OUTPUTS),
            "walls": (VELOCITY_INPUTS + WALL_INPUTS, VELOCITY_OUTPUTS),
        }[kind]
        self.net = nn.Sequential(
            nn.Linear(inputs, width),
            nn.SiLU(),
            nn.Linear(width, width),
            nn.SiLU(),
            nn.Linear(width, width),
            nn.SiLU(),
            nn.Linear(width, outputs),
        )
        self.register_buffer("scale", torch.ones(outputs) if scale is None else scale.float().clone())
        self.metadata: dict[str, str] = {}  # what the file it was loaded from says about it

    @property
    def columns(self) -> int:
        """A state's columns: 5 (the scene) or 10 (with the velocities)."""
        return STATE_COLUMNS[self.kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The predicted changes, divided by `scale` (what the objective compares)."""
        return self.net(x)

    def inputs(self, before, now, action):
        """The network's input for a step from `now` (after `before`, which only the `moves`
        kind reads) under `action`."""
        if self.kind == "moves":
            return features(before, now, action)
        if self.kind == "velocities":
            return velocity_features(now, action)
        return _xp(now).concatenate([velocity_features(now, action), wall_features(now)], 1)

    def changes(self, now, after):
        """The network's target for the step from `now` to `after` (in the data's units,
        not divided by `scale`)."""
        return targets(now, after) if self.kind == "moves" else velocity_targets(now, after)

    def errors(self, true: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
        """[N, outputs]: how far predicted states are from true ones, in the network's
        units (divided by `scale`): the change that takes the true scene to the predicted
        one, and for `velocities` the block's velocity and spin off (the agent's, being
        exact, are not scored)."""
        if self.kind == "moves":
            return targets(true, predicted) / self.scale
        pose = targets(true[:, :5], predicted[:, :5])
        vx, vy = _rotate(predicted[:, 7] - true[:, 7], predicted[:, 8] - true[:, 8], true[:, 4])
        off = torch.stack(
            [pose[:, 0], pose[:, 1], pose[:, 2], vx / 100, vy / 100, predicted[:, 9] - true[:, 9]], 1
        )
        return off / self.scale

    def step(self, before: torch.Tensor, now: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The next states [N, columns] (differentiable: training through rollouts calls this)."""
        return self.after(now, self.net(self.inputs(before, now, action)) * self.scale, action)

    def after(self, now, change, action):
        """The state a step from `now` under `action` reaches with `change` (in the data's
        units): `apply` or `velocity_apply`."""
        return apply(now, change) if self.kind == "moves" else velocity_apply(now, change, action)

    @torch.no_grad()
    def roll_out(self, start: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """Scenes [N, H, 5] predicted from `start` [N, 5] (at rest) under `actions` [N, H, 2],
        stepped in float64 as the environment's scenes are."""
        start = np.asarray(start, np.float64)
        before = now = np.concatenate([start, np.zeros((len(start), self.columns - OUTPUTS))], 1)
        out = np.empty((*actions.shape[:2], OUTPUTS), np.float64)
        dtype, device = self.scale.dtype, self.scale.device
        for h in range(actions.shape[1]):
            action = actions[:, h].astype(np.float64)
            x = torch.as_tensor(self.inputs(before, now, action), dtype=dtype, device=device)
            change = (self.net(x) * self.scale).double().cpu().numpy()
            before, now = now, self.after(now, change, action)
            out[:, h] = now[:, :OUTPUTS]
        return out

    def save(self, path: Path, metadata: dict | None = None) -> None:
        """Write the model, with `metadata` (how it was trained; values kept as text) that
        `load` gives back as `self.metadata`."""
        import safetensors.torch

        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        meta = {
            **{k: str(v) for k, v in (metadata or {}).items()},
            "format": FORMAT,
            "width": str(self.width),
            "kind": self.kind,
        }
        safetensors.torch.save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path) -> SceneModel:
        """A model `save` wrote; ValueError naming the file and what is wrong otherwise."""
        import safetensors

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(
                f"{path}: {path.stat().st_size} bytes, more than a scene model's {MAX_FILE_BYTES}"
            )
        try:
            with safetensors.safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iteration
        except Exception as e:  # safetensors' errors share no base class
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{path}: not a scene model (format {meta.get('format')!r}, expected {FORMAT!r})"
            )
        try:
            width = int(meta["width"])
        except (KeyError, ValueError):
            raise ValueError(f"{path}: the metadata has no width") from None
        if not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"{path}: width {width}, expected 1 to {MAX_WIDTH}")
        kind = meta.get("kind", "moves")  # files from before the kinds are `moves`
        if kind not in KINDS:
            raise ValueError(f"{path}: unknown kind {kind!r}, expected one of {KINDS}")
        model = cls(width, kind=kind)
        try:
            model.load_state_dict(tensors)
        except RuntimeError as e:
            raise ValueError(f"{path}: the tensors do not fit a width-{width} scene model ({e})") from None
        model.metadata = {k: v for k, v in meta.items() if k != "format"}
        return model.eval()


class SceneModelRollouts:
    """The planner's rollouts (`planning.Rollouts`) from a `SceneModel`: each candidate's
    scenes are predicted from the scene the observed frame shows (`pose.estimate_scene`, at
    rest) and drawn as the environment draws a scene at rest, so the planner's cost reads
    them as it reads the world model's frames. Where the observed frame shows no T to read
    (`unread`), every candidate is the observed frame unchanged, so the plan's search
    learns nothing and its mean stands.

    Drawing, not the model, is what a plan's time goes to, so only the frames something
    reads are drawn: with `every_frame` False, each candidate's last frame alone, frames
    [K, 1, S, S, 3], which is all a cost on the last frame reads (`cost_frames="last"`
    without `replan_error`); with True (the default), all H of them.

    With `poses=True` nothing is drawn: the predicted poses [K, H, 5] are the answer, for
    `planning.PoseCost` (NaN where the observed frame shows no T, which that cost scores
    alike for every candidate)."""

    def __init__(
        self, model: SceneModel, frame: np.ndarray, every_frame: bool = True, poses: bool = False
    ) -> None:
        self.model = model
        self.frame = frame
        self.every_frame = every_frame
        self.poses = poses
        self.scene = estimate_scene(frame)

    @property
    def unread(self) -> bool:
        return self.scene is None

    async def __call__(self, candidates: np.ndarray) -> np.ndarray:
        k, h = candidates.shape[:2]
        drawn = h if self.every_frame else 1
        if self.scene is None:
            if self.poses:
                return np.full((k, h, OUTPUTS), np.nan)
            return np.broadcast_to(self.frame, (k, drawn, *self.frame.shape)).copy()
        start = np.broadcast_to(np.array(scene_row(self.scene), np.float64), (k, OUTPUTS))
        if self.poses:
            return self.model.roll_out(start, candidates)
        scenes = self.model.roll_out(start, candidates)[:, h - drawn :]
        world = process_world(self.frame.shape[1])
        out = np.empty((k, drawn, *self.frame.shape), np.uint8)
        for i in range(k):
            out[i] = draw_scenes(world, scenes[i])
            await asyncio.sleep(0)  # milliseconds of drawing per candidate: let the event loop breathe
        return out
