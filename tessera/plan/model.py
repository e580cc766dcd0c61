"""What the planner knows of the model: a GPT's shape, a bare parameter count, or a module counted.

A GPT shape (l, h, a, s, V) gives everything: parameters (Narayanan et al. eq. 2), FLOPs per
iteration (eq. 3) and activations (Korthikanti et al.). A bare `--params 7.5B` gives model states
only (no activations, FLOPs 6 Ψ per token). A module (any `--model` the trainer accepts) is
counted: its parameters exactly; its FLOPs as 6 Ψ per token (forward 2Ψ, backward 4Ψ: Kaplan et
al. 2020, section 2.1, leaving out attention's s-dependent term), and, if it is tessera's GPT,
its shape, so the transformer formulas apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from tessera.plan.formulas import activation_bytes_per_layer, flops_per_token, gpt_params

__all__ = ["ModelSpec", "from_module", "parse_count"]

_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_count(text: str | float, flag: str = "--params") -> float:
    """'7.5B' -> 7.5e9, '312T' -> 3.12e14, '80GB' -> 8e10, '600GB/s' -> 6e11 (SI prefixes)."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(
        r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMGTPB]?)(?:i?B)?(?:/s)?\s*", text, re.I
    )
    if not match:
        raise ValueError(f"{flag} {text!r}: expected a number with an optional K/M/B/G/T suffix")
    return float(match.group(1)) * _SUFFIX[match.group(2).upper()]


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A model as the planner sees it; `layers` is 0 for a bare parameter count."""

    params: float
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    seq: int = 2048
    vocab: int = 0
    name: str = "model"

    @classmethod
    def gpt(cls, *, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> ModelSpec:
        """A GPT of that shape; its parameter count from Narayanan et al. eq. (2)."""
        for flag, value in (("layers", layers), ("hidden", hidden), ("heads", heads)):
            if value < 1:
                raise ValueError(f"--{flag} must be at least 1, got {value}")
        if hidden % heads:
            raise ValueError(f"--hidden {hidden} must be divisible by --heads {heads}")
        params = gpt_params(layers, hidden, vocab, seq)
        name = f"gpt l={layers} h={hidden} a={heads} s={seq} V={vocab}"
        return cls(
            params=params,
            layers=layers,
            hidden=hidden,
            heads=heads,
            seq=seq,
            vocab=vocab,
            name=name,
        )

    @property
    def is_transformer(self) -> bool:
        """A shape is known (the transformer formulas apply), not a bare parameter count."""
        return self.layers > 0

    def flops_per_token(self, *, recompute: bool = False) -> float:
        """Model FLOPs per token: Narayanan et al. eq. 3 for a GPT, else 6Ψ (8Ψ recomputing)."""
        if self.is_transformer:
            return flops_per_token(
                self.seq, self.layers, self.hidden, self.vocab, recompute=recompute
            )
        return (8.0 if recompute else 6.0) * self.params

    @property
    def tensors(self) -> int:
        """Parameter tensors: a GPT block's 12 (two layer norms' weight and bias, four linear
        layers' weight and bias), the token and position embeddings and the final norm's two
        (the head tied to the token embedding); a bare parameter count is one tensor."""
        return 12 * self.layers + 4 if self.layers else 1

    def params_outside_layers(self) -> float:
        """Parameters outside the transformer layers: the token and position embeddings (the
        head tied to the first), (V + s) h of eq. (2); ZeRO-3's root unit, kept gathered from
        the forward to the backward (`zero.stage3`). 0 for a bare parameter count."""
        return float((self.vocab + self.seq) * self.hidden) if self.is_transformer else 0.0

    def tensor_replicated_params(self) -> float:
        """Parameters every tensor-parallel rank holds whole, as Megatron-LM splits a GPT
        (Shoeybi et al. 2019, section 3): the layer norms (two per layer and the final one,
        weight and bias), the row-parallel layers' biases (added once, after the all-reduce:
        two per layer) and the position embedding; the word embedding is split over the
        vocabulary. 0 for a bare parameter count (it is split evenly)."""
        if not self.is_transformer:
            return 0.0
        h = self.hidden
        return float(self.layers * (4 * h + 2 * h) + 2 * h + self.seq * h)

    def activation_bytes(
        self, b: int, *, layers: float, t: int = 1, recompute: str = "none"
    ) -> float:
        """Activation bytes of `layers` layers for one micro-batch of b sequences (0 if unknown).

        16-bit activations (Korthikanti et al. 2022) with sequence parallelism when t > 1, as
        Megatron runs it; `formulas.activation_bytes_per_layer` has the variants.
        """
        if not self.is_transformer:
            return 0.0
        per_layer = activation_bytes_per_layer(
            self.seq, b, self.hidden, self.heads, t=t, sequence_parallel=t > 1, recompute=recompute
        )
        return per_layer * layers


def from_module(module: nn.Module, *, seq: int | None = None, name: str = "module") -> ModelSpec:
    """Count a module: tessera's GPT keeps its shape; any other module its parameter count."""
    config = getattr(module, "config", None)
    params = float(sum(p.numel() for p in module.parameters()))
    needed = ("n_layer", "n_embd", "n_head", "block_size", "vocab_size")
    if config is not None and all(hasattr(config, k) for k in needed):
        return ModelSpec(
            params=params,
            layers=config.n_layer,
            hidden=config.n_embd,
            heads=config.n_head,
            seq=seq or config.block_size,
            vocab=config.vocab_size,
            name=name,
        )
    return ModelSpec(params=params, seq=seq or 1, name=name)
