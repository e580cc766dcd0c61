"""A pipeline stage: this rank's slice of an `nn.Sequential`, and its links to the other stages.

The stage is built from the user's model itself (the same layer objects, no copies), so an
optimizer built on `stage.module` trains the user's parameters. A parameter used by layers of
several stages (a language model's embedding tied to its output head) exists once per stage; the
stages holding it add their gradients after backward, as Megatron-LM does for the word embedding
(Shoeybi et al. 2019), so every copy takes the same step and the model equals the unsplit one.

The links between stages are in `links.py`; this module also encodes the metadata message
(shapes and micro-batch sizes) that the first activation of a step follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["StageSlice", "shared_parameters", "slice_stage"]


@dataclass
class StageSlice:
    """This rank's layers `[start, end)` of the full model, as an `nn.Sequential`."""

    module: nn.Sequential
    index: int
    start: int
    end: int

    def full_key(self, local_key: str) -> str:
        """Map `"<i>.rest"` of the stage's state dict to the full model's `"<start+i>.rest"`."""
        head, _, rest = local_key.partition(".")
        return f"{self.start + int(head)}.{rest}"


def slice_stage(model: nn.Sequential, bounds: list[tuple[int, int]], index: int) -> StageSlice:
    """The stage `index` of `model` cut at `bounds` (sharing the model's layer objects)."""
    start, end = bounds[index]
    return StageSlice(nn.Sequential(*[model[i] for i in range(start, end)]), index, start, end)


def shared_parameters(
    model: nn.Sequential, bounds: list[tuple[int, int]]
) -> list[tuple[int, list[int]]]:
    """Parameters held by more than one stage: `(position in model.parameters(), stages)`.

    Positions follow `model.parameters()` of the full model, identical on every rank, so the
    stages agree on which tied gradient a message carries without exchanging names.
    """
    stages_of: dict[int, set[int]] = {}
    for stage, (start, end) in enumerate(bounds):
        for i in range(start, end):
            for p in model[i].parameters():
                stages_of.setdefault(id(p), set()).add(stage)
    order = {id(p): k for k, p in enumerate(model.parameters())}
    return sorted(
        (order[pid], sorted(stages)) for pid, stages in stages_of.items() if len(stages) > 1
    )


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_META_DIMS = 8


def encode_meta(output: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Describe micro-batch outputs: dtype, ndim, shape of one, dim-0 size of every micro-batch."""
    if output.dim() > _META_DIMS or output.dtype not in _DTYPES:
        raise ValueError(f"stage output {tuple(output.shape)} {output.dtype} cannot be sent")
    shape = list(output.shape) + [0] * (_META_DIMS - output.dim())
    return torch.tensor([_DTYPES.index(output.dtype), output.dim(), *shape, *sizes])


def meta_length(num_microbatches: int) -> int:
    """Length of the metadata message for `num_microbatches`."""
    return 2 + _META_DIMS + num_microbatches


def decode_meta(meta: torch.Tensor) -> tuple[torch.dtype, list[int], list[int]]:
    """`(dtype, shape of micro-batch 0's output without dim 0, dim-0 sizes)` from `encode_meta`."""
    values = meta.tolist()
    dtype, ndim = _DTYPES[values[0]], values[1]
    shape = values[2 : 2 + ndim]
    return dtype, shape[1:], values[2 + _META_DIMS :]
