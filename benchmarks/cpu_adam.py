"""tessera CPUAdam against torch.optim.AdamW (fused, foreach) and DeepSpeed's CPU Adam if installed.

One process, one flat fp32 parameter per optimizer (ZeRO-Offload's host partition), the same
hyper-parameters and gradients. Steps are interleaved, A B C A B C ... with the order rotated
every round, so every optimizer sees the same machine load (on a shared machine separate runs
swing by 2x: only side-by-side figures mean anything). Reported: the median step time, parameters
per second, and the effective bandwidth: a step moves at least 28 bytes per parameter (reads p, g,
m, v; writes p, m, v), so 28 * N / time against the bandwidth of an in-place add timed in the same
interleaving says how close a kernel comes to the memory system's limit (a kernel with more
streams in flight can exceed the add's figure: it is a yardstick, not a hard floor).

    python benchmarks/cpu_adam.py [--sizes 10 50 200] [--rounds 15]

Writes benchmarks/results/cpu_adam.json and benchmarks/results/cpu_adam.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tessera.optim import CPUAdam

RESULTS = Path(__file__).parent / "results"
BYTES_PER_PARAM = 28  # read p, g, m, v (16) + write p, m, v (12)
YARDSTICK = "in-place add (12 B/param)"
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class InPlaceAdd:
    """`a.add_(b)` over N floats, stepped like an optimizer: the bandwidth yardstick.

    It moves 12 bytes per float (read a and b, write a) in Adam's read-modify-write pattern (a
    plain copy would also read its destination before writing it, a write-allocate Adam never
    pays). Timed in the same interleaving, so its bandwidth is measured under the same load.
    """

    def __init__(self, num_floats: int) -> None:
        self.a, self.b = torch.randn(num_floats), torch.randn(num_floats) * 1e-6

    def step(self) -> None:
        self.a.add_(self.b)


def _deepspeed_factory() -> Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - not installed or its build failed: leave it out
        return None
    return lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **HYPER)


def optimizers() -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    """Name -> factory of every contender available here."""
    contenders = {
        "tessera CPUAdam": lambda ps: CPUAdam(ps, **HYPER),
        "tessera CPUAdam bf16 moments": lambda ps: CPUAdam(ps, bf16_moments=True, **HYPER),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER),
    }
    deepspeed = _deepspeed_factory()
    if deepspeed is not None:
        contenders["DeepSpeedCPUAdam"] = deepspeed
    return contenders


def measure(num_params: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median step seconds and params/s of each contender at `num_params`, interleaved."""
    contenders = optimizers()
    states = {}
    for name, factory in contenders.items():
        param = torch.randn(num_params).requires_grad_()
        param.grad = torch.randn(num_params) * 1e-2
        optimizer = factory([param])
        optimizer.step()  # allocate the moments, build/warm the kernel
        states[name] = (param, optimizer)
    contenders[YARDSTICK] = None
    states[YARDSTICK] = (None, InPlaceAdd(num_params))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            optimizer = states[name][1]
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    return {
        name: {"median_s": statistics.median(t), "params_per_s": num_params / statistics.median(t)}
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 50], help="millions")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows = []
    for millions in args.sizes:
        num_params = millions * 1_000_000
        figures = measure(num_params, args.rounds)
        bandwidth = 12 * num_params / figures.pop(YARDSTICK)["median_s"]
        for name, figure in figures.items():
            rows.append(
                {
                    "params": num_params,
                    "optimizer": name,
                    **figure,
                    "bandwidth_bytes_per_s": bandwidth,
                }
            )
    fused = {r["params"]: r["median_s"] for r in rows if r["optimizer"] == "torch AdamW fused"}
    lines = [
        "# CPU Adam step (fp32, one flat parameter)",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; interleaved, median of "
        f"{args.rounds} steps; the in-place add (12 B/float) is timed in the same interleaving.",
        "",
        "| params | optimizer | median step (ms) | Gparam/s | vs torch fused | GB/s at 28 B/param |"
        " in-place add GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {r['optimizer']} | {r['median_s'] * 1e3:.1f} | "
            f"{r['params_per_s'] / 1e9:.2f} | {fused[r['params']] / r['median_s']:.2f}x | "
            f"{BYTES_PER_PARAM * r['params_per_s'] / 1e9:.1f} | "
            f"{r['bandwidth_bytes_per_s'] / 1e9:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_adam.md").write_text(text)
    payload = {"rounds": args.rounds, "threads": torch.get_num_threads(), "rows": rows}
    (RESULTS / "cpu_adam.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
