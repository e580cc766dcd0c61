"""A model as the layers a pipeline cuts: `Layers`, and `model_layers` for any model.

A pipeline cuts an `nn.Sequential` at its layers at once; any other model is traced on its
first batch and cut at named modules (`trace.py`). A model that is a sequence of layers in
another shape provides its own view, so no caller asks which model it holds: tessera's GPT
through `tessera.pipeline.gpt.gpt_layers` (embed, blocks, head; split points named `blocks.i`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tessera.pipeline.partition import balance_from_split

__all__ = ["Layers", "model_layers"]


def _same_keys(state: dict[str, Any]) -> dict[str, Any]:
    return state


@dataclass(frozen=True)
class Layers:
    """How a pipeline cuts one model: the module it runs, where it is cut, its state's keys."""

    sequential: Callable[[], nn.Module]
    """The module the pipeline cuts (the model itself, or a view sharing its modules), built
    when called: after a tensor-parallel plan has replaced the modules it holds."""
    split: list[str] | None
    """The split points as names of that module's layers (or modules to trace at); None."""
    count: int | None
    """Its number of top-level layers; None: not a sequence of layers (traced when split)."""
    balance: list[int] | None = None
    """Layer counts per (virtual) stage where the model fixes them; None: the pipeline's own."""
    own_tp_plan: bool = False
    """The model has a built-in tensor-parallel plan (`parallelize_model(model, None)`)."""
    model_keys: Callable[[dict[str, Any]], dict[str, Any]] = field(default=_same_keys)
    """The view's state-dict keys renamed to the model's own (identity for the model itself)."""

    def eager(self, stages: int) -> bool:
        """Cut at once at layers (True) over `stages` (virtual) stages, or traced (False)."""
        if self.count is None:
            return False
        return self.split is None or balance_from_split(self.count, self.split, stages) is not None


def model_layers(model: nn.Module, split: Sequence[str] | None) -> Layers:
    """The model itself as `Layers`: an `nn.Sequential` counted by its layers, any other model
    traced when split (a model with a view of its own gives that instead: `gpt_layers`)."""
    count = len(model) if isinstance(model, nn.Sequential) else None
    return Layers(lambda: model, list(split) if split is not None else None, count)
