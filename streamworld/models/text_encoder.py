"""The umT5 prompt encoder with a per-prompt cache.

`TextEncoder` turns a prompt into the `[text_len, text_dim]` context the Wan DiT
cross-attends to: the encoder's hidden states for the prompt's real tokens, followed by
zero rows up to `text_len` (Wan's convention). Prompts repeat across streams and requests,
so results are kept in a small LRU cache, bounded by entries and by bytes (keys and tensors
together; `PromptCache`). Tiny test models use `ByteTokenizer`; real umT5
weights come with their own tokenizer files.
"""

from __future__ import annotations

import html
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch import Tensor
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from streamworld.models.config import ModelConfig

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

_TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer_config.json")
# Default byte budget of the embedding cache: 64 umT5-XXL embeddings (512 x 4096 bf16, 4 MiB each).
DEFAULT_CACHE_BYTES = 256 * 2**20

V = TypeVar("V")


class PromptCache(Generic[V]):
    """An LRU map from prompt to tensors, holding at most `max_entries` entries and
    `max_bytes` bytes (the key's string object plus the tensors' storage). An entry larger
    than `max_bytes` on its own is not kept. Not thread-safe: callers hold their own lock."""

    def __init__(self, max_entries: int, max_bytes: int, tensors: Callable[[V], Iterable[Tensor]]) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._tensors = tensors
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> V | None:
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def put(self, key: str, value: V) -> None:
        self.discard(key)
        size = sys.getsizeof(key) + sum(t.nbytes for t in self._tensors(value))
        if self.max_entries < 1 or size > self.max_bytes:
            return
        self._entries[key] = (value, size)
        self.nbytes += size
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.nbytes -= evicted

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1]

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


class ByteTokenizer:
    """UTF-8 bytes as token ids (byte + 3; 0 pad, 1 eos, 2 unk), for tiny models without tokenizer files.

    Called like a transformers tokenizer on one string; returns `input_ids` and
    `attention_mask` as int64 tensors [1, L].
    """

    vocab_size = BYTE_VOCAB_SIZE

    def __call__(
        self,
        text: str,
        *,
        max_length: int,
        padding: str | bool = "max_length",
        truncation: bool = True,
        **_: Any,
    ) -> dict[str, Tensor]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        # Like T5's tokenizer, truncation drops text and keeps the closing eos.
        if len(ids) + 1 > max_length:
            if not truncation:
                raise ValueError(f"prompt of {len(ids) + 1} tokens exceeds max_length={max_length}")
            ids = ids[: max_length - 1]
        ids.append(EOS_ID)
        mask = [1] * len(ids)
        if padding == "max_length":
            pad = max_length - len(ids)
            ids += [PAD_ID] * pad
            mask += [0] * pad
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "attention_mask": torch.tensor([mask], dtype=torch.long),
        }


class PromptCacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int
    currsize: int
    maxbytes: int = 0
    currbytes: int = 0


def clean_prompt(prompt: str) -> str:
    """Wan's prompt clean-up: unescape HTML entities and collapse whitespace."""
    text = html.unescape(html.unescape(prompt))
    return re.sub(r"\s+", " ", text).strip()


