"""Gradient compression hooks: what a bucket's reduction sends, in fewer bytes.

A hook is a function `hook(bucket, all_reduce_mean)`: `all_reduce_mean(tensor)` averages a tensor
over the data-parallel group in place; the bucket's buffer holds this rank's gradient, and the hook
must leave the average of all ranks there.

- `fp16` / `bf16`: cast, reduce, cast back. Half the bytes; bf16 keeps fp32's range, fp16 keeps
  more mantissa (PyTorch's `fp16_compress_hook` does the same).
- `powersgd`: Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
  for Distributed Optimization" (NeurIPS 2019). Each gradient matrix M (n x m) is approximated by
  P Q^T with rank r: P = M Q, all-reduce P, orthonormalise P, Q = M^T P, all-reduce Q. It sends
  r(n + m) numbers instead of nm. The part of M the approximation misses is kept (error feedback)
  and added to the next step's gradient, so nothing is lost, only delayed. Vectors (biases, norms)
  are reduced uncompressed. Q is reused across steps (warm start), as in the paper.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.comm.flat import flatten, unflatten_into
from tessera.data_parallel.bucket import Bucket

__all__ = ["CompressionHook", "PowerSGD", "cast_hook", "resolve_compression"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
CompressionHook = Callable[[Bucket, AllReduce], None]


def cast_hook(dtype: torch.dtype) -> CompressionHook:
    """Reduce the bucket in `dtype` (e.g. float16), then write the result back at full width."""

    def hook(bucket: Bucket, all_reduce: AllReduce) -> None:
        low = bucket.buffer.to(dtype)
        all_reduce(low)  # low-precision dtypes accumulate in float32 inside tessera.comm
        bucket.buffer.copy_(low)

    hook.__name__ = f"{dtype}_compress"
    return hook


class PowerSGD:
    """Rank-`rank` PowerSGD with error feedback; state (Q and the error) lives per parameter."""

    def __init__(self, rank: int = 2, *, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"powersgd rank must be at least 1, got {rank}")
        self.rank = rank
        self._generator = torch.Generator().manual_seed(seed)  # same Q on every rank
        self._q: dict[int, torch.Tensor] = {}
        self._error: dict[int, torch.Tensor] = {}

    def _matrix_view(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient as a 2-D matrix, or None when compressing it would not pay."""
        if grad.dim() < 2:
            return None
        matrix = grad.reshape(grad.shape[0], -1)  # (n, m)
        n, m = matrix.shape
        return matrix if self.rank * (n + m) < n * m else None

    def __call__(self, bucket: Bucket, all_reduce: AllReduce) -> None:
        """Reduce the bucket: low-rank for matrices, exact for the rest."""
        uncompressed = []
        for position, param in enumerate(bucket.params):
            grad = bucket.view(position)
            matrix = self._matrix_view(grad)
            if matrix is None:
                uncompressed.append(grad)
                continue
            key = id(param)
            if key not in self._q:
                self._q[key] = torch.randn(
                    matrix.shape[1], self.rank, generator=self._generator
                ).to(matrix)
                self._error[key] = torch.zeros_like(matrix)
            self._compress(matrix, key, all_reduce)
        if uncompressed:
            flat = flatten(uncompressed)
            all_reduce(flat)
            unflatten_into(flat, uncompressed)

    def _compress(self, matrix: torch.Tensor, key: int, all_reduce: AllReduce) -> None:
        corrected = matrix + self._error[key]  # (n, m): this rank's gradient + what it owes
        q, _ = torch.linalg.qr(self._q[key])  # (m, r), warm start from last step, orthonormal
        p = corrected @ q  # (n, r)
        all_reduce(p)  # mean over ranks of M_r Q = M Q
        p, _ = torch.linalg.qr(p)  # orthonormal columns: the basis of the projection
        q = corrected.t() @ p  # (m, r)
        all_reduce(q)  # M^T P
        approximation = p @ q.t()  # (n, m): P P^T M, the mean gradient's rank-r projection
        # What the approximation missed of this rank's gradient is added to its next one.
        self._error[key] = corrected - approximation
        self._q[key] = q
        matrix.copy_(approximation)


def resolve_compression(compression: str | CompressionHook | None, powersgd_rank: int):
    """The hook named by `compression` ("fp16", "bf16", "powersgd"), a callable, or None."""
    if compression is None or callable(compression):
        return compression
    if compression == "fp16":
        return cast_hook(torch.float16)
    if compression == "bf16":
        return cast_hook(torch.bfloat16)
    if compression == "powersgd":
        return PowerSGD(powersgd_rank)
    raise ValueError(
        f"unknown compression {compression!r}; use 'fp16', 'bf16', 'powersgd', a callable or None"
    )
