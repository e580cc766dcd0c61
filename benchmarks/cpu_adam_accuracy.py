"""The accuracy cost of CPUAdam's bf16 moments on a training run (issue 12).

Trains the trainer's character-level GPT (the demo's model and data, one process) from the same
seed on the same batches: with fp32 moments, with `bf16_moments=True` (fp32 arithmetic, moments
stored in bf16, rounded to nearest) and with bf16 moments rounded stochastically
(`moments_rounding="stochastic"`, one run per `--stochastic-seeds` value). Reports the loss
curves' largest gap, the final training loss of each, and a held-out loss (batches the run never
trained on), so the cost is read on the metric a user cares about, not on the parameters.
Writes results/cpu_adam_accuracy.{md,json}.

    python benchmarks/cpu_adam_accuracy.py [--steps 300] [--stochastic-seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from tessera.models import GPT, GPTConfig
from tessera.optim import CPUAdam
from tessera.train import build_config
from tessera.train.config_build import config_to_dict
from tessera.train.loop import corpus_batches, lr_at, next_token_loss

RESULTS = Path(__file__).parent / "results"

RUNS = {"fp32": {}, "bf16": {"bf16_moments": True}}  # row name -> CPUAdam options


def _stochastic_runs(seeds: list[int]) -> dict[str, dict]:
    """One row per rounding seed: how much of the result is the draw of the rounding bits."""
    options = {"bf16_moments": True, "moments_rounding": "stochastic"}
    return {f"bf16 stochastic, seed {seed}": {**options, "rounding_seed": seed} for seed in seeds}


def _train(options: dict, steps: int) -> dict:
    """One single-process run of the demo model; the losses per step and on held-out batches."""
    config = build_config({"nproc": 1, "strategy": "single", "steps": steps})
    tokenizer, batches = corpus_batches(config)
    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **config_to_dict(config)["model"]))
    optimizer = CPUAdam(
        model.parameters(),
        lr=config.lr,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
        **options,
    )
    losses = []
    for step in range(steps):
        x, y = batches.batch(step, 0, 1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        optimizer.zero_grad()
        loss = next_token_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():  # steps far beyond the run: batches it never saw
        held_out = [
            next_token_loss(model(x), y).item()
            for x, y in (batches.batch(10_000 + i, 0, 1) for i in range(8))
        ]
    return {"losses": losses, "held_out": statistics.fmean(held_out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stochastic-seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    all_runs = {**RUNS, **_stochastic_runs(args.stochastic_seeds)}
    runs = {name: _train(options, args.steps) for name, options in all_runs.items()}
    tail = max(1, args.steps // 10)  # the last 10% of steps, to average out batch noise
    fp32 = runs["fp32"]["losses"]
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps": args.steps,
        "rows": {
            name: {
                "final": statistics.fmean(run["losses"][-tail:]),
                "held_out": run["held_out"],
                "held_out_vs_fp32": run["held_out"] - runs["fp32"]["held_out"],
                "largest_gap_to_fp32": max(abs(a - b) for a, b in zip(fp32, run["losses"])),
            }
            for name, run in runs.items()
        },
        "losses": {name: run["losses"] for name, run in runs.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_adam_accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    table = (
        "### Accuracy cost of bf16 moments on a training run\n\n"
        f"{result['machine']}; the demo GPT and data, one process, {args.steps} steps, AdamW "
        "through `CPUAdam`, the same seed and batches for all; training loss = mean of the last "
        f"{tail} steps; held-out = 8 batches the runs never trained on; bf16 = rounded to "
        'nearest-even, bf16 stochastic = `moments_rounding="stochastic"` with the given '
        "`rounding_seed` (the model's seed and batches the same).\n\n"
        "| moments | training loss | held-out loss | held-out vs fp32 | largest per-step gap "
        "to fp32 |\n|---|---:|---:|---:|---:|\n"
        + "".join(
            f"| {name} | {row['final']:.4f} | {row['held_out']:.4f} | "
            f"{row['held_out_vs_fp32']:+.4f} | {row['largest_gap_to_fp32']:.4f} |\n"
            for name, row in result["rows"].items()
        )
    )
    (RESULTS / "cpu_adam_accuracy.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
