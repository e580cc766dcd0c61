"""Parameter server: pure clock rules and sharding, one server in-process, then real runs.

The process tests spawn S + W local processes each (RPC over TensorPipe); they are few and group
several checks each: BSP == synchronous data parallelism (an oracle written here as a plain loop),
SSP's bound from the log with a straggler, a wrong token and a lost worker, ASP convergence with a
worker killed, and a BSP failure naming the worker.
"""

from __future__ import annotations

import json
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

from tessera.errors import ConfigError, RankFailedError
from tessera.parameter_server import (
    ASP,
    BSP,
    SSP,
    TOKEN_ENV,
    ConsistencyPolicy,
    GradientShapeError,
    PeerRefused,
    Piece,
    PSResult,
    PSTimeout,
    ShardPlan,
    ShardServer,
    WorkerLost,
    plan_shards,
    resolve_policy,
    run,
    write_metrics,
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
        for w in range(len(speeds)):
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
        server=0,
        pieces=[torch.tensor(values)],
        policy=policy,
        num_workers=num_workers,
        optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.5),
        timeout_s=timeout_s,
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
        (0, 0, 0, 0),
        (1, 0, 0, 0),
    ]


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
        (0, 0, 0),
        (1, 0, 1),
        (0, 1, 1),
    ]
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
    refusal = ps_transport._dispatch("pull", "worker-1", "guess", (1, 0))  # sent back as a value
    assert refusal == ps_transport._Failure(
        "PeerRefused", "worker-1 refused for pull: wrong or missing token"
    )
    assert server.events[-1]["event"] == "refused" and server.events[-1]["peer"] == "worker-1"
    assert 1 not in server._reads  # never served
    assert len(ps_transport._dispatch("pull", "worker-0", "secret", (0, 0))) == 1


def test_merged_log_keeps_the_worst_case_over_servers():
    a = [{"worker": 0, "clock": 1, "min_clock": 1, "staleness": 0, "time": 2.0, "server": 0}]
    b = [{"worker": 0, "clock": 1, "min_clock": 0, "staleness": 2, "time": 1.0, "server": 1}]
    assert merge_logs([a, b]) == [
        {"worker": 0, "clock": 1, "min_clock": 0, "staleness": 2, "time": 2.0}
    ]


# --- real runs: S + W processes ------------------------------------------------------------------
LR = 0.2
STEPS = 3


