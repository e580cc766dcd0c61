"""One worker: pull the parameters from every shard, compute a gradient, push it to every shard.

Pulls and pushes go to all S servers at once (asynchronous RPCs, then one wait), so a step's
communication takes about as long as the largest shard's, not the sum. A background thread sends
heartbeats, so a worker computing a long step is not mistaken for a dead one; a worker whose only
calls are heartbeats for 2 x `timeout_s` is taken for hung (`server.HANG_FACTOR`), so one step
must take less than that.

A resumed worker starts from the smallest of its clocks over the servers: under ASP and SSP the
servers saved their shards at different moments, and a server that is behind must still receive
the gradients in between (the others skip those they applied already).

A worker listed in `slow_workers` with factor f sleeps (f - 1) times its compute time (data,
forward, backward) after each compute: the straggler of the benchmarks and tests, on purpose.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.parameter_server.sharding import ShardPlan
from tessera.parameter_server.transport import Transport

__all__ = ["WorkerStats", "run_worker"]


@dataclass(frozen=True)
class WorkerStats:
    """What one worker measured."""

    worker: int
    updates: int
    updates_per_s: float
    wait_s: float
    """Time spent in pulls and pushes (communication plus waiting for the policy)."""
    compute_s: float
    pull_s: float = 0.0
    """Of `wait_s`, the pulls (held back by the policy included)."""
    push_s: float = 0.0
    """Of `wait_s`, the pushes (a server applies the gradient before it answers)."""
    sleep_s: float = 0.0
    """Time slept on purpose as a slow worker."""


class _Heartbeat:
    """Sends `heartbeat` to every server every `period_s` until stopped."""

    def __init__(self, transport: Transport, worker: int, num_servers: int, period_s: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(transport, worker, num_servers, period_s), daemon=True
        )
        self._thread.start()

    def _run(self, transport: Transport, worker: int, num_servers: int, period_s: float) -> None:
        while not self._stop.wait(period_s):
            for server in range(num_servers):
                try:
                    transport.call_async(server, "heartbeat", worker)
                except Exception:  # noqa: BLE001 - a missed beat is reported by the server's timeout
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_worker(
    *,
    transport: Transport,
    worker: int,
    model: nn.Module,
    plan: ShardPlan,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    data_fn: Callable[[int, int], tuple[Any, torch.Tensor]],
    steps: int,
    slow_factor: float,
    heartbeat_s: float,
) -> WorkerStats:
    """Perform updates (pull, compute, push) as worker `worker` until its clock reaches `steps`."""
    servers = range(plan.num_servers)
    params = list(model.parameters())
    pull_s = push_s = compute_s = sleep_s = 0.0
    # > 0 when resuming from checkpoints; under ASP/SSP the servers may differ: the smallest.
    first_step = min(
        transport.wait(
            [(s, "start_clock", transport.call_async(s, "start_clock", worker)) for s in servers]
        )
    )
    heartbeat = _Heartbeat(transport, worker, plan.num_servers, heartbeat_s)
    started = time.perf_counter()
    try:
        for step in range(first_step, steps):
            t0 = time.perf_counter()
            calls = [(s, "pull", transport.call_async(s, "pull", worker, step)) for s in servers]
            for server, pieces in zip(servers, transport.wait(calls), strict=True):
                plan.scatter(server, pieces, params)
            t1 = time.perf_counter()
            inputs, targets = data_fn(worker, step)
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            t2 = time.perf_counter()
            t3 = t2
            if slow_factor > 1:
                time.sleep((slow_factor - 1) * (t2 - t1))
                t3 = time.perf_counter()
            calls = [
                (
                    s,
                    "push",
                    transport.call_async(
                        s, "push", worker, step, plan.gather(s, grads), float(loss.detach())
                    ),
                )
                for s in servers
            ]
            transport.wait(calls)
            pull_s += t1 - t0
            compute_s += t2 - t1
            sleep_s += t3 - t2
            push_s += time.perf_counter() - t3
        elapsed = time.perf_counter() - started
        updates = max(0, steps - first_step)
        stats = WorkerStats(
            worker,
            updates,
            updates / elapsed if elapsed > 0 else 0.0,
            pull_s + push_s,
            compute_s,
            pull_s,
            push_s,
            sleep_s,
        )
        calls = [(s, "finish", transport.call_async(s, "finish", worker, stats)) for s in servers]
        transport.wait(calls)
    finally:
        heartbeat.stop()
    return stats
