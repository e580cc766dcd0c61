"""tessera.comm against torch.distributed's own collectives, on 1-5 gloo ranks.

Spawning a rank costs ~2-3 s, so each world size runs one launched function that loops over
every case: all algorithms x ops x dtypes x odd lengths x contiguous / strided inputs. The case
list is drawn in the parent by hypothesis (edge lengths always included) and passed to every
rank, so all ranks run the same cases; each rank's values come from a generator seeded by
(case, rank). Every result is compared with the exact reduction of all ranks' inputs (gathered
with torch's all_gather, computed in float64) and with torch's own all_reduce.

A failure must show within a minute: hypothesis only draws here (no shrinking, which would
re-spawn the ranks again and again), the drawn cases run in one spawn, each collective in it
times out after `COLLECTIVE_TIMEOUT_S` (a rank that waits for a message never sent: an
off-by-one) and the spawn after `SPAWN_TIMEOUT_S`. A failing case is named in full in the
message (its values follow from its index), so it reproduces without hypothesis.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import tessera
from tessera import comm
from tessera.comm._ops import accumulate_dtype
from tessera.comm.shm import files as shm_files
from tessera.errors import CollectiveMismatch, CollectiveTimeout

COLLECTIVE_TIMEOUT_S = 20
"""Timeout of every collective in the spawned ranks (tessera's and torch's)."""

ENV = {"TESSERA_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}

SPAWN_TIMEOUT_S = 90
"""Bound of one spawn, for a hang outside any collective (none is known). A passing world-4 run
takes ~15 s on an idle 2-core machine and 34 s was measured with seven other test runs sharing
it, so 60 s would fail healthy runs; failures themselves surface sooner (a wrong value at once,
a hang after `COLLECTIVE_TIMEOUT_S`)."""

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
OPS = ("sum", "mean", "max", "min", "product")

EDGE_LENGTHS = (0, 1, 13, 97)  # plus world-1 (fewer elements than ranks); 13, 97: primes


def make_cases(world: int, random_lengths: list[int], strided: list[bool]) -> list[tuple]:
    """(algorithm, op, dtype, length, strided) cases, every combination of the first three.

    Lengths cycle through the edge cases and the drawn `random_lengths`; `strided[i]` says
    whether case i uses a non-contiguous input.
    """
    lengths = [*EDGE_LENGTHS, max(1, world - 1), *random_lengths]
    cases = []
    for algorithm in comm.ALGORITHMS + ("auto",):
        for op in OPS:
            for dtype in DTYPES:
                i = len(cases)
                cases.append((algorithm, op, dtype, lengths[i % len(lengths)], strided[i]))
    return cases


NUM_CASES = (len(comm.ALGORITHMS) + 1) * len(OPS) * len(DTYPES)


def _values(case_id: int, rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case_id * 1000 + rank)
    if op == "product":  # stay far from overflow and underflow
        if dtype.is_floating_point:
            return (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
        return torch.randint(-2, 3, (n,), generator=gen).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-100, 100, (n,), generator=gen).to(dtype)


def _exact(parts: list[torch.Tensor], op: str, world: int) -> torch.Tensor:
    """The reduction of the gathered inputs, unrounded: float64 for floats, int64 otherwise."""
    dtype = parts[0].dtype
    wide = torch.stack(
        [p.to(torch.float64 if dtype.is_floating_point else torch.int64) for p in parts]
    )
    if op in ("sum", "mean"):
        out = wide.sum(0)
        if op == "mean":
            out = (
                out / world
                if dtype.is_floating_point
                else torch.div(out, world, rounding_mode="floor")
            )
    elif op == "max":
        out = wide.max(0).values
    elif op == "min":
        out = wide.min(0).values
    else:
        out = wide.prod(0)
    return out


def _error_bound(
    parts: list[torch.Tensor], op: str, world: int, acc: torch.dtype, out: torch.dtype
) -> torch.Tensor:
    """The largest |result - exact| of a correct reduction in any order, per element (float64).

    Summing n values in any order with unit roundoff u (that of the accumulation dtype `acc`)
    errs by at most γ(n-1)·Σ|x_i|, and a product of n values by γ(n-1)·|Π x_i|, where
    γ(k) = k·u / (1 - k·u) (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    §3.1 and §4.2). Each later rounding (the mean's division, the cast of a float32 accumulator
    back to the output dtype `out`) adds its own unit roundoff times the value. max and min
    round nothing.
    """
    dtype, exact = parts[0].dtype, _exact(parts, op, world)
    if not dtype.is_floating_point or op in ("max", "min"):
        return torch.zeros(exact.shape, dtype=torch.float64)
    u, k = torch.finfo(acc).eps / 2, world - 1
    gamma = k * u / (1 - k * u)
    if op == "product":
        bound = gamma * exact.abs()
    else:
        bound = gamma * torch.stack([p.double().abs() for p in parts]).sum(0)
        if op == "mean":
            bound = bound / world + u * exact.abs()
    if acc != out:
        bound = bound + torch.finfo(out).eps / 2 * (exact.abs() + bound)
    return bound


def _reference(
    x: torch.Tensor, op: str, world: int, group=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reference result, bound on tessera's distance to it, bound on torch's) for `x`.

    The reference is computed in float64, which rounds too (for float64 inputs as much as the
    code under test): its own bound is added to both. tessera accumulates bf16/fp16 in float32;
    torch's gloo is only assumed to accumulate in the tensor's own dtype.
    """
    parts, dtype = _gather(x, world, group), x.dtype
    own = _error_bound(parts, op, world, torch.float64, torch.float64)
    tessera_bound = _error_bound(parts, op, world, accumulate_dtype(dtype), dtype) + own
    torch_bound = _error_bound(parts, op, world, dtype, dtype) + own
    return _exact(parts, op, world), tessera_bound, torch_bound


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """|got - want| <= bound elementwise (floats); equality (integers)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.dtype.is_floating_point:
        assert torch.equal(got.long(), want.long()), f"{what}: {got} != {want}"
        return
    error = (got.double() - want.double()).abs()
    worst = int((error - bound).argmax()) if error.numel() else 0
    assert not (error > bound).any(), (
        f"{what}: {int((error > bound).sum())} elements beyond the rounding bound; element "
        f"{worst}: got {got.reshape(-1)[worst].item()}, want {want.reshape(-1)[worst].item()}, "
        f"bound {bound.reshape(-1)[worst].item():.3g}"
    )


def _native(x: torch.Tensor, op: str, world: int, group=None) -> torch.Tensor:
    ops = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
    y = x.clone()
    dist.all_reduce(y, op=getattr(dist.ReduceOp, ops[op]), group=group)
    if op == "mean":
        y = y / world if y.is_floating_point() else torch.div(y, world, rounding_mode="floor")
    return y.to(x.dtype)


def _gather(x: torch.Tensor, world: int, group=None) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return parts


def _check_all_reduce(cases: list[tuple], group=None) -> int:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    for case_id, (algorithm, op, dtype, n, strided) in enumerate(cases):
        x = _values(case_id, rank, n, dtype, op)
        what = (
            f"case #{case_id}: all_reduce {algorithm} {op} {dtype} n={n} strided={strided} "
            f"world={world}"
        )
        want, bound, native_bound = _reference(x, op, world, group)
        native = _native(x, op, world, group)
        if strided:  # a non-contiguous view whose neighbours must stay untouched
            holder = torch.full((n, 2), 7, dtype=dtype)
            target = holder[:, 1]
            target.copy_(x)
        else:
            target = x.clone()
        try:
            out = comm.all_reduce(
                target, op, algorithm=algorithm, group=group, timeout=COLLECTIVE_TIMEOUT_S
            )
        except Exception as exc:
            exc.add_note(f"in {what}")  # a timeout or mismatch names its case too
            raise
        assert out is target, what
        _assert_within(target, want, bound, what + " vs exact")
        # both within their bounds of the reference, so within the sum of each other
        _assert_within(target, native, bound + native_bound, what + " vs torch")
        if strided:
            assert torch.all(holder[:, 0] == 7), what + ": wrote outside the view"
    return len(cases)


def _check_others(world: int, group=None) -> int:
    """reduce, broadcast, all_gather, reduce_scatter against torch's results."""
    rank = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    count = 0
    for case_id, n in enumerate([0, 1, max(1, world - 1), 11, 257]):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for op in ("sum", "max", "mean"):
                x = _values(case_id, rank, n, dtype, op)
                want, bound, _ = _reference(x, op, world, group)
                for k, algorithm in enumerate(("auto", "tree", "master_worker", "native", "ring")):
                    dst = ranks[(case_id + k) % world]
                    y = x.clone()
                    comm.reduce(y, dst, op, algorithm=algorithm, group=group)
                    what = f"reduce {algorithm} {op} {dtype} n={n} dst={dst}"
                    if dist.get_rank() == dst:
                        _assert_within(y, want, bound, what)
                    else:
                        assert torch.equal(y, x), what + ": a non-root's tensor changed"
                    count += 1
            for k, algorithm in enumerate(("auto",) + comm.BROADCAST_ALGORITHMS):
                src = ranks[(case_id + k + 1) % world]
                y = _values(case_id, rank, n, dtype, "sum")
                ref = y.clone()
                dist.broadcast(ref, src, group=group)
                comm.broadcast(y, src, algorithm=algorithm, group=group)
                assert torch.equal(y, ref), f"broadcast {algorithm} {dtype} n={n} src={src}"
                count += 1
            for shape in ((n,), (n, 3), ()):
                if shape == () and n != 1:
                    continue
                x = _values(case_id, rank, max(1, n) * (3 if len(shape) == 2 else 1), dtype, "sum")
                x = x[: torch.Size(shape).numel()].reshape(shape)
                got = comm.all_gather(x, algorithm="ring", group=group)
                parts = _gather(x.reshape(-1, *shape[1:]) if shape else x.reshape(1), world, group)
                assert torch.equal(got, torch.cat(parts)), f"all_gather {dtype} {shape}"
                count += 1
            for rows in (0, 1, world - 1, world + 1, 2 * world + 3):
                op = ("sum", "mean", "max")[rows % 3]
                x = _values(case_id + rows, rank, rows * 2, dtype, op).reshape(rows, 2)
                full, bound, _ = _reference(x, op, world, group)
                got = comm.reduce_scatter(x, op, algorithm="ring", group=group)
                mine, mine_bound = full.tensor_split(world)[rank], bound.tensor_split(world)[rank]
                _assert_within(got, mine, mine_bound, f"reduce_scatter {op} {dtype} rows={rows}")
                count += 1
    return count


