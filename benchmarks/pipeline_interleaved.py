"""Interleaved 1F1B (v = 2 chunks per rank) against 1F1B and GPipe, beside the closed forms.

The model and the timing are `benchmarks/pipeline.py`'s (8 blocks of Linear(512, 1024) - GELU -
Linear(1024, 512), batch 64, MSE, SGD; a step from a barrier to its end on the slowest rank),
cut into p = 2 and 4 stages (interleaved: 2p chunks of equal blocks, rank s holding chunks s and
s + p), m = 4 and 8 micro-batches. The three engines alternate step by step in each round (they
see the same load); medians over rounds. Reported beside each: the closed-form idle share
(`schedule.idle_fraction`: GPipe and 1F1B (p-1)/(m+p-1), interleaved bubble (p-1)/(v m) as an idle
share), the measured idle share (mean over stages of the step's timeline), and the ideal step
`(one process / p) / (1 - closed-form idle)`. The timeline of one interleaved step (p = 4, m = 8)
is drawn with its chunks to docs/pipeline_interleaved.png.

On a machine with fewer cores than ranks the stages share cores: a waiting stage lends its core
to the busy ones (`plan.formulas.bubble_fraction_on_shared_cores`), so a smaller bubble buys
less time than on devices of their own, and v times more messages cost more. Say the load.

    python benchmarks/pipeline_interleaved.py [--rounds 7]

Writes benchmarks/results/pipeline_interleaved.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline import BATCH, BLOCKS, WIDTH, _model, _one_process, _timed  # noqa: E402

import tessera  # noqa: E402
from tessera.pipeline import Pipeline, idle_fraction, measured_idle_fraction  # noqa: E402

HERE = Path(__file__).parent
RESULTS, DOCS = HERE / "results", HERE.parent / "docs"
V = 2
ENGINES = (("gpipe", 1), ("1f1b", 1), ("interleaved", V))


class _DeviceTime(torch.autograd.Function):
    """Identity whose forward sleeps `ms_per_row` per row and whose backward twice that: the
    time a device of its own would take, during which this process holds no core (a GPU kernel
    the host waits for). With it the stages of a 2-core machine behave as devices do: a stage
    that waits costs the others nothing, so the schedule's bubble shows as time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ms_per_row: float) -> torch.Tensor:
        ctx.ms = ms_per_row * x.shape[0]
        time.sleep(ctx.ms / 1e3)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.ms / 1e3)
        return grad, None


class _Device(nn.Module):
    def __init__(self, ms_per_row: float) -> None:
        super().__init__()
        self.ms_per_row = ms_per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeviceTime.apply(x, self.ms_per_row)


def _model_with(ms_per_row: float) -> nn.Sequential:
    """`benchmarks/pipeline.py`'s model; with `ms_per_row` > 0 each block also takes that long
    per row on an emulated device of its own (`_DeviceTime`)."""
    model = _model()
    if ms_per_row > 0:
        for block in model:
            block.append(_Device(ms_per_row))
    return model