class _Net(nn.Module):
    """Unlike tessera's models: ModuleDict blocks called one by one, one reused, a weight used
    directly in forward, a one-element unit, and a no_grad forward inside the training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"inp": nn.Linear(5, 7), "mid": nn.Linear(7, 7)})
        self.weight = nn.Parameter(torch.randn(3, 7) * 0.5)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks["inp"](x))
        h = torch.tanh(self.blocks["mid"](h))
        h = torch.tanh(self.blocks["mid"](h))  # called twice
        with torch.no_grad():
            self.blocks["inp"](x)  # an inference forward between this forward and its backward
        return self.scale * F.linear(h, self.weight)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _net_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * worker + step)
    return torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)


def _net_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _synchronous_data_parallel(num_workers: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The oracle: each step, the mean of the W workers' gradients, one SGD step (no momentum)."""
    torch.set_num_threads(1)
    model = _net().to(dtype)
    for step in range(STEPS):
        grads = []
        for worker in range(num_workers):
            x, y = _net_batch(worker, step)
            model.zero_grad()
            _net_loss(model(x.to(dtype)), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * sum(g[i] for g in grads) / num_workers
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_bsp_equals_synchronous_data_parallelism():
    result = run(
        _net,
        _net_loss,
        _net_batch,
        lr=LR,
        num_servers=2,
        num_workers=2,
        consistency="bsp",
        steps=STEPS,
        timeout_s=30,
    )
    oracle32 = _synchronous_data_parallel(2, torch.float32)
    ref64 = _synchronous_data_parallel(2, torch.float64)
    assert result.state_dict.keys() == oracle32.keys()
    for name, ref in ref64.items():
        got, oracle = result.state_dict[name].double(), oracle32[name].double()
        # The servers run the oracle's float32 operations, possibly rounded in another order
        # (other processes, the mean summed on a shard): allow 4x the oracle's own float32 error,
        # plus a few float32 ulps of the parameter per step where the oracle happens to be exact.
        eps = 4 * STEPS * torch.finfo(torch.float32).eps * ref.abs().max().item()
        bound = 4 * (oracle - ref).abs() + eps
        assert ((got - ref).abs() <= bound).all(), (name, (got - ref).abs().max(), bound.min())
        assert not torch.equal(got.float(), _net().state_dict()[name])  # it did train
    records = [(r["worker"], r["clock"], r["min_clock"], r["staleness"]) for r in result.log]
    assert sorted(records) == [(w, c, c, 0) for w in range(2) for c in range(STEPS)]
    assert len(result.updates_per_s) == 2 and all(u > 0 for u in result.updates_per_s)
    assert all(w >= 0 for w in result.wait_s) and result.wall_s > 0 and not result.events


def _bsp_failing_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if worker == 1 and step == 1:
        raise RuntimeError("planted failure in worker 1's data")
    return _net_batch(worker, step)


def test_a_failure_under_bsp_stops_the_run_naming_the_worker():
    with pytest.raises(RankFailedError, match="worker-1: RuntimeError: planted failure"):
        run(
            _net, _net_loss, _bsp_failing_batch, num_servers=1, num_workers=2, steps=4, timeout_s=30
        )


# SSP with a straggler and a peer without the token, in a world started like torchrun would.
SSP_BOUND = 1
SSP_STEPS = 8


def _slow_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if worker == 1:
        time.sleep(0.1)  # the straggler: slow_workers doubles this again
    return _net_batch(worker, step)


def _ssp_rank() -> object:
    rank = int(os.environ["RANK"])
    token = "wrong" if rank == 3 else "shared secret"  # rank 3 = worker 2 lacks the token
    try:
        return run(
            _net,
            _net_loss,
            _slow_batch,
            num_servers=1,
            num_workers=3,
            consistency=SSP(staleness=SSP_BOUND),
            steps=SSP_STEPS,
            slow_workers={1: 2},
            token=token,
            timeout_s=4,
        )
    except PeerRefused as exc:
        return f"refused: {exc}"


def test_ssp_bound_holds_with_a_straggler_and_a_peer_without_the_token(run_ranks):
    server, fast, slow, rogue = run_ranks(_ssp_rank, 4)
    assert rogue.startswith("refused: ") and "worker-2 refused for start_clock" in rogue
    result = server
    assert fast.log == result.log and slow.log == result.log  # every rank has the result
    refused = [e for e in result.events if e["event"] == "refused"]
    assert refused and all(e["peer"] == "worker-2" for e in refused)
    assert result.dropped_workers == [2]  # never authenticated: silent, dropped after 4 s
    assert sorted((r["worker"], r["clock"]) for r in result.log) == [
        (w, c) for w in (0, 1) for c in range(SSP_STEPS)
    ]  # nothing from the refused peer
    leads = [r["clock"] - r["min_clock"] for r in result.log]
    # Worker 0 is ~100x faster than worker 1: it waits at the bound, never past it.
    assert max(leads) == SSP_BOUND, leads
    assert result.wait_s[0] > result.wait_s[1]  # the fast worker is the one held back
    # Where the time went: the straggler (factor 2) slept at least as long as it computed, the
    # others not at all, and wait = pull + push.
    slow = result.phases_s[1]
    assert slow["sleep_s"] >= slow["compute_s"] > 0.1 * SSP_STEPS
    assert result.phases_s[0]["sleep_s"] == 0 and math.isnan(result.phases_s[2]["pull_s"])
    assert result.wait_s[0] == result.phases_s[0]["pull_s"] + result.phases_s[0]["push_s"]
    assert math.isnan(result.updates_per_s[2])


# ASP on a convex problem, one worker killed mid-run.
W_TRUE = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
B_TRUE = 0.7
ASP_STEPS = 40


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, 4))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _linear() -> nn.Module:
    return _Linear()


def _regression_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if worker == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # dies without a word, mid-run
    g = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(64, 4, generator=g)
    return x, F.linear(x, W_TRUE) + B_TRUE  # noise-free: every batch has the same minimum


def test_asp_converges_on_a_convex_problem_after_a_worker_is_killed():
    result = run(
        _linear,
        F.mse_loss,
        _regression_batch,
        lr=LR,
        num_servers=2,
        num_workers=3,
        consistency="asp",
        steps=ASP_STEPS,
        timeout_s=4,
    )
    assert result.dropped_workers == [1]
    assert any(e["event"] == "dropped" and e["worker"] == 1 for e in result.events)
    assert any(e["event"] == "worker_failed" and e["worker"] == 1 for e in result.events)
    counts = {w: sum(r["worker"] == w for r in result.log) for w in range(3)}
    assert counts == {0: ASP_STEPS, 1: 3, 2: ASP_STEPS}
    # Full-batch GD on this problem contracts the error by <= 0.8 per clock (Hessian 2 X^T X / n
    # has eigenvalues in about [1, 3.3] for n = 64, d = 5, lr = 0.2): ~1e-4 after 41 clocks of
    # 3 gradients / 3. 1e-2 leaves 100x for staleness and batch-to-batch variation.
    error = (result.state_dict["weight"] - W_TRUE).norm() + abs(result.state_dict["bias"] - B_TRUE)
    initial = W_TRUE.norm() + B_TRUE
    assert error <= 1e-2 * initial, (error, result.state_dict)
    assert max(r["staleness"] for r in result.log) >= 1  # it did run asynchronously


