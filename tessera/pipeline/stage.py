"""A pipeline stage: this rank's slice of an `nn.Sequential`, and its links to the other stages.

The stage is built from the user's model itself (the same layer objects, no copies), so an
optimizer built on `stage.module` trains the user's parameters. A parameter used by layers of
several stages (a language model's embedding tied to its output head) exists once per stage; the
stages holding it add their gradients after backward, as Megatron-LM does for the word embedding
(Shoeybi et al. 2019), so every copy takes the same step and the model equals the unsplit one.

Links are point-to-point messages over the pipeline's group: `isend` returns at once (its `Work` is
waited for at the end of the step), `recv` blocks with a deadline. Only the runner calls them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tessera.errors import CollectiveTimeout

__all__ = ["Links", "StageSlice", "shared_parameters", "slice_stage"]


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


class Links:
    """Point-to-point messages between the stages of one pipeline group, with deadlines."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.bytes_sent = 0

    def send(self, tensor: torch.Tensor, stage: int, tag: int) -> dist.Work:
        """Post `tensor` to `stage` without waiting; wait on the returned `Work` later."""
        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, dst=self.ranks[stage], group=self.group, tag=tag)

    def post_recv(
        self, shape: torch.Size, dtype: torch.dtype, stage: int, tag: int
    ) -> tuple[dist.Work, torch.Tensor]:
        """Post a receive of `shape`/`dtype` from `stage` without waiting: `(work, buffer)`."""
        buffer = torch.empty(shape, dtype=dtype)
        return dist.irecv(buffer, src=self.ranks[stage], group=self.group, tag=tag), buffer

    def recv(self, shape: torch.Size, dtype: torch.dtype, stage: int, tag: int) -> torch.Tensor:
        """Receive `shape`/`dtype` from `stage`; CollectiveTimeout past the deadline."""
        work, buffer = self.post_recv(shape, dtype, stage, tag)
        self.wait(work, f"pipeline recv from stage {stage} (tag {tag})")
        return buffer

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for `work` at most the deadline."""
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise CollectiveTimeout(
                dist.get_rank(), what, self.timeout_s, "a neighbouring stage stopped or diverged"
            ) from exc


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
