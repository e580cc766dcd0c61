"""Run a function on N local ranks: the launcher of tests, notebooks and `tessera train`.

Each rank is a fresh process (forked from a forkserver that has only imported torch and tessera,
or spawned: nothing of the parent's threads or CUDA state is inherited) with the parent's
environment plus what `torchrun` would give it, and TESSERA_INIT_FILE, a FileStore
path for rendezvous: no TCP port to pick, so parallel runs cannot collide. The function calls
`tessera.init()` itself, exactly as it would under `torchrun`. The processes come from the one
rank spawner (`tessera.runtime.spawner`); this module is its policy for collectives.

Failure handling is the point of this module. A rank that raises sends its traceback to the
parent; the parent then stops the other ranks (which are usually blocked in a collective waiting
for the failed one) and raises `RankFailedError` naming the rank. A rank that dies without a word
(killed, segfault) is reported by its exit code. Two bounds, never confused: `timeout_s` means
what it means everywhere in tessera, the bound of each blocking wait between ranks (handed to
every rank, where `tessera.init()` reads it); `deadline_s`, off unless asked, bounds the whole
run: past it every rank is stopped and `LaunchTimeout` names the ranks that had not finished.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from tessera.errors import LaunchTimeout, RankFailedError
from tessera.runtime.context import TIMEOUT_VARIABLE
from tessera.runtime.devices import BACKEND_ENV, check_visible_gpus
from tessera.runtime.spawner import ResultPolicy, process_context, spawn_ranks

__all__ = ["launch", "process_context"]

_GRACE_S = 1.0  # after a failure, how long other ranks may still report before they are stopped


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    timeout_s: float | None = None,
    deadline_s: float | None = None,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run `fn(*args)` on `nproc` local ranks and return their return values, in rank order.

    With the default `start_method="forkserver"` (`"spawn"` where the platform lacks it), ranks
    are forked from a server process that has imported torch and tessera once, so a launch (a
    test, a restart after a failure) starts in a fraction of a second instead of paying the
    import of torch per rank; nothing of this process's threads or state is inherited. `fn` must
    be importable by name, as with `"spawn"` (a module-level function of a module, or of a script
    with an `if __name__ == "__main__":` guard). In a notebook, where functions are not
    importable, pass `start_method="fork"` (Linux, macOS): ranks then inherit `fn` from this
    process.
    `env` adds environment variables to every rank. `timeout_s` bounds each blocking wait of the
    ranks (a collective, a receive; None: the ranks' default, `tessera.runtime.default_timeout_s`),
    exactly as `tessera.init(timeout_s=...)` would; a wait past it raises `CollectiveTimeout` in
    the rank, naming it and the operation. `deadline_s` bounds the whole run (None, the default:
    a run may take as long as it needs). Raises `RankFailedError` for the first rank that raised
    (its traceback included) and `LaunchTimeout` past `deadline_s` seconds.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    for name, value in (("timeout_s", timeout_s), ("deadline_s", deadline_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be spawn, fork or forkserver, got {start_method!r}")
    environment = dict(env or {})
    check_visible_gpus(nproc, environment.get(BACKEND_ENV))  # NCCL: a GPU per rank, else refused
    if timeout_s is not None:  # what `tessera.init()` reads in each rank
        environment[TIMEOUT_VARIABLE] = str(float(timeout_s))
    policy = EveryRank(nproc, deadline_s)
    return spawn_ranks(fn, nproc, args, policy, env=environment, start_method=start_method)


class EveryRank(ResultPolicy):
    """Every rank's value, in rank order; the first failure ends the run.

    After a rank fails the others are usually blocked in a collective waiting for it: they get
    `_GRACE_S` more to report (their own failures name the peer they lost), then are stopped.
    """

    def __init__(self, nproc: int, deadline_s: float | None) -> None:
        self.nproc = nproc
        self.deadline_s = deadline_s
        self.deadline = math.inf if deadline_s is None else time.monotonic() + deadline_s
        self.values: dict[int, Any] = {}
        self.failures: list[tuple[int, str, str]] = []

    def on_value(self, rank: int, value: Any) -> bool:
        """Keep the value; over once every rank has reported."""
        self.values[rank] = value
        return len(self.values) + len(self.failures) == self.nproc

    def on_error(self, rank: int, message: str, remote_traceback: str) -> bool:
        """Record the failure; the others get `_GRACE_S` to report theirs."""
        self.failures.append((rank, message, remote_traceback))
        self.deadline = min(self.deadline, time.monotonic() + _GRACE_S)
        return len(self.values) + len(self.failures) == self.nproc

    def on_exit(self, rank: int, exitcode: int) -> bool:
        """A silent death ends the run at once: it is the likely cause of what follows."""
        self.failures.append((rank, _silent(exitcode), ""))
        return True

    def result(self, unreported: dict[int, int | None]) -> list[Any]:
        """The values, or `RankFailedError` for the root cause, or `LaunchTimeout`."""
        if self.failures:
            silent = [(r, _silent(code), "") for r, code in unreported.items() if code is not None]
            raise _root_cause(self.failures + silent)
        if unreported:
            raise LaunchTimeout(self.deadline_s or 0.0, sorted(unreported))
        return [self.values[rank] for rank in range(self.nproc)]


def _silent(exitcode: int) -> str:
    return f"process exited with code {exitcode} without reporting"


def _root_cause(failures: list[tuple[int, str, str]]) -> RankFailedError:
    """The failure to report first, with the others listed after it.

    A rank that died without a word is the likelier cause: its peers then fail with connection
    errors that merely echo its death. Otherwise the first rank to report is the cause.
    """
    failures = sorted(failures, key=lambda failure: failure[2] != "")  # stable: silent first
    rank, text, remote_traceback = failures[0]
    others = "".join(f"\n  then rank {r}: {t.splitlines()[0][:200]}" for r, t, _ in failures[1:])
    return RankFailedError(rank, text + others, remote_traceback)