def _rank_world(cases: list[tuple], subgroup_ranks: list[int] | None) -> int:
    ctx = tessera.init()
    count = _check_all_reduce(cases) + _check_others(ctx.world_size)
    if subgroup_ranks:
        group = dist.new_group(subgroup_ranks)
        if ctx.rank in subgroup_ranks:
            sub_cases = [c for i, c in enumerate(cases) if i % 4 == 0]
            count += _check_all_reduce(sub_cases, group) + _check_others(len(subgroup_ranks), group)
    dist.barrier()
    return count


def _draw_cases(world: int) -> list[tuple]:
    """One case list drawn by hypothesis, here in the parent: draw only, never shrink."""
    drawn = []

    @settings(max_examples=1, deadline=None, database=None, phases=(Phase.generate,))
    @given(
        random_lengths=st.lists(st.integers(2, 3000), min_size=3, max_size=3),
        strided=st.lists(st.booleans(), min_size=NUM_CASES, max_size=NUM_CASES),
    )
    def draw(random_lengths: list[int], strided: list[bool]) -> None:
        drawn.append(make_cases(world, random_lengths, strided))

    draw()
    return drawn[0]


@pytest.mark.parametrize(
    "world, subgroup",
    [
        (1, None),
        (2, None),
        (3, [0, 2]),
        (4, [2, 3]),
        pytest.param(5, None, marks=pytest.mark.slow),  # subgroups: worlds 3 and 4
    ],
)
def test_collectives_match_torch(world, subgroup):
    cases = _draw_cases(world)
    counts = tessera.launch(
        _rank_world,
        world,
        cases,
        subgroup,
        deadline_s=SPAWN_TIMEOUT_S,
        env=ENV,
    )
    assert counts[0] >= len(cases)


