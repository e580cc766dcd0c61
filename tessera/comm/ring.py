"""Ring allreduce: reduce-scatter then all-gather around a ring (Patarasuk & Yuan 2009).

The vector is split into p chunks (`tensor_split` sizes: any length works, empty chunks too).
Reduce-scatter: in step s = 0..p-2, rank r sends chunk (r-s-1) mod p to rank r+1 and adds the
chunk (r-s-2) mod p coming from rank r-1 into its own copy; after p-1 steps rank r holds chunk r
reduced over all ranks. All-gather: the same ring passes the finished chunks on, p-1 steps.

Each phase runs as one stream of segments, not as p-1 steps with a stop between them: a segment
is passed on as soon as it is reduced (or, in the all-gather, has arrived) while the next one
is still in flight, and in an allreduce each segment of chunk r goes out to the all-gather the
moment its last addition is done, while the rest of the reduce-scatter is still arriving.
Receives are posted ahead of the data: gloo moves an unbound buffer only once the receiver has
posted its receive, so a receive posted late costs a round trip and a wake-up of the sender's
I/O thread. The reduce-scatter keeps a chunk's worth of receives posted, into scratch slots kept
from call to call; the all-gather receives straight into the output, on a tag of its own so
that they can be posted before the reduce-scatter's last receives (gloo matches receives to
sends in order, per tag). Every element is reduced in the same order as by the step-by-step
ring (chunk c: rank c+1's value, then c+2's, ...), so the results are the same bits.

Cost (Thakur, Rabenseifner & Gropp 2005): 2(p-1)α + 2n(p-1)/p·β + n(p-1)/p·γ. The bandwidth
term is optimal: some rank must send at least 2n(p-1)/p bytes (Patarasuk & Yuan 2009).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from tessera.comm._ops import combine
from tessera.comm._p2p import SECOND_TAG, Comm

__all__ = ["all_gather_ring", "all_reduce_ring", "reduce_scatter_ring", "split_bounds"]

SEGMENT_BYTES = 4 << 20
"""Segment size in bytes of the round-robin chain (`round_robin`): big enough that per-message
latency is amortised, small enough to overlap reduction and transfer on multi-MB vectors."""

RING_SEGMENT_BYTES = 8 << 20
"""The ring's segment size in bytes. Each message costs about 0.3 ms here on a call that starts
cold (after a barrier: two 8 MB exchanges as 16 messages of 1 MB took 26.7 ms, as 2 messages
22.1 ms, gloo's allreduce of 16 MB 21.9 ms), and at 16 MB, 4 ranks, one call per sample the
ring reached 0.94x gloo with 8 MB segments against 0.83x with 2 MB; back to back, 1-4 MB
segments were within noise. So a chunk is cut only when it is above 8 MB."""

RECEIVES_AHEAD = 2
"""Reduce-scatter receives kept posted (and scratch slots of one segment each), at least: with
2, the next segment arrives while this one is being reduced. A chunk's worth if that is more."""

_Segment = tuple[int, int, int]  # (step, start, stop): a piece of the chunk of ring step `step`


def split_bounds(numel: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """Element ranges of `tensor_split(parts)` over `numel // unit` rows of `unit` elements."""
    rows = numel // unit if unit else 0
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start * unit, stop * unit))
        start = stop
    return bounds


_local = threading.local()  # per thread: a collective on the comm stream runs beside the main one


