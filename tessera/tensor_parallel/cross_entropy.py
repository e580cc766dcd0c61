"""Cross-entropy over logits whose vocabulary dimension is split over the ranks.

Megatron-LM (Shoeybi et al. 2019): the output head is column-parallel, so rank i holds the logits
of vocabulary slice i, `(N, V/t)`. Gathering `(N, V)` logits would move `N V (t-1)/t` elements;
instead three all-reduces of `N` numbers each suffice: the row maximum (for a stable softmax), the
target's logit (owned by one rank, zero elsewhere) and the sum of exponentials. Loss per row:
`log(sum_j exp(z_j - max)) - (z_target - max)`. Backward needs no communication: the gradient of
the local logits is `softmax_local - onehot_local(target)`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tessera.tensor_parallel._comm import all_reduce, group_rank

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-row loss from split logits with three all-reduces of N numbers.
    Backward: local softmax minus the local one-hot of the target, times the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        logits = logits.float()  # (N, V/t)
        row_max = all_reduce(logits.max(dim=-1).values, group, op="max")  # (N,)
        shifted = logits - row_max.unsqueeze(-1)
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        outside = (targets < start) | (targets >= start + local_vocab)
        local_target = (targets - start).masked_fill(outside, 0)  # (N,)
        rows = torch.arange(logits.shape[0], device=logits.device)
        target_logit = shifted[rows, local_target].masked_fill(outside, 0.0)
        target_logit = all_reduce(target_logit, group)  # owned by exactly one rank
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)  # (N,)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        grad_logits = softmax.clone()
        grad_logits[rows, local_target] -= (~outside).to(softmax.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-position cross-entropy from vocabulary-split logits `(..., V/t)` and targets `(...)`.

    Returns a loss of shape `targets.shape` (take `.mean()` for the usual loss); equals
    `F.cross_entropy(full_logits, targets, reduction="none")`.
    """
    flat = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), group
    )
    return flat.reshape(targets.shape)
