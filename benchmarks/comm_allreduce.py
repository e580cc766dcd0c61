"""Every allreduce algorithm against gloo's own, sizes 4 KB to 64 MB (`benchmarks/comm.py`).

For each world size (2 and 4 local ranks) and message size, every algorithm runs in turn
(A B C … A B C …, `repeats` rounds, after one warm-up), each sample timing enough back-to-back
calls to last ~50 ms; a sample's time is the slowest rank's. Reported: the median time, algbw =
S/t and busbw = algbw·2(p-1)/p (nccl-tests' definitions, S bytes per rank), the ratio of busbw to
`native` (torch.distributed.all_reduce on gloo), the cost model's prediction after `calibrate`,
and the machine's memory-bandwidth limit (a 64 MB `copy_` on every rank at once) with shm's busbw
as a fraction of it.

The traffic bound of shm on an ordinary tensor (issue 11): copy in (read n, write n), reduce
this rank's n/p (read n, write n/p), copy out (read n, write n) is (5 + 1/p)·n bytes per rank.
At the copy bandwidth every rank reaches at that size when all copy at once (a `copy_` of n
bytes on every rank, timed in the same interleaved rounds, moving 2n bytes) it takes
(5 + 1/p)/2 times that copy: `bound_s`; `share` = bound_s / shm's time. The table shows it
beside the targets (`SHARE_TARGETS`, and ring >= `RING_TARGET` x gloo at 16 MB).
Writes benchmarks/results/comm.json, comm.md and comm.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.comm._ops import ALGORITHMS

__all__ = ["FULL_SIZES", "QUICK_SIZES", "main", "run"]

FULL_SIZES = tuple(4096 * 4**k for k in range(8))  # 4 KB .. 64 MB
QUICK_SIZES = (4096, 65536, 1 << 20, 16 << 20)
VARIANTS = ("native", *(a for a in ALGORITHMS if a != "native"), "shm_shared", "auto")
"""Columns of the benchmark: `shm_shared` is shm on a tensor from `shared_buffer` (no copy in
or out); `auto` is the cost model's choice."""
_SAMPLE_S = 0.05
SHARE_TARGETS = {(2, 1 << 20): 0.3, (4, 1 << 20): 0.3, (2, 16 << 20): 0.8, (4, 16 << 20): 0.5}
"""(ranks, bytes) -> the share of the traffic bound shm must reach there (issue 11)."""
RING_TARGET = 0.9
"""ring's speed as a multiple of gloo's (native) at 16 MB (issue 11)."""


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _memory_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes per second one rank copies while every rank copies at the same time."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def interleaved_medians(
    calls: list[Callable[[], Any]], repeats: int
) -> tuple[list[float], list[int]]:
    """Median seconds per call of each of `calls`, timed interleaved on every rank (collective),
    and the calls per sample of each.

    A warm-up call sets how many calls make one ~`_SAMPLE_S` sample (the same count on every
    rank); each of `repeats` rounds then times one sample of every call in turn, after a barrier.
    A sample lasts as long as its slowest rank, so the ranks' samples are reduced by max.
    """
    counts = torch.zeros(len(calls), dtype=torch.float64)
    for i, call in enumerate(calls):
        dist.barrier()
        start = time.perf_counter()
        call()
        counts[i] = time.perf_counter() - start
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    per_sample = [max(1, min(200, int(_SAMPLE_S / max(t, 1e-6)))) for t in counts.tolist()]
    samples = torch.zeros(repeats, len(calls), dtype=torch.float64)
    for r in range(repeats):
        for i, call in enumerate(calls):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(per_sample[i]):
                call()
            samples[r, i] = (time.perf_counter() - start) / per_sample[i]
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return samples.median(dim=0).values.tolist(), per_sample


