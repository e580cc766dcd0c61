"""ZeRO-Infinity's NVMe offload: `NVMeAdam`, `initialize(..., offload="nvme")`, swap folders.

What must hold: streaming the state through files in chunks changes no bit of the result (the
same fused kernel on the same elements as `CPUAdam`); every ZeRO stage with `offload="nvme"`
equals the run without offload; the resident memory the optimizer adds stays within its buffer
budget on a model whose states are several times larger (measured as peak RSS of a real
process); the files go at close and a crashed run's are removed, never read; each bad input
gets one clear error. (`offload="cpu"` is tested in test_cpu_adam.py; resume of an nvme run
through `tessera train` in test_resume.py.)
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import shutil
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.optim import CPUAdam
from tessera.optim.nvme import CHUNK_QUANTUM, NVMeAdam
from tessera.optim.offload import host_optimizer
from tessera.optim.swap_files import MANIFEST, SwapFile, SwapFolder, remove_stale
from tests._tolerance import check_close

HYPER = dict(lr=1e-2, weight_decay=0.1)
SIZES = [2 * CHUNK_QUANTUM + 5, 7, CHUNK_QUANTUM + 1]
"""Chunks cut inside a parameter, a parameter smaller than a chunk, one just over a chunk."""
SMALLEST_MB = 4 * 16 * CHUNK_QUANTUM / 2**20
"""The buffer budget giving one-quantum chunks with the parameters swapped (4 slots x 16 B)."""


def _gradient(step: int, index: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + index))


def _run(make, steps: int, swap: bool = False, sizes: list[int] = SIZES):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in sizes]
    optimizer = make(params)
    published = [torch.zeros(n) for n in sizes]
    for step in range(steps):
        grads = [_gradient(step, i, n) for i, n in enumerate(sizes)]
        if swap:
            optimizer.step(grads=grads, publish=published)
        else:
            for param, grad in zip(params, grads):
                param.grad = grad
            optimizer.step()
    values = published if swap else [p.detach().clone() for p in params]
    return values, optimizer


def _slow_writes(monkeypatch):
    """Every chunk write lands 10 ms late: a read that does not wait for it reads stale state."""
    write = SwapFile.write

    def late(self, offset, buffer):
        time.sleep(0.01)
        write(self, offset, buffer)

    monkeypatch.setattr(SwapFile, "write", late)


@pytest.mark.parametrize(
    "sizes", [SIZES, [7, 300]], ids=["more chunks than buffers", "fewer chunks than buffers"]
)
def test_nvme_adam_streams_chunks_bit_identical_to_cpu_adam(tmp_path, monkeypatch, sizes):
    """With fewer chunks than buffers, the next step's reads use buffers no write has used:
    only the wait for the pending write of the same chunk keeps them from reading stale state."""
    _slow_writes(monkeypatch)
    expected, cpu = _run(lambda ps: CPUAdam(ps, **HYPER), 3, sizes=sizes)
    for swap in (False, True):
        options = dict(nvme_dir=str(tmp_path), buffer_mb=SMALLEST_MB, swap_params=swap)
        make = lambda ps: NVMeAdam(ps, **HYPER, **options)  # noqa: B023, E731
        values, optimizer = _run(make, 3, swap=swap, sizes=sizes)
        assert optimizer.chunk == CHUNK_QUANTUM  # several chunks per parameter
        for ours, theirs in zip(values, expected):
            assert torch.equal(ours, theirs), f"parameters differ (swap_params={swap})"
        state, reference = optimizer.state_dict(), cpu.state_dict()
        for index in reference["state"]:
            for kind, value in reference["state"][index].items():
                assert torch.equal(state["state"][index][kind], value), (swap, index, kind)
        if swap:  # the swapped parameters, read back whole from their file
            for param, theirs in zip(optimizer.params, expected):
                assert torch.equal(optimizer.read_param(param), theirs)
        (folder,) = tmp_path.iterdir()
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["pid"] == os.getpid()
        optimizer.close()
        assert not list(tmp_path.iterdir()), "close() must remove the swap folder"
    # Resume: CPUAdam's state dict loaded into a fresh NVMeAdam continues bit for bit.
    more, _ = _run(lambda ps: CPUAdam(ps, **HYPER), 4, sizes=sizes)
    resumed = NVMeAdam(
        [nn.Parameter(v.clone()) for v in expected], **HYPER, nvme_dir=str(tmp_path),
        buffer_mb=SMALLEST_MB,
    )  # fmt: skip
    resumed.load_state_dict(cpu.state_dict())
    for index, param in enumerate(resumed.params):
        param.grad = _gradient(3, index, sizes[index])
    resumed.step()
    for ours, theirs in zip(resumed.params, more):
        assert torch.equal(ours.detach(), theirs)
    resumed.close()


# --- every ZeRO stage with offload="nvme" -----------------------------------------------------


class Blocks(nn.Module):
    """Not tessera's GPT: ModuleDict blocks called one by one, a parameter used directly, a
    layer called twice, and a weight large enough (240 x 200) to span several chunks per rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"inner": nn.Linear(200, 240), "outer": nn.Linear(240, 200)})
            for _ in range(2)
        )
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 200))
        self.head = nn.Linear(200, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["outer"](torch.tanh(block["inner"](x)))
        x = x * self.scale
        return self.head(torch.tanh(self.head.weight.T @ self.head(x).T).T)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(70 + step)
    return torch.randn(8, 200, generator=generator), torch.randn(8, 3, generator=generator)


STEPS = 3
RUNS = [  # (stage, mixed_precision, offload_params)
    (1, None, False),
    (2, None, False),
    (3, None, False),
    (3, None, True),
    (2, "bf16", False),
    (3, "bf16", True),
]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss_growth(train_steps) -> int:
    """Bytes the peak RSS rises above the current RSS while `train_steps()` runs."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    train_steps()
    return (_rss_kib("VmHWM") - before) * 1024


def _rss_run(offload: str | None, nvme_dir: str) -> tuple[int, int]:
    """(peak RSS growth over 3 steps, bytes of this rank's optimizer state), one ZeRO-1 run.

    Measured from after the first backward: parameters and gradient buffers are resident by
    then in both runs; what grows afterwards is the optimizer's (states, or NVMe buffers).
    """
    from tessera.zero import initialize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 2))  # 2.1 M parameters
    extra = dict(nvme_dir=nvme_dir, nvme_buffer_mb=BUDGET_MB) if offload == "nvme" else {}
    cls = torch.optim.AdamW if offload else CPUAdam
    model, optimizer = initialize(model, cls, stage=1, offload=offload, **HYPER, **extra)
    x = torch.randn(4, 1024)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()

    step()

    def three_steps() -> None:
        for _ in range(3):
            optimizer.step()
            step()

    growth = _peak_rss_growth(three_steps)
    state_bytes = 8 * optimizer.flats[0].master.numel()  # exp_avg + exp_avg_sq, fp32
    optimizer.remove_hooks()
    return growth, state_bytes


BUDGET_MB = 2.0
SLACK_BYTES = 2**20
"""Allowance for allocator rounding and the step's own small tensors (one MiB)."""


def _nvme_ranks(nvme_dir: str) -> dict:
    import tessera
    from tessera.zero import full_state_dict, initialize

    ctx = tessera.init()
    torch.set_num_threads(1)
    mine = Path(nvme_dir) / f"rank{ctx.rank}"
    mine.mkdir()
    # A first run maps the shared-memory segments of ZeRO's collectives (they live as long as
    # the group): otherwise the first measured run would count them and the second not.
    _rss_run(None, str(mine))
    out: dict = {"rss": {mode: _rss_run(mode, str(mine)) for mode in ("nvme", None)}}
    out["left after rss"] = sorted(p.name for p in mine.iterdir())
    for stage, mixed, offload_params in RUNS:
        for offload in ("nvme", None):
            extra = {}
            if offload == "nvme":
                extra = dict(nvme_dir=str(mine), nvme_buffer_mb=2, offload_params=offload_params)
            model, optimizer = initialize(
                Blocks(), torch.optim.AdamW if offload else CPUAdam, stage=stage,
                mixed_precision=mixed, offload=offload, **HYPER, **extra,
            )  # fmt: skip
            for step in range(STEPS):
                x, y = _batch(step)
                rows = slice(4 * ctx.rank, 4 * ctx.rank + 4)
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                optimizer.step()
            if offload:
                folders = list(mine.iterdir())
                assert len(folders) == 1 and (folders[0] / MANIFEST).is_file(), folders
                files = {p.name for p in folders[0].iterdir()}
                swapped = mixed is not None or offload_params
                expected = {MANIFEST, "exp_avg.bin", "exp_avg_sq.bin"} | (
                    {"param.bin"} if swapped else set()
                )
                assert files == expected, files
                out[(stage, mixed, offload_params, "chunks")] = (
                    optimizer.optimizer.chunk, max(f.master.numel() for f in optimizer.flats)
                )  # fmt: skip
            out[(stage, mixed, offload_params, offload)] = full_state_dict(model)
            optimizer.remove_hooks()
            assert not list(mine.iterdir()), "remove_hooks() leaves the swap folder behind"
    return out


def _oracle(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain single-process AdamW on the whole batch (written here, not through tessera)."""
    model = Blocks().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_every_zero_stage_with_nvme_offload_equals_no_offload(run_ranks, tmp_path, monkeypatch):
    # Fixed malloc threshold: large frees go back to the system, so RSS shows what is live.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    results = run_ranks(_nvme_ranks, 2, str(tmp_path))
    oracle, reference = _oracle(torch.float32), _oracle(torch.float64)
    for rank, out in enumerate(results):
        (nvme_growth, state_bytes), (plain_growth, _) = out["rss"]["nvme"], out["rss"][None]
        budget = int(BUDGET_MB * 2**20)
        assert state_bytes >= 3 * budget, "the model's states must exceed the budget 3x"
        # The same ZeRO-1 steps (their all-gathers allocate alike in both runs): in memory, the
        # states show in full; offloaded, only the buffers do, within the budget.
        assert plain_growth >= state_bytes, (rank, plain_growth, state_bytes)
        assert nvme_growth <= plain_growth - state_bytes + budget + SLACK_BYTES, (
            rank, nvme_growth, plain_growth, state_bytes, budget,
        )  # fmt: skip
        assert out["left after rss"] == []
    first = results[0]
    for stage, mixed, offload_params in RUNS:
        chunk, shard = first[(stage, mixed, offload_params, "chunks")]
        if stage < 3:
            assert shard > chunk, "the largest shard must span several chunks"
        offloaded = first[(stage, mixed, offload_params, "nvme")]
        plain = first[(stage, mixed, offload_params, None)]
        for name, value in plain.items():  # the same kernel on the same elements: bit-identical
            assert torch.equal(offloaded[name], value), (stage, mixed, offload_params, name)
        if mixed is None:
            check_close(offloaded, oracle, reference, what=f"stage {stage} offload=nvme")


def _nvme_checkpoint_ranks(folder: str, nvme_dir: str) -> dict:
    """ZeRO-2, bf16, offload='nvme' with a 2 MB buffer on a model whose fp32 master and moments
    take 12.6 MB per rank: save, one more step, load; the peak RSS growth of save and of load,
    and whether the load brought back exactly the state saved."""
    import tessera
    from tessera.zero import initialize
    from tessera.zero.checkpoint import load_shards, save_shard

    ctx = tessera.init()
    torch.set_num_threads(1)
    mine = Path(nvme_dir) / f"rank{ctx.rank}"
    mine.mkdir()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 2))  # 2.1 M parameters
    model, optimizer = initialize(
        model, torch.optim.AdamW, stage=2, mixed_precision="bf16", offload="nvme",
        nvme_dir=str(mine), nvme_buffer_mb=BUDGET_MB, **HYPER,
    )  # fmt: skip
    inner = optimizer.optimizer

    def step(index: int) -> None:
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(10 * index + ctx.rank))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    def snapshot() -> list:
        return [
            (inner.read_param(f.master),
             {k: v.clone() for k, v in inner.read_state(f.master).items()},
             f.flat_param[f.lo : f.hi].clone())
            for f in optimizer.flats
        ]  # fmt: skip

    for index in range(2):
        step(index)
    step(2)  # (every lazy allocation of a step made before the measurements)
    out = {"save": _peak_rss_growth(lambda: save_shard(folder, optimizer))}
    saved = snapshot()
    step(3)
    changed = snapshot()
    out["load"] = _peak_rss_growth(lambda: load_shards(optimizer, folder))
    loaded = snapshot()
    out["state bytes"] = 12 * sum(f.master.numel() for f in optimizer.flats)
    out["step changed it"] = not torch.equal(saved[0][0], changed[0][0])
    out["loaded"] = all(
        torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
        and all(torch.equal(a[1][k], b[1][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
        for a, b in zip(saved, loaded)
    )  # fmt: skip
    step(4)  # and it trains on from there
    optimizer.remove_hooks()
    return out


def test_nvme_checkpoint_save_and_load_stay_within_the_buffer(run_ranks, tmp_path, monkeypatch):
    """Finding 16 of issue 24: a ZeRO checkpoint under offload='nvme' read each master and
    moment whole (save) and built whole slices (load), so its memory grew with the model while
    the docstring promised `nvme_buffer_mb`. Now both stream chunk by chunk through the
    optimizer's own staging buffer: the peak RSS growth of each stays within the budget (plus
    slack), on a state 6x larger, and the load brings back every bit saved."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = run_ranks(_nvme_checkpoint_ranks, 2, str(tmp_path / "ckpt"), str(nvme))
    budget = int(BUDGET_MB * 2**20)
    for rank, out in enumerate(results):
        assert out["state bytes"] >= 6 * budget, out
        assert out["step changed it"] and out["loaded"], (rank, out)
        for phase in ("save", "load"):
            assert out[phase] <= budget + SLACK_BYTES, (rank, phase, out)


# --- swap folders: removed at close, a crashed run's removed and never read -------------------


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_crashed_runs_swap_folder_is_removed_not_read(tmp_path):
    import socket

    host, dead = socket.gethostname(), _dead_pid()
    stale = tmp_path / f"tessera-swap-{host}-{dead}-0123456789ab"
    stale.mkdir()
    (stale / MANIFEST).write_text(json.dumps({"host": host, "pid": dead, "started": "1"}))
    (stale / "exp_avg.bin").write_bytes(b"\x01" * 4096)  # what a restart must never read
    unfinished = tmp_path / f"tessera-swap-{host}-{dead}-ba9876543210"  # died before manifest
    unfinished.mkdir()
    live = tmp_path / f"tessera-swap-{host}-{os.getppid()}-aaaaaaaaaaaa"  # its owner runs
    live.mkdir()
    elsewhere = tmp_path / f"tessera-swap-otherhost-{dead}-bbbbbbbbbbbb"  # another host's
    elsewhere.mkdir()
    (elsewhere / MANIFEST).write_text(json.dumps({"host": "otherhost", "pid": dead}))
    folder = SwapFolder(tmp_path, purpose="test")
    assert not stale.exists() and not unfinished.exists()
    assert live.exists() and elsewhere.exists()
    assert folder.path.name.startswith(f"tessera-swap-{host}-{os.getpid()}-")
    assert remove_stale(tmp_path) == []  # this process's own folder is alive
    # A fresh optimizer starts from zero moments, whatever files lie around.
    stale.mkdir()
    (stale / "exp_avg.bin").write_bytes(b"\x01" * 4096)
    expected, _ = _run(lambda ps: CPUAdam(ps, **HYPER), 1)
    values, optimizer = _run(
        lambda ps: NVMeAdam(ps, **HYPER, nvme_dir=str(tmp_path), buffer_mb=SMALLEST_MB), 1
    )
    assert all(torch.equal(a, b) for a, b in zip(values, expected))
    optimizer.close()
    folder.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name])


