"""ZeRO-Offload's host step in a bf16 run: what it reads and writes besides Adam's own pass.

Two measurements, interleaved (A B B A ...), medians:

1. `CPUAdam` on `--params` float32 parameters with bf16 gradients, two ways: the gradient
   widened into a float32 buffer first and stepped as `.grad` (what offload did before it
   handed the bf16 partition over), and read as it is by the kernel (`step(grads=[...])`); both
   also write the bf16 copy that goes up (`bf16_out`).
2. `tessera.setup(strategy="zero2", precision="bf16")` on one rank, `train_step` + `step`, with
   `offload="cpu"` (with and without the delayed update) and without offload (the same ZeRO-2
   stepping torch's fused AdamW): the issue's measure is offload's step over its own no-offload
   step.
   The model is an embedding of `--params` parameters and a small head: little compute, so the
   step is mostly the optimizer's. On a CPU-only machine the "device" is host memory too, and
   the delayed update's background step shares the cores with the training thread.

    python benchmarks/offload_host_step.py [--params 33554432] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import tessera
from tessera.optim import CPUAdam
from tessera.zero import OffloadPolicy


def _interleaved(cases: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict:
    """Median seconds per call of each case, rounds in A B B A order."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(rounds):
        order = list(cases) if index % 2 == 0 else list(reversed(cases))
        for name in order:
            for _ in range(steps):
                began = time.perf_counter()
                cases[name]()
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(values) for name, values in times.items()}


def _adam_cases(numel: int) -> dict[str, Callable[[], None]]:
    generator = torch.Generator().manual_seed(0)
    low = torch.randn(numel, generator=generator).bfloat16()
    widened = torch.empty(numel)
    out = torch.empty(numel, dtype=torch.bfloat16)
    first = nn.Parameter(torch.randn(numel, generator=generator))
    second = nn.Parameter(first.detach().clone())
    widen_then_step, read_bf16 = CPUAdam([first], lr=1e-4), CPUAdam([second], lr=1e-4)

    def widen() -> None:
        first.grad = widened.copy_(low)
        widen_then_step.step(bf16_out=[out])

    def read() -> None:
        read_bf16.step(bf16_out=[out], grads=[low])

    return {"widen, then step": widen, "bf16 read by the kernel": read}


def _engine_cases(numel: int) -> dict[str, Callable[[], None]]:
    width = 128
    rows = numel // width
    x = torch.randint(rows, (8, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 16, width)
    cases = {}
    for name, offload in (
        ("no offload", None),
        ("offload", "cpu"),
        ("offload, delayed update", OffloadPolicy(delayed_update=True, delayed_update_after=2)),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(rows, width), nn.Linear(width, width))
        fused = {"fused": True} if offload is None else {}  # (offload steps CPUAdam)
        engine = tessera.setup(
            model, lambda p, fused=fused: torch.optim.AdamW(p, lr=1e-4, **fused),
            strategy="zero2", precision="bf16",
            loss_fn=lambda out, target: (out.float() - target).pow(2).mean(),
            **({"offload": offload} if offload is not None else {}),
        )  # fmt: skip

        def step(engine: tessera.Engine = engine) -> None:
            engine.train_step((x, y))
            engine.step()

        for _ in range(3):  # past the delayed update's 2 steps in place
            step()
        cases[name] = step
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=2**25)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("TESSERA_BACKEND", "gloo")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29583")
    tessera.init()
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, {args.params / 1e6:.1f}M parameters")
    adam = _interleaved(_adam_cases(args.params), args.rounds, 3)
    print("\n| CPUAdam step, bf16 gradients | median ms |\n|---|---:|")
    for name, seconds in adam.items():
        print(f"| {name} | {seconds * 1e3:.1f} |")
    engine = _interleaved(_engine_cases(args.params), args.rounds, 3)
    plain = engine["no offload"]
    print("\n| zero2 bf16, one rank, train_step + step | median ms | over no offload |")
    print("|---|---:|---:|")
    for name, seconds in engine.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / plain:.2f}x |")


if __name__ == "__main__":
    main()
