"""benchmarks/sampler_sharpness.py's `snap:` sampler: the environment redraws a true frame
as it is, and with a redraw that returned the truth the snapping rollout would be teacher
forcing exactly (CPU, the smoke-sized PushT delta model)."""

from __future__ import annotations

import numpy as np
import torch

from streamworld.engine.reference import GenerationRequest, ReferenceGenerator
from streamworld.models.presets import PUSHT
from streamworld.models.world_model import WorldModel
from streamworld.pusht.evaluate import record_eval_episode, true_latents
from streamworld.pusht.train import smoke_config
from streamworld.pusht.world import locate
from tests.conftest import load_script


def _bench():
    return load_script("benchmarks/sampler_sharpness.py")


def _model() -> WorldModel:
    torch.manual_seed(5)
    return WorldModel.load(smoke_config(PUSHT).with_prediction("delta"), random_weights=True)


def test_a_true_frame_is_redrawn_as_it_is():
    """The scene fitted to a true frame, drawn by the environment, is that frame: the block
    where it was (the drawing must not keep the bodies' earlier places) and few pixels off."""
    model = _model()
    ep = record_eval_episode(3, 32, model.config.height)
    snap = _bench().SnappingGenerator(model)
    for frame in ep.frames[[0, 16, 32]]:
        redrawn = snap._redraw(frame)
        assert np.abs(redrawn.astype(int) - frame.astype(int)).mean() < 0.5
        assert np.hypot(*np.subtract(locate(redrawn).block, locate(frame).block)) < 0.3
    assert (snap.snapped, snap.kept) == (3, 0)
    blank = np.full_like(ep.frames[0], 255)  # nothing to fit: committed as predicted
    assert snap._redraw(blank) is blank and snap.kept == 1


def test_snapping_with_a_redraw_that_returns_the_truth_is_teacher_forcing():
    """Each chunk's K/V and the frame a delta is added to come from the redrawn frames: were
    they the true frames, the rollout equals the reference's teacher-forced one, frame for
    frame, and differs from free-running."""
    model = _model()
    fpc, chunks = model.config.frames_per_chunk, 3
    ep = record_eval_episode(4, chunks * fpc, model.config.height)
    bench = _bench()

    class Truth(bench.SnappingGenerator):
        def _redraw(self, frame):
            self.snapped += 1
            return ep.frames[self.snapped]

    request = dict(seed=0, num_chunks=chunks, image=ep.frames[0], actions=ep.actions, kv_mode="clean")
    truth = Truth(model)
    snapped = truth.generate(GenerationRequest(**request))
    assert truth.snapped == chunks * fpc
    reference = ReferenceGenerator(model)
    forced = reference.generate(GenerationRequest(**request, context_latents=true_latents(model, ep.frames)))
    torch.testing.assert_close(snapped.latents, forced.latents, atol=1e-5, rtol=1e-5)
    free = reference.generate(GenerationRequest(**request))
    assert not torch.allclose(snapped.latents[:, fpc:], free.latents[:, fpc:], atol=1e-3)