def test_a_file_system_without_o_direct_gets_buffered_files(tmp_path, monkeypatch):
    """Finding 12 of issue 24: on tmpfs an O_DIRECT open creates the file and then fails with
    EINVAL, and the buffered retry's O_EXCL found it there (FileExistsError). Simulated here:
    the open with O_DIRECT creates the file, then refuses."""
    import errno

    from tessera.optim import swap_files

    real_open = os.open
    refused = []

    def no_direct(path, flags, *args, **kwargs):  # (`os` is global: rmtree calls it too)
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kwargs))  # as Linux does
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(swap_files.os, "open", no_direct)
    folder = SwapFolder(tmp_path, purpose="test")
    swap = folder.file("state.bin", 3 * 4096)
    assert refused and not swap.direct
    data = torch.arange(2048, dtype=torch.float32)
    swap.write(4096, data)
    back = torch.empty(2048)
    swap.read(4096, back)
    assert torch.equal(back, data)
    (folder.path / "taken.bin").write_bytes(b"mine")  # a file that was there: never removed
    with pytest.raises(FileExistsError):
        folder.file("taken.bin", 4096)
    assert (folder.path / "taken.bin").read_bytes() == b"mine"
    values, optimizer = _run(
        lambda ps: NVMeAdam(ps, **HYPER, nvme_dir=str(tmp_path), buffer_mb=SMALLEST_MB), 2
    )
    expected, _ = _run(lambda ps: CPUAdam(ps, **HYPER), 2)
    assert all(torch.equal(a, b) for a, b in zip(values, expected))
    optimizer.close()
    folder.close()
    assert not list(tmp_path.iterdir())


