"""Fragmented MP4 (ISO BMFF) for one H.264 track, both directions.

Writing: `init_segment` (ftyp+moov, sent once after `session.started`) and `fragment`
(moof+mdat, one per chunk). One video track, decode time = presentation time (no B-frames),
parameter sets only in the avcC, samples with 4-byte NAL lengths (`annexb.join_length_prefixed`).
Reading: `read_init_segment` and `read_fragment` demux with PyAV, for the client.

The boxes are written here rather than by FFmpeg's mp4 muxer (through PyAV 18, FFmpeg 8.1),
measured on three 64x64 chunks of 9, 12 and 12 frames at 16 fps:

- The muxer closes a fragment only when the next packet arrives, or on an explicit flush
  (`av_write_frame(NULL)` with `movflags=frag_custom`) that PyAV does not expose:
  `mux_one(None)` is a TypeError, and nothing came out until the container closed.
- `frag_every_frame`: one moof+mdat per frame, not per chunk, and the chunk's last frame
  stayed in the muxer until the next chunk's first packet (8 fragments after the 9-frame
  chunk), so every chunk's last frame would wait a whole chunk.
- `frag_duration` set to one chunk: one fragment per chunk, but each one chunk late (none
  after the first chunk), and cut by duration, not at chunk boundaries.
- `frag_keyframe`: a fragment per keyframe interval (2 s), nothing for the first 33 frames.
- A fresh muxer per chunk, closed after it: the fragment comes out at once (0.7-1.7 ms), but
  every fragment has sequence number 1 and decode time 0 and comes wrapped in ftyp, moov and
  mfra, so it would need rewriting box by box anyway.
"""

from __future__ import annotations

import io
import struct

import av

TRACK_ID = 1
_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)  # identity
_LANGUAGE_UND = 0x55C4  # "und", packed ISO 639-2/T
_SYNC_SAMPLE = 0x02000000  # sample_depends_on = 2 (an IDR)
_NON_SYNC_SAMPLE = 0x01010000  # sample_depends_on = 1, sample_is_non_sync_sample


def init_segment(width: int, height: int, timescale: int, sps: bytes, pps: bytes) -> bytes:
    """ftyp + moov for one H.264 track with no samples of its own (they come in fragments)."""
    # iso5: default-base-is-moof in the fragments' tfhd.
    ftyp = _box(b"ftyp", b"iso5", struct.pack(">I", 512), b"iso5iso6avc1mp41")
    mvhd = _full_box(
        b"mvhd",
        0,
        0,
        struct.pack(">IIII", 0, 0, timescale, 0),  # creation, modification, timescale, duration
        struct.pack(">IH", 0x00010000, 0x0100) + bytes(10),  # rate 1.0, volume 1.0, reserved
        _MATRIX,
        bytes(24),  # pre_defined
        struct.pack(">I", TRACK_ID + 1),  # next_track_ID
    )
    trak = _box(b"trak", _tkhd(width, height), _mdia(width, height, timescale, avcc_box(sps, pps)))
    trex = _full_box(b"trex", 0, 0, struct.pack(">IIIII", TRACK_ID, 1, 0, 0, 0))
    return ftyp + _box(b"moov", mvhd, trak, _box(b"mvex", trex))


def _tkhd(width: int, height: int) -> bytes:
    return _full_box(
        b"tkhd",
        0,
        0x3,  # track enabled, in movie
        struct.pack(">IIIII", 0, 0, TRACK_ID, 0, 0),  # creation, modification, ID, reserved, duration
        bytes(16),  # reserved, layer, alternate_group, volume, reserved
        _MATRIX,
        struct.pack(">II", width << 16, height << 16),  # 16.16 fixed point
    )


def _mdia(width: int, height: int, timescale: int, avcc: bytes) -> bytes:
    mdhd = _full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, timescale, 0, _LANGUAGE_UND, 0))
    hdlr = _full_box(b"hdlr", 0, 0, bytes(4), b"vide", bytes(12), b"VideoHandler\x00")
    avc1 = _box(
        b"avc1",
        bytes(6) + struct.pack(">H", 1),  # reserved, data_reference_index
        bytes(16),  # pre_defined, reserved
        struct.pack(">HHII", width, height, 0x00480000, 0x00480000),  # size, 72 dpi
        struct.pack(">IH", 0, 1),  # reserved, frame_count
        bytes(32),  # compressorname
        struct.pack(">Hh", 0x0018, -1),  # depth, pre_defined
        avcc,
    )
    stbl = _box(
        b"stbl",
        _full_box(b"stsd", 0, 0, struct.pack(">I", 1), avc1),
        _full_box(b"stts", 0, 0, struct.pack(">I", 0)),
        _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
        _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
        _full_box(b"stco", 0, 0, struct.pack(">I", 0)),
    )
    dinf = _box(b"dinf", _full_box(b"dref", 0, 0, struct.pack(">I", 1), _full_box(b"url ", 0, 0x1)))
    minf = _box(b"minf", _full_box(b"vmhd", 0, 0x1, bytes(8)), dinf, stbl)
    return _box(b"mdia", mdhd, hdlr, minf)


