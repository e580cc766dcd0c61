"""Character-level tokenizer: one id per distinct character, in sorted order.

Small enough to store inside a checkpoint as a plain dict, so a saved model can always decode
its own samples without the corpus it was trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CharTokenizer"]


@dataclass(kw_only=True, frozen=True)
class CharTokenizer:
    """Maps each character of ``chars`` to its index; ``chars`` must be unique characters."""

    chars: str
    """The vocabulary: id ``i`` is ``chars[i]``."""
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.chars:
            raise ValueError("chars must not be empty")
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("chars must not contain duplicate characters")
        object.__setattr__(self, "_ids", {ch: i for i, ch in enumerate(self.chars)})

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary of the sorted distinct characters of ``text``."""
        return cls(chars="".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a character outside the vocabulary raises ``ValueError``."""
        ids = self._ids
        try:
            return [ids[ch] for ch in text]
        except KeyError as error:
            char = error.args[0]
            raise ValueError(
                f"character {char!r} at position {text.index(char)} is not in the vocabulary"
            ) from None

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor ``(len(text),)``."""
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of the token ids (a list or a 1-D tensor); an id out of range raises."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise ValueError(f"decode expects a 1-D tensor, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        chars = self.chars
        for i in ids:
            if not 0 <= i < len(chars):
                raise ValueError(f"token id {i} out of range [0, {len(chars)})")
        return "".join(chars[i] for i in ids)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, for checkpoints; inverse of :meth:`from_dict`."""
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> CharTokenizer:
        """Rebuild a tokenizer saved by :meth:`to_dict`."""
        if state.get("type") != "char" or not isinstance(state.get("chars"), str):
            raise ValueError(
                f"not a CharTokenizer dict (need type='char' and a chars string): {state!r:.80}"
            )
        return cls(chars=state["chars"])
