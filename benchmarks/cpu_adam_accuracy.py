"""The accuracy cost of CPUAdam's bf16 moments on a training run (issue 12).

Trains the trainer's character-level GPT (the demo's model and data, one process) twice from the
same seed on the same batches: once with fp32 moments, once with `bf16_moments=True` (fp32
arithmetic, moments stored in bf16). Reports the loss curves' largest gap, the final training
loss of each, and a held-out loss (batches the run never trained on), so the cost is read on the
metric a user cares about, not on the parameters. Writes results/cpu_adam_accuracy.{md,json}.

    python benchmarks/cpu_adam_accuracy.py [--steps 300]
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
from tessera.train.config import config_to_dict
from tessera.train.loop import corpus_batches, lr_at, next_token_loss

RESULTS = Path(__file__).parent / "results"


def _train(bf16_moments: bool, steps: int) -> dict:
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
        bf16_moments=bf16_moments,
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
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    fp32, bf16 = _train(False, args.steps), _train(True, args.steps)
    tail = max(1, args.steps // 10)  # the last 10% of steps, to average out batch noise
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps": args.steps,
        "fp32_final": statistics.fmean(fp32["losses"][-tail:]),
        "bf16_final": statistics.fmean(bf16["losses"][-tail:]),
        "fp32_held_out": fp32["held_out"],
        "bf16_held_out": bf16["held_out"],
        "largest_gap": max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])),
        "losses": {"fp32": fp32["losses"], "bf16": bf16["losses"]},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_adam_accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    table = (
        "### Accuracy cost of bf16 moments on a training run\n\n"
        f"{result['machine']}; the demo GPT and data, one process, {args.steps} steps, AdamW "
        "through `CPUAdam`, the same seed and batches for both; training loss = mean of the last "
        f"{tail} steps; held-out = 8 batches the runs never trained on.\n\n"
        "| moments | training loss | held-out loss |\n|---|---:|---:|\n"
        f"| fp32 | {result['fp32_final']:.4f} | {result['fp32_held_out']:.4f} |\n"
        f"| bf16 | {result['bf16_final']:.4f} | {result['bf16_held_out']:.4f} |\n\n"
        f"Held-out loss difference (bf16 - fp32): "
        f"{result['bf16_held_out'] - result['fp32_held_out']:+.4f}; largest per-step gap of "
        f"the two training curves: {result['largest_gap']:.4f}.\n"
    )
    (RESULTS / "cpu_adam_accuracy.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
