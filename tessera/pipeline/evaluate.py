"""Forward-only pass of a pipeline: the loss of a batch through every stage, nothing trained.

Evaluation needs no backward, so no schedule either: each stage runs its micro-batches in
order, receiving micro-batch i's tuple from the previous stage and posting its own to the next
(sends never wait for the receiver, so the stages overlap as in GPipe's forward half). Each
tuple is preceded by its shapes, so micro-batches may differ in rows (the last of an eval set).
A traced stage runs its evaluation graph (`trace.py`: traced in eval mode, so dropout off and
batch norm on its running statistics, which it leaves as they are). The last
stage weighs each micro-batch's loss by its share of the batch, exactly as `Pipeline.train_step`
does, so the result equals the loss a training step on the same batch reports; it is broadcast
to every stage. Messages carry their own tags (above the training step's), and nothing of the
training step (its deferred weight gradients, the tied-gradient exchange) runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessera.pipeline import messages
from tessera.pipeline.microbatch import batch_rows, microbatch_sizes, split_rows
from tessera.runtime.devices import collective_device

__all__ = ["forward_only"]

_EVAL_META_TAG = 1 << 22
"""Micro-batch i's metadata travels with `_EVAL_META_TAG + 2 i`, its tuple with `... + 2 i + 1`."""


@torch.no_grad()
def forward_only(
    pipe: Any, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> float:
    """The mean loss of the batch through `pipe` (a ready `Pipeline`), the same on every stage.

    `inputs` / `targets` as for `Pipeline.train_step`: the first stage (every stage of a traced
    pipeline) needs `inputs`, the last `targets`; a middle stage learns the micro-batch sizes
    from the previous stage's metadata. Collective over the pipeline's group.
    """
    first, last = pipe.is_first, pipe.is_last
    stage = getattr(pipe.stage, "for_eval", None) or pipe.stage
    needs_inputs = first or pipe.split is not None
    sizes: list[int] = []
    if needs_inputs or last:
        rows = batch_rows(inputs if needs_inputs else targets)
        sizes = microbatch_sizes(rows, pipe.num_microbatches)
    if getattr(stage, "rows", None) is not None and set(sizes) != {stage.rows}:
        raise ValueError(  # every stage of a traced pipeline has the batch: all raise alike
            f"this model's traced graph fixes the rows of a micro-batch to {stage.rows}, so "
            f"evaluation needs batches of {stage.rows * pipe.num_microbatches} rows, not {rows}"
        )
    micro_inputs = split_rows(inputs, sizes) if needs_inputs and inputs is not None else []
    micro_targets = split_rows(targets, sizes) if last else []
    total = torch.zeros(())
    outbox = []  # gloo sends in flight, with their tensors (kept alive until they complete)
    i = 0
    while i < len(sizes) or (i == 0 and not sizes):  # (a middle stage learns the sizes)
        received: tuple = ()
        if not first:  # shapes first: gloo needs the exact receive size
            meta = pipe.links.recv(
                (messages.meta_length(pipe.num_microbatches),),
                torch.int64,
                pipe.stage_index - 1,
                _EVAL_META_TAG + 2 * i,
            )
            specs, sizes = messages.decode_specs(meta)
            parts = [(spec.shape, spec.dtype) for spec in specs]
            message = pipe.links.recv(
                *messages.layout(parts), pipe.stage_index - 1, _EVAL_META_TAG + 2 * i + 1
            )
            received = messages.unpack(message, parts)
        size = sizes[i]
        out = stage.run(micro_inputs[i] if micro_inputs else None, received)
        if last:
            share = loss_fn(out, micro_targets[i]).detach() * (size / sum(sizes))
            total = total.to(share.device) + share  # accumulated on the loss's device
            i += 1
            continue
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        outbox.append(_send(pipe, messages.encode_specs(out, sizes), _EVAL_META_TAG + 2 * i))
        outbox.append(_send(pipe, messages.pack(out), _EVAL_META_TAG + 2 * i + 1))
        i += 1
    for work, _ in outbox:
        pipe.links.wait(work, "pipeline evaluation send")
    if pipe.num_stages == 1:
        return float(total)
    # NCCL broadcasts device tensors only; every stage sends or receives one float32
    value = total.float().reshape(1).to(collective_device(pipe.group), copy=True)
    dist.broadcast(value, src=pipe.links.ranks[-1], group=pipe.group)
    return float(value)


def _send(pipe: Any, tensor: torch.Tensor, tag: int) -> tuple[Any, torch.Tensor]:
    return pipe.links.send(tensor, pipe.stage_index + 1, tag), tensor
