"""Throughput of the main job (`tessera train` defaults) under each strategy, side by side.

Runs the strategies alternately (A B A B ...), `--repeats` times each, every run `--steps` steps of
the demo model, and takes the median tokens/s over the steps after `--skip` warm-up steps, then
the median over repeats. Prints a table and writes benchmarks/results/train.json.

    python benchmarks/train.py [--steps 40] [--repeats 3]

Mixed precision: `--precisions fp32,bf16,fp16` runs each strategy in each (`--mixed-precision`)
and adds, per low-precision row, its tokens/s against the same strategy's fp32 run and the
difference of its final loss from fp32's (medians over repeats); `--strategies` picks the
strategies. Those runs write benchmarks/results/train_precision.json / .md instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tessera.train.metrics import read_metrics

RESULTS = Path(__file__).parent / "results"
STRATEGIES = {"single": 1, "torch-ddp": 2, "ddp": 2}  # strategy -> ranks
RANKS = {"single": 1}
"""Ranks of a strategy given with --strategies (2 unless listed)."""


def run_once(
    strategy: str,
    nproc: int,
    steps: int,
    skip: int,
    workdir: Path,
    tag: str,
    precision: str = "fp32",
    extra: tuple[str, ...] = (),
) -> dict:
    out = workdir / f"{strategy}-{precision}-{tag}"
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
    if precision != "fp32":
        command += ["--mixed-precision", precision]
    command += list(extra)
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = read_metrics(out / "metrics.jsonl")  # step records; event lines left out
    measured = records[skip:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
        "step_s": statistics.median(r["step_s"] for r in measured),
        "comm_s": statistics.median(r["comm_s"] for r in measured),
        "mfu": statistics.median(r["mfu"] for r in measured),
        "final_loss": records[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", default="", help="e.g. fp32,bf16,fp16 (see above)")
    parser.add_argument("--strategies", default="", help="comma-separated (with --precisions)")
    parser.add_argument(
        "--train-args",
        default="",
        help="with --precisions: more `tessera train` flags, e.g. '--n-layer 2 --n-embd 64'",
    )
    args = parser.parse_args(argv)
    if args.precisions:
        return precision_rows(args)
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


def precision_rows(args: argparse.Namespace) -> dict:
    """bf16 and fp16 against fp32, per strategy: tokens/s ratio and final-loss difference."""
    precisions = args.precisions.split(",")
    if precisions[0] != "fp32":
        raise SystemExit("--precisions must start with fp32 (the baseline of the ratios)")
    strategies = args.strategies.split(",") if args.strategies else list(STRATEGIES)
    runs: dict[tuple[str, str], list[dict]] = {
        (name, precision): [] for name in strategies for precision in precisions
    }
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # alternating: A B C A B C ...
            for name, precision in runs:
                nproc = RANKS.get(name, 2)
                runs[name, precision].append(
                    run_once(
                        name,
                        nproc,
                        args.steps,
                        args.skip,
                        Path(tmp),
                        str(repeat),
                        precision,
                        tuple(shlex.split(args.train_args)),
                    )  # fmt: skip
                )
    table = {}
    for (name, precision), results in runs.items():
        row = {key: statistics.median(r[key] for r in results) for key in results[0]}
        fp32 = runs[name, "fp32"]
        row["x_fp32"] = statistics.median(
            r["tokens_per_s"] / base["tokens_per_s"] for r, base in zip(results, fp32)
        )
        row["loss_minus_fp32"] = statistics.median(
            r["final_loss"] - base["final_loss"] for r, base in zip(results, fp32)
        )
        table[f"{name} {precision}"] = row
    result = {
        "benchmark": "train_precision",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps": args.steps,
        "skip": args.skip,
        "repeats": args.repeats,
        "train_args": args.train_args,
        "rows": table,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_precision.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "train_precision.md").write_text(precision_markdown(result))
    print(precision_markdown(result))
    return result


def precision_markdown(result: dict) -> str:
    """The BENCHMARKS.md section of a `train_precision.json` result."""
    lines = [
        "## train_precision: bf16 and fp16 (`--mixed-precision`) against fp32 per strategy",
        "",
        f"{result['machine']}, shared with other jobs while it ran (noisy); `tessera train "
        f"{result['train_args']}`; {result['steps']} steps per run, first {result['skip']} left "
        f"out of tokens/s, {result['repeats']} runs per row alternating; medians (x fp32: median "
        "of the per-repeat ratios; loss - fp32: final-step loss difference, median over repeats).",
        "",
        "| strategy | precision | tokens/s | x fp32 | final loss | loss - fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in result["rows"].items():
        name, precision = key.split(" ")
        lines.append(
            f"| {name} | {precision} | {row['tokens_per_s']:,.0f} | {row['x_fp32']:.2f} | "
            f"{row['final_loss']:.4f} | {row['loss_minus_fp32']:+.4f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
