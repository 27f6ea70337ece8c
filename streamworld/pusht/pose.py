"""The block's whole pose (position and angle) and the agent's position, read from a frame.

`locate` (`pusht/world.py`) gives centroids; simulating what comes after a frame needs the
state the physics uses: the block body's position (where pymunk puts the body's origin,
the middle of the T's top edge) and its angle. `fit_block` fits the T to the frame's block
weight map:

1. the block's weighted centroid, from `locate`;
2. for every angle on a 3-degree grid, the body position that puts the T's area centroid
   on that centroid, scored by the squared difference between the T drawn with
   anti-aliased edges and the weight map, in a crop around the block;
3. a pattern search over (x, y, angle) around the best, halving the steps each round.

The drawing is analytic (signed distance to the T's two rectangles, a one-pixel ramp at
the edge), so no renderer is involved and poses between pixels are told apart. Pixels
the agent covers are left out: the agent is drawn over the block.
"""

from __future__ import annotations

import numpy as np

from .world import FPS, WORLD_SIZE, PushTWorld, Scene, _pixel_centres, locate, palette_weights

# The T of gym-pusht (`PushTEnv.add_tee`, scale 30, length 4), in body coordinates: a bar
# 120 x 30 with a 30 x 90 stem under it. A pose is the body's position (where its origin,
# the top edge's middle, is in the world) and its angle, as pymunk reports them.
_BAR = (-60.0, 60.0, 0.0, 30.0)  # x0, x1, y0, y1
_STEM = (-15.0, 15.0, 30.0, 120.0)
_AREA = 120.0 * 30.0 + 30.0 * 90.0
T_CENTROID_Y = (3600.0 * 15.0 + 2700.0 * 75.0) / _AREA  # the T's area centroid is (0, this)
_FILL = 0.6
# Fits of true frames have mismatches below 0.16 in 99% of frames and below 0.2 in 399 of 400
# (one reached 0.41; seeds 0-99 at h = 8-32); blocks the model has dissolved into a grey blob
# reach 0.45 and more, fitted at arbitrary angles, but blurred blobs also fit at 0.25-0.35
# with their angle far off, so evaluation counts a T only within 0.2
# (`evaluate.T_SHAPE_MISMATCH`). This looser bound decides which context blocks get a
# simulated training target.
MAX_MISMATCH = 0.35
# The most the scene moves in one control step, beyond which two fits are not one motion
# (world units, radians): the agent's target moves at most 35 units a step, plus jitter.
MAX_STEP = {"agent": 100.0, "block": 60.0, "turn": np.pi / 4}
_CROP = 28  # pixels at 64 px: the T reaches 77 world units (9.6 px) from its centre


def _box_distance(u: np.ndarray, v: np.ndarray, box: tuple[float, float, float, float]) -> np.ndarray:
    """Signed distance from points (u, v) to an axis-aligned box, negative inside."""
    x0, x1, y0, y1 = box
    cx, cy, hx, hy = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    dx, dy = np.abs(u - cx) - hx, np.abs(v - cy) - hy
    outside = np.hypot(np.maximum(dx, 0.0), np.maximum(dy, 0.0))
    return outside + np.minimum(np.maximum(dx, dy), 0.0)


def block_distance(block: tuple[float, float, float], points: np.ndarray) -> np.ndarray:
    """Signed distance (world units, negative inside) from world points [..., 2] to the T at
    pose `block` (x, y, angle)."""
    x, y, a = block
    c, s = np.cos(a), np.sin(a)
    dx, dy = points[..., 0] - x, points[..., 1] - y
    u, v = c * dx + s * dy, -s * dx + c * dy  # world to body: R(-a) (w - p)
    return np.minimum(_box_distance(u, v, _BAR), _box_distance(u, v, _STEM))


def block_corners(block: tuple[float, float, float]) -> np.ndarray:
    """[8, 2]: the corners of the T's bar and stem (world units) at pose `block` (x, y, angle)."""
    x, y, a = block
    c, s = np.cos(a), np.sin(a)
    u, v = np.array([(box[i], box[j]) for box in (_BAR, _STEM) for i in (0, 1) for j in (2, 3)]).T
    return np.stack([x + c * u - s * v, y + s * u + c * v], 1)  # body to world: p + R(a) (u, v)


