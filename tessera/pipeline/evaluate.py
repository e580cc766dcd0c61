"""Forward-only pass of a pipeline: the loss of a batch through every stage, nothing trained.

Evaluation needs no backward, so no schedule either: each stage runs its micro-batches in
order, receiving micro-batch i's tuple from the previous stage and posting its own to the next
(sends never wait for the receiver, so the stages overlap as in GPipe's forward half). The last
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
"""Tag of the metadata message; micro-batch i's activations travel with `_EVAL_META_TAG + 1 + i`."""


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
    needs_inputs = first or pipe.split is not None
    sizes: list[int] = []
    if first or last:
        rows = batch_rows(inputs if needs_inputs else targets)
        sizes = microbatch_sizes(rows, pipe.num_microbatches)
    specs = None
    if not first:
        meta = pipe.links.recv(
            (messages.meta_length(pipe.num_microbatches),),
            torch.int64,
            pipe.stage_index - 1,
            _EVAL_META_TAG,
        )
        specs, sizes = messages.decode_specs(meta)
    micro_inputs = split_rows(inputs, sizes) if needs_inputs and inputs is not None else []
    micro_targets = split_rows(targets, sizes) if last else []
    total = torch.zeros(())
    outbox = []  # gloo sends in flight, with their tensors (kept alive until they complete)
    for i, size in enumerate(sizes):
        received: tuple = ()
        if specs is not None:
            parts = [(spec.shape_for(size), spec.dtype) for spec in specs]
            message = pipe.links.recv(
                *messages.layout(parts), pipe.stage_index - 1, _EVAL_META_TAG + 1 + i
            )
            received = messages.unpack(message, parts)
        out = pipe.stage.run(micro_inputs[i] if micro_inputs else None, received)
        if last:
            share = loss_fn(out, micro_targets[i]).detach() * (size / sum(sizes))
            total = total.to(share.device) + share  # accumulated on the loss's device
            continue
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if i == 0:  # shapes first: gloo needs the exact receive size
            outbox.append(_send(pipe, messages.encode_specs(out, sizes), _EVAL_META_TAG))
        outbox.append(_send(pipe, messages.pack(out), _EVAL_META_TAG + 1 + i))
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
