"""On the GPU as on the CPU: every strategy through `tessera train` and `tessera.setup` on CUDA.

`gpu`-marked: skipped without CUDA (conftest), run with NCCL on as many GPUs as the machine has
(one is enough; the model-parallel checks need two). `tests/test_setup.py`'s gpu test compares
the data-parallel strategies with a plain loop through `tessera.setup`; here:

* `tessera train` of the demo GPT under every strategy the GPUs allow, with what users run: the
  default `--grad-clip 1.0`, checkpoints, `--resume`, bf16 and fp16, ZeRO-Offload from GPU
  memory, then `export_run`. The first logged loss is the untrained model's loss on the first
  batch, so it must equal the same run's on the CPU (gloo, `single`): the same model and batch,
  computed on another device. The bound: the loss is a mean over batch * block token losses,
  each from matmuls accumulating n_embd products per layer; another device sums them in
  another order, each sum within (terms) * eps relative: (batch * block + 4 * n_layer *
  n_embd) * eps of the loss (TF32 is off: PyTorch's default for float32 matmuls). bf16/fp16
  runs round the inputs of every matmul to 8/11 bits, relative errors that add up through the
  network: (2 + 4 * n_layer) * eps of that dtype (embeddings, four matmuls a block, the head).
* tensor and pipeline parallelism through `tessera.setup` on two GPUs: the global mean loss and
  one SGD step equal a plain loop on one GPU (`_tolerance.check_close`, float64 reference).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera
from tessera.runtime.devices import BACKEND_ENV
from tessera.train import ModelSettings, TrainConfig, run_training
from tessera.train.export import export_run

pytestmark = pytest.mark.gpu

SHAPE = ModelSettings(n_layer=2, n_head=2, n_embd=32, block_size=32)
BATCH = 8
RUNS: dict[str, dict[str, Any]] = {
    "single": {"strategy": "single"},
    "ddp": {"strategy": "ddp"},
    "torch-ddp": {"strategy": "torch-ddp"},
    "local-sgd": {"strategy": "local-sgd"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "zero2-offload": {"strategy": "zero2", "offload": "cpu"},
    "zero3-offload": {"strategy": "zero3", "offload": "cpu"},
    "ddp-bf16": {"strategy": "ddp", "mixed_precision": "bf16"},
    "ddp-fp16": {"strategy": "ddp", "mixed_precision": "fp16"},
    "zero2-bf16": {"strategy": "zero2", "mixed_precision": "bf16"},
}
RESUMED = {"ddp", "zero2", "zero3", "zero3-offload", "ddp-fp16"}
"""Runs continued by `--resume` (each run costs seconds: the `make gpu-check` budget)."""
MODEL_PARALLEL = {"tensor": {"strategy": "tensor"}, "pipeline": {"strategy": "pipeline"}}
EPS = {None: torch.finfo(torch.float32).eps, "bf16": 2.0**-8, "fp16": 2.0**-11}


def _gpus() -> int:
    """Ranks for the GPU runs: as many GPUs as divide the global batch (1, 2, 4 or 8)."""
    return max(n for n in (1, 2, 4, 8) if n <= torch.cuda.device_count())


def _train(out: Path, nproc: int, steps: int, resume: bool = False, **layers: Any) -> list[dict]:
    config = TrainConfig(
        nproc=nproc, steps=steps, batch_size=BATCH, model=SHAPE, out=str(out), progress=False,
        checkpoint_every=2, sample_tokens=0, corpus_bytes=50_000, **layers,
    )  # fmt: skip
    run_training(config, resume=resume)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def test_tessera_train_runs_every_strategy_on_the_gpus(tmp_path, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setenv(BACKEND_ENV, "gloo")  # the CPU's first loss, the reference
    cpu_first = _losses(_train(tmp_path / "cpu", 1, 1, strategy="single"))[0]
    monkeypatch.delenv(BACKEND_ENV)
    runs = dict(RUNS)
    if _gpus() >= 2:
        runs.update(MODEL_PARALLEL)
    for name, layers in runs.items():
        nproc = 1 if layers["strategy"] == "single" else _gpus()
        out = tmp_path / name
        losses = _losses(_train(out, nproc, 2, **layers))  # a checkpoint at step 2
        if name in RESUMED:
            losses = _losses(_train(out, nproc, 3, resume=True, **layers))  # resumed to step 3
        assert len(losses) == 2 + (name in RESUMED), (name, losses)
        assert all(loss == loss for loss in losses), (name, losses)  # no nan
        precision = layers.get("mixed_precision")
        if precision is None:  # float32: sums in another order
            bound = (BATCH * SHAPE.block_size + 4 * SHAPE.n_layer * SHAPE.n_embd) * EPS[None]
        else:  # a rounding of each matmul's inputs: embeddings, 4 per block, the head
            bound = (2 + 4 * SHAPE.n_layer) * EPS[precision]
        assert abs(losses[0] - cpu_first) <= bound * abs(cpu_first), (name, losses[0], cpu_first)
        exported = export_run(out, tmp_path / f"{name}.safetensors")
        assert exported.stat().st_size > 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


ROWS = 8
OPTIONS = {
    "tensor": {"plan": {"0": "column", "2": "row"}},
    "pipeline": {"split": ["2"], "microbatches": 2},
}


def _model_parallel_worker() -> dict[str, Any]:
    ctx = tessera.init()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, 16), torch.randn(ROWS, 8)
    half = ROWS // ctx.world_size
    mine = slice(ctx.rank * half, (ctx.rank + 1) * half)
    found: dict[str, Any] = {}
    for strategy, options in OPTIONS.items():
        engine = tessera.setup(
            _model().to(ctx.device), lambda p: torch.optim.SGD(p, lr=0.1), strategy=strategy,
            loss_fn=F.mse_loss, ctx=ctx, **options,
        )  # fmt: skip
        loss = engine.train_step((x[mine].to(ctx.device), y[mine].to(ctx.device)))
        engine.step()
        state = {k: v.detach().cpu() for k, v in engine.full_state_dict().items()}
        found[strategy] = (float(loss), state)
        engine.close()
    return found


def _oracle(dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, 16), torch.randn(ROWS, 8)
    model = _model().to("cuda", dtype)
    loss = F.mse_loss(model(x.to("cuda", dtype)), y.to("cuda", dtype))
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return loss.item(), {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_tensor_and_pipeline_equal_a_plain_loop_on_two_gpus(run_ranks):
    if torch.cuda.device_count() < 2:
        pytest.skip("tensor and pipeline parallelism need 2 GPUs")
    torch.backends.cuda.matmul.allow_tf32 = False
    ranks = run_ranks(_model_parallel_worker, 2, deadline_s=600)
    (loss32, oracle), (loss64, exact) = _oracle(torch.float32), _oracle(torch.float64)
    for strategy in OPTIONS:
        for loss, state in (rank[strategy] for rank in ranks):
            check_close(torch.tensor(loss), loss32, loss64, what=f"{strategy} loss")
            check_close(state, oracle, exact, what=f"{strategy} SGD step")
