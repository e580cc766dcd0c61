"""Tensor (feature) parallelism: layers whose weights are split over the ranks of a group.

Megatron-LM's column/row split (Shoeybi et al. 2019): `mappings.py` (the f and g autograd
Functions), `layers.py` (parallel Linear, Embedding, Hugging Face Conv1D, Conv2d),
`cross_entropy.py` (loss over split logits), `styles.py` (what each plan style splits),
`parallelize.py` (apply a plan to a dense module, gather the dense state back), `heads.py`
(attention modules split by heads), `plans.py` (built-in plans: tessera's GPT via `gpt.py`,
Hugging Face GPT-2 and BERT), `policy.py` (`TensorPolicy`).
"""

from tessera.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tessera.tensor_parallel.gpt import ParallelCausalSelfAttention, parallelize_gpt
from tessera.tensor_parallel.layers import (
    ChannelParallelConv2d,
    ColumnParallelConv1D,
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    RowParallelConv1D,
    RowParallelConv2d,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tessera.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from tessera.tensor_parallel.parallelize import (
    STYLES,
    check_plan,
    full_state_dict,
    load_full_state_dict,
    parallelize,
)
from tessera.tensor_parallel.plans import (
    builtin_plan,
    hf_bert_plan,
    hf_gpt2_plan,
    parallelize_model,
)
from tessera.tensor_parallel.policy import TensorPolicy

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
