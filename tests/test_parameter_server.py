"""Parameter server: pure clock rules and sharding, one server in-process, then real runs.

The process tests spawn S + W local processes each (RPC over TensorPipe); they are few and group
several checks each: BSP == synchronous data parallelism (an oracle written here as a plain loop),
SSP's bound from the log with a straggler, a wrong token and a lost worker, ASP convergence with a
worker killed, and a BSP failure naming the worker.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tessera
from tessera.errors import ConfigError, RankFailedError
from tessera.parameter_server import (
    ASP,
    BSP,
    SSP,
    GradientShapeError,
    PeerRefused,
    ShardServer,
    WorkerLost,
    plan_shards,
    resolve_policy,
    run,
)
from tessera.parameter_server import transport as ps_transport
from tessera.parameter_server.result import merge_logs

# --- policies: pure clock rules ------------------------------------------------------------------
CLOCKS = [(c, m) for c in range(7) for m in range(7)]


def test_bsp_reads_only_when_every_live_worker_reached_the_clock():
    assert [BSP().may_read(c, m) for c, m in CLOCKS] == [m >= c for c, m in CLOCKS]
    assert not BSP().may_read(3, 2)  # one step-2 gradient still missing: clock 3 is not readable
    assert BSP().staleness_bound == 0


def test_asp_never_waits_and_ssp_bounds_the_lead():
    assert all(ASP().may_read(c, m) for c, m in CLOCKS)
    for k in (1, 2, 4):
        assert [SSP(k).may_read(c, m) for c, m in CLOCKS] == [c - m <= k for c, m in CLOCKS]
        assert SSP(k).may_read(5, 5 - k) and not SSP(k).may_read(5, 4 - k)  # exactly at the bound
    # K = 0 is BSP, K = inf is ASP.
    assert [SSP(0).may_read(c, m) for c, m in CLOCKS] == [BSP().may_read(c, m) for c, m in CLOCKS]
    assert [SSP(math.inf).may_read(c, m) for c, m in CLOCKS] == [True] * len(CLOCKS)


def _simulate(policy, speeds: list[int], ticks: int) -> list[tuple[int, int]]:
    """W workers, worker w finishing an update every speeds[w] ticks, gated by `policy`."""
    clocks = [0] * len(speeds)
    busy_until = [None] * len(speeds)  # tick when the update in progress completes
    reads = []
    for tick in range(ticks):
        for w, speed in enumerate(speeds):
            if busy_until[w] == tick:
                clocks[w] += 1
                busy_until[w] = None
        for w, speed in enumerate(speeds):
            if busy_until[w] is None and policy.may_read(clocks[w], min(clocks)):
                reads.append((clocks[w], min(clocks)))
                busy_until[w] = tick + speed
    return reads


@pytest.mark.parametrize("policy,bound", [(BSP(), 0), (SSP(1), 1), (SSP(3), 3), (ASP(), None)])
def test_a_straggler_simulation_reaches_but_never_passes_the_bound(policy, bound):
    reads = _simulate(policy, speeds=[1, 1, 5], ticks=60)
    lead = max(c - m for c, m in reads)
    if bound is None:
        assert lead > 5  # ASP lets the fast workers run far ahead
    else:
        assert lead == bound  # reached (the straggler is slow enough) and never passed


def test_policy_names_and_bad_values():
    assert resolve_policy("bsp") == BSP() and resolve_policy("ASP") == ASP()
    assert resolve_policy("ssp") == SSP(staleness=2)
    assert resolve_policy(SSP(staleness=4)) == SSP(4)
    with pytest.raises(ConfigError, match="unknown consistency 'hogwild'"):
        resolve_policy("hogwild")
    with pytest.raises(ConfigError, match="staleness must be >= 0, got -1"):
        SSP(staleness=-1)
    with pytest.raises(ConfigError, match="whole number"):
        SSP(staleness=1.5)
    with pytest.raises(ConfigError, match="policy object"):
        resolve_policy(3)


# --- sharding: by bytes, a large tensor split ---------------------------------------------------
class _Shapes(nn.Module):
    def __init__(self, shapes, dtypes=None):
        super().__init__()
        dtypes = dtypes or [torch.float32] * len(shapes)
        self.params = nn.ParameterList(
            nn.Parameter(torch.randn(s).to(d)) for s, d in zip(shapes, dtypes)
        )


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 6), min_size=0, max_size=3), min_size=1, max_size=5),
    num_servers=st.integers(1, 5),
    doubles=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_shards_cover_every_element_once_with_equal_bytes(shapes, num_servers, doubles):
    dtypes = [torch.float64 if d else torch.float32 for d in doubles[: len(shapes)]]
    model = _Shapes(shapes, dtypes)
    numel = sum(p.numel() for p in model.parameters())
    if num_servers > numel:
        with pytest.raises(ConfigError, match="would own nothing"):
            plan_shards(model, num_servers)
        return
    try:
        plan = plan_shards(model, num_servers)
    except ConfigError as exc:  # rounding to whole elements can empty a server of a tiny model
        assert "would own nothing" in str(exc)
        return
    params = list(model.parameters())
    covered = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
    for shard in plan.shards:
        for piece in shard:
            covered[piece.param_index][piece.start : piece.stop] += 1
    assert all(bool((c == 1).all()) for c in covered)
    total = sum(p.numel() * p.element_size() for p in params)
    for shard in plan.shards:
        nbytes = sum(piece.numel * params[piece.param_index].element_size() for piece in shard)
        assert abs(nbytes - total / num_servers) <= 8  # within one (largest) element, by rounding
    pieces = [plan.gather(s, params) for s in range(num_servers)]
    assembled = plan.assemble(pieces)
    for name, param in model.named_parameters():
        assert torch.equal(assembled[name], param.detach())


def test_a_large_tensor_is_split_and_scatter_writes_back():
    model = _Shapes([(3,), (100,), (2,)])  # 105 elements over 3 servers: 35 each
    plan = plan_shards(model, 3)
    assert [sum(p.numel for p in shard) for shard in plan.shards] == [35, 35, 35]
    assert sum(1 for shard in plan.shards for p in shard if p.name == "params.1") == 3
    target = [torch.zeros_like(p) for p in model.parameters()]
    for s in range(3):
        plan.scatter(s, plan.gather(s, list(model.parameters())), target)
    assert all(torch.equal(t, p.detach()) for t, p in zip(target, model.parameters()))
    with pytest.raises(ConfigError, match="num_servers=106 exceeds"):
        plan_shards(model, 106)


# --- one server, in-process --------------------------------------------------------------------
def _server(policy, num_workers=2, timeout_s=30.0, values=(1.0, 2.0, 3.0)):
    return ShardServer(
        server=0, pieces=[torch.tensor(values)], policy=policy, num_workers=num_workers,
        optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.5), timeout_s=timeout_s,
    )


def test_bsp_server_applies_the_mean_once_per_clock():
    server = _server(BSP())
    start = server.pull(0, 0)[0]
    server.pull(1, 0)
    server.push(0, 0, [torch.tensor([1.0, 0.0, 2.0])], 0.0)
    assert torch.equal(server.pieces[0].detach(), start)  # one of two gradients: nothing applied
    server.push(1, 0, [torch.tensor([3.0, 2.0, 0.0])], 0.0)
    assert torch.equal(server.pieces[0].detach(), start - 0.5 * torch.tensor([2.0, 1.0, 1.0]))
    assert [(r["worker"], r["clock"], r["min_clock"], r["staleness"]) for r in server.log] == [
        (0, 0, 0, 0), (1, 0, 0, 0)]


def test_asp_server_applies_each_gradient_scaled_and_counts_staleness():
    server = _server(ASP())
    start = server.pull(0, 0)[0]
    server.pull(1, 0)
    server.push(0, 0, [torch.tensor([2.0, 2.0, 2.0])], 0.0)
    assert torch.equal(server.pieces[0].detach(), start - 0.5 * torch.tensor([1.0, 1.0, 1.0]))
    server.pull(0, 1)
    server.push(1, 0, [torch.tensor([2.0, 0.0, 0.0])], 0.0)  # read before worker 0's apply
    server.push(0, 1, [torch.tensor([0.0, 0.0, 2.0])], 0.0)
    assert [(r["worker"], r["clock"], r["staleness"]) for r in server.log] == [
        (0, 0, 0), (1, 0, 1), (0, 1, 1)]
    assert torch.equal(server.pieces[0].detach(), start - 0.5 * torch.tensor([2.0, 1.0, 2.0]))


def test_ssp_server_holds_a_read_until_the_slowest_catches_up():
    server = _server(SSP(1))
    for clock in range(2):  # worker 0 runs two clocks ahead of worker 1
        server.pull(0, clock)
        server.push(0, clock, [torch.zeros(3)], 0.0)
    done = threading.Event()
    reader = threading.Thread(target=lambda: (server.pull(0, 2), done.set()), daemon=True)
    reader.start()
    assert not done.wait(0.5)  # clock 2 - min 0 > 1: held back
    server.pull(1, 0)
    server.push(1, 0, [torch.zeros(3)], 0.0)  # the slowest reaches 1: 2 - 1 <= 1
    assert done.wait(10)
    reader.join()


def test_a_wrong_shape_is_refused_naming_the_worker_and_others_are_served():
    server = _server(ASP())
    server.pull(0, 0)
    server.pull(1, 0)
    with pytest.raises(GradientShapeError, match="gradient from worker 1 refused"):
        server.push(1, 0, [torch.zeros(4)], 0.0)
    assert server.events[-1]["event"] == "refused_gradient" and server.events[-1]["worker"] == 1
    server.push(0, 0, [torch.ones(3)], 0.0)
    assert [r["worker"] for r in server.log] == [0]


def test_a_silent_worker_is_dropped_under_ssp_and_fatal_under_bsp():
    server = _server(SSP(1), timeout_s=0.3)
    server.pull(0, 0)
    server.push(0, 0, [torch.zeros(3)], 0.0)
    server.pull(0, 1)
    server.push(0, 1, [torch.zeros(3)], 0.0)
    server.pull(0, 2)  # waits for worker 1 (clock 0), silent: dropped, then the read goes on
    assert server.dropped == {1} and server.events[-1]["event"] == "dropped"
    assert server._reads[0].min_clock == 2  # the bound counts live workers only
    with pytest.raises(PeerRefused, match="worker 1 was dropped"):
        server.pull(1, 0)
    bsp = _server(BSP(), timeout_s=0.3)
    bsp.pull(0, 0)
    bsp.push(0, 0, [torch.zeros(3)], 0.0)
    with pytest.raises(WorkerLost, match="worker 1 silent .* during pull of clock 1 by worker 0"):
        bsp.pull(0, 1)


def test_a_wrong_token_is_refused_and_logged_before_the_server_is_touched(monkeypatch):
    server = _server(ASP())
    monkeypatch.setattr(ps_transport, "_SERVED", server)
    monkeypatch.setattr(ps_transport, "_TOKEN", "secret")
    with pytest.raises(PeerRefused, match="worker-1 refused for pull"):
        ps_transport._dispatch("pull", "worker-1", "guess", (1, 0))
    assert server.events[-1]["event"] == "refused" and server.events[-1]["peer"] == "worker-1"
    assert 1 not in server._reads  # never served
    assert len(ps_transport._dispatch("pull", "worker-0", "secret", (0, 0))) == 1


def test_merged_log_keeps_the_worst_case_over_servers():
    a = [{"worker": 0, "clock": 1, "min_clock": 1, "staleness": 0, "time": 2.0, "server": 0}]
    b = [{"worker": 0, "clock": 1, "min_clock": 0, "staleness": 2, "time": 1.0, "server": 1}]
    assert merge_logs([a, b]) == [
        {"worker": 0, "clock": 1, "min_clock": 0, "staleness": 2, "time": 2.0}]
