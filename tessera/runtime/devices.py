"""Which device a collective needs, and whether this machine has the GPUs a launch asks for.

NCCL reduces device tensors only: a scalar that every rank sums (a norm's share, an overflow
flag, a loss) must live on this rank's GPU under NCCL and on the CPU under gloo. Code that builds
such a scalar asks `collective_device(group)` instead of assuming the CPU, so the same code runs
on both backends (DESIGN.md, principle 7).

Under NCCL each local rank drives the GPU of its `LOCAL_RANK`: `--nproc 2` on a one-GPU machine
would fail inside rank 1 ("invalid device ordinal") after the processes started. The launcher
and `tessera.init` refuse it up front with `gpu_shortage_message`, which says how to start fewer
ranks, choose the GPUs, or train on the CPU instead.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tessera.errors import ConfigError

__all__ = [
    "BACKEND_ENV",
    "check_local_rank",
    "collective_device",
    "check_visible_gpus",
    "gpu_shortage_message",
    "uses_nccl",
]

BACKEND_ENV = "TESSERA_BACKEND"
"""Environment variable that names the backend every rank joins with (`gloo` trains on the CPU
although CUDA is visible); unset: NCCL where CUDA is available, else gloo."""


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor that `group` reduces must live: this rank's GPU under NCCL, else the CPU
    (also without a process group: nothing is communicated then)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def uses_nccl() -> bool:
    """Would ranks started now join with NCCL (CUDA available and no `TESSERA_BACKEND` other
    than nccl)? What `tessera.init` picks without an explicit backend."""
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        return chosen == "nccl"
    return torch.cuda.is_available() and dist.is_nccl_available()


def gpu_shortage_message(ranks: int, gpus: int) -> str:
    """The one message for `ranks` local ranks on a machine with `gpus` visible GPUs."""
    return (
        f"{ranks} ranks on this machine need {ranks} GPUs under NCCL (one per rank), but "
        f"{gpus} {'is' if gpus == 1 else 'are'} visible. Start fewer ranks (--nproc {gpus}, "
        f"or --nproc auto: one per GPU), choose the GPUs with CUDA_VISIBLE_DEVICES, or train on "
        f"the CPU instead with {BACKEND_ENV}=gloo (gloo, every rank on the CPU)"
    )


def check_local_rank(local_rank: int, local_world_size: int) -> None:
    """Raise the one message when NCCL's rank `local_rank` has no GPU of its own (torchrun's
    LOCAL_RANK beyond the visible devices)."""
    gpus = torch.cuda.device_count()
    if local_rank >= gpus:
        raise ConfigError(gpu_shortage_message(max(local_world_size, local_rank + 1), gpus))


def check_visible_gpus(ranks: int, backend: str | None = None) -> None:
    """Before starting `ranks` local ranks: the one message where they would join with NCCL
    and fewer GPUs are visible (nothing to check for ranks that join with gloo). `backend`: the
    one the ranks are given (None: what `tessera.init` would pick, `uses_nccl`)."""
    nccl = uses_nccl() if not backend else backend == "nccl"
    if ranks > 1 and nccl:
        gpus = torch.cuda.device_count()
        if ranks > gpus:
            raise ConfigError(gpu_shortage_message(ranks, gpus))
