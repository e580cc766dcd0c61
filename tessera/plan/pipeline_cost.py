"""What a pipeline's step costs this machine besides compute: `measure_pipeline`.

The planner prices a pipeline message as a link's latency plus its bytes over the bandwidth, the
α-β of `comm.calibrate`, which times collectives issued back to back by ranks that do nothing
else. A pipeline engine's step on processes sharing cores costs more than that, and not in its
compute (BENCHMARKS.md "plan_check": 4 ranks on 2 cores ran the hybrid dp=2 pp=2 56-88 ms a step
above its prediction at the achieved compute rate; timed here with other jobs beside it, its
four ranks' CPU time filled the two cores for about 93% of the step, each rank's 25-45 ms more
than the same rows through the whole model: host work, not a bubble):
* per message (an activation forward or a gradient backward across one stage boundary, per
  micro-batch): the send's copy, the receiver's wake-up (a process that slept in poll() waits
  for a core the others hold), the schedule's per-micro-batch actions around it;
* per step, whatever the micro-batches: the engine's gather of the global batch over all ranks
  (every stage computes on it), the loss broadcast from the last stage, its mean over the data
  parallel replicas.

`measure_pipeline(ranks)` times both where the plan's rows run: `ranks` local ranks, each in a
pipeline of two stages (`ranks / 2` data-parallel replicas, as a hybrid row splits them; an odd
count: one pipeline of all ranks), through `tessera.setup(strategy="hybrid")` as the trainer
builds it, on a stand-in model with next to no compute (a scalar times each activation). Its step
time at m1 = p and m2 = 8p micro-batches gives the cost per micro-batch (the slope) and per step
(the intercept, less a data-parallel engine's step on the same stand-in and ranks: the loop's
own cost and a gradient all-reduce, which every engine pays and the planner prices apart).
A micro-batch sends 2 (p - 1) messages per pipeline, over p ranks: the slope over 2 (p - 1) / p
is one message's cost as a rank's step sees it, with the cores shared as the plan's ranks share
them. The stand-in's messages are small (1 KiB): what their bytes cost is the link's
β, priced per row at the row's activation size.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

__all__ = ["measure_pipeline"]

_ROWS, _SEQ, _HIDDEN = 1, 16, 16
"""The stand-in's micro-batch: 1 sequence of 16 positions of 16 floats (a 1 KiB message)."""
_STEPS, _WARMUP = 15, 2


class _Embed(nn.Module):
    """Token ids to (rows, seq, hidden) floats, times a learnable scalar: a stage with a
    gradient and no matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.unsqueeze(-1).expand(*ids.shape, _HIDDEN).float() * self.weight


class _Scale(nn.Module):
    """An activation times a learnable scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (output.mean(-1) - targets.float()).pow(2).mean()


def layout(ranks: int) -> tuple[int, int]:
    """(dp, pp) of the measured pipelines: pairs of stages, or one pipeline of an odd count."""
    pp = 2 if ranks % 2 == 0 else ranks
    return ranks // pp, pp


def _time_steps(microbatch_counts: tuple[int, ...]) -> dict[int | str, list[float]]:
    """One rank: the stand-in's train_step times at each micro-batch count, and (key "ddp") a
    data-parallel engine's on the same stand-in and ranks. The engines take their steps in
    turn (after a warm-up of each), so a load that comes and goes weighs on all alike."""
    import torch.distributed as dist

    import tessera
    from tessera.runtime.context import init

    ctx = init()
    dp, pp = layout(ctx.world_size)
    engines, batches = {}, {}
    for m in (*microbatch_counts, 0):
        options = {"strategy": "ddp"}  # m = 0: the data-parallel engine
        if m:
            options = {"strategy": "hybrid", "dp": dp, "pp": pp, "microbatches": m}
        model = nn.Sequential(_Embed(), *[_Scale() for _ in range(2 * pp - 1)])
        engines[m or "ddp"] = tessera.setup(
            model, lambda params: torch.optim.SGD(params, lr=0.0), loss_fn=_loss, ctx=ctx,
            **options,
        )  # fmt: skip
        share = dp * max(m, pp) * _ROWS // ctx.world_size  # this rank's shard of the batch
        ids = torch.randint(0, 9, (2, share, _SEQ), generator=torch.Generator().manual_seed(m))
        batches[m or "ddp"] = (ids[0], ids[1])
    found: dict[int | str, list[float]] = {key: [] for key in engines}
    for round_ in range(_WARMUP + _STEPS):
        for key, engine in engines.items():
            dist.barrier()
            began = time.perf_counter()
            engine.train_step(batches[key])
            if round_ >= _WARMUP:
                found[key].append(time.perf_counter() - began)
            engine.step()
    for engine in engines.values():
        engine.close()
    return found


def measure_pipeline(ranks: int, beta: float) -> dict[str, float]:
    """{"pipeline_message_s", "pipeline_step_s"} of `ranks` local ranks (see the module
    docstring): a message's cost besides its bytes (`beta` seconds a byte, the link's), and
    what the pipeline engine's step costs whatever its micro-batches beyond a data-parallel
    engine's. Each step time is the slowest rank's (a synchronous step waits for it), the
    median over steps."""
    from tessera.runtime.launch import launch

    ranks = max(2, ranks)
    pp = layout(ranks)[1]
    counts = (pp, 8 * pp)
    per_rank = launch(_time_steps, ranks, counts, timeout_s=120)
    step = {
        m: statistics.median(max(times) for times in zip(*(r[m] for r in per_rank), strict=True))
        for m in (*counts, "ddp")
    }
    per_microbatch = max(0.0, (step[counts[1]] - step[counts[0]]) / (counts[1] - counts[0]))
    messages = 2 * (pp - 1) / pp  # per micro-batch and rank
    message_bytes = _ROWS * _SEQ * _HIDDEN * 4
    return {
        "pipeline_message_s": max(0.0, per_microbatch / messages - message_bytes * beta),
        "pipeline_step_s": max(0.0, step[counts[0]] - counts[0] * per_microbatch - step["ddp"]),
    }
