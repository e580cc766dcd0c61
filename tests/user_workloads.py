"""A user's model, data and loss as `tessera train --model/--data/--loss` imports them.

Importable as `user_workloads` because tests/ is on sys.path (pytest's rootdir conftest), in
pytest's process and so in the ranks it launches; the console-script test copies it into the
folder its subprocess runs in.
"""

from __future__ import annotations

import torch
from torch import nn


class Pairs(torch.utils.data.Dataset):
    """(inputs (6,), targets (2,)) pairs: a fixed random linear map plus noise."""

    def __init__(self, size: int = 64) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 6, generator=generator)
        self.y = self.x @ torch.randn(6, 2, generator=generator) + 0.1 * torch.randn(
            size, 2, generator=generator
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Dicts(torch.utils.data.Dataset):
    """Dict items {"features": (6,), "labels": int class in [0, 3)}."""

    def __init__(self, size: int = 64) -> None:
        self.pairs = Pairs(size)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.pairs[index]
        return {"features": x, "labels": int(y[0] > 0) + int(y[1] > 0)}


class Classifier(nn.Module):
    """Takes a dict batch as keywords; returns {"loss", "logits"} like a Hugging Face model."""

    def __init__(self, with_loss: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.with_loss = with_loss

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.body(features)
        if not self.with_loss:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def mlp() -> nn.Module:
    """A small MLP for the pairs."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def pairs() -> Pairs:
    """The (inputs, targets) data set."""
    return Pairs()


def dicts() -> Dicts:
    """The dict data set."""
    return Dicts()


def classifier() -> nn.Module:
    """A model that computes its own loss from a dict batch."""
    return Classifier()


def classifier_without_loss() -> nn.Module:
    """A model that returns logits only: a dict batch then needs --loss."""
    return Classifier(with_loss=False)


def mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The user loss of the pairs."""
    return nn.functional.mse_loss(output, targets)


def dict_loss(output: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A user loss of a dict batch: cross-entropy of the logits against batch["labels"]."""
    return nn.functional.cross_entropy(output["logits"], batch["labels"])


def doubled_loss(output: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A user loss unlike the model's own (twice its cross-entropy): a run that used the model's
    `output["loss"]` instead logs half of it."""
    return 2 * nn.functional.cross_entropy(output["logits"], batch["labels"])


def wrong_items() -> list:
    """A data set whose items are triples: refused before any rank starts."""
    return [(torch.zeros(2), torch.zeros(1), torch.zeros(1))] * 8


BUILT_ON: list[str] = []
"""Where `recorded_mlp` and `value_gated_mlp` were built: "meta" inside `torch.device("meta")`."""


def recorded_mlp() -> nn.Module:
    """`mlp`, noting the device it was built on (the preflight's test reads BUILT_ON)."""
    BUILT_ON.append(torch.empty(0).device.type)
    return mlp()


class _ValueGated(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum().item() < 0:  # a value, which a meta tensor does not have
            raise AssertionError("unreachable")
        return super().forward(x)


def value_gated_mlp() -> nn.Module:
    """An MLP whose forward reads a value (`.item()`): meta tensors cannot run it."""
    BUILT_ON.append(torch.empty(0).device.type)
    return _ValueGated(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def six_to_three() -> nn.Module:
    """A model for items of 3 features, not the pairs' 6: the preflight refuses it."""
    BUILT_ON.append(torch.empty(0).device.type)
    return nn.Sequential(nn.Linear(3, 2))


def reads_weights_at_construction() -> nn.Module:
    """A factory that reads a weight's value while building (meta tensors have none)."""
    model = mlp()
    if model[0].weight.sum().item() != model[0].weight.sum().item():
        raise AssertionError("unreachable")
    return model
