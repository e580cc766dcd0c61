"""Shared memory's trust boundary: file names, squatters, SIGTERM, dead jobs, the same-host probe.

/dev/shm is shared by every user and container of a host. These tests play the stranger (a file
pre-created at a name tessera would draw), the launcher (SIGTERM in the middle of set-up), a
dead job (files of a pid that no longer runs) and ranks that share a host name but not a
/dev/shm (one rank's `SHM_DIR` pointed elsewhere), and check every result against
torch.distributed's or a plain PyTorch loop's.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tessera
from tessera import comm
from tessera.comm.shm import atomics, segments
from tessera.comm.shm import files as shm_files
from tessera.zero import full_state_dict, initialize

SPAWN_TIMEOUT_S = 90
ENV = {"TESSERA_TIMEOUT_S": "20"}  # a hang is reported in 20 s, not 5 minutes
NAME = re.compile(r"^tessera-(\d+)-(\d+)-([0-9a-f]{32})\.(control|seg|pipe)$")
SQUATTED = b"a stranger's file"


def _ours(pid: int, directory: str | None = None) -> list[str]:
    """Files in /dev/shm (or `directory`) named after process `pid`."""
    return sorted(glob.glob(os.path.join(directory or shm_files.SHM_DIR, f"tessera-*-{pid}-*")))


def _namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ------------------------------------------------------------------------- no processes
def test_the_transport_package_exports_what_the_old_module_did():
    # tessera.comm.shm was one module; as a package it re-exports the names callers imported
    from tessera.comm import shm
    from tessera.comm.shm import channel, group

    assert (shm.ShmGroup, shm.shm_group) == (group.ShmGroup, group.shm_group)
    assert (shm.Endpoint, shm.ring_available) == (channel.Endpoint, channel.ring_available)


def test_words_read_and_write_the_mapping_in_every_mode():
    raw_map = mmap.mmap(-1, 4096)
    raw = torch.frombuffer(raw_map, dtype=torch.uint8)
    view = memoryview(raw_map)
    modes = ["x86-tso"] + (["atomics"] if atomics.MODE == "atomics" else [])
    for k, mode in enumerate(modes):
        words = atomics.Words(raw, view, mode)
        words.store(64, 12345 + k)
        words.store(80, -7)
        plain = view.cast("q")
        assert (plain[64], plain[80], plain[63], plain[65]) == (12345 + k, -7, 0, 0), mode
        plain[81] = 99
        assert words.load(81) == 99 and words.load(64) == 12345 + k, mode
        del plain
    with pytest.raises(ValueError, match="no ordered"):
        atomics.Words(raw, view, None)


def test_ordering_mode_refuses_unordered_machines():
    assert atomics.ordering_mode("aarch64", have_atomics=True) == "atomics"
    assert atomics.ordering_mode("x86_64", have_atomics=False) == "x86-tso"
    assert atomics.ordering_mode("aarch64", have_atomics=False) is None
    assert atomics.ordering_mode("ppc64le", have_atomics=False) is None


def test_peer_files_of_the_wrong_kind_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_files, "SHM_DIR", str(tmp_path))
    name, fd = shm_files.create_file("seg", 4096)
    os.close(fd)
    assert os.stat(tmp_path / name).st_mode & 0o777 == 0o600
    with pytest.raises(PermissionError, match="not a private pipe"):
        shm_files.open_checked(name, os.O_RDWR, fifo=True)
    os.chmod(tmp_path / name, 0o644)
    with pytest.raises(PermissionError, match="not a private file"):
        shm_files.open_checked(name, os.O_RDWR, fifo=False)
    with pytest.raises(ValueError, match="not a tessera shared-memory name"):
        shm_files.open_checked("../etc/passwd", os.O_RDONLY, fifo=False)
    shm_files.unlink(name)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_handler_unlinks_then_chains(tmp_path, monkeypatch):
    # one SIGTERM chain per process (tessera.runtime.signals): the cleanups, then the handler
    # that was there before (called; SIG_IGN: the process lives on)
    from tessera.runtime import signals

    monkeypatch.setattr(shm_files, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(signals, "_cleanups", [])
    monkeypatch.setattr(signals, "_installed", True)  # the handler is called by hand below
    shm_files.install_sigterm_cleanup()
    calls = []
    for previous in (lambda signum, frame: calls.append(signum), signal.SIG_IGN):
        name, fd = shm_files.create_file("seg", 64)
        os.close(fd)
        monkeypatch.setattr(signals, "_previous", previous)
        signals._handle(signal.SIGTERM, None)
        assert not (tmp_path / name).exists()
    assert calls == [signal.SIGTERM]


# ---------------------------------------------- names, squatters, dead jobs (one spawn)
def _token_source(squat_tokens: list[str]):
    """`secrets.token_hex` that draws a squatted token before every real one."""
    pending = [t for token in squat_tokens for t in (token, None)]
    real = secrets.token_hex

    def token_hex(nbytes: int | None = None) -> str:
        token = pending.pop(0) if pending else None
        return token if token is not None else real(nbytes)

    return token_hex


def _rank_files(stale: list[str]) -> dict:
    ctx = tessera.init()
    torch.set_num_threads(1)
    drawn: list[str] = []
    new_name = shm_files._new_name

    def recording(kind: str) -> str:
        drawn.append(new_name(kind))
        return drawn[-1]

    with mock.patch.object(shm_files, "_new_name", recording):
        sums = []
        for n in (1000, 5000, 30000):  # the copy-in segment grows twice
            x = torch.arange(n, dtype=torch.float32) * (ctx.rank + 1)
            comm.all_reduce(x, algorithm="shm")
            sums.append(x)
        shared = comm.shared_buffer(300)
        shared.fill_(ctx.rank + 1)
        comm.all_reduce(shared)
        sums.append(shared.clone())
    stale_left = sorted(n for n in stale if os.path.exists(os.path.join("/dev/shm", n)))

    # A stranger pre-created a file at every name ranks 0 and 1 draw first for each new file.
    squatters, squat_tokens = [], []
    if ctx.rank in (0, 1):
        for _ in range(6):
            token = secrets.token_hex(16)
            squat_tokens.append(token)
            for kind in ("pipe", "control", "seg"):
                path = f"/dev/shm/tessera-{_namespace()}-{os.getpid()}-{token}.{kind}"
                Path(path).write_bytes(SQUATTED)
                squatters.append(path)
    with mock.patch.object(shm_files.secrets, "token_hex", _token_source(squat_tokens)):
        group = dist.new_group(list(range(ctx.world_size)))
        squatted_same_host = comm.same_host(group)
        z = torch.full((3000,), float(ctx.rank + 1))
        comm.all_reduce(z, algorithm="shm", group=group)
        b = torch.full((7,), float(ctx.rank))
        comm.broadcast(b, 2, algorithm="shm", group=group)
    intact = all(Path(p).read_bytes() == SQUATTED for p in squatters)
    for path in squatters:
        os.unlink(path)
    dist.barrier()
    return {
        "pid": os.getpid(),
        "drawn": drawn,
        "sums": sums,
        "stale_left": stale_left,
        "squatted_same_host": squatted_same_host,
        "z": z,
        "b": b,
        "squatters_intact": intact,
        "leftovers": _ours(os.getpid()),
    }


def test_names_are_random_squatters_are_skipped_and_dead_jobs_swept(run_ranks):
    world, ns = 3, _namespace()
    dead = _dead_pid()
    stale = [f"tessera-{ns}-{dead}-{secrets.token_hex(16)}.{kind}" for kind in ("seg", "pipe")]
    live = f"tessera-{ns}-{os.getpid()}-{secrets.token_hex(16)}.seg"  # this process runs
    elsewhere = f"tessera-{ns + 1}-{dead}-{secrets.token_hex(16)}.seg"  # another pid namespace
    for name in [*stale, live, elsewhere]:
        fd = os.open(os.path.join("/dev/shm", name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
    try:
        results = run_ranks(_rank_files, world, stale, deadline_s=SPAWN_TIMEOUT_S)
        kept = [os.path.exists(os.path.join("/dev/shm", n)) for n in (live, elsewhere)]
    finally:
        for name in [*stale, live, elsewhere]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
    # dead jobs: the first group's set-up removed the dead pid's files, and only those
    assert all(r["stale_left"] == [] for r in results), [r["stale_left"] for r in results]
    assert kept == [True, True]
    # names: every file under a fresh 128-bit token, none derived from another
    creator = results[0]
    kinds = [NAME.match(n).group(4) for n in creator["drawn"]]
    assert kinds.count("control") == 1 and kinds.count("pipe") == 1 and kinds.count("seg") >= 4
    tokens = [int(NAME.match(n).group(3), 16) for n in creator["drawn"]]
    assert all(NAME.match(n).group(2) == str(creator["pid"]) for n in creator["drawn"])
    assert len(set(tokens)) == len(tokens)
    gaps = [abs(a - b) for i, a in enumerate(tokens) for b in tokens[i + 1 :]]
    assert min(gaps) > 2**64, "tokens close together: a counter, not random draws"
    for r in results:
        assert [NAME.match(n).group(4) for n in r["drawn"]].count("pipe") == 1
    # squatters: the job ran, and the strangers' files were left as they were
    for rank, r in enumerate(results):
        assert r["squatted_same_host"] and r["squatters_intact"], rank
        assert torch.equal(r["z"], torch.full((3000,), 6.0)), rank
        assert torch.equal(r["b"], torch.full((7,), 2.0)), rank
        assert r["leftovers"] == [], (rank, r["leftovers"])
        base = torch.arange(30000, dtype=torch.float32)
        for x in r["sums"][:3]:
            assert torch.equal(x, base[: x.numel()] * 6), rank
        assert torch.equal(r["sums"][3], torch.full((300,), 6.0)), rank


# ---------------------------------------------------------------- SIGTERM during set-up
def _rank_stalls_in_setup(pid_dir: str) -> None:
    ctx = tessera.init()
    Path(pid_dir, f"rank{ctx.rank}").write_text(str(os.getpid()))
    if ctx.rank == 1:  # stops between creating its pipe and voting: rank 0 waits in gloo
        opened = segments._open_peers

        def slow(*args):
            time.sleep(60)
            return opened(*args)

        mock.patch.object(segments, "_open_peers", slow).start()
    comm.all_reduce(torch.ones(4), algorithm="shm")


def test_sigterm_during_setup_leaves_no_file(run_ranks, tmp_path):
    outcome: list = []

    def run() -> None:
        try:
            run_ranks(_rank_stalls_in_setup, 2, str(tmp_path), deadline_s=SPAWN_TIMEOUT_S)
            outcome.append("finished")
        except Exception as exc:  # noqa: BLE001 - the ranks are meant to die
            outcome.append(exc)

    launcher = threading.Thread(target=run)
    launcher.start()
    deadline = time.monotonic() + 60
    pids: list[int] = []
    while time.monotonic() < deadline:
        files = sorted(tmp_path.iterdir())
        pids = [int(f.read_text() or 0) for f in files] if len(files) == 2 else []
        # rank 0: its pipe and the control page; rank 1: its pipe
        if pids and all(pids) and len(_ours(pids[0])) == 2 and len(_ours(pids[1])) == 1:
            break
        time.sleep(0.05)
    else:
        launcher.join(timeout=SPAWN_TIMEOUT_S)
        pytest.fail(f"set-up files never appeared (pids {pids}, outcome {outcome})")
    for pid in pids:  # what the launcher does to stop a job
        os.kill(pid, signal.SIGTERM)
    launcher.join(timeout=SPAWN_TIMEOUT_S)
    assert outcome and outcome[0] != "finished", outcome
    assert "-15" in str(outcome[0]) or "code" in str(outcome[0]), outcome[0]
    assert _ours(pids[0]) == [] and _ours(pids[1]) == [], (_ours(pids[0]), _ours(pids[1]))


# ----------------------------------- ranks that cannot share memory, multi-host reductions
class _Blocks(nn.Module):
    """Blocks in a ModuleDict called one by one, one module called twice, a bare weight."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(
            {
                "inp": nn.Linear(5, 8),
                "act": nn.Tanh(),
                "mid": nn.Linear(8, 8),
                "out": nn.Linear(8, 3),
            }
        )
        self.mix = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks["act"](self.blocks["inp"](x))
        h = self.blocks["act"](self.blocks["mid"](h))
        return F.linear(self.blocks["out"](h), self.mix)


