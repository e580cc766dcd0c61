"""Tensor (feature) parallelism: layers whose weights are split over the ranks of a group.

Megatron-LM's column/row split (Shoeybi et al. 2019): `mappings.py` (the f and g autograd
Functions), `layers.py` (parallel Linear, Embedding, Hugging Face Conv1D, Conv2d),
`cross_entropy.py` (loss over split logits), `styles.py` (what each plan style splits),
`parallelize.py` (apply a plan to a dense module, gather the dense state back), `heads.py`
(attention modules split by heads), `plans.py` (built-in plans: tessera's GPT via `gpt.py`,
Hugging Face GPT-2 and BERT), `policy.py` (`TensorPolicy`).

Names load on first use (PEP 562): importing one module of the package (its `policy`, as
`tessera train`'s config does) does not import the rest.
"""

from __future__ import annotations

from tessera.runtime.lazy import lazy_names
from tessera.tensor_parallel.parallelize import (  # eager: a name of the package is also a module's
    STYLES,
    check_plan,
    full_state_dict,
    load_full_state_dict,
    parallelize,
)

__all__ = [
    "STYLES",
    "ChannelParallelConv2d",
    "ColumnParallelConv1D",
    "ColumnParallelEmbedding",
    "ColumnParallelLinear",
    "ParallelCausalSelfAttention",
    "RowParallelConv1D",
    "RowParallelConv2d",
    "RowParallelLinear",
    "TensorPolicy",
    "VocabParallelEmbedding",
    "builtin_plan",
    "check_plan",
    "copy_to_tensor_parallel",
    "full_state_dict",
    "gather_from_tensor_parallel",
    "hf_bert_plan",
    "hf_gpt2_plan",
    "load_full_state_dict",
    "parallelize",
    "parallelize_gpt",
    "parallelize_model",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "vocab_parallel_cross_entropy",
]

_LAZY = {
    "ChannelParallelConv2d": "tessera.tensor_parallel.layers",
    "ColumnParallelConv1D": "tessera.tensor_parallel.layers",
    "ColumnParallelEmbedding": "tessera.tensor_parallel.layers",
    "ColumnParallelLinear": "tessera.tensor_parallel.layers",
    "ParallelCausalSelfAttention": "tessera.tensor_parallel.gpt",
    "RowParallelConv1D": "tessera.tensor_parallel.layers",
    "RowParallelConv2d": "tessera.tensor_parallel.layers",
    "RowParallelLinear": "tessera.tensor_parallel.layers",
    "TensorPolicy": "tessera.tensor_parallel.policy",
    "VocabParallelEmbedding": "tessera.tensor_parallel.layers",
    "builtin_plan": "tessera.tensor_parallel.plans",
    "copy_to_tensor_parallel": "tessera.tensor_parallel.mappings",
    "gather_from_tensor_parallel": "tessera.tensor_parallel.mappings",
    "hf_bert_plan": "tessera.tensor_parallel.plans",
    "hf_gpt2_plan": "tessera.tensor_parallel.plans",
    "parallelize_gpt": "tessera.tensor_parallel.gpt",
    "parallelize_model": "tessera.tensor_parallel.plans",
    "reduce_from_tensor_parallel": "tessera.tensor_parallel.mappings",
    "scatter_to_tensor_parallel": "tessera.tensor_parallel.mappings",
    "vocab_parallel_cross_entropy": "tessera.tensor_parallel.cross_entropy",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