def _bench_rank(sizes: list[int], repeats: int) -> dict | None:
    import tessera
    from tessera import comm
    from tessera.comm import api, cost
    from tessera.comm._p2p import group_info

    ctx = tessera.init()
    world = ctx.world_size
    comm.set_checks(True)
    params = comm.calibrate()
    copy_bw = _memory_bandwidth()
    info = group_info(None)
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        plain = torch.zeros(numel)
        shared = comm.shared_buffer(numel)
        copies = (torch.ones(numel), torch.zeros(numel))
        choice = api._auto_all_reduce(plain, info)
        measured = (*VARIANTS, "copy")  # "copy": one `copy_` of n bytes, for the traffic bound

        def call(variant: str, plain=plain, shared=shared, copies=copies) -> None:
            if variant == "copy":
                copies[1].copy_(copies[0])
            elif variant == "shm_shared":
                comm.all_reduce(shared, algorithm="shm")
            elif variant == "native":  # the anchor: torch.distributed itself, no tessera layer
                dist.all_reduce(plain)
            else:
                comm.all_reduce(plain, algorithm=variant)

        medians, calls = interleaved_medians([partial(call, v) for v in measured], repeats)
        native_s, copy_s = medians[0], medians[-1]
        bound_s = (5 + 1 / world) / 2 * copy_s  # (5 + 1/p) n bytes at 2n bytes per copy_ of n
        for i, variant in enumerate(VARIANTS):
            algorithm = {"shm_shared": "shm", "auto": choice}.get(variant, variant)
            predicted = cost.predict(
                algorithm, nbytes, world, params, shared=variant == "shm_shared"
            )
            algbw = nbytes / medians[i] / 1e9
            rows.append(
                {
                    "world": world,
                    "bytes": nbytes,
                    "variant": variant,
                    "algorithm": algorithm,
                    "time_s": medians[i],
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (world - 1) / world,
                    "ratio_to_native": native_s / medians[i],
                    "predicted_s": predicted,
                    "calls_per_sample": calls[i],
                    "copy_s": copy_s,
                    "bound_s": bound_s,
                    "share_of_bound": bound_s / medians[i],
                }
            )
        del shared, copies
    if ctx.rank != 0:
        return None
    return {
        "world": world,
        "params": {k: getattr(params, k) for k in ("alpha", "beta", "gamma", "mu", "sigma")}
        | {"alpha_native": params.alpha_native},
        "copy_GBps_per_rank": copy_bw / 1e9,
        "rows": rows,
    }


def run(sizes: tuple[int, ...], worlds: tuple[int, ...], repeats: int) -> dict:
    """Run the benchmark on each world size (spawning local ranks) and return the results."""
    import tessera

    results = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "sizes": list(sizes),
        "repeats": repeats,
        "worlds": [],
    }
    for world in worlds:
        start = time.perf_counter()
        out = tessera.launch(_bench_rank, world, list(sizes), repeats, deadline_s=3600)[0]
        out["seconds"] = time.perf_counter() - start
        results["worlds"].append(out)
    return results


def _row(result: dict, variant: str, nbytes: int) -> dict:
    return next(r for r in result["rows"] if r["variant"] == variant and r["bytes"] == nbytes)


