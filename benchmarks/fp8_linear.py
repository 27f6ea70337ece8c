"""Would FP8 linear layers speed up the DiT? The Wan 1.3B DiT's matrix shapes in bf16 against
FP8 (e4m3, per-row activation scales and per-column weight scales, `torch._scaled_mm`),
quantisation of the activations included, on this GPU.

    python benchmarks/fp8_linear.py --json fp8.json

For each linear layer of one block (self-attention q, k, v, o; cross-attention q, o; the
two FFN matrices) at the query tokens of one chunk (480x832: 3 x 1560; 320x512: 3 x 640, and
8 chunks batched), it times bf16 `F.linear` and the FP8 path (the median of many runs,
CUDA events) and the FP8 output's relative error against bf16 (random inputs of unit
scale, weights as Wan initialises them). The sum over a block's layers, times 30 blocks,
is the matrix-product time of one forward each way. Needs a GPU with FP8 (sm89+).
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

D, DFF = 1536, 8960
# (name, in features, out features, count per block)
LAYERS = (("attention projection", D, D, 6), ("ffn up", D, DFF, 1), ("ffn down", DFF, D, 1))
TOKENS = {"480x832, 1 chunk": 3 * 1560, "320x512, 1 chunk": 3 * 640, "320x512, 8 chunks": 8 * 3 * 640}
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x / scale as e4m3, scale [M, 1] float32), one scale per row."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16; w8 [N, K] e4m3 with w_scale [1, N]; the output in bf16."""
    x8, x_scale = quantise_rows(x)
    return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=torch.bfloat16)


def timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def measure(tokens: int, k: int, n: int, repeats: int) -> dict:
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    w8, w_scale = quantise_rows(w)  # one scale per output feature
    w_scale = w_scale.t().contiguous()
    ref = F.linear(x, w, bias)
    out = fp8_linear(x, w8, w_scale, bias)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    bf16_s = timed(lambda: F.linear(x, w, bias), repeats)
    fp8_s = timed(lambda: fp8_linear(x, w8, w_scale, bias), repeats)
    x8, x_scale = quantise_rows(x)
    mm_only_s = timed(
        lambda: torch._scaled_mm(
            x8, w8.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=torch.bfloat16
        ),
        repeats,
    )
    return {"bf16_s": bf16_s, "fp8_s": fp8_s, "fp8_matmul_only_s": mm_only_s, "rel_error": rel}


def run(repeats: int) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("fp8_linear.py measures a GPU; PyTorch sees none here")
    results = {}
    for label, tokens in TOKENS.items():
        rows, bf16, fp8 = [], 0.0, 0.0
        for name, k, n, count in LAYERS:
            r = measure(tokens, k, n, repeats)
            rows.append({"layer": name, "in": k, "out": n, "per_block": count, **r})
            bf16 += 30 * count * r["bf16_s"]
            fp8 += 30 * count * r["fp8_s"]
        results[label] = {"tokens": tokens, "layers": rows, "forward_bf16_s": bf16, "forward_fp8_s": fp8}
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50, help="timed runs per case (default 50)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    result = run(args.repeats)
    for label, r in result["results"].items():
        print(
            f"{label}: matrix products of one forward {r['forward_bf16_s'] * 1e3:.1f} ms bf16, "
            f"{r['forward_fp8_s'] * 1e3:.1f} ms fp8 ({r['forward_bf16_s'] / r['forward_fp8_s']:.2f}x)"
        )
        for row in r["layers"]:
            print(
                f"  {row['layer']:22s} {row['in']}x{row['out']}: bf16 {row['bf16_s'] * 1e6:7.1f} us, "
                f"fp8 {row['fp8_s'] * 1e6:7.1f} us (matmul alone {row['fp8_matmul_only_s'] * 1e6:7.1f} us), "
                f"rel err {row['rel_error']:.1e}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
