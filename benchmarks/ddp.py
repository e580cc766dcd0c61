"""tessera DataParallel vs torch DistributedDataParallel, side by side in one run.

Both engines wrap copies of the same GPT on the same 2 ranks and train on the same batches; steps
alternate in blocks (tessera, torch, tessera, torch, ...) so that both see the same machine load,
and the table reports medians and the ratio of steps/s (tessera / torch: above 1 means tessera is
faster). Exposed communication is the time the end of backward waited for gradient buckets
(tessera measures it directly; for torch it is measured the same way from outside, see
`tessera.strategies.torch_ddp.TorchDDPEngine`).

    python benchmarks/ddp.py [--quick] [--timeline]

`--timeline` also records, for tessera's engine on the communication-bound model, when each
bucket's last gradient arrived (its launch), when the communication thread started and finished
its all-reduce, and when backward ended, relative to the start of backward (medians over steps):
where the step's communication time goes.

Writes benchmarks/results/ddp.json and benchmarks/results/ddp.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.data_parallel import DataParallel
from tessera.models import GPT, GPTConfig

RESULTS = Path(__file__).parent / "results"
TARGETS = {"compute-bound": "-", "communication-bound": ">= 1.3"}
"""Issue 11's target for the ratio (communication-bound: every bucket size)."""
SIZES = {
    # name: (GPT shape, batch per rank, tokens per sequence)
    "compute-bound": (dict(n_layer=4, n_embd=320, n_head=5), 4, 64),
    "communication-bound": (dict(n_layer=7, n_embd=512, n_head=8), 1, 64),
}


def _model(shape: dict) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=96, block_size=64, **shape))


def _step(wrapped: nn.Module, optimizer, x, y) -> tuple[float, float]:
    """One training step; returns (step seconds, exposed communication seconds)."""
    began = time.perf_counter()
    loss = F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten())
    loss.backward()
    ended_backward = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = time.perf_counter() - began
    if isinstance(wrapped, DataParallel):
        return total, wrapped.exposed_comm_s
    return total, ended_backward - wrapped._tessera_last_grad[0]


def _torch_ddp(model: nn.Module, bucket_cap_mb: float) -> nn.Module:
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    stamp = [0.0]

    def mark(_param: torch.Tensor) -> None:
        stamp[0] = time.perf_counter()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(mark)
    ddp._tessera_last_grad = stamp
    return ddp


def _timeline(ours: DataParallel, optimizer, x, y, steps: int) -> list[dict]:
    """Per-bucket launch / start / end of the reduction, ms from the start of backward."""
    reducer = ours.reducer
    events: dict[str, dict[int, float]] = {"launch": {}, "start": {}, "end": {}}
    submit, reduce_bucket, wait = reducer.submit, reducer._reduce_bucket, reducer.wait

    def timed_submit(fn, *args, item=-1):
        events["launch"][item] = time.perf_counter()
        return submit(fn, *args, item=item)

    def timed_reduce(bucket):
        events["start"][bucket.index] = time.perf_counter()
        reduce_bucket(bucket)
        events["end"][bucket.index] = time.perf_counter()

    def timed_wait():
        events["backward_end"] = {0: time.perf_counter()}
        wait()

    reducer.submit, reducer._reduce_bucket, reducer.wait = timed_submit, timed_reduce, timed_wait
    per_step = []
    for _ in range(steps):
        loss = F.cross_entropy(ours(x).flatten(0, 1), y.flatten())
        began = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append(
            {
                "backward_end": 1e3 * (events["backward_end"][0] - began),
                "wait_end": 1e3 * (ended - began),
                "buckets": [
                    {k: 1e3 * (events[k][b.index] - began) for k in ("launch", "start", "end")}
                    for b in reducer.buckets
                ],
            }
        )
    del reducer.submit, reducer._reduce_bucket, reducer.wait  # back to the class's methods
    reducer._reduce_bucket = reduce_bucket
    median = statistics.median
    rows = []
    for i, bucket in enumerate(reducer.buckets):
        rows.append(
            {
                "bucket": i,
                "MB": bucket.offsets[-1] * 4 / 2**20,
                **{
                    k: median(s["buckets"][i][k] for s in per_step)
                    for k in ("launch", "start", "end")
                },
            }
        )
    rows.append(
        {
            "bucket": "backward",
            "backward_end": median(s["backward_end"] for s in per_step),
            "wait_end": median(s["wait_end"] for s in per_step),
        }
    )
    return rows


