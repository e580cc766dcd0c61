"""The public collectives: argument checks, algorithm choice, records, dtype and layout handling.

The algorithm modules see only a contiguous 1-D buffer in the accumulation dtype and a `Comm`;
this module turns any tensor (non-contiguous, bf16, 0-d, empty) into that buffer and back, picks
the algorithm ("auto": the cost model's fastest), and records the call for diagnosis.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tessera.comm import cost, diagnostics
from tessera.comm._ops import ALGORITHMS, accumulate_dtype, check_op, finish_mean, native_op
from tessera.comm._p2p import Comm, GroupInfo, group_info, next_seq
from tessera.comm.all_to_all import all_reduce_all_to_all
from tessera.comm.butterfly import all_reduce_butterfly
from tessera.comm.master_worker import (
    all_reduce_master_worker,
    broadcast_flat,
    reduce_master_worker,
)
from tessera.comm.ring import all_gather_ring, all_reduce_ring, reduce_scatter_ring, split_bounds
from tessera.comm.round_robin import all_reduce_round_robin
from tessera.comm.shm import gather as shm_gather
from tessera.comm.shm.group import shm_group
from tessera.comm.tree import all_reduce_tree, broadcast_tree, reduce_tree
from tessera.runtime.context import default_timeout_s

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older torch has only the first.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = [
    "ALGORITHMS",
    "GATHER_ALGORITHMS",
    "all_gather",
    "all_reduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "same_host",
    "shared_buffer",
]

BROADCAST_ALGORITHMS = ("tree", "master_worker", "shm", "native")
"""The algorithms `broadcast` accepts, besides "auto" ("master_worker": the root sends to all)."""

_ALL_REDUCE: dict[str, Callable[[torch.Tensor, str, Comm], None]] = {
    "ring": all_reduce_ring,
    "tree": all_reduce_tree,
    "butterfly": all_reduce_butterfly,
    "all_to_all": all_reduce_all_to_all,
    "master_worker": all_reduce_master_worker,
    "round_robin": all_reduce_round_robin,
}


def _timeout(timeout: float | None) -> float:
    if timeout is None:
        return default_timeout_s()
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return float(timeout)


def _check_algorithm(algorithm: str, allowed: tuple[str, ...]) -> None:
    if algorithm != "auto" and algorithm not in allowed:
        raise ValueError(f"algorithm must be 'auto' or one of {allowed}, got {algorithm!r}")


def same_host(group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of `group` can share memory with every other (collective, cached).

    Decided by a probe, not by host names: the first call per group (every rank at once) has
    group rank 0 create a file in /dev/shm holding a random token, and succeeds only if every
    rank can map it, read the token and reach every peer's wake-up pipe (`shm.segments.probe`).
    False also where this machine cannot order shared-memory accesses. A one-rank group: True.
    """
    info = group_info(group)
    return _same_host(info)


def _same_host(info: GroupInfo) -> bool:
    return info.size == 1 or shm_group(info).same_host


def _for_device(tensor: torch.Tensor, algorithm: str) -> str:
    """The algorithm for `tensor`'s device: a device tensor never reaches shared memory.

    The shared-memory transport copies host memory, and the cost model is fitted to the host's
    links, so for a CUDA (or other device) tensor "auto" means the backend's own collective
    (NCCL): it moves device memory directly. Point-to-point algorithms (ring, tree, ...) still
    run on device tensors when asked; "shm" is refused rather than silently copying to the host.
    """
    if tensor.device.type == "cpu":
        return algorithm
    if algorithm == "shm":
        raise ValueError(
            f"algorithm 'shm' moves host memory; this tensor is on {tensor.device}: use 'auto' "
            "(the backend's own collective, NCCL on CUDA) or a point-to-point algorithm"
        )
    return "native" if algorithm == "auto" else algorithm


_choices: dict[tuple, str] = {}


def _auto_all_reduce(tensor: torch.Tensor, info: GroupInfo) -> str:
    # Deterministic on every rank: same size, same world, same (broadcast) cost parameters.
    candidates = ("ring", "tree", "butterfly", "native")
    shared = False
    if _same_host(info):
        candidates += ("shm",)
        shared = shm_group(info).find(tensor) is not None
    nbytes = tensor.numel() * accumulate_dtype(tensor.dtype).itemsize
    params = cost.params_for(info.key)
    key = (info.key, nbytes, shared, params)
    choice = _choices.get(key)
    if choice is None:
        choice = cost.choose(nbytes, info.size, params, candidates=candidates, shared=shared)
        _choices[key] = choice
    return choice