# --------------------------------------------------------------------------- shared buffers
def _rank_shared_buffer() -> list:
    ctx = tessera.init()
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        a = comm.shared_buffer(1000, dtype)
        b = comm.shared_buffer(37, dtype)  # a second bucket must not alias the first
        for op in ("sum", "max", "mean"):
            a.copy_(torch.arange(1000) * (ctx.rank + 1))
            b.fill_(ctx.rank + 1)
            comm.all_reduce(a, op, algorithm="shm")
            comm.all_reduce(b, op)  # auto
            results.append((dtype, op, a.clone(), b.clone()))
    big = torch.ones(3000, dtype=torch.float32) * ctx.rank  # grows the scratch segment
    comm.all_reduce(big, algorithm="shm")
    # every file was unlinked once all ranks had it mapped: nothing of ours is left in /dev/shm
    mine = glob.glob(os.path.join(shm_files.SHM_DIR, f"tessera-*-{os.getpid()}-*"))
    assert mine == [], mine
    results.append(("big", big[0].item(), big[-1].item()))
    return results


def test_shared_buffer_all_reduce():
    world = 3
    results = tessera.launch(_rank_shared_buffer, world, deadline_s=60, env=ENV)
    scale = sum(range(1, world + 1))
    for rank_results in results:
        for entry in rank_results[:-1]:
            dtype, op, a, b = entry
            base = torch.arange(1000).to(torch.float64)
            want_a = {"sum": base * scale, "max": base * world, "mean": base * scale / world}[op]
            want_b = {"sum": scale, "max": world, "mean": scale / world}[op]
            if not dtype.is_floating_point:
                want_a = want_a.floor()
                want_b = float(int(want_b))
            torch.testing.assert_close(a.double(), want_a, rtol=1e-2, atol=0, msg=f"{dtype} {op}")
            assert torch.all(b.double() == want_b), (dtype, op, b[:3])
        assert rank_results[-1] == ("big", float(sum(range(world))), float(sum(range(world))))


