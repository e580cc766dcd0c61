"""A multi-layer perceptron: the smallest model every strategy is tested on.

Its parameters are a handful of dense matrices, so a data-parallel or ZeRO run can be compared
with single-process training exactly and quickly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MLP", "MLPConfig"]


@dataclass(kw_only=True, frozen=True)
class MLPConfig:
    """Shape of an :class:`MLP`."""

    in_features: int = 64
    """Width of each input row."""
    hidden: tuple[int, ...] = (128, 128)
    """Width of each hidden layer, in order; empty means a single linear layer."""
    out_features: int = 10
    """Number of output logits (classes)."""

    def __post_init__(self) -> None:
        if self.in_features <= 0:
            raise ValueError(f"in_features must be positive, got {self.in_features}")
        if self.out_features <= 0:
            raise ValueError(f"out_features must be positive, got {self.out_features}")
        # Accept a list from JSON/CLI configs but store a tuple so the config stays hashable.
        object.__setattr__(self, "hidden", tuple(self.hidden))
        if any(int(h) <= 0 for h in self.hidden):
            raise ValueError(f"hidden widths must all be positive, got {self.hidden}")


class MLP(nn.Module):
    """Linear + ReLU layers, then a final Linear producing logits (no activation)."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.in_features, *config.hidden]
        layers: list[nn.Module] = []
        for width_in, width_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], config.out_features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map inputs ``(B, in_features)`` to logits ``(B, out_features)``."""
        return self.layers(x)

    def num_parameters(self) -> int:
        """Number of scalar parameters."""
        return sum(p.numel() for p in self.parameters())
