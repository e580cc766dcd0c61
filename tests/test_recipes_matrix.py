"""The cells of README's recipe x strategy table that no other test holds (issue 29).

Through `tessera.setup` on 2 ranks, against a plain PyTorch loop written here on the whole batch
(float32 the oracle, float64 the yardstick: `_tolerance.check_close`):
- optimizer groups by shape and by identity (decay on matrices only, none on vectors, the head
  at 5x the lr: three groups whose hyper-parameters differ) under single, ddp, torch-ddp,
  pipeline, tensor and hybrid (dp=2, tp=2), 3 AdamW steps (ZeRO: test_zero_groups);
- an auxiliary head the forward never calls under single, pipeline and tensor, 3 AdamW steps
  with weight decay: the head takes no step (no gradient: AdamW skips it, where a zero gradient
  would let the decay move it); zero1-3 (with and without `offload="cpu"`) refuse it at the
  first step naming it (a reduce-scattered bucket would give it a zero gradient), and refuse
  `find_unused_parameters` in `setup` (ddp, torch-ddp, hybrid: test_recipes_strategies);
- dropout + BatchNorm: `eval_step` of the whole batch equals the plain model in `eval()`
  (dropout off, running statistics read) and leaves every tensor as it was, under single, ddp,
  torch-ddp, zero1-3, zero2 with `offload="cpu"`, tensor and hybrid dp=2 (the traced pipeline:
  test_recipes_pipeline).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera
from tessera.zero import OffloadPolicy

ROWS, LR, DECAY, STEPS = 8, 1e-2, 0.1, 3
CPU = {"offload": OffloadPolicy(device="cpu")}


class Net(nn.Module):
    """Matrices, biases, a norm and a head, on a residual stream; `aux` never called."""

    def __init__(self, aux: bool = True) -> None:
        super().__init__()
        self.body = nn.ModuleDict({"up": nn.Linear(6, 16), "down": nn.Linear(16, 6)})
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 4) if aux else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.body["down"](torch.relu(self.body["up"](x)))
        return self.head(self.norm(h))


class Normed(nn.Module):
    """BatchNorm and dropout before two layers a tensor plan can split."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 3)
        self.bn.running_mean.fill_(0.3)  # statistics that are not a batch's (nor 0 and 1)
        self.bn.running_var.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.drop(torch.relu(self.bn(self.inp(x)))))))


PLAN = {"body.up": "column", "body.down": "row"}
GROUPS = {
    "single": {},
    "ddp": {},
    "torch-ddp": {},
    "pipeline": {"split": ["norm"], "microbatches": 2},
    "tensor": {"plan": PLAN},
    "hybrid dp": {"dp": 2, "microbatches": 2},
    "hybrid tp": {"tp": 2, "plan": PLAN, "microbatches": 2},
}
REFUSED_UNUSED = {"zero1": {}, "zero2": {}, "zero3": {}, "zero2 cpu": CPU, "zero3 cpu": CPU}
UNUSED = {
    "single": {},
    "pipeline": {"split": ["norm"], "microbatches": 2},
    "tensor": {"plan": PLAN},
}
EVAL = {
    "single": {},
    "ddp": {},
    "torch-ddp": {},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "zero2 cpu": CPU,
    "tensor": {"plan": {"up": "column", "down": "row"}},
    "hybrid dp": {"dp": 2, "microbatches": 2},
}


def _built(factory: Any = Net) -> nn.Module:
    torch.manual_seed(0)
    return factory()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def _grouped(params: Any) -> torch.optim.Optimizer:
    """Groups by shape (decay on matrices only) and by identity (the head: 5x the lr). The
    head is recognised by its shapes: (3, 6) and (3,) are the head's alone in `Net`, and a
    tensor-parallel or pipeline engine passes the model's own parameters (not shards)."""
    params = list(params)
    head = [p for p in params if tuple(p.shape) in ((3, 6), (3,))]
    rest = [p for p in params if all(p is not q for q in head)]
    return torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": DECAY},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
            {"params": head, "lr": 5 * LR, "weight_decay": DECAY},
        ],
        lr=LR,
    )


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)


def _plain(factory: Any, aux: bool) -> list[dict[str, torch.Tensor]]:
    """The oracle and the yardstick: 3 AdamW steps on the whole batch."""
    states = []
    for dtype in (torch.float32, torch.float64):
        model = _built(lambda: Net(aux)).to(dtype)
        optimizer = factory(model.parameters())
        for step in range(STEPS):
            x, y = (t.to(dtype) for t in _batch(step))
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(model.state_dict())
    return states


def _train(strategy: str, options: dict, factory: Any, ctx: Any, aux: bool) -> dict:
    name = strategy.split()[0]
    world, rank = (1, 0) if name == "single" else (ctx.world_size, ctx.rank)
    rows = ROWS // world
    model = _built(lambda: Net(aux))
    engine = tessera.setup(model, factory, strategy=name, loss_fn=F.mse_loss, **options)
    for step in range(STEPS):
        engine.train_step(tuple(t[rank * rows : (rank + 1) * rows] for t in _batch(step)))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def _evaluated(strategy: str, options: dict) -> None:
    """eval_step of the whole batch on every rank: one meaning under every strategy."""
    name = strategy.split()[0]
    engine = tessera.setup(_built(Normed), _adamw, strategy=name, loss_fn=F.mse_loss, **options)
    before = engine.full_state_dict()
    got = engine.eval_step(_batch(5))
    plain = [_built(Normed).to(dtype).eval() for dtype in (torch.float32, torch.float64)]
    want = [F.mse_loss(m(x.to(d)), y.to(d)).item() for m, d in zip(plain, (torch.float32,
            torch.float64)) for x, y in [_batch(5)]]  # fmt: skip
    check_close(got, want[0], want[1], what=f"{strategy} eval_step")
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), f"{strategy}: eval changed"
    engine.close()


def _cases() -> None:
    ctx = tessera.init()
    initial = _built().state_dict()
    oracle, exact = _plain(_grouped, aux=False)
    for strategy, options in GROUPS.items():
        state = _train(strategy, options, _grouped, ctx, aux=False)
        check_close(state, oracle, exact, what=f"{strategy} groups")
    oracle, exact = _plain(_adamw, aux=True)
    for strategy, options in UNUSED.items():
        state = _train(strategy, options, _adamw, ctx, aux=True)
        for key in ("aux.weight", "aux.bias"):
            assert torch.equal(state[key], initial[key]), (strategy, key)
        check_close(state, oracle, exact, what=f"{strategy} unused head")
    for strategy, options in REFUSED_UNUSED.items():  # as PyTorch DDP without the option
        with pytest.raises(TypeError, match="has no option 'find_unused_parameters'"):
            tessera.setup(Net(), _adamw, strategy=strategy.split()[0], find_unused_parameters=True)
        try:
            _train(strategy, options, _adamw, ctx, aux=True)
        except RuntimeError as error:
            assert "no gradient in this backward: aux.bias, aux.weight" in str(error), strategy
            assert "requires_grad=False" in str(error), strategy
        else:
            raise AssertionError(f"{strategy} trained a model with an unused head")
    for strategy, options in EVAL.items():
        _evaluated(strategy, options)


def test_groups_unused_head_and_evaluation_under_the_other_strategies(run_ranks):
    run_ranks(_cases, 2)
