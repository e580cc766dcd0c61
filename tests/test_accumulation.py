"""Gradient accumulation (`tessera.setup(..., grad_accum=K)`, `--grad-accum`) equals the big batch.

Against a plain PyTorch loop written here, on one process and the whole global batch: with K=4
micro-batches per `train_step`, the gradients before the step, the parameters after one SGD step
without momentum, and after three AdamW steps, for ddp, torch-ddp, zero1-3 (one 2-rank spawn)
and single (in-process, with a batch K does not divide: each micro loss is weighted by its share
of the rows); one SGD step for tensor (which accumulates as single does, on the gathered batch),
pipeline (which runs K times its micro-batches) and local-sgd in the same spawn. The gradient
reduction happens once per optimizer step: the buckets reduced in one K=4 `train_step` are
counted. The model is unlike tessera's: a `ModuleDict` whose children are called one by one,
one of them twice, and a parameter used directly in forward.

Tolerances from `_tolerance.py`: every oracle run is repeated in float64 (the reference).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _tolerance import check_close
from test_setup import _full_grads, _params
from torch import nn

import tessera
from tessera.strategies.batch import split_for_accumulation
from tessera.strategies.torch_ddp import TorchDDPEngine
from tessera.strategies.zero import ZeroEngine

K = 4
ROWS = 16  # global batch: 8 rows per rank, micro-batches of 2
STRATEGIES = ["ddp", "torch-ddp", "zero1", "zero2", "zero3"]


class Blocks(nn.Module):
    """Children in a ModuleDict, called one by one; `mid` twice; `scale` used directly."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(
            {"inp": nn.Linear(5, 8), "mid": nn.Linear(8, 8), "out": nn.Linear(8, 3)}
        )
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks["inp"](x)) * self.scale
        h = torch.tanh(self.blocks["mid"](h))
        return self.blocks["out"](torch.tanh(self.blocks["mid"](h)))


def user_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A mean over rows no library ships: squared error plus an L1 pull of the outputs."""
    return (output - targets).square().mean() + 0.1 * output.abs().mean()


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _fresh(dtype: torch.dtype = torch.float32, kind: str = "blocks") -> nn.Module:
    torch.manual_seed(0)
    return (Blocks() if kind == "blocks" else _sequential()).to(dtype)


def _batch(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)


def _make(optimizer: str, params: Any) -> torch.optim.Optimizer:
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _oracle(
    optimizer: str, steps: int, dtype: torch.dtype, rows: int = ROWS, kind: str = "blocks"
) -> dict:
    """The plain loop: one forward of the whole global batch per step."""
    model = _fresh(dtype, kind)
    opt = _make(optimizer, model.parameters())
    out: dict[str, Any] = {}
    for step in range(steps):
        x, y = (t.to(dtype) for t in _batch(step, rows))
        loss = user_loss(model(x), y)
        loss.backward()
        if step == 0:
            out["loss"] = loss.detach()
            out["grads"] = {
                n: p.grad.detach().flatten().clone() for n, p in model.named_parameters()
            }
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _count_reductions(engine: Any) -> tuple[list[int], int]:
    """A counter of the gradient reductions the engine launches, and how many buckets it has."""
    calls: list[int] = []
    if not isinstance(engine, TorchDDPEngine):  # tessera's DDP and ZeRO: their Reducer
        reducer = engine.zero.reducer if isinstance(engine, ZeroEngine) else engine.ddp.reducer
        reduce = reducer._reduce_bucket

        def counted(bucket: Any) -> None:
            calls.append(1)
            reduce(bucket)

        reducer._reduce_bucket = counted
        return calls, len(reducer.buckets)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # noqa: ANN001, ANN202 - torch checks an annotation's type
        calls.append(1)
        return allreduce_hook(None, bucket)

    engine.ddp.register_comm_hook(None, hook)
    return calls, 1  # a model of a few hundred floats fits DDP's first bucket


def _mine(ctx: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's half of the global batch of `step`."""
    half = ROWS // ctx.world_size
    return tuple(t[ctx.rank * half : (ctx.rank + 1) * half] for t in _batch(step))


def _run(ctx: Any, strategy: str, optimizer: str, steps: int) -> dict:
    engine = tessera.setup(
        _fresh(), lambda p: _make(optimizer, p), strategy=strategy, loss_fn=user_loss,
        grad_accum=K, ctx=ctx,
    )  # fmt: skip
    calls, buckets = _count_reductions(engine)
    out: dict[str, Any] = {}
    for step in range(steps):
        loss = engine.train_step(_mine(ctx, step))
        if step == 0:
            assert len(calls) == buckets, (strategy, "reductions in one step", len(calls), buckets)
            out["loss"] = loss
            grads = _full_grads(engine)  # ZeRO's in bucket order
            out["grads"] = {name: grads[name] for name, _ in engine.module.named_parameters()}
        engine.step()
    out["params"] = _params(engine)
    engine.close()
    return out


