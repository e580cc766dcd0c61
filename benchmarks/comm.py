"""Collectives against torch.distributed's own (gloo), 2 and 4 ranks.

    python benchmarks/comm.py [--quick] [--worlds 2 4] [--repeats 5]    # allreduce, 4 KB-64 MB
    python benchmarks/comm.py gather [--worlds 2 4] [--repeats 5]       # all_gather, reduce_scatter

`tessera bench comm [...]` runs this script with the same arguments. The benchmarks themselves
are `comm_allreduce.py` and `comm_gather.py` beside it (they shipped inside the library as
`tessera.comm.bench` and `tessera.comm.bench_gather` before; benchmark code is not the library's).
"""

from __future__ import annotations

import sys

import comm_allreduce
import comm_gather

if __name__ == "__main__":
    if sys.argv[1:2] == ["gather"]:
        comm_gather.main(sys.argv[2:])
    else:
        comm_allreduce.main(sys.argv[1:])
