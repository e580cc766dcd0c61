"""What each rank keeps of a model cut into pipeline stages, and how a tied tensor is found.

Every rank builds the whole model; once cut, it keeps its stage's tensors (and any the caller
names) and moves the rest to the meta device (`release_other_stages`). A tensor several modules
share (T5's `shared`, `encoder.embed_tokens`, `decoder.embed_tokens` and `lm_head`: one tensor)
is held by a stage under whichever of its names that stage's modules use (`held`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["held", "release_other_stages"]


def held(state: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The tensor of `state` under the first of `names` (one tensor's keys) it holds."""
    for name in names:
        if name in state:
            return state[name]
    raise KeyError(f"no stage holds {names[0]!r} (nor its tied names {names[1:]})")


def release_other_stages(model: nn.Module, keep: list[nn.Module | torch.Tensor]) -> None:
    """Free the storage of the tensors other ranks train: this rank keeps only `keep` (its
    stage, and tensors no stage holds if it keeps those).

    Every rank builds the whole model (the same seed gives the same weights everywhere); once
    cut, the tensors of other stages move to the meta device (shape without storage). A tensor
    the stage shares, such as a tied embedding, stays.
    """
    kept = set()
    for item in keep:
        tensors = (
            [item] if isinstance(item, torch.Tensor) else [*item.parameters(), *item.buffers()]
        )
        kept |= {id(t) for t in tensors}
    for owner in model.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if id(param) not in kept:
                setattr(owner, name, nn.Parameter(param.to("meta"), param.requires_grad))
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if id(buffer) not in kept:
                setattr(owner, name, buffer.to("meta"))
