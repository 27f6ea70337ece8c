"""H.264 NAL units in Annex-B byte streams (ITU-T H.264 Annex B), both directions.

The `h264` wire format carries Annex-B access units (start code + NAL unit, repeated); the
encoder cuts libx264's output into NAL units here, and the client finds IDR access units
here. MP4 samples (`fmp4`) carry the same NAL units with 4-byte length prefixes instead.
"""

from __future__ import annotations

import struct

START_CODE = b"\x00\x00\x00\x01"
NAL_IDR, NAL_SPS, NAL_PPS, NAL_AUD = 5, 7, 8, 9
_START_CODE_PREFIX = b"\x00\x00\x01"


def split_nal_units(data: bytes) -> list[bytes]:
    """The NAL units of an Annex-B byte stream, without start codes or trailing zero bytes."""
    nals = []
    start = data.find(_START_CODE_PREFIX)
    while start != -1:
        begin = start + 3
        start = data.find(_START_CODE_PREFIX, begin)
        # Emulation prevention keeps 00 00 01 out of NAL payloads, so zeros before the next
        # start code belong to the byte stream (zero_byte / trailing_zero_8bits).
        nal = data[begin : len(data) if start == -1 else start].rstrip(b"\x00")
        if nal:
            nals.append(nal)
    return nals


def nal_type(nal: bytes) -> int:
    """nal_unit_type of a NAL unit (its first byte's low five bits)."""
    return nal[0] & 0x1F


def is_idr(access_unit: bytes) -> bool:
    """Whether an Annex-B access unit holds an IDR slice."""
    return any(nal_type(nal) == NAL_IDR for nal in split_nal_units(access_unit))


def join_annexb(nals: list[bytes]) -> bytes:
    """An Annex-B access unit: each NAL unit behind a 4-byte start code."""
    return b"".join(START_CODE + nal for nal in nals)


def join_length_prefixed(nals: list[bytes]) -> bytes:
    """An MP4 sample: each NAL unit behind its 4-byte big-endian length."""
    return b"".join(struct.pack(">I", len(nal)) + nal for nal in nals)
