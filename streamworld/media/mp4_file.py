"""Whole clips to MP4 files (`streamworld generate`, the examples' saved videos)."""

from __future__ import annotations

import os
from fractions import Fraction

import av
import numpy as np


def write_mp4(frames: np.ndarray, path: str | os.PathLike, fps: int, crf: int = 18) -> None:
    """Writes uint8 frames [T, H, W, 3] as an H.264 (yuv420p) MP4 that common players open."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 with yuv420p needs even frame sizes, got {width}x{height}")
    with av.open(os.fspath(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
