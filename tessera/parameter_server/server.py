"""One parameter server: owns a shard of the parameters and its optimizer state, serves reads
under a consistency policy and applies pushed gradients.

Update rule (so the modes are comparable): a policy with bound 0 (BSP) applies the mean of the W
workers' gradients once per clock, exactly synchronous data parallelism; any other policy (ASP,
SSP) applies each gradient on arrival scaled by 1/W, so one clock of all W workers moves the model
as far as one BSP step.

State is guarded by one condition variable: a pull the policy holds back waits on it (woken by
every applied gradient), bounded by the timeout. While it waits, and while server 0 waits for the
workers to finish, the server checks liveness. A worker is lost when it is silent (no call, no
heartbeat) for `timeout_s`, or hung: alive (its heartbeat thread beats) but making no other call
for `HANG_FACTOR` x `timeout_s` (a worker blocked in a pull here counts as progressing: the
server holds it). Under BSP a lost worker is an error naming it and its last call (the others
would wait forever); under ASP and SSP it is dropped, logged as an event, and the bound then
counts live workers only. So no wait depends on a worker coming back.

Checkpoints are written outside the lock: the state is copied under it, then serialised and
written (one save at a time) while heartbeats, pulls and pushes of other workers go on.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.parameter_server.checkpoint import save_shard
from tessera.parameter_server.errors import GradientShapeError, PeerRefused, PSTimeout, WorkerLost
from tessera.parameter_server.policy import ConsistencyPolicy, aggregates

__all__ = ["HANG_FACTOR", "ShardServer"]

_log = logging.getLogger(__name__)
_POLL_S = 0.1  # how often a held-back pull re-checks liveness while it waits
HANG_FACTOR = 2.0
"""A worker whose only calls for `HANG_FACTOR` x `timeout_s` are heartbeats is hung: one step
(pull, compute, push) must take less than that, as a read held back by the policy already must."""


@dataclass(frozen=True)
class _Read:
    clock: int
    min_clock: int
    version: int  # gradients applied on this server when the worker read


class ShardServer:
    """Server `server` of the run: a list of 1-D parameter pieces and their optimizer.

    Why so many parameters: a server is made by `run` (and by tests) from the run's config, one
    keyword each: its shard, the policy and liveness it enforces, and its checkpoint series.
    """

    def __init__(
        self,
        *,
        server: int,
        pieces: list[torch.Tensor],
        optimizer_fn: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        policy: ConsistencyPolicy,
        num_workers: int,
        timeout_s: float,
        layout: list | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 0,
        num_servers: int = 1,
        keep_checkpoints: int = 1,
    ) -> None:
        self.server = server
        self.num_servers = num_servers
        """Servers of the run: a checkpoint is kept until a newer one is common to all of them."""
        self.pieces = [p.detach().clone().requires_grad_(True) for p in pieces]
        for piece, given in zip(self.pieces, pieces):  # a factory grouping by shape reads it
            piece.source_ndim = getattr(given, "source_ndim", given.dim())  # type: ignore[attr-defined]
        self.optimizer = optimizer_fn(self.pieces)
        self.policy = policy
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.version = 0
        """Gradients applied so far (a BSP mean of W gradients counts W)."""
        self.clocks = [0] * num_workers
        """`clocks[w]`: worker w's updates applied here."""
        self.done: set[int] = set()
        self.dropped: set[int] = set()
        self.log: list[dict[str, Any]] = []
        self.worker_stats: dict[int, Any] = {}
        self.events: list[dict[str, Any]] = []
        self._last_seen = [time.monotonic()] * num_workers
        self._last_progress = [time.monotonic()] * num_workers  # any call but a heartbeat
        self._last_call = ["none"] * num_workers
        self._reads: dict[int, _Read] = {}
        self._pending: dict[int, dict[int, tuple[list[torch.Tensor], _Read, float]]] = {}
        self._cond = threading.Condition()
        self._save_lock = threading.Lock()  # one save at a time, outside `_cond`
        self.layout = layout or []
        """`(name, start, stop)` of each piece: what a checkpoint must match."""
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        """Versions common to all servers kept (with any newer file): see `checkpoint`."""

    # --- called by workers (through the transport) -------------------------------------------
    def pull(self, worker: int, clock: int) -> list[torch.Tensor]:
        """This shard's parameters for worker `worker` at `clock`, once the policy allows."""
        with self._cond:
            self._admit(worker, "pull", f"pull of clock {clock}")
            started = time.monotonic()
            while not self.policy.may_read(clock, self._min_live_clock()):
                self._drop_silent(f"pull of clock {clock} by worker {worker}")
                if time.monotonic() - started > 2 * self.timeout_s:
                    slowest = self._slowest_live()
                    raise PSTimeout(
                        f"server {self.server}: pull of clock {clock} by worker {worker} waited "
                        f"{2 * self.timeout_s:g} s for worker {slowest} (at clock "
                        f"{self.clocks[slowest]}) to progress"
                    )
                # Waiting here is a sign of life, and of progress: the server holds the worker.
                self._last_seen[worker] = self._last_progress[worker] = time.monotonic()
                self._cond.wait(timeout=_POLL_S)
            self._reads[worker] = _Read(clock, self._min_live_clock(), self.version)
            return [p.detach().clone() for p in self.pieces]

    def push(self, worker: int, clock: int, grads: list[torch.Tensor], loss: float) -> None:
        """Apply (or, under BSP, buffer) worker `worker`'s gradient for its update `clock`."""
        with self._cond:
            self._admit(worker, "push", f"push of clock {clock}")
            self._check_shapes(worker, grads)
            read = self._reads.pop(worker, None)
            if read is None or read.clock != clock:
                raise RuntimeError(
                    f"server {self.server}: worker {worker} pushed clock {clock} "
                    f"without reading it first (read: {read})"
                )
            if clock < self.clocks[worker]:
                return  # applied here before a restart (see `checkpoint`): not twice
            due = False
            if aggregates(self.policy):
                bucket = self._pending.setdefault(clock, {})
                bucket[worker] = (grads, read, loss)
                if len(bucket) == self.num_workers - len(self.dropped):
                    self._apply_mean(clock, self._pending.pop(clock))
                    due = self.checkpoint_every > 0 and (clock + 1) % self.checkpoint_every == 0
            else:
                self._apply([g / self.num_workers for g in grads])
                self._record(worker, read, loss)
                self.clocks[worker] = clock + 1
                self.version += 1
                every = self.checkpoint_every * self.num_workers
                due = every > 0 and self.version % every == 0
            self._cond.notify_all()
            state = self.state() if due and self.checkpoint_dir is not None else None
        if state is not None:  # outside the lock: a long write starves no heartbeat
            self._save(state)

    def heartbeat(self, worker: int) -> None:
        """A sign of life from a worker busy computing."""
        with self._cond:
            self._admit(worker, "heartbeat")

    def finish(self, worker: int, stats: Any = None) -> None:
        """Worker `worker` completed all its updates; `stats` are its measurements."""
        with self._cond:
            self._admit(worker, "finish", "finish")
            self.done.add(worker)
            self.worker_stats[worker] = stats
            self._cond.notify_all()

    def start_clock(self, worker: int) -> int:
        """Updates of worker `worker` this shard has applied (0 unless restored from a
        checkpoint); the worker resumes from the smallest over the servers."""
        with self._cond:
            self._admit(worker, "start_clock", "start_clock")
            return self.clocks[worker]

    def save_checkpoint(self) -> None:
        """Write this shard's state now (the coordinator calls it when training ended)."""
        if self.checkpoint_dir is not None:
            with self._cond:
                state = self.state()
            self._save(state)

    def on_refused(self, peer: str, method: str) -> None:
        """The transport refused `peer` (wrong token): log it, serve nothing."""
        with self._cond:
            self._event("refused", peer=peer, method=method, reason="wrong or missing token")

    # --- called locally ------------------------------------------------------------------------
    def wait_finished(self) -> None:
        """Block until every worker finished or was dropped; lost and hung workers are detected
        here, so this returns (or, under BSP, raises `WorkerLost`) within about
        `HANG_FACTOR` x `timeout_s` of the last progress of any worker."""
        with self._cond:
            while len(self.done | self.dropped) < self.num_workers:
                self._drop_silent("waiting for the workers to finish")
                self._cond.wait(timeout=_POLL_S)

    def snapshot(self) -> dict[str, Any]:
        """The shard's parameters, log and events (a copy)."""
        with self._cond:
            return {
                "server": self.server,
                "pieces": [p.detach().clone() for p in self.pieces],
                "log": [dict(r) for r in self.log],
                "events": [dict(e) for e in self.events],
            }

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: pieces, optimizer state, clocks, version and layout (copies:
        the optimizer updates its state tensors in place after this returns)."""
        return {
            "server": self.server,
            "version": self.version,
            "clocks": list(self.clocks),
            "pieces": [p.detach().clone() for p in self.pieces],
            "layout": self.layout,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state` (see `checkpoint.resume_version`, `load_shard`)."""
        with self._cond, torch.no_grad():
            for piece, saved in zip(self.pieces, state["pieces"], strict=True):
                piece.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"])
            self.clocks = list(state["clocks"])
            self.version = state["version"]

    # --- internals -----------------------------------------------------------------------------
    def _admit(self, worker: int, method: str, call: str | None = None) -> None:
        """Check `worker` may call; `call` (None for a heartbeat) is recorded as progress."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"server {self.server}: {method} from unknown worker {worker}")
        if worker in self.dropped:
            raise PeerRefused(
                f"server {self.server}: worker {worker} was dropped "
                f"({self._drop_reason(worker)}); its {method} is refused"
            )
        now = time.monotonic()
        self._last_seen[worker] = now
        if call is not None:
            self._last_progress[worker] = now
            self._last_call[worker] = call

    def _drop_reason(self, worker: int) -> str:
        reasons = [
            e["reason"] for e in self.events if e["event"] == "dropped" and e["worker"] == worker
        ]
        return reasons[-1] if reasons else f"after {self.timeout_s:g} s of silence"

    def _save(self, state: dict[str, Any]) -> None:
        with self._save_lock:
            save_shard(
                self.checkpoint_dir, self.server, state, self.num_servers, self.keep_checkpoints
            )

    def _check_shapes(self, worker: int, grads: list[torch.Tensor]) -> None:
        expected = [tuple(p.shape) for p in self.pieces]
        got = [tuple(g.shape) for g in grads]
        if got != expected:
            self._event("refused_gradient", worker=worker, expected=expected, got=got)
            raise GradientShapeError(
                f"server {self.server}: gradient from worker {worker} refused: piece shapes {got} "
                f"do not match this shard's {expected}"
            )

    def _live(self) -> list[int]:
        return [w for w in range(self.num_workers) if w not in self.dropped]

    def _min_live_clock(self) -> int:
        live = self._live()
        return min(self.clocks[w] for w in live) if live else max(self.clocks)

    def _slowest_live(self) -> int:
        """The live worker holding others back: lowest clock, and among those (BSP keeps pushed
        gradients pending until the clock is complete) one that has not pushed for it yet."""

        def behind(worker: int) -> tuple[int, bool]:
            pushed = worker in self._pending.get(self.clocks[worker], {})
            return self.clocks[worker], pushed

        return min(self._live(), key=behind)

    def _drop_silent(self, operation: str) -> None:
        """Drop (ASP, SSP) or raise for (BSP) each live worker silent or hung past its bound."""
        now = time.monotonic()
        hang_s = HANG_FACTOR * self.timeout_s
        for worker in self._live():
            if worker in self.done:
                continue
            silent_s = now - self._last_seen[worker]
            idle_s = now - self._last_progress[worker]
            if silent_s > self.timeout_s:
                text = (
                    f"server {self.server}: worker {worker} silent for {silent_s:.1f} s "
                    f"(timeout {self.timeout_s:g} s; last call: {self._last_call[worker]}) "
                    f"during {operation}"
                )
            elif idle_s > hang_s:
                text = (
                    f"server {self.server}: worker {worker} made no progress for "
                    f"{idle_s:.1f} s (heartbeats only; last call: {self._last_call[worker]}; "
                    f"a step must take less than {hang_s:g} s) during {operation}"
                )
            else:
                continue
            if aggregates(self.policy):
                raise WorkerLost(text + "; BSP cannot go on without it", worker)
            self.dropped.add(worker)
            self._event("dropped", worker=worker, reason=text)
            self._cond.notify_all()

    def _apply(self, grads: list[torch.Tensor]) -> None:
        for piece, grad in zip(self.pieces, grads, strict=True):
            piece.grad = grad.to(piece.dtype)
        self.optimizer.step()
        for piece in self.pieces:
            piece.grad = None

    def _apply_mean(self, clock: int, bucket: dict) -> None:
        workers = sorted(bucket)
        total = [g.clone() for g in bucket[workers[0]][0]]
        for worker in workers[1:]:  # summed in worker order: the same order on every run
            for acc, grad in zip(total, bucket[worker][0], strict=True):
                acc.add_(grad)
        self._apply([t / self.num_workers for t in total])
        for worker in workers:
            self._record(worker, bucket[worker][1], bucket[worker][2])
            self.clocks[worker] = clock + 1
        self.version += len(workers)

    def _record(self, worker: int, read: _Read, loss: float) -> None:
        self.log.append(
            {
                "worker": worker,
                "clock": read.clock,
                "min_clock": read.min_clock,
                "staleness": self.version - read.version,
                "time": time.time(),
                "loss": loss,
                "server": self.server,
            }
        )

    def _event(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "server": self.server, "time": time.time(), **fields}
        self.events.append(record)
        _log.warning("parameter server %d: %s %s", self.server, kind, fields)