def test_a_restart_after_a_killed_run_finds_the_space_the_dead_run_held(tmp_path, monkeypatch):
    """Finding 13 of issue 24: free space was checked before the dead run's folder was removed,
    so a restart failed on the space the dead run's files still held, and the folder stayed."""
    import socket

    dead = _dead_pid()
    stale = tmp_path / f"tessera-swap-{socket.gethostname()}-{dead}-0123456789ab"
    stale.mkdir()
    (stale / MANIFEST).write_text(
        json.dumps({"host": socket.gethostname(), "pid": dead, "started": "1"})
    )
    (stale / "exp_avg.bin").write_bytes(b"\x01" * 4096)

    class Usage:  # a disk whose room is taken by the stale folder while it exists
        def __init__(self, path):
            self.free = 0 if stale.exists() else 2**30

    monkeypatch.setattr(shutil, "disk_usage", Usage)
    optimizer = NVMeAdam([nn.Parameter(torch.zeros(1024))], nvme_dir=str(tmp_path), buffer_mb=1)
    assert not stale.exists()
    optimizer.close()


_TERMINATED = """
import sys, time
from tessera.optim.swap_files import SwapFolder
folder = SwapFolder(sys.argv[1], purpose="test")
folder.file("state.bin", 4096)
print(folder.path, flush=True)
time.sleep(60)
"""


