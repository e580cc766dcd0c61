"""tessera's host overhead per training step against the plain loop, measured on the CPU.

    python benchmarks/step_overhead.py            # world sizes 1 and 2 (gloo), ~2 minutes
    python benchmarks/step_overhead.py --quick    # fewer steps

On a GPU the device runs a step's kernels while the host queues the next ones; what the host
adds per step shows in the step time once the host is the bottleneck (GPT-2 small at batch 8 on
an H100: tessera `single`/`ddp` 0.94x and `zero2` 0.88x the plain loop, BENCHMARKS.md `## gpu`).
No GPU here, so this measures the two things that cost there, on a GPT so tiny that its compute
is negligible and the host's work is most of the step:

- **host time per step** (median over alternating blocks, A B A B ...): everything the host does,
  Python included;
- **aten operators per step** (a `TorchDispatchMode` over one steady-state step, after 2 warm-up
  steps; on the main thread and on the communication stream's worker thread): on a GPU each is
  at least one kernel launch, 5-10 us of host time;
- **host reads per step** (`aten._local_scalar_dense`: `.item()`, `float(t)`, `bool(t)`,
  `.tolist()`): on a GPU each one stalls the host until the device's queue drains.

The plain loop, written here: forward under autocast (bf16/fp16; none for fp32), `backward`,
fused AdamW `step` (fp16: `torch.amp.GradScaler`, as a plain fp16 loop does), `zero_grad`. tessera:
`engine.train_step((x, y))`, `engine.step()` through `tessera.setup` with setup's defaults (no
clipping: `grad_clip=0`, as the plain loop); the `clip` rows give both sides a clip at 1.0
(`clip_grad_norm_` in the plain loop, `grad_clip=1.0` in tessera, the trainer's default).
With 2 ranks the plain loop runs on each rank alone (no gradient averaging): the tessera rows
then include their communication, the plain loop has none. Writes
benchmarks/results/step_overhead.json and step_overhead.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tessera
from tessera.comm import stream as comm_stream
from tessera.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHAPE = dict(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=128)
BATCH = 2
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SYNC = torch.ops.aten._local_scalar_dense.default
Step = Callable[[], None]


class _Ops(TorchDispatchMode):
    """Counts the aten operators run under it (and host reads among them) into `counts`."""

    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(step: Step) -> dict[str, collections.Counter]:
    """The operators of one step on the calling thread (`main`) and on the communication
    stream's worker (`stream`: its tasks run under a counter of their own)."""
    main: collections.Counter = collections.Counter()
    worker: collections.Counter = collections.Counter()
    run_labeled = comm_stream._run_labeled

    def counted(future: Any, fn: Callable, args: tuple, label: int) -> None:
        def under_counter(*a: Any) -> Any:
            with _Ops(worker):
                return fn(*a)

        run_labeled(future, under_counter, args, label)

    comm_stream._run_labeled = counted
    try:
        with _Ops(main):
            step()
    finally:
        comm_stream._run_labeled = run_labeled
    return {"main": main, "stream": worker}


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _Bench:
    """The model, data and both loops of one rank."""

    def __init__(self) -> None:
        self.ctx = tessera.init()
        generator = torch.Generator().manual_seed(self.ctx.rank)
        x = torch.randint(SHAPE["vocab_size"], (BATCH, SHAPE["block_size"]), generator=generator)
        self.x, self.y = x, x.roll(-1, dims=1)

    @staticmethod
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(GPTConfig(**SHAPE))

    @staticmethod
    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4, fused=True)

    def plain(self, precision: str, clip: float) -> Step:
        """The plain PyTorch loop (fp16 with torch's GradScaler, unscaled before any clip)."""
        model = self.model()
        optimizer = self.adamw(model.parameters())
        dtype = DTYPES[precision]
        scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")

        def step() -> None:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = _loss(model(self.x), self.y)
            scaler.scale(loss).backward()
            if clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

        return step

    def tessera(self, strategy: str, precision: str, clip: float) -> Step:
        engine = tessera.setup(
            self.model(), self.adamw, strategy=strategy, loss_fn=_loss, precision=precision,
            grad_clip=clip,
        )  # fmt: skip

        def step() -> None:
            engine.train_step((self.x, self.y))
            engine.step()

        return step


def _timed(step: Step, steps: int) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) / steps


