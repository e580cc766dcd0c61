"""`tessera train --strategy ps`: the trainer's config and tools turned into a parameter-server job.

The adapter of the parameter server, as `zero.py` or `pipeline.py` are of theirs: it reads the
config's ps options (`tessera.parameter_server.options`), builds the servers' optimizer from the
trainer's (`JobTools`) and hands the job to `tessera.parameter_server.job.run_gpt_job`, which runs
the servers and workers and writes the run folder. It is an entry point, not an `Engine` builder:
the ranks play different roles (see `tessera.parameter_server.job`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from tessera.parameter_server.job import SERVERS_FOLDER, GPTJob, run_gpt_job
from tessera.parameter_server.options import (
    PSPolicy,
    check_ps_options,
    parse_slow_workers,
    ps_policy,
)
from tessera.strategies.capabilities import Capabilities
from tessera.strategies.own_job import JobTools
from tessera.strategies.registry import declare_strategy

__all__ = ["SERVERS_FOLDER", "train_ps"]


def _server_optimizer(
    config: Any, tools: JobTools, per_gradient: bool, params: list[torch.Tensor]
) -> Any:
    """The config's optimizer over one shard, its lr set before each step from the schedule.

    Under ASP and SSP (`per_gradient`) each gradient is applied alone, as 1/W of a clock: SGD gets
    the gradient scaled by 1/W (the runtime's update rule), AdamW, whose step does not shrink with
    its gradient, gets lr/W. The count of steps lives in the param group, so it is saved and
    restored with the optimizer's state_dict (a resumed server continues the schedule where it
    stopped).
    """
    optimizer = tools.make_optimizer(config, params)
    workers = config.workers
    lr_scale = 1 / workers if per_gradient and config.optimizer == "adamw" else 1.0
    for group in optimizer.param_groups:
        group["ps_steps"] = 0

    def schedule(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            clock = group["ps_steps"] // workers if per_gradient else group["ps_steps"]
            group["lr"] = tools.lr_at(clock, config) * lr_scale
            group["ps_steps"] += 1

    optimizer.register_step_pre_hook(schedule)
    return optimizer


def train_ps(config: Any, run_dir: str | Path, resume: bool, tools: JobTools) -> dict[str, Any]:
    """Train as `config` says with a parameter server; the summary (on every rank)."""
    record = tools.config_to_dict(config)
    job = GPTJob(
        corpus=config.corpus,
        corpus_bytes=config.corpus_bytes,
        model=record["model"],
        batch_size=config.batch_size,
        seed=config.seed,
        servers=config.servers,
        workers=config.workers,
        consistency=config.consistency,
        policy=ps_policy(config.consistency, config.staleness),
        steps=config.steps,
        slow_workers=parse_slow_workers(config.slow_worker, config.workers),
        timeout_s=config.timeout_s,
        checkpoint_every=config.checkpoint_every,
        keep_checkpoints=config.keep_checkpoints,
        optimizer_fn=functools.partial(_server_optimizer, config, tools),
        record=record,
        sample=functools.partial(tools.gpt_sample, config=config),
        read_log=tools.read_metrics,
    )
    return run_gpt_job(job, run_dir, resume)


def _ps_world(config: Any, world_size: int | None) -> None:
    """The parameter server's job: servers + workers processes, whatever nproc says."""
    check_ps_options(
        servers=config.servers,
        workers=config.workers,
        consistency=config.consistency,
        staleness=config.staleness,
        slow_worker=config.slow_worker,
        batch_size=config.batch_size,
        world_size=world_size,
    )


declare_strategy(
    "ps",
    train_ps,
    policy=PSPolicy,
    own_job=True,
    capabilities=Capabilities(
        grad_accum=False,
        check_world=_ps_world,
        not_compilable="its workers run their own loop against the parameter servers",
    ),
)
