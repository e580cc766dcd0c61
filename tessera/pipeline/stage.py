"""A pipeline stage: this rank's slice of an `nn.Sequential`, and its links to the other stages.

The stage is built from the user's model itself (the same layer objects, no copies), so an
optimizer built on `stage.module` trains the user's parameters. A parameter used by layers of
several stages (a language model's embedding tied to its output head) exists once per stage; the
stages holding it add their gradients after backward, as Megatron-LM does for the word embedding
(Shoeybi et al. 2019), so every copy takes the same step and the model equals the unsplit one.

A stage is anything with `module` (its parameters), `index`, `run(inputs, received)` and
`full_key(key)`: `StageSlice` (layers of an `nn.Sequential`), `ModelStage` (a whole model as the
only stage) and `trace.TracedStage` (a stage cut out of any model's traced graph). The links between
stages are in `links.py`, the messages they carry in `messages.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelStage",
    "StageSlice",
    "call_model",
    "shared_parameters",
    "slice_stage",
    "tied_parameters",
]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """`model(**inputs)` for a dict micro-batch (Hugging Face style), else `model(inputs)`."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


@dataclass
class StageSlice:
    """This rank's layers `[start, end)` of the full model, as an `nn.Sequential`."""

    module: nn.Sequential
    index: int
    start: int
    end: int

    def full_key(self, local_key: str) -> str:
        """Map `"<i>.rest"` of the stage's state dict to the full model's `"<start+i>.rest"`."""
        head, _, rest = local_key.partition(".")
        return f"{self.start + int(head)}.{rest}"

    def run(self, inputs: Any, received: tuple[torch.Tensor, ...]) -> Any:
        """The layers on the model's input (first stage) or on the received activation."""
        return self.module(inputs if self.index == 0 else received[0])


@dataclass
class ModelStage:
    """A whole model of any kind as the only stage (no split: gradient accumulation)."""

    module: nn.Module
    index: int = 0

    def full_key(self, local_key: str) -> str:
        """The model's own key."""
        return local_key

    def run(self, inputs: Any, received: tuple[torch.Tensor, ...]) -> Any:
        """The model on one micro-batch."""
        return call_model(self.module, inputs)


def slice_stage(model: nn.Sequential, bounds: list[tuple[int, int]], index: int) -> StageSlice:
    """The stage `index` of `model` cut at `bounds` (sharing the model's layer objects)."""
    start, end = bounds[index]
    return StageSlice(nn.Sequential(*[model[i] for i in range(start, end)]), index, start, end)


def shared_parameters(
    model: nn.Sequential, bounds: list[tuple[int, int]]
) -> list[tuple[int, list[int]]]:
    """Parameters held by more than one stage: `(position in model.parameters(), stages)`.

    Positions follow `model.parameters()` of the full model, identical on every rank, so the
    stages agree on which tied gradient a message carries without exchanging names.
    """
    stage_params = [
        [p for i in range(start, end) for p in model[i].parameters()] for start, end in bounds
    ]
    return tied_parameters(model, stage_params)


def tied_parameters(
    model: nn.Module, stage_params: Sequence[Sequence[nn.Parameter]]
) -> list[tuple[int, list[int]]]:
    """`(position in model.parameters(), stages)` of each parameter several stages hold."""
    stages_of: dict[int, set[int]] = {}
    for stage, params in enumerate(stage_params):
        for p in params:
            stages_of.setdefault(id(p), set()).add(stage)
    order = {id(p): k for k, p in enumerate(model.parameters())}
    return sorted(
        (order[pid], sorted(stages)) for pid, stages in stages_of.items() if len(stages) > 1
    )
