"""Attention modules a plan splits by heads: what each needs besides its sliced projections.

Splitting an attention's query/key/value projections by column gives each rank the full q, k and
v of `n_head / t` heads (Megatron-LM's split), but only if the attention then reshapes by the
*local* head count: a module that reshapes by its global `num_heads` would mix heads silently.
And a fused projection (GPT-2's `c_attn`, `3 * hidden` wide, cut by `split_size` into q, k, v)
must be split per q/k/v block (`chunks=3`), not in contiguous halves (rank 0 would get q and half
of k). Each `HeadSplit` below records, for one attention class, which children are the q/k/v
projections, how many blocks each fuses, which output projection must be row-split with them,
and how to make the module use its local heads. `parallelize` applies them to any plan that
names those children, so a user's plan and the built-in ones (`plans.py`) are equally correct.

Classes are recognised by name and module, never by importing transformers. An attention class
not listed here that reshapes by `head_dim` alone (as transformers' BERT and GPT-2 do since 4.48)
works with a plain plan; one that keeps a global head count does not, and no check can see that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

__all__ = ["HEAD_SPLITS", "HeadSplit", "head_split_of"]


@dataclass(frozen=True)
class HeadSplit:
    """How one attention class is split by heads."""

    column: tuple[str, ...]
    """Children split by output features together (the q, k, v projections, or the fused one)."""
    row: tuple[str, ...] = ()
    """Children that must be row-split with them (the output projection, when it is a child)."""
    chunks: dict[str, int] = field(default_factory=dict)
    """Child -> number of equal blocks it fuses (3 for a fused q/k/v); each block is split."""
    heads: Callable[[nn.Module], int] = lambda m: 1
    """The module's global head count (must divide by the tensor-parallel size)."""
    localize: Callable[[nn.Module, int], None] = lambda m, t: None
    """Divide the module's head-count and width attributes by t (called once, after the split)."""
    refuse: Callable[[nn.Module], str | None] = lambda m: None
    """Why this instance cannot be split (None: it can)."""


def _localize_gpt2(attn: nn.Module, t: int) -> None:
    # transformers >= 4.48 reshapes by head_dim and splits by split_size; older versions by
    # num_heads: all three hold local values, head_dim (per head) is unchanged.
    attn.num_heads //= t
    attn.split_size //= t
    attn.embed_dim //= t


def _localize_bert(attn: nn.Module, t: int) -> None:
    attn.num_attention_heads //= t
    attn.all_head_size //= t


def _refuse_gpt2(attn: nn.Module) -> str | None:
    if getattr(attn, "is_cross_attention", False):
        return (
            "a cross-attention GPT2Attention (q_attn separate, c_attn fuses k and v) is not split"
        )
    return None


def _refuse_tessera_gpt(attn: nn.Module) -> str | None:
    return (
        "tessera's CausalSelfAttention reshapes by the full width; split the GPT with "
        "parallelize_gpt (TensorPolicy(plan=None)), which replaces the attention as a whole"
    )


_GPT2 = HeadSplit(
    column=("c_attn",),
    row=("c_proj",),
    chunks={"c_attn": 3},
    heads=lambda m: m.num_heads,
    localize=_localize_gpt2,
    refuse=_refuse_gpt2,
)
_BERT = HeadSplit(
    column=("query", "key", "value"),
    heads=lambda m: m.num_attention_heads,
    localize=_localize_bert,
)

HEAD_SPLITS: dict[tuple[str, str], HeadSplit] = {
    ("transformers", "GPT2Attention"): _GPT2,
    ("transformers", "BertSelfAttention"): _BERT,
    ("transformers", "BertSdpaSelfAttention"): _BERT,  # transformers 4.x's SDPA variant
    ("tessera", "CausalSelfAttention"): HeadSplit(
        column=("qkv",), row=("proj",), refuse=_refuse_tessera_gpt
    ),
}
"""(top-level package, class name) -> its rule."""


def head_split_of(module: nn.Module) -> HeadSplit | None:
    """The rule of `module`'s class, if it is an attention class listed in `HEAD_SPLITS`."""
    cls = type(module)
    return HEAD_SPLITS.get((cls.__module__.split(".")[0], cls.__name__))
