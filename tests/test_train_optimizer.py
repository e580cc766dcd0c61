"""The trainer's `--optimizer`, `--optimizer-args`, `--lr-schedule` and `--grad-accum`.

* A user's optimizer class (`torch.optim:RMSprop` with `--optimizer-args`, and a class defined
  here that takes no weight_decay) and a user's schedule function give exactly (`torch.equal`)
  the parameters of a plain PyTorch loop written here, under `single` and through ZeRO-2's
  generic path (one rank, in-process).
* `--batch-size 4 --grad-accum 2` draws the very batch of `--batch-size 8` (one batch per
  optimizer step), and tokens/s counts every micro-step's tokens.
* A run with accumulation and AdamW resumes bit for bit (dropout on: every micro-batch draws).
* Each bad flag costs one clear ConfigError naming it, before any rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_resume import TINY, _final_state, _losses, _resume, assert_same
from torch import nn

import tessera
from tessera.errors import ConfigError
from tessera.train import build_config, run_training
from tessera.train.engine_setup import build_engine, lr_scheduler
from tessera.train.optimizers import check_optimizer_and_schedule
from tessera.train.resume import config_layers_for_resume
from tessera.train.resume_rules import check_resume_config
from tessera.train.workload import build_workload

ARGS = '{"alpha": 0.9, "momentum": 0.5, "centered": true}'


def halving(step: int) -> float:
    """A user schedule: the multiplier of --lr halves every step."""
    return 0.5**step


class SignDescent(torch.optim.Optimizer):
    """A user optimizer without weight decay: p -= lr * sign(grad)."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _plain(optimizer: str) -> dict[str, torch.Tensor]:
    model = _model()
    if optimizer == "rmsprop":
        weights = [p for p in model.parameters() if p.dim() > 1]  # biases are not decayed
        biases = [p for p in model.parameters() if p.dim() == 1]
        groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
        opt = torch.optim.RMSprop(
            groups, lr=0.01, weight_decay=0.1, alpha=0.9, momentum=0.5, centered=True
        )
    else:
        opt = SignDescent(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, halving)
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_user_optimizer_and_schedule_give_the_plain_loop_exactly():
    ctx = tessera.init()
    flags = {
        "rmsprop": {"optimizer": "torch.optim:RMSprop", "optimizer_args": ARGS},
        "sign": {"optimizer": "test_train_optimizer:SignDescent"},
    }
    for name, options in flags.items():
        for strategy in ("single", "zero2"):
            config = build_config(
                {"strategy": strategy, "nproc": 1, "lr": 0.01, "weight_decay": 0.1},
                {"lr_schedule": "test_train_optimizer:halving", "grad_clip": 0.0, **options},
            )
            check_optimizer_and_schedule(config)
            engine = build_engine(config, _model(), F.mse_loss, ctx)
            scheduler = lr_scheduler(engine, config)
            for step in range(3):
                engine.train_step(_batch(step))
                engine.step()
                scheduler.step()
            ours = engine.full_state_dict()
            for key, value in _plain(name).items():
                assert torch.equal(ours[key], value), (name, strategy, key)
            engine.close()


def test_accumulation_draws_the_big_batch_and_counts_every_token():
    small = build_config({"batch_size": 4, "grad_accum": 2, "nproc": 2, "corpus_bytes": 20_000})
    big = build_config({"batch_size": 8, "nproc": 2, "corpus_bytes": 20_000})
    a, b = build_workload(small), build_workload(big)
    assert a.tokens_per_step == b.tokens_per_step == 8 * small.model.block_size
    for step in (0, 5):
        for rank in (0, 1):
            assert_same(a.batches(step, rank, 2), b.batches(step, rank, 2), f"{step}/{rank}")


def test_resume_with_accumulation_is_exact(tmp_path: Path):
    layers = {**TINY, "strategy": "single", "nproc": 1, "grad_accum": 2, "out": None}
    for name, steps in (("straight", 4), ("split", 2)):
        run_training(build_config(layers, {"steps": steps, "out": str(tmp_path / name)}))
    _resume(tmp_path / "split", 4)
    assert _losses(tmp_path / "split") == _losses(tmp_path / "straight")
    assert_same(_final_state(tmp_path / "split"), _final_state(tmp_path / "straight"))
    # another grad_accum changes every step: not a key a resume may change
    saved = config_layers_for_resume(tmp_path / "split")
    with pytest.raises(ConfigError, match=r"grad_accum \(2 -> 4\)"):
        check_resume_config(saved, build_config(saved, {"grad_accum": 4}), "split")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer": "adam"}, "unknown optimizer 'adam'"),
        ({"optimizer_args": "{betas: 1}"}, "--optimizer-args .* is not valid JSON"),
        ({"optimizer_args": "[0.9]"}, "--optimizer-args must be a JSON object"),
        (
            {"optimizer_args": '{"betaz": [0.9, 0.99]}'},
            "--optimizer adamw with .*betaz.*AdamW takes lr, betas",
        ),
        ({"optimizer_args": '{"betas": [1.5, 0.9]}'}, "--optimizer adamw with .*beta"),
        ({"optimizer": "torch.optim:Nope"}, "--optimizer 'torch.optim:Nope': torch.optim has no"),
        ({"optimizer": "torch.nn:Linear"}, "is not a torch.optim.Optimizer subclass"),
        ({"lr_schedule": "cosinus"}, "unknown lr_schedule 'cosinus'"),
        ({"lr_schedule": "math:sqrt"}, ""),  # sqrt(0) = 0.0 is a number: accepted
        ({"lr_schedule": "builtins:str"}, "FN\\(step\\) must return a finite number"),
        ({"lr_schedule": "math:log"}, "FN\\(0\\) raised ValueError"),
        ({"grad_accum": 0}, "grad_accum must be at least 1"),
        ({"strategy": "ps", "grad_accum": 2}, "ps workers push every gradient"),
    ],
)
def test_bad_optimizer_flags_one_clear_error(options: dict[str, Any], message: str):
    if not message:
        check_optimizer_and_schedule(build_config(options))
        return
    with pytest.raises(ConfigError, match=message):
        check_optimizer_and_schedule(build_config(options))
