"""Reduction ops and the dtype rules of tessera's collectives.

Every algorithm reduces with the same five ops, given by name. Low-precision floats (bfloat16,
float16) are cast up to float32 once, reduced there and cast back once at the end: summing 8
bf16 values in bf16 loses up to 3 bits, summing them in float32 loses none that matter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "ALGORITHMS",
    "OPS",
    "PAIRWISE",
    "SUPPORTED_DTYPES",
    "accumulate_dtype",
    "check_op",
    "combine",
    "finish_mean",
]

OPS = ("sum", "mean", "max", "min", "product")

ALGORITHMS = (
    "ring",
    "tree",
    "butterfly",
    "all_to_all",
    "master_worker",
    "round_robin",
    "shm",
    "native",
)
"""Every algorithm `all_reduce` (and `reduce`) accepts, besides "auto"; diagnostics encode
an algorithm by its index here, so the order is part of the wire format."""

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.int64,
)

_NATIVE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # gloo has no AVG: sum, then divide (`finish_mean`)
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def check_op(op: str, dtype: torch.dtype) -> None:
    """Raise ValueError for an unknown op name or an unsupported dtype."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")


def native_op(op: str) -> dist.ReduceOp:
    """The torch.distributed op that computes `op` (mean: a sum, divided afterwards)."""
    return _NATIVE_OPS[op]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are kept in: float32 for bf16/fp16, else the dtype itself."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


PAIRWISE = {
    "sum": torch.add,
    "mean": torch.add,  # summed, then divided by `finish_mean`
    "max": torch.maximum,
    "min": torch.minimum,
    "product": torch.mul,
}
"""`PAIRWISE[op](a, b, out=c)`: c = a (op) b elementwise, for every op `check_op` accepts."""


def combine(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """`acc = acc (op) other`, elementwise and in place; mean sums (divided at the end)."""
    if acc.numel() == 0:
        return
    PAIRWISE[op](acc, other, out=acc)


def finish_mean(buf: torch.Tensor, op: str, world: int) -> None:
    """Divide a summed buffer by the world size when `op` is mean (integers: floor division)."""
    if op != "mean" or world == 1 or buf.numel() == 0:
        return
    if buf.is_floating_point():
        buf.div_(world)
    else:
        buf.floor_divide_(world)


def reduce_many(parts: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
    """`out = parts[0] (op) parts[1] (op) ...` in list order (the same order on every rank).

    Parts may be low precision; `out` is the accumulator dtype. A fixed order makes every rank's
    result bitwise identical, which the algorithms that reduce redundantly rely on.
    """
    out.copy_(parts[0])
    for part in parts[1:]:
        combine(out, part if part.dtype == out.dtype else part.to(out.dtype), op)