# ---------------------------------------------------------------------- timeouts, mismatches
def _rank_absent() -> str:
    ctx = tessera.init()
    comm.all_reduce(torch.ones(8), algorithm="shm")  # the shm group exists on every rank
    if ctx.rank == 2:
        time.sleep(5)  # never joins the next collectives; stays alive past the others' timeout
        return ""
    messages = []
    for algorithm in ("shm", "ring"):
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8), algorithm=algorithm, timeout=1.5)
        except CollectiveTimeout as exc:
            messages.append((str(exc), time.monotonic() - start))
    return messages


def test_timeout_names_the_missing_rank():
    start = time.monotonic()
    results = tessera.launch(_rank_absent, 3, deadline_s=60)
    assert time.monotonic() - start < 30
    for rank in (0, 1):
        assert len(results[rank]) == 2, results[rank]
        for message, seconds in results[rank]:
            assert "rank 2" in message or "[2]" in message, message
            assert f"rank {rank}" in message and "all_reduce" in message, message
            assert seconds < 6, (message, seconds)


def _rank_mismatch() -> list[str]:
    ctx = tessera.init()
    scenarios = [
        ("shape", lambda g: comm.all_reduce(torch.ones(4 + ctx.rank), algorithm="ring", group=g)),
        (
            "op",
            lambda g: comm.all_reduce(
                torch.ones(4), ("sum", "max")[ctx.rank], algorithm="tree", group=g
            ),
        ),
        (
            "dtype",
            lambda g: comm.all_reduce(
                torch.ones(4, dtype=(torch.float32, torch.int64)[ctx.rank]),
                algorithm="butterfly",
                group=g,
            ),
        ),
        (
            "shm-shape",
            lambda g: comm.all_reduce(torch.ones(4 + ctx.rank), algorithm="shm", group=g),
        ),
        (
            "native-shape",
            lambda g: comm.all_reduce(torch.ones(5 - ctx.rank), algorithm="native", group=g),
        ),
        ("gather-shape", lambda g: comm.all_gather(torch.ones(2, 1 + ctx.rank), group=g)),
        (
            "kind",
            lambda g: (
                comm.all_reduce(torch.ones(4), algorithm="tree", group=g)
                if ctx.rank == 0
                else comm.broadcast(torch.ones(4), 0, algorithm="tree", group=g)
            ),
        ),
    ]
    messages = []
    for name, call in scenarios:
        group = dist.new_group([0, 1])  # a fresh group: leftover messages cannot leak across
        try:
            call(group)
            messages.append(f"{name}: no error")
        except CollectiveMismatch as exc:
            messages.append(f"{name}: {exc}")
    dist.barrier()  # no rank exits while the other still waits for a descriptor
    return messages


