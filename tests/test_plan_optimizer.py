"""The planner prices each device's own optimizer step, and `tessera compare` measures a rank's
compute without it.

On CPU ranks torch's AdamW loops over the parameter tensors: DDP steps every tensor of the model
on every rank, ZeRO-1/2 a 1/dp slice of two flat buffers (the trainer's weight-decay groups).
`tessera compare`'s rate used to include the whole model's step in every rank's compute, so the
planner priced ZeRO's step like DDP's; `benchmarks/plan_check.py` measured ddp behind zero1/2.
"""

from __future__ import annotations

import time

import pytest
import torch

from tessera.plan.cluster import PRESETS, Cluster, adamw_cost
from tessera.plan.model import ModelSpec
from tessera.plan.search import Strategy, estimate

PER_PARAM, PER_TENSOR = 3e-9, 4e-5
"""A CPU-like cluster's AdamW costs, set here (seconds per parameter, per tensor)."""


def _cpu_cluster() -> Cluster:
    return Cluster(
        name="cpu", devices=2, per_node=2, memory_bytes=8e9, peak_flops=2e10,
        intra_bandwidth=1e9, inter_bandwidth=1e9, optimizer_s_per_param=PER_PARAM,
        optimizer_s_per_tensor=PER_TENSOR, overlap=False,
    )  # fmt: skip


def test_ddp_steps_every_tensor_zero_a_slice_of_two_flat_buffers():
    model = ModelSpec.gpt(layers=4, hidden=128, heads=4, seq=64, vocab=256)
    tensors = 12 * 4 + 4  # per block: 2 norms and 4 linears, weight and bias; wte, wpe, ln_f
    cluster = _cpu_cluster()

    def optimizer_s(strategy: Strategy) -> float:
        return estimate(strategy, model, cluster, batch=8, microbatch=8).optimizer_s

    assert optimizer_s(Strategy(dp=2)) == pytest.approx(
        model.params * PER_PARAM + tensors * PER_TENSOR, rel=1e-12
    )
    for stage in (1, 2):
        assert optimizer_s(Strategy(dp=2, zero=stage)) == pytest.approx(
            model.params / 2 * PER_PARAM + 2 * PER_TENSOR, rel=1e-12
        )
    # ZeRO-3: two buffers per unit, a unit per layer and one for the rest
    assert optimizer_s(Strategy(dp=2, zero=3)) == pytest.approx(
        model.params / 2 * PER_PARAM + 2 * (4 + 1) * PER_TENSOR, rel=1e-12
    )
    # a pipeline stage steps its own half of the tensors
    assert optimizer_s(Strategy(dp=1, pp=2, microbatches=2)) == pytest.approx(
        model.params / 2 * PER_PARAM + tensors / 2 * PER_TENSOR, rel=1e-12
    )
    assert optimizer_s(Strategy(dp=2, zero=2, offload="cpu")) == 0.0  # the host's: offload_s
    ddp = estimate(Strategy(dp=2), model, cluster, batch=8, microbatch=8)
    assert ddp.step_s == pytest.approx(
        ddp.compute_s + ddp.comm_s + ddp.bubble_s + ddp.offload_s + ddp.optimizer_s, rel=1e-12
    )
    measured = estimate(
        Strategy(dp=2), model, cluster, batch=8, microbatch=8, achieved_flops=1e10
    )  # an end-to-end rate holds the step already
    assert measured.optimizer_s == 0.0


def test_a_gpu_steps_at_its_memory_bandwidth():
    model = ModelSpec.gpt(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200)
    dgx = Cluster(name="dgx", devices=8, **PRESETS["a100-80g-dgx"])
    plan = estimate(Strategy(dp=8, zero=1), model, dgx, batch=64, microbatch=8)
    # fused AdamW reads and writes 28 bytes a parameter (FORMULAS.md) at 2 TB/s, per-tensor free
    assert plan.optimizer_s == pytest.approx(model.params / 8 * 28 / 2.0e12, rel=1e-12)


def test_adamw_cost_measures_a_positive_cost_per_parameter_and_per_tensor():
    per_param, per_tensor = adamw_cost(seconds=0.05)
    assert 0 < per_tensor < 0.1 and 0 <= per_param < 1e-3, (per_param, per_tensor)


SLEEP_S = 1.0


def _time_with_a_slow_optimizer() -> list[float]:
    """`compare`'s local step timing on one rank, AdamW's step made to sleep SLEEP_S."""
    from tessera.train.compare import _time_local_steps

    step = torch.optim.AdamW.step

    def slow(self, *args, **kwargs):
        time.sleep(SLEEP_S)
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = slow
    config = {
        "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
        "batch_size": 4,
        "corpus_bytes": 20_000,
        "nproc": 1,
    }
    return _time_local_steps(config, 2, 1 << 30, False)[1]


def test_compare_times_a_ranks_compute_without_its_optimizer_step(run_ranks):
    """Each repeat's time leaves the optimizer's step out: with a step of SLEEP_S seconds, a
    one-layer model's forward and backward on 4 rows take far less than SLEEP_S."""
    (times,) = run_ranks(_time_with_a_slow_optimizer, 1)
    assert len(times) == 2 and all(0 < t < SLEEP_S for t in times), times
