"""Many tensors as one flat buffer, and back: one message instead of one per tensor.

Broadcasting or all-reducing a model tensor by tensor pays a collective's latency per tensor;
concatenating them first pays it once. `flatten` copies (the tensors need not be contiguous or of
one storage) and `unflatten_into` copies the result back into the same tensors, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flatten", "unflatten_into"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor holding every tensor's elements, in order (all of one dtype)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"flatten needs tensors of one dtype, got {sorted(map(str, dtypes))}")
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` back into `tensors` (the inverse of `flatten`)."""
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"flat buffer has {flat.numel()} elements, the tensors {total}")
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
