"""Models built on the meta device: each ZeRO-3 rank materialises only its own shard.

`with torch.device("meta"): model = make_model()` builds the module tree with no memory behind
it, so a model larger than one rank can be described on every rank. ZeRO-3 then fills it unit by
unit, as FSDP2 does after `fully_shard` + `to_empty` + `reset_parameters`:

1. `prepare_meta` (before anything is built): every parameter becomes a tensor on the real
   device with no storage (identity kept, through `torch.utils.swap_tensors`, so tied weights,
   the units and the gradient hooks see the same objects), and nothing is allocated yet.
2. `materialize_shards` walks `module.named_modules()` in order. For each module it gives its own
   parameters their memory, replaces its meta buffers with real ones, and runs `init_fn(module)`
   (or the module's `reset_parameters()`), under `torch.no_grad()`. Once the last module holding
   parameters of a unit is done, the unit's flat buffer is laid out, group rank 0's values are
   broadcast (so every rank starts from the same model, as with a model built whole), this
   rank's slice is kept and the parameters' memory is freed before the walk goes on. The peak is
   the root unit (embeddings, head: finished last) and one unit in full, plus the slices.

Equality with the model built whole, on the same seed: the walk draws random numbers module by
module in `named_modules()` order, so the values are those of the model built whole when that
model's only draws are the same calls in the same order: every module initialises its own
tensors in its `reset_parameters()` and modules are constructed in the order they are registered
(torch.nn's Linear, Embedding, LayerNorm, Conv, BatchNorm), or the model's construction draws
nothing and then runs `for m in model.modules(): init_fn(m)` (the demo GPT: `GPT.init_module`).
A model that re-initialises weights after construction any other way gets the walk's values, not
its own. On a GPU each module's init still runs on the CPU (its tensors copied up after), so the
values are those of the model built whole on the CPU and moved, as the trainer builds it for
every other strategy: CUDA's generator would give other numbers on the same seed.

A tied parameter (an embedding shared with the LM head) is written by the init of every module
that holds it. Built whole, it keeps the value of the module that made it: the tie assigns one
module's parameter to another (`head.weight = embed.weight`, as Hugging Face's `tie_weights`
does), and the other module's own tensor, drawn at its construction, is dropped. So under
`reset_parameters()` the walk keeps the value of the first module in `named_modules()` order
that holds it (the one registered, hence constructed, first): a later holder's reset still runs,
drawing the same random numbers as its constructor did (a tied tensor has the same shape), and
its value is put back. With `init_fn` the last init in module order wins, as it does for
`for m in model.modules(): init_fn(m)` on the model built whole. (A model that ties the other
way, `embed.weight = head.weight` with the head registered later, is not told apart: it gets the
embedding's value.)

Every tensor of the walk must be written by its init: a parameter or buffer left untouched
(`_version` unchanged, and the buffer not replaced) is refused by name. This is how a buffer
computed in `__init__` (a causal mask, rotary frequencies) is caught: its value does not survive
the meta device, so `init_fn` (or `reset_parameters`) must compute it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.data_parallel.bucket import Bucket
from tessera.zero.partition import padded_numel, shard_range

__all__ = [
    "InitFn",
    "PendingInit",
    "has_meta",
    "materialize_shards",
    "meta_problem",
    "prepare_meta",
    "refuse_meta",
    "storageless",
]

InitFn = Callable[[nn.Module], None]
"""Initialises one module's own parameters and buffers in place (called once per module)."""


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        (name, tensor)
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]
        if tensor is not None
    ]


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _meta_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the tensors (parameters and buffers) on the meta device, and of the others."""
    meta, real = [], []
    for prefix, sub in module.named_modules():
        for name, tensor in _own_tensors(sub):
            (meta if tensor.is_meta else real).append(_qualified(prefix, name))
    return meta, real


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def refuse_meta(module: nn.Module, what: str) -> None:
    """Raise `ValueError` if `module` is (partly) on the meta device: `what` cannot take it."""
    meta, _ = _meta_names(module)
    if meta:
        raise ValueError(
            f"{what} cannot take a model on the meta device ({len(meta)} tensors, e.g. "
            f"{', '.join(meta[:3])}): only ZeRO-3 (strategy='zero3', with or without offload) "
            f"materialises one shard per rank; build the model on a real device for {what}"
        )


def storageless(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` with no memory behind it (its storage resized to 0 bytes)."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
    tensor.untyped_storage().resize_(0)
    return tensor


@dataclass
class PendingInit:
    """A meta-device model moved to `device` without memory, waiting for `materialize_shards`."""

    device: torch.device
    init_fn: InitFn | None
    params: set[int] = field(default_factory=set)
    """`id` of each parameter that has no value yet."""


def meta_problem(module: nn.Module, init_fn: InitFn | None) -> str | None:
    """Why a meta-device `module` cannot be materialised with `init_fn`, or None if it can.

    Refused: a model only partly on the meta device, and, without `init_fn`, modules holding
    tensors that have no `reset_parameters()`. (What an init leaves unwritten is found while
    materialising.)"""
    meta, real = _meta_names(module)
    if real:
        return (
            f"the model is only partly on the meta device ({', '.join(real[:3])} "
            f"{'are' if len(real) > 1 else 'is'} not): build all of it under "
            f"torch.device('meta'), or none of it"
        )
    if init_fn is not None:
        return None
    missing = [
        f"{name or '(root)'} ({type(sub).__name__}: {', '.join(n for n, _ in _own_tensors(sub))})"
        for name, sub in module.named_modules()
        if _own_tensors(sub) and not callable(getattr(sub, "reset_parameters", None))
    ]
    if missing:
        return (
            f"a meta-device model is initialised through each module's reset_parameters(), and "
            f"these modules have none: {'; '.join(missing[:4])}. Pass init_fn=FN (FN(module) "
            f"initialises that module's own parameters and buffers), or build it on a real device"
        )
    return None


def prepare_meta(
    module: nn.Module, device: torch.device | str, init_fn: InitFn | None
) -> PendingInit | None:
    """Put a meta-device `module`'s parameters on `device` without memory; None if not meta.

    Raises `ValueError` (before anything is allocated) for a model only partly on the meta
    device, and, without `init_fn`, for modules holding tensors that have no `reset_parameters`.
    """
    if not has_meta(module):
        return None
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a function of one module, got {init_fn!r}")
    problem = meta_problem(module, init_fn)
    if problem is not None:
        raise ValueError(problem)
    pending = PendingInit(torch.device(device), init_fn)
    for param in list(module.parameters()):  # each once, also when tied
        real = nn.Parameter(storageless(param.shape, param.dtype, pending.device))
        real.requires_grad_(param.requires_grad)
        torch.utils.swap_tensors(param, real)
        pending.params.add(id(param))
    return pending


class _Walk:
    """The state of one materialisation walk (see the module docstring)."""

    def __init__(self, module: nn.Module, pending: PendingInit) -> None:
        self.module = module
        self.pending = pending
        self.version: dict[int, int] = {}
        """Per materialised parameter: `_version` before its init (unchanged: never written)."""
        self.where: dict[int, str] = {}

    def give_memory(self, prefix: str, sub: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Memory for `sub`'s own parameters without a value; real buffers for its meta ones."""
        made = []
        for name, param in sub._parameters.items():
            if param is not None and id(param) in self.pending.params:
                self.pending.params.discard(id(param))
                storage = param.untyped_storage()
                storage.resize_(param.numel() * param.element_size())
                self.version[id(param)] = param._version
                self.where[id(param)] = _qualified(prefix, name)
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:  # made on the host: see `_init_on_host`
                real = torch.empty(buffer.shape, dtype=buffer.dtype)
                sub._buffers[name] = real
                made.append((name, real))
        return made

    def initialise(self, prefix: str, sub: nn.Module) -> None:
        """Give `sub` its memory, run its init, check that its buffers were written."""
        before = dict(sub._parameters)
        tied = []  # reset_parameters: parameters an earlier module made keep their value
        if self.pending.init_fn is None:
            tied = [
                (param, param.detach().clone()) for param in before.values()
                if param is not None and id(param) in self.version
                and param.untyped_storage().nbytes()
            ]  # fmt: skip
        buffers = self.give_memory(prefix, sub)
        reset = getattr(sub, "reset_parameters", None)
        with torch.no_grad(), _init_on_host(sub):
            if self.pending.init_fn is not None:
                self.pending.init_fn(sub)
            elif callable(reset):
                reset()
            for param, value in tied:
                param.copy_(value)
        for name, param in before.items():
            if sub._parameters.get(name) is not param:
                raise ValueError(
                    f"{self._how()} replaced parameter {_qualified(prefix, name)}: initialise "
                    f"it in place (nn.init.*, or .copy_ under torch.no_grad()), ZeRO-3 holds "
                    f"that object"
                )
        for name, real in buffers:
            current = sub._buffers.get(name)
            if current is real and real._version == 0:
                raise ValueError(
                    f"buffer {_qualified(prefix, name)} of a meta-device model is not set by "
                    f"{self._how()}: a value computed in __init__ does not survive the meta "
                    f"device; compute it in init_fn (or reset_parameters)"
                )
            if current is not None and current.device != self.pending.device:
                sub._buffers[name] = current.to(self.pending.device)

    def check_written(self, params: Sequence[nn.Parameter]) -> None:
        for param in params:
            if param._version == self.version[id(param)]:
                raise ValueError(
                    f"parameter {self.where[id(param)]} of a meta-device model is not set by "
                    f"{self._how()}: pass init_fn=FN that initialises it"
                )

    def _how(self) -> str:
        return "init_fn" if self.pending.init_fn is not None else "reset_parameters()"


