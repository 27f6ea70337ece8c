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

from streamworld.client import StreamWorldClient, StreamWorldError
from streamworld.pusht.evaluate import psnr
from streamworld.pusht.policy import ScriptedPolicy
from streamworld.pusht.world import PushTWorld, locate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Drive the real PushT environment and the served PushT world model with the same "
        "actions, and compare the predicted frames with the real ones.",
    )
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream", help="server stream URL")
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


async def run(args: argparse.Namespace) -> int:
    world = PushTWorld(64)
    first = world.reset(args.seed)
    policy = ScriptedPolicy(args.policy_seed if args.policy_seed is not None else 500_000 + args.seed)
    truth, predicted, rows = [first], [], []
    async with StreamWorldClient(
        args.url,
        model="pusht",
        image=first,
        seed=0,
        num_chunks=args.chunks,
        format="rgb",
        action_policy="wait",
        priority="interactive",
        kv_mode=args.kv_mode,
    ) as client:
        info = client.info
        if (info.width, info.height) != (64, 64):
            print(f"error: the server's pusht model makes {info.width}x{info.height} frames; expected 64x64")
            return 1
        fpc = info.frames_per_chunk
        chunks = client.chunks()
        print(
            f"session {info.session_id}: pusht, kv_mode {info.kv_mode}, "
            f"{fpc} frames per chunk at {info.fps} fps"
        )
        print(" chunk  frames  loop ms  server ms   PSNR dB  agent px  block px")
        for c in range(args.chunks):
            actions = []
            for _ in range(fpc):
                actions.append(policy(world.scene))
                truth.append(world.step(actions[-1]))
            sent = time.monotonic()
            await client.send_actions(np.asarray(actions), frame=c * fpc)
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                print(f"error: the session ended after {c} chunks ({client.done_reason})")
                return 1
            latency = (time.monotonic() - sent) * 1000
            frames = chunk.frames
            predicted.extend(frames)
            real = truth[chunk.first_frame : chunk.first_frame + chunk.num_frames]
            scores = [psnr(p, t) for p, t in zip(frames, real, strict=True)]
            found = [(locate(p), locate(t)) for p, t in zip(frames, real, strict=True)]
            agent = _mean([_distance(p.agent, t.agent) for p, t in found])
            block = _mean([_distance(p.block, t.block) for p, t in found])
            rows.append((latency, np.mean(scores), agent, block))
            print(
                f"{chunk.index:6d}  {chunk.first_frame:2d}-{chunk.first_frame + chunk.num_frames - 1:<3d}"
                f"{latency:9.0f}  {chunk.timings.get('total', float('nan')):9.0f}  {np.mean(scores):8.2f}"
                f"  {agent:8.2f}  {block:8.2f}"
            )
        async for _ in chunks:  # session.done
            pass
    lat = np.array([r[0] for r in rows])
    print(
        f"loop latency: median {np.median(lat):.0f} ms, max {lat.max():.0f} ms; "
        f"mean PSNR {np.mean([r[1] for r in rows]):.2f} dB (frames in px of a 64x64 frame; nan: not visible)"
    )
    if args.video:
        from streamworld.media import write_mp4

        n = len(predicted)
        pairs = np.concatenate([np.stack(truth[1 : n + 1]), np.stack(predicted)], axis=2)
        big = pairs.repeat(args.scale, axis=1).repeat(args.scale, axis=2)
        write_mp4(big, args.video, fps=round(info.fps))
        print(f"wrote {args.video}: {n} frames, truth left, prediction right")
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
