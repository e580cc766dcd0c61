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


class ConvNet(nn.Module):
    """A small CNN with BatchNorm between its two convolutions, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return self.head(h.mean(dim=(2, 3)))


def conv_net() -> nn.Module:
    return ConvNet()


class Images(torch.utils.data.Dataset):
    """(image (3, 8, 8), class in [0, 4)) pairs."""

    def __init__(self, size: int = 32) -> None:
        generator = torch.Generator().manual_seed(2)
        self.x = torch.randn(size, 3, 8, 8, generator=generator)
        self.y = torch.randint(0, 4, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def images() -> Images:
    return Images()


def cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, targets)


def fails_on_rank_one() -> nn.Module:
    """Builds in the launcher (its preflight) and on rank 0; rank 1 raises, as a model whose
    code breaks on one machine would, while rank 0 goes on into the engine's first collective."""
    import os

    if os.environ.get("RANK") == "1":
        raise ValueError("this model cannot be built on rank 1")
    return nn.Linear(6, 2)
