"""Your own model, data and loss under every tessera strategy, with one training function.

    python examples/own_model.py                      # every strategy, 2 local ranks each
    python examples/own_model.py --strategies ddp,zero3 --steps 20

The model is not tessera's: blocks in an `nn.ModuleDict` called one by one around a residual
stream, and a weight used directly in `forward`. The training function is the same for every
strategy; only the `tessera.setup` call's options differ (where to cut the pipeline, how to
split layers for tensor parallelism). A `torch.optim.lr_scheduler` attached to
`engine.optimizer` works unchanged. Every strategy starts from the same weights and sees the
same global batches, so the data-parallel, ZeRO and model-parallel runs print the same losses
as `single` up to float rounding; `local-sgd` averages only every `average_every` steps, so it
follows its own curve.

The same model trains from the command line (see the README, "Your model and your data"):

    tessera train --model examples.own_model:make_model --data examples.own_model:make_dataset \
        --loss examples.own_model:loss_fn --strategy zero2 --steps 20
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import tessera

FEATURES, CLASSES, WIDTH, GLOBAL_BATCH = 12, 4, 32, 16

OPTIONS = {
    "single": {},
    "torch-ddp": {},
    "ddp": {"bucket_cap_mb": 1.0},
    "local-sgd": {"average_every": 2},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "pipeline": {"split": ["blocks.b1"], "microbatches": 2},
    "tensor": {"plan": {"blocks.*.up": "column", "blocks.*.down": "row"}},
}
"""The strategy's own knobs: `tessera.setup(..., strategy=name, **OPTIONS[name])`."""


class Block(nn.Module):
    """An MLP block whose two linears a tensor-parallel plan splits (column, then row)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, WIDTH) -> (batch, WIDTH)."""
        return self.down(F.gelu(self.up(x)))


class ResidualNet(nn.Module):
    """Blocks in a ModuleDict called one by one, and a weight used directly in `forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleDict({"b0": Block(), "b1": Block()})
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, FEATURES) -> logits (batch, CLASSES)."""
        h = self.embed(x)
        for block in self.blocks.values():
            h = h + block(h)
        return self.head(h * self.scale)


def make_model() -> nn.Module:
    """Model factory (`tessera train --model examples.own_model:make_model`)."""
    return ResidualNet()


class Points(torch.utils.data.Dataset):
    """A map-style dataset of (features, label) pairs: points labelled by a fixed projection."""

    def __init__(self, size: int = 512) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, FEATURES, generator=generator)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def make_dataset() -> Points:
    """Data factory (`tessera train --data examples.own_model:make_dataset`)."""
    return Points()


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The user's loss: cross-entropy with a little label smoothing."""
    return F.cross_entropy(output, targets, label_smoothing=0.05)


def train(strategy: str, steps: int) -> list[float]:
    """Train on this rank under `strategy`; return the loss of every step."""
    ctx = tessera.init()
    torch.manual_seed(0)  # the same initial weights on every rank
    engine = tessera.setup(
        make_model(),
        lambda params: torch.optim.AdamW(params, lr=3e-3),
        strategy=strategy,
        loss_fn=loss_fn,
        grad_clip=1.0,
        **OPTIONS[strategy],
    )
    warmup = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: min(1.0, (s + 1) / 5))
    data = make_dataset()
    # this rank's shard of the global batch (`single`: no split, each process trains alone)
    ranks = 1 if strategy == "single" else ctx.world_size
    rank = 0 if strategy == "single" else ctx.rank
    shard = GLOBAL_BATCH // ranks
    losses = []
    for step in range(steps):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))
        mine = order[:GLOBAL_BATCH][rank * shard : (rank + 1) * shard]
        loss = engine.train_step((data.x[mine], data.y[mine]))
        engine.step()
        warmup.step()
        losses.append(loss)
    engine.close()
    return losses


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Run each strategy on `--nproc` local ranks and print its losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(OPTIONS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    results = {}
    for strategy in args.strategies.split(","):
        ranks = tessera.launch(train, args.nproc, strategy, args.steps)
        # data-parallel ranks report their own shard's loss: the global loss is their mean
        per_step = [sum(step) / len(step) for step in zip(*ranks)]
        if strategy in ("single", "pipeline", "tensor"):
            per_step = ranks[0]  # every rank trains on (or reports) the whole batch
        results[strategy] = per_step
        print(f"{strategy:>10}: " + " ".join(f"{loss:.4f}" for loss in per_step))
    return results


if __name__ == "__main__":
    main()
