"""`tessera compare`: run each strategy here for a few steps and hold the planner to its numbers.

For the demo GPT (or a `--model` with its `--data`), every strategy that applies to `--nproc N`
ranks runs `--steps K` steps through the trainer (`run_training`, a run folder each), and its
measured median step time (the first steps left out: warm-up) and model-state bytes per rank
are set against what `tessera.plan` predicts for the same split on this machine as
`tessera plan --cluster this-machine` measured it (matmul rate and the calibrated cost model).
Model states are compared as the mean over ranks (the planner splits Ψ evenly over stages;
a pipeline's stages hold unequal shares, but their sum is the model's) and the largest rank.
The runs are fp32 with AdamW: 4 + 4 + 8 bytes per parameter (`plan.search.PRECISIONS`). What a
run measures is what a rank holds at the end of a step: the pipeline, tensor and hybrid engines
have freed their gradients by then (`zero_grad(set_to_none=True)`), so their prediction is compared
without gradients; offloaded optimizer state lives in this host's memory, which is the "device"
here, so it is compared with it. ddp does not measure its model states (n/a).

The machine is measured again at the start (`this_machine(recalibrate=True)`): its load changes
from minute to minute, and a prediction calibrated under another load says little. Compute is
priced at the rate a rank achieves on its share of the iteration with the other ranks computing
beside it (`achieved_rate`), given to the planner as a compute-only rate (`compute_flops`,
`tessera plan --compute-flops`; not `--achieved-flops`, an end-to-end rate to which nothing is
added): a peak matmul rate overstates what a small model's step reaches (here by about 2x).
The rate is measured just before and after each strategy's run, at what it computes per pass
(the whole batch share, a pipeline's micro-batch, or a tensor-parallel rank's shards),
from the slowest rank of each synchronised repeat (a synchronous step waits for it; the trainer's
`step_s` is the slowest rank's too). What the comparison then tests is what the planner adds to
compute: communication, pipeline bubbles (on shared cores, `bubble_fraction_on_shared_cores`)
and offload traffic. `repeats` runs the list round-robin several times and compares medians: two
runs of one strategy minutes apart differ by up to 30% on a 2-core shared machine.

Any list of runs can be compared instead of `runs_for`'s (`compare_runs(runs=...)`): `plan_run`
makes the run of a `tessera plan` row, configured as the row's printed `tessera train` command
(benchmarks/plan_check.py: is the plan's top row among the two fastest measured?).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.plan.cluster import this_machine
from tessera.plan.commands import strategy_layer
from tessera.plan.formulas import flops_per_iteration
from tessera.plan.model import ModelSpec, from_module
from tessera.plan.search import Strategy, estimate
from tessera.strategies.registry import CAPABILITIES, capabilities
from tessera.train.config_build import build_config
from tessera.train.metrics import read_metrics
from tessera.train.run import run_training

__all__ = ["Comparison", "achieved_rate", "check_runs", "compare_runs", "plan_run", "runs_for"]

GRADIENTS_FREED = tuple(name for name, caps in CAPABILITIES.items() if caps.frees_gradients)
"""Engines whose gradients are gone when a step's model states are measured (see above): those
whose `Capabilities` declare `frees_gradients`."""


def runs_for(
    nproc: int, microbatches: int, *, model_parallel: bool = True
) -> list[tuple[str, dict[str, Any], Strategy]]:
    """The (label, config layer, planner strategy) of each strategy that runs on `nproc` ranks.

    `model_parallel=False` (a `--model` of the user's, which the pipeline and tensor strategies
    split only with --split / --tp-plan): the data-parallel strategies only.
    """
    n, m = nproc, microbatches
    runs: list[tuple[str, dict[str, Any], Strategy]] = [
        ("ddp", {"strategy": "ddp"}, Strategy(dp=n)),
        ("zero1", {"strategy": "zero1"}, Strategy(dp=n, zero=1)),
        ("zero2", {"strategy": "zero2"}, Strategy(dp=n, zero=2)),
        ("zero3", {"strategy": "zero3"}, Strategy(dp=n, zero=3)),
        (
            "zero2 offload cpu",
            {"strategy": "zero2", "offload": "cpu"},
            Strategy(dp=n, zero=2, offload="cpu"),
        ),
    ]
    if not model_parallel:
        return runs
    for schedule in ("gpipe", "1f1b"):
        runs.append(
            (
                f"pipeline {schedule}",
                {"strategy": "pipeline", "schedule": schedule, "microbatches": m},
                Strategy(dp=1, pp=n, microbatches=m, schedule=schedule),
            )
        )
    runs.append(("tensor", {"strategy": "tensor"}, Strategy(dp=1, tp=n)))
    if n >= 4 and n % 2 == 0:
        runs.append(
            (
                f"hybrid dp={n // 2} pp=2",
                {"strategy": "hybrid", "dp": n // 2, "tp": 1, "pp": 2, "microbatches": m},
                Strategy(dp=n // 2, pp=2, microbatches=m),
            )
        )
    return runs


Run = tuple[str, dict[str, Any], Strategy]
"""(label, config layer under the common one, the planner's strategy) of one compared run."""


def plan_run(strategy: Strategy, batch: int) -> Run:
    """The run of one `tessera plan` row: labelled with the row's name, configured with the
    values its `tessera train` command sets (`plan.commands.strategy_layer`, which that command
    is printed from), priced as the row's strategy. `batch`: the plan's global batch."""
    return strategy.name, strategy_layer(strategy, batch), strategy


def check_runs(common: dict[str, Any], runs: list[Run], nproc: int) -> None:
    """ValueError naming the first run whose config the trainer refuses on `nproc` ranks (before
    anything runs); `common` is the layer under every run's own."""
    for label, layer, _ in runs:
        try:
            build_config(common, layer).check_world_size(nproc)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from exc


@dataclass(frozen=True)
class Comparison:
    """One strategy: measured against predicted."""

    label: str
    measured_step_s: float
    predicted_step_s: float
    measured_state_bytes: float
    """Mean over ranks."""
    max_state_bytes: float
    predicted_state_bytes: float

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted_step_s / self.measured_step_s - 1

    @property
    def state_error(self) -> float:
        """(predicted - measured) / measured, model states per rank (mean over ranks)."""
        return self.predicted_state_bytes / self.measured_state_bytes - 1


def _measure(records: list[dict[str, Any]], skip: int) -> tuple[float, float, float]:
    kept = records[skip:] or records
    step = statistics.median(r["step_s"] for r in kept)
    states = [mb * 2**20 for mb in kept[-1].get("model_state_mb", [])]
    if not states:
        return step, float("nan"), float("nan")
    return step, statistics.fmean(states), max(states)


def iteration_flops(model: ModelSpec, rows: int) -> float:
    """FLOPs of one step on `rows` sequences, as the planner counts them (no recomputation)."""
    if model.is_transformer:
        return flops_per_iteration(
            rows, model.seq, model.layers, model.hidden, model.vocab, recompute=False
        )
    return model.flops_per_token() * rows * model.seq


def _time_local_steps(
    config: dict[str, Any], repeats: int, rows: int, tensor_parallel: bool
) -> tuple[int, list[float]]:
    """On one rank of `achieved_rate`'s launch: (rows per rank, seconds of each repeat) of this
    rank's share of an iteration's compute with no communication, as the trainer's step runs it
    (forward, backward, the clip to `grad_clip`), without the AdamW step: the planner prices
    that per strategy (`Cluster.optimizer_s`: DDP steps every tensor of the model, ZeRO a slice
    of a few flat buffers), so it is timed and taken out of each repeat.

    Data parallel and pipeline shares: the whole model on this rank's rows of step 0's batch, in
    passes of `rows` rows (a pipeline's micro-batch; gradients accumulate). Tensor parallel: the
    tensor engine itself on the gathered batch, its layers' collectives replaced by local
    stand-ins of the same shapes, so the rank computes its shards of every matrix and the parts
    tensor parallelism repeats on every rank (embeddings, layer norms, residuals); the engine's
    gather of the batch and the clip's one-number all-reduce stay (the trainer's step has them,
    the planner does not price them: under a millisecond here). Every repeat
    starts on a barrier (outside the timed part): repeat k of every rank ran at the same time.
    """
    import torch
    import torch.distributed as dist

    from tessera.pipeline.microbatch import batch_rows, microbatch_sizes, split_rows
    from tessera.runtime.context import init
    from tessera.strategies.batch import compute_loss
    from tessera.train.workload import build_workload

    ctx = init()  # the threads the trainer gives a rank: cores // ranks
    train_config = build_config(config)
    workload = build_workload(train_config)
    torch.manual_seed(0)
    module = workload.model_fn()
    batch = workload.batches(0, ctx.rank, ctx.world_size)
    share = batch_rows(batch)
    if tensor_parallel:
        step, optimizer = _tensor_share_without_collectives(
            config, module, workload.loss_fn, batch, ctx
        )
    else:
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        passes = split_rows(batch, microbatch_sizes(share, max(1, share // min(rows, share))))

        def step() -> None:
            for piece in passes:
                compute_loss(module, piece, workload.loss_fn).backward()
            if train_config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(module.parameters(), train_config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    in_optimizer = [0.0]  # seconds inside the optimizer's step, taken out of each repeat
    optimizer_step = optimizer.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return optimizer_step(*args, **kwargs)
        finally:
            in_optimizer[0] += time.perf_counter() - began

    optimizer.step = timed_step
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if ctx.world_size > 1:
            dist.barrier()
        in_optimizer[0] = 0.0
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began - in_optimizer[0])
    return share, times[1:]


def _tensor_share_without_collectives(
    config: dict[str, Any], module: Any, loss_fn: Any, batch: Any, ctx: Any
) -> tuple[Callable[[], None], Any]:
    """The tensor engine's step on this rank with its layers' all-reduces and all-gathers made
    local (this process only: a measuring rank, whose results nobody uses), and its optimizer."""
    import torch
    import torch.distributed as dist

    from tessera.tensor_parallel import _comm as tensor_comm
    from tessera.train.engine_setup import build_engine

    tensor_comm._all_reduce = lambda tensor, op, group: tensor
    tensor_comm._all_gather_along = lambda tensor, group, dim: torch.cat(
        [tensor] * dist.get_world_size(group), dim=dim
    )
    engine = build_engine(build_config(config, {"strategy": "tensor"}), module, loss_fn, ctx)

    def step() -> None:
        engine.train_step(batch)
        engine.step()

    return step, engine.optimizer


def achieved_rate(
    config: dict[str, Any],
    model: ModelSpec,
    nproc: int,
    repeats: int = 7,
    rows: int | None = None,
    tensor_parallel: bool = False,
) -> float:
    """FLOP/s of one of `nproc` local ranks on its share of an iteration while the others
    compute theirs beside it, with no communication (`_time_local_steps`): each on its rows of
    the global batch in passes of `rows` rows (a strategy's micro-batch; default one pass), or
    (`tensor_parallel`) its shards of the tensor-parallel model. Taken as a synchronous step
    takes it: from the slowest rank of each repeat (the median over repeats)."""
    from tessera.runtime.launch import launch

    per_pass = rows or 1 << 30
    measured = launch(_time_local_steps, nproc, config, repeats, per_pass, tensor_parallel)
    share = measured[0][0]
    return iteration_flops(model, share) / slowest_median([times for _, times in measured])


def slowest_median(per_rank: list[list[float]]) -> float:
    """The median over repeats of the slowest rank's time in each (repeat k of every rank ran
    together): what a synchronous step takes, not the mean rank's time."""
    return statistics.median(max(times) for times in zip(*per_rank, strict=True))


def compare_runs(
    base: dict[str, Any],
    *,
    nproc: int,
    steps: int,
    out: Path,
    skip: int = 2,
    only: list[str] | None = None,
    recalibrate: bool = True,
    repeats: int = 1,
    runs: list[Run] | None = None,
    probe_each_run: bool = True,
) -> list[Comparison]:
    """Run each applicable strategy (`only`: the labels to keep) and compare it with the plan.

    Why so many parameters: what runs (base, nproc, steps, the labels, or `runs`: any list,
    such as `plan_run` of each `tessera plan` row, instead of `runs_for`'s), where it goes, and
    how it is measured (skip, repeats, recalibration, probes) are each the caller's choice.

    `base` is a config layer (model shape, batch size, `--model` and `--data`, ...) under each
    strategy's own layer; every run logs each step and writes no checkpoint in between. Each
    strategy's compute is priced at the rate `achieved_rate` measures just before and just
    after its run, at its micro-batch (the machine's load drifts from minute to minute).
    `repeats` > 1 runs the whole list that many times, round-robin (a slow minute then falls on
    every strategy, not on one), and compares the medians of the measured and of the predicted
    step times. `probe_each_run=False` measures each rate (per micro-batch and kind) once, before
    its first run, and reuses it: a third of the launches, for a long list.
    """
    from tessera.train.workload import build_workload

    if repeats < 1 or steps < 1:
        raise ValueError(f"--steps and --repeats must be at least 1 (got {steps}, {repeats})")
    microbatches = int(base.get("microbatches", 4))
    common = {**base, "nproc": nproc, "steps": steps, "log_every": 1, "progress": False}
    common.update(checkpoint_every=0, sample_tokens=0)
    config = build_config(common)
    model = from_module(build_workload(config).model_fn(), seq=None)
    user_model = base.get("model_factory") is not None
    if runs is None:
        runs = runs_for(nproc, microbatches, model_parallel=not user_model)
    unknown = sorted(set(only or ()) - {label for label, _, _ in runs})
    if unknown:
        valid = ", ".join(label for label, _, _ in runs)
        raise ValueError(f"--strategies: no {unknown} on {nproc} ranks; choose from: {valid}")
    chosen = [run for run in runs if not only or run[0] in only]
    check_runs(common, chosen, nproc)
    cluster = this_machine(ranks=nproc, recalibrate=recalibrate)
    setting = _Setting(common, model, cluster, skip, None if probe_each_run else {})
    rounds: dict[str, list[Comparison]] = {label: [] for label, _, _ in chosen}
    for repeat in range(repeats):
        for label, layer, strategy in chosen:
            folder = out / label.replace(" ", "-").replace("=", "")
            folder = folder / f"repeat-{repeat + 1}" if repeats > 1 else folder
            rounds[label].append(_compare_one(label, layer, strategy, folder, setting))
    results = [_median_of(label, found) for label, found in rounds.items()]
    (out / "compare.json").write_text(
        json.dumps([r.__dict__ for r in results], indent=1, default=str)
    )
    return results


@dataclass
class _Setting:
    """What every run of a compare shares: the common layer, the model and cluster it is priced
    on, the steps left out, and the rates measured so far (None: probe around every run)."""

    common: dict[str, Any]
    model: ModelSpec
    cluster: Any
    skip: int
    rates: dict[tuple[int, bool], float] | None


def _compare_one(
    label: str, layer: dict[str, Any], strategy: Strategy, folder: Path, setting: _Setting
) -> Comparison:
    """One strategy's run against its prediction, compute priced at the rate of its micro-batch
    measured just before the run and just after it (the harmonic mean: the mean of the two
    times), so a load that drifts during the run weighs on both sides alike; with
    `setting.rates`, measured once per micro-batch and kind and reused."""
    common, model = setting.common, setting.model
    config = build_config(common, layer)
    batch = config.step_batch_size  # one optimizer step's sequences (batch_size x grad_accum)
    micro = batch // (strategy.dp * strategy.microbatches)
    tensor = layer["strategy"] == "tensor"
    nproc = int(common["nproc"])

    def probe() -> float:
        return achieved_rate(common, model, nproc, rows=micro, tensor_parallel=tensor)

    rates, key = setting.rates, (micro, tensor)
    if rates is None:
        before = probe()
    elif key not in rates:
        rates[key] = probe()
    run_training(build_config(common, layer, {"out": str(folder)}))
    rate = statistics.harmonic_mean([before, probe()]) if rates is None else rates[key]
    step, mean_states, max_states = _measure(read_metrics(folder / "metrics.jsonl"), setting.skip)
    plan = estimate(
        strategy, model, setting.cluster, batch=batch, microbatch=micro, compute_flops=rate,
        precision="fp32",
    )  # fmt: skip
    states = plan.model_state_bytes + plan.host_bytes
    if capabilities(layer["strategy"]).frees_gradients:
        states -= plan.grads
    return Comparison(label, step, plan.step_s, mean_states, max_states, states)


def _median_of(label: str, found: list[Comparison]) -> Comparison:
    """The medians of a strategy's repeats (model states do not vary between them)."""
    return Comparison(
        label,
        statistics.median(c.measured_step_s for c in found),
        statistics.median(c.predicted_step_s for c in found),
        found[0].measured_state_bytes,
        found[0].max_state_bytes,
        found[0].predicted_state_bytes,
    )


def markdown(results: list[Comparison], nproc: int) -> str:
    """The table of BENCHMARKS.md: measured, predicted, errors, and the worst of each."""
    lines = [
        "| strategy | ranks | step ms measured | predicted | error | model states MB/rank "
        "(mean, max) | predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {nproc} | {r.measured_step_s * 1e3:.1f} | "
            f"{r.predicted_step_s * 1e3:.1f} | {r.step_error:+.0%} | "
            f"{_mb(r.measured_state_bytes)}, {_mb(r.max_state_bytes)} | "
            f"{_mb(r.predicted_state_bytes)} | {_pct(r.state_error)} |"
        )
    worst_step = max(results, key=lambda r: abs(r.step_error))
    measured = [r for r in results if r.measured_state_bytes == r.measured_state_bytes]
    worst_state = max(measured or results, key=lambda r: abs(r.state_error))
    lines.append("")
    lines.append(
        f"Worst step-time error {worst_step.step_error:+.0%} ({worst_step.label}); worst "
        f"model-state error {worst_state.state_error:+.1%} ({worst_state.label})."
    )
    return "\n".join(lines)


def _mb(value: float) -> str:
    return "n/a" if value != value else f"{value / 2**20:.2f}"


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{value:+.1%}"


def plot(results: list[Comparison], path: Path, title: str) -> Path:
    """Measured and predicted step time and model states per strategy, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label for r in results]
    x = range(len(results))
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, measured, predicted, unit in (
        (time_ax, [r.measured_step_s * 1e3 for r in results],
         [r.predicted_step_s * 1e3 for r in results], "step time (ms)"),
        (mem_ax, [r.measured_state_bytes / 2**20 for r in results],
         [r.predicted_state_bytes / 2**20 for r in results], "model states per rank (MB)"),
    ):  # fmt: skip
        ax.bar([i - 0.2 for i in x], measured, width=0.4, label="measured")
        ax.bar([i + 0.2 for i in x], predicted, width=0.4, label="predicted")
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize="small")
        ax.set_ylabel(unit)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