def test_sigterm_removes_the_swap_folder(tmp_path):
    """Finding 13 of issue 24: SIGTERM, what the launcher sends, left the folder behind (exit
    hooks do not run on a signal's default action). The process still dies by SIGTERM."""
    import signal
    import sys

    process = subprocess.Popen(
        [sys.executable, "-c", _TERMINATED, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        folder = Path(process.stdout.readline().strip())
        assert folder.is_dir() and (folder / "state.bin").exists()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
    finally:
        process.kill()
        process.wait()
    assert not folder.exists() and not list(tmp_path.iterdir())


def test_nvme_adam_refuses_a_strided_or_replaced_parameter(tmp_path):
    """Finding 14 of issue 24: a strided 1-D parameter had the elements between its strides
    overwritten and half of it never updated; refused as CPUAdam refuses it. A parameter
    replaced after construction (`param.data = ...`) no longer fits its files: refused too."""
    base = torch.zeros(2 * 1024)
    strided = nn.Parameter(base[::2])
    assert strided.dim() == 1 and not strided.is_contiguous()
    with pytest.raises(ValueError, match="parameter 0 is a strided view"):
        NVMeAdam([strided], nvme_dir=str(tmp_path), buffer_mb=1)
    param = nn.Parameter(torch.zeros(1024))
    optimizer = NVMeAdam([param], nvme_dir=str(tmp_path), buffer_mb=1)
    param.data = torch.zeros(4096)[::4]
    param.grad = torch.ones(1024)
    with pytest.raises(ValueError, match="parameter 0 is a strided view"):
        optimizer.step()
    param.data = torch.zeros(2048)
    param.grad = torch.ones(2048)
    with pytest.raises(ValueError, match="2048 elements, its state on disk 1024"):
        optimizer.step()
    optimizer.close()
    assert torch.equal(base, torch.zeros(2 * 1024))  # nothing was written through the view


def test_nvme_adam_loads_torch_adamw_state(tmp_path):
    """Finding 11 of issue 24, for NVMeAdam: torch's AdamW state dict (no `adamw` key) loads,
    and the continued step equals CPUAdam's continued from the same state."""
    sizes = [7, 300]
    torch_params = [nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(n)))
                    for n in sizes]  # fmt: skip
    adamw = torch.optim.AdamW(torch_params, **HYPER)
    for index, param in enumerate(torch_params):
        param.grad = _gradient(0, index, sizes[index])
    adamw.step()
    results = []
    for make in (
        lambda ps: CPUAdam(ps, lr=1.0),
        lambda ps: NVMeAdam(ps, lr=1.0, nvme_dir=str(tmp_path), buffer_mb=SMALLEST_MB),
    ):
        params = [nn.Parameter(p.detach().clone()) for p in torch_params]
        optimizer = make(params)
        optimizer.load_state_dict(__import__("copy").deepcopy(adamw.state_dict()))
        for index, param in enumerate(params):
            param.grad = _gradient(1, index, sizes[index])
        optimizer.step()
        results.append([p.detach().clone() for p in params])
        getattr(optimizer, "close", lambda: None)()
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


