"""The reference GPT trained by S servers and W workers, its run folder written as the trainer's.

Why a job of its own and not an `Engine`: the trainer's loop runs the same step on every rank,
while here ranks play different roles (servers apply, workers compute) and under ASP they do not
even take the same number of steps at the same time. So `tessera train --strategy ps` hands the
whole job to its adapter (`tessera.strategies.ps`), which describes it as a `GPTJob` (the
trainer's optimizer, schedule, sample and log reader as callables: this layer imports no trainer)
and calls `run_gpt_job`. That calls `parameter_server.run` with the GPT and the corpus and writes
the run folder as the other strategies do (config.yaml, checkpoint.pt, metrics.jsonl, loss.png,
sample.txt) plus `metrics.png` (staleness histogram, rates per worker).

"The same way" as the other strategies: worker w's batch of its step-th update is the w-th of W
slices of the global batch of that step, so under BSP one clock is one synchronous data-parallel
step of `batch_size` sequences. `steps` is the number of updates of each worker. The learning
rate follows the config's schedule by the server's clock (`GPTJob.optimizer_fn`); under ASP and
SSP each gradient is applied alone, as 1/W of a clock: SGD gets the gradient scaled by 1/W (the
runtime's update rule), AdamW, whose step does not shrink with its gradient, gets lr/W. Not
applied: `grad_clip` (a worker would clip its own slice's gradient, which is not the clipping of
the mean; said in the config's help).

Checkpoints: the servers write their shards to `RUN/servers/` every `checkpoint_every` clocks
(under ASP/SSP every `checkpoint_every` x W applied gradients) and at the end, keeping the
`keep_checkpoints` newest versions common to all servers (and any newer file); `checkpoint.pt`
records the run (tokenizer, config, the step reached and, at the end, the assembled weights).
`--resume RUN` restarts from the newest shard version every server holds.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.files import save_checkpoint
from tessera.data import CharTokenizer, LMBatches, load_corpus
from tessera.errors import ConfigError
from tessera.models import GPT, GPTConfig
from tessera.parameter_server.api import run
from tessera.parameter_server.checkpoint import latest_common_version
from tessera.parameter_server.metrics import staleness_histogram, write_metrics
from tessera.parameter_server.policy import ConsistencyPolicy, aggregates
from tessera.parameter_server.result import PSResult

__all__ = ["SERVERS_FOLDER", "GPTJob", "run_gpt_job"]

SERVERS_FOLDER = "servers"
"""Sub-folder of the run folder holding the servers' shard checkpoints."""

CHECKPOINT_NAME = "checkpoint.pt"
"""The run's own state file (tokenizer, config, final weights), one per run folder: the single-file
layout that `tessera.checkpoint.series` still reads, so `--resume` finds it; the training
state itself lives in the servers' shard checkpoints."""


