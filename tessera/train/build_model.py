"""How the trainer builds the model: whole on the rank's device, or on the meta device for ZeRO-3.

Under `--strategy zero3` (with or without `--offload`) the model is built on the meta device, so
no rank ever holds all of it: ZeRO-3 materialises each unit in turn and keeps this rank's shard
(`tessera.zero.materialize`). The demo GPT is initialised through `GPT.init_module`, which gives
the weights of the GPT built whole; a `--model` factory's model through its own
`init_module(module)` method if it has one, else each module's `reset_parameters()`.

A model that cannot be initialised so (a module holding tensors without `reset_parameters` and no
`init_module`) and `hf:` models (transformers initialises in `post_init`, not per module) are
built whole, as before; so is every model with `--no-meta-init`, which a factory that changes
weights after construction (`nn.init` calls on the built model) needs: on the meta device those
calls do nothing, and the module's own init would give other values.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from tessera.models.user import HF_PREFIX
from tessera.strategies.registry import capabilities
from tessera.train.config import TrainConfig
from tessera.train.workload import Workload

__all__ = ["build_model"]


def build_model(
    workload: Workload, config: TrainConfig, device: torch.device, *, announce: bool = False
) -> tuple[nn.Module, Callable[[nn.Module], None] | None]:
    """The run's model after `torch.manual_seed(config.seed)`, and its per-module init.

    Returns `(model, init_fn)`: a meta-device model and the `init_fn` ZeRO-3 materialises it with
    (None: `reset_parameters()`), or the model built whole on `device` and None. `announce`:
    say on stderr why a zero3 run builds its model whole after all.
    """
    torch.manual_seed(config.seed)
    factory = config.model_factory or ""
    on_meta = capabilities(config.strategy).builds_on_meta and config.meta_init
    if on_meta and not factory.startswith(HF_PREFIX):
        from tessera.zero.materialize import meta_problem

        with torch.device("meta"):
            model = workload.model_fn()
        init_fn = getattr(model, "init_module", None)
        problem = meta_problem(model, init_fn)
        if problem is None:
            return model, init_fn
        if announce:
            print(f"tessera: building the model whole on every rank: {problem}", file=sys.stderr)
        torch.manual_seed(config.seed)
    return workload.model_fn().to(device), None
