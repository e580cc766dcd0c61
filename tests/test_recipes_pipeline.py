"""A traced pipeline (`strategy="pipeline", split=[...]`) on real recipes, against plain PyTorch.

Issue 29's pipeline items, through `tessera.setup` on two stages, with models tessera never built:
- a CNN with BatchNorm and dropout: `eval_step` equals the plain model in `eval()` (dropout off,
  the running statistics read, not written), before any training step and after one, on a batch
  of another row count too; it changes nothing (the state bit for bit); training updates the
  running statistics as the plain model's forward of the same micro-batches does; the state
  gathers whole (`full_state_dict`);
- a model calling one submodule twice (its two calls on two stages: the gradients summed as for
  a tied weight) and holding one it never calls, trained one SGD and three AdamW steps;
- a model that fixes the rows in its forward: another row count is refused in one message on
  every stage (nothing hangs);
- a Hugging Face T5 built from a config with its defaults (`use_cache` on, tied embeddings), cut
  at its decoder: one step equals the plain loop; save, load (the next step bit for bit) and a
  safetensors export a plain T5 loads all work.
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

ROWS = 8


class NormCNN(nn.Module):
    """Conv, BatchNorm, dropout, a flatten by the batch's own size, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.norm(self.conv(x))))
        return self.head(h.view(h.shape[0], -1))


class Twice(nn.Module):
    """`blocks.shared` is called at the start and at the end (two stages, one weight);
    `blocks.aux`, never called, is in no stage's graph (its state must not be lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(
            {"shared": nn.Linear(6, 6), "mid": nn.Linear(6, 6), "aux": nn.Linear(6, 2)}
        )
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks["shared"](x))
        h = torch.tanh(self.blocks["mid"](h))
        return self.head(torch.tanh(self.blocks["shared"](h)))


class FixedRows(nn.Module):
    """A forward that hard-codes the micro-batch's two rows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).reshape(2, 6))


def _built(factory: Any) -> nn.Module:
    torch.manual_seed(0)  # every rank and the oracle: the same initial weights
    return factory()


def _shard(batch: Any, rank: int, world: int) -> Any:
    rows = len(next(iter(batch.values())) if isinstance(batch, dict) else batch[0]) // world
    if isinstance(batch, dict):
        return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
    return tuple(t[rank * rows : (rank + 1) * rows] for t in batch)


def _images(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20 + step)
    return torch.randn(rows, 3, 4, 4, generator=g), torch.randn(rows, 3, generator=g)


