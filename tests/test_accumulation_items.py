"""Accumulation and data parallelism weight a token-averaged loss by its tokens, not its rows.

A causal LM's loss is the mean over the label tokens that are not -100 (padding, prompts). Cut
into micro-batches (`grad_accum`) or over ranks, a micro-batch of few tokens must weigh less
than one of many: weighting the micro-batches' mean losses by their rows gives another loss and
another gradient than the whole batch's. Here the rows hold 1 to 6 counted tokens, so rows and
tokens give clearly different weights; every run is compared with a plain PyTorch loop written
below over the whole global batch (float32, and float64 as the reference: `_tolerance.py`):

* the model's own loss of a dict batch (a Hugging-Face-style `*ForCausalLM` that shifts its
  labels by one), under single (grad_accum 4), ddp and zero2 (2 ranks, grad_accum 2, the ranks'
  halves holding 7 and 21 tokens); the dict also holds a 0-dim tensor, which accumulation must
  pass whole to every micro-batch (it crashed in slicing);
* a loss that declares what it averages over (`loss_fn.count_items`), single;
* the same under torch-ddp, zero1 and zero3 (the SGD step), and zero2 with `offload="cpu"` (an
  AdamW step: offload steps Adam(W) only);
* `nn.CrossEntropyLoss(ignore_index=-100)` on `(inputs, targets)` pairs, pipeline (2 stages,
  2 micro-batches x grad_accum 2), tensor (grad_accum 2) and hybrid dp=2 (grad_accum 2).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _tolerance import check_close
from test_setup import _full_grads
from torch import nn

import tessera
from tessera.zero import OffloadPolicy

VOCAB, WIDTH, T, ROWS = 13, 8, 7, 8
VALID = [1, 2, 1, 3, 6, 5, 6, 4]  # counted tokens per row (after the shift): rank 0 7, rank 1 21


class TinyForCausalLM(nn.Module):
    """Dict batch in, `{"loss", "logits"}` out, labels shifted by one as Hugging Face does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.mix(self.embed(input_ids))).cumsum(1)  # each position sees the past
        logits = self.head(h) / temperature
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        return {"loss": loss, "logits": logits}


