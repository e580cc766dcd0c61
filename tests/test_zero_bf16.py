"""bf16 and fp16 with a frozen layer and a dict batch of float inputs, under every strategy.

ZeRO's bf16 keeps bf16 weights; a frozen layer (not sharded) stays fp32 and a keyword argument
is not cast, and both once met bf16 activations: "mat1 and mat2 must have the same dtype". On 2
ranks, each with half the batch, `tessera.setup(..., precision="bf16" | "fp16")` of ddp,
torch-ddp, zero1-3, pipeline, tensor and hybrid dp=2 (single: each rank the whole batch) trains a
model with a frozen first layer on a dict batch whose float `scale` is a keyword argument, 3 SGD
steps (zero2/zero3 with `offload="cpu"`, which steps Adam(W) only: one AdamW step, `_adamw`).
Against the plain fp32 loop written here, the budget
is derived from the low precision's rounding, as in `test_precision`: after T SGD steps the
weights differ by lr * sum_t (g_t' - g_t), and each gradient element is a chain of at most
ROUNDINGS roundings of relative error <= u, so ||w' - w|| <= lr * ROUNDINGS * u * sum_t ||g_t||
(plus 16 float32 ulps of the weights). A plain autocast loop, written here too, must fall within
the same budget (the bound is not too tight for a correct run), and every run must differ from
fp32 (the low precision is used). The frozen layer must come back fp32 and unchanged.

BatchNorm under ZeRO's bf16 (fp32 running statistics beside bf16 weights) once crashed too
("expected scalar type BFloat16 but found Float"): a model with one trains under ddp and zero1-3
in bf16 and is compared, as `_tolerance` does, with a plain autocast loop that does what two
data-parallel ranks do (each half normalised on its own, the gradients averaged), its own bf16
error against float64 bounding ours; its BatchNorm parameters come back fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.zero import OffloadPolicy
from tests._tolerance import FP32_ULP, check_close

LR, STEPS, ROWS = 0.05, 3, 8
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
"""Half of each format's machine epsilon: the relative error of one rounding to nearest."""
ROUNDINGS = 3 * 6 + 2 * 2 + 2 + 1
"""Low-precision roundings on the longest path to one weight gradient: each of the three Linears
rounds its input, its weight and its output in forward and the incoming gradient, the other
factor and the product in backward (6); each tanh its output and its gradient (2); the product
with `scale` its result and its gradient (2); the reduction the averaged gradient (1)."""
STRATEGIES = {
    "single": {},  # (every rank alone on the whole batch)
    "ddp": {},
    "torch-ddp": {},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "pipeline": {"split": ["head"], "microbatches": 2},
    "tensor": {"plan": {"adapter": "column", "head": "row"}},
    "hybrid": {"dp": 2, "microbatches": 2},
    "zero2 cpu": {"offload": OffloadPolicy(device="cpu")},  # one AdamW step (`_adamw`)
    "zero3 cpu": {"offload": OffloadPolicy(device="cpu")},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("pair", "dict")


class FrozenBase(nn.Module):
    """A frozen first layer (a pretrained base), then trained layers; takes a dict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(5, 16)
        self.adapter = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.base.requires_grad_(False)

    def forward(self, features: torch.Tensor, scale: Any = None, labels: Any = None) -> Any:
        h = torch.tanh(self.base(features))
        h = h * scale if scale is not None else h
        return self.head(torch.tanh(self.adapter(h)))


def _model() -> FrozenBase:
    torch.manual_seed(0)
    return FrozenBase()


def _batch(step: int, kind: str) -> Any:
    """A dict batch (float `scale` a keyword argument) or an (inputs, targets) pair."""
    g = torch.Generator().manual_seed(20 + step)
    batch = {
        "features": torch.randn(ROWS, 5, generator=g),
        "scale": 0.5 + torch.rand(ROWS, 1, generator=g),
        "labels": torch.randint(0, 3, (ROWS,), generator=g),
    }
    return batch if kind == "dict" else (batch["features"], batch["labels"])


def _half(batch: Any, rank: int) -> Any:
    if isinstance(batch, dict):
        return {k: v.tensor_split(2)[rank] for k, v in batch.items()}
    return tuple(t.tensor_split(2)[rank] for t in batch)


def _loss(output: torch.Tensor, targets: Any) -> torch.Tensor:
    labels = targets["labels"] if isinstance(targets, dict) else targets
    return F.cross_entropy(output.float(), labels)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _adamw(params: Any) -> torch.optim.Optimizer:
    """Offload steps Adam(W) only. One step with eps 1 moves a weight by lr * g / (|g| + 1),
    whose change is at most lr times the gradient's: SGD's budget holds for it."""
    return torch.optim.AdamW(params, lr=LR, eps=1.0, weight_decay=0.0)


def _recipe(strategy: str) -> tuple[Any, int]:
    """(optimizer factory, steps) of a run: offload one AdamW step, the others SGD."""
    return (_adamw, 1) if strategy.endswith("cpu") else (_sgd, STEPS)


def _ranks() -> tuple[dict, dict]:
    rank = tessera.init().rank
    finals = {}
    for strategy, options in STRATEGIES.items():
        for precision in ("bf16", "fp16"):
            for kind in KINDS:  # pair: bf16 inputs meet the frozen layer; dict: a kwarg, bf16
                factory, steps = _recipe(strategy)
                engine = tessera.setup(
                    _model(), factory, strategy=strategy.split()[0], loss_fn=_loss,
                    precision=precision, **options,
                )  # fmt: skip
                for step in range(steps):
                    batch = _batch(step, kind)
                    engine.train_step(batch if strategy == "single" else _half(batch, rank))
                    engine.step()
                finals[strategy, precision, kind] = engine.full_state_dict()
                engine.close()
    return finals, _batch_norm_ranks(rank)


class Normed(nn.Module):
    """A Linear, BatchNorm (fp32 running statistics), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _normed(dtype: torch.dtype = torch.float32) -> Normed:
    torch.manual_seed(1)
    return Normed().to(dtype)


def _batch_norm_ranks(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """bf16 with BatchNorm: its statistics are fp32 buffers beside bf16 activations."""
    finals = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        engine = tessera.setup(_normed(), _sgd, strategy=strategy, loss_fn=_loss, precision="bf16")
        for step in range(STEPS):
            engine.train_step(_half(_batch(step, "pair"), rank))
            engine.step()
        finals[strategy] = engine.full_state_dict()
        engine.eval_step(_half(_batch(0, "pair"), rank))  # eval mode: the running statistics
        engine.close()
    return finals


def _batch_norm_plain(dtype: torch.dtype, autocast: bool) -> dict[str, torch.Tensor]:
    """Two ranks' data parallelism in one process: BatchNorm normalises each half on its
    own, the gradient is the mean of the halves' (a ddp rank keeps its own statistics)."""
    model = _normed(dtype)
    optimizer = _sgd(model.parameters())
    for step in range(STEPS):
        x, y = _batch(step, "pair")
        optimizer.zero_grad()
        for rows in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x.tensor_split(2)[rows].to(dtype))
            (_loss(out, y.tensor_split(2)[rows]) / 2).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _plain(kind: str, dtype: torch.dtype | None, strategy: str = "") -> tuple[dict, dict]:
    """The whole batch in one process, under autocast to `dtype` (None: fp32), with the
    optimizer and steps of `strategy`'s runs; the final weights and, per tensor, sum_t ||g_t||."""
    model = _model()
    factory, steps = _recipe(strategy)
    optimizer = factory(model.parameters())
    norms = dict.fromkeys(model.state_dict(), 0.0)
    for step in range(steps):
        batch = _batch(step, kind)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            output = model(**batch) if kind == "dict" else model(batch[0])
            loss = _loss(output, batch if kind == "dict" else batch[1])
        optimizer.zero_grad()
        loss.backward()
        for name, param in model.named_parameters():
            if param.grad is not None:
                norms[name] += param.grad.norm().item()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def test_low_precision_trains_frozen_layers_and_dict_batches_under_every_strategy(run_ranks):
    finals, batch_norm = run_ranks(_ranks, 2)[0]
    plain = {k: (_plain(k, None), {p: _plain(k, d)[0] for p, d in DTYPES.items()}) for k in KINDS}
    start = _model().state_dict()
    runs = {**finals, **{("plain autocast", p, k): plain[k][1][p] for p in DTYPES for k in KINDS}}
    assert len(runs) == 4 * len(STRATEGIES) + 4
    adamw = {k: _plain(k, None, "zero2 cpu") for k in KINDS}
    for (strategy, precision, kind), state in runs.items():
        fp32, norms = adamw[kind] if strategy.endswith("cpu") else plain[kind][0]
        assert any(not torch.equal(state[k], fp32[k]) for k in state), (strategy, precision, kind)
        for name in ("base.weight", "base.bias"):  # frozen: fp32 and untouched
            assert state[name].dtype == torch.float32, (strategy, precision, kind, name)
            assert torch.equal(state[name], start[name]), (strategy, precision, kind, name)
        for name, value in state.items():
            budget = LR * ROUNDINGS * UNIT_ROUNDOFF[precision] * norms[name]
            budget += 16 * FP32_ULP * fp32[name].norm().item()
            error = (value.double() - fp32[name].double()).norm().item()
            assert error <= budget, (strategy, precision, kind, name, error, budget)
    # BatchNorm: against the plain autocast loop, as `_tolerance` compares (its own bf16 error,
    # measured against float64, bounds ours); its parameters stay fp32 (as FSDP keeps them).
    oracle = _batch_norm_plain(torch.float32, autocast=True)
    reference = _batch_norm_plain(torch.float64, autocast=False)
    for strategy, state in batch_norm.items():
        assert state["layers.1.weight"].dtype == torch.float32, strategy
        ours = {name: state[name] for name in reference}
        check_close(ours, oracle, reference, what=f"{strategy} bf16 BatchNorm")
