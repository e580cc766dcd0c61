"""Loader workers on data whose items cost 10 ms each: `--num-workers 0` against `2`.

A `--model` run (a linear layer: the step itself costs almost nothing) on a data set whose every
item takes 10 ms of CPU to produce (a busy wait, as decoding or augmenting takes a core), batch 8,
one rank. Runs alternate (0 2 0 2 ...), `--repeats` times each; for each run it takes tessera's
reported samples/s (the summary's median over the steps) and the wall-clock rate (steps x batch
over the training loop's wall time, from before the first batch to after the last step), and the
median over repeats. Prints a table and writes benchmarks/results/data_loader.json / .md.

    python benchmarks/data_loader.py [--steps 100] [--repeats 3] [--sleep]

`--sleep`: items that wait 10 ms (a sleep, as a read from a remote store does) instead of
computing: the workers' overlap without the competition for cores
(benchmarks/results/data_loader_sleep.*).

The machine's load (os.getloadavg) is recorded before and after: on a shared 2-core machine the
workers compete with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

RESULTS = Path(__file__).parent / "results"
ITEM_S = 0.010
BATCH = 8


class SlowItems(torch.utils.data.Dataset):
    """Items that cost ITEM_S each, of CPU (a busy wait) or of waiting (a sleep, as reading a
    remote file does); 16 features, 4 targets."""

    def __init__(self, sleep: bool = False) -> None:
        self.sleep = sleep

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep:
            time.sleep(ITEM_S)
        else:
            deadline = time.perf_counter() + ITEM_S
            while time.perf_counter() < deadline:
                pass
        x = torch.full((16,), float(index % 7))
        return x, x[:4] * 0.5


def slow_items() -> SlowItems:
    return SlowItems()


def sleeping_items() -> SlowItems:
    return SlowItems(sleep=True)


def linear() -> nn.Module:
    return nn.Linear(16, 4)


def mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, targets)


def run_once(workers: int, steps: int, out: Path, data: str) -> dict[str, float]:
    """One `tessera train` run in this process (one rank); its reported and wall-clock rates."""
    from tessera.train import run_training
    from tessera.train.config_build import build_config

    config = build_config(
        {
            "strategy": "single", "nproc": 1, "model_factory": "data_loader:linear",
            "data": f"data_loader:{data}", "loss": "data_loader:mse", "batch_size": BATCH,
            "steps": steps, "checkpoint_every": 0, "progress": False, "out": str(out),
            "loader": {"num_workers": workers},
        }
    )  # fmt: skip
    summary = run_training(config)
    wall = steps * BATCH / summary["wall_s"]
    return {"reported": summary["samples_per_s"], "wall": wall, "data_s": summary["data_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sleep", action="store_true", help="items that wait 10 ms (I/O) instead of computing"
    )
    args = parser.parse_args()
    data = "sleeping_items" if args.sleep else "slow_items"
    load_before = os.getloadavg()
    runs: dict[int, list[dict[str, float]]] = {0: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for workers in runs:
                runs[workers].append(
                    run_once(workers, args.steps, Path(tmp) / f"{workers}-{repeat}", data)
                )
    load_after = os.getloadavg()
    table = {
        workers: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for workers, rs in runs.items()
    }
    speedup = table[2]["wall"] / table[0]["wall"]
    kind = "waiting (sleep)" if args.sleep else "CPU (busy wait)"
    name = "data_loader_sleep" if args.sleep else "data_loader"
    lines = [
        f"## {name}: `--num-workers 2` against 0 on items costing {ITEM_S * 1e3:.0f} ms of {kind}",
        "",
        f"items of {ITEM_S * 1e3:.0f} ms of {kind}, batch {BATCH}, {args.steps} steps, one rank, "
        f"medians of {args.repeats} (alternating); {os.cpu_count()} cores, load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after",
        "",
        "| --num-workers | wall-clock samples/s | reported samples/s | reported / wall | data_s |",
        "|---|---|---|---|---|",
    ]
    for workers, row in table.items():
        lines.append(
            f"| {workers} | {row['wall']:.1f} | {row['reported']:.1f} | "
            f"{row['reported'] / row['wall']:.2f} | {row['data_s'] * 1e3:.0f} ms |"
        )
    lines += ["", f"speed-up of 2 workers over 0 (wall clock): {speedup:.2f}x"]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    record = {
        "machine": platform.platform(),
        "cores": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "runs": runs,
        "medians": table,
        "speedup": speedup,
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
