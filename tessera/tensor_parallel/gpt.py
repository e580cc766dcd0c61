"""Tensor parallelism for the reference GPT: Megatron's split of attention and MLP.

Per block (Shoeybi et al. 2019, figure 3): the fused q/k/v projection is column-parallel with each
rank keeping the q, k and v of its `n_head / t` heads; attention runs on local heads; the output
projection is row-parallel. The MLP's up projection is column-parallel, its down projection
row-parallel. Two all-reduces forward and two backward per block; LayerNorms, embeddings and the
tied head stay replicated (their gradients are equal on every rank, since f all-reduces the
gradient entering each split region). Dropout inside the split attention would draw different
masks than one process; the equivalence tests use dropout 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.models.gpt import GPT, CausalSelfAttention
from tessera.tensor_parallel._comm import group_size
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, keep_frozen
from tessera.tensor_parallel.parallelize import parallelize

__all__ = ["GPT_BLOCK_PLAN", "ParallelCausalSelfAttention", "parallelize_gpt"]

GPT_BLOCK_PLAN = {"blocks.*.mlp.up": "column", "blocks.*.mlp.proj": "row"}
"""The MLP half of the plan; attention is replaced as a whole (its heads are split)."""


class ParallelCausalSelfAttention(nn.Module):
    """`CausalSelfAttention` with its heads split over the ranks of `group`."""

    def __init__(self, attn: CausalSelfAttention, *, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        size = group_size(group)
        if attn.n_head % size:
            raise ValueError(
                f"n_head ({attn.n_head}) is not divisible by the tensor-parallel size {size}"
            )
        self.n_head = attn.n_head // size  # local heads
        self.dropout = attn.dropout
        qkv = ColumnParallelLinear.from_dense(attn.qkv, group=group, chunks=3)
        self.qkv = keep_frozen(attn.qkv, qkv)
        self.proj = keep_frozen(attn.proj, RowParallelLinear.from_dense(attn.proj, group=group))
        self.proj_dropout = attn.proj_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, T, C)` replicated -> `(B, T, C)` replicated."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 x (B, T, C/t)
        hs = q.shape[-1] // self.n_head
        q, k, v = (z.view(B, T, self.n_head, hs).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh/t, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)  # (B, T, C/t)
        return self.proj_dropout(self.proj(y))


def parallelize_gpt(gpt: GPT, *, group: dist.ProcessGroup | None = None) -> GPT:
    """Split every block of `gpt` over `group` in place (weights sliced); return it."""
    size = group_size(group)
    if gpt.config.n_head % size:
        raise ValueError(
            f"n_head ({gpt.config.n_head}) is not divisible by the tensor-parallel size {size}"
        )
    if (4 * gpt.config.n_embd) % size:
        raise ValueError(f"MLP width {4 * gpt.config.n_embd} is not divisible by {size}")
    parallelize(gpt, GPT_BLOCK_PLAN, group=group)
    for block in gpt.blocks:
        block.attn = ParallelCausalSelfAttention(block.attn, group=group)
    return gpt
