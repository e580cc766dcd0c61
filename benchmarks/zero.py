"""tessera ZeRO 1/2/3 against FSDP2, torch's ZeroRedundancyOptimizer and tessera DDP.

One 2-rank run, one GPT, same batches. Six engines train copies of it with AdamW, in interleaved
blocks of steps (A B C ... A B C ...) so all see the same machine load; the table reports median
step times and three ratios (above 1: tessera faster):

* tessera ZeRO-3 vs FSDP2 (`torch.distributed.fsdp.fully_shard` per block, then the root);
* tessera ZeRO-1 vs `torch.distributed.optim.ZeroRedundancyOptimizer` with torch DDP;
* tessera ZeRO-2 vs tessera DataParallel.

It also measures tessera's model-state bytes per rank (from tensor storages) for each stage, in
fp32 and with bf16 mixed precision, against `tessera.zero.estimate_memory`.

    python benchmarks/zero.py [--quick]

Writes benchmarks/results/zero.json and benchmarks/results/zero.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.data_parallel import DataParallel
from tessera.models import GPT, GPTConfig
from tessera.zero import estimate_memory, initialize, measure_memory

RESULTS = Path(__file__).parent / "results"
SHAPE = dict(vocab_size=96, block_size=128, n_layer=4, n_embd=128, n_head=4)  # the demo GPT
BATCH, TOKENS = 16, 128  # the demo: global batch 32 on 2 ranks
BATCHES = {"demo batch": (BATCH, TOKENS), "small batch": (2, 64)}  # compute- vs comm-bound


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**SHAPE))


def _fsdp2() -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _torch_zero1() -> tuple[nn.Module, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    return ddp, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)


def _engines() -> dict[str, tuple[nn.Module, Any]]:
    engines: dict[str, tuple[nn.Module, Any]] = {}
    for stage in (3, 1, 2):
        engines[f"tessera zero{stage}"] = initialize(
            _model(), torch.optim.AdamW, stage=stage, lr=1e-4
        )
    try:
        engines["fsdp2"] = _fsdp2()
    except Exception as exc:  # reported in the table instead of a ratio
        engines["fsdp2"] = (None, repr(exc))
    engines["torch ZeroRedundancyOptimizer"] = _torch_zero1()
    model = _model()
    engines["tessera ddp"] = (DataParallel(model), torch.optim.AdamW(model.parameters(), lr=1e-4))
    return engines


def _step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    began = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    return time.perf_counter() - began


def _memory(mixed_precision: str | None) -> dict[int, dict[str, dict[str, int]]]:
    ctx = tessera.init()
    x = torch.randint(0, SHAPE["vocab_size"], (BATCH, TOKENS))
    rows = {}
    for stage in (0, 1, 2, 3):
        if stage == 0 and mixed_precision:
            continue
        model = _model()
        num_params = sum(p.numel() for p in model.parameters())
        model, opt = initialize(
            model, torch.optim.AdamW, stage=stage, lr=1e-4, mixed_precision=mixed_precision
        )
        _step(model, opt, x, x)
        opt.zero_grad()
        sizes = (2, 2, 12) if mixed_precision else (4, 4, 8)
        estimate = estimate_memory(
            num_params,
            ctx.world_size,
            stage,
            param_bytes=sizes[0],
            grad_bytes=sizes[1],
            optimizer_bytes=sizes[2],
        )
        rows[stage] = {"measured": measure_memory(model, opt), "estimate": estimate}
        if stage:
            opt.remove_hooks()
    return rows


def _timings(steps: int, rounds: int, batch: int, tokens: int) -> dict:
    ctx = tessera.init()
    engines = _engines()
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(0, SHAPE["vocab_size"], (batch, tokens), generator=g)
    y = torch.randint(0, SHAPE["vocab_size"], (batch, tokens), generator=g)
    live = {name: pair for name, pair in engines.items() if pair[0] is not None}
    times: dict[str, list[float]] = {name: [] for name in live}
    for model, opt in live.values():
        _step(model, opt, x, y)  # warm-up
    for _ in range(rounds):
        for name, (model, opt) in live.items():
            for _ in range(steps):
                times[name].append(_step(model, opt, x, y))
    step_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    errors = {name: pair[1] for name, pair in engines.items() if pair[0] is None}

    def ratio(ours: str, theirs: str) -> float | None:
        if theirs not in step_ms:
            return None
        return step_ms[theirs] / step_ms[ours]

    for _wrapped, opt in engines.values():
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
    return {
        "batch": f"{batch}x{tokens}",
        "step_ms": step_ms,
        "errors": errors,
        "ratios": {
            "zero3 / fsdp2": ratio("tessera zero3", "fsdp2"),
            "zero1 / torch ZeroRedundancyOptimizer": ratio(
                "tessera zero1", "torch ZeroRedundancyOptimizer"
            ),
            "zero2 / tessera ddp": ratio("tessera zero2", "tessera ddp"),
        },
    }


def _compare(steps: int, rounds: int) -> dict:
    rows = {name: _timings(steps, rounds, *shape) for name, shape in BATCHES.items()}
    return {
        "rows": rows,
        "memory_fp32": _memory(None),
        "memory_bf16": _memory("bf16"),
        "params": sum(p.numel() for p in _model().parameters()),
    }


def _markdown(result: dict, steps: int, rounds: int) -> str:
    mb = 2**20
    lines = [
        "## zero: tessera ZeRO 1/2/3 vs FSDP2, torch ZeroRedundancyOptimizer, tessera DDP",
        "",
        f"{result['machine']}; 2 ranks (gloo); demo GPT ({result['params'] / 1e6:.2f}M params, "
        f"n_layer 4, n_embd 128, block 128, vocab 96), AdamW; per rank the demo batch "
        f"({BATCH}x{TOKENS} tokens, compute-bound) and a small one (2x64, communication-bound); "
        f"medians of {steps * rounds} steps per engine, engines alternating in blocks of {steps} "
        "steps. Ratio = their step time / tessera's (above 1: tessera faster).",
        "",
    ]
    names = list(next(iter(result["rows"].values()))["step_ms"])
    lines += ["| engine | " + " | ".join(f"{b} ms" for b in result["rows"]) + " |"]
    lines += ["|---|" + "---|" * len(result["rows"])]
    for name in names:
        cells = [f"{row['step_ms'][name]:.1f}" for row in result["rows"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for row in result["rows"].values():
        lines += [f"| {name} | failed: {err} |" for name, err in row["errors"].items()]
    targets = {"zero3 / fsdp2": "1.5", "zero1 / torch ZeroRedundancyOptimizer": "1.0"}  # issue 11
    lines += ["", "| comparison | " + " | ".join(result["rows"]) + " | target |"]
    lines += ["|---|" + "---|" * (len(result["rows"]) + 1)]
    for name, target in {**targets, "zero2 / tessera ddp": "-"}.items():
        cells = []
        for row in result["rows"].values():
            value = row["ratios"][name]
            cells.append(f"**{value:.2f}**" if value is not None else "n/a")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {target} |")
    lines += [
        "",
        "Model-state MiB per rank, measured from tensor storages / `estimate_memory` "
        "(fp32: 4 + 4 + 8 bytes per parameter for AdamW; bf16: 2 + 2 + 12):",
        "",
        "| precision | stage | params | gradients | optimizer | total | total / estimate |",
        "|---|---|---|---|---|---|---|",
    ]
    for precision in ("fp32", "bf16"):
        for stage, row in result[f"memory_{precision}"].items():
            m, e = row["measured"], row["estimate"]
            cells = [f"{m[k] / mb:.3f} / {e[k] / mb:.3f}" for k in ("params", "gradients")]
            cells += [f"{m[k] / mb:.3f} / {e[k] / mb:.3f}" for k in ("optimizer", "total")]
            lines.append(
                f"| {precision} | {stage} | {' | '.join(cells)} | {m['total'] / e['total']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison on 2 ranks; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args(argv)
    steps, rounds = (2, 2) if args.quick else (3, 8)
    result = tessera.launch(_compare, 2, steps, rounds, deadline_s=1200)[0]
    result["machine"] = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.0f} at the end (other jobs share the cores)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "zero.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = _markdown(result, steps, rounds)
    (RESULTS / "zero.md").write_text(markdown)
    print(markdown)
    return result


if __name__ == "__main__":
    main()
