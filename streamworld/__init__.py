"""StreamWorld: real-time serving of autoregressive video diffusion world models."""

__version__ = "0.1.0"
