"""First frames for image-to-world models that come with their own environment.

A session (or `generate`, or `bench`) that gives such a model no image starts from the
environment's initial frame for its seed. Today that is PushT; other models need an image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .models.config import ModelConfig

# seed -> (image uint8 [H, W, 3], a JSON description of the scene for session.started, or None)
FirstFrame = Callable[[int], tuple[np.ndarray, dict[str, Any] | None]]


def first_frame_source(config: ModelConfig) -> FirstFrame | None:
    """The first-frame source of a model, or None when it has no environment."""
    if config.id == "pusht":

        def pusht(seed: int) -> tuple[np.ndarray, dict[str, Any] | None]:
            from .pusht.world import initial_frame

            image, scene = initial_frame(seed, config.height)
            return image, scene.to_json()

        return pusht
    return None
