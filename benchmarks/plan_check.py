"""Does `tessera plan` rank this machine's strategies as they run? (issue 32, item 4)

    python benchmarks/plan_check.py           # or: make plan-check   (2 and 4 ranks)
    python benchmarks/plan_check.py --quick   # 2 ranks, fewer rows and steps: does it run?

For 2 and 4 ranks:
1. the machine is measured as `tessera plan --cluster this-machine` measures it
   (`this_machine(ranks=n, recalibrate=True)`: one rank's matmul rate, `comm.calibrate`),
   into the cache the plan then reads;
2. the planner's rows for the demo GPT: `tessera plan --cluster this-machine --devices n` with
   the demo's shape and corpus vocabulary, `--batch 32 --microbatch 8` (the micro-batch of
   `tessera compare`'s pipelines) and `--precision fp32` (compare's runs are fp32 AdamW), as the
   table prints them (`plan.cli.plan_rows`), every row a strategy with its `tessera train` line;
3. the rows to run: the planner's top `--top` and the best-ranked row of every family (mesh,
   schedule, recomputation, offloaded or not), so that a kind of strategy the planner puts low
   is timed too; the rows left out differ from their family's runner only by ZeRO stage or
   offload target, which the planner prices as slower. `--all-rows` runs every row;
4. `tessera compare`'s function over exactly those rows (`compare_runs(runs=[plan_run(...)])`:
   each row's command config, the list round-robin `--repeats` times, each run's step time the
   median of its steps after the first `skip` (the trainer's step_s, the slowest rank's), the
   median over repeats), with compare's own prediction beside (compute at the rate a rank
   achieves on its share, measured once per micro-batch: `probe_each_run=False`);
5. the check: the planner's top row is among the two fastest measured. A run's step time moves
   by 10-30% between repeats on this machine while the data-parallel rows at the top of the
   plan differ by 1-3%: which of them has the lowest median is then a draw, not a measurement.
   So a row counts as faster than the top row only where its repeats are faster by a one-sided
   exact Mann-Whitney test at the 5% level (`faster_p`, on the repeats' medians, the units
   that are repeated), and the top row's measured rank is 1 + the rows faster than it. The
   rank by median alone is printed beside it. A top row that a family of rows outruns in
   every repeat (the hybrid rows, +19%, in an earlier run) still fails. With 3 repeats or
   fewer no row can be shown faster (the smallest p is 1 / C(2r, r)): the check then fails
   as undecided.

Writes benchmarks/results/plan_check.json and .md and BENCHMARKS.md's `## plan_check` section
(`--quick`: benchmarks/results/plan_check-quick.json only; timings of a loaded machine say
nothing). The runs go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tessera.optim.cpu_adam import native_kernel_available
from tessera.plan.cli import add_plan_arguments, plan_rows
from tessera.plan.cluster import this_machine
from tessera.plan.model import from_module
from tessera.plan.search import Estimate, Strategy
from tessera.train.compare import compare_runs, plan_run
from tessera.train.config_build import build_config
from tessera.train.metrics import read_metrics
from tessera.train.significance import faster_p
from tessera.train.workload import build_workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BATCH, MICROBATCH = 32, 8


def _demo_plan_argv(nproc: int) -> list[str]:
    """`tessera plan`'s flags for the demo GPT (its shape and its corpus's vocabulary)."""
    config = build_config({"nproc": nproc, "batch_size": BATCH})
    model = from_module(build_workload(config).model_fn())
    shape = ["--layers", model.layers, "--hidden", model.hidden, "--heads", model.heads,
             "--seq", model.seq, "--vocab", model.vocab]  # fmt: skip
    argv = ["--cluster", "this-machine", "--devices", nproc, *shape, "--batch", BATCH]
    return [str(a) for a in [*argv, "--microbatch", MICROBATCH, "--precision", "fp32"]]


def _family(s: Strategy) -> tuple[Any, ...]:
    """Rows of one family differ only by ZeRO stage and offload target."""
    return (s.dp, s.tp, s.pp, s.schedule if s.pp > 1 else None, s.chunks, s.recompute,
            s.offload is not None)  # fmt: skip


def choose_rows(estimates: list[Estimate], top: int, every: bool) -> list[int]:
    """Indices (plan order) of the rows to run: the top `top`, each family's best, or all."""
    if every:
        return list(range(len(estimates)))
    chosen, seen = [], set()
    for k, e in enumerate(estimates):
        family = _family(e.strategy)
        if k < top or family not in seen:
            chosen.append(k)
        seen.add(family)
    return chosen


def _repeat_medians(out: Path, label: str, repeats: int, skip: int) -> dict[str, list[float]]:
    """Each repeat's median step time of one run (compare keeps only their median), and of the
    trainer's split of it: compute (forward, backward, optimizer) and exposed communication."""
    folder = out / label.replace(" ", "-").replace("=", "")
    found: dict[str, list[float]] = {"step_s": [], "compute_s": [], "comm_s": []}
    for repeat in range(repeats):
        path = folder / f"repeat-{repeat + 1}" if repeats > 1 else folder
        records = read_metrics(path / "metrics.jsonl")
        kept = records[skip:] or records
        for key, values in found.items():
            values.append(statistics.median(r.get(key, float("nan")) for r in kept))
    return found


