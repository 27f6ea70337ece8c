"""Building a WorldModel from presets and local weight folders."""

from __future__ import annotations

import pytest
import torch

from streamworld.models.world_model import WeightPaths, WorldModel
from tests.conftest import load_tiny, tiny_config


def test_pipeline_folder_weights_replace_the_random_ones(tmp_path):
    source = load_tiny(init_seed=11)
    source.dit.transformer.save_pretrained(tmp_path / "transformer")
    source.vae.vae.save_pretrained(tmp_path / "vae")
    loaded = WorldModel.load(tiny_config(), WeightPaths(root=str(tmp_path)))
    default = load_tiny()
    for name, param in loaded.dit.transformer.state_dict().items():
        assert torch.equal(param, source.dit.transformer.state_dict()[name]), name
    for name, param in loaded.vae.vae.state_dict().items():
        assert torch.equal(param, source.vae.vae.state_dict()[name]), name
    some = "blocks.0.attn1.to_q.weight"
    assert not torch.equal(
        default.dit.transformer.state_dict()[some], loaded.dit.transformer.state_dict()[some]
    )


def test_checkpoint_of_another_architecture_is_refused_with_key_names(tmp_path):
    other = load_tiny(dit={**tiny_config().dit, "ffn_dim": 48})
    other.dit.transformer.save_pretrained(tmp_path / "transformer")
    with pytest.raises(ValueError, match=r"ffn\.net\.0\.proj\.weight"):
        WorldModel.load(tiny_config(), WeightPaths(dit=str(tmp_path / "transformer")))


def test_real_preset_refuses_to_start_without_weights():
    from streamworld.models import get_preset

    with pytest.raises(ValueError, match="needs weights"):
        WorldModel.load(get_preset("wan2.1-t2v-1.3b"))


def test_bf16_keeps_precision_sensitive_modules_in_float32():
    model = WorldModel.load(tiny_config(action_dim=2), dtype="bfloat16")
    tr = model.dit.transformer
    assert tr.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert tr.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert tr.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.dit.action_adapter.net[0].weight.dtype == torch.float32


def test_prompt_context_is_computed_once_per_prompt(tiny_model):
    a = tiny_model.text_context("a prompt used twice")
    b = tiny_model.text_context("a prompt used twice")
    assert a is b
    assert len(a.keys) == tiny_model.config.num_layers
    assert not torch.equal(a.keys[0], tiny_model.text_context("another").keys[0])


def test_non_finite_prompt_context_raises_and_is_not_cached(tiny_model, monkeypatch):
    prepare = tiny_model.dit.prepare_text

    def poisoned(embeds):
        ctx = prepare(embeds)
        return type(ctx)([k * float("nan") for k in ctx.keys], ctx.values)

    monkeypatch.setattr(tiny_model.dit, "prepare_text", poisoned)
    with pytest.raises(ValueError, match="non-finite"):
        tiny_model.text_context("a poisoned prompt")
    monkeypatch.undo()
    ctx = tiny_model.text_context("a poisoned prompt")  # computed again, now finite
    assert all(torch.isfinite(k).all() for k in ctx.keys)
