"""Models, data and losses of the trainer-recipe tests, imported by `tessera train --model ...`.

Importable as `user_recipes` (tests/ is on sys.path, in pytest's process and its ranks). Nothing
here is tessera's: what a user would write for their own model.
"""

from __future__ import annotations

import torch
from torch import nn


class Probe(nn.Module):
    """A linear map plus two parameters whose gradient is exactly zero: under AdamW a zero
    gradient moves nothing, so whatever changes them is the weight decay alone. `gain` is 1-D
    (a norm's weight), `mixer` 2-D (a matrix)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 2)
        self.gain = nn.Parameter(torch.ones(4))
        self.mixer = nn.Parameter(torch.ones(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + 0.0 * (self.gain.sum() + self.mixer.sum())


def probe() -> nn.Module:
    return Probe()
