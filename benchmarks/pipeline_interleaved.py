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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline import BATCH, BLOCKS, WIDTH, _model, _one_process, _timed  # noqa: E402

import tessera  # noqa: E402
from tessera.pipeline import Pipeline, idle_fraction, measured_idle_fraction  # noqa: E402

HERE = Path(__file__).parent
RESULTS, DOCS = HERE / "results", HERE.parent / "docs"
V = 2
ENGINES = (("gpipe", 1), ("1f1b", 1), ("interleaved", V))


def _engine(schedule: str, v: int, m: int, p: int):
    pipe = Pipeline(
        _model(),
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


def _bench(p: int, microbatches: list[int], rounds: int, batch: int = BATCH) -> dict:
    tessera.init()
    torch.set_num_threads(1)  # a core per rank: the stages must not share one through threads
    torch.manual_seed(1)
    x, y = torch.randn(batch, WIDTH), torch.randn(batch, WIDTH)
    one = _one_process(x, y, rounds)
    rows, drawn = [], None
    for m in microbatches:
        engines = {f"{s} v={v}" if v > 1 else s: (_engine(s, v, m, p), s, v) for s, v in ENGINES}
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
    args = parser.parse_args(argv)
    load = os.getloadavg()
    results = []
    for p in args.stages:
        results.append(
            tessera.launch(
                _bench, p, p, args.microbatches, args.rounds, args.batch, deadline_s=1800
            )[0]
        )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, load average "
        f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    lines = [
        f"Machine: {machine}; batch {args.batch}; {args.rounds} rounds, medians.", "",
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