def draw_block(poses: np.ndarray, xs: np.ndarray, ys: np.ndarray, unit: float) -> np.ndarray:
    """[N, *xs.shape]: how much of each pixel (centres xs, ys in world units, `unit` world
    units a pixel) the T covers at each pose (x, y, angle) of `poses` [N, 3]."""
    p = np.asarray(poses, np.float64)
    x, y, a = (p[:, i].reshape(-1, *([1] * xs.ndim)) for i in range(3))
    c, s = np.cos(a), np.sin(a)
    # World to body: (u, v) = R(-a) (w - p).
    dx, dy = xs - x, ys - y
    u = c * dx + s * dy
    v = -s * dx + c * dy
    distance = np.minimum(_box_distance(u, v, _BAR), _box_distance(u, v, _STEM))
    return np.clip(0.5 - distance / unit, 0.0, 1.0)


def _fit(
    target: np.ndarray, mask: np.ndarray, xs: np.ndarray, ys: np.ndarray, unit: float, centroid
) -> tuple[np.ndarray, float]:
    """The pose (x, y, angle) whose drawing best matches `target` where `mask` holds, and
    its squared error."""

    def errors(poses: np.ndarray) -> np.ndarray:
        return (((draw_block(poses, xs, ys, unit) - target) ** 2) * mask).sum(axis=(1, 2))

    angles = np.deg2rad(np.arange(0.0, 360.0, 3.0))
    c, s = np.cos(angles), np.sin(angles)
    # The body position that puts the T's area centroid (0, d) on `centroid`: minus R(a) (0, d).
    d = T_CENTROID_Y
    poses = np.stack([centroid[0] + s * d, centroid[1] - c * d, angles], 1)
    best = poses[int(np.argmin(errors(poses)))]
    step = np.array([unit / 2, unit / 2, np.deg2rad(1.5)])
    grid = np.stack(np.meshgrid(*[np.arange(-2, 3)] * 3, indexing="ij"), -1).reshape(-1, 3)
    for _ in range(5):
        poses = best + grid * step
        e = errors(poses)
        best, error = poses[int(np.argmin(e))], float(e.min())
        step = step / 2
    return best, error


def estimate_scene(frame: np.ndarray, max_mismatch: float = MAX_MISMATCH) -> Scene | None:
    """The agent's position and the block's pose (world units, radians in [0, 2 pi)) that
    a frame [H, W, 3] uint8 shows, or None where the agent or the block is not visible, or
    where the block is not T-shaped: the fitted T's squared error over the pixels the T
    covers (its mismatch, `fit_block`) above `max_mismatch`."""
    weights = palette_weights(frame)
    found = locate(frame, weights)
    if found.agent is None or found.block is None:
        return None
    pose, mismatch = _fit_block(weights, found.block)
    if mismatch > max_mismatch:
        return None
    unit = WORLD_SIZE / frame.shape[1]
    return Scene((found.agent[0] * unit, found.agent[1] * unit), pose)


def read_scene_row(frame: np.ndarray) -> np.ndarray:
    """[5]: what `estimate_scene` reads off a frame, as a row (agent x, y, block x, y, angle),
    with NaN for the agent or the block where it is not visible, and the block fitted
    whatever its mismatch."""
    weights = palette_weights(frame)
    found = locate(frame, weights)
    unit = WORLD_SIZE / frame.shape[1]
    agent = np.multiply(found.agent, unit) if found.agent is not None else [np.nan] * 2
    block = _fit_block(weights, found.block)[0] if found.block is not None else [np.nan] * 3
    return np.array([*agent, *block], np.float64)


def fit_block(frame: np.ndarray) -> tuple[tuple[float, float, float], float] | None:
    """The block's pose (x, y, angle) that best explains a frame, and the fit's mismatch (0
    for a perfect T), or None where no block is visible (`locate`)."""
    weights = palette_weights(frame)
    block = locate(frame, weights).block
    return None if block is None else _fit_block(weights, block)


