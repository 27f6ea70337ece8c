"""Per-session chunk encoders: what each wire format's payloads decode to, chunk by chunk."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
from av.video.frame import PictureType

from streamworld.media import FORMATS, EncodedChunk, make_decoder, make_encoder

WIDTH, HEIGHT, FPS = 64, 64, 16
CHUNK_FRAMES = (9, 12, 12)  # a shorter first chunk, as with image-conditioned models
MAX_MEAN_ABS_ERROR = 8.0  # uint8 levels, lossy formats at their default quality


def synthetic_clip(num_frames: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """uint8 [T, H, W, 3]: gradients, a drifting soft texture and a moving square."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    for t in range(num_frames):
        texture = 30 * np.sin(x / 6 + 0.4 * t) * np.cos(y / 8 - 0.25 * t)
        frame = np.stack([x * 255 / width + texture / 2, y * 255 / height, 128 + texture], axis=-1)
        top, left = 8 + t, 4 + 2 * t
        frame[top : top + 16, left : left + 16] = (230, 40, 40)
        frames[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return frames


def clip_chunks() -> list[np.ndarray]:
    clip = synthetic_clip(sum(CHUNK_FRAMES))
    bounds = np.cumsum((0, *CHUNK_FRAMES))
    return [clip[a:b] for a, b in itertools.pairwise(bounds)]


def split(chunk: EncodedChunk) -> list[bytes]:
    assert chunk.sizes is not None and sum(chunk.sizes) == len(chunk.payload)
    offsets = np.cumsum((0, *chunk.sizes))
    return [chunk.payload[a:b] for a, b in itertools.pairwise(offsets)]


def mean_abs_error(decoded: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(decoded.astype(np.int16) - expected.astype(np.int16)).mean())


def nal_types(access_unit: bytes) -> list[int]:
    return [nal[0] & 0x1F for nal in nal_units(access_unit)]


def nal_units(annexb: bytes) -> list[bytes]:
    return [part.rstrip(b"\x00") for part in annexb.split(b"\x00\x00\x01")[1:]]


def boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """Top-level ISO BMFF boxes as (type, body); asserts that they tile `data` exactly."""
    found, position = [], 0
    while position < len(data):
        size, kind = struct.unpack_from(">I4s", data, position)
        assert size >= 8
        found.append((kind, data[position + 8 : position + size]))
        position += size
    assert position == len(data)
    return found


def child(body: bytes, kind: bytes) -> bytes:
    matches = [b for k, b in boxes(body) if k == kind]
    assert len(matches) == 1, f"expected one {kind!r} box"
    return matches[0]


def decode_container(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_rgb_payload_round_trips_exactly():
    encoder = make_encoder("rgb", WIDTH, HEIGHT, FPS)
    assert (encoder.format, encoder.codec, encoder.init_segment()) == ("rgb", None, None)
    for frames in clip_chunks():
        chunk = encoder.encode(frames)
        assert chunk.sizes is None
        decoded = np.frombuffer(chunk.payload, np.uint8).reshape(len(frames), HEIGHT, WIDTH, 3)
        np.testing.assert_array_equal(decoded, frames)


def test_jpeg_chunks_split_by_sizes_into_files_that_decode_to_their_frames():
    encoder = make_encoder("jpeg", WIDTH, HEIGHT, FPS)
    assert (encoder.format, encoder.codec, encoder.init_segment()) == ("jpeg", None, None)
    for frames in clip_chunks():
        files = split(encoder.encode(frames))
        assert len(files) == len(frames)
        for file, expected in zip(files, frames, strict=True):
            assert file.startswith(b"\xff\xd8") and file.endswith(b"\xff\xd9")
            decoder = av.CodecContext.create("mjpeg", "r")
            (picture,) = decoder.decode(av.Packet(file))
            decoded = picture.to_ndarray(format="rgb24")
            assert decoded.shape == expected.shape
            assert mean_abs_error(decoded, expected) < MAX_MEAN_ABS_ERROR


def test_h264_each_chunk_decodes_to_exactly_its_frames_as_soon_as_it_arrives():
    encoder = make_encoder("h264", WIDTH, HEIGHT, FPS)
    assert encoder.init_segment() is None
    decoder = av.CodecContext.create("h264", "r")
    next_pts = 0
    decoded_pts = []
    for frames in clip_chunks():
        access_units = split(encoder.encode(frames))
        assert len(access_units) == len(frames)
        pictures = []
        for access_unit in access_units:
            packet = av.Packet(access_unit)
            packet.pts = next_pts
            next_pts += 1
            pictures += decoder.decode(packet)
        # No flush: a decoder that has been fed this chunk already holds all of its frames.
        assert len(pictures) == len(frames)
        for picture, expected in zip(pictures, frames, strict=True):
            assert (picture.width, picture.height) == (WIDTH, HEIGHT)
            assert picture.pict_type != PictureType.B
            assert mean_abs_error(picture.to_ndarray(format="rgb24"), expected) < MAX_MEAN_ABS_ERROR
        decoded_pts += [p.pts for p in pictures]
    assert decoded_pts == list(range(sum(CHUNK_FRAMES)))  # output order is decode order
    assert decoder.decode(None) == []


def test_h264_stream_starts_with_sps_pps_idr_and_codec_matches_the_sps():
    encoder = make_encoder("h264", WIDTH, HEIGHT, FPS)
    first = encoder.encode(clip_chunks()[0])
    assert first.payload.startswith(b"\x00\x00\x00\x01") or first.payload.startswith(b"\x00\x00\x01")
    types = nal_types(split(first)[0])
    assert types[:2] == [7, 8] and 5 in types
    sps = nal_units(first.payload)[0]
    assert encoder.codec == f"avc1.{sps[1]:02X}{sps[2]:02X}{sps[3]:02X}"


def test_h264_idr_every_two_seconds_of_video_each_with_parameter_sets():
    encoder = make_encoder("h264", WIDTH, HEIGHT, FPS)
    access_units = [au for frames in clip_chunks() for au in split(encoder.encode(frames))]
    idr_frames = [i for i, au in enumerate(access_units) if 5 in nal_types(au)]
    assert idr_frames[0] == 0 and 2 * FPS in idr_frames  # frame 32 falls inside the last chunk
    for i, au in enumerate(access_units):
        types = nal_types(au)
        assert (types[:2] == [7, 8]) == (i in idr_frames), f"frame {i}: NAL types {types}"


def test_fmp4_sends_one_init_segment_then_one_fragment_per_chunk():
    encoder = make_encoder("fmp4", WIDTH, HEIGHT, FPS)
    init = encoder.init_segment()
    assert init is not None
    assert [kind for kind, _ in boxes(init)] == [b"ftyp", b"moov"]
    for sequence_number, frames in enumerate(clip_chunks(), start=1):
        chunk = encoder.encode(frames)
        assert chunk.sizes is None
        assert [kind for kind, _ in boxes(chunk.payload)] == [b"moof", b"mdat"]
        moof = child(chunk.payload, b"moof")
        assert struct.unpack(">I", child(moof, b"mfhd")[4:8])[0] == sequence_number
        trun = child(child(moof, b"traf"), b"trun")
        assert struct.unpack(">I", trun[4:8])[0] == len(frames)


def test_fmp4_decodes_whole_and_progressively_fragment_by_fragment():
    encoder = make_encoder("fmp4", WIDTH, HEIGHT, FPS)
    stream = encoder.init_segment() or b""
    decoded_so_far = 0
    for frames in clip_chunks():
        stream += encoder.encode(frames).payload
        decoded = decode_container(stream)
        assert len(decoded) == decoded_so_far + len(frames)
        assert decoded.shape[1:] == (HEIGHT, WIDTH, 3)
        assert mean_abs_error(decoded[decoded_so_far:], frames) < MAX_MEAN_ABS_ERROR
        decoded_so_far = len(decoded)
    with av.open(io.BytesIO(stream)) as container:
        video = container.streams.video[0]
        assert (video.codec_context.name, video.average_rate) == ("h264", FPS)
        packets = [p for p in container.demux(video) if p.size]
        assert [p.pts for p in packets] == [p.dts for p in packets]  # no reordering
        assert [float(p.pts * p.time_base) for p in packets] == [i / FPS for i in range(decoded_so_far)]


def test_fmp4_codec_string_matches_the_avcc_in_the_init_segment():
    encoder = make_encoder("fmp4", WIDTH, HEIGHT, FPS)
    init = encoder.init_segment() or b""
    at = init.index(b"avcC")
    (size,) = struct.unpack(">I", init[at - 4 : at])
    record = init[at + 4 : at - 4 + size]
    assert encoder.codec == "avc1." + record[1:4].hex().upper()
    sps_length = struct.unpack(">H", record[6:8])[0]
    sps = record[8 : 8 + sps_length]
    assert sps[0] & 0x1F == 7 and sps[1:4] == record[1:4]
    with av.open(io.BytesIO(init + encoder.encode(clip_chunks()[0]).payload)) as container:
        assert container.streams.video[0].codec_context.extradata == record
    assert make_encoder("h264", WIDTH, HEIGHT, FPS).codec == encoder.codec


@pytest.mark.parametrize("fmt", FORMATS)
def test_sessions_encoded_in_parallel_threads_match_sessions_encoded_alone(fmt):
    def run_session(_: int) -> list[bytes]:
        encoder = make_encoder(fmt, WIDTH, HEIGHT, FPS)
        try:
            return [encoder.init_segment() or b""] + [encoder.encode(c).payload for c in clip_chunks()]
        finally:
            encoder.close()

    alone = run_session(0)
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(run_session, range(4))) == [alone] * 4


def test_unknown_format_is_a_value_error():
    assert set(FORMATS) == {"jpeg", "h264", "fmp4", "rgb"}
    with pytest.raises(ValueError, match="unknown media format"):
        make_encoder("webm", WIDTH, HEIGHT, FPS)


@pytest.mark.parametrize("fmt", ["h264", "fmp4"])
@pytest.mark.parametrize(("width", "height"), [(63, 64), (64, 63)])
def test_h264_formats_reject_odd_frame_sizes(fmt, width, height):
    with pytest.raises(ValueError, match="even frame sizes"):
        make_encoder(fmt, width, height, FPS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_frames_of_the_wrong_shape_or_dtype_are_a_value_error(fmt):
    encoder = make_encoder(fmt, WIDTH, HEIGHT, FPS)
    frames = synthetic_clip(2)
    with pytest.raises(ValueError, match="expected uint8 frames"):
        encoder.encode(frames[:, :32])
    with pytest.raises(ValueError, match="expected uint8 frames"):
        encoder.encode(frames.astype(np.float32))
    encoder.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_client_decoders_turn_each_chunk_back_into_its_frames(fmt):
    encoder = make_encoder(fmt, WIDTH, HEIGHT, FPS)
    decoder = make_decoder(fmt, WIDTH, HEIGHT, encoder.init_segment())
    for frames in clip_chunks():
        chunk = encoder.encode(frames)
        decoded = decoder.decode(chunk.payload, len(frames), chunk.sizes)
        assert decoded.shape == frames.shape and decoded.dtype == np.uint8
        assert mean_abs_error(decoded, frames) < MAX_MEAN_ABS_ERROR
        if fmt == "rgb":
            np.testing.assert_array_equal(decoded, frames)


def test_a_jpeg_frame_of_another_size_is_refused_before_decoding():
    encoder = make_encoder("jpeg", WIDTH, HEIGHT, FPS)
    chunk = encoder.encode(next(iter(clip_chunks())))
    with pytest.raises(ValueError, match=f"in a {WIDTH + 8}x{HEIGHT} session"):
        make_decoder("jpeg", WIDTH + 8, HEIGHT).decode(chunk.payload, 1, chunk.sizes)


def test_unknown_format_has_no_decoder():
    with pytest.raises(ValueError, match="unknown media format"):
        make_decoder("webm", WIDTH, HEIGHT)


def test_media_and_client_load_without_server_or_engine():
    code = (
        "import sys, streamworld.client, streamworld.media;"
        "print(sorted(m for m in sys.modules if m.startswith(('streamworld.server', 'streamworld.engine'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


STARTED = {
    "type": "session.started",
    "session_id": "s",
    "model": "m",
    "width": 64,
    "height": 64,
    "fps": 10,
    "format": "jpeg",
    "kv_mode": "final",
    "frames_per_chunk": 4,
    "first_chunk_frames": 1,
}


@pytest.mark.parametrize(
    "reply",
    [
        '{"type": "session.queued"}',
        '{"type": "session.queued", "position": "first"}',
        '{"type": "session.queued", "position": ' + "9" * 5000 + "}",
        '{"type": "session.queued", "position": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"type": "session.started", "width": Infinity}',
        json.dumps({**STARTED, "width": 1e308}).replace("1e+308", "1e400"),
    ],
    ids=["no-position", "text-position", "integer-too-long", "nested-too-deep", "infinity", "overflow"],
)
async def test_a_malformed_reply_before_the_start_is_a_protocol_error(reply):
    """What the client raises for a server's malformed reply is its own error, never a raw
    KeyError, ValueError or RecursionError."""
    from websockets.asyncio.server import serve

    from streamworld.client import StreamWorldClient, StreamWorldError

    async def handler(ws):
        await ws.recv()
        await ws.send(reply)
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(StreamWorldError) as caught:
            async with StreamWorldClient(f"ws://127.0.0.1:{port}/v1/stream", max_size=2**24):
                pass
    assert caught.value.code == "protocol"


async def test_a_branch_that_gets_more_chunks_than_it_asked_for_is_a_protocol_error():
    """A branch's chunks are bounded by the chunks it asked for (its memory, too): one more
    from the server ends the session with a protocol error."""
    from websockets.asyncio.server import serve

    from streamworld.client import StreamWorldClient, StreamWorldError

    started = {**STARTED, "width": 4, "height": 4, "format": "rgb", "frames_per_chunk": 1}

    def chunk(index, branch):
        meta = {"type": "chunk", "index": index, "first_frame": index, "num_frames": 1, "bytes": 48}
        return json.dumps({**meta, "branch": branch}), bytes(48)

    async def handler(ws):
        await ws.recv()
        await ws.send(json.dumps(started))
        fork = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.forked", "id": fork["id"], "branches": [1]}))
        for index in range(3):  # it asked for 2
            for message in chunk(index + 1, 1):
                await ws.send(message)
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with StreamWorldClient(f"ws://127.0.0.1:{port}/v1/stream", format="rgb") as client:
            (branch,) = await client.fork([{"num_chunks": 2}])
            taken = []

            async def drain():
                async for chunk in branch.chunks():
                    taken.append(chunk)

            with pytest.raises(StreamWorldError) as caught:
                await asyncio.wait_for(drain(), 60)  # without the bound: no end, a timeout
    assert len(taken) == 2 and caught.value.code == "protocol" and "asked for" in caught.value.message
