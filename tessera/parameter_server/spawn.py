"""Start the S + W local processes of a run and wait for the coordinator's result.

The processes come from the runtime's rank spawner (`tessera.runtime.spawner`: a FileStore
rendezvous file in a folder only this user can read, so no TCP port to pick; one process per rank
with the caller's environment; silent deaths noticed; everything stopped at the end). What is the
parameter server's own is here:

- each process runs `entry(config, rank, world_size, init_method)` as server `rank` (rank < S)
  or worker `rank - S`, its store in TESSERA_PS_INIT_FILE (not TESSERA_INIT_FILE: these
  processes join an RPC world, not tessera's process group);
- TensorPipe's listeners on loopback only (TP_SOCKET_IFNAME=lo), so no other machine can reach
  them;
- the result policy, `CoordinatorResult`. Not `launch`'s, which treats any rank that dies as the
  end of the run, right for collectives (the survivors would hang) but wrong here: under ASP and
  SSP a dead worker is dropped by the servers and training goes on. So:
  - an exception on any server, or on any worker under BSP: `RankFailedError` naming the process
    (`server-S` / `worker-W`) with its traceback, after which the others are stopped;
  - a worker that raised or died under ASP/SSP: recorded, the run continues; the servers drop it;
  - a server dying silently, or any worker dying silently under BSP: `RankFailedError` naming it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tessera.errors import RankFailedError
from tessera.parameter_server.transport import peer_name
from tessera.runtime.spawner import ResultPolicy, spawn_ranks

__all__ = ["CoordinatorResult", "spawn_local"]

LOOPBACK_ENV = "TP_SOCKET_IFNAME"
"""TensorPipe's choice of network interface; a local run sets it to loopback."""
INIT_FILE_ENV = "TESSERA_PS_INIT_FILE"
"""Where each process finds the rendezvous store's path."""


def spawn_local(entry: Callable[..., Any], config: Any, *, tolerate_worker_loss: bool) -> Any:
    """Run `entry(config, rank, world_size, init_method)` on S + W processes; rank 0's value.

    Returns `(value, worker_failures)`, the second a list of `(worker, message)` for workers that
    failed while `tolerate_worker_loss` let the run go on.
    """
    world_size = config.num_servers + config.num_workers
    # Every peer is on this machine: TensorPipe listens on loopback only, not on the interface
    # the host name resolves to (or one TP_SOCKET_IFNAME names), so no other machine can connect.
    return spawn_ranks(
        _process,
        world_size,
        (entry, config),
        CoordinatorResult(config.num_servers, tolerate_worker_loss),
        env={LOOPBACK_ENV: "lo"},
        init_file_variable=INIT_FILE_ENV,
        label="ps",
    )


def _process(entry: Callable[..., Any], config: Any) -> Any:
    """One process of the run; only the coordinator's (rank 0's) result travels back."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    value = entry(config, rank, world_size, f"file://{os.environ[INIT_FILE_ENV]}")
    return value if rank == 0 else None


class CoordinatorResult(ResultPolicy):
    """Rank 0's value and the workers lost on the way; any other failure ends the run."""

    def __init__(self, num_servers: int, tolerate_worker_loss: bool) -> None:
        self.num_servers = num_servers
        self.tolerate_worker_loss = tolerate_worker_loss
        self.value: Any = None
        self.worker_failures: list[tuple[int, str]] = []

    def on_value(self, rank: int, value: Any) -> bool:
        """Over when the coordinator (rank 0) has returned."""
        if rank == 0:
            self.value = value
        return rank == 0

    def on_error(self, rank: int, message: str, remote_traceback: str) -> bool:
        """A worker lost under ASP/SSP is recorded; anything else raises `RankFailedError`."""
        self._fail(rank, f"{peer_name(rank, self.num_servers)}: {message}", remote_traceback)
        return False

    def on_exit(self, rank: int, exitcode: int) -> bool:
        """As `on_error`, for a process that died without a word."""
        name = peer_name(rank, self.num_servers)
        self._fail(rank, f"{name}: process exited with code {exitcode} without reporting", "")
        return False

    def _fail(self, rank: int, text: str, remote_traceback: str) -> None:
        if rank >= self.num_servers and self.tolerate_worker_loss:
            self.worker_failures.append((rank - self.num_servers, text))
            return
        raise RankFailedError(rank, text, remote_traceback)

    def result(self, unreported: dict[int, int | None]) -> tuple[Any, list[tuple[int, str]]]:
        """`(rank 0's value, [(worker, message), ...])`; the other processes are stopped."""
        return self.value, self.worker_failures