@contextmanager
def _init_on_host(sub: nn.Module) -> Iterator[None]:
    """Run `sub`'s init on host copies of its parameters, then copy the values to the device.

    The model built whole (the trainer's other strategies, and this walk on the CPU) draws its
    random numbers from the CPU's generator and is then moved to the device; an init run on CUDA
    tensors would draw from CUDA's generator (another algorithm: other values on the same seed).
    `param.data` is swapped, not the parameter: ZeRO-3's hooks and units hold the objects, and
    a parameter's `_version` counts only the init's own writes (`check_written`)."""
    moved = []
    for param in sub._parameters.values():
        if param is None or param.device.type == "cpu" or not param.untyped_storage().nbytes():
            continue
        on_device = param.data
        param.data = on_device.to("cpu")  # (a tied value an earlier module wrote comes along)
        moved.append((param, on_device))
    try:
        yield
    finally:
        for param, on_device in moved:
            on_host = param.data
            param.data = on_device
            on_device.copy_(on_host)


@torch.no_grad()
def materialize_shards(
    module: nn.Module,
    pending: PendingInit,
    buckets: Sequence[Bucket],
    owner: dict[int, int],
    *,
    world: int,
    rank: int,
    broadcast: Callable[[torch.Tensor], None],
) -> dict[int, torch.Tensor]:
    """Initialise `module` unit by unit and return this rank's slice of each bucket's flat buffer.

    `buckets` are ZeRO-3's (one per unit and dtype; only their parameters and layout are read),
    `owner` maps `id(parameter)` to its unit. `broadcast(flat)` copies group rank 0's values into
    `flat` (collective). The parameters are left with no memory; buffers and frozen parameters
    are left whole, like a model built whole. Slices are keyed by bucket index.
    """
    walk = _Walk(module, pending)
    modules = list(module.named_modules())
    last: dict[int, int] = {}  # unit -> index of the last module holding one of its parameters
    for index, (_, sub) in enumerate(modules):
        for param in sub._parameters.values():
            if param is not None and id(param) in owner:
                last[owner[id(param)]] = index
    finishing: dict[int, list[Bucket]] = {}
    for bucket in buckets:
        finishing.setdefault(last[owner[id(bucket.params[0])]], []).append(bucket)
    slices: dict[int, torch.Tensor] = {}
    for index, (prefix, sub) in enumerate(modules):
        walk.initialise(prefix, sub)
        for bucket in finishing.get(index, []):
            walk.check_written(bucket.params)
            slices[bucket.index] = _slice_of(bucket, world, rank, broadcast)
        for bucket in finishing.get(index, []):
            for param in bucket.params:
                param.untyped_storage().resize_(0)
    walk.check_written([p for p in module.parameters() if id(p) not in owner])  # frozen ones
    return slices


def _slice_of(
    bucket: Bucket, world: int, rank: int, broadcast: Callable[[torch.Tensor], None]
) -> torch.Tensor:
    """Lay out a bucket's parameters flat, take rank 0's values, keep this rank's slice."""
    numel = bucket.offsets[-1]
    first = bucket.params[0]
    flat = torch.zeros(padded_numel(numel, world), dtype=first.dtype, device=first.device)
    for position, param in enumerate(bucket.params):
        flat[bucket.offsets[position] : bucket.offsets[position + 1]].copy_(param.reshape(-1))
    if world > 1:
        broadcast(flat)
    lo, hi = shard_range(numel, world, rank)
    return flat[lo:hi].clone()
