"""Model side: the causal Wan DiT, VAE, text encoder, schedules, checkpoints and presets.

Nothing here imports `streamworld.engine` or `streamworld.server`.
"""

from .config import KV_MODES, ModelConfig
from .presets import PRESETS, get_preset

__all__ = ["KV_MODES", "PRESETS", "ModelConfig", "get_preset"]
