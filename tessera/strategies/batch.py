"""The batch rule every engine follows: what a batch is, and how its loss is computed.

Two kinds of batch, the two conventions of PyTorch code:

* a mapping (a dict of tensors, as Hugging Face models take): `out = model(**batch)`; the loss
  is `loss_fn(out, batch)` when a `loss_fn` is given, else the model's own, `out.loss` or
  `out["loss"]` (Hugging Face models return it when the batch holds `labels`);
* an `(inputs, targets)` pair: `loss_fn(model(inputs), targets)`; a pair has no loss of its
  own, so `loss_fn` is required. Inputs that are a tuple or list call `model(*inputs)` (a
  two-input model: `((a, b), y)`), a mapping `model(**inputs)` (dict items whose input and
  target keys were named: `tessera.data.loader.select_keys`).

Anything else is refused with one message. Micro-batches (a pipeline's) cut every tensor on
dim 0; model-parallel engines gather the ranks' shards of a batch back into the global batch
the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Batch",
    "LossFn",
    "check_grad_accum",
    "compute_loss",
    "gather_batch",
    "call_model",
    "model_loss",
    "no_loss_message",
    "split_for_accumulation",
    "split_microbatches",
]

Batch = Mapping[str, Any] | tuple[Any, Any] | list[Any]
"""A dict of tensors (`model(**batch)`) or an `(inputs, targets)` pair."""
LossFn = Callable[[Any, Any], torch.Tensor]
"""`loss_fn(output, targets)` for pairs, `loss_fn(output, batch)` for dicts."""


def no_loss_message(model_name: str) -> str:
    """The error of a dict batch whose model returned no loss and no `loss_fn` was given."""
    return (
        f"the batch is a dict and no loss_fn was given, so the loss must be the model's own "
        f"(`output.loss` or `output['loss']`), but {model_name} returned no loss (a Hugging Face "
        f"model returns one when the batch holds 'labels'); pass loss_fn(output, batch)"
    )


def model_loss(out: Any, model_name: str = "model") -> torch.Tensor:
    """The model's own loss of a dict batch: `out.loss` or `out["loss"]` (Hugging Face's rule)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(no_loss_message(model_name))
    return loss


def compute_loss(
    call: Callable[..., Any], batch: Batch, loss_fn: LossFn | None, *, model_name: str = "model"
) -> torch.Tensor:
    """The loss of `batch` under the batch rule; `call` runs the model (possibly wrapped).

    `model_name` names the model in the error raised when a dict batch yields no loss.
    """
    if isinstance(batch, Mapping):
        out = call(**batch)
        return loss_fn(out, batch) if loss_fn is not None else model_loss(out, model_name)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        if loss_fn is None:
            raise ValueError(
                "the batch is an (inputs, targets) pair, which carries no loss: pass "
                "loss_fn=fn(output, targets) to tessera.setup (or give the model a dict batch "
                "from which it computes its own loss)"
            )
        inputs, targets = batch
        return loss_fn(call_model(call, inputs), targets)
    raise TypeError(
        f"a batch is a dict of tensors or an (inputs, targets) pair, got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def call_model(call: Callable[..., Any], inputs: Any) -> Any:
    """The model on a pair's inputs: `call(*inputs)` for a tuple or list, `call(**inputs)` for
    a mapping, else `call(inputs)`."""
    if isinstance(inputs, Mapping):
        return call(**inputs)
    if isinstance(inputs, (tuple, list)):
        return call(*inputs)
    return call(inputs)


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`fn` on every tensor of a (nested) batch, its structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, Mapping) else batch
    if not isinstance(batch, (Mapping, tuple, list)):
        return []
    return [t for value in values for t in _tensors(value)]


def _rows(batch: Batch) -> int:
    sizes = {v.shape[0] for v in _tensors(batch) if v.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"every tensor of a batch must have the same size on dim 0 (the rows), got {sizes}"
        )
    return sizes.pop()


