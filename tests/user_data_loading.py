"""Data tessera never built, for tests/test_data_loader.py (ranks import it by name).

- `images`: 3x8x8 images with random augmentation in `__getitem__` (a random flip and noise:
  numbers drawn in the loader's workers), labels 0..3; `cnn` classifies them;
- `texts`: token sequences of 3 to 9 tokens, padded per batch by `pad_collate` into
  `{input_ids, lengths, labels}` dict batches (`--input-keys input_ids,lengths --target-keys
  labels`); `bag` is a model of two keyword inputs;
- `two_inputs`: `((a, b), y)` items; `TwoInput` is `forward(a, b)`;
- `slow`: items that cost `SLOW_S` each to fetch (decoding, say), for the loader benchmark;
- `evens`: dict items with an `id` field, for checking which items a pass saw.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

SLOW_S = 0.010


class Images(torch.utils.data.Dataset):
    def __init__(self, count: int = 64) -> None:
        generator = torch.Generator().manual_seed(11)
        self.images = torch.randn(count, 3, 8, 8, generator=generator)
        self.labels = torch.randint(0, 4, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if torch.rand(()) < 0.5:  # augmentation: drawn wherever the item is fetched
            image = image.flip(-1)
        return image + 0.1 * torch.randn_like(image), self.labels[index]


def images() -> Images:
    return Images()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 4)
    )


def cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)


class Texts(torch.utils.data.Dataset):
    """Variable-length sequences; the label says whether token 1 occurs more than token 2."""

    def __init__(self, count: int = 48) -> None:
        generator = torch.Generator().manual_seed(5)
        lengths = torch.randint(3, 10, (count,), generator=generator).tolist()
        self.seqs = [torch.randint(1, 12, (n,), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, index: int) -> dict[str, object]:
        seq = self.seqs[index]
        return {"tokens": seq.tolist(), "label": int((seq == 1).sum() > (seq == 2).sum())}


def texts() -> Texts:
    return Texts()


def pad_collate(items: list[dict[str, object]]) -> dict[str, torch.Tensor]:
    longest = max(len(item["tokens"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["tokens"])] = torch.tensor(item["tokens"])
    return {
        "input_ids": ids,
        "lengths": torch.tensor([len(item["tokens"]) for item in items]),
        "labels": torch.tensor([item["label"] for item in items]),
    }


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8, padding_idx=0)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        summed = self.embed(input_ids).sum(1)  # padding embeds to 0
        return self.head(summed / lengths[:, None].float())


def bag() -> nn.Module:
    torch.manual_seed(0)
    return Bag()


class TwoInputs(torch.utils.data.Dataset):
    def __init__(self, count: int = 40) -> None:
        generator = torch.Generator().manual_seed(3)
        self.a = torch.randn(count, 5, generator=generator)
        self.b = torch.randn(count, 3, generator=generator)
        self.y = self.a[:, :2] - self.b[:, 1:]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return (self.a[index], self.b[index]), self.y[index]


def two_inputs() -> TwoInputs:
    return TwoInputs()


def two_inputs_13() -> TwoInputs:
    """13 items: no batch size or rank count divides them."""
    return TwoInputs(13)


class TwoInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 2), nn.Linear(3, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.a(a) + self.b(b)


def two_input() -> nn.Module:
    torch.manual_seed(0)
    return TwoInput()


def mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


class Slow(torch.utils.data.Dataset):
    """Items that cost SLOW_S of waiting each (as decoding a file does), 16 features."""

    def __init__(self, count: int = 4096) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        deadline = time.perf_counter() + SLOW_S
        while time.perf_counter() < deadline:  # busy, as decoding is: it takes a core
            pass
        x = torch.full((16,), float(index % 7))
        return x, x[:4] * 0.5


def slow() -> Slow:
    return Slow()


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(16, 4)


class Stream(torch.utils.data.IterableDataset):
    """`count` dict items with an `id`, in a fresh order every epoch (`set_epoch`)."""

    def __init__(self, count: int = 20) -> None:
        self.count, self.epoch = count, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.count, generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist():
            x = torch.full((3,), i / self.count) + 0.01 * torch.randn(3)  # drawn in the stream
            yield {"id": torch.tensor(i), "x": x, "y": torch.tensor([i % 3 / 3])}


def stream() -> Stream:
    return Stream()


class IdModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, id: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def id_model() -> nn.Module:
    torch.manual_seed(0)
    return IdModel()


def logged_mse(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """mse; each call's ids appended to $IDS_DIR/<rank>.<pid>.txt (one line per call)."""
    folder = os.environ.get("IDS_DIR")
    if folder:
        name = f"{os.environ.get('RANK', 'none')}.{os.getpid()}.txt"
        with open(os.path.join(folder, name), "a") as file:
            file.write(" ".join(str(int(i)) for i in batch["id"]) + "\n")
    return F.mse_loss(output, batch["y"])


class Tagger(nn.Module):
    """A per-token classifier: logits (batch, classes, length), as nn.CrossEntropyLoss takes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8, padding_idx=0)
        self.head = nn.Linear(8, 5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids)).transpose(1, 2)


def tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger()


def texts_13() -> Texts:
    return Texts(13)


def tag_collate(items: list[dict[str, object]]) -> dict[str, torch.Tensor]:
    """Padded ids; each real token's tag is its id mod 5, padding's -100 (not counted)."""
    longest = max(len(item["tokens"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    tags = torch.full((len(items), longest), -100, dtype=torch.long)
    for row, item in enumerate(items):
        seq = torch.tensor(item["tokens"])
        ids[row, : len(seq)], tags[row, : len(seq)] = seq, seq % 5
    return {"input_ids": ids, "labels": tags}


token_loss = nn.CrossEntropyLoss()  # mean over the tokens not ignored (-100)
