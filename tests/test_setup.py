"""`tessera.setup` on models unlike the GPT equals a plain PyTorch loop written here.

Three models, none of them tessera's: a Hugging Face BERT classifier (dict batches, the model's
own loss), a CNN with BatchNorm (pairs, `F.cross_entropy`) and an MLP with a user loss. For every
data-parallel and ZeRO strategy, on 2 ranks each feeding its half of the global batch:

* gradients after `train_step` equal the oracle's (the mean over the ranks' halves);
* three SGD steps without momentum, with `grad_clip` below the gradient norm (so clipping acts)
  and a `LambdaLR` the user attached to `engine.optimizer` (lr factors 1, 1/2, 1/4): the first
  step is "one SGD step", the third shows the scheduler's lr is the one used;
* three AdamW steps.

The oracle: one process, one model, loss = the mean over the ranks' halves of the loss of each
half, each half its own forward. That is what data parallelism defines; for the CNN it matters:
under DDP, BatchNorm normalizes with each rank's *local* batch statistics (no SyncBatchNorm), so
the oracle runs BatchNorm on each half separately, not on the global batch. The running
statistics then differ between ranks (and torch DDP / tessera DDP re-broadcast rank 0's at each
forward), so the CNN comparison covers parameters only. `single` runs every rank on the whole
batch (no communication), its oracle one forward of it. `local-sgd` with `average_every=1` equals
the oracle for SGD without momentum only (the average of the replicas' steps is the step of the
averaged gradient), so it runs the SGD check without clipping (it clips each replica's own norm).

Tolerances from `_tolerance.py`: every oracle run is repeated in float64 (the reference).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera

ROWS = 8  # global batch
DATA_PARALLEL = ["torch-ddp", "ddp", "zero1", "zero2", "zero3"]
SCHEDULE = [1.0, 0.5, 0.25]  # the user's LambdaLR factors of steps 0, 1, 2
ADAM_EXCLUDED = ("attention.self.key.bias",)
"""A key bias has a true gradient of zero (softmax ignores a constant per query); AdamW turns the
reduction-order noise of ~1e-10 into full-size updates, so two correct runs differ there
(DESIGN.md, Testing). The SGD and gradient checks cover it."""


# ----- the models and their batches ---------------------------------------------------------
def _bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=50,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
    )
    return transformers.BertForSequenceClassification(config)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def user_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss no library ships: squared error plus an L1 pull of the outputs."""
    return (output - targets).square().mean() + 0.1 * output.abs().mean()


MODELS = {"bert": (_bert, None), "cnn": (_cnn, F.cross_entropy), "mlp": (_mlp, user_loss)}


