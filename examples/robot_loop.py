"""A closed robot loop against a StreamWorld server: the PushT world model next to the real world.

A scripted PushT controller picks the agent's next targets from the real environment's
state, chunk by chunk. The same actions go to the real environment (gym-pusht) and to the
server, whose `pusht` model predicts the frames they lead to, starting from the same first
frame. The session uses the `wait` action policy, so every chunk is generated from exactly
the actions sent for it (lockstep), and the `rgb` format, so frames arrive losslessly.

For every chunk the script prints the loop latency (actions sent -> predicted frames
received), the server's own timing, and how far the prediction is from the truth (PSNR, and
the distance between where the agent and the block are in both). `--video` writes the truth
(left) and the prediction (right) side by side.

    streamworld serve                       # in another terminal (serves pusht by default)
    python examples/robot_loop.py --video loop.mp4
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time

import numpy as np

from streamworld.cli.eval import PUSHT_MODELS
from streamworld.client import Chunk, StreamWorldClient, StreamWorldError
from streamworld.pusht.evaluate import psnr
from streamworld.pusht.policy import ScriptedPolicy
from streamworld.pusht.world import PushTWorld, locate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Drive the real PushT environment and the served PushT world model with the same "
        "actions, and compare the predicted frames with the real ones.",
    )
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream", help="server stream URL")
    p.add_argument(
        "--model", default="pusht", choices=PUSHT_MODELS, help="served PushT model (default pusht)"
    )
    p.add_argument("--seed", type=int, default=0, help="environment seed: the scene the loop starts from")
    p.add_argument("--policy-seed", type=int, help="controller seed (default: 500000 + --seed)")
    p.add_argument("--chunks", type=int, default=8, help="chunks to run (default 8: 32 frames at 10 fps)")
    p.add_argument("--kv-mode", choices=("clean", "final", "noisy"), help="KV mode (default: the model's)")
    p.add_argument("--video", metavar="OUT.mp4", help="write truth | prediction side by side")
    p.add_argument("--scale", type=int, default=4, help="upscaling of the video frames (default 4)")
    return p


def _distance(a, b) -> float:
    return float("nan") if a is None or b is None else math.hypot(a[0] - b[0], a[1] - b[1])


def _mean(values: list[float]) -> float:
    """Mean of the finite values; nan when there is none (the object was never visible)."""
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


class LoopRecord:
    """The real frames (from the reset frame on), the predicted ones, and one row of figures per chunk."""

    def __init__(self, first: np.ndarray) -> None:
        self.truth: list[np.ndarray] = [first]
        self.predicted: list[np.ndarray] = []
        # (loop latency ms, mean PSNR dB, agent distance px, block distance px)
        self.rows: list[tuple[float, float, float, float]] = []


def open_session(args: argparse.Namespace, first: np.ndarray) -> StreamWorldClient:
    """A lockstep (`wait`), lossless (`rgb`) PushT session starting from the real first frame."""
    return StreamWorldClient(
        args.url,
        model=args.model,
        image=first,
        seed=0,
        num_chunks=args.chunks,
        format="rgb",
        action_policy="wait",
        priority="interactive",
        kv_mode=args.kv_mode,
    )


def act(world: PushTWorld, policy: ScriptedPolicy, frames: int, truth: list[np.ndarray]) -> list:
    """The controller's next `frames` actions, each already applied to the real world."""
    actions = []
    for _ in range(frames):
        actions.append(policy(world.scene))
        truth.append(world.step(actions[-1]))
    return actions


def score_chunk(chunk: Chunk, latency: float, record: LoopRecord) -> None:
    """Compares a predicted chunk with the real frames it stands for; records and prints the row."""
    frames = chunk.frames
    record.predicted.extend(frames)
    real = record.truth[chunk.first_frame : chunk.first_frame + chunk.num_frames]
    scores = [psnr(p, t) for p, t in zip(frames, real, strict=True)]
    found = [(locate(p), locate(t)) for p, t in zip(frames, real, strict=True)]
    agent = _mean([_distance(p.agent, t.agent) for p, t in found])
    block = _mean([_distance(p.block, t.block) for p, t in found])
    record.rows.append((latency, np.mean(scores), agent, block))
    print(
        f"{chunk.index:6d}  {chunk.first_frame:2d}-{chunk.first_frame + chunk.num_frames - 1:<3d}"
        f"{latency:9.0f}  {chunk.timings.get('total', float('nan')):9.0f}  {np.mean(scores):8.2f}"
        f"  {agent:8.2f}  {block:8.2f}"
    )


async def run_chunks(
    client: StreamWorldClient, num_chunks: int, world: PushTWorld, policy: ScriptedPolicy, record: LoopRecord
) -> bool:
    """Drives the loop chunk by chunk to the end of the session; False if the server ended it early."""
    fpc = client.info.frames_per_chunk
    chunks = client.chunks()
    for c in range(num_chunks):
        actions = act(world, policy, fpc, record.truth)
        sent = time.monotonic()
        await client.send_actions(np.asarray(actions), frame=c * fpc)
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            print(f"error: the session ended after {c} chunks ({client.done_reason})")
            return False
        score_chunk(chunk, (time.monotonic() - sent) * 1000, record)
    async for _ in chunks:  # session.done
        pass
    return True


def write_side_by_side(path: str, record: LoopRecord, scale: int, fps: float) -> None:
    from streamworld.media import write_mp4

    n = len(record.predicted)
    # The truth starts with the reset frame, which the prediction was given rather than predicted.
    pairs = np.concatenate([np.stack(record.truth[1 : n + 1]), np.stack(record.predicted)], axis=2)
    big = pairs.repeat(scale, axis=1).repeat(scale, axis=2)
    write_mp4(big, path, fps=round(fps))
    print(f"wrote {path}: {n} frames, truth left, prediction right")


async def run(args: argparse.Namespace) -> int:
    world = PushTWorld(64)
    first = world.reset(args.seed)
    policy = ScriptedPolicy(args.policy_seed if args.policy_seed is not None else 500_000 + args.seed)
    record = LoopRecord(first)
    async with open_session(args, first) as client:
        info = client.info
        if (info.width, info.height) != (64, 64):
            print(
                f"error: the server's {info.model} model makes {info.width}x{info.height} frames, not 64x64"
            )
            return 1
        print(
            f"session {info.session_id}: {info.model}, kv_mode {info.kv_mode}, "
            f"{info.frames_per_chunk} frames per chunk at {info.fps} fps"
        )
        print(" chunk  frames  loop ms  server ms   PSNR dB  agent px  block px")
        if not await run_chunks(client, args.chunks, world, policy, record):
            return 1
    lat = np.array([r[0] for r in record.rows])
    print(
        f"loop latency: median {np.median(lat):.0f} ms, max {lat.max():.0f} ms; "
        f"mean PSNR {np.mean([r[1] for r in record.rows]):.2f} dB "
        "(frames in px of a 64x64 frame; nan: not visible)"
    )
    if args.video:
        write_side_by_side(args.video, record, args.scale, info.fps)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.chunks < 1 or args.scale < 1:
        print("error: --chunks and --scale must be at least 1", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args))
    except (OSError, StreamWorldError) as e:
        print(f"error: {e} (is `streamworld serve` running at {args.url}?)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
