"""Mixed precision (`tessera.setup(..., precision=)`, `--mixed-precision`) and fp16 loss scaling.

Oracles are plain PyTorch loops written here. What is checked:

* the scaler's rules (skip and halve on inf, grow after `growth_interval` clean steps) and its
  defaults (torch.amp.GradScaler's);
* an fp16 run of `single` with an inf injected into one step's gradient equals, bit for bit, a
  plain loop doing autocast + scaled backward + unscale + skip + clip-after-unscale; the skipped
  step leaves parameters and AdamW state unchanged;
* resume with fp16 scaling is exact (the scaler's state travels in the checkpoint);
* on 2 ranks, bf16 and fp16 runs of single, ddp, torch-ddp, zero2, zero3, pipeline, tensor,
  hybrid and local-sgd stay within a tolerance derived from the unit roundoff of the fp32
  oracle, and differ from their fp32 run (the low precision is really used); an inf on one
  rank alone makes every rank skip (`test_precision_skip.py`, which asserts it within seconds);
* the trainer takes `--mixed-precision fp16` for a non-ZeRO strategy and writes `loss_scale`
  and `skipped` to metrics.jsonl.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from _tolerance import FP32_ULP
from torch import nn

import tessera
from tessera.optim import DynamicLossScaler
from tessera.runtime import Context

LR, STEPS, ROWS = 0.05, 3, 8
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
"""Half of each format's machine epsilon: the relative error of one rounding to nearest."""


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 5, generator=generator), torch.randint(
        0, 3, (ROWS,), generator=generator
    )


def _ctx() -> Context:
    return Context(0, 1, 0, 1, torch.device("cpu"), "gloo", 60.0)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ----- the scaler's rules ---------------------------------------------------------------------
