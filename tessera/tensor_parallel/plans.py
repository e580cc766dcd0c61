"""Built-in plans, and one call that splits any supported model: `parallelize_model`.

A plan names modules, so it depends on the architecture. Here are the plans of the models
tessera knows without being told, in Megatron-LM's layout (Shoeybi et al. 2019, figure 3): in each
transformer block the attention's q/k/v projections are column-split (each rank keeps the q, k and
v of `n_head / t` heads) and its output projection row-split; the MLP's up projection is
column-split and its down projection row-split. Embeddings, LayerNorms, poolers, classifier and
LM heads stay replicated: a tied LM head stays tied, and every replicated parameter receives the
same gradient on every rank (f all-reduces the gradient entering each split region).

- tessera's GPT: `parallelize_gpt` (its attention is replaced as a whole).
- Hugging Face GPT-2 (`GPT2Model` and the heads on it): `hf_gpt2_plan`. The fused `c_attn`
  (`Conv1D`, `3 * hidden` wide) is split per q/k/v block and each `GPT2Attention` is made to use
  its local heads (`heads.py` does both for any plan naming `c_attn`).
- Hugging Face BERT (`BertModel` and the heads on it): `hf_bert_plan`; each `BertSelfAttention`
  gets local `num_attention_heads` / `all_head_size`.

Plans name every module explicitly (`h.0.attn.c_attn`, ...): an fnmatch `*` also matches dots, so
`layer.*.output.dense` would catch `layer.0.attention.output.dense` too.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist
from torch import nn

from tessera.models.gpt import GPT
from tessera.tensor_parallel.gpt import parallelize_gpt
from tessera.tensor_parallel.parallelize import parallelize

__all__ = ["builtin_plan", "hf_bert_plan", "hf_gpt2_plan", "parallelize_model"]


def _blocks(model: nn.Module, class_name: str) -> list[str]:
    """Names of the submodules of `model` whose class is transformers' `class_name`."""
    return [
        name
        for name, sub in model.named_modules()
        if type(sub).__name__ == class_name and type(sub).__module__.startswith("transformers.")
    ]


def _plan(blocks: list[str], layout: Mapping[str, str]) -> dict[str, str]:
    return {
        (f"{b}.{child}" if b else child): style for b in blocks for child, style in layout.items()
    }


_GPT2_BLOCK = {
    "attn.c_attn": "column",
    "attn.c_proj": "row",
    "mlp.c_fc": "column",
    "mlp.c_proj": "row",
}
_BERT_LAYER = {
    "attention.self.query": "column",
    "attention.self.key": "column",
    "attention.self.value": "column",
    "attention.output.dense": "row",
    "intermediate.dense": "column",
    "output.dense": "row",
}


def hf_gpt2_plan(model: nn.Module) -> dict[str, str]:
    """Megatron's plan for every `GPT2Block` of a Hugging Face GPT-2 model (empty if none)."""
    return _plan(_blocks(model, "GPT2Block"), _GPT2_BLOCK)


def hf_bert_plan(model: nn.Module) -> dict[str, str]:
    """Megatron's plan for every `BertLayer` of a Hugging Face BERT model (empty if none)."""
    return _plan(_blocks(model, "BertLayer"), _BERT_LAYER)


def builtin_plan(model: nn.Module) -> dict[str, str] | None:
    """The built-in plan of a known Hugging Face architecture (GPT-2, BERT), else None."""
    for make in (hf_gpt2_plan, hf_bert_plan):
        plan = make(model)
        if plan:
            return plan
    return None


def parallelize_model(
    model: nn.Module,
    plan: Mapping[str, str] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Split `model` over `group` in place by `plan`, or by its own plan when `plan` is None
    (tessera's GPT: `parallelize_gpt`; Hugging Face GPT-2 / BERT: the plans above); return it.

    ValueError, before any module changes, for a model with no known plan and none given, and
    for every check of `parallelize`.
    """
    if plan is None:
        if isinstance(model, GPT):
            return parallelize_gpt(model, group=group)
        plan = builtin_plan(model)
        if plan is None:
            raise ValueError(
                f"no built-in tensor-parallel plan for {type(model).__name__}; give one, "
                f"e.g. plan={{'mlp.up': 'column', 'mlp.down': 'row'}} (styles: column, row, "
                f"embedding, vocab, column_gather)"
            )
    return parallelize(model, plan, group=group)
