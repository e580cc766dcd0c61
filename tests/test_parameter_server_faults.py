"""Parameter server under faults: hung workers, crashes between checkpoints, resumes, and peers.

In-process checks drive `ShardServer`s directly (cheap, deterministic); the rest spawn real runs:
an ASP and an SSP run resumed from two servers' shards that hold different gradients (as a crash
leaves them), checked per (worker, clock) and per server, and the trust model of the RPC world.

The resume runs use a probe model whose gradient does not depend on the parameters: the gradient
of worker w's update c is 4^(w * STEPS + c) in every element, so the final value of every element
of a shard spells, digit by digit in base 4, how many times that shard applied each (worker,
clock) gradient (float32 sums of these are exact). "Exactly once on every server" is then read off
the result instead of being inferred from a matching total.
"""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

from tessera.errors import CheckpointError
from tessera.parameter_server import ASP, BSP, SSP, PeerRefused, ShardServer, WorkerLost, run
from tessera.parameter_server import api as ps_api
from tessera.parameter_server import checkpoint as ps_checkpoint
from tessera.parameter_server import server as ps_server
from tessera.parameter_server.sharding import plan_shards
from tessera.parameter_server.transport import Transport

# --- item 17: a worker that hangs while its heartbeat thread lives ------------------------------


def _one_shard(policy, timeout_s, folder=None, every=0, server=0, num_workers=2):
    return ShardServer(
        server=server,
        pieces=[torch.zeros(3)],
        policy=policy,
        num_workers=num_workers,
        optimizer_fn=lambda ps: torch.optim.SGD(ps, lr=0.5),
        timeout_s=timeout_s,
        layout=[("w", 3 * server, 3 * server + 3)],
        checkpoint_dir=None if folder is None else str(folder),
        checkpoint_every=every,
        num_servers=2,
    )


@pytest.mark.parametrize("policy", [ASP(), SSP(1), BSP()], ids=["asp", "ssp", "bsp"])
def test_a_worker_hung_with_a_live_heartbeat_is_dropped_or_named_not_waited_for(policy):
    server = _one_shard(policy, timeout_s=0.2)
    server.pull(0, 0)
    server.push(0, 0, [torch.ones(3)], 0.0)
    server.finish(0)
    server.pull(1, 0)  # worker 1 reads clock 0, then hangs computing; its heartbeat goes on
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.is_set():
            try:
                server.heartbeat(1)
            except PeerRefused:  # dropped: the worker's heartbeat thread ignores it, as here
                pass
            time.sleep(0.02)

    outcome: list[object] = []

    def wait() -> None:
        try:
            server.wait_finished()
            outcome.append("finished")
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(exc)

    beating = threading.Thread(target=heartbeat, daemon=True)
    waiting = threading.Thread(target=wait, daemon=True)
    beating.start()
    waiting.start()
    waiting.join(timeout=10)
    stop.set()
    beating.join()
    assert outcome, "wait_finished still waiting for a hung worker after 10 s"
    if policy == BSP():  # the others cannot go on: an error naming the worker and what it did
        (error,) = outcome
        assert isinstance(error, WorkerLost) and error.worker == 1
        assert "worker 1 made no progress" in str(error)
        assert "heartbeats only" in str(error) and "last call: pull of clock 0" in str(error)
        assert "waiting for the workers to finish" in str(error)
    else:  # dropped like a dead worker, and the event says why
        assert outcome == ["finished"] and server.dropped == {1}
        (dropped,) = [e for e in server.events if e["event"] == "dropped"]
        assert "made no progress" in dropped["reason"]
        assert "last call: pull of clock 0" in dropped["reason"]


def _hanging_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if worker == 1 and step == 1:
        time.sleep(60)  # hangs (for the test's purpose) while its heartbeat thread beats on
    return _plain_batch(worker, step)


def test_a_run_goes_on_without_a_worker_that_hangs_with_a_live_heartbeat():
    started = time.monotonic()
    result = run(
        _probe,
        _probe_loss,
        _hanging_batch,
        lr=0.5,
        num_servers=1,
        num_workers=2,
        consistency="asp",
        steps=3,
        timeout_s=2,
    )
    assert time.monotonic() - started < 50  # not the 60 s of the hang
    assert result.dropped_workers == [1]
    (dropped,) = [e for e in result.events if e["event"] == "dropped"]
    assert "worker 1 made no progress" in dropped["reason"]
    assert "last call: pull of clock 1" in dropped["reason"]
    assert sorted((r["worker"], r["clock"]) for r in result.log) == [(0, 0), (0, 1), (0, 2), (1, 0)]