# Resume from the servers' checkpoints: k steps + restart + k steps == 2k steps straight.
def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _assert_same(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _crashing_net_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if step == 2:
        raise RuntimeError("planted crash at step 2")
    return _net_batch(worker, step)


def test_a_restarted_run_resumes_from_the_server_checkpoints(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    kwargs = dict(
        optimizer_fn=_adamw, num_servers=2, num_workers=1, consistency="bsp", steps=4, timeout_s=30
    )
    full = run(_net, _net_loss, _net_batch, checkpoint_dir=straight, checkpoint_every=2, **kwargs)
    with pytest.raises(RankFailedError, match="planted crash at step 2"):
        run(
            _net,
            _net_loss,
            _crashing_net_batch,
            checkpoint_dir=resumed,
            checkpoint_every=2,
            **kwargs,
        )  # the restarted run finds only the checkpoint after 2 clocks
    again = run(_net, _net_loss, _net_batch, checkpoint_dir=resumed, **kwargs)
    assert sorted(r["clock"] for r in again.log) == [2, 3]  # it did resume, not restart
    _assert_same(again.state_dict, full.state_dict, "params")
    for server in range(2):
        name = f"server-{server}/applied-{4:010d}.pt"
        _assert_same(torch.load(resumed / name), torch.load(straight / name), name)


def test_bad_input_is_refused_before_any_process_starts(monkeypatch):
    args = (_linear, F.mse_loss, _regression_batch)
    with pytest.raises(ConfigError, match="num_servers must be a positive integer, got 0"):
        run(*args, num_servers=0)
    with pytest.raises(ConfigError, match="num_workers must be a positive integer, got 0"):
        run(*args, num_workers=0)
    with pytest.raises(ConfigError, match="unknown consistency 'sync'"):
        run(*args, consistency="sync")
    with pytest.raises(ConfigError, match="staleness must be >= 0"):
        run(*args, consistency=SSP(staleness=-2))
    with pytest.raises(ConfigError, match="slow_workers names worker 5"):
        run(*args, slow_workers={5: 2.0})
    with pytest.raises(ConfigError, match=r"slow_workers\[0\] must be a factor >= 1"):
        run(*args, slow_workers={0: 0.5})
    with pytest.raises(ConfigError, match="checkpoint_every must be an integer >= 0"):
        run(*args, checkpoint_every=-1)
    with pytest.raises(ConfigError, match="keep_checkpoints must be an integer >= 1, got 0"):
        run(*args, keep_checkpoints=0)
    with pytest.raises(ConfigError, match="num_servers=6 exceeds the model's 5 parameter"):
        run(*args, num_servers=6)  # checked on the caller, before spawning
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"1 \+ 3 = 4 must equal the world size 3"):
        run(*args, num_servers=1, num_workers=3)


def test_metrics_file_has_every_gradient_each_worker_and_the_histogram(tmp_path):
    log = [
        {"worker": w, "clock": 0, "min_clock": 0, "staleness": s, "time": 1.0, "loss": 0.5}
        for w, s in ((0, 0), (1, 1), (0, 1))
    ]
    result = PSResult(
        state_dict={},
        log=log,
        events=[],
        updates_per_s=[2.0, math.nan],
        wait_s=[0.1, math.nan],
        wall_s=1.0,
        dropped_workers=[1],
    )
    path = write_metrics(result, tmp_path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["gradient"] * 3 + ["worker"] * 2 + ["staleness_histogram"]
    assert lines[4] == {
        "kind": "worker",
        "worker": 1,
        "dropped": True,
        "updates_per_s": None,
        "wait_s": None,
    }
    assert lines[-1]["counts"] == {"0": 1, "1": 2}  # JSON keys are strings
    assert (tmp_path / "metrics.png").stat().st_size > 0


def test_policies_share_one_protocol_and_plans_are_made_of_pieces():
    policies: list[ConsistencyPolicy] = [BSP(), SSP(staleness=3), ASP()]
    assert [p.staleness_bound for p in policies] == [0, 3, math.inf]
    plan = plan_shards(nn.Linear(4, 3), 2)  # 12 + 3 elements over 2 servers
    assert isinstance(plan, ShardPlan)
    pieces = [piece for shard in plan.shards for piece in shard]
    assert all(isinstance(piece, Piece) for piece in pieces)
    assert sum(piece.stop - piece.start for piece in pieces) == 15
    assert TOKEN_ENV == "TESSERA_PS_TOKEN"  # the name `run`'s docstring gives users


def test_a_read_held_back_too_long_raises_pstimeout_naming_the_slowest_worker():
    server = _server(SSP(0), timeout_s=0.2)
    server.pull(0, 0)
    server.push(0, 0, [torch.zeros(3)], 0.0)
    stop = threading.Event()

    def alive_but_stuck() -> None:  # worker 1 keeps calling (not hung) but never pushes
        while not stop.is_set():
            server.start_clock(1)
            time.sleep(0.02)

    beating = threading.Thread(target=alive_but_stuck)
    beating.start()
    try:
        with pytest.raises(PSTimeout, match="for worker 1 \\(at clock 0\\)"):
            server.pull(0, 1)
    finally:
        stop.set()
        beating.join()


# Periodic checkpoints under ASP: shards saved at different moments resume exactly.
def _gradient(worker: int, clock: int) -> list[torch.Tensor]:
    """Small integers: every sum of them, and lr / W times it, is exact in float32."""
    return [torch.tensor([1.0 + worker, 2.0 * clock, 3.0 - worker - clock])]


def _asp_servers(folder, clocks_done=None):
    servers = []
    for s in range(2):
        server = ShardServer(
            server=s,
            pieces=[torch.tensor([4.0, 8.0, 16.0])],
            policy=ASP(),
            num_workers=2,
            optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.5),
            timeout_s=30.0,
            layout=[("w", 0, 3)],
            checkpoint_dir=str(folder),
            checkpoint_every=1,
            num_servers=2,
        )
        servers.append(server)
    return servers


def _update(server: ShardServer, worker: int, clock: int) -> None:
    server.pull(worker, clock)
    server.push(worker, clock, _gradient(worker, clock), 0.0)


def test_asp_shards_checkpoint_every_n_clocks_and_resume_without_applying_twice(tmp_path):
    from tessera.parameter_server.checkpoint import latest_common_version, load_shard

    # Two shards see the gradients of 2 workers in different orders, then the run crashes.
    first, second = _asp_servers(tmp_path)
    for worker, clock in ((0, 0), (1, 0), (0, 1), (0, 2), (0, 3)):
        _update(first, worker, clock)
    for worker, clock in ((0, 0), (1, 0), (1, 1), (0, 1), (1, 2)):
        _update(second, worker, clock)
    # checkpoint_every=1 clock = W = 2 applied gradients: files at versions 2 and 4.
    assert latest_common_version(tmp_path, 2) == 4
    restarted = _asp_servers(tmp_path)
    for server in restarted:
        server.restore(load_shard(tmp_path, server.server, 4, server.layout))
    assert [s.clocks for s in restarted] == [[3, 1], [2, 2]]  # different gradients on each
    # Each worker restarts from its smallest clock over the servers, and pushes to both.
    starts = [min(s.start_clock(w) for s in restarted) for w in range(2)]
    assert starts == [2, 1]
    for worker in range(2):
        for clock in range(starts[worker], 4):
            for server in restarted:
                _update(server, worker, clock)
    # Every (worker, clock < 4) gradient applied exactly once on each shard: the uninterrupted
    # result, whatever the order (SGD without momentum on exact values).
    total = sum(_gradient(w, c)[0] for w in range(2) for c in range(4))
    expected = torch.tensor([4.0, 8.0, 16.0]) - 0.5 * total / 2
    for server in restarted:
        assert torch.equal(server.pieces[0].detach(), expected), server.server
        assert server.clocks == [4, 4] and server.version == 8
    # Saved again at versions 6 and 8; server 0 saved 8 first, when 6 was the newest version
    # common to both, so it kept 6; server 1 saved 8 when 8 was common, and kept only 8.
    kept = [sorted(f.name for f in (tmp_path / f"server-{s}").iterdir()) for s in range(2)]
    assert kept == [[f"applied-{v:010d}.pt" for v in (6, 8)], [f"applied-{8:010d}.pt"]]


def test_a_kill_while_ps_metrics_are_rewritten_leaves_the_previous_file(tmp_path):
    # A resumed ps run rewrites metrics.jsonl whole; killed half-way, the previous file must
    # remain (a plain write_text left half a file that every later resume failed to read).
    from tessera.checkpoint import atomic
    from tessera.parameter_server import write_metrics
    from tessera.parameter_server.result import PSResult

    def result(clocks: int) -> PSResult:
        log = [{"worker": 0, "clock": c, "min_clock": c, "staleness": 0, "time": 0.0,
                "loss": 1.0} for c in range(clocks)]  # fmt: skip
        return PSResult({}, log, [], [1.0], [0.0], 1.0)

    write_metrics(result(3), tmp_path, plot=False)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    pid = os.fork()
    if pid == 0:  # the child dies by SIGKILL in the middle of the rewrite
        atomic.arm_write_crash(lambda: True)
        write_metrics(result(50), tmp_path, plot=False)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
