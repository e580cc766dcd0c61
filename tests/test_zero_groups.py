"""ZeRO keeps the optimizer's parameter groups: the factory sees the model's own parameters.

Recipes group by shape (weight decay on matrices only, none on biases and norms: nanoGPT,
Hugging Face) or by identity (another learning rate for the head). Through
`tessera.setup(model, factory, strategy="zero1|2|3")` on 2 ranks, each rank half of the batch,
against a plain loop in this test on the whole batch (the same factory on a plain model):
- gradients: one SGD step with a different lr per group; `(before - after) / lr` of each
  parameter is its gradient, so this checks both the gradient and that each group got its lr;
- 3 AdamW steps with groups by shape and by identity, and under offload="cpu" and "nvme" (the
  host optimizer keeps the groups), and a scheduler that sets another lr per group;
- resume: 2 AdamW steps, save, a fresh engine loads, 1 more step equals 3 straight (a
  checkpoint is refused by an optimizer with another number of groups);
- hybrid's ZeRO inside pipeline stages (`zero=2` over its dp group) with groups by shape.
A single group hides the bug (every group's hyper-parameters differ here by a factor >= 5),
and the plain loop's own float32 error bounds the comparison (`_tolerance`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.errors import CheckpointError
from tessera.zero import OffloadPolicy
from tests._tolerance import check_close

STEPS, ROWS = 3, 8


class Net(nn.Module):
    """Matrices, biases and a norm (decayed or not by shape) and a head (its own lr)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(5, 8)
        self.norm = nn.LayerNorm(8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.stem(x)))
        return self.head(torch.tanh(self.hidden(h)))


def _model(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(3)
    return Net().to(dtype)


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(ROWS, 5, generator=g).to(dtype), torch.randn(ROWS, 3, generator=g).to(dtype)


def by_shape(params: Any, kind: str = "adamw") -> torch.optim.Optimizer:
    """nanoGPT's groups: weight decay on matrices only."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    if kind == "sgd":  # one step: lr differs per group, so each group's lr is checked
        return torch.optim.SGD([{"params": decay, "lr": 0.1}, {"params": rest}], lr=0.02)
    groups = [{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2)


def by_identity(model: nn.Module) -> Any:
    """The head at 5x the lr of the rest (chosen by identity, as fine-tuning recipes do)."""

    def make(params: Any) -> torch.optim.Optimizer:
        head = list(model.head.parameters())
        rest = [p for p in params if all(p is not h for h in head)]
        return torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 5e-2}], lr=1e-2)

    return make


def _half(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple:
    return tuple(t.tensor_split(2)[rank] for t in batch)


def _train(engine: Any, steps: range, scheduler: Any = None) -> None:
    for step in steps:
        engine.train_step(_half(_batch(step), dist.get_rank()))
        engine.step()
        if scheduler is not None:
            scheduler.step()


def _per_group_schedule(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0, lambda s: 0.5**s])


def _setup(strategy: str, factory: Any, model: nn.Module | None = None, **options: Any) -> Any:
    model = model if model is not None else _model()
    return tessera.setup(model, factory, strategy=strategy, loss_fn=F.mse_loss, **options)


def _ranks(nvme_dir: str, save_dir: str) -> dict[str, Any]:
    """Every configuration's parameters after training, on 2 ranks."""
    out: dict[str, Any] = {}
    for strategy in ("zero1", "zero2", "zero3"):
        engine = _setup(strategy, lambda ps: by_shape(ps, "sgd"))
        _train(engine, range(1))
        out[f"{strategy} sgd"] = engine.full_state_dict()
        engine = _setup(strategy, by_shape)
        _train(engine, range(STEPS))
        out[f"{strategy} shape"] = engine.full_state_dict()
        model = _model()
        engine = _setup(strategy, by_identity(model), model)
        scheduler = _per_group_schedule(engine.optimizer)
        _train(engine, range(STEPS), scheduler)
        out[f"{strategy} identity+schedule"] = engine.full_state_dict()
    # ZeRO inside a pipeline stage (hybrid's zero=1|2 over its dp group) keeps them too.
    engine = _setup("hybrid", by_shape, dp=2, microbatches=2, zero=2)
    _train(engine, range(STEPS))
    out["hybrid-zero2 shape"] = engine.full_state_dict()
    for strategy, offload in (("zero2", "cpu"), ("zero3", "cpu"), ("zero1", "nvme")):
        where = {"nvme_dir": nvme_dir} if offload == "nvme" else {}
        engine = _setup(strategy, by_shape, offload=OffloadPolicy(device=offload, **where))
        _train(engine, range(STEPS))
        out[f"{strategy} shape offload={offload}"] = engine.full_state_dict()
        engine.close()
    model = _model()
    nvme = OffloadPolicy(device="nvme", nvme_dir=nvme_dir, params=True)  # masters in files
    engine = _setup("zero3", by_identity(model), model, offload=nvme)
    _train(engine, range(STEPS))
    out["zero3 identity offload=nvme"] = engine.full_state_dict()
    engine.close()
    for strategy in ("zero2", "zero3"):
        engine = _setup(strategy, by_shape)
        _train(engine, range(2))
        engine.save(f"{save_dir}/{strategy}")
        fresh = _setup(strategy, by_shape)
        fresh.load(f"{save_dir}/{strategy}")
        _train(fresh, range(2, STEPS))
        out[f"{strategy} shape resumed"] = fresh.full_state_dict()
    one_group = _setup("zero2", lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    with pytest.raises(CheckpointError, match="it has 2 parameter groups, this optimizer 1"):
        one_group.load(f"{save_dir}/zero2")
    return out


def _plain(make: Any, steps: int, dtype: torch.dtype, schedule: bool = False) -> dict:
    """The plain loop on the whole batch: the same groups on a plain model."""
    model = _model(dtype)
    optimizer = make(model)
    scheduler = _per_group_schedule(optimizer) if schedule else None
    for step in range(steps):
        x, y = _batch(step, dtype)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_zero_keeps_the_optimizer_groups_under_every_stage_and_offload(run_ranks, tmp_path):
    results = run_ranks(_ranks, 2, str(tmp_path), str(tmp_path / "saved"))
    assert set(results[0]) == set(results[1])
    oracles = {  # what each configuration's plain loop is: (optimizer of a model, steps, lr plan)
        "sgd": (lambda m: by_shape(m.parameters(), "sgd"), 1, False),
        "shape": (lambda m: by_shape(m.parameters()), STEPS, False),
        "identity+schedule": (lambda m: by_identity(m)(m.parameters()), STEPS, True),
        "identity": (lambda m: by_identity(m)(m.parameters()), STEPS, False),
    }
    start = _plain(oracles["sgd"][0], 0, torch.float32)
    failed: list[str] = []
    for name, ours in results[0].items():
        kind = name.split()[1]
        make, steps, schedule = oracles[kind]
        oracle = _plain(make, steps, torch.float32, schedule)
        reference = _plain(make, steps, torch.float64, schedule)
        if kind == "sgd":  # the gradient each group's lr gives: (before - after) / lr
            lrs = {k: 0.1 if start[k].dim() >= 2 else 0.02 for k in start}
            ours, oracle, reference = (
                {k: (start[k].double() - v.double()) / lrs[k] for k, v in d.items()}
                for d in (ours, oracle, reference)
            )
        try:
            check_close(ours, oracle, reference, what=name)
        except AssertionError as error:  # every configuration is checked, then all reported
            failed.append(str(error))
    assert not failed, "\n".join(failed)
