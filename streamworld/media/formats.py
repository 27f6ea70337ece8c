"""The wire formats of chunk payloads (`format` in `session.start`, see docs/protocol.md).

| format | payload | `sizes` |
| --- | --- | --- |
| `rgb` | the frames' bytes, row-major, concatenated | None |
| `jpeg` | one JPEG file per frame, concatenated | bytes per frame |
| `h264` | one Annex-B access unit per frame, concatenated | bytes per frame |
| `fmp4` | one fragmented-MP4 media fragment (moof+mdat) | None |

`fmp4` also sends an initialization segment (ftyp+moov) once, right after `session.started`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMATS = ("jpeg", "h264", "fmp4", "rgb")
# Formats whose chunk payloads are split per frame by the `sizes` field.
SIZED_FORMATS = ("jpeg", "h264")


@dataclass(frozen=True)
class EncodedChunk:
    """One chunk's binary payload; `sizes` splits it per frame (`jpeg`, `h264`), else None."""

    payload: bytes
    sizes: list[int] | None = None


def check_frames(frames: np.ndarray, width: int, height: int) -> None:
    """Raises ValueError unless `frames` is one chunk of uint8 frames [T >= 1, height, width, 3]."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (height, width, 3):
        raise ValueError(
            f"expected uint8 frames [T, {height}, {width}, 3], got {frames.dtype} {list(frames.shape)}"
        )
    if len(frames) == 0:
        raise ValueError("a chunk needs at least one frame")


def split_sized(payload: bytes, sizes: list[int]) -> list[bytes]:
    """The per-frame parts of a `jpeg` or `h264` payload, cut at `sizes`."""
    parts, position = [], 0
    for size in sizes:
        parts.append(payload[position : position + size])
        position += size
    return parts