def _vectors(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30 + step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def _plain_eval(state: dict[str, torch.Tensor], batch: Any) -> list[float]:
    """The plain model in eval mode on `state`: the loss in float32 and in float64."""
    losses = []
    for dtype in (torch.float32, torch.float64):
        model = NormCNN().to(dtype)
        model.load_state_dict(state)
        model.eval()
        x, y = (t.to(dtype) for t in batch)
        losses.append(F.mse_loss(model(x), y).item())
    return losses


def _check_eval(engine: Any, ctx: Any, batch: Any, what: str) -> None:
    """eval_step equals the plain model in eval mode and leaves the state as it was."""
    before = engine.full_state_dict()
    loss = engine.eval_step(_shard(batch, ctx.rank, ctx.world_size))
    oracle, exact = _plain_eval(before, batch)
    check_close([loss], [oracle], [exact], what=what)
    after = engine.full_state_dict()
    assert list(after) == list(NormCNN().state_dict())
    assert all(torch.equal(after[k], before[k]) for k in before), f"{what} changed the state"


def _norm_cnn(ctx: Any) -> None:
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    engine = tessera.setup(
        _built(NormCNN), sgd, strategy="pipeline", split=["head"], microbatches=2,
        loss_fn=F.mse_loss,
    )  # fmt: skip
    _check_eval(engine, ctx, _images(0), "eval before training")  # (traced by eval_step)
    x, _ = _images(1)
    engine.train_step(_shard(_images(1), ctx.rank, ctx.world_size))
    engine.step()
    plain, exact = _built(NormCNN), _built(NormCNN).double()
    for model in (plain, exact):  # the pipeline's two micro-batches, through plain forwards
        model(x[:4].to(model.head.weight.dtype))
        model(x[4:].to(model.head.weight.dtype))
    state = engine.full_state_dict()
    keys = ["norm.running_mean", "norm.running_var"]
    check_close(
        {k: state[k] for k in keys},
        {k: plain.state_dict()[k] for k in keys},
        {k: exact.state_dict()[k] for k in keys},
        what="running statistics after a training step",
    )
    assert state["norm.num_batches_tracked"] == 2
    _check_eval(engine, ctx, _images(2), "eval after training")
    _check_eval(engine, ctx, _images(3, rows=6), "eval of 6 rows (4 traced)")
    engine.close()


def _twice(ctx: Any) -> None:
    for make, steps in ((lambda ps: torch.optim.SGD(ps, lr=0.5), 1), (torch.optim.AdamW, 3)):
        engine = tessera.setup(
            _built(Twice), make, strategy="pipeline", split=["blocks.mid"], microbatches=2,
            loss_fn=F.mse_loss,
        )  # fmt: skip
        models = [_built(Twice), _built(Twice).double()]
        optimizers = [make(m.parameters()) for m in models]
        for step in range(steps):
            engine.train_step(_shard(_vectors(step), ctx.rank, ctx.world_size))
            engine.step()
            for model, optimizer in zip(models, optimizers):
                x, y = (t.to(model.head.weight.dtype) for t in _vectors(step))
                F.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        state = engine.full_state_dict()
        assert list(state) == list(models[0].state_dict())
        check_close(state, *[m.state_dict() for m in models], what=f"twice, {steps} steps")
        engine.close()


def _fixed_rows(ctx: Any) -> None:
    engine = tessera.setup(
        _built(FixedRows), torch.optim.SGD, strategy="pipeline", split=["b"], microbatches=2,
        loss_fn=F.mse_loss,
    )  # fmt: skip
    engine.train_step(_shard(_vectors(0, rows=4), ctx.rank, ctx.world_size))
    with pytest.raises(ValueError, match="fixes the rows of a micro-batch to 2"):
        engine.eval_step(_shard(_vectors(1, rows=6), ctx.rank, ctx.world_size))
    assert engine.eval_step(_shard(_vectors(1, rows=4), ctx.rank, ctx.world_size)) > 0
    engine.close()


def t5() -> nn.Module:
    """A tiny T5 from a config (nothing downloaded): tied embeddings, `use_cache` on."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def _t5_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)  # (no padding: each micro-batch has 2 x 4 labels)
    return {
        "input_ids": torch.randint(1, 16, (ROWS, 5), generator=g),
        "labels": torch.randint(1, 16, (ROWS, 4), generator=g),
    }


def _t5(ctx: Any, folder: Path) -> None:
    from safetensors.torch import load_file

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.5)

    model = _built(t5)
    assert model.config.use_cache and model.shared.weight is model.lm_head.weight
    options = {"strategy": "pipeline", "split": ["decoder"], "microbatches": 2}
    engine = tessera.setup(model, sgd, **options)
    engine.train_step(_shard(_t5_batch(0), ctx.rank, ctx.world_size))
    engine.step()
    oracle, exact = _built(t5), _built(t5).double()
    for plain in (oracle, exact):
        plain(**_t5_batch(0)).loss.backward()
        sgd(plain.parameters()).step()
    state = engine.full_state_dict()
    assert list(state) == list(oracle.state_dict())
    check_close(state, oracle.state_dict(), exact.state_dict(), what="t5 one step")
    engine.save(folder / "checkpoint")
    engine.export(folder / "t5.safetensors")
    plain = t5()
    plain.load_state_dict(load_file(folder / "t5.safetensors"), strict=False)
    assert all(torch.equal(v, state[k]) for k, v in plain.state_dict().items())
    assert plain.shared.weight is plain.lm_head.weight
    again = tessera.setup(_built(t5), sgd, **options)
    again.load(folder / "checkpoint")
    for each in (engine, again):
        each.train_step(_shard(_t5_batch(1), ctx.rank, ctx.world_size))
        each.step()
    got, want = again.full_state_dict(), engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), "resumed step differs"
    assert model.config.use_cache, "the user's config is left as it was"


def _cases(folder: str) -> None:
    ctx = tessera.init()
    _norm_cnn(ctx)
    _twice(ctx)
    _fixed_rows(ctx)
    _t5(ctx, Path(folder))


def test_traced_pipeline_on_batch_norm_dropout_reuse_fixed_rows_and_tied_t5(run_ranks):
    with tempfile.TemporaryDirectory() as folder:
        run_ranks(_cases, 2, folder)
