"""All-to-all allreduce: every rank sends its whole vector to every other and reduces locally.

One round of messages, so the latency term is a single α when the ranks' links work in parallel;
but every rank sends and receives (p-1)·n bytes and reduces p vectors.
Cost (Thakur, Rabenseifner & Gropp 2005, "direct" exchange): α + (p-1)nβ + (p-1)nγ with p-1
ports; (p-1)(α + nβ) + (p-1)nγ on one port. Memory: p vectors per rank.
Every rank reduces the p vectors in rank order, so every rank's result is bitwise the same.
"""

from __future__ import annotations

import torch

from tessera.comm._ops import reduce_many
from tessera.comm._p2p import Comm

__all__ = ["all_reduce_all_to_all"]


def all_reduce_all_to_all(buf: torch.Tensor, op: str, comm: Comm) -> None:
    """All-to-all allreduce of the contiguous 1-D `buf`, in place."""
    p, r = comm.size, comm.rank
    parts = [buf if peer == r else torch.empty_like(buf) for peer in range(p)]
    handles = [comm.irecv(parts[peer], peer) for peer in range(p) if peer != r]
    for step in range(1, p):  # staggered targets: rank r first sends to r+1, then r+2, ...
        comm.isend(buf, (r + step) % p)
    for handle in handles:
        comm.wait(handle)
    comm.finish()  # `buf` is still being sent until here
    result = torch.empty_like(buf)
    reduce_many(parts, result, op)
    buf.copy_(result)
