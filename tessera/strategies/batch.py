"""The batch rule every engine follows: what a batch is, and how its loss is computed.

Two kinds of batch, the two conventions of PyTorch code:

* a mapping (a dict of tensors, as Hugging Face models take): `out = model(**batch)`; the loss
  is `loss_fn(out, batch)` when a `loss_fn` is given, else the model's own, `out.loss` or
  `out["loss"]` (Hugging Face models return it when the batch holds `labels`);
* an `(inputs, targets)` pair: `loss_fn(model(inputs), targets)`; a pair has no loss of its
  own, so `loss_fn` is required. Inputs that are a tuple or list call `model(*inputs)` (a
  two-input model: `((a, b), y)`), a mapping `model(**inputs)` (dict items whose input and
  target keys were named: `tessera.data.loader.select_keys`).

Anything else is refused with one message. Micro-batches (a pipeline's, gradient
accumulation's) cut every tensor on dim 0 (a 0-dim tensor, a flag, goes whole into each);
model-parallel engines gather the ranks' shards of a batch back into the global batch the same
way.

What a loss averages over (`item_counter`): a micro-batch's loss is weighted by its share of the
batch's *items*, not of its rows, so that the weighted sum is the whole batch's loss also for a
loss averaged over tokens with padding or `ignore_index` (a Hugging Face causal LM's labels hold
-100 where no token counts). The items are the rows unless the loss says otherwise: a `loss_fn`
with a `count_items(targets)` attribute (the same second argument the loss gets: the targets of a
pair, the batch of a dict) declares them; `nn.CrossEntropyLoss` / `nn.NLLLoss` (mean reduction)
count their targets that differ from `ignore_index` (weighted by class `weight` when set); the
model's own loss of a dict batch counts `labels != -100`, one position fewer per row for a causal
LM (a class named `*ForCausalLM` / `*LMHeadModel`: Hugging Face shifts its labels by one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = [
    "Batch",
    "LossFn",
    "check_grad_accum",
    "compute_loss",
    "gather_batch",
    "is_one",
    "call_model",
    "item_counter",
    "items_share",
    "items_weighted",
    "loss_targets",
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


def _map_rows(batch: Batch, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`fn` on every tensor of a (nested) batch that has rows; 0-dim tensors (a flag) and
    anything else go unchanged, the structure kept."""
    return _map_tensors(batch, lambda t: fn(t) if t.dim() > 0 else t)


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
    return [_map_rows(batch, lambda t, i=i: t[i * size : (i + 1) * size]) for i in range(m)]


def check_grad_accum(k: Any) -> None:
    """Refuse a `grad_accum` that is not an int >= 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"grad_accum must be an int >= 1 (1: no accumulation), got {k!r}")


def split_for_accumulation(
    batch: Batch, k: int, count: Callable[[Any], float | None] | None = None
) -> list[tuple[Any, float]]:
    """Cut `batch` into `k` micro-batches of as equal rows as can be; each with its share.

    The share is the micro-batch's fraction of the items its loss averages over (`count`, from
    `item_counter`; without it, or where it returns None, the rows): the sum of `share * mean
    loss` over the micro-batches is the whole batch's mean loss, so the gradients of the shares'
    weighted losses add up to the whole batch's gradient. A micro-batch without items (every
    label ignored) is left out: its mean loss is 0/0, and it adds nothing to the batch's.
    Sizes differ by at most one row when `k` does not divide the rows; fewer rows than `k` is
    refused. Counting reads the labels on the host (one sync per step, only with `count`).
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
        parts.append((_map_rows(batch, lambda t, a=start, b=end: t[a:b]), float(end - start)))
        start = end
    return _shares(parts, count)


def _shares(parts: list[tuple[Any, float]], count: Callable[[Any], Any] | None) -> list:
    """Each part's weight (its rows) replaced by its fraction of the items (or of the rows)."""
    items = [count(loss_targets(micro)) for micro, _ in parts] if count is not None else []
    if items and all(n is not None for n in items) and sum(items) > 0:
        parts = [(micro, float(n)) for (micro, _), n in zip(parts, items) if n > 0]
    total = sum(weight for _, weight in parts)
    return [(micro, weight / total) for micro, weight in parts]


def loss_targets(batch: Batch) -> Any:
    """What the loss compares the output with: a pair's targets, a dict batch itself."""
    return batch if isinstance(batch, Mapping) else batch[1]


def _causal_lm(module: nn.Module | None) -> bool:
    """A Hugging Face causal LM, whose own loss drops each row's first label (it shifts)."""
    name = type(module).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def _labels_count(
    labels: Any, shift: bool, ignore_index: int = -100, on_device: bool = False
) -> float | torch.Tensor | None:
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dim() == 0:
        return None  # regression targets, or no labels: the rows are the items
    if shift:
        labels = labels[..., 1:]
    kept = (labels != ignore_index).sum()
    return kept if on_device else float(kept)