def markdown(results: dict) -> str:
    """The tables of BENCHMARKS.md: busbw and ratio to native, predictions, headline ratios."""
    lines = [
        "### Allreduce (float32, sum): busbw GB/s and (ratio to native)",
        "",
        f"Machine: {results['machine']['platform']}, {results['machine']['cpus']} CPUs, "
        f"torch {results['machine']['torch']}; median of {results['repeats']} interleaved "
        "repeats; a sample is the slowest rank's time. `shm_shared`: the tensor comes from "
        "`shared_buffer`. `auto`: the algorithm the cost model picked.",
        "",
    ]
    for result in results["worlds"]:
        world = result["world"]
        lines += [
            f"**{world} ranks** (memory copy limit: {result['copy_GBps_per_rank']:.2f} "
            "GB/s per rank, all ranks copying at once)",
            "",
        ]
        lines.append("| size | native ms | " + " | ".join(VARIANTS[1:]) + " | auto picks |")
        lines.append("|---" * (len(VARIANTS) + 2) + "|")
        for nbytes in results["sizes"]:
            native = _row(result, "native", nbytes)
            cells = [_label(nbytes), f"{native['time_s'] * 1e3:.3f}"]
            for variant in VARIANTS[1:]:
                row = _row(result, variant, nbytes)
                cells.append(f"{row['busbw_GBps']:.2f} ({row['ratio_to_native']:.2f}x)")
            cells.append(_row(result, "auto", nbytes)["algorithm"])
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        shm_frac = [
            _row(result, v, n)["busbw_GBps"] / result["copy_GBps_per_rank"]
            for v in ("shm", "shm_shared")
            for n in results["sizes"]
            if n >= 1 << 20
        ]
        if shm_frac:
            lines.append(
                f"shm busbw as a fraction of the copy limit at >= 1 MB: "
                f"{min(shm_frac):.2f} .. {max(shm_frac):.2f}"
            )
            lines.append("")
    lines += _bound_table(results)
    lines += [
        "### Cost model: predicted / measured time (median over sizes, [min, max])",
        "",
        "| ranks | " + " | ".join(VARIANTS) + " |",
        "|---" * (len(VARIANTS) + 1) + "|",
    ]
    for result in results["worlds"]:
        cells = [str(result["world"])]
        for variant in VARIANTS:
            ratios = [
                r["predicted_s"] / r["time_s"] for r in result["rows"] if r["variant"] == variant
            ]
            cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    p = results["worlds"][0]["params"]
    lines.append(
        "Calibrated (2 ranks): "
        + ", ".join(f"{k} = {v:.3g}" for k, v in p.items())
        + " (seconds, per byte for beta/gamma/mu)."
    )
    lines += [
        "",
        "### Headline ratios to native (busbw)",
        "",
        "| ranks | size | shm | shm_shared | ring | auto |",
        "|---|---|---|---|---|---|",
    ]
    for result in results["worlds"]:
        for nbytes in (1 << 20, 16 << 20):
            if nbytes not in results["sizes"]:
                continue
            cells = [str(result["world"]), _label(nbytes)]
            cells += [
                f"{_row(result, v, nbytes)['ratio_to_native']:.2f}x"
                for v in ("shm", "shm_shared", "ring", "auto")
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _bound_table(results: dict) -> list[str]:
    """shm against its traffic bound, and ring against gloo, with issue 11's targets beside."""
    lines = [
        "### shm on ordinary tensors against its traffic bound; ring against gloo",
        "",
        "bound = (5 + 1/p)·n bytes per rank at the copy bandwidth every rank reaches when all copy "
        "n bytes at once, timed in the same rounds: (5 + 1/p)/2 x `copy ms`. share = bound / shm "
        "time. ring / gloo: native's time over ring's (above 1: ring faster).",
        "",
        "| ranks | size | copy ms | bound ms | shm ms | share | target | ring ms | gloo ms "
        "| ring / gloo | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results["worlds"]:
        world = result["world"]
        for nbytes in results["sizes"]:
            shm, ring = _row(result, "shm", nbytes), _row(result, "ring", nbytes)
            native = _row(result, "native", nbytes)
            share_target = SHARE_TARGETS.get((world, nbytes))
            ring_target = RING_TARGET if nbytes == 16 << 20 else None
            lines.append(
                f"| {world} | {_label(nbytes)} | {shm['copy_s'] * 1e3:.3f} "
                f"| {shm['bound_s'] * 1e3:.3f} | {shm['time_s'] * 1e3:.3f} "
                f"| {shm['share_of_bound']:.0%} "
                f"| {f'>= {share_target:.0%}' if share_target else ''} "
                f"| {ring['time_s'] * 1e3:.3f} | {native['time_s'] * 1e3:.3f} "
                f"| {ring['ratio_to_native']:.2f}x "
                f"| {f'>= {ring_target}x' if ring_target else ''} |"
            )
    lines.append("")
    return lines


def plot(results: dict, path: Path) -> None:
    """busbw against size, one panel per world size, one line per algorithm (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = results["worlds"]
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
    for ax, result in zip(axes[0], worlds):
        for variant in VARIANTS:
            rows = [r for r in result["rows"] if r["variant"] == variant]
            style = "-" if variant in ("native", "shm", "shm_shared", "auto", "ring") else ":"
            ax.plot(
                [r["bytes"] for r in rows],
                [r["busbw_GBps"] for r in rows],
                style,
                marker="o",
                markersize=3,
                label=variant,
                linewidth=2 if variant == "native" else 1,
            )
        ax.axhline(result["copy_GBps_per_rank"], color="grey", linestyle="--", label="copy_ limit")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"allreduce, {result['world']} ranks (gloo, CPU)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Command line: `python benchmarks/comm.py [--quick] [--worlds 2 4] [--repeats 5]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 sizes (4 KB, 64 KB, 1 MB, 16 MB)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    results = run(sizes, tuple(args.worlds), max(1, args.repeats))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "comm.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (args.out / "comm.md").write_text(table)
    plot(results, args.out / "comm.png")
    print(table)
    print(f"wrote {args.out / 'comm.json'}, comm.md, comm.png")
    return results


if __name__ == "__main__":  # pragma: no cover
    main()
