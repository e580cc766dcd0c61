"""The user's optimizer groups under ZeRO: read on the model's own parameters, kept per shard.

Recipes group parameters by shape (weight decay on matrices only, none on biases and norms, as
nanoGPT and Hugging Face's Trainer do) or by identity (another learning rate for the head), so
the factory must see the model's parameters, as under every other strategy, not ZeRO's flat
shards. ZeRO then keeps each group's hyper-parameters for its shards the way DeepSpeed does
(`stage_1_and_2.py` flattens each param group into its own buffer): a gradient bucket, and with it
a flat buffer and a master shard, never mixes two groups (`ZeroOptimizer._ordered_parameters`),
so every master belongs to exactly one group.

`OptimizerGroups` calls the factory once on `module.parameters()` and records which group holds
each parameter. The inner optimizer is then the user's own object with each group's `params`
replaced by the masters of that group's buckets (its hyper-parameters, group order and class are
the user's, so a learning-rate scheduler that sets a different lr per group works unchanged), or,
under offload, the host optimizer (`CPUAdam` / `NVMeAdam`) built with the same groups. A trainable
parameter that no group holds is left out of ZeRO, as a frozen one is: plain PyTorch never steps
it either. A tensor a group holds that is not the module's (`module` is one pipeline stage, the
factory picked a head it lacks by identity) is dropped, as the pipeline does without ZeRO.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerGroups"]


class OptimizerGroups:
    """The user's optimizer built on the model's parameters, read for its `param_groups`."""

    def __init__(self, module: nn.Module, make_optimizer: Callable[[Any], Any]) -> None:
        optimizer = make_optimizer(module.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer factory must return a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        names = {id(p): name for name, p in module.named_parameters()}
        self.user = optimizer
        """The user's optimizer; after `build` (without a host optimizer) the inner one."""
        self.group: dict[int, int] = {}
        """`id(parameter)` -> index of the group that holds it."""
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                # A tensor of another module (a factory that picks the head by identity, run
                # on a pipeline stage without it) is not this module's to shard or step.
                if id(param) in names:
                    self.group[id(param)] = index
        self.host: tuple[type, dict[str, Any], Sequence[str]] | None = None
        """Under offload: (class, keyword arguments, group keys taken from each user group)."""

    @classmethod
    def of(cls, module: nn.Module, make_optimizer: Any) -> OptimizerGroups:
        """`make_optimizer` itself if it is one already, else read from it."""
        if isinstance(make_optimizer, cls):
            return make_optimizer
        return cls(module, make_optimizer)

    def __len__(self) -> int:
        return len(self.user.param_groups)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether a group of the user's optimizer holds `param` (else ZeRO leaves it out)."""
        return id(param) in self.group

    def build(self, masters: Sequence[torch.Tensor], groups: Sequence[int]) -> Any:
        """The inner optimizer over `masters`, master i in the user's group `groups[i]`.

        Every user group is kept, in order, even one left without masters (all its parameters
        frozen), so group indices (and schedulers' per-group values) stay the user's."""
        split: list[list[torch.Tensor]] = [[] for _ in self.user.param_groups]
        for master, group in zip(masters, groups, strict=True):
            split[group].append(master)
        if self.host is not None:
            host_class, kwargs, keys = self.host
            specs = [
                {"params": params, **{k: group[k] for k in keys if k in group}}
                for params, group in zip(split, self.user.param_groups)
            ]
            return host_class(specs, **kwargs)
        optimizer = self.user
        if optimizer.state:  # an optimizer that makes its state at construction (Adagrad)
            specs = [
                {**{k: v for k, v in group.items() if k != "params"}, "params": params}
                for params, group in zip(split, optimizer.param_groups)
            ]
            self.user = type(optimizer)(specs, **optimizer.defaults)  # the old state goes
            return self.user
        for params, group in zip(split, optimizer.param_groups):
            group["params"] = params  # no state yet: the masters simply take their place
        return optimizer
