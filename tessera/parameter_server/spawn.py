"""Start the S + W local processes of a run and wait for the coordinator's result.

Why not `tessera.launch`: it treats any rank that dies as the end of the run and stops the others,
which is right for collectives (the survivors would hang) but wrong here: under ASP and SSP a dead
worker is dropped by the servers and training goes on. This launcher gives each process the same
environment (RANK, WORLD_SIZE, a FileStore rendezvous file in a folder only this user can read,
so no TCP port to pick; TensorPipe's listeners on loopback only, so no other machine can reach
them) and reports:

- an exception on any server, or on any worker under BSP: `RankFailedError` naming the process
  (`server-S` / `worker-W`) with its traceback, after which the others are stopped;
- a worker that raised or died under ASP/SSP: recorded, the run continues; the servers drop it;
- a server dying silently, or any worker dying silently under BSP: `RankFailedError` naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from tessera.errors import RankFailedError
from tessera.parameter_server.transport import peer_name
from tessera.runtime.launch import decode_result, encode_result, process_context, stop_processes

__all__ = ["spawn_local"]

_POLL_S = 0.2
LOOPBACK_ENV = "TP_SOCKET_IFNAME"
"""TensorPipe's choice of network interface; a local run sets it to loopback."""
_GRACE_S = 1.0


def _child(entry: Callable[..., Any], config: Any, rank: int, world_size: int, init_file: str,
           environment: dict[str, str], results: mp.Queue) -> None:
    # A forkserver child starts with the server's environment: give it the caller's, as it is now.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), TESSERA_PS_INIT_FILE=init_file)
    # Every peer is on this machine: TensorPipe listens on loopback only, not on the interface
    # the host name resolves to (or one TP_SOCKET_IFNAME names), so no other machine can connect.
    os.environ[LOOPBACK_ENV] = "lo"
    name = peer_name(rank, config.num_servers)
    try:
        value = entry(config, rank, world_size, f"file://{init_file}")
        # Bytes, not tensors: a queued tensor is a shared-memory handle that dies with this process.
        results.put(("ok", rank, encode_result(value) if rank == 0 else None, ""))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", rank, f"{name}: {type(exc).__name__}: {exc}", traceback.format_exc()))


def spawn_local(entry: Callable[..., Any], config: Any, *, tolerate_worker_loss: bool) -> Any:
    """Run `entry(config, rank, world_size, init_method)` on S + W processes; rank 0's value.

    Returns `(value, worker_failures)`, the second a list of `(worker, message)` for workers that
    failed while `tolerate_worker_loss` let the run go on.
    """
    world_size = config.num_servers + config.num_workers
    context = process_context()  # a forkserver that imported torch and tessera once
    results: mp.Queue = context.Queue()
    store_dir = tempfile.mkdtemp(prefix="tessera-ps-")
    init_file = os.path.join(store_dir, "rpc-store")
    environment = dict(os.environ)
    processes = [
        context.Process(
            target=_child,
            args=(entry, config, r, world_size, init_file, environment, results),
            name=f"tessera-ps-{peer_name(r, config.num_servers)}",
        )
        for r in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, config.num_servers, tolerate_worker_loss)
    finally:
        stop_processes(processes)
        shutil.rmtree(store_dir, ignore_errors=True)


def _collect(processes: list[mp.Process], results: mp.Queue, num_servers: int,
             tolerate_worker_loss: bool) -> tuple[Any, list[tuple[int, str]]]:
    reported: set[int] = set()
    worker_failures: list[tuple[int, str]] = []
    exited_at: dict[int, float] = {}  # rank -> when its exit was first seen without a message
    while True:
        try:
            kind, rank, payload, remote_traceback = results.get(timeout=_POLL_S)
        except queue_module.Empty:
            for rank in _silent_deaths(processes, reported, exited_at):
                text = (f"{peer_name(rank, num_servers)}: process exited with code "
                        f"{processes[rank].exitcode} without reporting")
                if rank >= num_servers and tolerate_worker_loss:
                    reported.add(rank)
                    worker_failures.append((rank - num_servers, text))
                else:
                    raise RankFailedError(rank, text) from None
            continue
        reported.add(rank)
        if kind == "ok":
            if rank == 0:
                return decode_result(payload), worker_failures
            continue
        if rank >= num_servers and tolerate_worker_loss:
            worker_failures.append((rank - num_servers, payload))
            continue
        raise RankFailedError(rank, payload, remote_traceback)


def _silent_deaths(processes: list[mp.Process], reported: set[int],
                   exited_at: dict[int, float]) -> list[int]:
    """Ranks whose process ended over `_GRACE_S` ago without a message.

    A process's last message can still be in the pipe when its exit is seen, hence the grace.
    """
    now = time.monotonic()
    silent = []
    for rank, process in enumerate(processes):
        if rank in reported or process.exitcode is None:
            continue
        if now - exited_at.setdefault(rank, now) > _GRACE_S:
            silent.append(rank)
    return silent