# --- item 18: checkpoints that always keep a version common to all servers ---------------------


def _update(server: ShardServer, worker: int, clock: int) -> None:
    server.pull(worker, clock)
    server.push(worker, clock, [torch.full((3,), 4.0 ** (worker * 4 + clock))], 0.0)


def _versions(folder: Path, server: int) -> list[int]:
    return sorted(int(f.name[8:18]) for f in (folder / f"server-{server}").glob("applied-*.pt"))


def _restart(folder: Path) -> list[ShardServer]:
    """What `run` does on a restart: both servers restore the newest common version."""
    servers = [_one_shard(ASP(), 30.0, folder, every=1, server=s) for s in range(2)]
    versions = [ps_checkpoint.resume_version(folder, 2, s.server) for s in servers]
    for server, version in zip(servers, versions):
        server.restore(ps_checkpoint.load_shard(folder, server.server, version, server.layout))
    return servers


def _resume(servers: list[ShardServer], updates) -> None:
    """Workers resumed from their smallest clock push to every server; applied ones are skipped."""
    for worker, clock in updates:
        for server in servers:
            _update(server, worker, clock)


def test_a_crash_after_resume_still_finds_a_version_common_to_all_servers(tmp_path):
    # ASP, 2 servers, 2 workers, a save every 2 applied gradients.
    servers = [_one_shard(ASP(), 30.0, tmp_path, every=1, server=s) for s in range(2)]
    _resume(servers, ((0, 0), (1, 0), (0, 1), (1, 1)))
    _update(servers[0], 1, 2)  # worker 1 dies between its pushes to server 0 and server 1
    _resume(servers, ((0, 2), (0, 3)))
    for server in servers:  # the end of the run
        server.save_checkpoint()
    assert [_versions(tmp_path, s)[-1] for s in range(2)] == [7, 6]
    assert ps_checkpoint.latest_common_version(tmp_path, 2) == 6

    resumed = _restart(tmp_path)
    assert [s.clocks for s in resumed] == [[3, 3], [4, 2]]
    assert _versions(tmp_path, 0)[-1] == 6  # server 0's version 7 belongs to the abandoned run
    starts = [min(s.clocks[w] for s in resumed) for w in range(2)]
    assert starts == [3, 2]
    _resume(resumed, ((0, 3), (1, 2)))
    _update(resumed[0], 1, 3)  # server 0 reaches version 8 and saves; then the run crashes
    assert _versions(tmp_path, 0)[-1] == 8 and _versions(tmp_path, 1)[-1] == 7 - 1
    # Before the fix that save pruned version 6 (keeping 7 and 8): no common version was left.
    assert ps_checkpoint.latest_common_version(tmp_path, 2) == 6

    again = _restart(tmp_path)
    assert [s.clocks for s in again] == [[3, 3], [4, 2]]
    _resume(again, ((0, 3), (1, 2), (1, 3)))
    for server in again:
        server.save_checkpoint()
    assert ps_checkpoint.latest_common_version(tmp_path, 2) == 8
    # Once a newer version is common to all servers, the older ones go.
    assert _versions(tmp_path, 0) == [8] and _versions(tmp_path, 1) == [8]
    expected = -0.5 / 2 * sum(4.0 ** (w * 4 + c) for w in range(2) for c in range(4))
    for server in again:
        assert torch.equal(server.pieces[0].detach(), torch.full((3,), expected))
        assert server.clocks == [4, 4] and server.version == 8


def test_a_crash_before_every_server_saved_starts_afresh_without_the_crashed_files(tmp_path):
    server = _one_shard(ASP(), 30.0, tmp_path, every=1, server=0)
    for worker, clock in ((0, 0), (1, 0)):
        _update(server, worker, clock)  # server 0 saves version 2; server 1 never saved
    assert _versions(tmp_path, 0) == [2]
    assert ps_checkpoint.latest_common_version(tmp_path, 2) is None
    assert [ps_checkpoint.resume_version(tmp_path, 2, s) for s in (0, 1)] == [None, None]
    assert _versions(tmp_path, 0) == []  # a later version 2 of the new run cannot mix with it


