"""The ring's segment streams: many segments per chunk, uneven and empty chunks, 2 and 3 ranks.

The ring cuts each chunk into segments of `ring.RING_SEGMENT_BYTES` (8 MB), so the suite's
other ring tests, on small tensors, send one segment per chunk. Here the ranks shrink the
segments to a few elements, so that every chunk is many segments, the reduce-scatter's scratch
slots are reused, the all-gather receives are posted while the reduce-scatter still runs, and
the last segment of a chunk is shorter than the others.

The oracle is the ring's reduction order written out in the test from every rank's input (each
rank regenerates the others' from their seeds): chunk c (`tensor_split` sizes) holds rank c+1's
value, plus rank c+2's, ..., plus rank c's, added left to right in the working dtype. The
results must equal it bit for bit: the order is fixed, so any other result is a misplaced or
missing segment, not rounding.
One spawn of 3 ranks: the world (p = 3) and the 2-rank group [0, 2] (global rank 2 is its
group rank 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tessera
from tessera import comm
from tessera.comm import ring

ENV = {"TESSERA_TIMEOUT_S": "20"}
SPAWN_TIMEOUT_S = 90

LENGTHS = (0, 1, 2, 7, 61, 300)
"""Fewer elements than ranks (empty chunks), one segment, and many segments per chunk."""

SEGMENT_CASES = ((12, 2), (20, 3), (4, 2))
"""(RING_SEGMENT_BYTES, RECEIVES_AHEAD): 3 or 5 float32 per segment, or one element each."""


def _ring_order(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """The ring's result from every rank's input (group order), reduced in the ring's order."""
    p = len(parts)
    chunks = [part.tensor_split(p) for part in parts]
    out = []
    for c in range(p):
        acc = chunks[(c + 1) % p][c].clone()
        for k in range(2, p + 1):
            other = chunks[(c + k) % p][c]
            acc = acc + other if op == "sum" else torch.maximum(acc, other)
        out.append(acc)
    return torch.cat(out)


def _values(seed: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over 6 decades: a sum in another order rounds differently
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -3, 3, (n,), generator=gen
    )
    return x.to(dtype)


def _rank_segments() -> list[str]:
    ctx = tessera.init()
    pair = dist.new_group([0, 2])
    wrong = []
    for group, members in ((None, [0, 1, 2]), (pair, [0, 2])):
        if ctx.rank not in members:
            continue
        me = members.index(ctx.rank)
        for seg_bytes, ahead in SEGMENT_CASES:
            ring.RING_SEGMENT_BYTES, ring.RECEIVES_AHEAD = seg_bytes, ahead
            for n in LENGTHS:
                for op, dtype in (("sum", torch.float32), ("max", torch.int64)):
                    case = f"p={len(members)} seg={seg_bytes} ahead={ahead} n={n} {op} {dtype}"
                    seed = 1000 * n + seg_bytes
                    mine = _values(seed + ctx.rank, n, dtype)
                    parts = [_values(seed + g, n, dtype) for g in members]
                    want = _ring_order(parts, op)
                    got = comm.all_reduce(mine.clone(), op, algorithm="ring", group=group)
                    if not torch.equal(got, want):
                        wrong.append(f"all_reduce {case}")
                    rows = mine.view(-1, 1)  # reduce_scatter splits rows like tensor_split
                    got = comm.reduce_scatter(rows, op, algorithm="ring", group=group)
                    if not torch.equal(got.view(-1), want.tensor_split(len(members))[me]):
                        wrong.append(f"reduce_scatter {case}")
                    got = comm.all_gather(mine, algorithm="ring", group=group)
                    if not torch.equal(got, torch.cat(parts)):
                        wrong.append(f"all_gather {case}")
    dist.barrier()
    return wrong


def test_ring_segments_are_exact_in_ring_order():
    results = tessera.launch(_rank_segments, 3, deadline_s=SPAWN_TIMEOUT_S, env=ENV)
    assert results == [[], [], []], results