def test_the_scaler_skips_halves_grows_and_has_grad_scalers_defaults():
    torch_scaler = torch.amp.GradScaler("cpu")
    scaler = DynamicLossScaler()
    assert scaler.scale == torch_scaler.get_scale()
    assert scaler.growth_interval == torch_scaler.get_growth_interval()
    assert scaler.growth_factor == torch_scaler.get_growth_factor()
    assert scaler.backoff_factor == torch_scaler.get_backoff_factor()
    scaler = DynamicLossScaler(8.0, growth_interval=2)
    grads = [torch.tensor([8.0, -16.0])]
    assert not scaler.unscale_and_check(grads)
    assert grads[0].tolist() == [1.0, -2.0]  # divided by the scale
    scales = []
    for found_inf in (False, True, False, False, False):
        scaler.update(found_inf)
        scales.append(scaler.scale)
    assert scales == [8.0, 4.0, 4.0, 8.0, 8.0]  # halved on the inf, doubled after 2 clean steps
    assert (scaler.skipped, scaler.clean_steps) == (1, 1)
    assert scaler.unscale_and_check([torch.tensor([1.0, math.nan]), None])
    for bad, message in (
        (lambda: DynamicLossScaler(0.0), "init_scale"),
        (lambda: DynamicLossScaler(growth_interval=0), "growth_interval"),
        (lambda: tessera.setup(_mlp(), _adamw, strategy="single", precision="fp8"), "precision"),
        (
            lambda: tessera.setup(
                _mlp(), _adamw, strategy="single", loss_scaler=DynamicLossScaler()
            ),
            "loss_scaler goes with precision='fp16'",
        ),
        (
            lambda: tessera.setup(
                _mlp(), _adamw, strategy="zero2", precision="fp16", mixed_precision="bf16"
            ),
            "disagree",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            bad()


# ----- single: a plain fp16 loop, bit for bit ------------------------------------------------
def _poison_at(model: nn.Module, steps: set[int], counter: list[int]) -> None:
    """Make the first weight's gradient inf in the backward of each step in `steps`."""
    first = next(model.parameters())
    first.register_hook(lambda grad: grad * math.inf if counter[0] in steps else grad)


def _plain_fp16_loop(model, batch, steps, poisoned, init_scale, interval, clip):
    """What fp16 training with dynamic loss scaling is, in plain PyTorch."""
    optimizer = _adamw(model.parameters())
    counter, scale, clean, history = [0], init_scale, 0, []
    _poison_at(model, poisoned, counter)
    for step in range(steps):
        counter[0] = step
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(batch[0]), batch[1])
        (loss * scale).backward()
        grads = [p.grad for p in model.parameters()]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        for grad in grads:
            grad.mul_(1.0 / scale)
        if finite:
            nn.utils.clip_grad_norm_(model.parameters(), clip)  # on the unscaled gradients
            optimizer.step()
            clean += 1
            if clean == interval:
                scale, clean = scale * 2, 0
        else:
            scale, clean = scale / 2, 0
        optimizer.zero_grad(set_to_none=True)
        history.append(scale)
    return model, history


def test_fp16_single_equals_a_plain_loop_skips_the_inf_step_and_resumes_exactly(tmp_path):
    """Step 1's gradient is inf: that step is skipped (parameters and AdamW state unchanged), the
    scale halves, then doubles after `interval` clean steps; the rest equals the plain loop bit for
    bit (clipping acts, on unscaled gradients). A run saved after 3 steps and resumed ends where
    the uninterrupted run ends, scaler included."""
    batch, steps, poisoned, init_scale, interval, clip = _batch(), 6, {1}, 2.0**10, 2, 0.05
    oracle, expected_scales = _plain_fp16_loop(
        _mlp(), batch, steps, poisoned, init_scale, interval, clip
    )
    assert expected_scales == [1024.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0]

    def engine_for(model):
        scaler = DynamicLossScaler(init_scale, growth_interval=interval)
        return tessera.setup(
            model, _adamw, strategy="single", loss_fn=F.cross_entropy, grad_clip=clip,
            precision="fp16", loss_scaler=scaler, ctx=_ctx(),
        )  # fmt: skip

    model, counter = _mlp(), [0]
    _poison_at(model, poisoned, counter)
    engine = engine_for(model)
    scales = []
    for step in range(steps):
        counter[0] = step
        before = copy.deepcopy((engine.module.state_dict(), engine.optimizer.state_dict()))
        engine.train_step(batch)
        engine.step()
        scales.append(engine.loss_scale)
        if step in poisoned:
            assert _equal(before[0], engine.module.state_dict())
            assert _equal(before[1]["state"], engine.optimizer.state_dict()["state"])
        if step == 2:
            engine.save(tmp_path / "step3")
    assert scales == expected_scales and engine.skipped_steps == 1
    assert _equal(engine.module.state_dict(), oracle.state_dict())

    resumed = engine_for(_mlp())
    resumed.load(tmp_path / "step3")
    for _ in range(3, steps):
        resumed.train_step(batch)
        resumed.step()
    assert resumed.loss_scaler.state_dict() == engine.loss_scaler.state_dict()
    assert _equal(resumed.module.state_dict(), engine.module.state_dict())
    assert _equal(resumed.optimizer.state_dict()["state"], engine.optimizer.state_dict()["state"])


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


# ----- every strategy on 2 ranks --------------------------------------------------------------
STRATEGIES = {
    "single": {},
    "ddp": {"bucket_cap_mb": 0.0005},  # several buckets
    "torch-ddp": {},
    "zero2": {},
    "zero3": {},
    "pipeline": {"microbatches": 2},
    "tensor": {"plan": {"0": "column", "2": "row"}},
    "hybrid": {"dp": 2, "microbatches": 2},  # the dp reduction inside a pipeline stage
    "local-sgd": {"average_every": 1},  # SGD: the average of the steps is the averaged step
}
ROUNDINGS = 2 * 6 + 2 + 1
"""Low-precision roundings on the longest path to one weight gradient of the 2-layer MLP: each
Linear rounds its input, its weight and its output in forward and the incoming gradient, the
other factor and the product in backward (6); tanh rounds its output and its gradient (2); the
reduction rounds the averaged gradient once more (1)."""


def _rank_runs():
    """On every rank: 3 SGD steps per (strategy, precision)."""
    ctx = tessera.init()
    inputs, targets = _batch()
    mine = slice(ctx.rank * ROWS // 2, (ctx.rank + 1) * ROWS // 2)
    finals = {}
    for strategy, options in STRATEGIES.items():
        batch = (inputs, targets) if strategy == "single" else (inputs[mine], targets[mine])
        for precision in ("fp32", "bf16", "fp16"):
            engine = tessera.setup(
                _mlp(), lambda p: torch.optim.SGD(p, lr=LR), strategy=strategy,
                loss_fn=F.cross_entropy, precision=precision, ctx=ctx, **options,
            )  # fmt: skip
            for _ in range(STEPS):
                engine.train_step(batch)
                engine.step()
            finals[strategy, precision] = engine.full_state_dict()
            engine.close()
    return finals


def _oracle_sgd() -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Plain fp32 SGD on the global batch: the final weights and, per tensor, sum_t ||g_t||."""
    model, (inputs, targets) = _mlp(), _batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grad_norms = dict.fromkeys(model.state_dict(), 0.0)
    for _ in range(STEPS):
        F.cross_entropy(model(inputs), targets).backward()
        for name, param in model.named_parameters():
            grad_norms[name] += param.grad.norm().item()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), grad_norms


def test_every_strategy_in_bf16_and_fp16_stays_near_fp32(run_ranks):
    """The tolerance. With SGD the weights after T steps are w0 - lr * sum_t g_t, so the
    low-precision run differs from fp32 by lr * sum_t (g_t' - g_t). Each gradient element is a
    chain of at most ROUNDINGS roundings, each of relative error <= u (the unit roundoff), so to
    first order ||g_t' - g_t|| <= ROUNDINGS * u * ||g_t||: the budget per tensor is
    lr * ROUNDINGS * u * sum_t ||g_t||, plus 16 float32 ulps of the weights for the fp32
    arithmetic itself (as in _tolerance.py). The bound is worst-case (every rounding in the
    same direction), so it holds with room; a bug is far outside it: loss scale not undone
    (x 2^16), weights stepped in low precision (u * ||w|| >> lr * u * sum ||g|| here), a
    gradient not averaged (x 2). (SGD, not Adam: Adam divides by sqrt(v), which turns the
    rounding of a near-zero gradient into an update of full size.)"""
    finals = run_ranks(_rank_runs, 2)[0]
    oracle, grad_norms = _oracle_sgd()
    for (strategy, precision), state in finals.items():
        if precision == "fp32":
            continue
        fp32 = finals[strategy, "fp32"]
        assert any(not torch.equal(state[k], fp32[k]) for k in state), (strategy, precision)
        for name, value in state.items():
            budget = LR * ROUNDINGS * UNIT_ROUNDOFF[precision] * grad_norms[name]
            budget += 16 * FP32_ULP * oracle[name].norm().item()
            error = (value.double() - oracle[name].double()).norm().item()
            assert error <= budget, (strategy, precision, name, error, budget)


# ----- the trainer ----------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # a skipped step 1
def test_the_trainer_takes_fp16_for_any_strategy_and_logs_the_scale(tmp_path):
    from tessera.errors import ConfigError
    from tessera.train import build_config, run_training

    with pytest.raises(ConfigError, match="mixed_precision must be bf16, fp16 or unset"):
        build_config({"mixed_precision": "fp8"})
    with pytest.raises(ConfigError, match="mixed_precision does not apply to strategy ps"):
        build_config({"strategy": "ps", "mixed_precision": "fp16"})
    init = 2.0**20  # overflows this model's fp16 gradients: the first steps are skipped
    config = build_config({
        "strategy": "single", "nproc": 1, "steps": 5, "mixed_precision": "fp16",
        "loss_scale_init": init, "loss_scale_growth_interval": 1,
        "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16}, "batch_size": 4,
        "corpus_bytes": 20_000, "sample_tokens": 0, "progress": False, "out": str(tmp_path),
    })  # fmt: skip
    run_training(config)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss_scale" in line]
    assert [line["step"] for line in steps] == [1, 2, 3, 4, 5]
    scale, skipped = init, 0
    for line in steps:  # halved on each skipped step, doubled after each clean one (interval 1)
        skip = line["skipped"] - skipped
        scale, skipped = scale * (0.5 if skip else 2.0), line["skipped"]
        assert skip in (0, 1) and line["loss_scale"] == scale, line
    assert 0 < skipped < 5  # both kinds of step happened


def _one_rank_ddp_gradients() -> dict[str, dict[str, torch.Tensor]]:
    """One rank: ddp's and a plain bf16 autocast loop's gradients of the same batch."""
    ctx = tessera.init()
    model = nn.Sequential(nn.Linear(5, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    plain = copy.deepcopy(model)
    inputs, targets = _batch()
    engine = tessera.setup(model, _adamw, strategy="ddp", loss_fn=F.cross_entropy,
                           precision="bf16", ctx=ctx)  # fmt: skip
    engine.train_step((inputs, targets))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(plain(inputs), targets)
    loss.backward()
    ddp = {name: p.grad.clone() for name, p in engine.module.named_parameters()}
    engine.close()
    return {"ddp": ddp, "plain": {name: p.grad for name, p in plain.named_parameters()}}


def test_ddp_on_one_rank_keeps_its_bf16_run_s_gradients_at_full_width(run_ranks):
    """bf16 gradients are averaged in bf16 over ranks (half the bytes); one rank sends nothing,
    so nothing is cast and ddp's gradients are the plain autocast loop's, bit for bit. The
    LayerNorm's and the biases' gradients are computed in fp32 and are not bf16 values: a cast
    there would round them (checked, so that the comparison can fail)."""
    grads = run_ranks(_one_rank_ddp_gradients, 1)[0]
    plain = grads["plain"]
    rounded = [n for n, g in plain.items() if not torch.equal(g, g.bfloat16().float())]
    assert rounded, "every gradient is a bf16 value: the test could not see a cast"
    for name, grad in plain.items():
        assert torch.equal(grads["ddp"][name], grad), name
