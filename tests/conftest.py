from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from streamworld.models import get_preset
from streamworld.models.config import ModelConfig
from streamworld.models.world_model import WorldModel

# Tests share the machine's two cores; one intra-op thread avoids OpenMP spin contention.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str):
    """A script of the repository (`path` from its root, e.g. "benchmarks/plan_cost.py"),
    imported as a module without running its `main`."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(**overrides) -> ModelConfig:
    """The tiny-wan preset with overrides (e.g. action_dim, needs_image, a smaller frame)."""
    return dataclasses.replace(get_preset("tiny-wan"), **overrides)


def load_tiny(**overrides) -> WorldModel:
    return WorldModel.load(tiny_config(**overrides), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_model() -> WorldModel:
    return load_tiny()