def _engine(schedule: str, v: int, m: int, p: int, ms_per_row: float = 0.0):
    pipe = Pipeline(
        _model_with(ms_per_row),
        num_microbatches=m,
        schedule=schedule,
        virtual_stages=v,
        balance=[BLOCKS // (p * v)] * (p * v),
    )
    optimizer = torch.optim.SGD(pipe.module.parameters(), lr=1e-3)

    def step(x, y):
        pipe.train_step(x, y, F.mse_loss)
        optimizer.step()
        optimizer.zero_grad()

    return step, list(pipe.module.parameters()), pipe


def _bench(
    p: int, microbatches: list[int], rounds: int, batch: int = BATCH, ms_per_row: float = 0.0
) -> dict:
    tessera.init()
    torch.set_num_threads(1)  # a core per rank: the stages must not share one through threads
    torch.manual_seed(1)
    x, y = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    one = _one_process(x, y, rounds, model_fn=lambda: _model_with(ms_per_row))
    rows, drawn = [], None
    for m in microbatches:
        engines = {
            f"{s} v={v}" if v > 1 else s: (_engine(s, v, m, p, ms_per_row), s, v)
            for s, v in ENGINES
        }
        times = {name: [] for name in engines}
        idle = {name: [] for name in engines}
        for (step, params, _), _, _ in engines.values():
            _timed(step, params, x, y)  # warm-up
        for _ in range(rounds):
            for name, ((step, params, pipe), _, _) in engines.items():
                took, _ = _timed(step, params, x, y)
                times[name].append(took)
                events = pipe.gather_timeline()
                idle[name].append(statistics.fmean(measured_idle_fraction(events)))
                if name.startswith("interleaved") and p == 4 and m == 8:
                    drawn = events
        for name, (_, schedule, v) in engines.items():
            closed = idle_fraction(schedule, p, m, v)
            rows.append(
                {
                    "stages": p,
                    "m": m,
                    "engine": name,
                    "step_ms": statistics.median(times[name]) * 1e3,
                    "measured_idle": statistics.median(idle[name]),
                    "closed_form_idle": closed,
                    "ideal_ms": one / p / (1 - closed) * 1e3,
                }
            )
    return {
        "one_process_ms": one * 1e3,
        "rows": rows,
        "drawn": drawn if dist.get_rank() == 0 else None,
    }


def _table(results: list[dict]) -> list[str]:
    lines = [
        "| stages | m | engine | step ms | vs 1f1b | measured idle | closed-form idle | ideal ms "
        "| step / ideal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        by = {(r["engine"], r["m"]): r for r in result["rows"]}
        for r in result["rows"]:
            base = by[("1f1b", r["m"])]["step_ms"]
            lines.append(
                f"| {r['stages']} | {r['m']} | {r['engine']} | {r['step_ms']:.1f} | "
                f"{base / r['step_ms']:.2f} | {r['measured_idle']:.3f} | "
                f"{r['closed_form_idle']:.3f} | {r['ideal_ms']:.1f} | "
                f"{r['step_ms'] / r['ideal_ms']:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run p = 2 and 4, m = 4 and 8; print and write the table, draw one interleaved step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--batch", type=int, default=BATCH,
        help="rows a step: more rows, more compute per micro-batch against its fixed costs",
    )  # fmt: skip
    parser.add_argument(
        "--device-ms-per-row", type=float, default=0.0,
        help="emulate devices of their own: each block also sleeps this long per row in forward "
        "(twice in backward), holding no core",
    )  # fmt: skip
    args = parser.parse_args(argv)
    load = os.getloadavg()
    results = []
    for p in args.stages:
        results.append(
            tessera.launch(
                _bench, p, p, args.microbatches, args.rounds, args.batch,
                args.device_ms_per_row, deadline_s=1800,
            )[0]
        )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, load average "
        f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    lines = [
        f"Machine: {machine}; batch {args.batch}; {args.rounds} rounds, medians"
        + (f"; emulated devices, {args.device_ms_per_row:g} ms a row and block forward (x2 "
           "backward)" if args.device_ms_per_row else "") + ".", "",
        *_table(results),
    ]  # fmt: skip
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    saved = [{k: v for k, v in r.items() if k != "drawn"} for r in results]
    (RESULTS / "pipeline_interleaved.json").write_text(
        json.dumps({"machine": machine, "results": saved}, indent=1)
    )
    (RESULTS / "pipeline_interleaved.md").write_text("\n".join(lines) + "\n")
    drawn = results[-1].get("drawn")
    if drawn:
        from tessera.viz import pipeline_timeline

        title = "interleaved 1F1B, p=4, v=2, m=8: labels micro-batch.chunk, chunk 1 lighter"
        print(f"wrote {pipeline_timeline(drawn, DOCS / 'pipeline_interleaved.png', title=title)}")


if __name__ == "__main__":
    main()
