"""Decode cost per chunk: the Wan VAE decoder against StreamWorld's lite decoder (GPU).

Both decode the steady-state chunk of a stream (3 latent frames after a first chunk has
filled the causal state) of the `wan2.1-t2v-1.3b` geometry, random weights, in bf16, for
one stream and for a batch of streams (`decode_chunks`, as the engine batches them).
Median of `--repeats` runs timed with CUDA events.

    python benchmarks/decode_speed.py --json decode.json
    python benchmarks/decode_speed.py --sizes 320x512 --batches 1,8 --json decode320.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from datetime import datetime, timezone

import torch
from attention_padding import timed  # benchmarks/ is the script's folder

from streamworld.models import get_preset
from streamworld.models.lite_decoder import LiteDecoder
from streamworld.models.vae import StreamingVAE


def _steady_states(vae: StreamingVAE, batch: int, latents: torch.Tensor):
    states = [vae.new_decoder_state() for _ in range(batch)]
    vae.decode_chunks([latents] * batch, states)  # the first chunk fills the causal state
    return states


def measure(height: int, width: int, batches: list[int], repeats: int) -> list[dict]:
    cfg = get_preset("wan2.1-t2v-1.3b")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, w, f = height // cfg.spatial_ratio, width // cfg.spatial_ratio, cfg.latent_frames_per_chunk
    latents = torch.randn(1, cfg.latent_channels, f, h, w, device=dev, dtype=dtype)
    rows = []
    with torch.device(dev):
        vae = StreamingVAE.from_config(cfg, seed=1)
    vae = vae.to(dev, dtype)
    lite = LiteDecoder.for_model(cfg)
    lite_compiled = copy.deepcopy(lite).to(dev, dtype).compile_for(h, w, f)
    variants = [("wan", None), ("lite", lite), ("lite-compiled", lite_compiled)]
    for name, decoder in variants:
        vae.lite = None
        if decoder is not None:
            vae.use_lite_decoder(decoder)
        for batch in batches:
            states = _steady_states(vae, batch, latents)

            def step(states=states, batch=batch):
                # Each call decodes the next chunk; the state size stays the same.
                vae.decode_chunks([latents] * batch, states)

            ms = timed(step, repeats)
            frames = batch * f * cfg.temporal_ratio
            rows.append(
                {
                    "decoder": name,
                    "size": f"{height}x{width}",
                    "batch": batch,
                    "ms_per_batch": ms,
                    "ms_per_chunk": ms / batch,
                    "frames_per_s": frames / (ms / 1000.0),
                    "parameters": sum(p.numel() for p in (decoder or vae.vae.decoder).parameters()),
                }
            )
            print(
                f"{name:5s} {height}x{width} batch {batch}: {ms:8.1f} ms per batch, "
                f"{ms / batch:7.1f} ms per chunk, {frames / (ms / 1000.0):7.0f} frames/s",
                flush=True,
            )
            del states
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="480x832,320x512", help="frame sizes, height x width")
    parser.add_argument("--batches", default="1,8", help="streams decoded together")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for size in args.sizes.split(","):
        hh, ww = (int(x) for x in size.lower().split("x"))
        rows += measure(hh, ww, batches, args.repeats)
    result = {
        "benchmark": "decode_speed",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
