"""Real training recipes under tessera's strategies, against a plain PyTorch loop (issue 29).

Models tessera never built, trained through `tessera.setup` (and `tessera train`):
- a frozen layer inside `nn.ModuleDict` blocks, named in a tensor-parallel plan (tensor, hybrid
  tp=2) and inside a data-parallel stage (hybrid dp=2, with and without ZeRO-1): it must stay
  frozen (`requires_grad` False, its weights bit for bit the initial ones) and the rest must train
  as the plain loop trains it;
- an auxiliary head the forward never uses (ddp, torch-ddp, hybrid dp=2): refused without
  `find_unused_parameters=True` where PyTorch DDP refuses it, trained with it as one process
  trains it. AdamW with weight decay tells "no gradient" (one process: the optimizer skips the
  head) from "a zero gradient" (weight decay would shrink it);
- a language model whose head is its embedding (tied) under every strategy (zero3 with
  `offload="cpu"` too, one AdamW step: offload steps Adam(W) only): one step equals the
  plain loop, and save, load (the next step bit for bit) and a safetensors export that a plain
  model loads all work (a tied Hugging Face T5 cut into pipeline stages: test_recipes_pipeline).

The oracle is the same model trained here by plain PyTorch on the whole global batch (float32),
the yardstick the same in float64 (`_tolerance.check_close`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera
from tessera.cli import main
from tessera.zero import OffloadPolicy

ROWS, LR, DECAY, VOCAB = 8, 1e-2, 0.1, 12
PLAN = {"blocks.up": "column", "blocks.down": "row"}


class FrozenBlock(nn.Module):
    """ModuleDict blocks on a residual stream; `blocks.up` frozen (a fine-tuning recipe's base),
    with trainable layers before and after it, so gradients flow through the frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(
            {"base": nn.Linear(6, 8), "up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}
        )
        self.head = nn.Linear(8, 3)
        self.blocks["up"].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks["base"](x))
        h = h + self.blocks["down"](torch.relu(self.blocks["up"](h)))
        return self.head(h)


class AuxHead(nn.Module):
    """A body and an auxiliary head that this forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleDict({"a": nn.Linear(6, 8), "b": nn.Linear(8, 2)})
        self.aux = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body["b"](torch.tanh(self.body["a"](x)))


def aux_head() -> nn.Module:
    """`tessera train --model test_recipes_strategies:aux_head` (6 inputs, 2 outputs)."""
    return AuxHead()


def _built(factory: Any) -> nn.Module:
    torch.manual_seed(0)  # every rank and the oracle: the same initial weights
    return factory()


def _batch(step: int, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, outputs, generator=g)


def _shard(batch: Any, rank: int, world: int) -> Any:
    rows = ROWS // world
    if isinstance(batch, dict):
        return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
    return tuple(t[rank * rows : (rank + 1) * rows] for t in batch)


def _plain_adamw(factory: Any, outputs: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """The oracle (float32) and the yardstick (float64): AdamW on the whole batch."""
    states = []
    for dtype in (torch.float32, torch.float64):
        model = _built(factory).to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        for step in range(steps):
            x, y = (t.to(dtype) for t in _batch(step, outputs))
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(model.state_dict())
    return states


def _train(engine: Any, ctx: Any, outputs: int, steps: int) -> dict[str, torch.Tensor]:
    for step in range(steps):
        engine.train_step(_shard(_batch(step, outputs), ctx.rank, ctx.world_size))
        engine.step()
    return engine.full_state_dict()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)


def _frozen_cases() -> None:
    ctx = tessera.init()
    initial = _built(FrozenBlock).state_dict()
    oracle, exact = _plain_adamw(FrozenBlock, 3, 3)
    frozen = {"blocks.up.weight", "blocks.up.bias"}
    for strategy, options in (
        ("tensor", {"plan": PLAN}),
        ("hybrid", {"tp": 2, "plan": PLAN, "microbatches": 2}),
        ("hybrid", {"dp": 2, "microbatches": 2}),
        ("hybrid", {"dp": 2, "zero": 1, "microbatches": 2}),
    ):
        what = f"{strategy} {options}"
        engine = tessera.setup(
            _built(FrozenBlock), _adamw, strategy=strategy, loss_fn=F.mse_loss, **options
        )
        trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
        assert trainable.isdisjoint(frozen) and len(trainable) == 6, (what, trainable)
        state = _train(engine, ctx, 3, 3)
        for key in frozen:  # not one step taken: bit for bit the initial weights
            assert torch.equal(state[key], initial[key]), (what, key)
        check_close(state, oracle, exact, what=what)
        engine.close()


def test_a_frozen_layer_stays_frozen_under_tensor_and_hybrid(run_ranks):
    run_ranks(_frozen_cases, 2)


def _unused_cases() -> None:
    ctx = tessera.init()
    initial = _built(AuxHead).state_dict()
    oracle, exact = _plain_adamw(AuxHead, 2, 3)
    hybrid = {"dp": 2, "microbatches": 2}
    for strategy, options in (("ddp", {}), ("hybrid", hybrid)):  # PyTorch DDP's refusal
        engine = tessera.setup(
            _built(AuxHead), _adamw, strategy=strategy, loss_fn=F.mse_loss, **options
        )
        with pytest.raises(RuntimeError, match="aux.*pass find_unused_parameters=True"):
            engine.train_step(_shard(_batch(0, 2), ctx.rank, ctx.world_size))
    for strategy, options in (("ddp", {}), ("torch-ddp", {}), ("hybrid", hybrid)):
        engine = tessera.setup(
            _built(AuxHead),
            _adamw,
            strategy=strategy,
            loss_fn=F.mse_loss,
            find_unused_parameters=True,
            **options,
        )
        state = _train(engine, ctx, 2, 3)
        for key in ("aux.weight", "aux.bias"):  # no gradient, so no step (no weight decay)
            assert torch.equal(state[key], initial[key]), (strategy, key)
        check_close(state, oracle, exact, what=f"{strategy} find_unused_parameters")


def test_an_unused_head_trains_with_find_unused_parameters(run_ranks):
    for strategy in ("ddp", "torch-ddp", "hybrid"):
        with pytest.raises(ValueError, match="find_unused_parameters must be True or False"):
            tessera.strategies.make_policy(strategy, {"find_unused_parameters": "yes"})
    run_ranks(_unused_cases, 2)


def test_tessera_train_takes_find_unused_parameters(tmp_path):
    from tessera.train import latest_checkpoint, load_checkpoint
    from tessera.train.export import checkpoint_model_state

    run = tmp_path / "run"
    args = ["train", "--nproc", "2", "--strategy", "ddp", "--model", "test_recipes_strategies:"
            "aux_head", "--data", "user_workloads:pairs", "--loss", "user_workloads:mse",
            "--batch-size", "8", "--steps", "2", "--no-progress", "--out", str(run)]  # fmt: skip
    assert main([*args, "--find-unused-parameters"]) == 0
    path = latest_checkpoint(run)
    state = checkpoint_model_state(path, load_checkpoint(path))
    initial = _built(AuxHead).state_dict()  # (the trainer seeds 0 before the factory)
    assert torch.equal(state["aux.weight"], initial["aux.weight"])
    assert not torch.equal(state["body.a.weight"], initial["body.a.weight"])


class TiedLM(nn.Module):
    """A language model whose output head is its token embedding (one tensor, two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)})
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.blocks["down"](torch.relu(self.blocks["up"](h)))
        return self.head(h)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, VOCAB, (ROWS, 6), generator=g)
    return ids[:, :-1], ids[:, 1:]


