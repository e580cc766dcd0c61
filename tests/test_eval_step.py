"""`engine.eval_step(batch)`: the loss of a plain no-grad forward written here, and training
left exactly as it was (a run that evaluates equals one that does not, bit for bit).

The models are not tessera's: dropout (eval mode must switch it off), a layer that draws random
numbers even in eval mode (the RNG stream of training must be restored), a parameter used
directly in forward, and a ModuleDict whose children forward calls one by one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera

ROWS = 8


class Noisy(nn.Module):
    """Uses its parameter directly and draws random numbers in every mode (adds 0 times them)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + 0.0 * torch.rand_like(x)


class Branches(nn.Module):
    """A ModuleDict model whose children forward calls one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({"inp": nn.Linear(6, 16), "out": nn.Linear(16, 3)})
        self.drop = nn.Dropout(0.3)
        self.noise = Noisy(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts["out"](self.noise(self.drop(torch.tanh(self.parts["inp"](x)))))


def _sequential() -> nn.Module:
    """Cuttable into pipeline stages and splittable by a tensor-parallel plan ("0", "3")."""
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 3), Noisy(3))


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)
    return x.to(dtype), y


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _plain_loss(model: nn.Module, batch: tuple, dtype: torch.dtype) -> float:
    """The oracle: a copy in eval mode, one no-grad forward, in `dtype`."""
    model = copy.deepcopy(model).to(dtype).eval()
    with torch.no_grad():
        return float(F.cross_entropy(model(batch[0].to(dtype)), batch[1]))


def _train(model: nn.Module, evaluate: bool) -> tuple[list[float], list[float], dict, Any]:
    engine = tessera.setup(model, _sgd, strategy="single", loss_fn=F.cross_entropy)
    torch.manual_seed(7)  # dropout's stream
    losses, evals = [], []
    for step in range(3):
        if evaluate:
            evals.append(engine.eval_step(_batch(100)))
        losses.append(engine.train_step(_batch(step)))
        engine.step()
    return losses, evals, engine.full_state_dict(), engine


def test_eval_step_is_a_plain_no_grad_loss_and_changes_no_training():
    torch.manual_seed(0)
    model = Branches()
    model.parts["out"].eval()  # a user's mix of modes survives an evaluation
    initial = copy.deepcopy(model)
    plain, plain_evals, plain_state, _ = _train(copy.deepcopy(model), evaluate=False)
    losses, evals, state, engine = _train(model, evaluate=True)
    # bit for bit: the same losses and weights as the run that never evaluated
    assert losses == plain and plain_evals == []
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)
    # the first evaluation saw the initial weights; a plain eval-mode forward gives its loss
    batch = _batch(100)
    check_close(
        evals[0],
        _plain_loss(initial, batch, torch.float32),
        _plain_loss(initial, batch, torch.float64),
        what="eval_step",
    )
    assert model.training and model.drop.training and not model.parts["out"].training
    rng = torch.get_rng_state()
    assert engine.eval_step(batch) == engine.eval_step(batch)  # dropout is off
    assert torch.equal(torch.get_rng_state(), rng)  # Noisy drew, and the stream was restored
    assert all(p.grad is None for p in model.parameters())  # step() cleared them; eval adds none


STRATEGIES = {
    "ddp": {},
    "zero3": {"bucket_cap_mb": 0.001},
    "pipeline": {"microbatches": 2},
    "tensor": {"plan": {"0": "column", "3": "row"}},
    "hybrid": {"dp": 2, "microbatches": 2},  # each dp replica evaluates its rows; the mean
}
GLOBAL = ("pipeline", "tensor", "hybrid")
"""Strategies whose eval_step returns the global batch's loss (the others: this rank's half)."""


def _shard(batch: tuple, rank: int, world: int) -> tuple:
    size = ROWS // world
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def _strategy_runs() -> dict[str, Any]:
    """On each rank, per strategy: a run evaluating before every step and after, and one not."""
    ctx = tessera.init()
    found: dict[str, Any] = {}
    for name, options in STRATEGIES.items():
        runs = []
        for evaluate in (True, False):
            torch.manual_seed(0)
            engine = tessera.setup(
                _sequential(),
                _sgd,
                strategy=name,
                loss_fn=F.cross_entropy,
                ctx=ctx,
                **options,
            )
            torch.manual_seed(11 + ctx.rank)  # each rank's dropout stream, alike in both runs
            evals, losses = [], []
            for step in range(2):
                if evaluate:
                    evals.append(engine.eval_step(_shard(_batch(100), ctx.rank, ctx.world_size)))
                losses.append(engine.train_step(_shard(_batch(step), ctx.rank, ctx.world_size)))
                engine.step()
            if evaluate:
                evals.append(engine.eval_step(_shard(_batch(100), ctx.rank, ctx.world_size)))
            runs.append((evals, losses, engine.full_state_dict()))
            engine.close()
        found[name] = runs
    return found


def test_eval_step_under_two_rank_strategies(run_ranks):
    per_rank = run_ranks(_strategy_runs, 2)
    torch.manual_seed(0)
    initial = _sequential()
    batch = _batch(100)
    for name in STRATEGIES:
        for rank, found in enumerate(per_rank):
            (evals, losses, state), (no_evals, plain_losses, plain_state) = found[name]
            assert no_evals == [] and losses == plain_losses, name
            assert all(torch.equal(state[k], plain_state[k]) for k in plain_state), name
            trained = copy.deepcopy(initial)
            trained.load_state_dict(state)
            mine = batch if name in GLOBAL else _shard(batch, rank, 2)
            for value, model in ((evals[0], initial), (evals[-1], trained)):
                check_close(
                    value,
                    _plain_loss(model, mine, torch.float32),
                    _plain_loss(model, mine, torch.float64),
                    what=f"{name} rank {rank} eval_step",
                )
