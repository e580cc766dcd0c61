"""`tessera train --compile`: torch.compile of the model trains as the eager model does.

The suite compiles with the `aot_eager` backend (`TESSERA_COMPILE_BACKEND`): Dynamo captures the
same graphs and AOTAutograd splits them into forward and backward as inductor would get them, but
no kernels are generated (a minute of C++ compilation on 2 cores otherwise). The runs use SGD:
Adam divides by a gradient's RMS and turns rounding noise into full-size updates (DESIGN.md).

The bound: each logged loss is the mean of batch_size * block_size token losses; compiled and
eager may add them (and every reduction before them) in another order, which changes a float32
sum of n terms by at most n * eps relative (the recursive summation bound). Three SGD steps at a
small learning rate carry a gradient's rounding difference into the loss scaled by lr, far below
that. So |compiled - eager| <= n * eps * |eager| for n = 4 * 16 = 64.
"""

from __future__ import annotations

import json

import pytest
import torch

from tessera.errors import ConfigError
from tessera.train import ModelSettings, TrainConfig, run_training
from tessera.train.engine_setup import COMPILE_BACKEND_ENV

BATCH, BLOCK = 4, 16
EPS32 = torch.finfo(torch.float32).eps


def _losses(tmp_path, strategy: str, nproc: int, compile: bool) -> list[float]:
    out = tmp_path / f"{strategy}-{compile}"
    config = TrainConfig(
        strategy=strategy, nproc=nproc, steps=3, batch_size=BATCH, optimizer="sgd", lr=0.05,
        warmup_steps=1, compile=compile, out=str(out), progress=False, sample_tokens=0,
        checkpoint_every=0, corpus_bytes=20_000,
        model=ModelSettings(n_layer=1, n_head=2, n_embd=16, block_size=BLOCK),
    )  # fmt: skip
    run_training(config)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if "loss" in line]


def _check_equal(compiled: list[float], eager: list[float]) -> None:
    assert len(compiled) == len(eager) == 3
    for mine, theirs in zip(compiled, eager):
        assert abs(mine - theirs) <= BATCH * BLOCK * EPS32 * abs(theirs), (compiled, eager)
    assert eager[-1] < eager[0]  # it trains


def test_compile_trains_like_eager_on_one_process(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    eager = _losses(tmp_path, "single", 1, compile=False)
    graphs = counters["stats"]["unique_graphs"]
    compiled = _losses(tmp_path, "single", 1, compile=True)
    assert counters["stats"]["unique_graphs"] > graphs  # the model was compiled, not run eagerly
    _check_equal(compiled, eager)


@pytest.mark.slow
def test_compile_trains_like_eager_under_ddp(tmp_path, monkeypatch):
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    _check_equal(_losses(tmp_path, "ddp", 2, True), _losses(tmp_path, "ddp", 2, False))


@pytest.mark.parametrize(
    ("strategy", "why"),
    [
        ("zero3", "gather and free each parameter"),
        ("pipeline", "cuts the model into stages"),
        ("tensor", "collectives inside forward"),
    ],
)
def test_compile_is_refused_where_the_strategy_cannot_take_it(strategy, why):
    refused = f"--compile is not supported by --strategy {strategy}: .*{why}"
    with pytest.raises(ConfigError, match=refused):
        TrainConfig(strategy=strategy, compile=True)
