"""Collectives against torch.distributed's own (gloo), 2 and 4 ranks.

    python benchmarks/comm.py [--quick] [--worlds 2 4] [--repeats 5]    # allreduce, 4 KB-64 MB
    python benchmarks/comm.py gather [--worlds 2 4] [--repeats 5]       # all_gather, reduce_scatter

The logic lives in `tessera.comm.bench` and `tessera.comm.bench_gather`, so that `tessera bench
comm` runs the same code.
"""

from __future__ import annotations

import sys

from tessera.comm import bench, bench_gather

if __name__ == "__main__":
    if sys.argv[1:2] == ["gather"]:
        bench_gather.main(sys.argv[2:])
    else:
        bench.main()