# --- bad input: one clear error each ------------------------------------------------------------


def test_nvme_bad_input(tmp_path, monkeypatch):
    model = nn.Linear(3, 2)
    adamw = torch.optim.AdamW
    with pytest.raises(FileNotFoundError, match="nvme_dir .*missing.* does not exist"):
        host_optimizer("nvme", 2, model, adamw, {}, nvme_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="nvme_dir is required"):
        host_optimizer("nvme", 2, model, adamw, {})
    if Path("/sys").is_dir():  # sysfs refuses new files even to root
        with pytest.raises(PermissionError, match="nvme_dir '/sys' is not writable"):
            host_optimizer("nvme", 2, model, adamw, {}, nvme_dir="/sys")
    with pytest.raises(ValueError, match="offload must be one of"):
        host_optimizer("disk", 2, model, adamw, {})
    with pytest.raises(ValueError, match="goes with offload='nvme'"):
        host_optimizer("cpu", 2, model, adamw, {}, nvme_dir=str(tmp_path))
    with pytest.raises(ValueError, match="offload_params=True .* stage 2"):
        host_optimizer("nvme", 2, model, adamw, {}, nvme_dir=str(tmp_path), offload_params=True)
    with pytest.raises(ValueError, match="nvme_buffer_mb=0.5 is too small"):
        NVMeAdam([nn.Parameter(torch.zeros(4))], nvme_dir=str(tmp_path), buffer_mb=0.5)
    # Space: checked up front from the estimate of the state's files (two fp32 moments here).
    free = 3 * 4096

    class Usage:
        def __init__(self, path):
            self.free = free

    monkeypatch.setattr(shutil, "disk_usage", Usage)
    with pytest.raises(OSError, match="has 0.00 GiB free; the offloaded state needs"):
        NVMeAdam([nn.Parameter(torch.zeros(2048))], nvme_dir=str(tmp_path), buffer_mb=1)
    assert not list(tmp_path.iterdir()), "nothing may be written when the space is lacking"
    NVMeAdam([nn.Parameter(torch.zeros(1024))], nvme_dir=str(tmp_path), buffer_mb=1).close()


