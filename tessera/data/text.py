"""Text as training items: a tokenizer (characters, or a Hugging Face `tokenizer.json`) and
fixed-length token windows.

A text file (or the `{"text": ...}` lines of a JSON-lines file, joined by newlines) becomes one
token stream cut into consecutive, non-overlapping windows of `block_size` tokens. Each item is
`{"input_ids": window, "labels": window}`: the Hugging Face causal-LM convention (the model shifts
the labels itself), so an `hf:` causal LM trains on it with its own loss, and a `--loss` gets the
batch to shift as it likes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from tessera.data.tokenizer import CharTokenizer
from tessera.errors import ConfigError

__all__ = ["TextTokenizer", "TokenWindows", "load_tokenizer"]


class TextTokenizer:
    """Text -> token ids, and what identifies the vocabulary (stored in checkpoints)."""

    def __init__(self, encode: Any, identity: dict[str, Any]) -> None:
        self._encode = encode
        self.identity = identity
        """Plain data naming the vocabulary: a resumed run must tokenise the same way."""

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of `text`, a 1-D int64 tensor."""
        return torch.tensor(self._encode(text), dtype=torch.long)


def load_tokenizer(path: str | None, text: str) -> TextTokenizer:
    """The tokenizer of a run: the file `path` (via `tokenizers`), else characters of `text`."""
    if path is None:
        chars = CharTokenizer.from_text(text)
        return TextTokenizer(chars.encode, chars.to_dict())
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--tokenizer {path}: no such file")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "--tokenizer needs the `tokenizers` package (pip install tokenizers)"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises its own Exception type for a bad file
        raise ConfigError(f"--tokenizer {path} is not a tokenizers JSON file: {exc}") from None
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    identity = {"type": "tokenizers", "sha256": digest, "vocab_size": tokenizer.get_vocab_size()}
    return TextTokenizer(lambda s: tokenizer.encode(s).ids, identity)


class TokenWindows(torch.utils.data.Dataset):
    """Consecutive windows of `block_size` tokens; item i is `{"input_ids", "labels"}` of
    tokens `[i*block_size, (i+1)*block_size)` (a last partial window is dropped)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() < block_size:
            raise ValueError(
                f"the text has {tokens.numel()} tokens, fewer than one window of {block_size}"
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return self.tokens.numel() // self.block_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        window = self.tokens[index * self.block_size : (index + 1) * self.block_size]
        return {"input_ids": window, "labels": window}
