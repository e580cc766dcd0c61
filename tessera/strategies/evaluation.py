"""What `Engine.eval_step` runs under: no gradient, eval mode, and training's state untouched.

An evaluation between two training steps must change nothing of training, so that a run with
evaluation equals one without, bit for bit: no autograd graph (so no gradient hook fires and no
gradient accumulates), the modules in eval mode only for the call (dropout and batch norm as at
inference; each module's own `training` flag restored after, whatever mix the user had), and
the random streams of training as they were: a model that draws random numbers in eval mode (a
user's noise layer) would otherwise shift every dropout mask after it. The optimizer is never
called, so its state stays as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["evaluating"]


@contextlib.contextmanager
def evaluating(*modules: nn.Module) -> Iterator[None]:
    """`torch.no_grad()`, every module of `modules` in eval mode, the RNG states saved; on exit
    the modes and the CPU and CUDA RNG states are restored (also when the body raises)."""
    flags = [(m, m.training) for module in modules for m in module.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        for module in modules:
            module.eval()
        with torch.no_grad():
            yield
    finally:
        for module, training in flags:
            module.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