def test_no_common_version_is_still_refused_by_name(tmp_path):
    for server, version in ((0, 2), (1, 4)):
        (tmp_path / f"server-{server}").mkdir()
        (tmp_path / f"server-{server}" / f"applied-{version:010d}.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="share no version"):
        ps_checkpoint.latest_common_version(tmp_path, 2)


def test_a_long_save_does_not_hold_the_server_lock(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    real_save = ps_server.save_shard

    def slow_save(*args, **kwargs):
        started.set()
        assert release.wait(20), "the test never released the save"
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ps_server, "save_shard", slow_save)
    server = _one_shard(ASP(), 30.0, tmp_path, every=1)
    _update(server, 0, 0)
    saver = threading.Thread(target=_update, args=(server, 1, 0), daemon=True)  # saves version 2
    saver.start()
    try:
        assert started.wait(10)
        answered = threading.Event()
        threading.Thread(
            target=lambda: (server.heartbeat(1), server.pull(0, 1), answered.set()), daemon=True
        ).start()
        assert answered.wait(2), "heartbeat and pull blocked by a save in progress"
    finally:
        release.set()
        saver.join(10)
    assert _versions(tmp_path, 0) == [2]
    saved = torch.load(tmp_path / "server-0" / f"applied-{2:010d}.pt", weights_only=False)
    assert saved["clocks"] == [1, 1] and saved["version"] == 2  # the state at the save point


# --- the suite gap: resume an ASP/SSP run with 2 servers through `run(...)` ---------------------
STEPS = 4
WORKERS = 2


class _Probe(nn.Module):
    """A gradient that does not depend on the parameters: d(sum(x * w))/dw = sum of x's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _probe() -> nn.Module:
    return _Probe()


def _probe_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _digit(worker: int, clock: int) -> float:
    return 4.0 ** (worker * STEPS + clock)


def _recorded_batch(folder: str, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Record the computation (and this process's listening sockets), then the probe's batch."""
    Path(folder, f"computed-{worker}-{step}").touch()
    if step == 0 or not Path(folder, f"listening-{worker}").exists():
        Path(folder, f"listening-{worker}").write_text("\n".join(_listening_addresses()))
    return torch.full((1, 4), _digit(worker, step)), torch.zeros(1)


def _listening_addresses() -> list[str]:
    """The local addresses of this process's listening TCP sockets (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, words))
    return found


def _interface_with_address() -> str | None:
    """A network interface other than loopback that has an IPv4 address, if the machine has one."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # SIOCGIFADDR: the interface's address, or an error if it has none
                fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        return name
    return None


def _applied_counts(value: float) -> dict[tuple[int, int], int]:
    """Decode a probe element (start 0, SGD lr 0.5, 1/W per gradient) into base-4 digits."""
    total = round(-value * 2 * WORKERS)  # -value = lr / W x the sum of the applied gradients
    counts = {}
    for index in range(WORKERS * STEPS):
        counts[(index // STEPS, index % STEPS)] = total % 4
        total //= 4
    assert total == 0, value
    return counts


def _crashed_checkpoint(folder: Path) -> list[list[int]]:
    """Two servers' shards as a crash leaves them under ASP: the same count of gradients applied
    (version 4), but not the same ones. Written by `ShardServer`s driven here, with the layout,
    optimizer and gradients of the run that resumes them."""
    plan = plan_shards(_probe(), 2)
    params = list(_probe().parameters())
    orders = [((0, 0), (1, 0), (0, 1), (0, 2)), ((0, 0), (1, 0), (1, 1), (0, 1))]
    clocks = []
    for s, order in enumerate(orders):
        server = ShardServer(
            server=s,
            pieces=plan.gather(s, params),
            policy=ASP(),
            num_workers=WORKERS,
            optimizer_fn=functools.partial(torch.optim.SGD, lr=0.5),
            timeout_s=30.0,
            layout=[(p.name, p.start, p.stop) for p in plan.shards[s]],
            checkpoint_dir=str(folder),
            checkpoint_every=1,
            num_servers=2,
        )
        for worker, clock in order:
            server.pull(worker, clock)
            grads = plan.gather(s, [torch.full((4,), _digit(worker, clock))])
            server.push(worker, clock, grads, 0.0)
        clocks.append(list(server.clocks))
    return clocks


@pytest.mark.parametrize("consistency", ["asp", SSP(staleness=1)], ids=["asp", "ssp"])
def test_a_resumed_asp_or_ssp_run_applies_every_gradient_once_on_every_server(
    tmp_path, monkeypatch, consistency
):
    ckpt, record = tmp_path / "servers", tmp_path / "record"
    record.mkdir()
    assert _crashed_checkpoint(ckpt) == [[3, 1], [2, 2]]
    stale = ckpt / "server-0" / f"applied-{5:010d}.pt"  # newer than the common 4: the crashed run's
    stale.write_bytes((ckpt / "server-0" / f"applied-{4:010d}.pt").read_bytes())
    # A machine whose TensorPipe would listen on a network interface: a local run still must not.
    interface = _interface_with_address()
    if interface is not None:
        monkeypatch.setenv("TP_SOCKET_IFNAME", interface)
    result = run(
        _probe,
        _probe_loss,
        functools.partial(_recorded_batch, str(record)),
        lr=0.5,
        num_servers=2,
        num_workers=WORKERS,
        consistency=consistency,
        steps=STEPS,
        timeout_s=30,
        checkpoint_dir=ckpt,
    )
    # The result, per server: every (worker, clock) gradient applied exactly once on each shard.
    weight = result.state_dict["weight"]
    for server, elements in enumerate((weight[:2], weight[2:])):
        for value in elements.tolist():
            counts = _applied_counts(value)
            assert counts == {key: 1 for key in counts}, (server, counts)
    for server in range(2):
        final = torch.load(ckpt / f"server-{server}" / f"applied-{8:010d}.pt", weights_only=False)
        assert final["clocks"] == [STEPS, STEPS] and final["version"] == WORKERS * STEPS
    assert not stale.exists()
    # The work: each worker computed from its smallest saved clock over the servers, once each.
    computed = sorted(tuple(map(int, f.name.split("-")[1:])) for f in record.glob("computed-*"))
    assert computed == [(0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert not result.dropped_workers and not result.events
    # Spawned on one machine, the RPC world listens on loopback only.
    for worker in range(WORKERS):
        addresses = (record / f"listening-{worker}").read_text().split()
        assert addresses and all(a in ("127.0.0.1", "::1") for a in addresses), addresses


# --- item 1: the trust model ---------------------------------------------------------------------


def _trust_rank() -> object:
    rank = int(os.environ["RANK"])
    if rank < 2:  # server-0 and worker-0 of a run whose token is "ours"
        return run(
            _probe,
            _probe_loss,
            _plain_batch,
            lr=0.5,
            num_servers=1,
            num_workers=2,
            consistency="asp",
            steps=2,
            token="ours",
            timeout_s=3,
        )
    # Rank 2 = worker-1 of the world, started with another run's token.
    transport = Transport(
        rank=rank,
        world_size=3,
        num_servers=1,
        init_method=ps_api._world_init_method(),
        token="another run's",
        rpc_timeout_s=9,
    )
    try:
        try:
            transport.call(0, "start_clock", 1)
            refused = ""
        except PeerRefused as exc:
            refused = str(exc)
        # Not a security boundary: any peer of the RPC world can run code on a server.
        server_pid = rpc.rpc_sync("server-0", os.getpid, timeout=9)
        return refused, server_pid, os.getpid()
    finally:
        transport.shutdown()


def _plain_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((1, 4), _digit(worker, step)), torch.zeros(1)


def test_a_worker_of_another_run_is_refused_but_the_token_is_no_security_boundary(run_ranks):
    server, worker, (refused, server_pid, own_pid) = run_ranks(_trust_rank, 3)
    assert "worker-1 refused for start_clock: wrong or missing token" in refused
    assert server.dropped_workers == [1]  # never served, then silent: dropped
    assert sorted((r["worker"], r["clock"]) for r in server.log) == [(0, 0), (0, 1)]
    assert any(e["event"] == "refused" and e["peer"] == "worker-1" for e in server.events)
    assert worker.log == server.log
    # What the README states: the RPC world is a trusted network.
    assert server_pid != own_pid
