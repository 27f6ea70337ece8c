"""Frame arithmetic shared by the model and the engine, free of tensors.

Latent frame 0 decodes to video frame 0 alone; latent frame j >= 1 to the r = temporal_ratio
video frames r(j-1)+1 .. rj (F latent frames decode to 1 + r(F - 1) video frames), and it
is conditioned by the actions of video frames r(j-1) .. rj-1.
"""

from __future__ import annotations


def latent_action_window(latent_frame: int, temporal_ratio: int) -> tuple[int, int]:
    """Video-frame range [start, stop) of the actions that condition a latent frame."""
    if latent_frame == 0:
        return (0, 0)
    return (temporal_ratio * (latent_frame - 1), temporal_ratio * latent_frame)


def actions_needed(first_latent_frame: int, num_latent_frames: int, temporal_ratio: int) -> int:
    """Video frames whose actions a chunk needs (the stop of its action window)."""
    return latent_action_window(first_latent_frame + num_latent_frames - 1, temporal_ratio)[1]
