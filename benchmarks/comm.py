"""Allreduce algorithms against torch.distributed's (gloo), sizes 4 KB to 64 MB, 2 and 4 ranks.

    python benchmarks/comm.py [--quick] [--worlds 2 4] [--repeats 5]

The logic lives in `tessera.comm.bench` so that `tessera bench comm` runs the same code.
"""

from __future__ import annotations

from tessera.comm.bench import main

if __name__ == "__main__":
    main()