def test_train_config_offload_and_activation_checkpointing(tmp_path):
    from tessera.train import build_config
    from tessera.train.engine_setup import policy_options
    from tessera.train.loop import make_optimizer
    from tessera.zero.api import _host_spec

    def _offload_optimizer(stage, module, make, config):  # the trainer's translation, as used
        offload = policy_options(config)["offload"]
        user = make(module.parameters())  # ZeRO reads the user's optimizer on the model
        host_class, kwargs, _ = _host_spec(stage, module, user, config.mixed_precision, offload)
        return partial(host_class, **kwargs)

    base = {"nproc": 2, "steps": 1}
    config = build_config(
        base,
        {
            "strategy": "zero3",
            "offload": "nvme",
            "nvme_dir": str(tmp_path),
            "nvme_buffer_mb": 3.0,
            "offload_params": True,
            "activation_checkpointing": True,
        },
    )
    make = _offload_optimizer(3, nn.Linear(2, 2), lambda ps: make_optimizer(config, ps), config)
    optimizer = make([nn.Parameter(torch.zeros(8))])
    trainer = make_optimizer(config, [nn.Parameter(torch.zeros(1))])
    assert isinstance(optimizer, NVMeAdam) and optimizer.swap_params
    for key in ("lr", "betas", "eps", "weight_decay"):  # the trainer's AdamW, read not copied
        assert optimizer.defaults[key] == trainer.defaults[key], key
    assert optimizer.folder.path.parent == tmp_path
    optimizer.close()
    # --offload-moments: the storage of CPUAdam's moments, passed through with the trainer's Adam.
    from tessera.optim import CPUAdam

    for choice, bf16, rounding in (
        ("fp32", False, "nearest"),
        ("bf16", True, "nearest"),
        ("bf16-stochastic", True, "stochastic"),
    ):
        layer = {"strategy": "zero2", "offload": "cpu", "offload_moments": choice}
        config = build_config(base, layer)
        make = _offload_optimizer(2, nn.Linear(2, 2), partial(make_optimizer, config), config)
        optimizer = make([nn.Parameter(torch.zeros(8))])
        assert isinstance(optimizer, CPUAdam), choice
        assert optimizer.defaults["bf16_moments"] is bf16, choice
        assert optimizer.defaults["moments_rounding"] == rounding, choice
        optimizer.zero_grad()
        optimizer.param_groups[0]["params"][0].grad = torch.ones(8)
        optimizer.step()
        moment = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
        assert moment.dtype == (torch.bfloat16 if bf16 else torch.float32), choice
    errors = [
        ({"strategy": "zero2", "offload_moments": "bf16"}, "needs offload cpu, not offload None"),
        ({"strategy": "zero2", "offload": "cpu", "offload_moments": "fp16"}, "must be one of"),
        ({"strategy": "ddp", "offload": "cpu"}, "needs strategy zero1, zero2 or zero3, not ddp"),
        ({"strategy": "zero2", "offload": "cpu", "optimizer": "sgd"}, "needs optimizer adamw"),
        ({"strategy": "zero2", "offload": "gpu"}, "offload device must be 'cpu' or 'nvme'"),
        ({"strategy": "zero2", "offload": "nvme"}, "nvme_dir is required"),
        ({"strategy": "zero2", "offload": "nvme", "nvme_dir": str(tmp_path / "x")}, "not exist"),
        ({"strategy": "zero2", "offload": "cpu", "nvme_dir": str(tmp_path)}, "needs offload nvme"),
        (
            {
                "strategy": "zero2",
                "offload": "nvme",
                "nvme_dir": str(tmp_path),
                "offload_params": True,
            },
            "use zero3",
        ),  # fmt: skip
        ({"strategy": "pipeline", "activation_checkpointing": True}, "does not support it"),
    ]
    for layer, message in errors:
        with pytest.raises(ConfigError, match=message):
            build_config(base, layer)


