"""The fast paths of all_reduce keep their guarantees.

- The shm barrier's spin (it yields the core between looks): results stay exact when both ranks
  share one core, and a spin set far longer than the timeout still ends at the timeout (every
  wait ends in a `CollectiveTimeout` naming the rank and the operation).
- Only the main thread spins: a side thread (DDP's comm stream, beside compute) sleeps at once.
- The ring's receive buffer, kept between calls, is per thread: two threads running ring
  all-reduces at once (on two groups, as the comm stream does beside the main thread) get
  exact results.

One spawn of 2 ranks; the shm part pins both ranks to one CPU, so that a rank spinning in the
barrier holds the only core its peer could run on.
"""

from __future__ import annotations

import os
import threading
import time
from unittest import mock

import torch
import torch.distributed as dist

import tessera
import tessera.comm.shm.group as shm  # the module that reads SPIN_S
from tessera import comm
from tessera.errors import CollectiveTimeout

SPAWN_TIMEOUT_S = 90
ENV = {"TESSERA_TIMEOUT_S": "20"}
CALLS = 40


def _ring_calls(group: dist.ProcessGroup, rank: int, salt: int, wrong: list) -> None:
    for i in range(12):
        numel = 200_000 + 5_000 * ((i * 7 + salt) % 11)  # sizes up and down: buffer reused
        base = (torch.arange(numel, dtype=torch.float32) * (salt + 1)) % 101
        x = base + (rank + 1) * (i + 1)
        comm.all_reduce(x, algorithm="ring", group=group)
        if not torch.equal(x, 2 * base + 3 * (i + 1)):  # small integers: exact in float32
            wrong.append((salt, i))


def _yields_while_waiting(rank: int, thread: str) -> int:
    """sched_yield calls of rank 1's barriers while rank 0 arrives 50 ms late, on `thread`."""
    shm.SPIN_S = 30.0
    calls = []
    real_yield = os.sched_yield

    def counting_yield() -> None:
        calls.append(1)
        real_yield()

    def reduce_late() -> None:
        for _ in range(2):
            if rank == 0:
                time.sleep(0.05)
            comm.all_reduce(torch.ones(8), algorithm="shm")

    with mock.patch.object(os, "sched_yield", counting_yield):
        if thread == "main":
            reduce_late()
        else:  # as DDP's comm stream does, beside the main thread
            worker = threading.Thread(target=reduce_late)
            worker.start()
            worker.join()
    return len(calls)


def _rank_fast_paths() -> dict:
    ctx = tessera.init()
    groups = [dist.new_group([0, 1]) for _ in range(2)]
    ring_wrong: list = []
    threads = [
        threading.Thread(target=_ring_calls, args=(g, ctx.rank, salt, ring_wrong))
        for salt, g in enumerate(groups)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    yields = {thread: _yields_while_waiting(ctx.rank, thread) for thread in ("side", "main")}
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # both ranks share one core
    shm.SPIN_S = 30.0  # spin far longer than any timeout below
    wrong = []
    for i in range(CALLS):
        numel = (1, 1000, 70_000)[i % 3]
        # small integers in float32: every sum is exact, whatever the order
        x = torch.arange(numel, dtype=torch.float32) % 97 + (ctx.rank + 1) * (i + 1)
        want = 2 * (torch.arange(numel, dtype=torch.float32) % 97) + 3 * (i + 1)
        comm.all_reduce(x, algorithm="shm")
        if not torch.equal(x, want):
            wrong.append(i)
    outcome = {"wrong": wrong, "ring_wrong": ring_wrong, "yields": yields}
    if ctx.rank == 1:
        time.sleep(2.5)  # absent from the next call, alive past rank 0's timeout
        return outcome
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(8), algorithm="shm", timeout=1.0)
        outcome["timeout"] = None
    except CollectiveTimeout as exc:
        outcome["timeout"] = str(exc)
    outcome["waited_s"] = time.monotonic() - start
    return outcome


def test_shm_spin_and_ring_buffer_keep_results_exact_and_waits_bounded():
    results = tessera.launch(_rank_fast_paths, 2, deadline_s=SPAWN_TIMEOUT_S, env=ENV)
    assert results[0]["ring_wrong"] == [] and results[1]["ring_wrong"] == [], results
    # the waiting rank spins (yielding) on the main thread only, never on a side thread
    assert results[1]["yields"]["side"] == 0 and results[1]["yields"]["main"] > 0, results
    assert results[0]["wrong"] == [] and results[1]["wrong"] == [], results
    message = results[0]["timeout"]
    assert message is not None, "rank 0 waited for an absent rank and got no timeout"
    assert "rank 0" in message and "all_reduce" in message and "[1]" in message, message
    # 1 s timeout against a 30 s spin: the wait ends at the timeout (slack for a loaded machine)
    assert results[0]["waited_s"] < 10, results[0]
