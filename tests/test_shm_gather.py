"""all_gather and reduce_scatter (shm, ring, native, auto) against torch.distributed's results.

One spawn per world size (2 and 3 ranks) runs every case: each algorithm x six dtypes x uneven
row counts (0 rows, fewer rows than ranks, one more than a multiple) x five ops. all_gather only
copies, so it must equal torch's `all_gather_single` bit for bit. reduce_scatter must equal
torch's `reduce_scatter` exactly where the reduction cannot depend on the order (integers,
max/min, and float sums of two values in the tensor's own precision: a + b == b + a), and lie
within the derived rounding bound of the exact float64 reduction elsewhere (`test_comm`: Higham's
bound for the accumulation dtype, for tessera's result and torch's each).

The same spawns check the double buffering of the shared segment: rank 1 is held back between
the barrier and its reads while rank 0 races ahead into the next collectives; a segment reused
without a barrier between would hand rank 1 the next call's data (or the next descriptor). They
also check that tensor parallelism gathers through shm (ZeRO: tests/test_zero.py), and that a
rank that never arrives is named in a timeout.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from test_comm import _assert_within, _reference, _values

import tessera
from tessera import comm
from tessera.comm import cost
from tessera.comm._p2p import group_info
from tessera.comm.shm.group import shm_group
from tessera.errors import CollectiveTimeout
from tessera.tensor_parallel import _comm as tp_comm

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
OPS = ("sum", "mean", "max", "min", "product")
ENV = {"TESSERA_TIMEOUT_S": "20"}


def ROWS(world: int) -> tuple[int, ...]:  # noqa: N802 - a constant of the world size
    """Row counts: none, fewer than ranks, one past a multiple, and many (split unevenly)."""
    return (0, world - 1, world + 1, 1001)


def _torch_reduce_scatter(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    """torch's own reduce_scatter of `x`'s `tensor_split` rows (mean: its sum, divided here)."""
    native = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
    parts = [part.contiguous() for part in x.tensor_split(world)]
    out = torch.empty_like(parts[dist.get_rank()])
    dist.reduce_scatter(out, parts, op=getattr(dist.ReduceOp, native[op]))
    if op == "mean":
        out = out / world if out.is_floating_point() else out.div(world, rounding_mode="floor")
    return out.to(x.dtype)


def _order_free(op: str, dtype: torch.dtype, world: int) -> bool:
    """Whether every correct reduction gives the same bits (so tessera must equal torch)."""
    if not dtype.is_floating_point or op in ("max", "min"):
        return True
    return world == 2 and dtype in (torch.float32, torch.float64) and op != "mean"


def _check_equivalence(world: int, rank: int) -> int:
    checked = 0
    for algorithm in ("shm", "native"):  # ring: test_comm; auto picks shm here
        for d, dtype in enumerate(DTYPES):
            for rows in ROWS(world):
                case = (d * 31 + rows) * 7 + len(algorithm)
                x = _values(case, rank, rows * 3, dtype, "sum").reshape(rows, 3)
                got = comm.all_gather(x, algorithm=algorithm)
                want = torch.empty((world * rows, 3), dtype=dtype)
                dist.all_gather_into_tensor(want, x)
                assert torch.equal(got, want), f"all_gather {algorithm} {dtype} rows={rows}"
                for op in OPS:
                    x = _values(case + 1, rank, rows * 3, dtype, op).reshape(rows, 3)
                    what = f"reduce_scatter {algorithm} {op} {dtype} rows={rows} world={world}"
                    got = comm.reduce_scatter(x, op, algorithm=algorithm)
                    theirs = _torch_reduce_scatter(x, op, world)
                    exact, bound, torch_bound = _reference(x, op, world)
                    mine, mine_bound = (
                        exact.tensor_split(world)[rank],
                        bound.tensor_split(world)[rank],
                    )
                    _assert_within(got, mine, mine_bound, what + " vs exact")
                    if _order_free(op, dtype, world):
                        assert torch.equal(got, theirs), what + " differs from torch's"
                    else:
                        their_bound = torch_bound.tensor_split(world)[rank]
                        _assert_within(got, theirs, mine_bound + their_bound, what + " vs torch")
                    checked += 1
    return checked


def _hold_back_rank_one(rank: int) -> None:
    """Rank 1 reads the segment 0.1 s after each barrier; rank 0 goes straight on."""
    if rank != 1:
        return
    group = shm_group(group_info(None))
    check = group._check

    def late_check(mine, at=0):
        time.sleep(0.1)
        check(mine, at)

    group._check = late_check


def _check_reuse(world: int, rank: int) -> None:
    """Back-to-back calls with fresh values while rank 1 lags: each call sees its own data."""
    _hold_back_rank_one(rank)
    for call in range(3):
        x = torch.full((5, 2), 10.0 * call + rank)
        got = comm.all_gather(x, algorithm="shm")
        want = torch.cat([torch.full((5, 2), 10.0 * call + q) for q in range(world)])
        assert torch.equal(got, want), f"all_gather call {call} read another call's data"
    for call in range(3):
        x = torch.full((2 * world, 2), 10.0 * call + rank)
        got = comm.reduce_scatter(x, "sum", algorithm="shm")
        want = sum(10.0 * call + q for q in range(world))
        assert torch.all(got == want), f"reduce_scatter call {call}: {got.tolist()} != {want}"
    for _ in range(2):  # all_reduce right after an all_gather, on either half of the segment
        got = comm.all_gather(torch.full((4,), float(rank)), algorithm="shm")
        assert torch.equal(got, torch.arange(world).repeat_interleave(4).float()), got.tolist()
        y = torch.full((4,), float(rank + 1))
        comm.all_reduce(y, algorithm="shm")  # writes into its peers' slots (its own segment)
        assert torch.all(y == world * (world + 1) / 2), y.tolist()
    group = shm_group(group_info(None))
    group.__dict__.pop("_check", None)


def _check_tensor_parallel(world: int, rank: int) -> list[tuple[str, str]]:
    """A tensor-parallel all-gather along dim 1 (ZeRO's collectives: tests/test_zero.py)."""
    last = comm.history()[-1].seq  # the history keeps 64 records: select by sequence number
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    got = tp_comm.all_gather_dim(x, None, dim=1)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    assert torch.equal(got, torch.cat(parts, dim=1)), "tensor-parallel all_gather_dim"
    return sorted({(r.kind, r.algorithm) for r in comm.history() if r.seq > last})


def _check_absent(rank: int) -> str:
    """The last rank never calls: the others' shm all_gather times out naming it."""
    message = ""
    if rank != dist.get_world_size() - 1:
        start = time.monotonic()
        try:
            comm.all_gather(torch.ones(3), algorithm="shm", timeout=1)
        except CollectiveTimeout as exc:
            message = f"{exc} after {time.monotonic() - start:.1f} s"
    dist.barrier()
    return message


def _rank(world: int) -> dict:
    ctx = tessera.init()
    t0 = time.perf_counter()
    checked = _check_equivalence(world, ctx.rank)
    t1 = time.perf_counter()
    _check_reuse(world, ctx.rank)
    t2 = time.perf_counter()
    issued = _check_tensor_parallel(world, ctx.rank)
    t3 = time.perf_counter()
    absent = _check_absent(ctx.rank) if world == 3 else ""
    print("TIMES", t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, flush=True)
    return {"checked": checked, "issued": issued, "absent": absent}


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_and_reduce_scatter_equal_torch(run_ranks, world, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    results = run_ranks(_rank, world, world)
    for rank, result in enumerate(results):
        assert result["checked"] == 2 * len(DTYPES) * len(ROWS(world)) * len(OPS)
        issued = result["issued"]
        assert issued == [("all_gather", "shm")], issued
        if world == 3 and rank < 2:
            assert "rank 2" in result["absent"] or "[2]" in result["absent"], result["absent"]
            assert "all_gather" in result["absent"], result["absent"]


def test_cost_model_prefers_shm_on_one_host_and_knows_each_kind():
    params = cost.DEFAULT_PARAMS
    assert comm.GATHER_ALGORITHMS == ("ring", "shm", "native")
    assert cost.KINDS == ("all_reduce", "all_gather", "reduce_scatter")
    for kind in ("all_gather", "reduce_scatter"):
        for nbytes in (64 << 10, 1 << 20, 64 << 20):
            for world in (2, 3, 4):
                assert (
                    cost.choose(nbytes, world, candidates=("ring", "native", "shm"), kind=kind)
                    == "shm"
                )
    # closed forms (module docstring of tessera.comm.shm.gather, Thakur et al. for the ring)
    n, p = 8e6, 4
    ring = cost.predict("ring", n, p, kind="reduce_scatter")
    assert ring == pytest.approx(3 * params.alpha + n * 3 / 4 * (params.beta + params.gamma))
    shm = cost.predict("shm", n, p, kind="all_gather")
    assert shm == pytest.approx(params.sigma + 2 * n * 1.25 * params.mu)  # 4 ranks on 2 cores
    with pytest.raises(ValueError, match="tree"):
        cost.predict("tree", n, p, kind="all_gather")
