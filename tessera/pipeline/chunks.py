"""Model chunks: the v slices of an `nn.Sequential` one rank holds in an interleaved pipeline.

With p ranks and v chunks per rank the model is cut into p*v contiguous virtual stages; rank s
holds virtual stages s, s+p, ..., s+(v-1)p (Narayanan et al. 2021, section 2.2.2: rank 0 the
first and the (v+1)-th quarter of the layers for v = 2, p = 2). A micro-batch's activation goes
from virtual stage k to k+1, so from rank p-1 back round to rank 0 between chunks: the pipeline's
links form a ring. `ChunkedStage` presents the chunks as one stage (one module for the optimizer,
the state dict and the dp reduction, full-model keys) while the runner runs each chunk on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.pipeline import messages
from tessera.pipeline.microbatch import batch_rows, microbatch_sizes, split_rows
from tessera.pipeline.partition import (
    balance_by_cost,
    check_balance,
    parameter_costs,
    stage_bounds,
)
from tessera.pipeline.stage import StageSlice, shared_parameters, slice_stage

__all__ = ["ChunkedStage", "cut_layers", "forward_only_interleaved", "sum_tied_gradients"]

_EVAL_TAG = 1 << 23
"""Tags of the forward-only pass: metadata `_EVAL_TAG + k`, activations above (see below)."""


@dataclass
class ChunkedStage:
    """This rank's chunks as one stage: `module` an `nn.ModuleList` of the chunks' layers."""

    chunks: list[StageSlice]
    index: int

    def __post_init__(self) -> None:
        self.module = nn.ModuleList([chunk.module for chunk in self.chunks])

    def full_key(self, local_key: str) -> str:
        """`"<chunk>.<layer>.rest"` of the stage's state dict -> the full model's key."""
        head, _, rest = local_key.partition(".")
        return self.chunks[int(head)].full_key(rest)


def cut_layers(
    model: nn.Sequential,
    balance: Sequence[int] | None,
    num_stages: int,
    virtual_stages: int,
    stage: int,
) -> tuple[list[int], list[StageSlice], list[tuple[int, list[int]]]]:
    """Cut `model` into p*v virtual stages (`balance` layer counts, None: by parameters);
    return the checked balance, rank `stage`'s chunks (virtual stages stage, stage+p, ...) and
    the tied parameters `(position, ranks)` held by more than one rank (the chunks of one rank
    share one parameter object, whose gradient accumulates by itself)."""
    total = num_stages * virtual_stages
    if balance is None:
        if len(model) < total:
            raise ValueError(f"{len(model)} layers cannot fill {total} stages")
        balance = balance_by_cost(parameter_costs(model), total)
    balance = check_balance(balance, len(model), total)
    bounds = stage_bounds(balance)
    chunks = [slice_stage(model, bounds, k) for k in range(stage, total, num_stages)]
    ties = []
    for position, virtual in shared_parameters(model, bounds):
        ranks = sorted({k % num_stages for k in virtual})
        if len(ranks) > 1:
            ties.append((position, ranks))
    return balance, chunks, ties


def sum_tied_gradients(
    links: Any, tied: Sequence[tuple[nn.Parameter, int, list[int]]], stage: int, tag_base: int
) -> None:
    """Add the gradients of parameters held by several stages (e.g. tied embeddings).

    Every holder walks its tied parameters in the full model's parameter order and tags each
    exchange with that global position, so two groups held by different stage sets ({0, 3}
    and {1, 3}) never wait for each other: a holder's earlier exchanges involve only groups
    earlier in the same global order, which their holders reach first too.
    """
    for param, position, stages in tied:
        if not param.requires_grad:  # frozen on every holder: a summed zero gradient would let
            continue  # AdamW's weight decay move it
        tag = tag_base + position
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        others = [s for s in stages if s != stage]
        sends = [links.send(grad.detach(), s, tag) for s in others]
        parts = {stage: grad}
        for s in others:
            parts[s] = links.recv(grad.shape, grad.dtype, s, tag)
        for work in sends:  # (None: already copied into a shared-memory ring)
            links.wait(work, "pipeline tied-gradient send")
        total = parts[stages[0]].clone()
        for s in stages[1:]:  # the same order on every holder: identical sums
            total += parts[s]
        param.grad = total


@torch.no_grad()
def forward_only_interleaved(
    pipe: Any, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> float:
    """The batch's mean loss through an interleaved `pipe`, the same on every rank (as
    `evaluate.forward_only` for one chunk per rank; collective over the pipeline's group).

    Each rank runs its chunks in order, all micro-batches of chunk 0, then of chunk 1, ...:
    virtual stage k only waits for k-1, which its rank reaches first, and sends never wait.
    """
    p, m = pipe.num_stages, pipe.num_microbatches
    last_k = p * pipe.virtual_stages - 1
    sizes = (
        microbatch_sizes(batch_rows(inputs if pipe.is_first else targets), m)
        if (pipe.is_first or pipe.is_last)
        else []
    )
    total, outbox = torch.zeros(()), []
    for c, chunk in enumerate(pipe._chunks):
        k = c * p + pipe.stage_index
        specs = None
        if k > 0:
            meta = pipe.links.recv(
                (messages.meta_length(m),), torch.int64, (k - 1) % p, _EVAL_TAG + k
            )
            specs, sizes = messages.decode_specs(meta)
        micro_inputs = split_rows(inputs, sizes) if k == 0 else []
        micro_targets = split_rows(targets, sizes) if k == last_k else []
        for i, size in enumerate(sizes):
            received: tuple = ()
            tag = _EVAL_TAG + p * pipe.virtual_stages + k * m + i
            if specs is not None:
                parts = [(spec.shape_for(size), spec.dtype) for spec in specs]
                message = pipe.links.recv(*messages.layout(parts), (k - 1) % p, tag)
                received = messages.unpack(message, parts)
            out = chunk.run(micro_inputs[i] if micro_inputs else None, received)
            if k == last_k:
                total += loss_fn(out, micro_targets[i]).detach() * (size / sum(sizes))
                continue
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            to = (k + 1) % p
            if i == 0:  # shapes first: gloo needs the exact receive size
                meta = messages.encode_specs(out, sizes)
                outbox.append((pipe.links.send(meta, to, _EVAL_TAG + k + 1), meta))
            packed = messages.pack(out)
            outbox.append((pipe.links.send(packed, to, tag + m), packed))
    for work, _ in outbox:  # (the tensors stay referenced until their sends complete)
        pipe.links.wait(work, "pipeline evaluation send")
    value = total.reshape(1).clone()
    dist.broadcast(value, src=pipe.links.ranks[-1], group=pipe.group)
    return float(value)
