"""The device is a parameter: CUDA code paths checked on a CPU-only machine, and ranks vs GPUs.

`FakeTensorMode` makes `device="cuda"` tensors without a GPU: they carry shapes, dtypes and
devices but no data, and any op mixing a CPU tensor with a CUDA one raises as it would on a GPU
("Expected all tensors to be on the same device"). `_HostReads` sits inside it and counts each
read of a device value by the host (`aten._local_scalar_dense`, what `.item()`, `float()` and
`bool()` of a tensor run: on CUDA each one waits for the GPU's queue to drain), answering 0 so
the code goes on. So the single-process paths that run on a GPU (norms and clipping, the fp16
overflow check, the checkpoint writer, the training step) are run here with CUDA tensors.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import tessera
from tessera.errors import ConfigError
from tessera.optim.clip import clip_grad_norm, squared_sum
from tessera.optim.loss_scale import DynamicLossScaler
from tessera.runtime.devices import BACKEND_ENV
from tessera.train import TrainConfig, run_training
from tessera.zero._safetensors import TensorFile, write_tensors

EPS32 = torch.finfo(torch.float32).eps


class _HostReads(TorchDispatchMode):
    """Counts host reads of tensor values (each a device sync on CUDA); answers 0 to each."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
            return 0.0 if args[0].dtype.is_floating_point else 0
        return func(*args, **(kwargs or {}))


def _cuda_grads() -> list[torch.Tensor]:
    """Gradients of three shapes and two dtypes on the (fake) GPU."""
    return [
        torch.randn(7, 3, device="cuda"),
        torch.randn(5, device="cuda"),
        torch.randn(4, 4, device="cuda", dtype=torch.bfloat16),
    ]


def test_norms_and_clipping_stay_on_the_gradients_device():
    """The default --grad-clip 1.0 path of ZeRO, tensor and pipeline engines with CUDA gradients:
    a float64 accumulator on the CPU beside CUDA gradients raised at the first step."""
    with FakeTensorMode(), _HostReads() as reads:
        grads = _cuda_grads()
        total = squared_sum(grads, [1.0, 0.5, 1.0])
        assert total.device.type == "cuda" and total.dtype == torch.float64
        norm = clip_grad_norm(grads, 1.0)
        assert reads.count == 0  # norm and scaling on the device: the step does not wait
        assert all(g.device.type == "cuda" for g in grads)
        assert norm.tensor().device.type == "cuda"
        float(norm)  # read when asked, once
        assert reads.count == 1


def test_squared_sum_still_weights_and_sums_in_float64():
    grads = [torch.tensor([3.0, 4.0]), None, torch.tensor([1.0], dtype=torch.bfloat16)]
    assert squared_sum(grads, [2.0, 1.0, 0.0]).item() == 50.0
    assert squared_sum(grads).item() == 26.0 and squared_sum([]).item() == 0.0


def test_fp16_overflow_check_reads_the_host_once_whatever_the_gradient_count():
    """One sync per step: the check used to read every gradient's finiteness on the host."""
    with FakeTensorMode(), _HostReads() as reads:
        scaler = DynamicLossScaler()
        scaler.unscale_and_check(_cuda_grads())
        assert reads.count == 1
    # the values on real tensors: unscaled by 1/scale, inf/nan found, a bf16 one too
    scaler = DynamicLossScaler(init_scale=4.0)
    finite = [torch.tensor([4.0, 8.0]), torch.tensor([2.0], dtype=torch.bfloat16)]
    assert scaler.unscale_and_check(finite) is False
    assert finite[0].tolist() == [1.0, 2.0] and finite[1].item() == 0.5
    for bad in (float("inf"), float("nan")):
        assert scaler.unscale_and_check([torch.ones(2), torch.tensor([1.0, bad])]) is True


class _OnDevice(torch.Tensor):
    """A tensor that behaves as device memory towards numpy: `.numpy()` raises as it does on a
    CUDA tensor, and `.to("cpu")`/`.cpu()` return a plain host tensor. (FakeTensorMode's tensors
    hold no bytes to write, so the writer is checked with this stand-in.)"""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).clone()
        return super().__torch_function__(func, types, args, kwargs)


def test_checkpoint_writer_copies_device_tensors_to_the_host(tmp_path):
    """ZeRO's shard files from GPU memory: the writer called .numpy() on the CUDA tensor."""
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    halves = torch.arange(5, dtype=torch.bfloat16)
    write_tensors(
        tmp_path / "shard.safetensors",
        {"w": weights.as_subclass(_OnDevice), "h": halves.as_subclass(_OnDevice)},
    )
    with TensorFile(tmp_path / "shard.safetensors") as read:
        assert torch.equal(read.get("w"), weights) and torch.equal(read.get("h"), halves)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_train_step_returns_without_reading_the_device():
    """`train_step` returns a `StepLoss`: the value is read when used, not at every step."""
    try:
        _check_lazy_loss(tessera.init())
    finally:
        tessera.shutdown()  # later tests in this process expect no process group


