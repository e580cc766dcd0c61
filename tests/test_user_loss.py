"""A user's `loss_fn` wins over the model's own `.loss`, under every strategy and in the trainer.

A Hugging Face model fed `labels` returns its own loss; a user who passes `loss_fn(output, batch)`
(label smoothing, a weighting, an auxiliary term) must get that loss trained, returned and
evaluated, never the model's. The oracle is the same model trained here by plain PyTorch on the
user's loss: the loss `train_step` and `eval_step` return, the gradients, and the parameters after
one SGD step (float64 yardstick, `_tolerance.check_close`) for every strategy on 2 ranks; the
trainer's `--loss` against its own run without it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import user_workloads
from _tolerance import check_close, to_float64
from torch import nn

import tessera
from tessera.cli import main
from tessera.train.metrics import read_metrics

ROWS, LR = 8, 0.5


def _smoothed(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The user's loss: label-smoothed cross-entropy, weighted, plus a penalty on the logits (the
    model's own is plain cross-entropy), so its value and its gradient both differ."""
    logits = output["logits"]
    smoothed = nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=0.3)
    return 3 * smoothed + logits.square().mean()


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=5, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def _bert_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "input_ids": torch.randint(0, 11, (ROWS, 5), generator=g),
        "labels": torch.randint(0, 3, (ROWS,), generator=g),
    }


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_hugging_face_models_own_loss_loses_to_the_users(grad_accum):
    """`tessera.setup(bert, ..., loss_fn=user)`: train_step returns the user's loss, the
    gradients are the user's loss's, eval_step returns it too; the model's own differs."""
    model, oracle = _bert(), _bert()
    batch = _bert_batch()
    engine = tessera.setup(
        model, lambda p: torch.optim.SGD(p, lr=LR), strategy="single", loss_fn=_smoothed,
        grad_accum=grad_accum,
    )  # fmt: skip
    out = oracle(**batch)
    want = _smoothed(out, batch)
    assert abs(out.loss.item() - want.item()) > 1  # the premise: the two losses differ
    want.backward()
    got = engine.train_step(batch)
    few = 8 * torch.finfo(torch.float32).eps  # the same float32 loss (in halves: another order)
    assert got == pytest.approx(want.item(), rel=few)
    for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert engine.eval_step(batch) == pytest.approx(want.item(), rel=few)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"features": torch.randn(ROWS, 6, generator=g), "labels": torch.randint(0, 3, (ROWS,))}


STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "torch-ddp": {},
    "local-sgd": {"average_every": 1},
    "zero2": {},
    "zero3": {},
    "tensor": {"plan": {"body.0": "column", "body.2": "row"}},
    "pipeline": {"split": ["body.2"], "microbatches": 2},
    "hybrid": {"dp": 2, "microbatches": 2},
}


def _every_strategy() -> None:
    ctx = tessera.init()
    batch = _batch()
    mine = {k: v[ctx.rank * ROWS // 2 : (ctx.rank + 1) * ROWS // 2] for k, v in batch.items()}
    torch.manual_seed(0)
    initial = user_workloads.Classifier().state_dict()
    oracle, exact = user_workloads.Classifier(), user_workloads.Classifier().double()
    oracle.load_state_dict(initial)
    exact.load_state_dict(to_float64(initial))
    for model, b in ((oracle, batch), (exact, to_float64(batch))):
        out = model(**b)
        assert abs(out["loss"].item() - _smoothed(out, b).item()) > 1  # the premise
        _smoothed(out, b).backward()
        torch.optim.SGD(model.parameters(), lr=LR).step()
    for strategy, options in STRATEGIES.items():
        model = user_workloads.Classifier()
        model.load_state_dict(initial)
        engine = tessera.setup(
            model, lambda p: torch.optim.SGD(p, lr=LR), strategy=strategy, loss_fn=_smoothed,
            ctx=ctx, **options,
        )  # fmt: skip
        engine.train_step(mine)
        engine.step()
        check_close(
            engine.full_state_dict(), oracle.state_dict(), exact.state_dict(),
            what=f"{strategy}: one SGD step on the user's loss",
        )  # fmt: skip
        engine.close()


def test_every_strategy_trains_the_users_loss_not_the_models(run_ranks):
    run_ranks(_every_strategy, 2)


def test_the_trainers_loss_flag_wins_over_the_models_own(tmp_path):
    """`tessera train --loss` with a model that returns its own loss: the logged loss of the
    first step (same seed, same batch, weights not yet stepped) is the user's, twice the
    model's cross-entropy, not the model's."""
    args = ["train", "--strategy", "single", "--nproc", "1", "--steps", "1", "--batch-size", "8",
            "--no-progress", "--model", "user_workloads:classifier",
            "--data", "user_workloads:dicts"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "own")]) == 0
    assert main([*args, "--loss", "user_workloads:doubled_loss", "--out", str(tmp_path / "u")]) == 0
    own = read_metrics(tmp_path / "own/metrics.jsonl")[0]["loss"]
    users = read_metrics(tmp_path / "u/metrics.jsonl")[0]["loss"]
    # the user's loss is twice the model's cross-entropy, computed apart: a few float32 roundings
    assert users == pytest.approx(2 * own, rel=8 * torch.finfo(torch.float32).eps)
