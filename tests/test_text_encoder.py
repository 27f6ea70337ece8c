"""Prompt encoding with umT5: Wan's zero padding, determinism, and the per-prompt cache."""

from __future__ import annotations

import pytest
import torch

from streamworld.models.config import ModelConfig
from streamworld.models.text_encoder import EOS_ID, PAD_ID, ByteTokenizer, TextEncoder

TINY_UMT5 = dict(
    vocab_size=300,
    d_model=16,
    d_kv=8,
    d_ff=32,
    num_layers=2,
    num_heads=2,
    relative_attention_num_buckets=8,
)
TEXT_LEN = 32


def tiny_config() -> ModelConfig:
    return ModelConfig(
        id="t",
        dit={"num_layers": 1, "patch_size": (1, 2, 2)},
        vae={"z_dim": 4, "dim_mult": [1, 2, 2, 2]},
        text_encoder=TINY_UMT5,
        height=32,
        width=32,
        text_len=TEXT_LEN,
        latent_frames_per_chunk=1,
        window_frames=2,
    )


@pytest.fixture
def encoder() -> TextEncoder:
    return TextEncoder.from_config(tiny_config(), seed=0)


def count_forwards(encoder: TextEncoder) -> list[int]:
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    encoder.model.register_forward_hook(hook)
    return calls


def test_byte_tokenizer_appends_eos_pads_and_truncates() -> None:
    tokens = ByteTokenizer()("hé", max_length=6)
    assert tokens["input_ids"].tolist() == [[ord("h") + 3, 0xC3 + 3, 0xA9 + 3, EOS_ID, PAD_ID, PAD_ID]]
    assert tokens["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0]]
    long = ByteTokenizer()("abcdefgh", max_length=4)
    assert long["input_ids"].tolist() == [[ord("a") + 3, ord("b") + 3, ord("c") + 3, EOS_ID]]


def test_encode_returns_text_len_rows_with_zero_padding(encoder: TextEncoder) -> None:
    prompt = "a red cube"
    out = encoder.encode(prompt)
    assert out.shape == (TEXT_LEN, 16)
    assert out.dtype == torch.float32
    real = len(prompt) + 1  # bytes + eos
    assert out[:real].abs().sum(dim=1).gt(0).all()
    assert torch.equal(out[real:], torch.zeros(TEXT_LEN - real, 16))


def test_same_seed_builds_encode_identically_and_prompts_differ(encoder: TextEncoder) -> None:
    torch.manual_seed(99)
    before = torch.random.get_rng_state()
    again = TextEncoder.from_config(tiny_config(), seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(encoder.encode("a blue sphere"), again.encode("a blue sphere"))
    assert not torch.equal(encoder.encode("a blue sphere"), encoder.encode("a green sphere"))
    other_seed = TextEncoder.from_config(tiny_config(), seed=1)
    assert not torch.equal(encoder.encode("a blue sphere"), other_seed.encode("a blue sphere"))


def test_repeated_prompt_is_served_from_cache(encoder: TextEncoder) -> None:
    forwards = count_forwards(encoder)
    first = encoder.encode("a cat")
    second = encoder.encode("a cat")
    assert forwards[0] == 1
    assert torch.equal(first, second)
    info = encoder.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 1, 1)


def test_cache_evicts_least_recently_used_prompt() -> None:
    encoder = TextEncoder.from_kwargs(TINY_UMT5, text_len=TEXT_LEN, seed=0, cache_size=2)
    forwards = count_forwards(encoder)
    encoder.encode("one")
    encoder.encode("two")
    encoder.encode("one")  # "two" is now the oldest
    encoder.encode("three")
    assert forwards[0] == 3
    encoder.encode("one")
    assert forwards[0] == 3
    encoder.encode("two")
    assert forwards[0] == 4
    assert encoder.cache_info().currsize == 2


def test_long_and_empty_prompts(encoder: TextEncoder) -> None:
    long = encoder.encode("x" * 500)
    assert long.shape == (TEXT_LEN, 16)
    assert long.abs().sum(dim=1).gt(0).all()

    empty = encoder.encode("")
    assert empty.shape == (TEXT_LEN, 16)
    assert empty[0].abs().sum() > 0  # the eos token
    assert torch.equal(empty[1:], torch.zeros(TEXT_LEN - 1, 16))


def test_small_vocab_is_refused_for_byte_tokenizer() -> None:
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        TextEncoder.from_kwargs({**TINY_UMT5, "vocab_size": 100}, text_len=TEXT_LEN, seed=0)


def test_from_pretrained_names_the_missing_pieces(encoder: TextEncoder, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextEncoder.from_pretrained(tmp_path / "nowhere")
    encoder.model.save_pretrained(tmp_path / "pipeline" / "text_encoder")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        TextEncoder.from_pretrained(tmp_path / "pipeline")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        TextEncoder.from_pretrained(tmp_path)


def test_from_pretrained_loads_a_pipeline_folder_offline(encoder: TextEncoder, tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "</s>": EOS_ID, "<unk>": 2, "a": 3, "red": 4, "cube": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", EOS_ID)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    encoder.model.save_pretrained(tmp_path / "text_encoder")

    loaded = TextEncoder.from_pretrained(tmp_path, text_len=TEXT_LEN, dtype=torch.float32)
    out = loaded.encode("a red  cube")
    assert out.shape == (TEXT_LEN, 16)
    # Three words and eos, through the same weights as the byte-tokenised model.
    assert out[:4].abs().sum(dim=1).gt(0).all()
    assert torch.equal(out[4:], torch.zeros(TEXT_LEN - 4, 16))
    ids = torch.tensor([[3, 4, 5, EOS_ID]])
    with torch.no_grad():
        expected = encoder.model(input_ids=ids).last_hidden_state[0]
    torch.testing.assert_close(out[:4], expected, atol=1e-5, rtol=1e-5)


def test_non_finite_encodings_raise_and_are_not_cached() -> None:
    encoder = TextEncoder.from_kwargs(TINY_UMT5, text_len=TEXT_LEN, seed=0)
    weight = encoder.model.shared.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.fill_(float("nan"))  # e.g. weights read before their initialisation finished
    with pytest.raises(ValueError, match="non-finite"):
        encoder.encode("a cat")
    assert encoder.cache_info().currsize == 0
    with torch.no_grad():
        weight.copy_(saved)
    assert torch.isfinite(encoder.encode("a cat")).all()  # tried again, not served stale
