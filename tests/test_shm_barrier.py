"""The shm barrier's spin (it yields the core between looks): results stay exact when both
ranks share one core, and a spin set far longer than the timeout still ends at the timeout
(every wait ends in a `CollectiveTimeout` naming the rank and the operation).

One spawn of 2 ranks, both pinned to one CPU, so that a rank spinning in the barrier holds the
only core its peer could run on.
"""

from __future__ import annotations

import os
import time

import torch

import tessera
from tessera import comm
from tessera.comm import shm
from tessera.errors import CollectiveTimeout

SPAWN_TIMEOUT_S = 90
ENV = {"TESSERA_TIMEOUT_S": "20"}
CALLS = 40


def _rank_pinned_spin() -> dict:
    ctx = tessera.init()
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
    outcome = {"wrong": wrong}
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


def test_spin_on_a_shared_core_stays_exact_and_ends_at_the_timeout():
    results = tessera.launch(_rank_pinned_spin, 2, timeout_s=SPAWN_TIMEOUT_S, env=ENV)
    assert results[0]["wrong"] == [] and results[1]["wrong"] == [], results
    message = results[0]["timeout"]
    assert message is not None, "rank 0 waited for an absent rank and got no timeout"
    assert "rank 0" in message and "all_reduce" in message and "[1]" in message, message
    # 1 s timeout against a 30 s spin: the wait ends at the timeout (slack for a loaded machine)
    assert results[0]["waited_s"] < 10, results[0]