def _fit_block(weights: np.ndarray, block: tuple[float, float]) -> tuple[tuple[float, float, float], float]:
    h, w, _ = weights.shape
    unit = WORLD_SIZE / w
    crop = round(_CROP * w / 64)
    centre = block
    for _ in range(2):  # the crop around locate's centroid, then around the crop's own
        x0 = int(np.clip(round(centre[0] - crop / 2), 0, w - crop))
        y0 = int(np.clip(round(centre[1] - crop / 2), 0, h - crop))
        rows, cols = slice(y0, y0 + crop), slice(x0, x0 + crop)
        ys, xs = _pixel_centres(h, w)[:, rows, cols]
        # The fill unmixes to about 0.67 of the block's colour and the outline to 1.
        target = np.minimum(weights[rows, cols, 2] / _FILL, 1.0)
        centre = ((target * xs).sum() / target.sum(), (target * ys).sum() / target.sum())
    mask = (weights[rows, cols, 3] < 0.1).astype(np.float64)
    centroid = (centre[0] * unit, centre[1] * unit)
    (x, y, angle), error = _fit(target, mask, xs * unit, ys * unit, unit, centroid)
    return (float(x), float(y), float(angle % (2 * np.pi))), error / (_AREA / unit**2)


def place(world: PushTWorld, scene: Scene, previous: Scene) -> None:
    """Put `world`'s bodies in `scene`, moving as they moved since `previous`, one control
    step (1 / FPS s) earlier: the agent's and the block's velocities are those differences."""
    env = world.env
    env.agent.position = scene.agent
    env.agent.velocity = tuple((np.subtract(scene.agent, previous.agent) * FPS).tolist())
    env.block.angle = scene.block[2]
    env.block.position = scene.block[:2]
    env.block.velocity = tuple((np.subtract(scene.block[:2], previous.block[:2]) * FPS).tolist())
    turn = (scene.block[2] - previous.block[2] + np.pi) % (2 * np.pi) - np.pi
    env.block.angular_velocity = float(turn * FPS)


def simulate(world: PushTWorld, scene: Scene, previous: Scene, actions) -> np.ndarray:
    """The frames [k, H, W, 3] uint8 `world` draws after each of `actions` [k, 2], started in
    `scene` moving as it moved since `previous` (`place`). A fresh space each time: pymunk
    carries contact impulses from step to step, and the result must not depend on what the
    world simulated before."""
    world.reset(0)
    place(world, scene, previous)
    return np.stack([world.step(a) for a in actions])


def draw_scene(world: PushTWorld, scene: Scene) -> np.ndarray:
    """The frame of `scene` at rest, drawn without a physics step."""
    place(world, scene, scene)
    for shape in world.env.space.shapes:  # the drawing reads the shapes' cached places
        shape.cache_bb()
    return world.render()


def _one_motion(previous: Scene, scene: Scene) -> bool:
    turn = abs((scene.block[2] - previous.block[2] + np.pi) % (2 * np.pi) - np.pi)
    return (
        np.hypot(*np.subtract(scene.agent, previous.agent)) <= MAX_STEP["agent"]
        and np.hypot(*np.subtract(scene.block[:2], previous.block[:2])) <= MAX_STEP["block"]
        and turn <= MAX_STEP["turn"]
    )


_WORLD: PushTWorld | None = None  # one environment per process: `process_world`


def process_world(size: int) -> PushTWorld:
    """This process's own environment for frames of `size` px, made (and reset) once and
    reused: for simulating or drawing placed scenes (`simulate`, `draw_scene`), never the
    real episode's environment, whose bodies those move."""
    global _WORLD
    if _WORLD is None or _WORLD.size != size:
        if _WORLD is not None:
            _WORLD.close()
        _WORLD = PushTWorld(size)
        _WORLD.reset(0)
    return _WORLD


def continue_frames(job: tuple) -> np.ndarray | None:
    """What the environment draws after a pair of frames: `job` is (the frame before,
    the frame, actions [k, 2]), and optionally the largest mismatch of a block that counts
    as a T (default `MAX_MISMATCH`); the result is k frames uint8 [k, H, W, 3], simulated from
    the scene the two frames show (`estimate_scene`, `place`). None where either frame
    does not show both the agent and a T-shaped block, or where the two scenes are further
    apart than one step can move them (`MAX_STEP`). One job per call, for process pools."""
    before, frame, actions, *rest = job
    limit = rest[0] if rest else MAX_MISMATCH
    scene, previous = estimate_scene(frame, limit), estimate_scene(before, limit)
    if scene is None or previous is None or not _one_motion(previous, scene):
        return None
    return simulate(process_world(frame.shape[0]), scene, previous, actions)
