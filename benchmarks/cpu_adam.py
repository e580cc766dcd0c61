"""tessera CPUAdam against torch.optim.AdamW (fused, foreach) and DeepSpeed's CPU Adam if installed.

One process, one flat fp32 parameter per optimizer (ZeRO-Offload's host partition), the same
hyper-parameters and gradients. Steps are interleaved, A B C A B C ... with the order rotated
every round, so every optimizer sees the same machine load (on a shared machine separate runs
swing by 2x: only side-by-side figures mean anything). Reported: the median step time, parameters
per second, and the effective bandwidth: a step moves at least 28 bytes per parameter (reads p, g,
m, v; writes p, m, v), so 28 * N / time against the bandwidth of an in-place add timed in the same
interleaving says how close a kernel comes to the memory system's limit (a kernel with more
streams in flight can exceed the add's figure: it is a yardstick, not a hard floor).

All contenders read one shared gradient tensor (read-only for every one of them, and far larger
than the caches, so sharing it favours nobody) so that 200M fits in memory; foreach, ~10 passes
and large temporaries, runs only up to --foreach-max-millions. The load average before and after
each size is recorded: on a shared 2-core machine it says how much the figures can be trusted.

Page size matters here: CPUAdam puts its moments on transparent huge pages, the others keep
torch's 4 KiB pages. One more row steps parameters and a gradient of its own allocated with
`host_zeros` (huge pages), as ZeRO's `offload="cpu"` allocates its master and gradient slices.
With THP_MEM_ALLOC_ENABLE=1 in the environment torch puts every tensor of 2 MB or more on huge
pages too (all contenders, and the shared parameters and gradient); the output file name then
gets a `_thp` suffix, so both regimes can be compared.

    python benchmarks/cpu_adam.py [--sizes 10 50 200] [--rounds 15]

Writes benchmarks/results/cpu_adam{,_thp}.json and .md.
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
from tessera.optim.cpu_adam import host_zeros

RESULTS = Path(__file__).parent / "results"
BYTES_PER_PARAM = 28  # read p, g, m, v (16) + write p, m, v (12)
YARDSTICK = "in-place add (12 B/param)"
BASELINES = ("torch AdamW fused", "DeepSpeedCPUAdam")  # the anchors: the faster one counts
TARGETS = {"tessera CPUAdam": 1.0, "tessera CPUAdam bf16 moments": 1.3}  # x the faster anchor
FOREACH = "torch AdamW foreach"
STOCHASTIC = "tessera CPUAdam bf16 moments, stochastic rounding"
HUGE_PAGE_BUFFERS = "tessera CPUAdam bf16 moments, params + grads on huge pages (ZeRO offload)"
OWN_HUGE_PAGE_BUFFERS = {HUGE_PAGE_BUFFERS}  # parameters and gradient from host_zeros
PAGES_DEFAULT = "torch default (4 KiB); CPUAdam puts its own moments on huge pages"
PAGES_THP = "every tensor >= 2 MB on huge pages (THP_MEM_ALLOC_ENABLE=1), all contenders"
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


def optimizers(
    with_foreach: bool,
) -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    """Name -> factory of every contender available here."""
    contenders = {
        "tessera CPUAdam": lambda ps: CPUAdam(ps, **HYPER),
        "tessera CPUAdam bf16 moments": lambda ps: CPUAdam(ps, bf16_moments=True, **HYPER),
        STOCHASTIC: lambda ps: CPUAdam(
            ps, bf16_moments=True, moments_rounding="stochastic", **HYPER
        ),
        HUGE_PAGE_BUFFERS: lambda ps: CPUAdam(ps, bf16_moments=True, **HYPER),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),
    }
    if with_foreach:
        contenders[FOREACH] = lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER)
    deepspeed = _deepspeed_factory()
    if deepspeed is not None:
        contenders["DeepSpeedCPUAdam"] = deepspeed
    return contenders


def huge_page_mb() -> float:
    """MB of this process's memory on transparent huge pages now (Linux), else NaN: says whether
    the kernel granted the huge pages asked for (a fragmented host may not)."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def measure(
    num_params: int, rounds: int, with_foreach: bool
) -> tuple[dict[str, dict[str, float]], float]:
    """Median step seconds and params/s of each contender at `num_params`, interleaved; and the
    MB on huge pages while all of them are alive."""
    contenders = optimizers(with_foreach)
    states = {}
    grad = torch.randn(num_params) * 1e-2
    for name, factory in contenders.items():
        param = torch.randn(num_params)
        if name in OWN_HUGE_PAGE_BUFFERS:
            param = host_zeros((num_params,), torch.float32).copy_(param)
        param.requires_grad_()
        param.grad = grad
        if name in OWN_HUGE_PAGE_BUFFERS:
            param.grad = host_zeros((num_params,), torch.float32).copy_(grad)
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
    figures = {
        name: {"median_s": statistics.median(t), "params_per_s": num_params / statistics.median(t)}
        for name, t in times.items()
    }
    return figures, huge_page_mb()


