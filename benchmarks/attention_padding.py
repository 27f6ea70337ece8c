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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-frame", type=int, default=1560, help="480x832: 1560")
    parser.add_argument("--chunk-frames", type=int, default=3)
    parser.add_argument("--contexts", default="0,3,6,9,12,15,18,18", help="context frames of each unit")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    heads, dim = 12, 128
    p, f = args.tokens_per_frame, args.chunk_frames
    contexts = [int(c) for c in args.contexts.split(",")]
    dev, dt = torch.device("cuda"), torch.bfloat16
    nq = f * p
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(len(contexts), heads, nq, dim, device=dev, dtype=dt, generator=gen)
    keys = [torch.randn(1, heads, (c + f) * p, dim, device=dev, dtype=dt, generator=gen) for c in contexts]
    values = [torch.randn_like(k) for k in keys]
    nk_max = max(k.shape[2] for k in keys)

    def pad(ts):
        return torch.cat([F.pad(t, (0, 0, 0, nk_max - t.shape[2])) for t in ts])

    k_pad, v_pad = pad(keys), pad(values)
    mask = torch.zeros(len(contexts), 1, 1, nk_max, dtype=torch.bool, device=dev)
    for i, k in enumerate(keys):
        mask[i, ..., : k.shape[2]] = True

    def padded():
        return F.scaled_dot_product_attention(q, k_pad, v_pad, attn_mask=mask)

    def per_unit():
        return [
            F.scaled_dot_product_attention(q[i : i + 1], keys[i], values[i]) for i in range(len(contexts))
        ]

    # Same results (up to bf16 rounding) before timing anything.
    a, b = padded(), torch.cat(per_unit())
    rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert rel < 2e-2, rel

    useful = sum(4 * heads * nq * k.shape[2] * dim for k in keys)
    padded_flops = 4 * heads * nq * nk_max * dim * len(contexts)
    ms_padded, ms_units = timed(padded), timed(per_unit)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(dev),
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
    print(
        f"{len(contexts)} units, contexts {contexts} frames x {p} tokens, chunk {f} frames, bf16:\n"
        f"  padded + mask, one call : {ms_padded:7.2f} ms "
        f"({result['padded_useful_tflops']:.0f} useful TFLOP/s; "
        f"{padded_flops / useful:.2f}x the useful work)\n"
        f"  exact length, per unit  : {ms_units:7.2f} ms "
        f"({result['per_unit_useful_tflops']:.0f} useful TFLOP/s)\n"
        f"  speedup {result['speedup']:.2f}x, relative difference {rel:.1e}"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
