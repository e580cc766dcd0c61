"""The training job end to end: equivalence with one process, exact resume, files, two nodes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _tolerance import check_close
from test_trainer_oracle import oracle_run  # tests/ is on sys.path under pytest

from tessera.train import (
    build_config,
    latest_checkpoint,
    load_checkpoint,
    run_training,
)
from tessera.train.metrics import read_metrics

TINY = [
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--corpus-bytes",
    "50000",
    "--sample-tokens",
    "20",
    "--no-progress",
]
TINY_CONFIG = {
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
    "batch_size": 8,
    "corpus_bytes": 50_000,
    "sample_tokens": 0,
    "progress": False,
}


def _params(run_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(run_dir))["engine"]["model"]


def _tessera(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tessera", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [
        ("torch-ddp", {}),
        ("ddp", {"bucket_cap_mb": 0.01}),
        # Local SGD averaging every step with SGD-momentum is linear in the gradients, so it
        # equals one process too (without clipping, which acts on each rank's own gradient).
        ("local-sgd", {"average_every": 1, "grad_clip": 0.0}),
    ],
)
def test_data_parallel_strategies_equal_one_process_on_the_global_batch(tmp_path, strategy, extra):
    # SGD with momentum, not Adam: Adam turns reduction-order noise in a gradient that should be
    # zero (attention key biases) into full-size updates (see DESIGN.md, Testing).
    common = {**TINY_CONFIG, "steps": 6, "optimizer": "sgd", "lr": 0.05, "warmup_steps": 0}
    parallel = {"strategy": strategy, "nproc": 2, "out": str(tmp_path / "b"), **extra}
    config = build_config(common, parallel)
    run_training(config)
    # The oracle: the plain PyTorch loop of test_trainer_oracle.py, in float32 and float64.
    oracle, exact = oracle_run(config, "fp32"), oracle_run(config, "fp64")
    two = _params(tmp_path / "b")
    assert two.keys() == exact["state"].keys()
    check_close(two, oracle["state"], exact["state"], what=strategy)
    losses = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")]
    check_close(losses, oracle["losses"], exact["losses"], what=f"{strategy} losses")
    assert losses[-1] < losses[0]


# Resume, bit for bit with AdamW for every strategy: tests/test_resume.py; the README's resume
# command and the run folder's files: tests/test_readme_commands.py.


def test_corrupt_checkpoint_is_refused_on_resume(tmp_path):
    run = _tessera(
        "train",
        *TINY,
        "--strategy",
        "single",
        "--nproc",
        "1",
        "--steps",
        "2",
        "--out",
        "r",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    checkpoint = tmp_path / "r/checkpoints/step-00000002/state.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:-100])
    resumed = _tessera("train", "--resume", "r", "--steps", "4", cwd=tmp_path)
    assert resumed.returncode == 2
    assert "state.pt is truncated" in resumed.stderr  # the warning names the file
    error = resumed.stderr.strip().splitlines()[-1]
    assert error.startswith("tessera: error: cannot resume r: it holds no complete checkpoint")
    assert len(read_metrics(tmp_path / "r/metrics.jsonl")) == 2  # nothing appended


def test_config_errors_are_tessera_errors_and_strategies_register():
    from tessera.errors import CheckpointError, ConfigError, TesseraError
    from tessera.train import STRATEGIES, ModelSettings, TorchDDPEngine, register_strategy

    with pytest.raises(TesseraError, match=r"model.n_embd \(10\) must be divisible"):
        ModelSettings(n_embd=10, n_head=4)
    with pytest.raises(ConfigError, match="model.dropout must be in"):
        build_config({"model": {"dropout": 1.0}})
    assert build_config({"model": {"n_layer": 3}}).model == ModelSettings(n_layer=3)
    assert issubclass(CheckpointError, TesseraError)
    with pytest.raises(TesseraError, match="not a readable checkpoint"):
        load_checkpoint(__file__)
    from tessera.strategies.torch_ddp import build

    assert STRATEGIES["torch-ddp"] is build
    added = register_strategy("test-only")(TorchDDPEngine)
    try:
        assert added is TorchDDPEngine and STRATEGIES["test-only"] is TorchDDPEngine
        with pytest.raises(ValueError, match="'test-only' is registered twice"):
            register_strategy("test-only")(TorchDDPEngine)
    finally:
        from tessera.strategies import registry

        registry._user_strategies.pop("test-only")  # the public table is read-only
