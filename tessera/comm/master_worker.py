"""Master-worker allreduce: gather every vector at rank 0, reduce there, send the result back.

The naive baseline (keep the naive version next to the fast one): the root's link carries
(p-1)·n bytes each way and the root does all the reducing.
Cost (Thakur, Rabenseifner & Gropp 2005): 2(p-1)(α + nβ) + (p-1)nγ.
"""

from __future__ import annotations

import torch

from tessera.comm._ops import reduce_many
from tessera.comm._p2p import Comm

__all__ = ["all_reduce_master_worker", "broadcast_flat", "reduce_master_worker"]


def reduce_master_worker(buf: torch.Tensor, root: int, op: str, comm: Comm) -> None:
    """Every rank sends `buf` to `root`, which reduces them in rank order into its `buf`."""
    p, r = comm.size, comm.rank
    if r != root:
        comm.send(buf, root)
        comm.finish()
        return
    parts = [buf if peer == r else torch.empty_like(buf) for peer in range(p)]
    handles = [comm.irecv(parts[peer], peer) for peer in range(p) if peer != r]
    for handle in handles:
        comm.wait(handle)
    result = torch.empty_like(buf)
    reduce_many(parts, result, op)
    buf.copy_(result)
    comm.finish()


def broadcast_flat(buf: torch.Tensor, root: int, comm: Comm) -> None:
    """The root sends `buf` to every other rank directly: (p-1)(α + nβ) at the root."""
    if comm.rank == root:
        for peer in range(comm.size):
            if peer != root:
                comm.isend(buf, peer)
    else:
        comm.recv(buf, root)
    comm.finish()


def all_reduce_master_worker(buf: torch.Tensor, op: str, comm: Comm) -> None:
    """Master-worker allreduce of the contiguous 1-D `buf`, in place (master: group rank 0)."""
    reduce_master_worker(buf, 0, op, comm)
    broadcast_flat(buf, 0, comm)
