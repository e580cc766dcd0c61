"""Shamir's t-of-n secret sharing (Shamir 1979, "How to share a secret") of 32-byte secrets.

A secret s is the constant term of a random polynomial f of degree t-1 over the prime field
GF(2^521 - 1) (a Mersenne prime, large enough for any 32-byte value); share i is (x_i, f(x_i))
with distinct non-zero x_i. Any t shares determine f, hence s = f(0), by Lagrange interpolation;
t-1 shares are consistent with every possible secret, so they reveal nothing about it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

PRIME = 2**521 - 1
SECRET_BYTES = 32
SHARE_BYTES = 66  # ceil(521 / 8): one field element


def split(secret: bytes, xs: Iterable[int], threshold: int) -> dict[int, int]:
    """Shares `{x: f(x)}` of a 32-byte `secret` for each evaluation point x in `xs`."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"shamir: secrets are {SECRET_BYTES} bytes, got {len(secret)}")
    coefficients = [int.from_bytes(secret, "big"), *_random_elements(threshold - 1)]
    shares = {}
    for x in xs:
        if not 0 < x < PRIME:
            raise ValueError(f"shamir: evaluation points must be in 1..PRIME-1, got {x}")
        value = 0
        for coefficient in reversed(coefficients):  # Horner's rule
            value = (value * x + coefficient) % PRIME
        shares[x] = value
    return shares


def _random_elements(count: int) -> list[int]:
    """`count` independent uniform elements of GF(PRIME) from one `os.urandom` call: 521 random
    bits are uniform on 0..2^521-1 = 0..PRIME, so only the value PRIME itself is redrawn."""
    raw = os.urandom(SHARE_BYTES * count)
    values = [
        int.from_bytes(raw[i : i + SHARE_BYTES], "big") & PRIME
        for i in range(0, len(raw), SHARE_BYTES)
    ]
    return [v if v != PRIME else _random_elements(1)[0] for v in values]


def combine(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret from at least `threshold` shares `{x: f(x)}` (Lagrange interpolation at 0)."""
    if len(shares) < threshold:
        raise ValueError(f"shamir: {len(shares)} shares cannot recover a {threshold}-of-n secret")
    points = list(shares.items())[:threshold]
    # f(0) = sum_i N_i / D_i with N_i = y_i prod_{j != i} x_j and D_i = prod_{j != i} (x_j - x_i).
    # Over the common denominator prod_i D_i the sum needs one modular inverse instead of t:
    # f(0) = (sum_i N_i prod_{k != i} D_k) / prod_k D_k, the inner products from prefix/suffix.
    numerators, denominators = [], []
    for i, (x_i, y_i) in enumerate(points):
        numerator, denominator = y_i, 1
        for j, (x_j, _) in enumerate(points):
            if i != j:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        numerators.append(numerator)
        denominators.append(denominator)
    prefix = [1]
    for denominator in denominators:
        prefix.append(prefix[-1] * denominator % PRIME)
    if prefix[-1] == 0:
        raise ValueError("shamir: two shares have the same evaluation point")
    total, suffix = 0, 1
    for i in reversed(range(len(points))):
        total = (total + numerators[i] * prefix[i] % PRIME * suffix) % PRIME
        suffix = suffix * denominators[i] % PRIME
    secret = total * pow(prefix[-1], -1, PRIME) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ValueError("shamir: the shares do not belong to one 32-byte secret")
    return secret.to_bytes(SECRET_BYTES, "big")


def share_to_bytes(value: int) -> bytes:
    """A share's field element as fixed-width bytes (what travels, encrypted)."""
    return value.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    """Inverse of `share_to_bytes`."""
    return int.from_bytes(data, "big")
