"""Tensor (feature) parallelism: layers whose weights are split over the ranks of a group.

Megatron-LM's column/row split (Shoeybi et al. 2019): `mappings.py` (the f and g autograd
Functions), `layers.py` (parallel Linear, Embedding, Conv2d), `cross_entropy.py` (loss over split
logits), `parallelize.py` (apply a plan to a dense module, gather the dense state back),
`gpt.py` (the plan of the reference GPT).
"""

from tessera.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tessera.tensor_parallel.gpt import ParallelCausalSelfAttention, parallelize_gpt
from tessera.tensor_parallel.layers import (
    ChannelParallelConv2d,
    ColumnParallelLinear,
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
from tessera.tensor_parallel.parallelize import STYLES, full_state_dict, parallelize

__all__ = [
    "STYLES",
    "ChannelParallelConv2d",
    "ColumnParallelLinear",
    "ParallelCausalSelfAttention",
    "RowParallelConv2d",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel",
    "full_state_dict",
    "gather_from_tensor_parallel",
    "parallelize",
    "parallelize_gpt",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "vocab_parallel_cross_entropy",
]
