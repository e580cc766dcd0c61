"""The reference GPT as an `nn.Sequential` a pipeline can cut: embed, blocks, head.

`gpt_as_sequential(gpt)` shares the GPT's own modules (no copies): layer 0 holds `wte`, `wpe`,
`drop` and runs `GPT.embed`; layers 1..n are the blocks; layer n+1 holds `ln_f` and `lm_head` and
runs `GPT.head`. The output head is tied to the token embedding, so the same parameter sits in the
first and the last layer: a `Pipeline` finds it and adds the two stages' gradients after backward
(Megatron-LM's embedding all-reduce, Shoeybi et al. 2019), which keeps both copies equal to the
unsplit model's single matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tessera.models import GPT
from tessera.pipeline.layers import Layers

__all__ = [
    "gpt_as_sequential",
    "gpt_balance",
    "gpt_layers",
    "gpt_split",
    "gpt_state_from_sequential",
]


class _Embed(nn.Module):
    """Token ids (B, T) -> residual stream (B, T, C): the GPT's own `embed`, on its modules."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.config = gpt.config
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Run `GPT.embed` with this module's (shared) embeddings."""
        return GPT.embed(self, idx)  # type: ignore[arg-type]  # duck-typed: same attributes


class _Head(nn.Module):
    """Residual stream (B, T, C) -> logits (B, T, vocab): the GPT's own `head`."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run `GPT.head` with this module's (shared) layers."""
        return GPT.head(self, x)  # type: ignore[arg-type]


def gpt_as_sequential(gpt: GPT) -> nn.Sequential:
    """`[embed, *blocks, head]` over the GPT's own modules; same forward as `gpt(idx)`."""
    return nn.Sequential(_Embed(gpt), *gpt.blocks, _Head(gpt))


def gpt_state_from_sequential(
    state: dict[str, torch.Tensor], n_layer: int
) -> dict[str, torch.Tensor]:
    """Rename a `gpt_as_sequential` state dict to the GPT's own keys (`blocks.i.…`, `wte.…`)."""
    renamed = {}
    for key, value in state.items():
        index, _, rest = key.partition(".")
        i = int(index)
        if i == 0 or i == n_layer + 1:
            renamed[rest] = value
        else:
            renamed[f"blocks.{i - 1}.{rest}"] = value
    return renamed


def gpt_balance(n_layer: int, stages: int) -> list[int]:
    """Layer counts of `gpt_as_sequential` over `stages` (virtual) stages: the blocks divided
    evenly (the first `n_layer % stages` stages one more), the embedding with the first stage's
    blocks and the head with the last's, as Megatron-LM assigns transformer layers to chunks."""
    if n_layer < stages:
        raise ValueError(f"{n_layer} GPT blocks cannot fill {stages} pipeline chunks")
    counts = [n_layer // stages + (k < n_layer % stages) for k in range(stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def gpt_split(split: list[str], n_layer: int) -> list[str]:
    """GPT split points ("blocks.3", "ln_f") as layers of `gpt_as_sequential` ("4", "n+1")."""
    layers = {f"blocks.{i}": str(i + 1) for i in range(n_layer)}
    layers["ln_f"] = layers["lm_head"] = str(n_layer + 1)
    out = []
    for name in split:
        if name not in layers:
            raise ValueError(
                f"split point {name!r}: the GPT starts a stage at a block ('blocks.0' .. "
                f"'blocks.{n_layer - 1}') or at its head ('ln_f')"
            )
        out.append(layers[name])
    return out


def gpt_layers(
    model: nn.Module, split: Sequence[str] | None, chunks: int | None = None
) -> Layers | None:
    """The GPT as the `Layers` a pipeline cuts (None for any other model): `gpt_as_sequential`,
    `split` at blocks translated (`gpt_split`), `chunks` (interleaved: pp * v) filled evenly
    by its blocks when no split is given (`gpt_balance`), its own tensor-parallel plan, and the
    state renamed back to the GPT's keys. Every GPT-specific step of the pipeline engines."""
    if not isinstance(model, GPT):
        return None
    n_layer = model.config.n_layer
    return Layers(
        lambda: gpt_as_sequential(model),
        gpt_split(list(split), n_layer) if split is not None else None,
        n_layer + 2,
        balance=gpt_balance(n_layer, chunks) if chunks is not None and split is None else None,
        own_tp_plan=True,
        model_keys=lambda state: gpt_state_from_sequential(state, n_layer),
    )