def _compare(
    size: str, bucket_cap_mb: float, steps: int, rounds: int, algorithm: str, timeline: bool = False
) -> dict:
    ctx = tessera.init()
    shape, batch, tokens = SIZES[size]
    ours_model, theirs_model = _model(shape), _model(shape)
    ours = DataParallel(ours_model, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm)
    theirs = _torch_ddp(theirs_model, bucket_cap_mb)
    engines = {
        "tessera": (ours, torch.optim.AdamW(ours_model.parameters(), lr=1e-4)),
        "torch": (theirs, torch.optim.AdamW(theirs_model.parameters(), lr=1e-4)),
    }
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(0, 96, (batch, tokens), generator=g)
    y = torch.randint(0, 96, (batch, tokens), generator=g)
    times: dict[str, list[float]] = {name: [] for name in engines}
    exposed: dict[str, list[float]] = {name: [] for name in engines}
    for wrapped, opt in engines.values():
        _step(wrapped, opt, x, y)  # warm-up: allocations, cost-model calibration
    for _ in range(rounds):
        for name, (wrapped, opt) in engines.items():
            for _ in range(steps):
                total, waited = _step(wrapped, opt, x, y)
                times[name].append(total)
                exposed[name].append(waited)
    if timeline:
        result_timeline = _timeline(ours, engines["tessera"][1], x, y, steps * rounds)
    ours.reducer.remove_hooks()
    params = sum(p.numel() for p in ours_model.parameters())
    result = {
        name: {
            "step_ms": 1e3 * statistics.median(times[name]),
            "exposed_comm_ms": 1e3 * statistics.median(exposed[name]),
        }
        for name in engines
    }
    result["ratio"] = result["torch"]["step_ms"] / result["tessera"]["step_ms"]
    result.update(
        size=size,
        bucket_cap_mb=bucket_cap_mb,
        params=params,
        batch=batch,
        tokens=tokens,
        buckets=len(ours.buckets),
    )
    if timeline:
        result["timeline"] = result_timeline
    return result


def _timeline_lines(row: dict) -> list[str]:
    """The per-bucket timeline of one run as a markdown table (ms from the start of backward)."""
    *buckets, end = row["timeline"]
    lines = [
        f"Timeline, tessera, communication-bound, bucket cap {row['bucket_cap_mb']:.0f} MB "
        "(ms from the start of backward, medians):",
        "",
        "| bucket | MB | last gradient (launch) | comm thread starts | reduced | reduce ms |",
        "|---|---|---|---|---|---|",
    ]
    for b in buckets:
        lines.append(
            f"| {b['bucket']} | {b['MB']:.1f} | {b['launch']:.1f} | {b['start']:.1f} "
            f"| {b['end']:.1f} | {b['end'] - b['start']:.1f} |"
        )
    lines += [
        "",
        f"Backward's last gradient hook done at {end['backward_end']:.1f} ms; backward returned "
        f"(all buckets reduced) at {end['wait_end']:.1f} ms.",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no bucket sweep")
    parser.add_argument("--algorithm", default="auto", help="tessera's all-reduce algorithm")
    parser.add_argument("--timeline", action="store_true", help="per-bucket timeline (tessera)")
    parser.add_argument("--sizes", nargs="+", default=None, help="only these runs, e.g. 25 1")
    args = parser.parse_args(argv)
    steps, rounds = (2, 2) if args.quick else (3, 4)
    runs = [(size, 25.0) for size in SIZES]
    if not args.quick:
        runs += [("communication-bound", cap) for cap in (1.0, 5.0, 100.0)]
    if args.sizes:
        runs = [("communication-bound", float(cap)) for cap in args.sizes]
    rows = []
    for size, cap in runs:
        timeline = args.timeline and size == "communication-bound"
        launched = tessera.launch(_compare, 2, size, cap, steps, rounds, args.algorithm, timeline)
        rows.append(launched[0])
        row = rows[-1]
        print(
            f"{size:<20} cap {cap:>5.0f} MB  tessera {row['tessera']['step_ms']:7.1f} ms  "
            f"torch {row['torch']['step_ms']:7.1f} ms  ratio {row['ratio']:.2f}",
            flush=True,
        )
        if "timeline" in row:
            print("\n".join(_timeline_lines(row)), flush=True)
    result = {
        "benchmark": "ddp",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.0f} at the end (other jobs share the cores)",
        "ranks": 2,
        "algorithm": args.algorithm,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ddp.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "## ddp: tessera DataParallel vs torch DistributedDataParallel",
        "",
        f"{result['machine']}; 2 ranks (gloo); tessera algorithm `{args.algorithm}`; medians of "
        f"{steps * rounds} steps per engine, engines alternating in blocks of {steps} steps. "
        "Ratio = torch step time / tessera step time (above 1: tessera faster).",
        "",
        "| model | params | batch/rank | bucket MB | buckets | tessera ms | torch ms | ratio "
        "| target | exposed comm tessera ms | exposed comm torch ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['size']} | {row['params'] / 1e6:.1f}M | {row['batch']}x{row['tokens']} "
            f"| {row['bucket_cap_mb']:.0f} | {row['buckets']} | {row['tessera']['step_ms']:.1f} "
            f"| {row['torch']['step_ms']:.1f} | **{row['ratio']:.2f}** | {TARGETS[row['size']]} "
            f"| {row['tessera']['exposed_comm_ms']:.1f} | {row['torch']['exposed_comm_ms']:.1f} |"
        )
    for row in rows:
        if "timeline" in row:
            lines += ["", *_timeline_lines(row)]
    (RESULTS / "ddp.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
