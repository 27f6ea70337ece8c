"""Distil a `LiteDecoder` from a model's Wan VAE decoder (`streamworld distill-decoder`).

The teacher is the Wan VAE: clips from the user's videos are encoded with its encoder
(posterior mean, normalised as the DiT sees latents) and decoded with its causal decoder;
the lite decoder learns to map the same latents to the same frames (L1 + MSE). Teacher
outputs are computed once, before training, and kept on the host (frames as uint8).
A tenth of the clips (at least one) is held out and the student's PSNR against the teacher
on them is reported and recorded in the weight file's metadata.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .lite_decoder import LiteDecoder, save_lite_decoder
from .vae import StreamingVAE

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".gif")


@dataclass
class DistillConfig:
    steps: int = 3000
    batch_size: int = 4
    # Latent frames per training clip: 6 covers a stream's first chunk and a steady-state one.
    latent_frames: int = 6
    lr: float = 3e-4
    max_clips: int = 400
    seed: int = 0


def video_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"video folder {folder} does not exist")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in VIDEO_SUFFIXES)
    if not files:
        raise ValueError(f"no videos ({', '.join(VIDEO_SUFFIXES)}) under {folder}")
    return files


def _fit(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """Scale so the frame covers height x width, then crop the centre."""
    from PIL import Image

    h, w = frame.shape[:2]
    scale = max(height / h, width / w)
    size = (max(width, round(w * scale)), max(height, round(h * scale)))
    image = Image.fromarray(frame).resize(size, Image.BICUBIC)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return np.asarray(image.crop((left, top, left + width, top + height)))


def read_clips(
    files: list[Path], height: int, width: int, frames: int, max_clips: int
) -> Iterator[np.ndarray]:
    """Non-overlapping clips [frames, height, width, 3] uint8 from the videos, in order."""
    import av

    count = 0
    for path in files:
        try:
            with av.open(str(path)) as container:
                buffer: list[np.ndarray] = []
                for frame in container.decode(video=0):
                    buffer.append(_fit(frame.to_ndarray(format="rgb24"), height, width))
                    if len(buffer) == frames:
                        yield np.stack(buffer)
                        buffer = []
                        count += 1
                        if count >= max_clips:
                            return
        except av.error.FFmpegError as e:
            raise ValueError(f"cannot read video {path}: {e}") from None


@dataclass
class TeacherSet:
    latents: list[torch.Tensor]  # [C, F, h, w] float16, normalised
    frames: list[torch.Tensor]  # [3, T, H, W] uint8, the Wan decoder's output


@torch.inference_mode()
def teacher_set(vae: StreamingVAE, clips: list[np.ndarray], progress: bool = True) -> TeacherSet:
    """Encode each clip and decode it with the Wan decoder (the targets)."""
    if vae.lite is not None:
        raise ValueError("the teacher must decode with the Wan decoder, not a lite decoder")
    latents, frames = [], []
    for clip in tqdm(clips, desc="teacher (Wan VAE)", unit="clip", disable=not progress):
        x = torch.from_numpy(clip).to(vae.device).permute(3, 0, 1, 2).unsqueeze(0)
        x = x.to(vae.dtype) / 127.5 - 1.0  # [1, 3, T, H, W] in [-1, 1]
        mu = vae.vae.encode(x).latent_dist.mode()
        z = vae.normalise(mu.float())
        out = vae.decode_full(z)
        latents.append(z[0].to(torch.float16).cpu())
        frames.append(((out[0].float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu())
    return TeacherSet(latents, frames)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB between two frame tensors in [-1, 1]."""
    mse = F.mse_loss(a.float(), b.float()).item() / 4.0  # on the [0, 1] scale
    return float("inf") if mse == 0 else 10.0 * math.log10(1.0 / mse)


def _batch(data: TeacherSet, idx: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.stack([data.latents[i] for i in idx]).to(device, torch.float32)
    y = torch.stack([data.frames[i] for i in idx]).to(device, torch.float32) / 127.5 - 1.0
    return z, y


def evaluate(decoder: LiteDecoder, data: TeacherSet, idx: list[int], device: torch.device) -> float:
    """Mean PSNR of the decoder against the teacher over clips idx (whole clips, from scratch)."""
    decoder.eval()
    values = []
    with torch.inference_mode():
        for i in idx:
            z, y = _batch(data, [i], device)
            out = decoder(z, [None] * decoder.num_slots, first_chunk=True)
            values.append(psnr(out, y))
    decoder.train()
    return float(np.mean(values))


def distill(
    decoder: LiteDecoder,
    data: TeacherSet,
    config: DistillConfig,
    device: torch.device,
    progress: bool = True,
) -> dict:
    """Train `decoder` (in float32, on `device`) to reproduce the teacher; returns a summary."""
    n = len(data.latents)
    if n < 2:
        raise ValueError(f"distillation needs at least 2 clips (one is held out), got {n}")
    rng = random.Random(config.seed)
    order = list(range(n))
    rng.shuffle(order)
    held = order[: max(1, n // 10)]
    train = order[len(held) :]
    torch.manual_seed(config.seed)
    decoder.to(device, torch.float32).train().requires_grad_(True)
    opt = torch.optim.AdamW(decoder.parameters(), lr=config.lr, weight_decay=0.0)
    warmup = max(1, config.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return config.lr * (step + 1) / warmup
        progress_ = (step - warmup) / max(1, config.steps - warmup)
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress_))

    psnr_before = evaluate(decoder, data, held, device)
    start = time.perf_counter()
    losses: list[float] = []
    bar = tqdm(range(config.steps), desc="distilling", unit="step", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        idx = [train[rng.randrange(len(train))] for _ in range(config.batch_size)]
        z, y = _batch(data, idx, device)
        out = decoder(z, [None] * decoder.num_slots, first_chunk=True)
        loss = F.l1_loss(out, y) + F.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(decoder.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
    decoder.eval().requires_grad_(False)
    return {
        "config": asdict(config),
        "clips_train": len(train),
        "clips_held_out": len(held),
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-max(1, min(50, len(losses) // 5)) :])),
        "held_out_psnr_db_before": psnr_before,
        "held_out_psnr_db": evaluate(decoder, data, held, device),
        "train_s": time.perf_counter() - start,
    }


def save(decoder: LiteDecoder, path: str, summary: dict, teacher: str) -> None:
    save_lite_decoder(
        decoder,
        path,
        {
            "teacher": teacher,
            "steps": str(summary["config"]["steps"]),
            "held_out_psnr_db": f"{summary['held_out_psnr_db']:.2f}",
        },
    )