def _batch(kind: str, step: int) -> Any:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "bert":
        return {
            "input_ids": torch.randint(0, 50, (ROWS, 6), generator=g),
            "attention_mask": torch.ones(ROWS, 6, dtype=torch.long),
            "labels": torch.randint(0, 2, (ROWS,), generator=g),
        }
    if kind == "cnn":
        return torch.randn(ROWS, 1, 6, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def _rows(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, dict):
        return {k: v[lo:hi] for k, v in batch.items()}
    return tuple(t[lo:hi] for t in batch)


def _shards(batch: Any, strategy: str, world: int) -> list[Any]:
    """What each rank feeds: its half (data parallel) or the whole batch (`single`)."""
    if strategy == "single":
        return [batch]
    size = ROWS // world
    return [_rows(batch, r * size, (r + 1) * size) for r in range(world)]


def _as(batch: Any, dtype: torch.dtype) -> Any:
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return (
        {k: cast(v) for k, v in batch.items()}
        if isinstance(batch, dict)
        else tuple(cast(t) for t in batch)
    )


def _fresh(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind][0]()


# ----- the oracle: a plain PyTorch loop -------------------------------------------------------
def _oracle_loss(model: nn.Module, kind: str, shards: list[Any]) -> torch.Tensor:
    loss_fn = MODELS[kind][1]
    losses = []
    for shard in shards:  # each rank's half its own forward (BatchNorm: local statistics)
        if isinstance(shard, dict):
            losses.append(model(**shard).loss)
        else:
            losses.append(loss_fn(model(shard[0]), shard[1]))
    return torch.stack(losses).mean()


def _oracle(
    kind: str, strategy: str, world: int, optimizer: str, clip: float, dtype, schedule: bool = True
) -> dict:
    """Gradients of step 0 and parameters after each of three steps, in `dtype`; the lr follows
    SCHEDULE, or stays constant with `schedule=False`."""
    model = _fresh(kind).to(dtype)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    factors = SCHEDULE if schedule else [1.0, 1.0, 1.0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factors[min(s, 2)])
    out: dict[str, Any] = {"params": []}
    for step in range(3):
        shards = [_as(s, dtype) for s in _shards(_batch(kind, step), strategy, world)]
        _oracle_loss(model, kind, shards).backward()
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            out["norm"] = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        scheduler.step()
        out["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


# ----- tessera ----------------------------------------------------------------------------------
def _make_optimizer(optimizer: str):
    if optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    return lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's averaged gradient, flattened; ZeRO's gathered from the ranks' slices."""
    zero = getattr(engine, "zero", None)
    if zero is None:
        return {n: p.grad.detach().flatten().clone() for n, p in engine.module.named_parameters()}
    world, out = dist.get_world_size(), {}
    for flat, grad in zip(zero.flats, zero.gradient_slices()):
        parts = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(parts, grad.contiguous())
        full, offsets = torch.cat(parts), flat.layout.offsets
        for index, name in enumerate(flat.layout.names):
            out[name] = full[offsets[index] : offsets[index + 1]].clone()
    return out


def _params(engine: Any) -> dict[str, torch.Tensor]:
    """The parameters (not the buffers) of the full state, in `named_parameters` order."""
    full = engine.full_state_dict()
    return {name: full[name] for name, _ in engine.module.named_parameters()}


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(t.to(device) for t in batch)


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.cpu() for name, tensor in tensors.items()}


def _run(ctx, kind: str, strategy: str, optimizer: str, clip: float, **options) -> dict:
    """Three steps through `tessera.setup` on this rank's device (the oracle runs on the CPU)."""
    engine = tessera.setup(
        _fresh(kind).to(ctx.device),
        _make_optimizer(optimizer),
        strategy=strategy,
        loss_fn=MODELS[kind][1],
        grad_clip=clip,
        ctx=ctx,
        **options,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: SCHEDULE[min(s, 2)])
    out: dict[str, Any] = {"params": []}
    for step in range(3):
        shards = _shards(_batch(kind, step), strategy, ctx.world_size)
        engine.train_step(_to(shards[0 if strategy == "single" else ctx.rank], ctx.device))
        if step == 0 and strategy != "local-sgd":
            out["grads"] = _cpu(_full_grads(engine))
        engine.step()
        scheduler.step()
        out["params"].append(_cpu(_params(engine)))
    engine.close()
    return out


def _compare(ctx, kind: str, strategy: str) -> None:
    world = ctx.world_size
    sgd_clip = 0.0
    if strategy != "local-sgd":  # half the first gradient's norm: clipping acts
        sgd_clip = 0.5 * float(_oracle(kind, strategy, world, "sgd", 0.0, torch.float64)["norm"])
    options = {"average_every": 1} if strategy == "local-sgd" else {}
    ours = _run(ctx, kind, strategy, "sgd", sgd_clip, **options)
    oracle = _oracle(kind, strategy, world, "sgd", sgd_clip, torch.float32)
    exact = _oracle(kind, strategy, world, "sgd", sgd_clip, torch.float64)
    what = f"{strategy} {kind}"
    if "grads" in ours:
        flat = lambda d: {n: d[n].flatten() for n in exact["grads"]}  # noqa: E731
        grads = (flat(ours["grads"]), flat(oracle["grads"]), flat(exact["grads"]))
        check_close(*grads, what=f"{what} gradients")
    for step in (0, 2):  # one SGD step; the third, at the lr the user's scheduler set
        check_close(
            ours["params"][step],
            oracle["params"][step],
            exact["params"][step],
            what=f"{what} SGD step {step + 1}",
        )
    if strategy == "local-sgd":
        return
    ours = _run(ctx, kind, strategy, "adamw", 0.0)
    oracle = _oracle(kind, strategy, world, "adamw", 0.0, torch.float32)
    exact = _oracle(kind, strategy, world, "adamw", 0.0, torch.float64)
    keep = lambda d: {k: v for k, v in d.items() if not k.endswith(ADAM_EXCLUDED)}  # noqa: E731
    check_close(
        keep(ours["params"][2]),
        keep(oracle["params"][2]),
        keep(exact["params"][2]),
        what=f"{what} AdamW 3 steps",
    )


def _errors(ctx) -> None:
    """One message each, raised on every rank alike (no rank waits on another) and before any
    parameter changes."""

    class NoLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    model = NoLoss()
    engine = tessera.setup(model, _make_optimizer("sgd"), strategy="ddp", ctx=ctx)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="NoLoss returned no loss"):
        engine.train_step({"x": torch.randn(2, 5)})
    with pytest.raises(ValueError, match="pass loss_fn=fn\\(output, targets\\)"):
        engine.train_step((torch.randn(2, 5), torch.randn(2, 2)))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def setup_worker() -> bool:
    ctx = tessera.init()
    _errors(ctx)
    for kind in MODELS:
        for strategy in ["single", *DATA_PARALLEL, "local-sgd"]:
            _compare(ctx, kind, strategy)
    return True


def test_setup_equals_a_plain_loop_for_every_data_parallel_strategy(run_ranks):
    assert run_ranks(setup_worker, 2, deadline_s=600) == [True, True]


def gpu_setup_worker() -> bool:
    """The same checks on CUDA tensors with NCCL (one rank per GPU); the oracle stays on the CPU.

    TF32 is turned off: it rounds matmul and convolution inputs to 10 mantissa bits, an error
    the float32 oracle does not make (the tolerance is derived from float32 rounding).
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ctx = tessera.init()
    assert ctx.device.type == "cuda" and ctx.backend == "nccl"
    for kind in MODELS:
        for strategy in ["single", *DATA_PARALLEL, "local-sgd"]:
            _compare(ctx, kind, strategy)
    return True


@pytest.mark.gpu
def test_setup_equals_a_plain_loop_on_gpus(run_ranks):
    # one rank per GPU, as many as divide the global batch of 8 rows (1, 2, 4 or 8)
    world = max(n for n in (1, 2, 4, 8) if n <= torch.cuda.device_count())
    assert run_ranks(gpu_setup_worker, world, deadline_s=900) == [True] * world