def _bytes_per_param(name: str) -> int:
    return 20 if "bf16 moments" in name else BYTES_PER_PARAM  # bf16 m, v: 2 + 2 instead of 4 + 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 50, 200], help="millions")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--foreach-max-millions", type=int, default=50)
    args = parser.parse_args()
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "") not in ("", "0")
    rows, loads, huge_mb = [], {}, {}
    for millions in args.sizes:
        num_params = millions * 1_000_000
        load_before = os.getloadavg()[0]
        figures, huge_mb[num_params] = measure(
            num_params, args.rounds, millions <= args.foreach_max_millions
        )
        loads[num_params] = (load_before, os.getloadavg()[0])
        bandwidth = 12 * num_params / figures.pop(YARDSTICK)["median_s"]
        anchor = min(figures[name]["median_s"] for name in BASELINES if name in figures)
        for name, figure in figures.items():
            rows.append(
                {
                    "params": num_params,
                    "optimizer": name,
                    **figure,
                    "vs_faster_anchor": anchor / figure["median_s"],
                    "target": TARGETS.get(name),
                    "bandwidth_bytes_per_s": bandwidth,
                    "load_average_1min": loads[num_params],
                }
            )
    anchors = " and ".join(name for name in BASELINES if any(r["optimizer"] == name for r in rows))
    lines = [
        "# CPU Adam step (fp32 parameters, one flat parameter)",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; interleaved, median of "
        f"{args.rounds} steps; the in-place add (12 B/float) is timed in the same interleaving. "
        f"Pages: {PAGES_THP if thp else PAGES_DEFAULT}. "
        f"Ratio against the faster of {anchors} at each size. 1-min load average before -> after "
        "each size: "
        + ", ".join(f"{n / 1e6:.0f}M {a:.1f} -> {b:.1f}" for n, (a, b) in loads.items())
        + ". Memory on huge pages during each size: "
        + ", ".join(f"{n / 1e6:.0f}M {mb:.0f} MB" for n, mb in huge_mb.items())
        + ".",
        "",
        "| params | optimizer | median step (ms) | Gparam/s | vs faster anchor | target |"
        " GB/s moved | in-place add GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        target = f"{r['target']:.1f}x" if r["target"] is not None else ""
        lines.append(
            f"| {r['params'] / 1e6:.0f}M | {r['optimizer']} | {r['median_s'] * 1e3:.1f} | "
            f"{r['params_per_s'] / 1e9:.2f} | {r['vs_faster_anchor']:.2f}x | {target} | "
            f"{_bytes_per_param(r['optimizer']) * r['params_per_s'] / 1e9:.1f} | "
            f"{r['bandwidth_bytes_per_s'] / 1e9:.1f} |"
        )
    lines += ["", "GB/s moved: 28 B/param (20 with bf16 moments) over the median step."]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    stem = "cpu_adam_thp" if thp else "cpu_adam"
    (RESULTS / f"{stem}.md").write_text(text)
    payload = {
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "huge_pages_everywhere": thp,
        "huge_page_mb": {str(n): mb for n, mb in huge_mb.items()},
        "rows": rows,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
