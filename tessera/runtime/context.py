"""Join the process group described by the environment, the same way under any launcher.

`torchrun` (and `tessera run`, its thin front) describes each worker with environment variables:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. tessera's own local
launcher (`tessera.launch`) sets the same variables, plus TESSERA_INIT_FILE, the path of a FileStore
used for rendezvous (a file needs no free TCP port, so parallel test runs cannot race for one).
`init()` reads them and returns a small immutable `Context`; a script calling it runs unchanged
under either launcher, or as a plain `python script.py` (a world of one).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.runtime.devices import BACKEND_ENV, check_local_rank

__all__ = [
    "Context",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_VARIABLE",
    "current_context",
    "default_timeout_s",
    "init",
    "on_shutdown",
    "shutdown",
]

TIMEOUT_VARIABLE = "TESSERA_TIMEOUT_S"
"""The environment variable that hands the bound of every wait to the processes a job starts
(`tessera.launch(timeout_s=...)` sets it); read once, where the rank's `Context` is built."""

DEFAULT_TIMEOUT_S = 300.0
"""Default bound of every blocking wait (5 minutes); `init(timeout_s=...)` or, from a launching
parent, TESSERA_TIMEOUT_S overrides it."""


def _timeout_from_environment() -> float:
    """TESSERA_TIMEOUT_S as a launching parent handed it (`tessera.launch(timeout_s=...)`), else
    DEFAULT_TIMEOUT_S: read only where a `Context` is built, never by the waits themselves."""
    value = os.environ.get(TIMEOUT_VARIABLE, "")
    if value == "":
        return DEFAULT_TIMEOUT_S
    try:
        timeout_s = float(value)
    except ValueError:
        timeout_s = float("nan")
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise ValueError(f"{TIMEOUT_VARIABLE}={value!r} is not a positive number of seconds")
    return timeout_s


def default_timeout_s() -> float:
    """The bound, in seconds, of every blocking wait of this process.

    Once the group is joined: the `timeout_s` of this process's `Context` (`current_context`).
    Before: the value `init()` would give it (TESSERA_TIMEOUT_S from a launching parent, else
    DEFAULT_TIMEOUT_S). Engines and waits take the value from the Context they were given;
    this is for callers that have none.
    """
    if dist.is_initialized():
        return current_context().timeout_s
    return _timeout_from_environment()


@dataclass(frozen=True)
class Context:
    """Where this process stands in the job."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    """Number of processes in the job, over all machines."""
    local_rank: int
    """Rank among the processes of this machine; picks the GPU when there is one."""
    local_world_size: int
    """Number of processes on this machine."""
    device: torch.device
    """Where tensors of this rank live: `cuda:<local_rank>` with NCCL, else CPU."""
    backend: str
    """The torch.distributed backend: "gloo" on CPU, "nccl" on GPU."""
    timeout_s: float
    """Bound of every blocking wait of this rank, in seconds: engines built with this Context
    pass it, as a value, to each wait (`tessera.runtime.wait.wait_or_raise`)."""

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes files and prints."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from exc


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _init_method(world_size: int) -> str:
    init_file = os.environ.get("TESSERA_INIT_FILE")
    if init_file:
        return f"file://{init_file}"
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return "env://"
    if world_size == 1:
        # A plain `python script.py`: a private store file, so collectives work on a world of one.
        fd, path = tempfile.mkstemp(prefix="tessera-store-")
        os.close(fd)
        os.unlink(path)
        return f"file://{path}"
    raise RuntimeError(
        f"WORLD_SIZE={world_size} but neither TESSERA_INIT_FILE nor MASTER_ADDR/MASTER_PORT "
        "is set: start the job with `tessera run`, `torchrun` or `tessera.launch`"
    )


def _limit_threads(local_world_size: int) -> None:
    """Share the cores among the ranks of this machine unless the user chose already.

    Four ranks on two cores, each with torch's default of one thread per core, spend their time
    preempting each other; torchrun sets OMP_NUM_THREADS=1 for the same reason.
    """
    if "OMP_NUM_THREADS" in os.environ or local_world_size <= 1:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _keep_freed_memory() -> None:
    """Let glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    A training step frees and reallocates the same large tensors (gradients, activations) every
    step. By default glibc serves blocks above a threshold with mmap and trims the heap's free top
    back to the OS, so the next step's allocation page-faults on every 4 KB page: on the 8-block
    MLP the pipeline benchmark trains, that is 5 of the 12 ms its weight-gradient pass takes.
    This is what the usual CPU advice of preloading tcmalloc or jemalloc achieves; it is skipped
    when an allocator is preloaded or the user set glibc's MALLOC_* variables.
    """
    if any(k.startswith("MALLOC_") for k in os.environ) or "LD_PRELOAD" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's largest allowed value
        libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        return


def _context_of_group(timeout_s: float) -> Context:
    backend = str(dist.get_backend())
    rank = dist.get_rank()
    local_rank = _env_int("LOCAL_RANK", rank)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return Context(
        rank=rank,
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", dist.get_world_size()),
        device=device,
        backend=backend,
        timeout_s=timeout_s,
    )


_context: Context | None = None
"""The Context of the group this process joined (`init`), or None before (and after shutdown)."""


def current_context() -> Context:
    """This process's `Context`: the one `init()` returned.

    A group joined without `init()` (a plain `dist.init_process_group`) gets one built once, its
    timeout from the environment as `init()` would read it. RuntimeError before any group.
    """
    global _context
    if not dist.is_initialized():
        raise RuntimeError("no process group was joined: call tessera.init() first")
    if _context is None:
        _context = _context_of_group(_timeout_from_environment())
    return _context


def init(backend: str | None = None, *, timeout_s: float | None = None) -> Context:
    """Join the default process group from the environment and return this rank's `Context`.

    Calling it again returns the context of the group already joined. `timeout_s` bounds every
    blocking wait of this rank (default 300 s, or TESSERA_TIMEOUT_S as `tessera.launch` hands it
    to the ranks it starts); it travels in the Context, the environment is left as it was.
    """
    global _context
    if dist.is_initialized():
        return current_context()
    if timeout_s is None:
        timeout_s = _timeout_from_environment()
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    backend = backend or os.environ.get(BACKEND_ENV) or _default_backend()
    _limit_threads(local_world_size)
    _keep_freed_memory()
    if backend == "nccl":  # one GPU per local rank: refused in one message where it has none
        check_local_rank(_env_int("LOCAL_RANK", 0), local_world_size)
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    dist.init_process_group(
        backend=backend,
        init_method=_init_method(world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _context = _context_of_group(float(timeout_s))
    return _context


_before_shutdown: list[Callable[[], None]] = []


def on_shutdown(callback: Callable[[], None]) -> None:
    """Run `callback` in `shutdown()` before the process group is left (registered once).

    Layers above the runtime (the communication streams) register what must stop while the group
    still exists; the runtime calls them without importing those layers.
    """
    if callback not in _before_shutdown:
        _before_shutdown.append(callback)


def shutdown() -> None:
    """Run the `on_shutdown` callbacks (the communication streams stop), then leave the process
    group (no-op if none was joined)."""
    global _context
    for callback in list(_before_shutdown):
        callback()
    if dist.is_initialized():
        dist.destroy_process_group()
    _context = None