class TextEncoder:
    """A umT5 encoder, its tokenizer, and an LRU cache of prompt embeddings."""

    def __init__(
        self,
        model: UMT5EncoderModel,
        tokenizer: Callable[..., Mapping[str, Tensor]],
        *,
        text_len: int,
        cache_size: int = 64,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        if text_len < 1:
            raise ValueError(f"text_len must be positive, got {text_len}")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.text_len = text_len
        self.cache_size = cache_size
        self._cache: PromptCache[Tensor] = PromptCache(cache_size, cache_bytes, lambda t: (t,))
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_kwargs(
        cls,
        umt5_kwargs: Mapping[str, Any],
        *,
        text_len: int,
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        cache_size: int = 64,
    ) -> TextEncoder:
        """A randomly initialised encoder with a `ByteTokenizer`; the global RNG is left untouched."""
        umt5_config = UMT5Config(**umt5_kwargs)
        if umt5_config.vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"ByteTokenizer needs vocab_size >= {BYTE_VOCAB_SIZE}, got {umt5_config.vocab_size}"
            )
        # Built on the target device: the real umT5-XXL is 5.7B parameters.
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = UMT5EncoderModel(umt5_config)
        model = model.to(device=device, dtype=dtype)
        return cls(model, ByteTokenizer(), text_len=text_len, cache_size=cache_size)

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        *,
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> TextEncoder:
        if config.text_encoder is None:
            raise ValueError(f"model {config.id!r} takes no prompt: its config has no text_encoder")
        return cls.from_kwargs(
            config.text_encoder, text_len=config.text_len, seed=seed, device=device, dtype=dtype
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        text_len: int = 512,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        cache_size: int = 64,
    ) -> TextEncoder:
        """Load a local umT5 encoder and its tokenizer; never downloads.

        `path` is a diffusers pipeline folder (`text_encoder/` and `tokenizer/` subfolders) or
        one folder holding both the encoder (config.json and weights) and the tokenizer files.
        """
        model_dir, tokenizer_dir = _find_text_encoder_folders(Path(path))
        model = UMT5EncoderModel.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        return cls(model.to(device), tokenizer, text_len=text_len, cache_size=cache_size)

    # --- encoding -------------------------------------------------------------------
    @property
    def text_dim(self) -> int:
        return int(self.model.config.d_model)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def encode(self, prompt: str) -> Tensor:
        """Prompt -> [text_len, text_dim] in the model's dtype; rows past the prompt's tokens are zero.

        The result may be shared with other callers through the cache: do not modify it.
        """
        key = clean_prompt(prompt)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._hits += 1
                return cached
            self._misses += 1
        # The model runs outside the lock so a slow prompt does not block cache hits.
        embedding = self._run(key)
        if not bool(torch.isfinite(embedding).all()):
            # Not cached: a later request for the prompt tries again.
            raise ValueError("the text encoder gave non-finite values for this prompt")
        with self._lock:
            self._cache.put(key, embedding)
        return embedding

    def cache_info(self) -> PromptCacheInfo:
        with self._lock:
            c = self._cache
            return PromptCacheInfo(self._hits, self._misses, c.max_entries, len(c), c.max_bytes, c.nbytes)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._hits = self._misses = 0

    @torch.inference_mode()
    def _run(self, prompt: str) -> Tensor:
        tokens = self.tokenizer(
            prompt,
            padding="max_length",
            max_length=self.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        input_ids = tokens["input_ids"].to(self.device)  # [1, text_len]
        mask = tokens["attention_mask"].to(self.device)  # [1, text_len]
        seq_len = int(mask.sum())
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state[0]
        out = torch.zeros_like(hidden)  # [text_len, text_dim]
        out[:seq_len] = hidden[:seq_len]
        return out


def _find_text_encoder_folders(path: Path) -> tuple[Path, Path]:
    """(encoder folder, tokenizer folder) under `path`, or a clear error naming what is missing."""
    if path.is_file():
        raise NotImplementedError(
            f"{path} is a checkpoint file; StreamWorld loads umT5 from a transformers folder "
            "(config.json, weights and tokenizer files). Convert or download it to such a folder first."
        )
    if not path.is_dir():
        raise FileNotFoundError(f"text encoder path {path} does not exist")

    originals = sorted(path.glob("*t5*.pth"))
    if originals and not (path / "text_encoder").is_dir():
        raise NotImplementedError(
            f"{originals[0]} is an original Wan umT5 checkpoint; StreamWorld loads the transformers layout "
            "only. Use the text_encoder/ and tokenizer/ folders of a diffusers Wan pipeline instead."
        )

    def has_tokenizer(folder: Path) -> bool:
        return any((folder / name).is_file() for name in _TOKENIZER_FILES)

    if (path / "text_encoder").is_dir():
        model_dir, tokenizer_dir = path / "text_encoder", path / "tokenizer"
    else:
        model_dir, tokenizer_dir = path, path
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"no umT5 encoder config under {path}: expected {model_dir / 'config.json'} "
            f"(a pipeline folder's text_encoder/ or a transformers model folder)"
        )
    if not has_tokenizer(tokenizer_dir):
        raise FileNotFoundError(
            f"no tokenizer files under {path}: expected one of "
            f"{', '.join(_TOKENIZER_FILES)} in {tokenizer_dir}"
        )
    return model_dir, tokenizer_dir