SIGNIFICANCE = 0.05
"""The test's level: a row is faster than the top row when p < 5%, the usual convention."""


def check(nproc: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One rank count: calibrate, plan, run the chosen rows, rank both ways."""
    began = time.perf_counter()
    this_machine(ranks=nproc, recalibrate=True)  # what `tessera plan --cluster this-machine` reads
    calibrated_s = time.perf_counter() - began
    plan_argv = _demo_plan_argv(nproc)
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    model, cluster, estimates, commands = plan_rows(parser.parse_args(plan_argv))
    chosen = choose_rows(estimates, args.top, args.all_rows)
    runs = [plan_run(estimates[k].strategy, BATCH) for k in chosen]
    results = compare_runs(
        {"batch_size": BATCH},
        nproc=nproc,
        steps=args.steps,
        out=out / f"nproc{nproc}",
        skip=args.skip,
        recalibrate=False,  # priced on the calibration the plan used
        repeats=args.repeats,
        runs=runs,
        probe_each_run=False,
    )
    measured = {r.label: r for r in results}
    order = sorted(measured, key=lambda label: measured[label].measured_step_s)
    rows = []
    for k, (e, command) in enumerate(zip(estimates, commands, strict=True)):
        row: dict[str, Any] = {
            "plan_rank": k + 1,
            "name": e.strategy.name,
            "command": command.text,
            "predicted_step_s": e.step_s,
            "predicted": {
                "compute_s": e.compute_s,
                "comm_s": e.comm_s,
                "bubble_s": e.bubble_s,
                "offload_s": e.offload_s,
            },  # fmt: skip
            "run": e.strategy.name in measured,
        }
        if row["run"]:
            found = measured[e.strategy.name]
            repeats = _repeat_medians(out / f"nproc{nproc}", found.label, args.repeats, args.skip)
            row.update(
                measured_step_s=found.measured_step_s,
                measured_rank=order.index(found.label) + 1,
                repeat_medians_s=repeats["step_s"],
                measured_compute_s=statistics.median(repeats["compute_s"]),
                measured_comm_s=statistics.median(repeats["comm_s"]),
                predicted_at_achieved_rate_s=found.predicted_step_s,
            )
        rows.append(row)
    timed = [row for row in rows if row["run"]]
    top = rows[0]
    for row in timed[1:]:
        row["faster_than_top_p"] = faster_p(row["repeat_medians_s"], top["repeat_medians_s"])
    faster = [row["name"] for row in timed[1:] if row["faster_than_top_p"] < SIGNIFICANCE]
    top_rank = 1 + len(faster)
    # the check's power: which run rows would pass had the plan put them first
    would_pass = [
        t["name"]
        for t in timed
        if sum(faster_p(o["repeat_medians_s"], t["repeat_medians_s"]) < SIGNIFICANCE
               for o in timed if o is not t) <= 1
    ]  # fmt: skip
    # with r repeats a side the smallest p is 1 / C(2r, r): at r <= 3 no row can be shown faster
    decidable = 1 / math.comb(2 * args.repeats, args.repeats) < SIGNIFICANCE
    spread = statistics.median(max(r["repeat_medians_s"]) / min(r["repeat_medians_s"]) - 1
                               for r in timed)  # fmt: skip
    return {
        "nproc": nproc,
        "plan_flags": "tessera plan " + " ".join(plan_argv),
        "model": model.name,
        "matmul_flops": cluster.peak_flops,
        "cost": cluster.measured.get("cost"),
        "calibration_s": calibrated_s,
        "rows_run": len(chosen),
        "rows_planned": len(estimates),
        "top_row": rows[0]["name"],
        "top_row_measured_rank": top_rank,
        "top_row_median_rank": top["measured_rank"],
        "rows_faster_than_top": faster,
        "decidable": decidable,
        "rows_that_would_pass_as_top": would_pass,
        "passed": top_rank <= 2 and decidable,
        "top_row_over_fastest": rows[0]["measured_step_s"] / measured[order[0]].measured_step_s - 1,
        "repeat_spread": spread,
        "measured_order": order,
        "rows": rows,
        "wall_s": time.perf_counter() - began,
    }


def markdown(found: dict[str, Any]) -> str:
    """BENCHMARKS.md's section: the setting, then per rank count the verdict and the rows."""
    lines = [
        "## plan_check: is `tessera plan`'s top row for this machine among the two fastest run?",
        "",
        f"{found['machine']}; `python benchmarks/plan_check.py` ({found['wall_s']:.0f} s): for "
        f"each rank count the machine calibrated as `tessera plan --cluster this-machine` does, "
        f"the plan's rows for the demo GPT (fp32, batch {BATCH}, micro-batch {MICROBATCH}), and "
        f"`tessera compare`'s runs of its top {found['top']} rows and each family's best "
        f"(mesh, schedule, recomputation, offload), {found['repeats']} times round-robin, "
        f"{found['steps']} steps each, the first {found['skip']} left out; medians. Predicted: "
        "the plan's step (compute at the calibrated matmul rate) and what it adds to compute, "
        "and compare's (compute at the rate a rank achieves on its share); measured: the "
        "step and the trainer's exposed communication (comm_s).",
    ]
    for one in found["checks"]:
        verdict = "PASS" if one["passed"] else "FAIL"
        others = [name for name in one["rows_that_would_pass_as_top"] if name != one["top_row"]]
        if not one["decidable"]:
            verdict += f" ({found['repeats']} repeats cannot show a row faster: 4 at least)"
        lines += [
            "",
            f"**{one['nproc']} ranks: {verdict}**: the plan's top row ({one['top_row']}) is "
            f"measured #{one['top_row_measured_rank']} of {one['rows_run']} run "
            f"({one['rows_planned']} planned): faster than it (p < {SIGNIFICANCE:g}): "
            f"{', '.join(one['rows_faster_than_top']) or 'no row'}; by median alone "
            f"#{one['top_row_median_rank']}, {one['top_row_over_fastest']:+.1%} over the "
            f"fastest; a row's repeats spread by {one['repeat_spread']:.0%} (median over rows). "
            f"Had the plan put another row first, {len(others)} of the {one['rows_run'] - 1} "
            f"others would pass: {', '.join(others) or 'none'}. `{one['plan_flags']}`",
            "",
            "| plan # | strategy | predicted ms (plan) | comm + bubble + offload | "
            "at achieved rate | measured ms | comm | # by median | p faster than #1 | "
            "repeats ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in one["rows"]:
            if not row["run"]:
                continue
            repeats = ", ".join(f"{t * 1e3:.0f}" for t in row["repeat_medians_s"])
            p = f"{row['faster_than_top_p']:.3f}" if "faster_than_top_p" in row else ""
            parts = row["predicted"]
            added = parts["comm_s"] + parts["bubble_s"] + parts["offload_s"]
            lines.append(
                f"| {row['plan_rank']} | {row['name']} | {row['predicted_step_s'] * 1e3:.1f} | "
                f"{added * 1e3:.1f} | {row['predicted_at_achieved_rate_s'] * 1e3:.1f} | "
                f"{row['measured_step_s'] * 1e3:.1f} | {row['measured_comm_s'] * 1e3:.1f} | "
                f"{row['measured_rank']} | {p} | {repeats} |"
            )
    return "\n".join(lines) + "\n"


def _write_section(text: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    """Replace BENCHMARKS.md's `## plan_check` section (up to the next `## `), or add one
    after `## plan_compare`'s."""
    old = path.read_text()
    start = old.find("\n## plan_check")
    if start < 0:
        after = old.find("\n## ", old.find("\n## plan_compare") + 1)
        start = end = after if after >= 0 else len(old)
    else:
        end = old.find("\n## ", start + 1)
        end = end if end >= 0 else len(old)
    path.write_text(old[: start + 1] + text + "\n" + old[end + 1 :])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check for each rank count; write the results (and, unless quick, BENCHMARKS)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, fewer rows and steps")
    parser.add_argument("--nproc", type=int, nargs="+", help="rank counts (default 2 4)")
    parser.add_argument("--top", type=int, help="plan rows run besides each family's best")
    parser.add_argument("--all-rows", action="store_true", help="run every row the plan prints")
    parser.add_argument("--steps", type=int, help="steps per run")
    parser.add_argument("--repeats", type=int, help="round-robin repeats (medians)")
    args = parser.parse_args(argv)
    quick = {"nproc": [2], "top": 2, "steps": 4, "repeats": 4}
    full = {"nproc": [2, 4], "top": 3, "steps": 10, "repeats": 5}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.skip = 2 if args.steps > 4 else 1
    began = time.perf_counter()
    native_kernel_available()  # the offload rows' CPU Adam kernel, built once, before timing
    built_s = time.perf_counter() - began
    began = time.perf_counter()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="plan_check_") as folder:
        checks = [check(n, args, Path(folder)) for n in args.nproc]
    found = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after",
        "quick": args.quick,
        "top": args.top,
        "steps": args.steps,
        "skip": args.skip,
        "repeats": args.repeats,
        "cpu_adam_build_s": built_s,
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
        "wall_s": time.perf_counter() - began,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "plan_check-quick" if args.quick else "plan_check"
    (RESULTS / f"{name}.json").write_text(json.dumps(found, indent=1) + "\n")
    text = markdown(found)
    if not args.quick:
        (RESULTS / "plan_check.md").write_text(text)
        _write_section(text)
    print(text)
    print(f"{'PASS' if found['passed'] else 'FAIL'} in {found['wall_s']:.0f} s")
    return found


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