def _start(
    kind: str, tensor: torch.Tensor, op: str, algorithm: str, info: GroupInfo, root: int = -1
) -> tuple[int, list[int] | None]:
    seq = next_seq(info)
    entry = diagnostics.record(seq, kind, algorithm, op, tensor, info.ranks)
    if info.size == 1 or not diagnostics.checks_enabled():
        return seq, None
    return seq, diagnostics.describe_words(entry, root)


def _work_buffer(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """A contiguous 1-D buffer in the accumulation dtype: `tensor` itself when possible."""
    acc = accumulate_dtype(tensor.dtype)
    if not copy and tensor.is_contiguous() and tensor.dtype == acc:
        return tensor.view(-1)
    return tensor.reshape(-1).to(acc, copy=True)


def _write_back(tensor: torch.Tensor, buf: torch.Tensor) -> None:
    if buf.data_ptr() != tensor.data_ptr() or buf.dtype != tensor.dtype or tensor.numel() == 0:
        tensor.copy_(buf.view(tensor.shape))


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Reduce `tensor` over the group, in place on every rank, and return it.

    `algorithm`: one of `ALGORITHMS`, or "auto" (the cost model's fastest for this size, world
    and dtype). bf16/fp16 accumulate in float32. Raises `CollectiveTimeout` past `timeout`
    seconds (default: this rank's `Context.timeout_s`, see `tessera.init`) and
    `CollectiveMismatch` if ranks disagree.
    """
    check_op(op, tensor.dtype)
    _check_algorithm(algorithm, ALGORITHMS)
    timeout_s = _timeout(timeout)
    info = group_info(group)
    if info.size == 1:
        _start("all_reduce", tensor, op, "native" if algorithm == "auto" else algorithm, info)
        return tensor
    algorithm = _for_device(tensor, algorithm)
    if algorithm == "auto":
        algorithm = _auto_all_reduce(tensor, info)
    seq, descriptor = _start("all_reduce", tensor, op, algorithm, info)
    if algorithm == "shm":
        group_shm = shm_group(info)
        if group_shm.same_host:
            group_shm.all_reduce(tensor, op, seq, timeout_s, descriptor)
            return tensor
        algorithm = "native"  # no shared memory (see `same_host`): every rank falls back alike
    comm = Comm(info, seq, "all_reduce", timeout_s, descriptor)
    if algorithm == "native":
        buf = _work_buffer(tensor, copy=False)  # bf16/fp16: reduced in float32 here too
        comm.verify()  # gloo aborts the process on mismatched sizes: check first
        work = dist.all_reduce(buf, op=native_op(op), group=group, async_op=True)
        comm.wait_native(work)
        comm.finish()
        finish_mean(buf, op, info.size)
        _write_back(tensor, buf)
        return tensor
    buf = _work_buffer(tensor, copy=False)
    _ALL_REDUCE[algorithm](buf, op, comm)
    comm.finish()
    finish_mean(buf, op, info.size)
    _write_back(tensor, buf)
    return tensor


def _group_rank(info: GroupInfo, global_rank: int, what: str) -> int:
    if global_rank not in info.ranks:
        raise ValueError(f"{what}={global_rank} is not a rank of the group {list(info.ranks)}")
    return info.ranks.index(global_rank)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: str = "sum",
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Reduce `tensor` over the group into global rank `dst`'s tensor (others: unchanged).

    "tree": binomial tree; "master_worker": every rank sends to `dst`; "native": torch's; any
    other allreduce algorithm runs on a copy and `dst` keeps the result. "auto": shm on one
    host, else tree. `timeout`: as in `all_reduce`.
    """
    check_op(op, tensor.dtype)
    _check_algorithm(algorithm, ALGORITHMS)
    info = group_info(group)
    root = _group_rank(info, dst, "dst")
    timeout_s = _timeout(timeout)
    if info.size == 1:
        _start("reduce", tensor, op, "native" if algorithm == "auto" else algorithm, info, root)
        return tensor
    algorithm = _for_device(tensor, algorithm)
    if algorithm == "auto":
        algorithm = "shm" if _same_host(info) else "tree"
    if algorithm not in ("tree", "master_worker", "native"):
        scratch = tensor.clone()
        all_reduce(scratch, op, algorithm=algorithm, group=group, timeout=timeout_s)
        if info.rank == root:
            tensor.copy_(scratch)
        return tensor
    seq, descriptor = _start("reduce", tensor, op, algorithm, info, root)
    comm = Comm(info, seq, "reduce", timeout_s, descriptor)
    if algorithm == "native":
        buf = _work_buffer(tensor, copy=True)
        comm.verify()
        work = dist.reduce(buf, dst, op=native_op(op), group=group, async_op=True)
        comm.wait_native(work)
    else:
        buf = _work_buffer(tensor, copy=True)
        fn = reduce_tree if algorithm == "tree" else reduce_master_worker
        fn(buf, root, op, comm)
    comm.finish()
    if info.rank == root:
        finish_mean(buf, op, info.size)
        _write_back(tensor, buf)
    return tensor


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Copy global rank `src`'s `tensor` into every rank's `tensor`, in place, and return it.

    `algorithm`: one of `BROADCAST_ALGORITHMS` or "auto" (shm on one host, else tree).
    `timeout`: as in `all_reduce`.
    """
    _check_algorithm(algorithm, BROADCAST_ALGORITHMS)
    info = group_info(group)
    root = _group_rank(info, src, "src")
    timeout_s = _timeout(timeout)
    if info.size == 1:
        _start("broadcast", tensor, "", "native" if algorithm == "auto" else algorithm, info, root)
        return tensor
    algorithm = _for_device(tensor, algorithm)
    if algorithm == "auto":
        algorithm = "shm" if _same_host(info) else "tree"
    seq, descriptor = _start("broadcast", tensor, "", algorithm, info, root)
    if algorithm == "shm":
        group_shm = shm_group(info)
        if group_shm.same_host:
            group_shm.broadcast(tensor, root, seq, timeout_s, descriptor)
            return tensor
        algorithm = "native"  # no shared memory: every rank falls back alike
    comm = Comm(info, seq, "broadcast", timeout_s, descriptor)
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    if algorithm == "native":
        comm.verify()
        comm.wait_native(dist.broadcast(buf, src, group=group, async_op=True))
    elif algorithm == "tree":
        broadcast_tree(buf.view(-1), root, comm)
    else:
        broadcast_flat(buf.view(-1), root, comm)
    comm.finish()
    if buf.data_ptr() != tensor.data_ptr():
        tensor.copy_(buf)
    return tensor


GATHER_ALGORITHMS = ("ring", "shm", "native")
"""The algorithms `all_gather` and `reduce_scatter` accept, besides "auto"."""


def _auto_half(kind: str, nbytes: int, info: GroupInfo) -> str:
    """The cost model's all_gather / reduce_scatter algorithm (the same on every rank)."""
    candidates = ("ring", "native", "shm") if _same_host(info) else ("ring", "native")
    params = cost.params_for(info.key)
    key = (kind, info.key, nbytes, params)
    choice = _choices.get(key)
    if choice is None:
        choice = cost.choose(nbytes, info.size, params, candidates=candidates, kind=kind)
        _choices[key] = choice
    return choice


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_end = a.data_ptr() + a.numel() * a.element_size()
    b_end = b.data_ptr() + b.numel() * b.element_size()
    return a.numel() > 0 and b.numel() > 0 and a.data_ptr() < b_end and b.data_ptr() < a_end


def all_gather(
    tensor: torch.Tensor,
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """The group's tensors (same shape on every rank) concatenated along dim 0 in rank order.

    `algorithm`: one of `GATHER_ALGORITHMS` or "auto" (the cost model's fastest: shm on one
    host for all but tiny tensors). Ring: (p-1)α + n(p-1)/p·β for n bytes of output; shm: one
    barrier and n(1 + 1/p) bytes copied (`shm.gather`). A 0-d tensor counts as shape (1,).
    `out`: a contiguous tensor of the result's shape and dtype to write into (it may hold
    `tensor` itself, as ZeRO's flat buffers do); else a new one is returned.
    """
    _check_algorithm(algorithm, GATHER_ALGORITHMS)
    info = group_info(group)
    timeout_s = _timeout(timeout)
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
    shape = (info.size * rows.shape[0], *rows.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    elif tuple(out.shape) != shape or out.dtype != tensor.dtype or not out.is_contiguous():
        raise ValueError(
            f"all_gather: out must be a contiguous {tensor.dtype} tensor of shape {shape}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    flat, src = out.view(-1), rows.reshape(-1)
    if info.size == 1:
        _start("all_gather", rows, "", "native" if algorithm == "auto" else algorithm, info)
        if src.data_ptr() != flat.data_ptr():
            flat.copy_(src)
        return out
    algorithm = _for_device(tensor, algorithm)
    if algorithm == "auto":
        algorithm = _auto_half("all_gather", flat.numel() * flat.element_size(), info)
    if algorithm == "shm" and not shm_group(info).same_host:
        algorithm = "native"  # no shared memory (see `same_host`): every rank falls back alike
    if algorithm != "shm" and _overlaps(src, flat):
        src = src.clone()  # ring and native write `out` while still sending from `tensor`
    seq, descriptor = _start("all_gather", rows, "", algorithm, info)
    if algorithm == "shm":
        shm_gather.all_gather(shm_group(info), src, flat, seq, timeout_s, descriptor)
        return out
    comm = Comm(info, seq, "all_gather", timeout_s, descriptor)
    if algorithm == "native":
        comm.verify()  # gloo aborts the process on mismatched sizes: check first
        comm.wait_native(_all_gather_single(flat, src, group=group, async_op=True))
    else:
        bounds = split_bounds(flat.numel(), info.size)
        lo, hi = bounds[info.rank]
        flat[lo:hi].copy_(src)
        all_gather_ring(flat, bounds, comm)
    comm.finish()
    return out


def reduce_scatter(
    tensor: torch.Tensor,
    op: str = "sum",
    *,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Rank r's share of the reduced `tensor`: the reduction of `tensor.tensor_split(p)[r]`.

    Uneven splits follow `tensor_split` (the first `len % p` ranks get one more row). Returns a
    new tensor; the input is not modified. `algorithm`: one of `GATHER_ALGORITHMS` or "auto".
    Ring: (p-1)α + n(p-1)/p·(β + γ); shm: one barrier, n bytes copied in and this rank's n/p
    reduced from every rank's copy, in rank order (`shm.gather`). bf16/fp16 accumulate in
    float32 and are rounded once.
    """
    check_op(op, tensor.dtype)
    _check_algorithm(algorithm, GATHER_ALGORITHMS)
    if tensor.dim() == 0:
        raise ValueError("reduce_scatter needs a tensor with at least one dimension")
    info = group_info(group)
    timeout_s = _timeout(timeout)
    p, r = info.size, info.rank
    unit = tensor[0].numel() if tensor.shape[0] else 0
    bounds = split_bounds(tensor.numel(), p, unit) if unit else [(0, 0)] * p
    lo, hi = bounds[r]
    rows = (hi - lo) // unit if unit else tensor.tensor_split(p)[r].shape[0]
    if p == 1:
        _start("reduce_scatter", tensor, op, "native" if algorithm == "auto" else algorithm, info)
        return tensor.clone()
    algorithm = _for_device(tensor, algorithm)
    if algorithm == "auto":
        algorithm = _auto_half("reduce_scatter", tensor.numel() * tensor.element_size(), info)
    if algorithm == "shm" and not shm_group(info).same_host:
        algorithm = "native"  # no shared memory: every rank falls back alike
    seq, descriptor = _start("reduce_scatter", tensor, op, algorithm, info)
    if algorithm == "shm":
        mine = torch.empty(hi - lo, dtype=accumulate_dtype(tensor.dtype))
        flat = tensor.reshape(-1)
        group_shm = shm_group(info)
        shm_gather.reduce_scatter(group_shm, flat, bounds, op, mine, seq, timeout_s, descriptor)
    else:
        buf = _work_buffer(tensor, copy=True)
        comm = Comm(info, seq, "reduce_scatter", timeout_s, descriptor)
        if algorithm == "native":
            comm.verify()
            mine = torch.empty(hi - lo, dtype=buf.dtype, device=buf.device)
            parts = [buf[a:b] for a, b in bounds]
            comm.wait_native(
                dist.reduce_scatter(mine, parts, op=native_op(op), group=group, async_op=True)
            )
        else:
            reduce_scatter_ring(buf, bounds, op, comm)
            mine = buf[lo:hi]
        comm.finish()
    finish_mean(mine, op, p)
    return mine.to(tensor.dtype).view(rows, *tensor.shape[1:])


def shared_buffer(
    numel: int, dtype: torch.dtype = torch.float32, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """A zeroed (numel,) tensor living in the group's shared-memory segment (collective call).

    Filling it in place and calling `all_reduce(..., algorithm="shm")` (or "auto") skips the copy
    into and out of the segment. Every rank must call it with the same arguments, in the same
    order. Without shared memory (one rank, several hosts) it returns an ordinary tensor.
    """
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    info = group_info(group)
    if info.size == 1 or not _same_host(info):
        return torch.zeros(numel, dtype=dtype)
    return shm_group(info).shared_buffer(numel, dtype, _timeout(None))
