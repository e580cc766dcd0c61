"""Activation checkpointing: keep each block's input, recompute its inside during backward.

Chen et al. 2016 ("Training deep nets with sublinear memory cost"): a block's forward keeps only
its input; backward runs the block again to get the activations its gradient needs. For a GPT
block of width C on B x T tokens this keeps 1 x (B, T, C) instead of about 16 of them (LayerNorm
inputs, q/k/v, attention output, the 4C-wide MLP hidden before and after GELU, ...), for one
extra forward per step (about a third more compute).

`checkpoint_activations(model)` applies `torch.utils.checkpoint.checkpoint` (non-reentrant: works
with kwargs, with inputs that need no grad, with hooks, and preserves the RNG state so dropout
recomputes identically) to every block in place, by replacing the block's `forward` on the
instance: parameter names, the state dict and hooks on the block stay as they were. Blocks are
found by `tessera.memory.blocks.find_blocks`, like ZeRO-3's units: the children with parameters
of every outermost `nn.ModuleList`/`nn.Sequential`. A block that is itself only a container
(an `nn.ModuleDict` of layers that its parent calls one by one) has no forward to wrap, so each
of its children is wrapped instead.

`offload="cpu"` (as in ZeRO-Infinity's activation offload, Rajbhandari et al. 2021) keeps the
block inputs in host memory: each tensor input is copied to the host (a differentiable `.to`
whose backward saves nothing) before the checkpoint, so the checkpoint holds the host copy, and
copied back to the block's device inside the recomputed region. Everything else autograd saves
outside the checkpointed blocks goes through `saved_tensors_hooks` that move it to the host and
back on unpack. On a CPU-only machine both copies are no-ops and the model computes exactly what
it computes without offload.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.memory.blocks import find_blocks

__all__ = ["checkpoint_activations", "checkpointed_blocks"]

_MARK = "_tessera_checkpointed"
_OFFLOAD_MODES = (None, "cpu")


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to("cpu", non_blocking=True)
    return value


def _checkpointed_forward(
    forward: Callable[..., Any], device_of: Callable[[], torch.device], offload: str | None
) -> Callable[..., Any]:
    """`forward` run under a non-reentrant checkpoint, its tensor inputs kept on the host if
    `offload == "cpu"` and moved back to the block's device when (re)computed."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if offload == "cpu":
            device = device_of()
            args = tuple(_to_host(a) for a in args)
            kwargs = {k: _to_host(v) for k, v in kwargs.items()}

            def on_device(*inner_args: Any, **inner_kwargs: Any) -> Any:
                move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
                return forward(
                    *(move(a) for a in inner_args), **{k: move(v) for k, v in inner_kwargs.items()}
                )

            return checkpoint(on_device, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return functools.wraps(forward)(run)


def _host_saved_tensors(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` with every tensor autograd saves (outside checkpoints) kept on the host."""

    def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        return tensor.device, tensor.to("cpu", non_blocking=True)

    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        return tensor.to(device, non_blocking=True)

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return forward(*args, **kwargs)

    return functools.wraps(forward)(run)


def _device_of(block: nn.Module) -> Callable[[], torch.device]:
    def device() -> torch.device:
        for tensor in (*block.parameters(), *block.buffers()):
            return tensor.device
        return torch.device("cpu")

    return device


def checkpoint_activations(
    module: nn.Module, *, every: int = 1, offload: str | None = None
) -> nn.Module:
    """Recompute the activations of every `every`-th block of `module` in backward; in place.

    Returns `module` (its blocks' `forward` replaced on the instance). `offload="cpu"` keeps the
    checkpointed inputs and the other saved tensors in host memory. Raises `ValueError` for an
    unknown mode, `every < 1`, a module without blocks or one already checkpointed.
    """
    if offload not in _OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {_OFFLOAD_MODES}, got {offload!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int, got {every!r}")
    if getattr(module, _MARK, False):
        raise ValueError(f"{type(module).__name__} is already activation-checkpointed")
    blocks = find_blocks(module)
    if not blocks:
        raise ValueError(
            f"{type(module).__name__} has no blocks to checkpoint: checkpoint_activations wraps "
            "the children (with parameters) of its nn.ModuleList / nn.Sequential containers"
        )
    for index, block in enumerate(blocks):
        if index % every == 0:
            block.forward = _checkpointed_forward(block.forward, _device_of(block), offload)
            setattr(block, _MARK, True)
    if offload == "cpu":
        module.forward = _host_saved_tensors(module.forward)
    setattr(module, _MARK, True)
    return module


def checkpointed_blocks(module: nn.Module) -> list[nn.Module]:
    """The submodules of `module` whose forward `checkpoint_activations` wrapped."""
    return [m for m in module.modules() if m is not module and getattr(m, _MARK, False)]
