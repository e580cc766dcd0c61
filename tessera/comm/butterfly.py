"""Butterfly allreduce: recursive doubling (small) or Rabenseifner's halving + doubling (large).

Recursive doubling: in round k every rank exchanges its whole vector with rank ^ 2^k and
reduces: lg p·α + n·lg p·β + n·lg p·γ. Rabenseifner: recursive halving reduce-scatter (each round
exchanges half of the current range, the partner keeps the other half) then recursive doubling
all-gather of the pieces: 2 lg p·α + 2n(p-1)/p·β + n(p-1)/p·γ.

World sizes that are not powers of two fold in first: with p' the largest power of two ≤ p and
q = p - p', the first 2q ranks pair up, each even rank hands its vector to the odd one and sits
out; the p' remaining ranks run the butterfly; the odd ranks hand the result back. This adds
2α + 2nβ + nγ (Thakur, Rabenseifner & Gropp 2005, section 4).
"""

from __future__ import annotations

import torch

from tessera.comm._ops import combine
from tessera.comm._p2p import Comm

__all__ = ["SMALL_BYTES", "all_reduce_butterfly"]

SMALL_BYTES = 64 << 10
"""Below this many bytes, recursive doubling (fewer messages); above, Rabenseifner (fewer bytes)."""


def _recursive_doubling(buf: torch.Tensor, op: str, comm: Comm, me: int, pof2: int, real) -> None:
    scratch = torch.empty_like(buf)
    mask = 1
    while mask < pof2:
        partner = real(me ^ mask)
        comm.sendrecv(buf, partner, scratch, partner)
        combine(buf, scratch, op)  # a+b == b+a bitwise, so both partners hold the same values
        comm.finish()
        mask <<= 1


def _rabenseifner(buf: torch.Tensor, op: str, comm: Comm, me: int, pof2: int, real) -> None:
    lo, hi = 0, buf.numel()
    scratch = torch.empty((hi + 1) // 2, dtype=buf.dtype, device=buf.device)
    history = []  # (lo, hi, kept_lo, kept_hi) per halving round, replayed backwards
    mask = pof2 // 2
    while mask > 0:
        partner = real(me ^ mask)
        mid = (lo + hi) // 2
        if me & mask:  # upper partner keeps the upper half
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        incoming = scratch[: keep[1] - keep[0]]
        comm.sendrecv(buf[give[0] : give[1]], partner, incoming, partner)
        combine(buf[keep[0] : keep[1]], incoming, op)
        comm.finish()
        history.append((lo, hi, keep))
        lo, hi = keep
        mask >>= 1
    mask = 1
    for old_lo, old_hi, keep in reversed(history):
        partner = real(me ^ mask)
        other = (old_lo, keep[0]) if keep[0] > old_lo else (keep[1], old_hi)
        comm.sendrecv(buf[keep[0] : keep[1]], partner, buf[other[0] : other[1]], partner)
        comm.finish()
        mask <<= 1


def all_reduce_butterfly(buf: torch.Tensor, op: str, comm: Comm) -> None:
    """Butterfly allreduce of the contiguous 1-D `buf`, in place, for any world size."""
    p, r = comm.size, comm.rank
    pof2 = 1 << (p.bit_length() - 1)
    extra = p - pof2

    def real(virtual: int) -> int:  # virtual butterfly rank -> group rank
        return 2 * virtual + 1 if virtual < extra else virtual + extra

    if r < 2 * extra:  # fold in: even ranks hand their vector to the odd neighbour
        if r % 2 == 0:
            comm.send(buf, r + 1)
            me = -1
        else:
            scratch = torch.empty_like(buf)
            comm.recv(scratch, r - 1)
            combine(buf, scratch, op)
            me = r // 2
    else:
        me = r - extra
    if me >= 0:
        small = buf.numel() * buf.element_size() < SMALL_BYTES or buf.numel() < pof2
        (_recursive_doubling if small else _rabenseifner)(buf, op, comm, me, pof2, real)
    if r < 2 * extra:  # fold out
        if r % 2 == 1:
            comm.send(buf, r - 1)
        else:
            comm.recv(buf, r + 1)
    comm.finish()
