"""First frames from the environment, made in a child process by the server."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamworld.models import get_preset
from streamworld.scenes import ChildProcessFrames, first_frame_source, pusht_frame


def crash_on_13(seed: int) -> int:
    """Dies as a native crash would (module level, so that the child can import it)."""
    if seed == 13:
        os.abort()
    return 2 * seed


def test_the_child_process_makes_the_same_frames_as_the_process_itself():
    cfg = get_preset("pusht")
    isolated = first_frame_source(cfg, isolated=True)
    try:
        image, scene = isolated(7)
        direct_image, direct_scene = pusht_frame(7, cfg.height)
        assert np.array_equal(image, direct_image) and scene == direct_scene
        assert isolated(7)[0] is image  # cached
    finally:
        isolated.close()


def test_a_crashing_environment_costs_one_request_not_the_process():
    frames = ChildProcessFrames(crash_on_13)
    try:
        assert frames(1) == 2
        with pytest.raises(RuntimeError, match="process died making the first frame for seed 13"):
            frames(13)
        assert frames.restarts == 2  # the first death was retried in a new child, which died too
        assert frames(2) == 4  # a new child serves the next request
    finally:
        frames.close()