def _compare(ctx: Any, strategy: str) -> None:
    ours, oracle, exact = (
        _run(ctx, strategy, "sgd", 1),
        _oracle("sgd", 1, torch.float32),
        _oracle("sgd", 1, torch.float64),
    )
    check_close(ours["grads"], oracle["grads"], exact["grads"], what=f"{strategy} gradients")
    check_close(ours["params"], oracle["params"], exact["params"], what=f"{strategy} SGD step")
    ours = _run(ctx, strategy, "adamw", 3)
    oracle, exact = _oracle("adamw", 3, torch.float32), _oracle("adamw", 3, torch.float64)
    check_close(ours["params"], oracle["params"], exact["params"], what=f"{strategy} AdamW x3")


def _other_strategies(ctx: Any) -> None:
    """Tensor parallelism accumulates as `single` does (every rank on the gathered batch); a
    pipeline runs K times its micro-batches; local SGD accumulates on each replica (averaged
    every step, SGD without momentum: the big batch's step). One SGD step each, K=2."""
    runs = (
        ("tensor", "seq", {"plan": {"0": "column", "2": "row"}}),
        ("pipeline", "seq", {"microbatches": 2}),
        ("local-sgd", "blocks", {"average_every": 1}),
    )
    for strategy, kind, options in runs:
        engine = tessera.setup(
            _fresh(kind=kind), lambda p: _make("sgd", p), strategy=strategy, loss_fn=user_loss,
            grad_accum=2, ctx=ctx, **options,
        )  # fmt: skip
        if strategy == "pipeline":
            assert engine.pipe.num_microbatches == 4
        engine.train_step(_mine(ctx, 0))
        engine.step()
        full = engine.full_state_dict()
        oracle = _oracle("sgd", 1, torch.float32, kind=kind)["params"]
        exact = _oracle("sgd", 1, torch.float64, kind=kind)["params"]
        ours = {name: full[name].cpu() for name in exact}
        check_close(ours, oracle, exact, what=f"{strategy} SGD step")


def accumulation_worker() -> bool:
    ctx = tessera.init()
    for strategy in STRATEGIES:
        _compare(ctx, strategy)
    _other_strategies(ctx)
    return True


def test_accumulation_equals_the_big_batch_and_reduces_once(run_ranks):
    assert run_ranks(accumulation_worker, 2) == [True, True]


def test_single_accumulates_uneven_micro_batches_by_their_share():
    """10 rows in 4 micro-batches (3, 3, 2, 2): each weighted by its share, not by 1/4."""
    rows = 10
    ctx = tessera.init()
    for optimizer, steps in (("sgd", 1), ("adamw", 3)):
        engine = tessera.setup(
            _fresh(), lambda p, o=optimizer: _make(o, p), strategy="single", loss_fn=user_loss,
            grad_accum=K, ctx=ctx,
        )  # fmt: skip
        oracle = _oracle(optimizer, steps, torch.float32, rows)
        exact = _oracle(optimizer, steps, torch.float64, rows)
        for step in range(steps):
            loss = engine.train_step(_batch(step, rows))
            if step == 0:
                grads = {n: p.grad.flatten() for n, p in engine.module.named_parameters()}
                check_close(grads, oracle["grads"], exact["grads"], what="single gradients")
                found = torch.tensor(float(loss))
                check_close(found, oracle["loss"], exact["loss"], what="single loss")
            engine.step()
        check_close(_params(engine), oracle["params"], exact["params"], what=f"single {optimizer}")


def test_split_shares_and_bad_grad_accum():
    parts = split_for_accumulation({"a": torch.arange(10), "b": torch.zeros(10, 2)}, 4)
    assert [len(micro["a"]) for micro, _ in parts] == [3, 3, 2, 2]
    assert [share for _, share in parts] == [0.3, 0.3, 0.2, 0.2]
    assert torch.equal(torch.cat([micro["a"] for micro, _ in parts]), torch.arange(10))
    with pytest.raises(ValueError, match="3 rows does not split into grad_accum=4"):
        split_for_accumulation((torch.zeros(3), torch.zeros(3)), 4)
    with pytest.raises(TypeError, match="a batch is a dict of tensors or an .* got Tensor"):
        split_for_accumulation(torch.zeros(8, 2), 4)
    with pytest.raises(ValueError, match="the same size on dim 0"):
        split_for_accumulation({"x": torch.zeros(8), "mask": torch.zeros(4)}, 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
            tessera.setup(_fresh(), lambda p: _make("sgd", p), strategy="single", grad_accum=bad)
        with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
            split_for_accumulation(_batch(0), bad)  # an engine's attribute set by hand
