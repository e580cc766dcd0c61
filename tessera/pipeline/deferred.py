"""Deferred weight gradients: a stage's backward split into B (input gradients) and W (weights).

The backward of a linear layer `y = x W^T + b` computes two things: the input's gradient
`g W` (which the previous stage waits for) and the weight's gradient `g^T x` (which nobody needs
until the optimizer step). Zero-bubble pipelining (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism") separates them into a B pass and a W pass. tessera does the same for every
`F.linear` a stage runs, for two reasons:

* the critical path gets shorter: a stage sends its input gradient upstream without first
  computing its weight gradients, so the cool-down bubble shrinks;
* the W pass runs once per step over the whole batch: `dW = G^T X` with X and G the
  concatenated micro-batches is one large matrix product, instead of m small ones each
  added into `.grad`. On a CPU a product with 8 rows runs at about half the rate of one
  with 64 rows, and the m read-add-write rounds over the gradient are memory traffic: on the
  8-block MLP of `benchmarks/pipeline.py` (2 stages, m = 8) a GPipe step takes 73 ms instead
  of 106 ms with the weight gradients computed inside B.

The cost is memory: each linear layer's input and output gradient are kept from a micro-batch's
B until the step's W pass (GPipe keeps the inputs anyway; 1F1B's activation memory becomes O(m)
instead of O(p) for these two tensors). `Pipeline(defer_weight_grads=False)` trades back.

The W pass is an ordinary autograd backward (a chain of one node per layer, last layer first), so
every gradient hook sees it: a bucketed reducer (DDP, ZeRO-2) starts reducing the last layers'
gradients while the W pass computes the earlier layers' ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["WeightGradDeferral"]


class _LayerStash:
    """One weight's saved (input, output-gradient) pairs, one per micro-batch, until the W pass."""

    __slots__ = ("weight", "bias", "inputs", "grads")

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        self.weight, self.bias = weight, bias
        self.inputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs + self.grads)


class _LinearInputGradOnly(torch.autograd.Function):
    """`F.linear` whose backward returns only the input's gradient and stashes the rest.

    forward: `x W^T + b`, saving x for the W pass.
    backward: `g W` for x (when x needs it); None for W and b, whose gradients the W pass
    computes from the stashed (x, g).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, stash: Any) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.stash = stash
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        stash: _LayerStash = ctx.stash
        stash.inputs.append(x.reshape(-1, x.shape[-1]))
        stash.grads.append(grad.reshape(-1, grad.shape[-1]))
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class _WeightGradients(torch.autograd.Function):
    """One link of the W pass: forward passes a scalar through; backward computes dW and db."""

    @staticmethod
    def forward(ctx: Any, link: torch.Tensor, stash: Any, weight: Any, bias: Any) -> torch.Tensor:
        ctx.stash = stash
        return link.clone()

    @staticmethod
    def backward(ctx: Any, grad_link: torch.Tensor) -> tuple:
        stash: _LayerStash = ctx.stash
        inputs = torch.cat(stash.inputs)
        grads = torch.cat(stash.grads)
        stash.inputs, stash.grads = [], []
        grad_weight = grads.t().matmul(inputs) if stash.weight.requires_grad else None
        grad_bias = grads.sum(0) if stash.bias is not None and stash.bias.requires_grad else None
        return grad_link, None, grad_weight, grad_bias


class _DeferLinears(TorchFunctionMode):
    """Route `F.linear` calls on deferred weights to `_LinearInputGradOnly`; others pass."""

    def __init__(self, owner: WeightGradDeferral) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            stash = self.owner.stash_for(args, kwargs)
            if stash is not None:
                x = args[0] if args else kwargs["input"]
                return _LinearInputGradOnly.apply(x, stash.weight, stash.bias, stash)
        return func(*args, **kwargs)


class WeightGradDeferral:
    """Defer the gradients of `F.linear(x, weight, bias)` calls on `params` to a W pass.

    `params`: the parameters that may be deferred (a stage's, except those other stages share).
    A call is deferred when its weight is one of them and its bias is one of them or None; any
    other use of such a parameter keeps its ordinary gradient, which the W pass adds to.
    Run the stage's forward inside `capturing()`; after the last micro-batch's backward call
    `weight_pass()`.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._eligible = {id(p) for p in params}
        self._stashes: dict[int, _LayerStash] = {}  # by weight id, in order of first use
        self.peak_bytes = 0
        """Most bytes the stash held at the start of a W pass (the memory deferral costs)."""

    def __bool__(self) -> bool:
        return bool(self._eligible)

    def stash_for(self, args: tuple, kwargs: dict) -> _LayerStash | None:
        """The stash of an `F.linear(x, weight, bias)` call, or None if it is not deferred."""
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if weight is None or id(weight) not in self._eligible or not weight.requires_grad:
            return None
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if bias is not None and id(bias) not in self._eligible:
            return None
        stash = self._stashes.get(id(weight))
        if stash is None:
            stash = self._stashes[id(weight)] = _LayerStash(weight, bias)
        elif stash.bias is not bias:
            return None  # the same weight with another bias: keep it simple, stay eager
        return stash

    def clear(self) -> None:
        """Drop whatever a step that failed half-way left in the stash."""
        self._stashes.clear()

    def capturing(self) -> TorchFunctionMode:
        """Context manager for the stage's forward: deferred linears record their stash."""
        return _DeferLinears(self)

    def pending(self) -> list[nn.Parameter]:
        """Parameters whose gradients the next W pass produces."""
        out = []
        for stash in self._stashes.values():
            if stash.inputs:
                out += [p for p in (stash.weight, stash.bias) if p is not None and p.requires_grad]
        return out

    def weight_pass(self) -> None:
        """Compute every pending weight gradient (accumulating into `.grad`), last layer first.

        One autograd backward over a chain of one node per layer, so gradient hooks fire as each
        layer finishes.
        """
        layers = [s for s in self._stashes.values() if s.inputs]
        self.peak_bytes = max(self.peak_bytes, sum(s.nbytes() for s in layers))
        if not layers:
            return
        link = torch.zeros(())
        for stash in layers:  # forward order of first use; backward runs them in reverse
            link = _WeightGradients.apply(link, stash, stash.weight, stash.bias)
        link.backward()
