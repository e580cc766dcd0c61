"""ZeRO-Offload's one-step delayed parameter update (DPU, Ren et al. 2021, section 5).

What must hold, compared with an oracle written here (one process, the whole batch, plain
PyTorch): after `delayed_update_after` = N steps in place, the update of step t (0-based) uses
the gradient computed at the parameters of step t-1 (x_{t-1}) instead of x_t; the update of step
N itself is still fresh. The module shows x_{t-1} until the next `step` publishes x_t. That for
stages 1-3, with several flat buffers, gradient accumulation (two backwards per step) and
clipping by the global norm, with SGD without momentum (a wrong gradient factor or a wrong
point shows in every element) and with AdamW through `initialize(offload="cpu")`.

The SGD run holds each background step at a gate until the next backward has finished: the step
then runs after that backward overwrote the stage's gradient buffers (and, with the host step of
offload, the host link's), so a step reading them instead of its own set (the partition not
double-buffered) fails deterministically.

Resume: `tessera train` with DPU, checkpointed while a step is in flight, resumed: the same
parameters, optimizer state and losses as the run that never stopped (`torch.equal`).
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from test_resume import TINY, _final_state, _losses, assert_same
from torch import nn

import tessera
from tessera.errors import ConfigError
from tessera.train import build_config
from tessera.train.loop import train_worker
from tessera.zero import ZeroStage1, ZeroStage2, ZeroStage3, full_state_dict, initialize
from tessera.zero.delayed import DEFAULT_WARMUP_STEPS

STEPS = 6
AFTER = 2
"""Warm-up steps in place: steps 0..2 use fresh gradients, steps 3..5 one step stale."""
BATCH = 8
SGD_LR = 0.2
MAX_NORM = 0.3


class DictNet(nn.Module):
    """Blocks in an nn.ModuleDict called one by one, a parameter used directly in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.blocks = nn.ModuleDict(
            {"inner": nn.Linear(6, 6), "mix": nn.Linear(6, 6), "out": nn.Linear(6, 3)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks["inner"](x * self.scale))
        h = h + torch.tanh(self.blocks["mix"](h))
        return self.blocks["out"](h)


def _model() -> DictNet:
    torch.manual_seed(0)
    return DictNet()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def _oracle(make_optimizer: Any, dtype: torch.dtype, clip: float | None) -> dict[str, Any]:
    """The paper's rule in plain PyTorch: step t applies the gradient at x_t (t <= AFTER) or
    x_{t-1}; returns x_{STEPS-1} and x_STEPS and the norms clipping saw."""
    model = _model().to(dtype)
    probe = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    norms = []
    for step in range(STEPS):
        current = {k: v.clone() for k, v in model.state_dict().items()}
        probe.load_state_dict(current if step <= AFTER else previous)
        probe.zero_grad()
        x, y = _batch(step)
        F.mse_loss(probe(x.to(dtype)), y.to(dtype)).backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(probe.parameters(), clip)))
        for param, used in zip(model.parameters(), probe.parameters()):
            param.grad = used.grad.clone()
        optimizer.step()
        previous = current
    return {"before_last": previous, "final": model.state_dict(), "norms": norms}


class GatedSGD(torch.optim.SGD):
    """SGD whose background (delayed) steps wait until the test opens the gate."""

    gate = threading.Semaphore(0)

    def step(self, closure: Any = None) -> Any:
        if threading.current_thread() is not threading.main_thread():
            assert GatedSGD.gate.acquire(timeout=60), "the test never opened the gate"
        return super().step(closure)


def _train(model: nn.Module, optimizer: Any, *, micro: int, clip: float | None, gated: bool):
    """Each rank's share of every batch, `micro` backwards per step; returns clip norms."""
    rank, world = tessera.init().rank, tessera.init().world_size
    rows = BATCH // world
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (F.mse_loss(model(xs), ys) / micro).backward()
        if gated and step > AFTER:
            GatedSGD.gate.release()  # the step of t-1 runs now, after this backward
        if clip is not None:
            norms.append(optimizer.clip_grad_norm(clip))
        optimizer.step()
        optimizer.zero_grad()
    if gated:
        GatedSGD.gate.release()  # the last step
    return norms


