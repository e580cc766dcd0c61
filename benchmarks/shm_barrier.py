"""A/B of the shm barrier's sleep: a futex on the arrival counter or the named pipe.

    python benchmarks/shm_barrier.py [--worlds 2 4] [--sizes-mb 1 16] [--rounds 9]

The variants run in one process on two groups of the same ranks (one set up with the futex,
one with `TESSERA_SHM_FUTEX=0`'s pipe; `shm.SPIN_S` switched per variant), in turn round by
round with the order reversed every other round, so that the load of this shared machine hits
all alike. A round times `calls` all-reduces of one variant after a `dist.barrier`; a sample is
the slowest rank's time per call. The table gives each variant's median over the rounds, on the
main thread and on a side thread while the main thread computes (as DDP's comm stream does),
and the median over rounds of each variant's time over the pipe's in the same round (below 1:
faster than the pipe). `--phases` also times the phases of the futex variant's calls (main
thread): API and copy in, first barrier, reduce, second barrier, copy out (medians over every
call of every rank, and the slowest rank's mean), and each rank's CPU time outside barriers.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

VARIANTS = {  # name: (the group's sleep, how long a waiting main thread spins first)
    "pipe": ("pipe", 100e-6),
    "futex": ("futex", 100e-6),
    "futex, no spin": ("futex", 0.0),
}


def _groups(world: int) -> dict:
    import tessera.comm.shm.group as shm
    from tessera.comm._p2p import group_info
    from tessera.comm.shm import futex

    groups = {}
    for sleep in ("futex", "pipe"):
        futex.ENABLED = sleep == "futex"
        group = dist.new_group(list(range(world)))
        groups[sleep] = group
        assert shm.shm_group(group_info(group)).same_host
    futex.ENABLED = True
    for sleep, group in groups.items():  # the set-up happened: the mode is what we asked
        mode = shm.shm_group(group_info(group))._futex
        assert mode == (sleep == "futex"), (sleep, mode)
    return groups


def _timed(groups: dict, variant: str, tensor: torch.Tensor, calls: int, side: bool) -> float:
    import tessera.comm.shm.group as shm
    from tessera import comm

    sleep, shm.SPIN_S = VARIANTS[variant]
    group = groups[sleep]

    def run() -> None:
        for _ in range(calls):
            comm.all_reduce(tensor, algorithm="shm", group=group)

    dist.barrier()
    start = time.perf_counter()
    if not side:
        run()
        return (time.perf_counter() - start) / calls
    worker = threading.Thread(target=run)
    worker.start()
    a = torch.randn(96, 96)
    while worker.is_alive():  # compute beside the comm thread, as a backward pass would
        a = torch.tanh(a @ a.T * 0.01)
    worker.join()
    return (time.perf_counter() - start) / calls


def _phases(group, tensor: torch.Tensor, calls: int) -> dict:
    """Per-phase seconds of `calls` futex all-reduces, from stamps around the barriers: wall
    time of every phase, and the CPU time this rank spent outside the barriers ("work cpu")."""
    from tessera import comm
    from tessera.comm.shm.group import ShmGroup

    stamps: list[tuple[float, float]] = []
    real = ShmGroup.barrier

    def stamped(self, op, seq, timeout_s):
        stamps.append((time.perf_counter(), time.thread_time()))
        real(self, op, seq, timeout_s)
        stamps.append((time.perf_counter(), time.thread_time()))

    ShmGroup.barrier = stamped
    phases = defaultdict(list)
    try:
        dist.barrier()
        for _ in range(calls):
            stamps.clear()
            start, start_cpu = time.perf_counter(), time.thread_time()
            comm.all_reduce(tensor, algorithm="shm", group=group)
            end, end_cpu = time.perf_counter(), time.thread_time()
            (b1, b1c), (e1, e1c), (b2, b2c), (e2, e2c) = stamps
            for name, seconds in (
                ("api + copy in", b1 - start),
                ("barrier 1", e1 - b1),
                ("reduce", b2 - e1),
                ("barrier 2", e2 - b2),
                ("copy out", end - e2),
                ("call", end - start),
                ("work cpu", (b1c - start_cpu) + (b2c - e1c) + (end_cpu - e2c)),
                ("barrier cpu", (e1c - b1c) + (e2c - b2c)),
            ):
                phases[name].append(seconds)
    finally:
        ShmGroup.barrier = real
    return dict(phases)


def _rank(sizes: list[int], rounds: int, phases: bool) -> dict:
    import tessera
    import tessera.comm.shm.group as shm
    from tessera import comm

    ctx = tessera.init()
    torch.set_num_threads(1)
    groups = _groups(ctx.world_size)
    out: dict = {"rows": [], "phases": {}}
    for nbytes in sizes:
        numel = nbytes // 4
        base = torch.arange(numel, dtype=torch.float32) % 251
        want = base * ctx.world_size + sum(range(1, ctx.world_size + 1))
        for variant, (sleep, shm.SPIN_S) in VARIANTS.items():
            x = base + ctx.rank + 1  # small integers in float32: exact
            comm.all_reduce(x, algorithm="shm", group=groups[sleep])
            assert torch.equal(x, want), variant
        tensor = torch.ones(numel)
        calls = max(5, min(200, int(0.05 / (nbytes / 2e9 + 300e-6))))
        for side in (False, True):
            samples = torch.zeros(rounds, len(VARIANTS), dtype=torch.float64)
            for r in range(rounds):
                order = list(enumerate(VARIANTS))
                for i, variant in order if r % 2 == 0 else order[::-1]:
                    samples[r, i] = _timed(groups, variant, tensor, calls, side)
            dist.all_reduce(samples, op=dist.ReduceOp.MAX)
            medians = samples.median(dim=0).values.tolist()
            # paired: each variant over the pipe's time in the same round, median over rounds
            paired = (samples / samples[:, :1]).median(dim=0).values.tolist()
            row = {"bytes": nbytes, "thread": "side" if side else "main", "calls": calls}
            row["paired"] = dict(zip(VARIANTS, paired, strict=True))
            out["rows"].append(row | dict(zip(VARIANTS, medians, strict=True)))
        if phases:
            shm.SPIN_S = VARIANTS["futex"][1]
            got = _phases(groups["futex"], tensor, 3 * calls)
            everyone: list = [None] * ctx.world_size
            dist.all_gather_object(everyone, got)
            merged = {
                name: {
                    "median": statistics.median(s for g in everyone for s in g[name]),
                    "slowest_mean": max(statistics.fmean(g[name]) for g in everyone),
                }
                for name in got
            }
            out["phases"][nbytes] = merged
    return out if ctx.rank == 0 else None


def main() -> None:
    import tessera

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--phases", action="store_true")
    args = parser.parse_args()
    sizes = [int(mb * (1 << 20)) for mb in args.sizes_mb]
    names = list(VARIANTS)
    ratios = " | ".join(f"{v} / pipe" for v in names[1:])
    print("| ranks | size | thread | " + " | ".join(f"{v} µs" for v in names) + f" | {ratios} |")
    print("|---|---|---|" + "---|" * (2 * len(names) - 1))
    for world in args.worlds:
        result = tessera.launch(_rank, world, sizes, args.rounds, args.phases, deadline_s=1800)[0]
        for row in result["rows"]:
            mb = row["bytes"] / (1 << 20)
            cells = " | ".join(f"{row[v] * 1e6:.0f}" for v in names)
            cells += "".join(f" | {row['paired'][v]:.2f}" for v in names[1:])
            print(f"| {world} | {mb:g} MB | {row['thread']} | {cells} |")
        for nbytes, merged in result["phases"].items():
            parts = ", ".join(
                f"{name} {v['median'] * 1e6:.0f} ({v['slowest_mean'] * 1e6:.0f})"
                for name, v in merged.items()
            )
            print(
                f"phases, {world} ranks, {nbytes / (1 << 20):g} MB, µs median (slowest mean): "
                f"{parts}"
            )


if __name__ == "__main__":
    main()
