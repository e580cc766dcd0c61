"""All-gather and reduce-scatter through shared memory, double-buffered: one barrier per call.

Rank r of p, n bytes of input per rank, h = the group's turn number mod 2:

all_gather (output p·n bytes):
  1. copy the input into half h of slot r;
  2. barrier;
  3. copy half h of every slot to its place in the output.
reduce_scatter (output: chunk r of the input's `tensor_split` rows, reduced):
  1. copy the input, except chunk r that only this rank reads, into half h of slot r;
  2. barrier;
  3. reduce chunk r of half h over the p slots, in rank order, into the output.

Why one barrier is enough: after step 2 the peers read slot r until they reach their next
barrier. Rank r's next call writes the other half; the call after it writes half h again, but
only once it passed the barrier of the call in between, which no rank passes before every rank
arrived there, that is, finished reading half h. The descriptors that detect mismatched calls
alternate between two places of the control page the same way (`DESCRIPTOR_AT`), apart from
all_reduce's. all_reduce and broadcast keep their own segment ("scratch" in `ShmGroup.scratch`):
all_reduce writes into its peers' slots, which would race the readers of an earlier all_gather.

Memory traffic per rank, against all_reduce's (5 + 1/p)·n that ZeRO used before on one host:
all_gather reads and writes n + p·n (the copy out is the bound); reduce_scatter reads and
writes n(p-1)/p copying in, reads n and writes n/p reducing. Cost model: `cost.predict(kind=)`.
Every rank reduces its own chunk, so each element is reduced by one rank in one order (0, 1, ...
p-1): the result does not depend on timing, and with two ranks it equals any other order's.
"""

from __future__ import annotations

import torch

from tessera.comm._ops import reduce_many
from tessera.comm.shm.group import ShmGroup
from tessera.comm.shm.segments import Segment

__all__ = ["DESCRIPTOR_AT", "all_gather", "reduce_scatter"]

DESCRIPTOR_AT = (1024, 1536)
"""Byte offsets in a rank's control slot of the descriptor of an even / odd turn (all_reduce's
sits at 0, the barrier counter at 512, the sleeping flag at 640)."""

_ALIGN = 64
_BLOCK = 256 << 10  # bytes of output reduced at a time: the accumulator stays in cache


def _stage(group: ShmGroup, nbytes: int, timeout_s: float) -> tuple[Segment, int, int]:
    """(staging segment, byte offset of this turn's half in every slot, turn parity)."""
    half = (max(nbytes, 1) + _ALIGN - 1) // _ALIGN * _ALIGN
    segment = group.scratch(2 * half, timeout_s, purpose="staging")
    parity = group.turns % 2
    group.turns += 1
    return segment, parity * (segment.slot_bytes // 2), parity


def _exchange(
    group: ShmGroup,
    kind: str,
    flat: torch.Tensor,
    seq: int,
    timeout_s: float,
    words: list[int] | None,
    keep: tuple[int, int] = (0, 0),
) -> list[torch.Tensor]:
    """Steps 1 and 2 of both collectives: every rank's `flat`, as views of the staging slots.

    Elements `keep` = [lo, hi) of this rank's `flat` are not copied in (only it reads them).
    """
    segment, offset, parity = _stage(group, flat.numel() * flat.element_size(), timeout_s)
    slots, _ = group._plan(segment, offset, flat.numel(), flat.dtype)
    mine, (lo, hi) = slots[group.info.rank], keep
    mine[:lo].copy_(flat[:lo])
    mine[hi:].copy_(flat[hi:])
    published = group._publish(words, DESCRIPTOR_AT[parity])
    group.barrier(kind, seq, timeout_s)
    group._check(published, DESCRIPTOR_AT[parity])
    return slots


def all_gather(
    group: ShmGroup,
    flat: torch.Tensor,
    out: torch.Tensor,
    seq: int,
    timeout_s: float,
    words: list[int] | None = None,
) -> None:
    """Fill the contiguous 1-D `out` (p·n) with every rank's contiguous 1-D `flat` (n)."""
    n = flat.numel()
    for q, slot in enumerate(_exchange(group, "all_gather", flat, seq, timeout_s, words)):
        out[q * n : (q + 1) * n].copy_(slot)


def reduce_scatter(
    group: ShmGroup,
    flat: torch.Tensor,
    bounds: list[tuple[int, int]],
    op: str,
    out: torch.Tensor,
    seq: int,
    timeout_s: float,
    words: list[int] | None = None,
) -> None:
    """Reduce elements `bounds[rank]` of the contiguous 1-D `flat` over the group into `out`.

    `out` has `hi - lo` elements in the accumulation dtype; "mean" is left as a sum.
    """
    r = group.info.rank
    lo, hi = bounds[r]
    parts = list(_exchange(group, "reduce_scatter", flat, seq, timeout_s, words, keep=(lo, hi)))
    parts[r] = flat  # this rank's own chunk is read where it is: it was not copied in
    step = max(1, _BLOCK // out.element_size())
    for start in range(lo, hi, step):
        stop = min(start + step, hi)
        reduce_many([part[start:stop] for part in parts], out[start - lo : stop - lo], op)