def _visible(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equivalence_on_ranks() -> dict[str, Any]:
    """Per case: (what tessera ended with, what it showed before finish_step)."""
    tessera.init()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    sgd = {"delayed_update": True, "delayed_update_after": AFTER, "bucket_cap_mb": 0.0001}
    cases = [
        ("sgd-zero1", ZeroStage1, sgd),
        ("sgd-zero2", ZeroStage2, sgd),
        ("sgd-zero3", ZeroStage3, {**sgd, "bucket_cap_mb": None, "units": ["blocks.*"]}),
        # the host step (offload's): the link hands its gradient set to the step and takes its
        # other one for the next backward, whose copies the gate lets land first
        ("sgd-zero2-host", ZeroStage2, {**sgd, "host_step": True}),
        ("sgd-zero3-host", ZeroStage3,
         {**sgd, "host_step": True, "bucket_cap_mb": None, "units": ["blocks.*"]}),
    ]  # fmt: skip
    for name, stage, options in cases:
        model = _model()
        options = {k: v for k, v in options.items() if v is not None}
        optimizer = stage(model, lambda ps: GatedSGD(ps, lr=SGD_LR), **options)
        assert len(optimizer.flats) >= 3, "the case needs several flat buffers"
        _train(model, optimizer, micro=2, clip=None, gated=True)
        shown = _visible(model) if stage is not ZeroStage3 else None
        optimizer.finish_step()
        full = optimizer.full_parameters()  # (built without initialize: no full_state_dict)
        final = {key: full[key] for key, _ in model.named_parameters()}
        out[name] = (final, shown, _visible(model) if shown else None)
    for stage in (2, 3):
        model, optimizer = initialize(
            _model(), torch.optim.AdamW, stage=stage, offload="cpu", delayed_update=True,
            delayed_update_after=AFTER, lr=0.05, weight_decay=0.1,
            **({"units": ["blocks.*"]} if stage == 3 else {}),
        )  # fmt: skip
        norms = _train(model, optimizer, micro=1, clip=MAX_NORM, gated=False)
        shown = _visible(model) if stage != 3 else None
        out[f"adamw-zero{stage}"] = (full_state_dict(model), shown, norms)
    # DPU off is unchanged: delayed_update with the warm-up never over is the plain step.
    ends = []
    for delayed in (False, True):
        extra = {"delayed_update": True, "delayed_update_after": STEPS} if delayed else {}
        model, optimizer = initialize(
            _model(), torch.optim.AdamW, stage=2, offload="cpu", lr=0.05, **extra
        )
        _train(model, optimizer, micro=1, clip=MAX_NORM, gated=False)
        ends.append(full_state_dict(model))
    out["never-delayed"] = ends
    return out


def test_delayed_update_equals_the_one_step_stale_oracle(run_ranks):
    results = run_ranks(_equivalence_on_ranks, 2)[0]

    def sgd(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=SGD_LR)

    def adamw(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)

    expected = {
        "sgd": (_oracle(sgd, torch.float32, None), _oracle(sgd, torch.float64, None)),
        "adamw": (
            _oracle(adamw, torch.float32, MAX_NORM),
            _oracle(adamw, torch.float64, MAX_NORM),
        ),
    }
    plain, never = results.pop("never-delayed")
    for case, (final, shown, extra) in results.items():
        fp32, fp64 = expected[case.split("-")[0]]
        check_close(final, fp32["final"], fp64["final"], what=f"{case} final")
        if shown is not None:  # the module is one step behind until the next step publishes
            check_close(shown, fp32["before_last"], fp64["before_last"], what=f"{case} shown")
        if case.startswith("sgd") and extra is not None:  # finish_step publishes the last one
            check_close(extra, fp32["final"], fp64["final"], what=f"{case} after finish_step")
        if case.startswith("adamw"):
            check_close(extra, fp32["norms"], fp64["norms"], what=f"{case} clip norms")
            assert max(extra) > MAX_NORM, "clipping never acted: the check would prove nothing"
    assert plain.keys() == never.keys()
    assert all(torch.equal(plain[k], never[k]) for k in plain)


def test_delayed_update_is_refused_where_it_cannot_run():
    model = _model()
    with pytest.raises(ValueError, match="it needs offload='cpu', not offload=None"):
        initialize(model, torch.optim.AdamW, stage=2, delayed_update=True)
    with pytest.raises(ValueError, match="it needs offload='cpu', not offload='nvme'"):
        initialize(model, torch.optim.AdamW, stage=2, offload="nvme", delayed_update=True)
    with pytest.raises(ValueError, match="needs ZeRO stage 1, 2 or 3, not stage 0"):
        initialize(model, torch.optim.AdamW, stage=0, offload="cpu", delayed_update=True)
    with pytest.raises(ValueError, match="delayed_update_after must be an integer >= 1"):
        initialize(model, torch.optim.AdamW, stage=2, offload="cpu", delayed_update=True,
                   delayed_update_after=0)  # fmt: skip
    with pytest.raises(ConfigError, match="it needs offload cpu, not offload None"):
        build_config({"strategy": "zero2", "delayed_update": True})
    with pytest.raises(ConfigError, match="delayed_update_after must be an integer >= 1"):
        build_config(
            {"strategy": "zero2", "offload": "cpu", "delayed_update": True,
             "delayed_update_after": 0}
        )  # fmt: skip
    config = build_config(
        {"strategy": "zero3", "offload": "cpu", "delayed_update": True, "delayed_update_after": 3}
    )
    assert config.delayed_update and config.delayed_update_after == 3
    assert build_config({}).delayed_update_after == DEFAULT_WARMUP_STEPS  # one default, two APIs


DPU = {"offload": "cpu", "delayed_update": True, "delayed_update_after": 1, "nproc": 2}
"""Step 0 in place, steps 1-3 delayed: the checkpoint of step 2 holds a step in flight."""
DPU_RUNS = {
    "zero2": {"strategy": "zero2", "bucket_cap_mb": 0.01, **DPU},  # several flat shards
    "zero3-bf16": {"strategy": "zero3", "mixed_precision": "bf16", **DPU},
}


def _resume_three_ways(root: str) -> None:
    for run, options in DPU_RUNS.items():
        for name, steps, resume in (("straight", 4, 0), ("split", 2, 0), ("split", 4, 1)):
            folder = Path(root) / run / name
            folder.mkdir(parents=True, exist_ok=True)
            config = build_config(TINY, options, {"steps": steps, "out": str(folder)})
            train_worker(config, str(folder), bool(resume))


def test_delayed_update_resumes_bit_for_bit_with_adamw(run_ranks, tmp_path):
    run_ranks(_resume_three_ways, 2, str(tmp_path))
    for run in DPU_RUNS:
        straight, split = tmp_path / run / "straight", tmp_path / run / "split"
        assert _losses(split) == _losses(straight), run
        assert [step for step, _ in _losses(split)] == [1, 2, 3, 4]
        state = _final_state(straight)
        assert state["shards"][0]["meta"]["delayed"] == {"steps": 4, "unpublished": True}
        assert any(key.startswith("stale|") for key in state["shards"][0]), run
        assert_same(_final_state(split), state, f"{run} checkpoint")
