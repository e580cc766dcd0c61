"""The shm barrier's two ways to sleep, the futex and the named pipe, keep its guarantees.

One spawn of 3 ranks (two sleepers per barrier, so the last arriver's wake must reach both);
each rank sets up one group that sleeps on the futex and one that uses the pipe
(`futex.ENABLED` off, as TESSERA_SHM_FUTEX=0 or a machine without futex does). For each:

- all_reduce through shm gives torch.distributed's result, bit for bit, on the main thread and
  on a side thread (DDP's comm stream); the futex group's arrival counter is started just below
  2**32, so its barriers wrap around it; an ordinary tensor gets the same bits as the same
  values in a `shared_buffer` (two code paths, one order of operations);
- no wake-up is lost: the naps between looks are set far past the timeout, so a waiter that is
  not woken sleeps until its deadline (its last look then finds the barrier passed); ranks
  arrive late in turn, with and without the spin that precedes the sleep;
- a rank whose peers never arrive gets a `CollectiveTimeout` naming itself, the operation and
  the missing ranks, at its timeout.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

import tessera
import tessera.comm.shm.group as shm  # the module that reads SPIN_S
from tessera import comm
from tessera.comm._p2p import group_info
from tessera.comm.shm import futex
from tessera.errors import CollectiveTimeout

SPAWN_TIMEOUT_S = 120
ENV = {"TESSERA_TIMEOUT_S": "20"}
WORLD = 3
VARIANTS = ("futex", "pipe")
LATE_CALLS = 24
NO_NAP_MS = 600_000.0  # longer than any timeout below: only a wake-up ends a sleep
LATE_TIMEOUT_S = 5.0


def _inputs(rank: int, i: int) -> list[tuple[torch.Tensor, str]]:
    gen = torch.Generator().manual_seed(100 * i + rank)
    numel = (1, 1000, 300_001)[i % 3]
    integers = torch.randint(-1000, 1000, (numel,), generator=gen).to(torch.float32)
    return [
        (integers, "sum"),  # small integers: every order of summing gives the same bits
        (torch.randn(numel, generator=gen, dtype=torch.float64), "max"),
        (torch.randn(7, 5, generator=gen).t(), "min"),  # not contiguous
    ]


def _agrees_with_torch(group: dist.ProcessGroup, rank: int, calls: range) -> list:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    wrong = []
    for i in calls:
        for x, op in _inputs(rank, i):
            want = x.clone()
            dist.all_reduce(want, op=ops[op])  # torch.distributed itself (gloo)
            comm.all_reduce(x, op=op, algorithm="shm", group=group)
            if not torch.equal(x, want):
                wrong.append((i, op))
    return wrong


def _on_side(found: list, group: dist.ProcessGroup, rank: int) -> None:
    found.extend(("side", *w) for w in _agrees_with_torch(group, rank, range(4, 7)))


def _late_in_turn(group: dist.ProcessGroup, rank: int) -> list:
    """all_reduces where one rank comes 3 ms late, in turn; the others go to sleep.

    A sleeper that is not woken looks once more at its deadline, finds the barrier passed and
    returns: a lost wake-up shows as a call that lasted its whole timeout. Every rank stops at
    the first such call (or error) of any rank, so that a bug costs one timeout, not one per
    barrier."""
    failures: list = []
    for i in range(LATE_CALLS):
        shm.SPIN_S = 0.0 if i % 2 else 100e-6  # sleep at once, or after the spin
        if rank == i % WORLD:
            time.sleep(0.003)
        x = torch.full((64,), float(rank + i))
        start = time.monotonic()
        try:
            comm.all_reduce(x, algorithm="shm", group=group, timeout=LATE_TIMEOUT_S)
            if time.monotonic() - start >= 0.95 * LATE_TIMEOUT_S:
                failures.append((i, "waited out its timeout: a wake-up was lost"))
            elif not torch.equal(x, torch.full((64,), float(3 * i + 3))):
                failures.append((i, "wrong sum"))
        except CollectiveTimeout as exc:
            failures.append((i, str(exc)))
        anyone: list = [None] * WORLD
        dist.all_gather_object(anyone, bool(failures))
        if any(anyone):
            break
    return failures


def _same_bits_as_in_place(group: dist.ProcessGroup, rank: int) -> list:
    """An ordinary tensor (copied in, reduced into the result area) against the same values in
    a `shared_buffer` (reduced in place): the same bits, where the order of operations shows
    (three ranks' random floats), through the accumulation dtype (bf16) and for mean of ints."""
    gen = torch.Generator().manual_seed(7 + rank)
    cases = [(torch.float32, "sum"), (torch.bfloat16, "mean"), (torch.float64, "product")]
    wrong = []
    for dtype, op in [*cases, (torch.int64, "mean")]:
        for numel in (1, 999, 300_001):
            if dtype == torch.int64:
                x = torch.randint(-(2**40), 2**40, (numel,), generator=gen)
            else:
                x = (torch.randn(numel, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
            shared = comm.shared_buffer(numel, dtype, group=group)
            shared.copy_(x)
            comm.all_reduce(shared, op=op, algorithm="shm", group=group)
            comm.all_reduce(x, op=op, algorithm="shm", group=group)
            if not torch.equal(x, shared):
                wrong.append((str(dtype), op, numel))
    return wrong


def _rank_barriers() -> dict:
    ctx = tessera.init()
    rank = ctx.rank
    groups, shms = {}, {}
    for variant in VARIANTS:
        futex.ENABLED = variant == "futex"
        groups[variant] = dist.new_group(list(range(WORLD)))
        shms[variant] = shm.shm_group(group_info(groups[variant]))  # set up in this mode
    futex.ENABLED = True
    futex_group = shms["futex"]
    start = 2**32 // WORLD - 5  # barrier number whose target is just below 2**32
    futex_group._count = start
    if rank == 0:
        futex_group._words.add32(futex_group._arrivals, start * WORLD & 0xFFFFFFFF)
    dist.barrier()  # the counter is set before any rank arrives
    out: dict = {"modes": {v: s._futex for v, s in shms.items()}, "wrong": {}, "late": {}}
    for variant in VARIANTS:
        group = groups[variant]
        wrong = _agrees_with_torch(group, rank, range(0, 4))
        side: list = []
        worker = threading.Thread(target=_on_side, args=(side, group, rank))
        worker.start()
        worker.join()
        out["wrong"][variant] = wrong + side + _same_bits_as_in_place(group, rank)
        shms[variant]._nap_ms = NO_NAP_MS
        out["late"][variant] = _late_in_turn(group, rank)
    out["futex_wrapped"] = futex_group._words.load32(futex_group._arrivals) < 2**31
    shm.SPIN_S = 100e-6
    dist.barrier()
    if rank != 0:
        dist.barrier()  # absent from rank 0's calls below until they timed out
        return out
    out["timeouts"] = {}
    for variant in VARIANTS:
        begin = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8), algorithm="shm", group=groups[variant], timeout=1.0)
            message = None
        except CollectiveTimeout as exc:
            message = str(exc)
        out["timeouts"][variant] = (message, time.monotonic() - begin)
    dist.barrier()
    return out


def test_futex_and_pipe_barriers_match_torch_lose_no_wakeup_and_time_out():
    results = tessera.launch(_rank_barriers, WORLD, deadline_s=SPAWN_TIMEOUT_S, env=ENV)
    late = {rank: result["late"] for rank, result in enumerate(results)}
    assert all(v == {"futex": [], "pipe": []} for v in late.values()), f"lost wake-up: {late}"
    for rank, result in enumerate(results):
        assert result["modes"] == {"futex": futex.AVAILABLE, "pipe": False}, result["modes"]
        assert result["wrong"] == {"futex": [], "pipe": []}, (rank, result["wrong"])
        assert result["futex_wrapped"], "the futex group's counter did not wrap around 2**32"
    for variant in VARIANTS:
        message, waited = results[0]["timeouts"][variant]
        assert message is not None, f"{variant}: rank 0 waited for absent ranks, no timeout"
        assert "rank 0" in message and "all_reduce" in message, message
        assert "[1, 2]" in message, message
        assert waited < 10, (variant, waited)  # a 1 s timeout, with slack for a loaded machine