class ToClasses(nn.Module):
    """(rows, T, classes) -> (rows, classes, T): the layout `nn.CrossEntropyLoss` takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


def _sequential() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, VOCAB), ToClasses(),
    )  # fmt: skip


def _fresh(kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(3)
    return (TinyForCausalLM() if kind == "lm" else _sequential()).to(dtype)


def _batch(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Rows of T tokens; labels -100 but for VALID[r] positions after the first."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (ROWS, T), generator=g)
    labels = torch.full((ROWS, T), -100)
    for row, n in enumerate(VALID):
        labels[row, 1 : 1 + n] = ids[row, 1 : 1 + n]
    labels[:, 0] = ids[:, 0]  # counted by nothing: the causal shift drops it
    return {"input_ids": ids, "labels": labels, "temperature": torch.tensor(1.5, dtype=dtype)}


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A user's token loss (no shift) declaring its count: the labels not ignored."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


token_loss.count_items = lambda labels: (labels != -100).sum()


def _pairs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["input_ids"], batch["labels"]


def _oracle(kind: str, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """The plain loop: one forward of the whole batch, one SGD step."""
    model, batch = _fresh(kind, dtype), _batch(dtype)
    if kind == "lm":
        loss = model(**batch)["loss"]
    elif kind == "pairs":
        loss = token_loss(model[:-1](batch["input_ids"]), batch["labels"])
    else:
        loss = nn.CrossEntropyLoss(ignore_index=-100)(model(batch["input_ids"]), batch["labels"])
    loss.backward()
    grads = {n: p.grad.detach().flatten().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _check(engine: Any, kind: str, what: str, grads: dict | None = None) -> None:
    oracle, exact = _oracle(kind, torch.float32), _oracle(kind, torch.float64)
    if grads is not None:
        check_close(grads, oracle["grads"], exact["grads"], what=f"{what} gradients")
    engine.step()
    full = engine.full_state_dict()
    params = {name: full[name] for name in exact["params"]}
    check_close(params, oracle["params"], exact["params"], what=f"{what} SGD step")


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def test_single_accumulates_by_tokens_model_loss_and_declared_count():
    for kind, loss_fn, batch in (
        ("lm", None, _batch()),
        ("pairs", token_loss, _pairs(_batch())),
    ):
        model = _fresh(kind)
        if kind == "pairs":
            model = model[:-1]  # (rows, T, vocab) logits for token_loss
        engine = tessera.setup(model, _sgd, strategy="single", loss_fn=loss_fn, grad_accum=4)
        engine.train_step(batch)
        grads = {n: p.grad.flatten().clone() for n, p in engine.module.named_parameters()}
        _check(engine, kind, f"single {kind}", grads)


def _half(ctx: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rows = ROWS // ctx.world_size
    a, b = ctx.rank * rows, (ctx.rank + 1) * rows
    return {key: value[a:b] if value.dim() else value for key, value in batch.items()}


def _adamw(params: Any) -> torch.optim.Optimizer:
    """eps 1: the first step is lr * g / (|g| + 1), not Adam's usual lr * sign(g), which would
    hide how the micro-batches and ranks are weighted."""
    return torch.optim.AdamW(params, lr=0.5, eps=1.0, weight_decay=0.0)


def _offload_case(ctx: Any) -> None:
    """zero2 with `offload="cpu"` (which steps Adam(W) only): one AdamW step of the model's own
    token loss, grad_accum 2, against the plain loop's AdamW step on the whole batch."""
    engine = tessera.setup(
        _fresh("lm"), _adamw, strategy="zero2", grad_accum=2, offload=OffloadPolicy(device="cpu")
    )
    engine.train_step(_half(ctx, _batch()))
    engine.step()
    full = engine.full_state_dict()
    want = []
    for dtype in (torch.float32, torch.float64):
        model = _fresh("lm", dtype)
        model(**_batch(dtype))["loss"].backward()
        _adamw(model.parameters()).step()
        want.append({n: p.detach() for n, p in model.named_parameters()})
    got = {name: full[name] for name in want[1]}
    check_close(got, want[0], want[1], what="zero2 offload AdamW step")
    engine.close()


def items_worker() -> bool:
    ctx = tessera.init()
    for strategy in ("ddp", "zero2"):
        engine = tessera.setup(_fresh("lm"), _sgd, strategy=strategy, grad_accum=2, ctx=ctx)
        engine.train_step(_half(ctx, _batch()))
        grads = _full_grads(engine)
        _check(engine, "lm", strategy, {n: grads[n] for n, _ in engine.module.named_parameters()})
        engine.close()
    for strategy in ("torch-ddp", "zero1", "zero3"):  # (the SGD step: no gradients gathered)
        engine = tessera.setup(_fresh("lm"), _sgd, strategy=strategy, grad_accum=2)
        engine.train_step(_half(ctx, _batch()))
        _check(engine, "lm", strategy)
        engine.close()
    _offload_case(ctx)
    for strategy, options in (
        ("pipeline", {"microbatches": 2}),
        ("tensor", {"plan": {"1": "column", "3": "row"}}),
        ("hybrid", {"dp": 2, "microbatches": 2}),
    ):
        engine = tessera.setup(
            _fresh("seq"), _sgd, strategy=strategy, loss_fn=nn.CrossEntropyLoss(ignore_index=-100),
            grad_accum=2, ctx=ctx, **options,
        )  # fmt: skip
        engine.train_step(_pairs(_half(ctx, _batch())))
        _check(engine, "seq", strategy)
        engine.close()
    return True


def test_ranks_and_micro_batches_weigh_by_tokens(run_ranks):
    assert run_ranks(items_worker, 2) == [True, True]