# --- what every process builds (module-level, so the spawned processes can unpickle them) -------
def _gpt(model_config: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(model_config)


@functools.lru_cache(maxsize=2)
def _batches(
    corpus: str, corpus_bytes: int, block_size: int, batch_size: int, seed: int
) -> LMBatches:
    """The run's batch stream, built once per process."""
    text = load_corpus(corpus, max_bytes=corpus_bytes)
    tokens = CharTokenizer.from_text(text).encode_tensor(text)
    return LMBatches(tokens, block_size=block_size, global_batch_size=batch_size, seed=seed)


def _worker_batch(
    source: tuple, num_workers: int, worker: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _batches(*source).batch(step, worker, num_workers)


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- the job ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTJob:
    """One run: the data, the GPT's shape, the servers' and workers' settings, and what the
    trainer lends (its optimizer by clock, its sample, its log reader, the config as plain data).

    Why so many fields: it is the whole of a `tessera train --strategy ps` run, named field by
    field so that this layer reads no trainer config.
    """

    corpus: str
    corpus_bytes: int
    model: dict[str, Any]
    """`GPTConfig` keywords but the vocabulary (the corpus gives it)."""
    batch_size: int
    seed: int
    servers: int
    workers: int
    consistency: str
    """As the user named it (the plot's title); `policy` is what it means."""
    policy: ConsistencyPolicy
    steps: int
    slow_workers: dict[int, float]
    timeout_s: float
    checkpoint_every: int
    keep_checkpoints: int
    optimizer_fn: Callable[[bool, list[torch.Tensor]], torch.optim.Optimizer]
    """(one gradient per step, not one clock, params) -> the server's optimizer; picklable."""
    record: dict[str, Any]
    """The config as plain data, kept in checkpoint.pt."""
    sample: Callable[[dict[str, torch.Tensor], GPTConfig, CharTokenizer], str]
    read_log: Callable[[Path], list[dict[str, Any]]]
    """The step records of an earlier run's metrics.jsonl (a resume merges them)."""


def run_gpt_job(job: GPTJob, run_dir: str | Path, resume: bool) -> dict[str, Any]:
    """Train `job` with a parameter server; the summary (on every rank)."""
    out = Path(run_dir)
    main = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank gets here
    servers_dir = out / SERVERS_FOLDER
    if (
        not resume
        and servers_dir.exists()
        and latest_common_version(servers_dir, job.servers) is not None
    ):
        raise ConfigError(
            f"{servers_dir} holds the server checkpoints of an earlier run; "
            f"continue it with --resume {out} or choose another --out"
        )
    text = load_corpus(job.corpus, max_bytes=job.corpus_bytes)
    tokenizer = CharTokenizer.from_text(text)
    model_config = GPTConfig(vocab_size=tokenizer.vocab_size, **job.model)
    source = (job.corpus, job.corpus_bytes, job.model["block_size"], job.batch_size, job.seed)
    record = {
        "tokenizer": tokenizer.to_dict(),
        "config": job.record,
        "parameter_server": SERVERS_FOLDER,
    }
    started = time.perf_counter()
    if main and not resume:  # a crash from here on can be resumed from the server checkpoints
        save_checkpoint(out / CHECKPOINT_NAME, {"step": 0, "engine": None, **record})
    result = run(
        functools.partial(_gpt, model_config, job.seed),
        _next_token_loss,
        functools.partial(_worker_batch, source, job.workers),
        optimizer_fn=functools.partial(job.optimizer_fn, not aggregates(job.policy)),
        num_servers=job.servers,
        num_workers=job.workers,
        consistency=job.policy,
        steps=job.steps,
        slow_workers=job.slow_workers,
        timeout_s=job.timeout_s,
        checkpoint_dir=servers_dir,
        checkpoint_every=job.checkpoint_every,
        keep_checkpoints=job.keep_checkpoints,
    )
    wall_s = time.perf_counter() - started
    if not main:
        return _summary(out, job, result, result.log, wall_s, "")
    log = _merge_earlier_log(job, out / "metrics.jsonl", result.log) if resume else result.log
    full = PSResult(**{**result.__dict__, "log": log})
    write_metrics(full, out)
    _plot_loss(
        full,
        out / "loss.png",
        f"ps: {job.servers} server(s), {job.workers} workers, {job.consistency}",
    )
    weights = _full_state_dict(_gpt(model_config, job.seed), result.state_dict)
    step = _completed_clock(log, job.workers, result.dropped_workers)
    save_checkpoint(out / CHECKPOINT_NAME, {"step": step, "engine": {"model": weights}, **record})
    sample = job.sample(weights, model_config, tokenizer)
    (out / "sample.txt").write_text(sample)
    return _summary(out, job, result, log, wall_s, sample)


def _full_state_dict(
    model: torch.nn.Module, parameters: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's state dict from the servers' parameters: a tied weight (the GPT's lm_head is
    its embedding) is served once, under its first name, and appears here under both."""
    missing, unexpected = model.load_state_dict(parameters, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(parameters)
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"the servers' parameters do not fit the model: missing "
            f"{sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _completed_clock(log: list[dict[str, Any]], workers: int, dropped: list[int]) -> int:
    """Updates completed by every live worker."""
    done = [
        1 + max((r["clock"] for r in log if r["worker"] == w), default=-1)
        for w in range(workers)
        if w not in dropped
    ]
    return min(done, default=0)


def _merge_earlier_log(job: GPTJob, path: Path, log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A resumed run's log preceded by the earlier run's gradients it did not redo."""
    redone = {(r["worker"], r["clock"]) for r in log}
    earlier = [
        {k: v for k, v in r.items() if k != "kind"}
        for r in job.read_log(path)
        if r.get("kind") == "gradient" and (r["worker"], r["clock"]) not in redone
    ]
    return sorted(earlier, key=lambda r: r["time"]) + log


def _plot_loss(result: PSResult, path: Path, title: str) -> None:
    """Each worker's mini-batch loss against wall time since the first applied gradient."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    start = min((r["time"] for r in result.log), default=0.0)
    for worker in sorted({r["worker"] for r in result.log}):
        mine = [r for r in result.log if r["worker"] == worker]
        ax.plot(
            [r["time"] - start for r in mine],
            [r["loss"] for r in mine],
            lw=1,
            label=f"worker {worker}",
        )
    ax.set(xlabel="wall time (s)", ylabel="loss (nats per character)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _summary(
    out: Path, job: GPTJob, result: PSResult, log: list[dict[str, Any]], wall_s: float, sample: str
) -> dict[str, Any]:
    window = max(1, job.workers)  # the first and last clock's worth of gradients
    losses = [r["loss"] for r in log]
    rates = [r for r in result.updates_per_s if not math.isnan(r)]
    histogram = staleness_histogram(result)
    summary = {
        "run_dir": str(out),
        "strategy": "ps",
        "world_size": job.servers + job.workers,
        "steps": job.steps,
        "first_loss": statistics.fmean(losses[:window]),
        "final_loss": statistics.fmean(losses[-window:]),
        "updates_per_s": sum(rates),
        "worker_updates_per_s": result.updates_per_s,
        "worker_wait_s": result.wait_s,
        "staleness_histogram": histogram,
        "dropped_workers": result.dropped_workers,
        "wall_s": wall_s,
        "sample": sample,
    }
    per_worker = ", ".join(
        "dropped" if math.isnan(u) else f"{u:.1f}/s, waited {w:.1f} s"
        for u, w in zip(result.updates_per_s, result.wait_s)
    )
    summary["rows"] = [
        (
            "servers / workers / consistency",
            f"{job.servers} / {job.workers} / {job.policy}",
        ),
        ("updates per worker", str(job.steps)),
        (
            "loss (first -> last clock)",
            f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}",
        ),
        ("total updates/s", f"{summary['updates_per_s']:.1f}"),
        ("per worker", per_worker),
        ("staleness (value: gradients)", ", ".join(f"{k}: {v}" for k, v in histogram.items())),
        ("wall time", f"{wall_s:.1f} s"),
        ("run folder", str(out)),
    ]
    return summary
