"""Step time of ZeRO-Offload with and without the one-step delayed parameter update (DPU).

`tessera.zero.initialize(stage=2, offload="cpu")` trains a GPT with `CPUAdam` on the host;
`delayed_update=True` runs each host step in a background thread beside the next forward and
backward (Ren et al. 2021, section 5). Both engines are built in the same rank processes and
measured interleaved (rounds A B A B, each round `--steps` steps after `--warm` unmeasured ones,
so DPU is past its warm-up), medians of the per-step times (the slowest rank's), for 1 and 2
ranks. Beside them, what bounds the overlap: the CPU Adam step alone on this rank's partition and
the forward+backward alone, timed the same way, and what DPU adds: the copy of the gradient
partition the background step reads (and, on one rank, the copy of the masters into the
parameters, which the all-gather of 2 ranks makes anyway). With the step hidden completely, a
DPU step costs max(forward+backward+reduction, Adam) instead of their sum, and only if a core is
free for the Adam thread: on 2 cores with 2 ranks there is none.

    flock /tmp/bench.lock python benchmarks/offload_dpu.py [--width 512] [--tokens 16 4]

Writes benchmarks/results/offload_dpu.json and prints a Markdown table.
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

import tessera

RESULTS = Path(__file__).parent / "results"


def _gpt(width: int, layers: int, context: int) -> torch.nn.Module:
    from tessera.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=96, block_size=context, n_layer=layers, n_head=4, n_embd=width))


def _slowest(seconds: float) -> float:
    """The slowest rank's time (a synchronous step lasts as long as its slowest rank)."""
    if tessera.init().world_size == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value)


def _rank(args: argparse.Namespace) -> dict[str, float]:
    ctx = tessera.init()
    torch.set_num_threads(1)  # one thread per rank (the Adam thread is the second one)
    world = ctx.world_size
    rows = args.batch // world
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(0, 96, (rows, args.tokens), generator=g)
    y = torch.randint(0, 96, (rows, args.tokens), generator=g)
    engines = {}
    for name, delayed in (("plain", False), ("dpu", True)):
        extra = {"delayed_update": True, "delayed_update_after": 1} if delayed else {}
        model, optimizer = tessera.zero.initialize(
            _gpt(args.width, args.layers, args.tokens), torch.optim.AdamW, stage=2,
            offload="cpu", lr=1e-4, **extra,
        )  # fmt: skip
        engines[name] = (model, optimizer)

    def step(model, optimizer) -> None:
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    times: dict[str, list[float]] = {"plain": [], "dpu": [], "fb": [], "adam": [], "copy": []}
    for _ in range(args.rounds):
        for name, (model, optimizer) in engines.items():
            for index in range(args.warm + args.steps):
                began = time.perf_counter()
                step(model, optimizer)
                took = _slowest(time.perf_counter() - began)
                if index >= args.warm:
                    times[name].append(took)
        # The bound: forward+backward (with the reduce-scatter) and the host Adam step alone.
        model, optimizer = engines["plain"]
        for _ in range(args.steps):
            began = time.perf_counter()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            times["fb"].append(_slowest(time.perf_counter() - began))
            grads = optimizer.gradient_slices()
            spares = [torch.empty_like(grad) for grad in grads]
            began = time.perf_counter()  # what DPU adds: the copy of the gradient partition
            for spare, grad in zip(spares, grads):
                spare.copy_(grad)
            times["copy"].append(_slowest(time.perf_counter() - began))
            for flat, grad in zip(optimizer.flats, grads):
                flat.master.grad = grad
            began = time.perf_counter()
            optimizer.optimizer.step()
            times["adam"].append(_slowest(time.perf_counter() - began))
            for flat in optimizer.flats:
                flat.master.grad = None
            optimizer.zero_grad()
    for _, optimizer in engines.values():
        optimizer.finish_step()
    params = engines["plain"][1].num_params()
    return {
        **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()},
        "params": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[16, 4], help="contexts per sequence to run"
    )
    parser.add_argument("--batch", type=int, default=2, help="global sequences per step")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    for tokens in args.tokens:
        for world in args.worlds:
            shape = argparse.Namespace(**{**vars(args), "tokens": tokens})
            result = tessera.launch(_rank, world, shape, deadline_s=1800)[0]
            rows.append({"ranks": world, "tokens": tokens, **result})
    load_after = os.getloadavg()
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": load_before,
        "load_average_after": load_after,
        "args": vars(args),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offload_dpu.json").write_text(json.dumps(report, indent=2))
    print(
        f"GPT {args.layers} blocks x width {args.width}, {rows[0]['params'] / 1e6:.1f} M params, "
        f"batch {args.batch}; load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    print(
        "| tokens/seq | ranks | no DPU step | DPU step | ratio | fwd+bwd alone | CPU Adam alone "
        "| gradient copy |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['tokens']} | {row['ranks']} | {row['plain_ms']:.1f} ms | "
            f"{row['dpu_ms']:.1f} ms | "
            f"{row['plain_ms'] / row['dpu_ms']:.2f}x | {row['fb_ms']:.1f} ms | "
            f"{row['adam_ms']:.1f} ms | {row['copy_ms']:.1f} ms |"
        )


if __name__ == "__main__":
    main()
