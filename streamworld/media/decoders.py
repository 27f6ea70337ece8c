"""Client-side chunk decoders: one wire payload in, uint8 frames [T, H, W, 3] out.

`make_decoder(fmt, width, height, init_segment)` returns a `ChunkDecoder` for one session.
The video decoders keep state across chunks because only the first chunk of a stream starts
with a keyframe, so one decoder must see a session's chunks in order.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Protocol

import av
import numpy as np
from PIL import Image

from . import fmp4
from .annexb import is_idr
from .formats import FORMATS, split_sized

# Longest run of coded frames kept for decoding again (see VideoDecoder).
MAX_REPLAY_FRAMES = 256


class ChunkDecoder(Protocol):
    """Decodes the chunks of one session, in order."""

    def decode(self, payload: bytes, num_frames: int, sizes: Sequence[int] | None) -> np.ndarray:
        """uint8 frames [num_frames, H, W, 3]; `sizes` is the chunk's per-frame split, if any."""
        ...


def make_decoder(fmt: str, width: int, height: int, init_segment: bytes | None = None) -> ChunkDecoder:
    """A fresh decoder for one session; `init_segment` is required for `fmp4`.

    Raises ValueError for an unknown format, and PyAV's errors for an unusable init segment.
    """
    if fmt == "rgb":
        return RgbDecoder(width, height)
    if fmt == "jpeg":
        return JpegDecoder(width, height)
    if fmt == "h264":
        return H264Decoder()
    if fmt == "fmp4":
        if init_segment is None:
            raise ValueError("fmp4 needs the initialization segment")
        return Fmp4Decoder(init_segment)
    raise ValueError(f"unknown media format {fmt!r}; expected one of {', '.join(FORMATS)}")


class RgbDecoder:
    """`rgb`: the payload reshaped."""

    def __init__(self, width: int, height: int) -> None:
        self.shape = (height, width, 3)

    def decode(self, payload: bytes, num_frames: int, sizes: Sequence[int] | None = None) -> np.ndarray:
        frames = np.frombuffer(payload, dtype=np.uint8).reshape(num_frames, *self.shape)
        return frames.copy()  # writable, and free of the message buffer


class JpegDecoder:
    """`jpeg`: each file decoded by Pillow, once its header shows the session's frame size (a
    file of any other size is refused before its pixels are decoded)."""

    def __init__(self, width: int, height: int) -> None:
        self.size = (width, height)

    def decode(self, payload: bytes, num_frames: int, sizes: Sequence[int] | None) -> np.ndarray:
        return np.stack([self._one(data) for data in split_sized(payload, sizes)])

    def _one(self, data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data), formats=("JPEG",)) as image:
            if image.size != self.size:
                (w, h), (sw, sh) = image.size, self.size
                raise ValueError(f"a {w}x{h} frame in a {sw}x{sh} session")
            return np.asarray(image.convert("RGB"))


class H264Decoder:
    """`h264`: the access units fed to one persistent decoder."""

    def __init__(self) -> None:
        self._video = VideoDecoder("h264")

    def decode(self, payload: bytes, num_frames: int, sizes: Sequence[int] | None) -> np.ndarray:
        units = split_sized(payload, sizes)
        return np.stack(self._video.decode(units, [is_idr(unit) for unit in units]))


class Fmp4Decoder:
    """`fmp4`: each fragment demuxed behind the initialization segment, decoded by one decoder."""

    def __init__(self, init_segment: bytes) -> None:
        self._init = init_segment
        self._video = VideoDecoder(*fmp4.read_init_segment(init_segment))

    def decode(self, payload: bytes, num_frames: int, sizes: Sequence[int] | None = None) -> np.ndarray:
        samples, keyframes = fmp4.read_fragment(self._init, payload)
        return np.stack(self._video.decode(samples, keyframes))


def _open_video_decoder(codec: str, extradata: bytes | None) -> av.CodecContext:
    decoder = av.CodecContext.create(codec, "r")
    if extradata:
        decoder.extradata = extradata
    # Frame threading delays output by a frame per thread; slice threading does not.
    decoder.thread_type = "SLICE"
    return decoder


class VideoDecoder:
    """A persistent decoder fed one coded frame (access unit or MP4 sample) per video frame.

    Without B-frames the decoder outputs every frame as soon as it is fed, so a chunk's
    frames come out with its payload. Should a decoder still hold frames back, flushing it
    would end its stream (FFmpeg takes no input after a flush), so the missing frames are
    decoded again by a throwaway decoder that starts from the last keyframe and is flushed;
    the persistent decoder's late copies of them are dropped when they come out.
    """

    def __init__(self, codec: str, extradata: bytes | None = None) -> None:
        self.codec = codec
        self.extradata = extradata
        self._decoder = _open_video_decoder(codec, extradata)
        self._fed = 0  # coded frames fed so far = video frame index of the next one
        self._output = 0  # frames the persistent decoder has output so far
        # Coded frames from the last keyframe on (None once that is too long to decode again).
        self._gop: list[bytes] | None = []
        self._gop_start = 0  # video frame index of self._gop[0]

    def decode(self, units: Sequence[bytes], keyframes: Sequence[bool]) -> list[np.ndarray]:
        """The frames of `units`, one coded frame each, in order."""
        first = self._fed  # the chunk's frames are [first, first + len(units))
        previous_gop = None if self._gop is None else [*self._gop, *units]
        previous_start = self._gop_start
        frames: list[np.ndarray] = []
        for unit, keyframe in zip(units, keyframes, strict=True):
            if keyframe:
                self._gop, self._gop_start = [], self._fed
            if self._gop is not None:
                self._gop.append(unit)
                if len(self._gop) > MAX_REPLAY_FRAMES:
                    self._gop = None
            self._fed += 1
            for frame in self._decoder.decode(av.Packet(unit)):
                if self._output >= first:
                    frames.append(frame.to_ndarray(format="rgb24"))
                self._output += 1
        missing = len(units) - len(frames)
        if missing > 0:
            if self._gop is not None and self._gop_start <= self._fed - missing:
                replay, start = self._gop, self._gop_start
            elif previous_gop is not None:
                replay, start = previous_gop, previous_start
            else:
                raise ValueError(f"the decoder held back {missing} frames and no keyframe is recent enough")
            frames += self._replay(replay, start, missing)
        return frames

    def _replay(self, replay: list[bytes], start: int, missing: int) -> list[np.ndarray]:
        """The last `missing` frames fed, decoded again from `replay` (coded frames from `start` on)."""
        decoder = _open_video_decoder(self.codec, self.extradata)
        decoded = [frame for unit in replay for frame in decoder.decode(av.Packet(unit))]
        decoded += decoder.decode(None)
        stop = self._fed - start
        return [frame.to_ndarray(format="rgb24") for frame in decoded[stop - missing : stop]]