def test_mismatch_is_reported():
    results = tessera.launch(_rank_mismatch, 2, deadline_s=60, env=ENV)
    for rank_messages in results:
        names = [m.split(":")[0] for m in rank_messages]
        assert names == [
            "shape",
            "op",
            "dtype",
            "shm-shape",
            "native-shape",
            "gather-shape",
            "kind",
        ]
        for message in rank_messages:
            assert "no error" not in message, message
        assert "shape=(4,)" in rank_messages[0] and "shape=(5,)" in rank_messages[0]
        assert "op=sum" in rank_messages[1] and "op=max" in rank_messages[1]
        assert "broadcast" in rank_messages[6] and "all_reduce" in rank_messages[6]


def _rank_history_and_calibration() -> tuple:
    tessera.init()
    comm.all_reduce(torch.ones(3), algorithm="ring")
    comm.broadcast(torch.ones(2), 0)
    records = [(r.seq, r.kind, r.algorithm, r.shape, r.call_site) for r in comm.history()[-2:]]
    params = comm.calibrate(repeats=3)
    chosen = []
    for numel in (1, 1000, 1 << 20):
        x = torch.ones(numel)
        comm.all_reduce(x)  # auto, with the calibrated parameters
        assert torch.all(x == 2)
        chosen.append(comm.history()[-1].algorithm)
    return records, params, chosen


def test_history_records_calls_and_calibration_is_shared():
    results = tessera.launch(_rank_history_and_calibration, 2, deadline_s=60, env=ENV)
    for records, params, chosen in results:
        (seq1, kind1, algo1, shape1, site1), (seq2, kind2, *_rest) = records
        assert (kind1, algo1, shape1, kind2) == ("all_reduce", "ring", (3,), "broadcast")
        assert seq2 == seq1 + 1 and site1.startswith("test_comm.py:")
        assert params == results[0][1]  # rank 0's numbers on every rank
        assert all(getattr(params, k) > 0 for k in ("alpha", "beta", "gamma", "mu", "sigma"))
        assert chosen == results[0][2] and set(chosen) <= set(comm.ALGORITHMS)


def test_bad_arguments_raise_before_any_message():
    x = torch.ones(3)
    with pytest.raises(ValueError, match="op must be"):
        comm.all_reduce(x, "median")
    with pytest.raises(ValueError, match="algorithm must be"):
        comm.all_reduce(x, algorithm="carrier-pigeon")
    with pytest.raises(ValueError, match="algorithm must be"):
        comm.broadcast(x, 0, algorithm="butterfly")


def test_device_tensors_never_reach_shared_memory():
    # "auto" resolves to the backend's own collective (NCCL) for a device tensor, and an explicit
    # "shm" is refused instead of copying device memory through the host. The meta device stands
    # in for CUDA here: the rule looks only at `tensor.device.type`.
    from tessera.comm.api import _for_device

    on_device = torch.empty(4, device="meta")
    assert _for_device(on_device, "auto") == "native"
    assert _for_device(on_device, "ring") == "ring"
    with pytest.raises(ValueError, match="moves host memory"):
        _for_device(on_device, "shm")
    host = torch.empty(4)
    assert _for_device(host, "auto") == "auto" and _for_device(host, "shm") == "shm"
