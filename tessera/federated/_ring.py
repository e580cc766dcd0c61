"""The ring of secure aggregation: reports as fixed-point elements of Z_{2^64} (numpy uint64,
whose addition wraps exactly mod 2^64), and the error a secure-aggregation round stops with.

With `frac_bits` f each coordinate is rounded to a multiple of 2^-f; the ring holds sums in
+-2^(63-f), so a report bound for a sum of n must stay below 2^(63-f) / n (`quantize`'s `count`).
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.errors import TesseraError

__all__ = ["FRAC_BITS", "SecureAggregationError", "dequantize", "quantize"]

FRAC_BITS = 32
"""Default fixed-point fraction bits: resolution 2^-32, range +-2^31 for the whole sum."""


class SecureAggregationError(TesseraError):
    """A secure-aggregation round cannot complete (too few survivors, a bad message)."""


def quantize(vector: torch.Tensor, frac_bits: int = FRAC_BITS, count: int = 1) -> np.ndarray:
    """`round(vector * 2^frac_bits)` as two's-complement uint64 (a ring element per coordinate).

    `count` is the number of reports that will be summed: every coordinate must be below
    2^(63 - frac_bits) / count in magnitude, so that the sum cannot wrap around the ring
    (refused with `SecureAggregationError` otherwise, and for non-finite values)."""
    if count < 1:
        raise ValueError(f"secure aggregation: count must be >= 1, got {count}")
    scaled = vector.detach().to(torch.float64).numpy() * 2.0**frac_bits  # a new array
    limit = 2.0**63 / count
    if scaled.size and not -limit < scaled.min() <= scaled.max() < limit:  # False for NaN
        raise SecureAggregationError(
            f"secure aggregation: a value cannot be represented: the sum of {count} reports must "
            f"stay in +-2^{63 - frac_bits}, so each value in +-2^{63 - frac_bits}/{count} "
            f"(largest magnitude {float(np.abs(scaled).max()) * 2.0**-frac_bits:.6g})"
        )
    ring = np.empty(scaled.shape, dtype=np.int64)
    np.rint(scaled, out=ring, casting="unsafe")  # rounded, then converted (exact: |x| < 2^62)
    return ring.view(np.uint64)


def dequantize(total: np.ndarray, frac_bits: int = FRAC_BITS) -> torch.Tensor:
    """The float64 value of a ring element read as a signed fixed-point number."""
    # times 2^-f is division by 2^f exactly; one pass, converting as it multiplies
    return torch.from_numpy(np.multiply(total.view(np.int64), 2.0**-frac_bits, dtype=np.float64))
