"""The trainer's defaults for a model it never saw: the schedule spans the run, and the weight
decay spares biases and norm weights.

Through `tessera train` with `user_recipes:probe`, whose `gain` (1-D, a norm's weight) and
`mixer` (2-D) get exactly zero gradients: under AdamW a zero gradient moves nothing, so the
weight decay alone changes them, by the factor `1 - lr_t * weight_decay` per step. The expected
learning rates are the documented schedule computed here: linear warmup, then a cosine to lr/10
over `--steps - --warmup-steps` steps (the old default decayed over 450 steps whatever --steps);
a `--resume` to more steps stretches what is left of it.
"""

from __future__ import annotations

import math

import pytest
import torch

from tessera.cli import main
from tessera.train import latest_checkpoint, load_checkpoint
from tessera.train.export import checkpoint_model_state
from tessera.train.metrics import read_metrics

LR, WD, WARMUP, STEPS = 0.01, 0.5, 2, 6


def _lr(step: int, decay: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / decay)
    return LR * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def test_decay_spans_steps_and_spares_vectors_then_resume_stretches_it(tmp_path):
    run = tmp_path / "run"
    args = [
        "train", "--model", "user_recipes:probe", "--data", "user_workloads:pairs",
        "--loss", "user_workloads:mse", "--strategy", "single", "--nproc", "1",
        "--batch-size", "8", "--lr", str(LR), "--weight-decay", str(WD), "--grad-clip", "0",
        "--warmup-steps", str(WARMUP), "--no-progress", "--out", str(run),
    ]  # fmt: skip
    assert main([*args, "--steps", str(STEPS)]) == 0
    lrs = [record["lr"] for record in read_metrics(run / "metrics.jsonl")]
    expected = [_lr(step, STEPS - WARMUP) for step in range(STEPS)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=0)
    path = latest_checkpoint(run)
    state = checkpoint_model_state(path, load_checkpoint(path))
    assert torch.equal(state["gain"], torch.ones(4))  # 1-D: not decayed
    shrink = math.prod(1 - lr * WD for lr in expected)  # 2-D: decayed every step
    torch.testing.assert_close(state["mixer"], torch.full((3, 3), shrink), rtol=1e-6, atol=0)
    # extending the run stretches the rest of its decay over the new --steps
    assert main([*args, "--steps", str(STEPS + 2), "--resume", str(run)]) == 0
    lrs = [record["lr"] for record in read_metrics(run / "metrics.jsonl")]
    stretched = [_lr(step, STEPS + 2 - WARMUP) for step in (STEPS, STEPS + 1)]
    assert lrs[STEPS:] == pytest.approx(stretched, rel=1e-12, abs=0)