def split_microbatches(batch: Batch, m: int) -> list[Any]:
    """Cut every tensor of `batch` into `m` equal parts on dim 0 (the rows must divide)."""
    rows = _rows(batch)
    if m < 1 or rows % m:
        raise ValueError(f"a batch of {rows} rows does not split into {m} equal micro-batches")
    size = rows // m
    return [_map_tensors(batch, lambda t, i=i: t[i * size : (i + 1) * size]) for i in range(m)]


def check_grad_accum(k: Any) -> None:
    """Refuse a `grad_accum` that is not an int >= 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"grad_accum must be an int >= 1 (1: no accumulation), got {k!r}")


def split_for_accumulation(batch: Batch, k: int) -> list[tuple[Any, float]]:
    """Cut `batch` into `k` micro-batches of as equal rows as can be; each with its share.

    The share is the micro-batch's fraction of the rows: the sum of `share * mean loss` over the
    micro-batches is the whole batch's mean loss (for a loss averaged over rows), so the
    gradients of the shares' weighted losses add up to the whole batch's gradient. Sizes differ
    by at most one row when `k` does not divide the rows; fewer rows than `k` is refused.
    """
    check_grad_accum(k)
    if k == 1:  # the batch as given, whatever it holds (the batch rule judges it)
        return [(batch, 1.0)]
    if not isinstance(batch, (Mapping, tuple, list)):
        raise TypeError(
            f"a batch is a dict of tensors or an (inputs, targets) pair, got {type(batch).__name__}"
        )
    rows = _rows(batch)
    if rows < k:
        raise ValueError(f"a batch of {rows} rows does not split into grad_accum={k} micro-batches")
    size, extra = divmod(rows, k)
    parts, start = [], 0
    for index in range(k):
        end = start + size + (index < extra)
        micro = _map_tensors(batch, lambda t, a=start, b=end: t[a:b])
        parts.append((micro, (end - start) / rows))
        start = end
    return parts


_META = 10
"""Ints describing one gathered tensor: ndim, element size, is-float, then up to 7 dims."""


def _gather_rows(tensor: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `tensor` concatenated on dim 0 in rank order (shards may differ in length).

    The shapes are exchanged first, so a rank whose shard has another trailing shape or dtype
    raises on every rank instead of leaving the collective mismatched.
    """
    tensor = tensor.contiguous()
    if tensor.dim() == 0 or tensor.dim() > _META - 3:
        raise ValueError(f"a batch tensor needs 1 to {_META - 3} dimensions, got {tensor.dim()}")
    meta = [tensor.dim(), tensor.element_size(), int(tensor.is_floating_point()), *tensor.shape]
    meta = torch.tensor(meta + [0] * (_META - len(meta)), dtype=torch.int64, device=tensor.device)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    rows = [int(m[3]) for m in metas]
    for rank, other in enumerate(metas):
        if not torch.equal(torch.cat([other[:3], other[4:]]), torch.cat([meta[:3], meta[4:]])):
            raise ValueError(
                f"batch shards differ beyond dim 0: rank {rank} has shape "
                f"{tuple(other[3 : 3 + int(other[0])].tolist())}, this rank {tuple(tensor.shape)}"
            )
    longest = max(rows)
    if tensor.shape[0] < longest:  # all_gather needs equal sizes: pad, then trim
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, rows)])


def gather_batch(batch: Any, group: dist.ProcessGroup | None = None) -> Any:
    """All-gather every rank's shard of a batch into the global batch, in rank order.

    Tensors are concatenated on dim 0 (shards may differ in length; a shard whose trailing shape
    or dtype differs raises on every rank), dicts key by key (in this rank's key order, which
    must be every rank's), tuples and lists element by element; a non-tensor value (a flag) is
    taken as it is. Model-parallel engines use it: every rank of a tensor-parallel group, and
    every stage of a pipeline, computes on the same global batch. Collective over `group`.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return batch
    if isinstance(batch, torch.Tensor):
        return _gather_rows(batch, world, group)
    if isinstance(batch, Mapping):
        return type(batch)({key: gather_batch(value, group) for key, value in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(gather_batch(value, group) for value in batch)
    return batch
