"""ZeRO's bf16 forward (`mixed_precision="bf16"`): bf16 weights, and autocast for the rest.

The sharded parameters are bf16 already (their flat buffers are; the fp32 masters are the
optimizer's), but not everything a forward meets is: frozen parameters (not sharded, kept fp32
as in the model built whole, so that exports and checkpoints keep their values), buffers,
keyword arguments (a dict batch's float inputs), tensors the model makes itself. Casting only
the positional inputs once crashed on each of these ("mat1 and mat2 must have the same dtype").
So the forward runs under `torch.autocast(bf16)`, entered by the module's forward pre-hook and
left by its forward hook (also when the forward raises): each operand of a matrix product or
convolution is cast to bf16 where it is used, as under every other strategy's bf16
(`tessera.strategies.precision`), and the bf16 weights pass through unchanged. Positional float
inputs are still cast up front (what autocast would do at their first product anyway), keyword
arguments are left alone (a float label must not be rounded), and float outputs come back fp32.

BatchNorm's parameters stay fp32 (`kept_in_fp32`, as FSDP's mixed precision keeps `_BatchNorm`
in full precision): its running statistics are fp32 buffers, and torch's batch norm takes bf16
inputs with fp32 weight and statistics, but not bf16 weight with fp32 statistics. They are
sharded in fp32 buckets of their own (a bucket holds one dtype).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from tessera.zero.materialize import storageless

__all__ = ["Bf16Forward", "kept_in_fp32", "to_bf16_storageless"]


def kept_in_fp32(module: nn.Module, mixed_precision: str | None) -> set[int]:
    """`id` of each parameter that bf16 leaves fp32: BatchNorm's (none without bf16)."""
    if mixed_precision != "bf16":
        return set()
    norms = [sub for sub in module.modules() if isinstance(sub, nn.modules.batchnorm._BatchNorm)]
    return {id(p) for sub in norms for p in sub._parameters.values() if p is not None}


def to_bf16_storageless(named: list[tuple[str, nn.Parameter]], kept: set[int]) -> None:
    """Each parameter not `kept` becomes bf16 with no memory (its flat buffer fills it)."""
    for _, param in named:
        if id(param) not in kept:
            param.data = storageless(param.shape, torch.bfloat16, param.device)


class Bf16Forward:
    """The two forward hooks' bf16 half, for a module whose parameters are on `device_type`."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._open: list[Any] = []
        """The autocast each running forward entered (a module may be called re-entrantly)."""

    def enter(self, args: tuple) -> tuple:
        """Before the forward: autocast on; the positional inputs to bf16."""
        autocast = torch.autocast(self.device_type, dtype=torch.bfloat16)
        autocast.__enter__()
        self._open.append(autocast)
        return tree_map(_to_bf16, args)

    def exit(self, output: Any) -> Any:
        """After the forward (or its exception): autocast off; bf16 outputs to fp32."""
        if self._open:
            self._open.pop().__exit__(None, None, None)
        return tree_map(_to_fp32, output)


def _to_bf16(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.bfloat16)
    return value


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        return value.float()
    return value
