"""`run`: train a model with a parameter server (S servers, W workers) under BSP, ASP or SSP.

The centralized architecture: the parameters live on the servers, sharded by bytes; workers pull
them, compute a gradient on their mini-batch and push it; the servers apply the optimizer on their
shard. Li et al., "Scaling Distributed Machine Learning with the Parameter Server" (OSDI 2014);
the consistency models and the update rule are described in `policy` and `server`.

Processes: from a plain Python process `run` spawns S + W local processes (ranks 0..S-1 servers,
then the workers) and returns on the caller; under `torchrun` / `tessera run` / `tessera.launch`
(RANK and WORLD_SIZE set) it uses the world, which must hold exactly S + W processes, and returns
the same `PSResult` on every rank.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.parameter_server.checkpoint import load_shard, resume_version
from tessera.parameter_server.coordinator import Coordinator, fetch_result
from tessera.parameter_server.policy import ConsistencyPolicy, aggregates, resolve_policy
from tessera.parameter_server.result import PSResult
from tessera.parameter_server.server import ShardServer
from tessera.parameter_server.sharding import plan_shards
from tessera.parameter_server.spawn import spawn_local
from tessera.parameter_server.transport import Transport, serve
from tessera.parameter_server.worker import run_worker

__all__ = ["DEFAULT_TIMEOUT_S", "TOKEN_ENV", "run"]

DEFAULT_TIMEOUT_S = 60.0
"""A worker silent this long is lost; every wait is bounded by a small multiple of it, except a
finished worker's wait for the run's result, which lasts while the others train (each poll of it
bounded, so a dead coordinator is an error)."""
TOKEN_ENV = "TESSERA_PS_TOKEN"
"""Environment variable holding the run token when `run` gets none (a guard against a worker of
another run joining by mistake; not a security boundary: the RPC world must be trusted)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _RunConfig:
    """Everything every process needs; pickled to spawned processes. Checked when made (a
    `ConfigError` naming the first bad argument of `run`), before anything starts."""

    model_fn: Callable[[], nn.Module]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    data_fn: Callable[[int, int], tuple[Any, torch.Tensor]]
    optimizer_fn: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    num_servers: int
    num_workers: int
    policy: ConsistencyPolicy
    steps: int
    slow_workers: dict[int, float] = field(default_factory=dict)
    token: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        for name in ("model_fn", "loss_fn", "data_fn"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be callable, got {getattr(self, name)!r}")
        for name in ("num_servers", "num_workers", "steps"):
            count = getattr(self, name)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"{name} must be a positive integer, got {count!r}")
        for worker, factor in self.slow_workers.items():
            if not (isinstance(worker, int) and 0 <= worker < self.num_workers):
                raise ConfigError(
                    f"slow_workers names worker {worker!r}; workers are 0..{self.num_workers - 1}"
                )
            if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1):
                raise ConfigError(f"slow_workers[{worker}] must be a factor >= 1, got {factor!r}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s!r}")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))  # frozen: set once here
        every, keep = self.checkpoint_every, self.keep_checkpoints
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"checkpoint_every must be an integer >= 0, got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep_checkpoints must be an integer >= 1, got {keep!r}")