def item_counter(
    loss_fn: LossFn | None, module: nn.Module | None = None, *, on_device: bool = False
) -> Callable | None:
    """`targets -> how many items the loss averages over` (see the module docstring), or None
    where they are the rows. `targets` is the loss's second argument (a dict batch itself).

    `on_device=True`: the count is a 0-dim tensor on the labels' device, never read by the host
    (a read is a device sync on a GPU; the data-parallel weighing per step uses it so); a count
    the loss declares (`count_items`) is returned as the loss gives it."""
    declared = getattr(loss_fn, "count_items", None)
    if callable(declared):
        return declared if on_device else lambda targets: float(declared(targets))
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and loss_fn.reduction == "mean":
        return lambda targets: _class_count(loss_fn, targets, on_device)
    if loss_fn is None:  # the model's own loss of a dict batch
        shift = _causal_lm(module)

        def own(batch: Any) -> float | torch.Tensor | None:
            if not isinstance(batch, Mapping):
                return None
            if isinstance(batch.get("shift_labels"), torch.Tensor):  # given shifted already
                return _labels_count(batch["shift_labels"], False, on_device=on_device)
            return _labels_count(batch.get("labels"), shift, on_device=on_device)

        return own
    return None


def is_one(factor: float | torch.Tensor) -> bool:
    """A number equal to 1 (a tensor factor, computed on the device, is never read to check)."""
    return not isinstance(factor, torch.Tensor) and factor == 1.0


def items_share(
    batch: Batch,
    count: Callable[[Any], Any],
    world: int,
    device: torch.device,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
) -> float | torch.Tensor:
    """This rank's weight when data-parallel ranks average their gradients: `world * its
    items / all ranks' items` (1 where no rank has any), from `count` (`item_counter(...,
    on_device=True)`) and `sum_over_ranks`, a collective. 1.0 where `count` gives None.

    The count, its sum and the weight stay tensors on the labels' device: reading them on the
    host was two device syncs a step under ddp and zero1-3 with `nn.CrossEntropyLoss` or a
    Hugging Face model's own loss. A count the loss declares as a number goes to the device of
    the batch's first tensor (`device` where it holds none). Returns a 0-dim float32 tensor.
    """
    targets = loss_targets(batch)
    mine = count(targets)
    if mine is None:
        return 1.0
    if not isinstance(mine, torch.Tensor):
        tensors = [t for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor)]
        mine = torch.tensor(float(mine), device=tensors[0].device if tensors else device)
    mine = mine.detach().to(torch.float64).reshape(1)
    total = sum_over_ranks(mine.clone())
    return torch.where(total > 0, world * mine / total, 1.0).reshape(()).float()


def items_weighted(
    loss_fn: LossFn, count: Callable | None, targets: Any, total: float | None = None
) -> LossFn:
    """`loss_fn` for a pipeline, which weighs each micro-batch's loss by its share of the rows:
    times `(its items / the batch's items) / (its rows / the batch's rows)`, so the weights are
    the shares of the items (`count`: `item_counter`). `loss_fn` itself where the items are the
    rows or `targets` is not on this stage (None: not the last). `total`: the batch's items
    where the dp replicas' gradients are averaged (the global batch's items / dp: a replica
    with few items then weighs less, as the whole batch's loss weighs it)."""
    if count is None or targets is None:
        return loss_fn
    total = count(targets) if total is None else total
    if not total:
        return loss_fn
    from tessera.pipeline.microbatch import batch_rows  # the rows as the pipeline counts them

    rows = batch_rows(targets)

    def weighted(output: Any, micro: Any) -> torch.Tensor:
        items = count(micro) or 0.0  # (None where the batch had items: not this rule's batch)
        return loss_fn(output, micro) * (items * rows / (total * batch_rows(micro)))

    return weighted


def _class_count(
    loss_fn: nn.CrossEntropyLoss | nn.NLLLoss, targets: Any, on_device: bool = False
) -> float | torch.Tensor | None:
    """The divisor of a mean class loss: targets not ignored, each by its class weight (by a
    mask, not by selecting the kept targets: a selection's size is read by the host)."""
    count = _labels_count(targets, False, loss_fn.ignore_index, on_device=on_device)
    if count is None or loss_fn.weight is None:
        return count
    keep = targets != loss_fn.ignore_index
    weights = loss_fn.weight.to(targets.device)[targets.masked_fill(~keep, 0)]
    kept = (weights * keep).sum()
    return kept if on_device else float(kept)


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