def _check_lazy_loss(ctx) -> None:
    engine = tessera.setup(
        _model(), lambda p: torch.optim.SGD(p, lr=0.1), strategy="single",
        loss_fn=F.mse_loss, grad_accum=2, ctx=ctx,
    )  # fmt: skip
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    with _HostReads() as reads:
        loss = engine.train_step((x, y))
        assert reads.count == 0
    assert isinstance(loss, tessera.strategies.StepLoss)
    plain = _model()
    expected = F.mse_loss(plain(x), y).item()  # the mean of two equal halves' means
    assert abs(float(loss) - expected) <= 4 * EPS32 * abs(expected)
    assert f"{loss:.6f}" == f"{float(loss):.6f}" and loss + 0 == float(loss)
    assert pickle.loads(pickle.dumps(loss)) == float(loss)  # a plain float across processes


ROWS, STRATEGIES = 8, ("ddp", "torch-ddp", "local-sgd", "zero2", "tensor", "pipeline")


def _loss_worker() -> dict:
    """Each rank's returned loss per strategy, and its own shard's loss (different per rank)."""
    ctx = tessera.init()
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, 6), torch.randn(ROWS, 3)
    half = ROWS // ctx.world_size
    mine = slice(ctx.rank * half, (ctx.rank + 1) * half)
    found = {"own": F.mse_loss(_model()(x[mine]), y[mine]).item()}
    for strategy in STRATEGIES:
        options = {
            "pipeline": {"split": ["2"], "microbatches": 2},
            "tensor": {"plan": {"0": "column", "2": "row"}},
        }.get(strategy, {})
        engine = tessera.setup(
            _model(), lambda p: torch.optim.SGD(p, lr=0.1), strategy=strategy,
            loss_fn=F.mse_loss, ctx=ctx, **options,
        )  # fmt: skip
        found[strategy] = float(engine.train_step((x[mine], y[mine])))
        engine.close()
    return found


def test_train_step_returns_the_global_mean_loss_under_every_strategy(run_ranks):
    """Issue 29, item 17: data parallelism returned each rank's own loss, tensor and pipeline the
    global one. Now every strategy returns the global batch's mean on every rank."""
    ranks = run_ranks(_loss_worker, 2)
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, 6), torch.randn(ROWS, 3)
    expected = F.mse_loss(_model()(x), y).item()
    assert abs(ranks[0]["own"] - ranks[1]["own"]) > 1e-3  # the ranks' own losses differ
    # float32: each side sums ROWS * 3 squared errors and halves once more: (n + 2) roundings
    bound = (ROWS * 3 + 2) * EPS32 * abs(expected)
    for strategy in STRATEGIES:
        for rank in ranks:
            assert abs(rank[strategy] - expected) <= bound, (strategy, rank[strategy], expected)


def _pretend_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)


def _check_message(text: str) -> None:
    for part in ("2 ranks", "1 is visible", "--nproc auto", "CUDA_VISIBLE_DEVICES", "=gloo"):
        assert part in text, (part, text)


def test_more_ranks_than_gpus_is_refused_before_any_process_starts(monkeypatch, tmp_path, capsys):
    _pretend_one_gpu(monkeypatch)
    config = TrainConfig(nproc=2, steps=1, out=str(tmp_path / "run"), progress=False)
    with pytest.raises(ConfigError) as refused:
        run_training(config)
    _check_message(str(refused.value))
    assert not (tmp_path / "run").exists()  # refused before the run folder, before any rank
    with pytest.raises(ConfigError) as refused:
        tessera.launch(_model, 2)
    _check_message(str(refused.value))
    from tessera.cli import main

    assert main(["run", "-n", "2", str(tmp_path / "train.py")]) == 2  # tessera run: torchrun's
    _check_message(capsys.readouterr().err)
    from tessera.runtime.devices import check_visible_gpus
    from tessera.train.config_build import auto_nproc

    assert auto_nproc("ddp") == 1  # --nproc auto: one rank per GPU
    # the CPU way out that the message names: ranks on gloo need no GPU (checked, not run)
    monkeypatch.setenv(BACKEND_ENV, "gloo")
    check_visible_gpus(2)
    assert auto_nproc("ddp") == (os.cpu_count() or 1)


_TORCHRUN_RANK = """
import torch, torch.distributed
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.distributed.is_nccl_available = lambda: True
import tessera
try:
    tessera.init()
except Exception as exc:
    print(type(exc).__name__, exc, "initialized:", torch.distributed.is_initialized())
"""


def test_a_torchrun_rank_beyond_the_gpus_gets_the_same_message():
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # fmt: skip
    env.pop(BACKEND_ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", _TORCHRUN_RANK], env=env, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout  # fmt: skip
    assert out.startswith("ConfigError") and out.rstrip().endswith("initialized: False"), out
    _check_message(out)


def test_the_trainers_adamw_runs_fused_on_cuda_unless_the_user_chose():
    from tessera.train.optimizers import make_optimizer

    with FakeTensorMode():
        on_gpu = [nn.Parameter(torch.randn(3, 2, device="cuda"))]
        assert make_optimizer(TrainConfig(), on_gpu).defaults["fused"] is True
        groups = [{"params": on_gpu, "weight_decay": 0.0}]
        assert make_optimizer(TrainConfig(), groups).defaults["fused"] is True
        mine = TrainConfig(optimizer_args='{"foreach": false}')
        assert not make_optimizer(mine, on_gpu).defaults["fused"]
    assert not make_optimizer(TrainConfig(), [nn.Parameter(torch.ones(2))]).defaults["fused"]
