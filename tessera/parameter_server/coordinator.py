"""The end of a run: server 0 waits for the workers, gathers the shards and hands out the result.

Server 0 doubles as coordinator. Once every worker has finished or been dropped, it fetches the
other servers' snapshots (parameters, logs, events), assembles one `PSResult` and serves it to every
other process, which polls `fetch_result` (each poll bounded, so a dead coordinator surfaces as an
error, and a long training is not mistaken for one), then acknowledges it. Only when every expected
peer acknowledged (or the timeout passed) does server 0 leave the RPC world: leaving earlier could
cut a peer off before the result reached it. The acknowledgement's own reply may be cut off that
way; the peer ignores that, it has the result already.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from tessera.parameter_server.result import PSResult, merge_logs
from tessera.parameter_server.server import ShardServer
from tessera.parameter_server.sharding import ShardPlan
from tessera.parameter_server.transport import Transport

__all__ = ["Coordinator", "fetch_result"]


class Coordinator:
    """Served on rank 0: the shard server's methods plus `fetch_result`."""

    def __init__(self, server: ShardServer, plan: ShardPlan, num_servers: int) -> None:
        self.server = server
        self.plan = plan
        self.num_servers = num_servers
        self._result: PSResult | None = None
        self._fetched: set[str] = set()
        self._cond = threading.Condition()
        self._started = time.perf_counter()

    # The shard server's methods, served on rank 0 like on any other server.
    def pull(self, *args: Any) -> Any:
        """See `ShardServer.pull`."""
        return self.server.pull(*args)

    def push(self, *args: Any) -> Any:
        """See `ShardServer.push`."""
        return self.server.push(*args)

    def heartbeat(self, *args: Any) -> Any:
        """See `ShardServer.heartbeat`."""
        return self.server.heartbeat(*args)

    def finish(self, *args: Any) -> Any:
        """See `ShardServer.finish`."""
        return self.server.finish(*args)

    def start_clock(self, *args: Any) -> Any:
        """See `ShardServer.start_clock`."""
        return self.server.start_clock(*args)

    def on_refused(self, peer: str, method: str) -> None:
        """See `ShardServer.on_refused`."""
        self.server.on_refused(peer, method)

    def fetch_result(self, peer: str, wait_s: float) -> PSResult | None:
        """The run's result once assembled; None if not ready within `wait_s` (poll again)."""
        with self._cond:
            self._cond.wait_for(lambda: self._result is not None, timeout=wait_s)
            return self._result

    def acknowledge(self, peer: str) -> None:
        """`peer` has the result; server 0 may leave once all have."""
        with self._cond:
            self._fetched.add(peer)
            self._cond.notify_all()

    def conclude(self, transport: Transport, timeout_s: float) -> PSResult:
        """Wait for the workers, assemble the result, and keep serving it until all have it."""
        self.server.wait_finished()
        transport.wait(
            [
                (s, "save_checkpoint", transport.call_async(s, "save_checkpoint"))
                for s in range(1, self.num_servers)
            ]
        )
        self.server.save_checkpoint()
        snapshots = [self.server.snapshot()] + transport.wait(
            [
                (s, "snapshot", transport.call_async(s, "snapshot"))
                for s in range(1, self.num_servers)
            ]
        )
        dropped = sorted(self.server.dropped)
        stats = self.server.worker_stats
        workers = range(self.server.num_workers)
        result = PSResult(
            state_dict=self.plan.assemble([snap["pieces"] for snap in snapshots]),
            log=merge_logs([snap["log"] for snap in snapshots]),
            events=[e for snap in snapshots for e in snap["events"]],
            updates_per_s=[stats[w].updates_per_s if w in stats else math.nan for w in workers],
            wait_s=[stats[w].wait_s if w in stats else math.nan for w in workers],
            phases_s=[_phases(stats.get(w)) for w in workers],
            wall_s=time.perf_counter() - self._started,
            dropped_workers=dropped,
        )
        expected = {f"server-{s}" for s in range(1, self.num_servers)}
        expected |= {f"worker-{w}" for w in workers if w not in self.server.dropped}
        with self._cond:
            self._result = result
            self._cond.notify_all()
            self._cond.wait_for(lambda: expected <= self._fetched, timeout=timeout_s)
        return result


def _phases(stats: Any) -> dict[str, float]:
    """Seconds a worker spent per phase of its updates (NaN for a dropped worker)."""
    names = ("pull_s", "compute_s", "sleep_s", "push_s")
    return {name: math.nan if stats is None else getattr(stats, name) for name in names}


def fetch_result(transport: Transport, timeout_s: float) -> PSResult:
    """Poll the coordinator until the result is ready (each poll bounded by the RPC timeout)."""
    while True:
        result = transport.call(0, "fetch_result", transport.name, timeout_s / 2)
        if result is not None:
            try:
                transport.call(0, "acknowledge", transport.name)
            except Exception:  # noqa: BLE001 - server 0 may leave before this reply is sent
                pass
            return result
