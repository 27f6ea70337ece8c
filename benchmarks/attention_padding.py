"""Self-attention for a batch of units with different context lengths: padded + masked SDPA
in one call against one exact-length SDPA call per unit (what `CausalWanDiT.run_blocks`
does), at Wan 1.3B shapes. GPU only.

    python benchmarks/attention_padding.py --json attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone

import torch
import torch.nn.functional as F


def timed(fn, reps: int = 20) -> float:
    """Median milliseconds of `fn` over `reps` runs after warm-up (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


HEADS, HEAD_DIM = 12, 128  # Wan 1.3B


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-frame", type=int, default=1560, help="480x832: 1560")
    parser.add_argument("--chunk-frames", type=int, default=3)
    parser.add_argument("--contexts", default="0,3,6,9,12,15,18,18", help="context frames of each unit")
    parser.add_argument("--json", help="write the result here")
    return parser.parse_args()


class UnitBatch:
    """Each unit's chunk queries and its own-length keys and values, also padded to the longest.

    q: [units, heads, chunk tokens, dim]; keys[i], values[i]: [1, heads, (context + chunk) tokens, dim];
    k_pad, v_pad: [units, heads, longest, dim]; mask: [units, 1, 1, longest], True on real keys.
    """

    def __init__(self, contexts: list[int], tokens_per_frame: int, chunk_frames: int) -> None:
        p, f = tokens_per_frame, chunk_frames
        dev, dt = torch.device("cuda"), torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)
        self.q = torch.randn(len(contexts), HEADS, f * p, HEAD_DIM, device=dev, dtype=dt, generator=gen)
        self.keys = [
            torch.randn(1, HEADS, (c + f) * p, HEAD_DIM, device=dev, dtype=dt, generator=gen)
            for c in contexts
        ]
        self.values = [torch.randn_like(k) for k in self.keys]
        nk_max = max(k.shape[2] for k in self.keys)

        def pad(ts):
            return torch.cat([F.pad(t, (0, 0, 0, nk_max - t.shape[2])) for t in ts])

        self.k_pad, self.v_pad = pad(self.keys), pad(self.values)
        self.mask = torch.zeros(len(contexts), 1, 1, nk_max, dtype=torch.bool, device=dev)
        for i, k in enumerate(self.keys):
            self.mask[i, ..., : k.shape[2]] = True

    @property
    def longest(self) -> int:
        return self.k_pad.shape[2]

    def padded(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q, self.k_pad, self.v_pad, attn_mask=self.mask)

    def per_unit(self) -> list[torch.Tensor]:
        return [
            F.scaled_dot_product_attention(self.q[i : i + 1], self.keys[i], self.values[i])
            for i in range(len(self.keys))
        ]


def relative_difference(batch: UnitBatch) -> float:
    a, b = batch.padded(), torch.cat(batch.per_unit())
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def attention_flops(batch: UnitBatch) -> tuple[int, int]:
    """The work of the exact-length calls (the useful work) and of the padded call."""
    units, nq = len(batch.keys), batch.q.shape[2]
    useful = sum(4 * HEADS * nq * k.shape[2] * HEAD_DIM for k in batch.keys)
    return useful, 4 * HEADS * nq * batch.longest * HEAD_DIM * units


def measure(batch: UnitBatch, contexts: list[int], p: int, f: int, rel: float) -> tuple[dict, float]:
    """The JSON result of timing both ways, and how many times the useful work the padded call does."""
    useful, padded_flops = attention_flops(batch)
    ms_padded, ms_units = timed(batch.padded), timed(batch.per_unit)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(torch.device("cuda")),
        "torch": torch.__version__,
        "contexts_frames": contexts,
        "tokens_per_frame": p,
        "chunk_frames": f,
        "relative_difference": rel,
        "padded_masked_ms": ms_padded,
        "per_unit_exact_ms": ms_units,
        "useful_tflop": useful / 1e12,
        "padded_tflop": padded_flops / 1e12,
        "padded_useful_tflops": useful / ms_padded / 1e9,
        "per_unit_useful_tflops": useful / ms_units / 1e9,
        "speedup": ms_padded / ms_units,
    }
    return result, padded_flops / useful


def print_result(result: dict, padding_overhead: float) -> None:
    contexts, p, f = result["contexts_frames"], result["tokens_per_frame"], result["chunk_frames"]
    print(
        f"{len(contexts)} units, contexts {contexts} frames x {p} tokens, chunk {f} frames, bf16:\n"
        f"  padded + mask, one call : {result['padded_masked_ms']:7.2f} ms "
        f"({result['padded_useful_tflops']:.0f} useful TFLOP/s; "
        f"{padding_overhead:.2f}x the useful work)\n"
        f"  exact length, per unit  : {result['per_unit_exact_ms']:7.2f} ms "
        f"({result['per_unit_useful_tflops']:.0f} useful TFLOP/s)\n"
        f"  speedup {result['speedup']:.2f}x, relative difference {result['relative_difference']:.1e}"
    )


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    p, f = args.tokens_per_frame, args.chunk_frames
    contexts = [int(c) for c in args.contexts.split(",")]
    batch = UnitBatch(contexts, p, f)
    # Same results (up to bf16 rounding) before timing anything.
    rel = relative_difference(batch)
    assert rel < 2e-2, rel
    result, padding_overhead = measure(batch, contexts, p, f, rel)
    print_result(result, padding_overhead)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
