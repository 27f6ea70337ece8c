"""The GPU profile summary of `streamworld bench --profile`, on a hand-made trace."""

from __future__ import annotations

import pytest

from streamworld.bench import summarise_gpu_trace


def _launch(tid: int, corr: int) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "args": {"correlation": corr}}


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_gpu_time_is_attributed_to_the_launching_executor_and_overlap_counts_once():
    events = [
        _launch(11, 1),
        _launch(11, 2),
        _launch(22, 3),
        _launch(99, 4),
        _kernel("gemm", 0, 100, 1),  # DiT: 0-100
        _kernel("attn", 150, 50, 2),  # DiT: 150-200
        _kernel("conv", 180, 100, 3),  # decode, overlaps the DiT: 180-280
        _kernel("memset", 900, 100, 4),  # a thread that is no executor's
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000, "tid": 11},  # not GPU time
    ]
    out = summarise_gpu_trace(events, {11: "dit", 22: "decode"}, window_us=2000)
    assert out["kernel_s"] == pytest.approx({"dit": 150e-6, "decode": 100e-6, "other": 100e-6})
    # Union of [0,100], [150,280], [900,1000]: 330 us busy of 2000.
    assert out["gpu_busy_s"] == pytest.approx(330e-6)
    assert out["gpu_idle_share"] == pytest.approx(1 - 330 / 2000)
    assert out["top_kernels_s"][0]["name"] in ("gemm", "conv", "memset")
    assert {(k["executor"], k["name"]) for k in out["top_kernels_s"]} == {
        ("dit", "gemm"),
        ("dit", "attn"),
        ("decode", "conv"),
        ("other", "memset"),
    }
    assert out["other_by_thread_s"] == pytest.approx({"99": 100e-6})


def test_profile_needs_cuda(capsys):
    from streamworld.cli import main

    assert main(["bench", "--model", "tiny-wan", "--device", "cpu", "--profile", "--duration", "1"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_utilisation_sampler_reports_why_it_has_no_samples_without_nvml(monkeypatch):
    import time

    import torch

    from streamworld.bench import UtilisationSampler

    def no_nvml(device=None):
        raise ModuleNotFoundError("pynvml is not installed")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    sampler = UtilisationSampler(torch.device("cuda"), interval=0.005)
    while sampler.error is None:
        time.sleep(0.01)
    result = sampler.stop()
    assert result["mean_percent"] is None and result["samples"] == 0 and "pynvml" in result["error"]
    values = iter([40.0, 60.0] + [50.0] * 1000)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: next(values))
    sampler = UtilisationSampler(torch.device("cuda"), interval=0.005)
    while len(sampler.samples) < 2:
        time.sleep(0.01)
    result = sampler.stop()
    assert result["samples"] >= 2 and 40.0 <= result["mean_percent"] <= 60.0 and result["error"] is None
