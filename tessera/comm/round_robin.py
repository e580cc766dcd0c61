"""Round-robin allreduce: the partial result travels rank 0 → 1 → … → p-1, then is broadcast.

Rank r receives x_0 ∘ … ∘ x_{r-1}, reduces its own vector in and passes it on; the last rank
holds the result and broadcasts it down a binomial tree. The vector moves in segments, so rank
r+1 already reduces segment k while rank r works on segment k+1 (a pipelined chain).
Cost: unsegmented (p-1)(α + nβ + nγ) + ⌈lg p⌉(α + nβ); with s segments the chain part falls to
(p-2+s)(α + (n/s)(β + γ)).
"""

from __future__ import annotations

import torch

from tessera.comm._ops import combine
from tessera.comm._p2p import Comm
from tessera.comm.ring import SEGMENT_BYTES
from tessera.comm.tree import broadcast_tree

__all__ = ["all_reduce_round_robin"]


def all_reduce_round_robin(buf: torch.Tensor, op: str, comm: Comm) -> None:
    """Round-robin allreduce of the contiguous 1-D `buf`, in place."""
    p, r = comm.size, comm.rank
    step = max(1, SEGMENT_BYTES // max(1, buf.element_size()))
    segments = [(a, min(a + step, buf.numel())) for a in range(0, buf.numel(), step)]
    if r > 0:
        incoming = torch.empty_like(buf)
        handles = [comm.irecv(incoming[a:b], r - 1) for a, b in segments]
    for k, (a, b) in enumerate(segments):
        if r > 0:
            comm.wait(handles[k])
            # (x_0 ∘ … ∘ x_{r-1}) ∘ x_r, in that order on every segment
            combine(incoming[a:b], buf[a:b], op)
            buf[a:b].copy_(incoming[a:b])
        if r < p - 1:
            comm.isend(buf[a:b], r + 1)
    comm.finish()
    broadcast_tree(buf, p - 1, comm)
