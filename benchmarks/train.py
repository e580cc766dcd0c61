"""Throughput of the main job (`tessera train` defaults) under each strategy, side by side.

Runs the strategies alternately (A B A B ...), `--repeats` times each, every run `--steps` steps of
the demo model, and takes the median tokens/s over the steps after `--skip` warm-up steps, then
the median over repeats. Prints a table and writes benchmarks/results/train.json.

    python benchmarks/train.py [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tessera.train.metrics import read_metrics

RESULTS = Path(__file__).parent / "results"
STRATEGIES = {"single": 1, "torch-ddp": 2, "ddp": 2}  # strategy -> ranks


def run_once(strategy: str, nproc: int, steps: int, skip: int, workdir: Path, tag: str) -> dict:
    out = workdir / f"{strategy}-{tag}"
    command = [
        sys.executable,
        "-m",
        "tessera",
        "train",
        "--strategy",
        strategy,
        "--nproc",
        str(nproc),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--no-progress",
        "--sample-tokens",
        "0",
        "--checkpoint-every",
        "0",
    ]
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = read_metrics(out / "metrics.jsonl")  # step records; event lines left out
    measured = records[skip:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
        "step_s": statistics.median(r["step_s"] for r in measured),
        "comm_s": statistics.median(r["comm_s"] for r in measured),
        "mfu": statistics.median(r["mfu"] for r in measured),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {name: [] for name in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, nproc in STRATEGIES.items():
                runs[name].append(
                    run_once(name, nproc, args.steps, args.skip, Path(tmp), str(repeat))
                )
    table = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    base = table["single"]["tokens_per_s"]
    for row in table.values():
        row["ratio_to_single"] = row["tokens_per_s"] / base
    result = {
        "benchmark": "train",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps": args.steps,
        "skip": args.skip,
        "repeats": args.repeats,
        "strategies": table,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    header = ("strategy", "ranks", "tokens/s", "step ms", "comm ms", "MFU", "x single")
    print(f"{header[0]:<12}" + "".join(f"{h:>10}" for h in header[1:]))
    for name, row in table.items():
        print(
            f"{name:<12}{STRATEGIES[name]:>10}{row['tokens_per_s']:>10,.0f}"
            f"{row['step_s'] * 1e3:>10.1f}{row['comm_s'] * 1e3:>10.1f}"
            f"{row['mfu']:>10.1%}{row['ratio_to_single']:>10.2f}"
        )
    lines = [
        "## train: the main job (`tessera train` defaults) per strategy",
        "",
        f"{result['machine']}; {args.steps} steps per run, first {args.skip} left out, "
        f"{args.repeats} runs per strategy alternating; medians. MFU: tokens/s x the model's "
        "FLOPs per token (Narayanan et al. 2021 eq. 3, no recomputation) over the ranks' float32 "
        "matmul rate measured by the run (`tessera.train.mfu`).",
        "",
        "| strategy | ranks | tokens/s | step ms | exposed comm ms | MFU | x single |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        lines.append(
            f"| {name} | {STRATEGIES[name]} | {row['tokens_per_s']:,.0f} | "
            f"{row['step_s'] * 1e3:.1f} | {row['comm_s'] * 1e3:.1f} | {row['mfu']:.1%} | "
            f"{row['ratio_to_single']:.2f} |"
        )
    (RESULTS / "train.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
