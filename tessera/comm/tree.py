"""Binomial-tree reduce and broadcast, and allreduce as reduce-then-broadcast.

With v = (rank - root) mod p, in round k rank v with bit k set sends its partial result to
v - 2^k and drops out; the others add what v + 2^k sends. After ⌈lg p⌉ rounds the root holds
the result. Broadcast runs the same tree backwards.

Cost (Thakur, Rabenseifner & Gropp 2005): reduce ⌈lg p⌉(α + nβ + nγ), broadcast ⌈lg p⌉(α + nβ);
allreduce 2⌈lg p⌉α + 2n⌈lg p⌉β + n⌈lg p⌉γ: few messages, so it wins on small vectors, but the
whole vector crosses every level, so it loses to the ring on large ones.
"""

from __future__ import annotations

import torch

from tessera.comm._ops import combine
from tessera.comm._p2p import Comm

__all__ = ["all_reduce_tree", "broadcast_tree", "reduce_tree"]


def reduce_tree(buf: torch.Tensor, root: int, op: str, comm: Comm) -> None:
    """Binomial reduce of `buf` to group rank `root` (other ranks' `buf` end as partial sums)."""
    p = comm.size
    v = (comm.rank - root) % p
    scratch = None
    mask = 1
    while mask < p:
        if v & mask:
            comm.send(buf, (v - mask + root) % p)
            break
        if v + mask < p:
            if scratch is None:
                scratch = torch.empty_like(buf)
            comm.recv(scratch, (v + mask + root) % p)
            combine(buf, scratch, op)
        mask <<= 1
    comm.finish()


def broadcast_tree(buf: torch.Tensor, root: int, comm: Comm) -> None:
    """Binomial broadcast of group rank `root`'s `buf` to every rank."""
    p = comm.size
    v = (comm.rank - root) % p
    mask = 1
    while mask < p:
        if v & mask:  # receive once, from the parent that clears our lowest set bit
            comm.recv(buf, (v - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            comm.isend(buf, (v + mask + root) % p)
        mask >>= 1
    comm.finish()


def all_reduce_tree(buf: torch.Tensor, op: str, comm: Comm) -> None:
    """Allreduce as binomial reduce to rank 0 then binomial broadcast."""
    reduce_tree(buf, 0, op, comm)
    broadcast_tree(buf, 0, comm)
