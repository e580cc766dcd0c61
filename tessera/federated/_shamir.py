"""Shamir's t-of-n secret sharing (Shamir 1979, "How to share a secret") of 32-byte secrets, in
numpy over the prime field GF(p), p = 2^26 - 5.

A 32-byte secret is cut into `CHUNKS` = 11 chunks of 25 bits (each below p); each chunk c is the
constant term of its own random polynomial f of degree t-1 over GF(p), and holder x gets f(x).
Any t shares determine every f, hence every chunk, by Lagrange interpolation at 0; t-1 shares are
consistent with every value of every chunk (the coefficients are independent and uniform), so
they reveal nothing about the secret. A share is therefore `CHUNKS` field elements per secret.

Why this field: a product of two elements is below 2^52, so a sum of up to 2^12 of them fits in
uint64 and both sharing (shares = Vandermonde matrix @ coefficients) and recovery (Lagrange
weights @ shares) are one uint64 matrix product over all chunks of all secrets and all holders,
reduced mod p once; a field large enough for a whole 32-byte secret would need Python integers,
one share and one coefficient at a time. Hence at most `MAX_HOLDERS` holders.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import numpy as np

PRIME = 2**26 - 5
CHUNK_BITS = 25
SECRET_BYTES = 32
CHUNKS = -(-8 * SECRET_BYTES // CHUNK_BITS)  # 11 chunks of 25 bits hold 256 bits
SHARE_BYTES = 4 * CHUNKS  # one secret's share: CHUNKS field elements, 4 bytes each
MAX_HOLDERS = 4096  # t products below 2^52 each must sum below 2^64
_CHUNK_MASK = (1 << CHUNK_BITS) - 1
_LOW_26_BITS, _PRIME_U64 = np.uint64(2**26 - 1), np.uint64(PRIME)


def split(secrets: Sequence[bytes], xs: Sequence[int], threshold: int) -> np.ndarray:
    """Shares of each 32-byte secret for each evaluation point: a uint64 array of shape
    (len(xs), len(secrets), CHUNKS); row i is what holder xs[i] gets."""
    if not 1 <= threshold <= len(xs) <= MAX_HOLDERS:
        raise ValueError(
            f"shamir: threshold {threshold} must be in 1..{len(xs)} holders (at most {MAX_HOLDERS})"
        )
    constant = np.array([_to_chunks(secret) for secret in secrets], dtype=np.uint64)
    coefficients = np.empty((threshold, constant.size), dtype=np.uint64)
    coefficients[0] = constant.ravel()  # f(0) = the secret; the other coefficients are random
    coefficients[1:] = random_elements((threshold - 1, constant.size))
    values = _vandermonde(tuple(int(x) for x in xs), threshold) @ coefficients % PRIME
    return values.reshape(len(xs), *constant.shape)


def combine(xs: Sequence[int], shares: np.ndarray, threshold: int) -> list[bytes]:
    """The secrets from the shares `shares[i]` (shape (secrets, CHUNKS)) held at points `xs[i]`,
    at least `threshold` of them (the first `threshold` are used): Lagrange interpolation at 0."""
    if len(xs) < threshold:
        raise ValueError(f"shamir: {len(xs)} shares cannot recover a {threshold}-of-n secret")
    held = np.asarray(shares[:threshold], dtype=np.uint64)
    weights = lagrange_at_zero(tuple(int(x) for x in xs[:threshold]))
    chunks = weights @ held.reshape(threshold, -1) % PRIME
    return [_from_chunks(row) for row in chunks.reshape(held.shape[1:])]


@functools.lru_cache(maxsize=256)
def _vandermonde(xs: tuple[int, ...], threshold: int) -> np.ndarray:
    """x_i^j mod p for each holder i and power j < threshold: f(x_i) = row i @ coefficients."""
    if any(not 0 < x < PRIME for x in xs) or len(set(xs)) != len(xs):
        raise ValueError(f"shamir: evaluation points must be distinct, in 1..PRIME-1: {list(xs)}")
    return np.array([[pow(x, j, PRIME) for j in range(threshold)] for x in xs], dtype=np.uint64)


@functools.lru_cache(maxsize=256)
def lagrange_at_zero(xs: tuple[int, ...]) -> np.ndarray:
    """The weights l_i = prod_{j != i} x_j / (x_j - x_i) (mod p) with f(0) = sum_i l_i f(x_i).
    One set of holders recovers many secrets (all survivors' seeds in a complete-graph round), so
    the weights are computed once per set."""
    weights = []
    for i, x_i in enumerate(xs):
        numerator, denominator = 1, 1
        for j, x_j in enumerate(xs):
            if i != j:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        if denominator == 0:
            raise ValueError(f"shamir: two shares have the same evaluation point {x_i}")
        weights.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return np.array(weights, dtype=np.uint64)


def random_elements(shape: tuple[int, ...]) -> np.ndarray:
    """Independent uniform elements of GF(p) from the OS's randomness: 26 random bits are uniform
    on 0..2^26-1, and the few values >= p are redrawn (rejection sampling)."""
    values = np.frombuffer(os.urandom(8 * math.prod(shape)), dtype=np.uint64) & _LOW_26_BITS
    if (rejected := values >= _PRIME_U64).any():
        values = values.copy()
        values[rejected] = random_elements((int(rejected.sum()),))
    return values.reshape(shape)


def share_from_bytes(data: bytes) -> np.ndarray:
    """The field elements of shares on the wire: each share is its CHUNKS elements as 4-byte
    big-endian words (`SHARE_BYTES`), several shares concatenated; refuses a length that is not
    whole shares or a value outside the field."""
    if not data or len(data) % SHARE_BYTES:
        raise ValueError(f"shamir: a share is {SHARE_BYTES} bytes, got {len(data)}")
    share = np.frombuffer(data, dtype=">u4").astype(np.uint64)
    if (share >= PRIME).any():
        raise ValueError("shamir: a share value is outside the field")
    return share


def _to_chunks(secret: bytes) -> list[int]:
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"shamir: secrets are {SECRET_BYTES} bytes, got {len(secret)}")
    value = int.from_bytes(secret, "big")
    return [value >> (CHUNK_BITS * i) & _CHUNK_MASK for i in range(CHUNKS)]


def _from_chunks(chunks: np.ndarray) -> bytes:
    value = 0
    for i, chunk in enumerate(chunks.tolist()):
        if chunk > _CHUNK_MASK:
            raise ValueError("shamir: the shares do not belong to one 32-byte secret")
        value |= chunk << (CHUNK_BITS * i)
    if value >= 1 << (8 * SECRET_BYTES):
        raise ValueError("shamir: the shares do not belong to one 32-byte secret")
    return value.to_bytes(SECRET_BYTES, "big")
