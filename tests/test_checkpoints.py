"""Wan DiT checkpoints in every supported layout load into the same diffusers model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
from diffusers import WanTransformer3DModel

from streamworld.models.checkpoint import CheckpointLayoutError, load_dit_state_dict, load_into

TINY_DIT = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    rope_max_seq_len=64,
)
TINY_I2V = dict(image_dim=8, added_kv_proj_dim=16)

# Diffusers name -> original Wan name, written from the Wan reference model's module names.
# The first pattern that matches is applied, once.
DIFFUSERS_TO_ORIGINAL = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"^condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"\.scale_shift_table$", ".modulation"),
    (r"\.attn1\.to_q\.", ".self_attn.q."),
    (r"\.attn1\.to_k\.", ".self_attn.k."),
    (r"\.attn1\.to_v\.", ".self_attn.v."),
    (r"\.attn1\.to_out\.0\.", ".self_attn.o."),
    (r"\.attn1\.norm_q\.", ".self_attn.norm_q."),
    (r"\.attn1\.norm_k\.", ".self_attn.norm_k."),
    (r"\.attn2\.to_q\.", ".cross_attn.q."),
    (r"\.attn2\.to_k\.", ".cross_attn.k."),
    (r"\.attn2\.to_v\.", ".cross_attn.v."),
    (r"\.attn2\.to_out\.0\.", ".cross_attn.o."),
    (r"\.attn2\.norm_q\.", ".cross_attn.norm_q."),
    (r"\.attn2\.norm_k\.", ".cross_attn.norm_k."),
    (r"\.attn2\.add_k_proj\.", ".cross_attn.k_img."),
    (r"\.attn2\.add_v_proj\.", ".cross_attn.v_img."),
    (r"\.attn2\.norm_added_k\.", ".cross_attn.norm_k_img."),
    # The cross-attention norm: norm3 in Wan, norm2 in diffusers.
    (r"\.norm2\.", ".norm3."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
]

ORIGINAL_T2V_KEYS = {
    "blocks.0.self_attn.q.weight",
    "blocks.0.cross_attn.norm_k.weight",
    "blocks.0.norm3.weight",
    "blocks.0.ffn.0.weight",
    "blocks.0.modulation",
    "head.head.weight",
    "head.modulation",
    "patch_embedding.weight",
    "text_embedding.0.weight",
    "text_embedding.2.weight",
    "time_embedding.0.weight",
    "time_embedding.2.weight",
    "time_projection.1.weight",
}


def tiny_dit(seed: int, **overrides: object) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**TINY_DIT, **overrides}).eval()


def original_wan_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    converted = {}
    for key, value in model.state_dict().items():
        pattern, replacement = next(
            ((p, r) for p, r in DIFFUSERS_TO_ORIGINAL if re.search(p, key)), (None, None)
        )
        original = key if pattern is None else re.sub(pattern, replacement, key, count=1)
        converted[original] = value.clone()
    return converted


def load_fresh(path: Path, **overrides: object) -> WanTransformer3DModel:
    model = tiny_dit(seed=123, **overrides)
    load_into(model, load_dit_state_dict(path), what=f"DiT checkpoint {path}")
    return model


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    different = [key for key in want if not torch.equal(got[key], want[key])]
    assert not different, different


@pytest.fixture
def source() -> WanTransformer3DModel:
    return tiny_dit(seed=0)


def test_fresh_models_differ_so_equality_means_loaded(source: WanTransformer3DModel) -> None:
    with pytest.raises(AssertionError):
        assert_same_weights(tiny_dit(seed=123), source)


@pytest.mark.parametrize("layout", ["transformer", "pipeline", "sharded", "bin"])
def test_diffusers_folder_loads(source: WanTransformer3DModel, tmp_path: Path, layout: str) -> None:
    if layout == "transformer":
        source.save_pretrained(tmp_path)
        path = tmp_path
    elif layout == "pipeline":
        source.save_pretrained(tmp_path / "transformer")
        (tmp_path / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "X"]}))
        path = tmp_path
    elif layout == "sharded":
        source.save_pretrained(tmp_path, max_shard_size="16KB")
        assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("diffusion_pytorch_model-*.safetensors"))) > 1
        path = tmp_path
    else:
        source.save_pretrained(tmp_path, safe_serialization=False)
        assert (tmp_path / "diffusion_pytorch_model.bin").is_file()
        path = tmp_path

    assert_same_weights(load_fresh(path), source)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/abs/path.safetensors", 7, ["x"]])
def test_a_shard_index_naming_files_elsewhere_is_refused(
    source: WanTransformer3DModel, tmp_path: Path, shard
) -> None:
    source.save_pretrained(tmp_path, max_shard_size="16KB")
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointLayoutError, match="shard files in the same folder"):
        load_fresh(tmp_path)


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_original_wan_layout_loads(tmp_path: Path, variant: str, suffix: str) -> None:
    extra = TINY_I2V if variant == "i2v" else {}
    source = tiny_dit(seed=0, **extra)
    original = original_wan_state_dict(source)
    assert original.keys() >= ORIGINAL_T2V_KEYS
    if variant == "i2v":
        assert {"img_emb.proj.1.weight", "blocks.0.cross_attn.k_img.weight"} <= original.keys()
    adapter_weight = torch.randn(8, 4)
    original["action_adapter.net.0.weight"] = adapter_weight

    file = tmp_path / f"wan{suffix}"
    if suffix == ".safetensors":
        safetensors.torch.save_file(original, file)
    else:
        torch.save(original, file)

    loaded = load_dit_state_dict(file)
    assert torch.equal(loaded.pop("action_adapter.net.0.weight"), adapter_weight)
    model = tiny_dit(seed=123, **extra)
    load_into(model, loaded, what=f"DiT checkpoint {file}")
    assert_same_weights(model, source)


def test_original_norm2_and_norm3_trade_names(tmp_path: Path) -> None:
    # Diffusers' block has no affine norm3, so the model round trip above never shows the
    # swap going the other way.
    file = tmp_path / "norms.safetensors"
    norm2, norm3 = torch.full((4,), 2.0), torch.full((4,), 3.0)
    weights = {"blocks.7.norm2.weight": norm2, "blocks.7.norm3.weight": norm3}
    safetensors.torch.save_file({**weights, "blocks.7.self_attn.q.weight": torch.zeros(4, 4)}, file)

    loaded = load_dit_state_dict(file)

    assert torch.equal(loaded["blocks.7.norm3.weight"], norm2)
    assert torch.equal(loaded["blocks.7.norm2.weight"], norm3)


def test_causvid_generator_checkpoint_loads(source: WanTransformer3DModel, tmp_path: Path) -> None:
    generator = {"model." + key: value for key, value in original_wan_state_dict(source).items()}
    torch.save({"generator": generator}, tmp_path / "model.pt")

    assert_same_weights(load_fresh(tmp_path / "model.pt"), source)


def test_self_forcing_prefers_generator_ema(source: WanTransformer3DModel, tmp_path: Path) -> None:
    other = tiny_dit(seed=7)
    ema = {"model." + key: value for key, value in original_wan_state_dict(source).items()}
    plain = {"model." + key: value for key, value in original_wan_state_dict(other).items()}
    torch.save({"generator": plain, "generator_ema": ema, "step": 600}, tmp_path / "both.pt")
    torch.save({"generator": plain}, tmp_path / "generator_only.pt")

    assert_same_weights(load_fresh(tmp_path / "both.pt"), source)
    assert_same_weights(load_fresh(tmp_path / "generator_only.pt"), other)


def test_fsdp_and_ddp_prefixes_are_stripped(source: WanTransformer3DModel, tmp_path: Path) -> None:
    wrapped = {
        "module.model._fsdp_wrapped_module." + key: value
        for key, value in original_wan_state_dict(source).items()
    }
    torch.save({"state_dict": wrapped}, tmp_path / "wrapped.pt")

    assert_same_weights(load_fresh(tmp_path / "wrapped.pt"), source)


def test_wrong_layout_names_missing_and_unexpected_keys(
    source: WanTransformer3DModel, tmp_path: Path
) -> None:
    state_dict = dict(source.state_dict())
    del state_dict["blocks.1.attn2.to_k.bias"]
    state_dict["blocks.0.bogus.weight"] = torch.zeros(3)

    with pytest.raises(CheckpointLayoutError) as error:
        load_into(tiny_dit(seed=1), state_dict, what="DiT checkpoint /ckpt/broken")
    message = str(error.value)
    assert message.startswith("DiT checkpoint /ckpt/broken")
    assert "blocks.1.attn2.to_k.bias" in message
    assert "blocks.0.bogus.weight" in message
    assert "generator_ema" in message

    wide = tiny_dit(seed=0, ffn_dim=48)
    wide.save_pretrained(tmp_path)
    with pytest.raises(CheckpointLayoutError) as error:
        load_fresh(tmp_path)
    message = str(error.value)
    assert "blocks.0.ffn.net.0.proj.weight" in message
    assert "(48, 16)" in message and "(32, 16)" in message


def test_failed_load_leaves_the_model_untouched(source: WanTransformer3DModel) -> None:
    state_dict = dict(source.state_dict())
    del state_dict["proj_out.bias"]
    target = tiny_dit(seed=1)
    before = {key: value.clone() for key, value in target.state_dict().items()}

    with pytest.raises(CheckpointLayoutError):
        load_into(target, state_dict, what="DiT checkpoint")
    assert all(torch.equal(value, before[key]) for key, value in target.state_dict().items())


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.pt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_dit_state_dict(missing)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(empty))):
        load_dit_state_dict(empty)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointLayoutError, match=re.escape(str(garbage))):
        load_dit_state_dict(garbage)

    no_state_dict = tmp_path / "optimizer.pt"
    torch.save({"optimizer": {"lr": 1e-4}}, no_state_dict)
    with pytest.raises(CheckpointLayoutError, match="top-level keys: optimizer"):
        load_dit_state_dict(no_state_dict)