def _receive_buffer(
    numel: int, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A (numel,) buffer for incoming segments, kept between calls (grown by doubling).

    A fresh `torch.empty` of a multi-MB buffer is a fresh mmap whose pages fault in on first
    touch, on every call: ~1 ms of page faults per 8 MB here, against ~16 ms for the whole 16 MB
    allreduce. The buffer lives as long as the thread: about one chunk (n/p elements), at least
    `RECEIVES_AHEAD` segments.
    """
    buffers = _local.__dict__.setdefault("buffers", {})
    key = (dtype, torch.device("cpu") if device is None else device)  # one per device
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        grown = max(numel, 2 * buf.numel()) if buf is not None else numel
        buf = buffers[key] = torch.empty(grown, dtype=dtype, device=key[1])
    return buf[:numel]


def _segments(lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
    step = max(1, RING_SEGMENT_BYTES // itemsize)
    return [(s, min(s + step, hi)) for s in range(lo, hi, step)]


def _stream(bounds: list[tuple[int, int]], first: int, p: int, itemsize: int) -> list[_Segment]:
    """The segments of chunks first, first-1, ..., first-p+2 (mod p) in order, with their step.

    A chunk is cut the same way on every rank, so the segments one rank sends in a phase pair
    up one to one with those its neighbour receives.
    """
    return [
        (step, a, b)
        for step in range(p - 1)
        for a, b in _segments(*bounds[(first - step) % p], itemsize)
    ]


def _reduce_scatter(
    buf: torch.Tensor,
    bounds: list[tuple[int, int]],
    op: str,
    comm: Comm,
    sends: list[dist.Work | None],
    finished: Callable[[int, int], None] | None = None,
) -> None:
    """The reduce-scatter stream; appends its sends to `sends` as it starts them, one per
    segment of `_stream(bounds, r-1)`, and does not wait for them.

    `finished(a, b)` is called as soon as `buf[a:b]`, a segment of chunk r, holds its final
    value (every send has been started by then).
    """
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    itemsize = buf.element_size()
    incoming = _stream(bounds, r - 2, p, itemsize)
    slot_len = max((b - a for _, a, b in incoming), default=0)
    # A whole chunk's segments stay posted: then every send of this phase has its receive
    # posted without the receiver waiting for anything, and `all_reduce_ring` may block on
    # them (with fewer, a ring of ranks each waiting for a send to go out would deadlock).
    ahead = max(RECEIVES_AHEAD, len(_segments(0, max(b - a for a, b in bounds), itemsize)))
    slots = _receive_buffer(ahead * slot_len, buf.dtype, buf.device)
    posted: deque = deque()

    def post(k: int) -> None:
        _, a, b = incoming[k]
        start = (k % ahead) * slot_len
        slot = slots[start : start + b - a]
        posted.append((comm.irecv(slot, left), slot))

    for k in range(min(ahead, len(incoming))):
        post(k)
    # step 0 sends this rank's own values of chunk r-1
    sends += [comm.isend(buf[a:b], right) for a, b in _segments(*bounds[(r - 1) % p], itemsize)]
    for k, (step, a, b) in enumerate(incoming):
        handle, slot = posted.popleft()
        comm.wait(handle)  # segment k+1 is already on its way while k is reduced
        combine(buf[a:b], slot, op)
        if k + ahead < len(incoming):
            post(k + ahead)  # into the slot just reduced
        if step < p - 2:
            sends.append(comm.isend(buf[a:b], right))  # step+1 passes it on
        elif finished is not None:
            finished(a, b)


def reduce_scatter_ring(
    buf: torch.Tensor, bounds: list[tuple[int, int]], op: str, comm: Comm
) -> None:
    """Leave chunk `bounds[rank]` of the 1-D `buf` reduced over the group (other chunks: junk)."""
    _reduce_scatter(buf, bounds, op, comm, [])
    comm.finish()


def _pass_on(
    buf: torch.Tensor, incoming: list[_Segment], handles: list, comm: Comm, tag: int
) -> None:
    """Wait for each all-gather segment in turn and send it on unless its step is the last."""
    right = (comm.rank + 1) % comm.size
    for (step, a, b), handle in zip(incoming, handles):
        comm.wait(handle)
        if step < comm.size - 2:
            comm.isend(buf[a:b], right, tag)


def all_gather_ring(buf: torch.Tensor, bounds: list[tuple[int, int]], comm: Comm) -> None:
    """Starting with chunk `bounds[rank]` of `buf` final, fill in every other chunk."""
    p, r = comm.size, comm.rank
    itemsize = buf.element_size()
    # Each incoming segment has its own place in `buf`: every receive can be posted at once.
    incoming = _stream(bounds, r - 1, p, itemsize)
    handles = [comm.irecv(buf[a:b], (r - 1) % p) for _, a, b in incoming]
    for a, b in _segments(*bounds[r], itemsize):
        comm.isend(buf[a:b], (r + 1) % p)
    _pass_on(buf, incoming, handles, comm, 0)
    comm.finish()


def all_reduce_ring(buf: torch.Tensor, op: str, comm: Comm) -> None:
    """Ring allreduce of the contiguous 1-D `buf`, in place."""
    p, r = comm.size, comm.rank
    bounds = split_bounds(buf.numel(), p)
    # The all-gather receives into the chunks the reduce-scatter sent, segment for segment
    # (both are `_stream(bounds, r-1)`): each may be posted once that send is out.
    incoming = _stream(bounds, r - 1, p, buf.element_size())
    handles: list = []
    sends: list[dist.Work | None] = []

    def post_receives() -> None:
        if len(handles) < len(incoming):
            for (_, a, b), send in zip(incoming, sends, strict=True):
                comm.wait_sent(send, (r + 1) % p)
                handles.append(comm.irecv(buf[a:b], (r - 1) % p, SECOND_TAG))

    def finished(a: int, b: int) -> None:
        post_receives()  # at the first final segment: every reduce-scatter send is started
        comm.isend(buf[a:b], (r + 1) % p, SECOND_TAG)

    _reduce_scatter(buf, bounds, op, comm, sends, finished)
    post_receives()  # (if chunk r is empty, nothing was final early)
    _pass_on(buf, incoming, handles, comm, SECOND_TAG)
    comm.finish()