def _row(bench: _Bench, strategy: str, precision: str, clip: float, steps: int, blocks: int):
    ours, theirs = bench.tessera(strategy, precision, clip), bench.plain(precision, clip)
    for fn in (ours, theirs):
        _timed(fn, 2)  # warm-up: optimizer state, buckets, communication streams
    ops_ours, ops_theirs = _ops_per_step(ours), _ops_per_step(theirs)
    ours_s, theirs_s = [], []
    for _ in range(blocks):
        ours_s.append(_timed(ours, steps))
        theirs_s.append(_timed(theirs, steps))
    main = ops_ours["main"]
    extra = main - ops_theirs["main"]
    return {
        "strategy": strategy, "precision": precision, "clip": clip,
        "tessera_step_s": statistics.median(ours_s), "plain_step_s": statistics.median(theirs_s),
        "tessera_ops": sum(main.values()), "plain_ops": sum(ops_theirs["main"].values()),
        "stream_ops": sum(ops_ours["stream"].values()),
        "tessera_syncs": main[str(SYNC)] + ops_ours["stream"][str(SYNC)],
        "plain_syncs": ops_theirs["main"][str(SYNC)],
        "extra_ops": dict(sorted(extra.items())),
    }  # fmt: skip


def _rank(strategies: list[str], steps: int, blocks: int) -> list[dict[str, Any]]:
    bench = _Bench()
    rows = []
    for strategy in strategies:
        for precision in DTYPES:
            rows.append(_row(bench, strategy, precision, 0.0, steps, blocks))
    for strategy in strategies[:1] + ["zero2"]:
        rows.append(_row(bench, strategy, "bf16", 1.0, steps, blocks))
    world = bench.ctx.world_size
    return [{**row, "world": world} for row in rows]


def _markdown(rows: list[dict[str, Any]], note: str) -> str:
    lines = [
        "## step_overhead",
        "",
        "**Measured on the CPU** (no GPU): tessera's host work per training step against the "
        f"plain loop, GPT {SHAPE['n_layer']} x {SHAPE['n_embd']}, block {SHAPE['block_size']}, "
        f"batch {BATCH}: compute is negligible, so the step is host overhead, as the host's "
        "share of a GPU step. Written by `benchmarks/step_overhead.py`; ratio = plain time / "
        "tessera time (above 1: tessera faster); ops = aten operators per steady-state step on "
        "the calling thread (each a kernel launch on a GPU), + those on the communication "
        "stream's worker; syncs = host reads of a tensor value per step (each a device sync on "
        f"a GPU). fused AdamW on both sides; fp16: GradScaler in the plain loop. {note}",
        "",
        "| ranks | strategy | precision | clip | tessera step | plain step | ratio | ops "
        "tessera (+stream) / plain | syncs tessera / plain | extra ops |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        extra = ", ".join(f"{k.removeprefix('aten.')} {v}" for k, v in row["extra_ops"].items())
        lines.append(
            f"| {row['world']} | {row['strategy']} | {row['precision']} | {row['clip']:g} | "
            f"{row['tessera_step_s'] * 1e3:.2f} ms | {row['plain_step_s'] * 1e3:.2f} ms | "
            f"{row['plain_step_s'] / row['tessera_step_s']:.2f}x | {row['tessera_ops']} "
            f"(+{row['stream_ops']}) / {row['plain_ops']} | {row['tessera_syncs']} / "
            f"{row['plain_syncs']} | {extra} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure on 1 rank (single, ddp, zero1-3) and 2 gloo ranks (ddp, zero1-3)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--note", default="", help="said beside the table (the machine's load)")
    parser.add_argument("--out", default="step_overhead", help="results file name (no suffix)")
    args = parser.parse_args(argv)
    steps, blocks = (10, 3) if args.quick else (20, 5)
    env = {"TESSERA_BACKEND": "gloo"}
    rows = tessera.launch(_rank, 1, ["single", "ddp", "zero1", "zero2", "zero3"], steps, blocks,
                          env=env)[0]  # fmt: skip
    rows += tessera.launch(_rank, 2, ["ddp", "zero1", "zero2", "zero3"], steps, blocks, env=env)[0]
    note = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
    note += f"torch {torch.__version__}. {args.note}".rstrip()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=2))
    markdown = _markdown(rows, note)
    (RESULTS / f"{args.out}.md").write_text(markdown)
    print(markdown)
    return rows


if __name__ == "__main__":
    main()