def run(
    model_fn: Callable[[], nn.Module],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    data_fn: Callable[[int, int], tuple[Any, torch.Tensor]],
    *,
    optimizer_fn: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    lr: float = 0.1,
    num_servers: int = 1,
    num_workers: int = 2,
    consistency: str | ConsistencyPolicy = "bsp",
    steps: int = 100,
    slow_workers: dict[int, float] | None = None,
    token: str | None = None,
    timeout_s: float | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 2,
) -> PSResult:
    """Train `model_fn()` for `steps` updates per worker; the final parameters and the log.

    `model_fn()` must build the same model on every process (seed inside it); `data_fn(worker,
    step) -> (inputs, targets)`; `optimizer_fn(params)` runs on each server over its shard
    (default `SGD(lr=lr)`). All must be module-level functions (they are pickled). `consistency`
    is "bsp", "asp", "ssp" (= `SSP(2)`) or `BSP()`, `ASP()`, `SSP(staleness=K)`. `slow_workers
    ={worker: factor}` makes workers `factor` times slower. `token` (else $TESSERA_PS_TOKEN, else a
    fresh random one when spawning): the servers serve only workers of the same token, so a worker
    of another run started on the same rendezvous is refused. It is no security boundary: any
    process in the RPC world can run code on a server (see `transport`), so the world must be a
    trusted network; spawned locally it listens on loopback only. `timeout_s` (default 60): a
    worker silent this long, or making no call but heartbeats for 2x it (hung), is lost (error
    naming it and its last call under BSP, dropped under ASP/SSP); a read held back by the policy
    fails after 2x it; so one step of the slowest worker must take less than 2x it.
    `checkpoint_dir`: servers save their shards there (if `checkpoint_every` > 0, every that many
    clocks under BSP and every that many x W applied gradients under ASP/SSP; in every mode at the
    end) and a run finding checkpoints there resumes from them: each worker continues from its
    smallest saved clock over the servers up to `steps` (see `checkpoint` for how ASP's unaligned
    shards resume exactly). Each server keeps its files from the `keep_checkpoints`-th newest
    version common to all servers on, so a crash at any moment leaves a version to resume from.

    Why so many parameters: the three functions that define the job, then its knobs as keywords
    with one default each (the trainer's `--strategy ps` passes them by name); they are checked
    together, before anything is spawned, and travel to every process as one `_RunConfig`.
    """
    config = _RunConfig(
        model_fn,
        loss_fn,
        data_fn,
        _optimizer_fn(optimizer_fn, lr),
        num_servers,
        num_workers,
        resolve_policy(consistency),
        steps,
        dict(slow_workers or {}),
        timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
        checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
    )
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != num_servers + num_workers:
            raise ConfigError(
                f"num_servers + num_workers = {num_servers} + {num_workers} = "
                f"{num_servers + num_workers} must equal the world size {world_size}"
            )
        if token is None:
            _log.warning(
                "parameter server without a token: a worker of another run joining this "
                "rendezvous would be served; set %s to tell runs apart (this is no "
                "security boundary: the RPC world must be a trusted network)",
                TOKEN_ENV,
            )
        config = replace(config, token=token or "")
        return _rank_main(config, int(os.environ["RANK"]), world_size, _world_init_method())
    plan_shards(model_fn(), num_servers)  # too many servers for the model: fail before spawning
    config = replace(config, token=token if token is not None else secrets.token_hex(16))
    result, failures = spawn_local(
        _rank_main, config, tolerate_worker_loss=not aggregates(config.policy)
    )
    result.events.extend(
        {"event": "worker_failed", "worker": w, "error": text} for w, text in failures
    )
    return result


def _optimizer_fn(
    optimizer_fn: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None, lr: float
) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """`optimizer_fn`, else SGD at `lr` (checked: a positive number)."""
    if optimizer_fn is not None:
        return optimizer_fn
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"lr must be a positive number, got {lr!r}")
    return functools.partial(torch.optim.SGD, lr=lr)


def _world_init_method() -> str:
    init_file = os.environ.get("TESSERA_INIT_FILE")
    # A file of its own: the default process group may already use TESSERA_INIT_FILE.
    return f"file://{init_file}.ps-rpc" if init_file else "env://"


def _rank_main(config: _RunConfig, rank: int, world_size: int, init_method: str) -> PSResult:
    """One process of the run: server `rank` if rank < S, else worker `rank - S`."""
    torch.set_num_threads(1)  # S + W processes share the machine's cores
    model = config.model_fn()
    plan = plan_shards(model, config.num_servers)
    params = list(model.parameters())
    coordinator = None
    if rank < config.num_servers:
        server = ShardServer(
            server=rank,
            pieces=plan.gather(rank, params),
            optimizer_fn=config.optimizer_fn,
            policy=config.policy,
            num_workers=config.num_workers,
            timeout_s=config.timeout_s,
            layout=[(p.name, p.start, p.stop) for p in plan.shards[rank]],
            checkpoint_dir=config.checkpoint_dir,
            checkpoint_every=config.checkpoint_every,
            num_servers=config.num_servers,
            keep_checkpoints=config.keep_checkpoints,
        )
        if config.checkpoint_dir is not None:
            version = resume_version(config.checkpoint_dir, config.num_servers, rank)
            if version is not None:
                server.restore(load_shard(config.checkpoint_dir, rank, version, server.layout))
        coordinator = Coordinator(server, plan, config.num_servers) if rank == 0 else None
        serve(coordinator or server)  # before joining: peers may call as soon as all joined
    transport = Transport(
        rank=rank,
        world_size=world_size,
        num_servers=config.num_servers,
        init_method=init_method,
        token=config.token,
        rpc_timeout_s=3 * config.timeout_s,
    )
    try:
        if coordinator is not None:
            return coordinator.conclude(transport, config.timeout_s)
        if rank >= config.num_servers:
            worker = rank - config.num_servers
            run_worker(
                transport=transport,
                worker=worker,
                model=model,
                plan=plan,
                loss_fn=config.loss_fn,
                data_fn=config.data_fn,
                steps=config.steps,
                slow_factor=config.slow_workers.get(worker, 1.0),
                heartbeat_s=config.timeout_s / 4,
            )
        return fetch_result(transport, config.timeout_s)
    finally:
        transport.shutdown()
