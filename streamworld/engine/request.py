"""What a caller asks of the engine: a stream request, its priority class and action
policy, the admission errors, and the one validation that the engine and the reference
generator share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models.config import ModelConfig

PRIORITY_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}
# hold: frames past the known actions repeat the last one; wait: a chunk starts only once
# the actions of all its frames are known.
ACTION_POLICIES = ("hold", "wait")
# Chunks one stream may ask for; None asks for an open-ended stream. The wire protocol
# (server/protocol.py) holds the same bound.
MAX_NUM_CHUNKS = 10**6


class Overloaded(RuntimeError):
    """The admission queue is full."""


class Unsupported(ValueError):
    """The request can never be served here (e.g. its K/V never fits the pool)."""


class StreamError(RuntimeError):
    """The stream ended with an error."""


@dataclass
class StreamRequest:
    seed: int
    num_chunks: int | None = None  # None: until cancelled
    prompt: str = ""
    image: np.ndarray | None = None  # [H, W, 3] uint8, frame 0 of image-to-world models
    actions: np.ndarray | None = None  # [N, action_dim] from video frame 0
    kv_mode: str | None = None
    priority: str = "standard"
    action_policy: str = "hold"


@dataclass
class BranchRequest:
    """One branch of a fork (`AsyncEngine.fork`): its chunks after the fork point; its
    actions, one per video frame, `actions[i]` conditioning the branch's i-th frame (they
    replace the parent's queued actions from the frame before the fork point's first; the
    `hold` policy past them; None: the parent's); the seed of its noise (None: the
    parent's); its priority class (None: the parent's); and whether its chunks keep to the
    playback clock or run as soon as they can."""

    num_chunks: int
    actions: np.ndarray | None = None
    seed: int | None = None
    priority: str | None = None
    paced: bool = False


def validate_branch(config: ModelConfig, branch: BranchRequest) -> None:
    """ValueError with the reason when a branch cannot be run."""
    if not 1 <= branch.num_chunks <= MAX_NUM_CHUNKS:
        raise ValueError("a branch's num_chunks must be from 1 to 10**6")
    if branch.actions is not None:
        check_actions(config, branch.actions)
    if branch.priority is not None and branch.priority not in PRIORITY_CLASSES:
        raise ValueError(f"priority must be one of {list(PRIORITY_CLASSES)}")


def validate(
    config: ModelConfig,
    *,
    num_chunks: int | None,
    image: np.ndarray | None,
    actions: np.ndarray | None,
    kv_mode: str | None,
    priority: str = "standard",
    action_policy: str = "hold",
) -> str:
    """Checks a request against the model (ValueError with the reason); returns the KV mode
    to use. `num_chunks` None means an unbounded stream."""
    kv_mode = kv_mode or config.default_kv_mode
    if kv_mode not in config.kv_modes:
        raise ValueError(
            f"kv_mode {kv_mode!r} is not supported by {config.id}; use one of {list(config.kv_modes)}"
        )
    if num_chunks is not None and not 1 <= num_chunks <= MAX_NUM_CHUNKS:
        raise ValueError("num_chunks must be from 1 to 10**6 (or None for an open-ended stream)")
    if config.needs_image and image is None:
        raise ValueError(f"model {config.id} needs a first image")
    if not config.needs_image and image is not None:
        raise ValueError(f"model {config.id} takes no image")
    if image is not None and image.shape != (config.height, config.width, 3):
        raise ValueError(f"image must be {config.height}x{config.width} RGB, got shape {tuple(image.shape)}")
    if actions is not None:
        check_actions(config, actions)
    if priority not in PRIORITY_CLASSES:
        raise ValueError(f"priority must be one of {list(PRIORITY_CLASSES)}")
    if action_policy not in ACTION_POLICIES:
        raise ValueError(f"action_policy must be one of {list(ACTION_POLICIES)}")
    return kv_mode


def check_actions(config: ModelConfig, actions: np.ndarray) -> None:
    """ValueError unless the model takes actions and these are [N, action_dim] of accepted values."""
    if config.action_dim == 0:
        raise ValueError(f"model {config.id} takes no actions")
    arr = np.asarray(actions)
    if arr.ndim != 2 or arr.shape[1] != config.action_dim:
        raise ValueError(f"actions must be a list of vectors of length {config.action_dim}")
    check_action_values(config, arr)


def check_action_values(config: ModelConfig, actions: np.ndarray) -> None:
    """ValueError unless every value is finite and in the model's accepted action range."""
    arr = np.asarray(actions, dtype=np.float64)
    low, high = config.accepted_action_range
    if arr.size and not (np.isfinite(arr).all() and low <= arr.min() and arr.max() <= high):
        raise ValueError(f"action values must be finite and in the range [{low:g}, {high:g}] of {config.id}")


def validate_stream_request(config: ModelConfig, request: StreamRequest) -> str:
    return validate(
        config,
        num_chunks=request.num_chunks,
        image=request.image,
        actions=request.actions,
        kv_mode=request.kv_mode,
        priority=request.priority,
        action_policy=request.action_policy,
    )
