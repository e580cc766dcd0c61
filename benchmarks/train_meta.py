"""The largest GPT that ZeRO-3 trains under a per-rank memory budget: built on the meta device
(each rank materialises only its shard) against built whole on every rank first.

Each trial launches `--ranks` fresh processes; each builds the 12-block GPT in fp32 (on the meta
device, or whole), shards it with ZeRO-3 (fp32 AdamW, no offload: every byte counted is host
memory), trains 2 steps of one 64-token sequence per rank, and reports its peak RSS (VmHWM:
torch import, set-up and steps included) after set-up and at the end. A trial fits when every
rank's peak stays within `--budget-mb`. Widths are tried in increasing order per mode until one
exceeds the budget. Prints a table, writes benchmarks/results/train_meta_{N}ranks[_MODE].json
and rebuilds benchmarks/results/train_meta.md from every such file (one table per run).

    python benchmarks/train_meta.py [--budget-mb 1024] [--ranks 2] [--widths 384 512 640 768]
                                    [--modes whole meta]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # large frees go back to the system
LAYERS, HEADS, CONTEXT, VOCAB, STEPS = 12, 8, 64, 96, 2
MODES = ("whole", "meta")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def trial(width: int, meta: bool) -> dict:
    """One rank: build (meta or whole), ZeRO-3, 2 AdamW steps; its peak RSS."""
    import tessera
    from tessera.models import GPT, GPTConfig
    from tessera.zero import initialize

    tessera.init()
    torch.set_num_threads(1)
    baseline = _status_mb("VmRSS")
    config = GPTConfig(
        vocab_size=VOCAB, block_size=CONTEXT, n_layer=LAYERS, n_head=HEADS, n_embd=width
    )
    torch.manual_seed(0)
    began = time.perf_counter()
    if meta:
        with torch.device("meta"):
            model = GPT(config)
    else:
        model = GPT(config)
    params = model.num_parameters()
    init_fn = model.init_module if meta else None
    model, optimizer = initialize(model, torch.optim.AdamW, stage=3, lr=1e-3, init_fn=init_fn)
    setup_s, setup_peak = time.perf_counter() - began, _status_mb("VmHWM")
    generator = torch.Generator().manual_seed(tessera.init().rank)
    for _ in range(STEPS):
        idx = torch.randint(0, VOCAB, (1, CONTEXT + 1), generator=generator)
        optimizer.zero_grad()
        logits = model(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        optimizer.step()
    optimizer.remove_hooks()
    return {
        "width": width,
        "params": params,
        "baseline_rss_mb": baseline,
        "setup_peak_rss_mb": setup_peak,
        "peak_rss_mb": _status_mb("VmHWM"),
        "setup_s": setup_s,
    }


def largest(budget_mb: float, ranks: int, widths: list[int], modes: list[str]) -> dict:
    """Per mode: every width tried (ascending, until one is over budget) and the largest fit."""
    import tessera

    out = {}
    for mode in modes:
        tried = []
        for width in widths:
            per_rank = tessera.launch(trial, ranks, width, mode == "meta", deadline_s=1800)
            row = {
                **per_rank[0],
                "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
                "setup_peak_rss_mb": max(r["setup_peak_rss_mb"] for r in per_rank),
            }
            row["fits"] = row["peak_rss_mb"] <= budget_mb
            tried.append(row)
            print(
                f"  {mode:5s} C={width:5d} {row['params'] / 1e6:6.1f} M params: peak RSS per "
                f"rank {row['peak_rss_mb']:6.0f} MB (set-up {row['setup_peak_rss_mb']:6.0f})"
                f"{'' if row['fits'] else '  over budget'}",
                flush=True,
            )
            if not row["fits"]:
                break
        fits = [row for row in tried if row["fits"]]
        out[mode] = {"tried": tried, "largest": fits[-1] if fits else None}
    return out


def markdown(result: dict) -> str:
    budget, ranks = result["budget_mb"], result["ranks"]
    lines = [
        f"### Largest 12-block GPT that ZeRO-3 trains on {ranks} ranks within {budget:.0f} MB "
        "of peak RSS per rank: built on the meta device against built whole",
        "",
        f"{result['machine']}. fp32 weights and AdamW state, no offload, {STEPS} steps of one "
        f"{CONTEXT}-token sequence per rank; peak RSS (VmHWM) of each rank's whole process "
        "(torch import, set-up, steps), the largest over ranks.",
        "",
        "| built | width | parameters | fp32 weights + Adam state of the model | peak RSS set-up | "
        "peak RSS | within budget |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for mode in result["modes"]:
        for row in result["modes"][mode]["tried"]:
            state = row["params"] * 12 / 2**20
            lines.append(
                f"| {mode} | {row['width']} | {row['params'] / 1e6:.1f} M | {state:,.0f} MB | "
                f"{row['setup_peak_rss_mb']:,.0f} MB | {row['peak_rss_mb']:,.0f} MB | "
                f"{'yes' if row['fits'] else 'no'} |"
            )
    best = {mode: found["largest"] for mode, found in result["modes"].items()}
    said = [
        f"{mode} {row['params'] / 1e6:.1f} M parameters" if row else f"{mode} none tried"
        for mode, row in best.items()
    ]
    lines += ["", f"Largest within budget: {', '.join(said)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=1024.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--widths", type=int, nargs="+", default=[384, 512, 640, 768, 896])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args(argv)
    os.environ.update(MALLOC_ENV)
    result = {
        "benchmark": "train_meta",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other jobs), "
        f"torch {torch.__version__}",
        "budget_mb": args.budget_mb,
        "ranks": args.ranks,
        "modes": largest(args.budget_mb, args.ranks, sorted(args.widths), args.modes),
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"train_meta_{args.ranks}ranks" + (
        "" if args.modes == list(MODES) else "_" + args.modes[0]
    )
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    runs = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("train_meta_*.json"))]
    heading = "## train_meta: the largest model per rank budget, ZeRO-3 on the meta device or whole"
    (RESULTS / "train_meta.md").write_text(heading + "\n\n" + "\n".join(map(markdown, runs)))
    return result


if __name__ == "__main__":
    main()