def fragment(
    sequence_number: int, base_time: int, sample_duration: int, samples: list[bytes], sync: list[bool]
) -> bytes:
    """moof + mdat holding `samples` back to back, the first decoded at `base_time`."""

    def moof(data_offset: int) -> bytes:
        tfhd = _full_box(
            b"tfhd",
            0,
            0x020008,  # default-base-is-moof, default-sample-duration-present
            struct.pack(">II", TRACK_ID, sample_duration),
        )
        tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", base_time))
        entries = (
            struct.pack(">II", len(sample), _SYNC_SAMPLE if is_sync else _NON_SYNC_SAMPLE)
            for sample, is_sync in zip(samples, sync, strict=True)
        )
        trun = _full_box(
            b"trun",
            0,
            0x000601,  # data-offset, sample-size and sample-flags present
            struct.pack(">Ii", len(samples), data_offset),
            *entries,
        )
        mfhd = _full_box(b"mfhd", 0, 0, struct.pack(">I", sequence_number))
        return _box(b"moof", mfhd, _box(b"traf", tfhd, tfdt, trun))

    # The data offset runs from the moof's first byte to the first sample, past the 8-byte
    # mdat header; the moof's size does not depend on the offset's value.
    data_offset = len(moof(0)) + 8
    return moof(data_offset) + _box(b"mdat", *samples)


def _box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I", 8 + len(body)) + kind + body


def _full_box(kind: bytes, version: int, flags: int, *parts: bytes) -> bytes:
    return _box(kind, struct.pack(">I", version << 24 | flags), *parts)


def avcc_box(sps: bytes, pps: bytes) -> bytes:
    """AVCDecoderConfigurationRecord (ISO/IEC 14496-15) with 4-byte NAL lengths."""
    record = bytes([1, sps[1], sps[2], sps[3], 0xFC | 3, 0xE0 | 1])
    record += struct.pack(">H", len(sps)) + sps + bytes([1]) + struct.pack(">H", len(pps)) + pps
    if sps[1] in (100, 110, 122, 144):
        chroma_format, luma_depth_minus8, chroma_depth_minus8 = _sps_chroma_fields(sps)
        record += bytes(
            [0xFC | chroma_format, 0xF8 | luma_depth_minus8, 0xF8 | chroma_depth_minus8, 0]  # no SPS-ext
        )
    return _box(b"avcC", record)


def _sps_chroma_fields(sps: bytes) -> tuple[int, int, int]:
    """chroma_format_idc, bit_depth_luma_minus8, bit_depth_chroma_minus8 of a High-profile SPS."""
    rbsp = sps[1:].replace(b"\x00\x00\x03", b"\x00\x00")
    bits = "".join(f"{b:08b}" for b in rbsp[3:12])  # after profile, constraints, level
    position = 0

    def exp_golomb() -> int:
        nonlocal position
        zeros = 0
        while bits[position + zeros] == "0":
            zeros += 1
        value = int(bits[position + zeros : position + 2 * zeros + 1], 2) - 1
        position += 2 * zeros + 1
        return value

    exp_golomb()  # seq_parameter_set_id
    chroma_format = exp_golomb()
    if chroma_format == 3:
        position += 1  # separate_colour_plane_flag
    return chroma_format, exp_golomb(), exp_golomb()


def read_init_segment(init: bytes) -> tuple[str, bytes | None]:
    """The video track's codec name and extradata (the avcC record) from an initialization segment."""
    with av.open(io.BytesIO(init), format="mp4") as container:
        context = container.streams.video[0].codec_context
        return context.name, context.extradata


def read_fragment(init: bytes, fragment: bytes) -> tuple[list[bytes], list[bool]]:
    """The samples of a media fragment, in decode order, and which of them are keyframes."""
    with av.open(io.BytesIO(init + fragment), format="mp4") as container:
        packets = [packet for packet in container.demux(video=0) if packet.size]
        return [bytes(packet) for packet in packets], [packet.is_keyframe for packet in packets]