TIED_STRATEGIES = {
    "single": {},
    "ddp": {},
    "torch-ddp": {},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "pipeline": {"split": ["blocks.down"], "microbatches": 2},
    "tensor": {"plan": PLAN},
    "hybrid": {"dp": 2, "microbatches": 2},
    "zero3 cpu": {"offload": OffloadPolicy(device="cpu")},  # (AdamW: offload steps Adam(W) only)
}


def _tied_cases(folder: str) -> None:
    from safetensors.torch import load_file

    ctx = tessera.init()

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.5)

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=DECAY)

    for strategy, options in TIED_STRATEGIES.items():
        # single: every rank trains alone on the whole batch (rank 0 writes, as for the others)
        world = 1 if strategy == "single" else ctx.world_size
        rank = 0 if strategy == "single" else ctx.rank
        where = Path(folder) / strategy
        name, factory = strategy.split()[0], adamw if "offload" in options else sgd
        oracle, exact = _built(TiedLM), _built(TiedLM).double()
        for model in (oracle, exact):
            _lm_loss(model(_lm_batch(0)[0]), _lm_batch(0)[1]).backward()
            factory(model.parameters()).step()
        engine = tessera.setup(_built(TiedLM), factory, strategy=name, loss_fn=_lm_loss, **options)
        engine.train_step(_shard(_lm_batch(0), rank, world))
        engine.step()
        state = engine.full_state_dict()
        assert list(state) == list(oracle.state_dict()), strategy
        check_close(state, oracle.state_dict(), exact.state_dict(), what=f"tied {strategy}")
        engine.save(where / "checkpoint")
        engine.export(where / "model.safetensors")
        plain = TiedLM()
        plain.load_state_dict(load_file(where / "model.safetensors"), strict=False)
        assert all(torch.equal(v, state[k]) for k, v in plain.state_dict().items()), strategy
        assert plain.head.weight is plain.emb.weight  # still tied
        again = tessera.setup(_built(TiedLM), factory, strategy=name, loss_fn=_lm_loss, **options)
        again.load(where / "checkpoint")
        for each in (engine, again):
            each.train_step(_shard(_lm_batch(1), rank, world))
            each.step()
        got, want = again.full_state_dict(), engine.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), f"{strategy}: resumed step"


def test_a_tied_model_trains_saves_loads_and_exports_under_every_strategy(run_ranks):
    with tempfile.TemporaryDirectory() as folder:
        run_ranks(_tied_cases, 2, folder)
