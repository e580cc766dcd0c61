"""Shamir's t-of-n secret sharing (Shamir 1979, "How to share a secret") of 32-byte secrets.

A secret s is the constant term of a random polynomial f of degree t-1 over the prime field
GF(2^521 - 1) (a Mersenne prime, large enough for any 32-byte value); share i is (x_i, f(x_i))
with distinct non-zero x_i. Any t shares determine f, hence s = f(0), by Lagrange interpolation;
t-1 shares are consistent with every possible secret, so they reveal nothing about it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping

PRIME = 2**521 - 1
SECRET_BYTES = 32
SHARE_BYTES = 66  # ceil(521 / 8): one field element


def split(secret: bytes, xs: Iterable[int], threshold: int) -> dict[int, int]:
    """Shares `{x: f(x)}` of a 32-byte `secret` for each evaluation point x in `xs`."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"shamir: secrets are {SECRET_BYTES} bytes, got {len(secret)}")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        if not 0 < x < PRIME:
            raise ValueError(f"shamir: evaluation points must be in 1..PRIME-1, got {x}")
        value = 0
        for coefficient in reversed(coefficients):  # Horner's rule
            value = (value * x + coefficient) % PRIME
        shares[x] = value
    return shares


def combine(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret from at least `threshold` shares `{x: f(x)}` (Lagrange interpolation at 0)."""
    if len(shares) < threshold:
        raise ValueError(f"shamir: {len(shares)} shares cannot recover a {threshold}-of-n secret")
    points = list(shares.items())[:threshold]
    secret = 0
    for i, (x_i, y_i) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (x_j, _) in enumerate(points):
            if i != j:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        secret = (secret + y_i * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ValueError("shamir: the shares do not belong to one 32-byte secret")
    return secret.to_bytes(SECRET_BYTES, "big")


def share_to_bytes(value: int) -> bytes:
    """A share's field element as fixed-width bytes (what travels, encrypted)."""
    return value.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    """Inverse of `share_to_bytes`."""
    return int.from_bytes(data, "big")