def test_peak_rss_helper_measures_a_real_allocation():
    """The RSS probe the budget test relies on sees 32 MiB being touched.

    The pages come from a fresh anonymous mapping, one byte written per page: memory that earlier
    tests freed (and glibc kept, or a forked rank inherited) can neither serve them nor add to them.
    """
    size = 32 * 2**20
    with mmap.mmap(-1, size) as pages:

        def touch_every_page() -> None:
            for offset in range(0, size, mmap.PAGESIZE):
                pages[offset] = 1

        growth = _peak_rss_growth(touch_every_page)
    assert size <= growth < size + 4 * 2**20, growth
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


# --- swap_idle (GeePS): idle blocks' parameters in files, the next `keep` prefetched ----------


class Tower(nn.Module):
    """Not tessera's GPT: ModuleDict blocks called one by one, one layer called twice, a root
    parameter used directly, and a head outside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"a": nn.Linear(24, 24), "b": nn.Linear(24, 24)}) for _ in range(3)
        )
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 24))
        self.head = nn.Linear(24, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = torch.tanh(block["b"](block["a"](x)))
            if index == 1:
                x = block["a"](x)  # called twice within one forward
        return self.head(x * self.gain)


def test_swap_idle_steps_a_head_outside_the_swapped_module_once(tmp_path):
    """Finding 15 of issue 24: with the backbone swapped and one optimizer over backbone and
    head, `swapper.step(opt)` stepped the head once per block plus once (its bias moved 4x as
    far). Compared with a plain loop over the same model, bit for bit."""
    import copy

    from tessera.memory import swap_idle

    torch.manual_seed(3)
    backbone = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 6))
    head = nn.Linear(6, 2)
    plain_backbone, plain_head = copy.deepcopy(backbone), copy.deepcopy(head)
    swapper = swap_idle(backbone, keep=0, nvme_dir=str(tmp_path))
    assert len(swapper.blocks) == 3

    def make(*modules):
        params = [p for m in modules for p in m.parameters()]
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.0)

    optimizer, plain_opt = make(backbone, head), make(plain_backbone, plain_head)
    bias_before = head.bias.detach().clone()
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for b, h, opt in ((backbone, head, optimizer), (plain_backbone, plain_head, plain_opt)):
            opt.zero_grad()
            h(b(x)).square().sum().backward()
        swapper.step(optimizer)
        plain_opt.step()
        if step == 0:  # a first Adam step moves every element by lr (one step: 0.1, not 0.4)
            assert torch.allclose((head.bias - bias_before).abs(), torch.full((2,), 0.1))
        assert torch.equal(head.bias, plain_head.bias), step
        assert torch.equal(head.weight, plain_head.weight), step
        assert all(optimizer.state[p]["step"].item() == step + 1 for p in head.parameters())
    swapper.close()
    for a, b in zip(backbone.parameters(), plain_backbone.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["files", "host"])
def test_swap_idle_same_gradients_and_steps_as_plain(tmp_path, where):
    import copy

    from tessera.memory import IdleSwapper, swap_idle

    plain = Tower()
    swapped = copy.deepcopy(plain)
    keep = 1
    swapper = swap_idle(swapped, keep=keep, nvme_dir=str(tmp_path) if where == "files" else None)
    assert isinstance(swapper, IdleSwapper) and len(swapper.blocks) == 6
    block_bytes = max(block.nbytes for block in swapper.blocks)
    seen: list[int] = []  # resident block bytes whenever a block starts, forward or backward
    for block in swapper.blocks:
        block.module.register_forward_pre_hook(lambda *_: seen.append(swapper.resident_bytes()))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.1, weight_decay=0.1)
    swapped_opt = torch.optim.AdamW(swapped.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(2):
        x = torch.randn(5, 24, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((plain, plain_opt), (swapped, swapped_opt)):
            optimizer.zero_grad()
            model(x).square().sum().backward()
        assert swapper.resident_bytes() == 0, "every block is idle after backward"
        for (name, a), b in zip(plain.named_parameters(), swapped.parameters()):
            assert torch.equal(a.grad, b.grad), (step, name)  # the same operations: bit-equal
        plain_opt.step()
        swapper.step(swapped_opt)  # one block at a time
        assert swapper.resident_bytes() == 0
        with torch.no_grad():  # a forward without autograd brings blocks in and out too
            assert torch.equal(plain(x), swapped(x))
    # At most the running block, the `keep` prefetched ones and one being left are resident.
    assert seen and max(seen) <= (keep + 2) * block_bytes, (seen, block_bytes)
    if where == "files":
        (folder,) = tmp_path.iterdir()
        assert len(list(folder.glob("block-*.bin"))) == 6
    swapper.close()
    assert not list(tmp_path.iterdir())
    for a, b in zip(plain.parameters(), swapped.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="keep must be an int >= 0"):
        swap_idle(Tower(), keep=-1)
    tied = Tower()
    tied.head.weight = tied.blocks[0]["b"].weight
    with pytest.raises(ValueError, match="tied parameters cannot be swapped"):
        swap_idle(tied)