LR, BATCH = 0.5, 12


def _blocks(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(3)
    return _Blocks().to(dtype)


def _batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return torch.randn(BATCH, 5, generator=gen).to(dtype), torch.randint(
        0, 3, (BATCH,), generator=gen
    )


def _check_without_shared_memory(group, world: int, rank: int) -> list[str]:
    """Every collective on `group` against torch's; exact, since inputs are small integers."""
    failures = []
    x = torch.arange(1001, dtype=torch.float32) % 17 * (rank + 1)
    for algorithm in ("shm", "auto"):
        want = x.clone()
        dist.all_reduce(want, group=group)
        got = comm.all_reduce(x.clone(), algorithm=algorithm, group=group)
        if not torch.equal(got, want):
            failures.append(f"all_reduce {algorithm}")
    for algorithm in ("shm", "auto"):
        src = dist.get_process_group_ranks(group)[1]
        want, got = x.clone(), x.clone()
        dist.broadcast(want, src, group=group)
        comm.broadcast(got, src, algorithm=algorithm, group=group)
        if not torch.equal(got, want):
            failures.append(f"broadcast {algorithm}")
    plain = comm.shared_buffer(6, group=group)
    if not (plain.shape == (6,) and torch.equal(plain, torch.zeros(6))):
        failures.append("shared_buffer")
    rows = torch.arange(4 * world + 1, dtype=torch.float32).reshape(-1, 1) * (rank + 2)
    total = rows.clone()
    dist.all_reduce(total, group=group)  # small integers: the sum is exact in any order
    for op, want in (("sum", total), ("mean", total / world)):
        got = comm.reduce_scatter(rows, op, group=group)
        if not torch.equal(got, want.tensor_split(world)[rank]):
            failures.append(f"reduce_scatter {op}")
    return failures


def _rank_apart(private_dir: str) -> dict:
    """Groups whose ranks cannot all share memory; then ZeRO on such a group."""
    ctx = tessera.init()
    torch.set_num_threads(1)
    world, rank = ctx.world_size, ctx.rank
    scenarios = [
        ("rank 2 sees another /dev/shm", 2, mock.patch.object(shm_files, "SHM_DIR", private_dir)),
        ("rank 0 sees another /dev/shm", 0, mock.patch.object(shm_files, "SHM_DIR", private_dir)),
        ("rank 1 cannot order accesses", 1, mock.patch.object(atomics, "MODE", None)),
    ]
    out: dict = {"scenarios": {}}
    apart = None
    for name, odd_rank, patch in scenarios:
        with patch if rank == odd_rank else contextlib.nullcontext():
            group = dist.new_group(list(range(world)))
            verdict = comm.same_host(group)
        out["scenarios"][name] = (verdict, _check_without_shared_memory(group, world, rank))
        apart = apart or group
    together = dist.new_group(list(range(world)))
    out["together"] = comm.same_host(together)
    comm.all_reduce(torch.ones(3), algorithm="shm", group=together)
    out["leftovers"] = _ours(os.getpid()) + _ours(os.getpid(), private_dir)

    # ZeRO on a group without shared memory reduce-scatters its gradients (the multi-host path)
    x, y = (t.tensor_split(world)[rank] for t in _batch())
    out["zero"] = {}
    for stage in (1, 2, 3):
        model, opt = initialize(_blocks(), torch.optim.SGD, stage=stage, group=apart, lr=LR)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out["zero"][stage] = (opt.one_host, full_state_dict(model))
        opt.remove_hooks()
    return out


def _one_sgd_step(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The oracle: one plain SGD step (no momentum) on the whole batch, in one process."""
    model = _blocks(dtype)
    x, y = _batch(dtype)
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= LR * param.grad
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def apart_results(tmp_path_factory):
    private = tmp_path_factory.mktemp("other-host-shm")
    results = tessera.launch(_rank_apart, 3, str(private), deadline_s=SPAWN_TIMEOUT_S, env=ENV)
    return results, private


def test_ranks_that_cannot_share_memory_fall_back_to_native(apart_results):
    results, private = apart_results
    for rank, r in enumerate(results):
        for name, (verdict, failures) in r["scenarios"].items():
            assert verdict is False, (rank, name)
            assert failures == [], (rank, name, failures)
        assert r["together"] is True, rank
        assert r["leftovers"] == [], (rank, r["leftovers"])
    assert list(private.iterdir()) == []


def test_zero_on_a_multi_host_group_averages_gradients(apart_results):
    """One SGD step without momentum: a gradient summed instead of averaged moves 3x as far."""
    results, _ = apart_results
    oracle, exact = _one_sgd_step(torch.float32), _one_sgd_step(torch.float64)
    for stage in (1, 2, 3):
        for rank, r in enumerate(results):
            one_host, state = r["zero"][stage]
            assert one_host is False, (stage, rank)
            for key, ref in exact.items():
                # C = 4: the ranks sum 3 partial gradients of 4 samples where the oracle sums
                # 12 samples at once, so the rounding differs; 2^-21 of the largest value (4 ulp)
                # covers an oracle that happens to be exact.
                bound = 4 * (oracle[key].double() - ref).abs().max() + 2**-21 * ref.abs().max()
                error = (state[key].double() - ref).abs().max()
                assert error <= bound, (stage, rank, key, error.item(), bound.item())
