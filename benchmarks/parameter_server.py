"""Parameter server: BSP, SSP (K = 1, 2, 4) and ASP with a 3x straggler, and all-reduce DDP.

Task: a synthetic digits-sized classification (1797 samples, 64 features, 10 Gaussian classes;
synthetic so that the benchmark needs no scikit-learn), trained by logistic regression and a small
MLP with plain SGD. 1 server and 3 workers, worker 2 three times slower (`slow_workers={2: 3}`).
tessera DataParallel (all-reduce, no server) runs the same task on 3 ranks with the same
straggler. Reported: total updates/s, time to a target loss (the mini-batch loss averaged over the
last 3 gradients, from the run's log), and where each worker's time goes (pull, compute, sleep,
push per update, from `PSResult.phases_s`); plus push/pull time per update for a 10M-parameter
model with 1 and 2 servers.

Total updates/s is the sum of the workers' own rates (updates / the worker's elapsed time): the
system's throughput while every worker runs. Each worker performs a fixed number of updates, so
under ASP the fast workers finish early and the straggler then runs alone; the updates of the
whole run divided by its span (reported beside it as "whole-run") mixes in that tail, in which
only the slow worker trains, and understates ASP by up to the ratio of the workers' speeds.

    python benchmarks/parameter_server.py [--quick]

Writes benchmarks/results/parameter_server.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.data_parallel import DataParallel
from tessera.parameter_server import SSP, run

RESULTS = Path(__file__).parent / "results"
SAMPLES, FEATURES, CLASSES, BATCH = 1797, 64, 10, 256
LR = 0.5
SLOW = {2: 3.0}
TARGET_FRACTION = 0.05  # target loss: 5% of the initial loss (ln 10 = 2.30), about 0.115
MODES = {"bsp": "bsp", "ssp1": SSP(1), "ssp2": SSP(2), "ssp4": SSP(4), "asp": "asp"}


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.6
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return centers[labels] + torch.randn(SAMPLES, FEATURES, generator=g), labels


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _dataset()
    g = torch.Generator().manual_seed(10_000 * worker + step)
    index = torch.randint(0, SAMPLES, (BATCH,), generator=g)
    return x[index], y[index]


def logistic_regression() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, CLASSES)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def wide_mlp() -> nn.Module:
    """Compute-bound (~1.1M parameters): a step's compute outweighs its push and pull, as on real
    models, so the straggler's extra time shows in BSP; the digits-sized models above are bound
    by RPC latency on one machine."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )


def big_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 3200), nn.Linear(3200, 3200), nn.Linear(3200, 10))


MODELS = {"logreg": logistic_regression, "mlp": mlp, "mlp_wide": wide_mlp}

READING = [
    "Reading the phases: a straggler sleeps (factor - 1) x its compute, so it is 3x slower only "
    "where compute dominates a step. In logreg and mlp a step is mostly pull and push (RPC "
    "latency), the straggler is barely slower, and ASP / BSP there measures the machine's noise "
    "more than consistency. In mlp_wide (compute-bound) BSP's fast workers spend most of each "
    "update in pull, waiting for the straggler, and ASP removes that wait. With a persistent "
    "straggler SSP(K) reaches its bound after K clocks and then moves at the straggler's pace "
    "like BSP: its gain is the K clocks of lead, so it lies between BSP and ASP, nearer BSP for "
    "small K. Compute under the runtime is several times compute alone: 4 processes on 2 cores "
    "(plus the other jobs on the machine), worst under BSP where all workers compute at once.",
]
"""What the phase table shows; numbers are in the tables above it."""


def _time_to_target(times: list[float], losses: list[float], window: int = 3) -> float | None:
    target = TARGET_FRACTION * float(torch.log(torch.tensor(float(CLASSES))))
    for i in range(window - 1, len(losses)):
        if sum(losses[i - window + 1 : i + 1]) / window <= target:
            return times[i] - times[0]
    return None


def _ps_row(model: str, mode: str, steps: int) -> dict:
    result = run(
        MODELS[model],
        F.cross_entropy,
        batch,
        lr=LR,
        num_servers=1,
        num_workers=3,
        consistency=MODES[mode],
        steps=steps,
        slow_workers=SLOW,
        timeout_s=60,
    )
    times, losses = [r["time"] for r in result.log], [r["loss"] for r in result.log]
    span = times[-1] - times[0]
    return {
        "model": model,
        "mode": mode,
        "updates": len(result.log),
        "updates_per_s": sum(result.updates_per_s),
        "whole_run_updates_per_s": (len(result.log) - 1) / span,
        "ms_per_update": [
            {k: 1e3 * v / steps for k, v in phases.items()} for phases in result.phases_s
        ],
        "time_to_target_s": _time_to_target(times, losses),
        "wait_s": result.wait_s,
        "max_staleness": max(r["staleness"] for r in result.log),
        "curve": [(t - times[0], loss) for t, loss in zip(times, losses)],
    }


def _ddp_rank(model: str, steps: int) -> dict:
    ctx = tessera.init()
    torch.set_num_threads(1)
    net = MODELS[model]()
    ddp = DataParallel(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    times, losses = [], []
    for step in range(steps):
        began = time.perf_counter()
        x, y = batch(ctx.rank, step)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        if ctx.rank in SLOW:  # the same straggler: sleeps (factor - 1) x its compute
            time.sleep((SLOW[ctx.rank] - 1) * (time.perf_counter() - began))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.time())
        losses.append(float(loss.detach()))
    ddp.reducer.remove_hooks()
    return {"times": times, "losses": losses}


def _ddp_row(model: str, steps: int) -> dict:
    ranks = tessera.launch(_ddp_rank, 3, model, steps)
    times, losses = ranks[0]["times"], ranks[0]["losses"]
    span = times[-1] - times[0]
    return {
        "model": model,
        "mode": "ddp",
        "updates": 3 * steps,
        "updates_per_s": 3 * (steps - 1) / span,
        "whole_run_updates_per_s": 3 * (steps - 1) / span,
        "ms_per_update": None,
        "time_to_target_s": _time_to_target(times, losses),
        "wait_s": None,
        "max_staleness": 0,
        "curve": [(t - times[0], loss) for t, loss in zip(times, losses)],
    }


def _push_pull_ms(num_servers: int, steps: int) -> float:
    result = run(
        big_model,
        F.cross_entropy,
        batch,
        lr=0.01,
        num_servers=num_servers,
        num_workers=1,
        consistency="asp",
        steps=steps,
        timeout_s=120,
    )
    return 1e3 * result.wait_s[0] / steps


def _push_pull_rows(steps: int, repeats: int) -> list[dict]:
    """1 and 2 servers, interleaved (1 2 1 2 ...), medians."""
    params = sum(p.numel() for p in big_model().parameters())
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for servers in times:
            times[servers].append(_push_pull_ms(servers, steps))
    return [
        {"servers": s, "params": params, "push_pull_ms_per_update": statistics.median(t), "each": t}
        for s, t in times.items()
    ]


def _compute_alone_ms(model: str, steps: int = 15) -> float:
    """One worker's data + forward + backward in this process alone: the uncontended cost."""
    torch.set_num_threads(1)
    net = MODELS[model]()
    spent = []
    for step in range(steps):
        began = time.perf_counter()
        x, y = batch(0, step)
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        spent.append(time.perf_counter() - began)
    return 1e3 * statistics.median(spent)


def _median_row(rows: list[dict]) -> dict:
    """The first repeat's curve, with the medians of the repeats' figures."""
    reached = [r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None]
    return {
        **rows[0],
        "repeats": len(rows),
        "updates_per_s": statistics.median(r["updates_per_s"] for r in rows),
        "updates_per_s_all": [r["updates_per_s"] for r in rows],
        "whole_run_updates_per_s": statistics.median(r["whole_run_updates_per_s"] for r in rows),
        "ms_per_update": None
        if rows[0]["ms_per_update"] is None
        else [
            {k: statistics.median(r["ms_per_update"][w][k] for r in rows) for k in phases}
            for w, phases in enumerate(rows[0]["ms_per_update"])
        ],
        "time_to_target_s": statistics.median(reached) if len(reached) == len(rows) else None,
        "max_staleness": max(r["max_staleness"] for r in rows),
    }


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for row in (r for r in rows if r["model"] == model):
            ts, ls = zip(*row["curve"])
            ax.plot(ts, ls, label=row["mode"], linewidth=1)
        ax.set(
            title=f"{model}: 1 server, 3 workers, worker 2 3x slower",
            xlabel="wall time (s)",
            ylabel="mini-batch loss",
            yscale="log",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, logreg only")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all modes (medians)")
    parser.add_argument(
        "--from-json",
        action="store_true",
        help="rebuild the table and plot from results/parameter_server.json",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        result = json.loads((RESULTS / "parameter_server.json").read_text())
        _plot(result["rows"], RESULTS / "parameter_server.png")
        (RESULTS / "parameter_server.md").write_text(_table(result))
        return result
    steps = 20 if args.quick else 60
    runs = [
        (model, mode)
        for model in (["logreg"] if args.quick else list(MODELS))
        for mode in [*MODES, "ddp"]
    ]
    repeats: dict[tuple[str, str], list[dict]] = {run_: [] for run_ in runs}
    for _ in range(args.repeats):  # A B C ... A B C ...: every mode sees the same machine load
        for model, mode in runs:
            row = _ddp_row(model, steps) if mode == "ddp" else _ps_row(model, mode, steps)
            repeats[(model, mode)].append(row)
            print(
                f"{model:7} {mode:5} {row['updates_per_s']:7.1f} updates/s  "
                f"target in {row['time_to_target_s']}",
                flush=True,
            )
    rows = [_median_row(repeats[run_]) for run_ in runs]
    push_pull = _push_pull_rows(4 if args.quick else 8, args.repeats)
    alone = {model: _compute_alone_ms(model) for model in sorted({m for m, _ in runs})}
    result = {
        "benchmark": "parameter_server",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}",
        "steps_per_worker": steps,
        "repeats": args.repeats,
        "batch": BATCH,
        "lr": LR,
        "slow_workers": SLOW,
        "rows": rows,
        "push_pull": push_pull,
        "compute_alone_ms": alone,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parameter_server.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(rows, RESULTS / "parameter_server.png")
    (RESULTS / "parameter_server.md").write_text(_table(result))
    print(_table(result))
    return result


def _table(result: dict) -> str:
    lines = [
        "## parameter_server: BSP / SSP / ASP with a straggler, and all-reduce DDP",
        "",
        f"{result['machine']}; 1 server + 3 workers (ASP/SSP/BSP) or 3 ranks (DDP), worker 2 "
        f"3x slower; {result['steps_per_worker']} steps per worker, batch {result['batch']}, SGD "
        f"lr {result['lr']}. Target loss: {TARGET_FRACTION} x ln 10. Medians of "
        f"{result['repeats']} rounds over all modes (A B C ... A B C ...); time to target from "
        "the first gradient's apply; 'not reached' if any round missed it.",
        "",
        "Total updates/s: the sum of the workers' rates (the system's throughput while all "
        "run); whole-run: all updates / the run's span, which under ASP includes the straggler "
        "finishing its quota alone. Target: ASP >= 2x BSP, SSP in between.",
        "",
        "| model | mode | total updates/s (each round) | vs BSP | whole-run updates/s "
        "| time to target s | max staleness |",
        "|---|---|---|---|---|---|---|",
    ]
    bsp = {r["model"]: r["updates_per_s"] for r in result["rows"] if r["mode"] == "bsp"}
    for r in result["rows"]:
        target = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}"
        each = ", ".join(f"{u:.0f}" for u in r.get("updates_per_s_all", []))
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['updates_per_s']:.1f} ({each}) "
            f"| {r['updates_per_s'] / bsp[r['model']]:.2f} "
            f"| {r['whole_run_updates_per_s']:.1f} | {target} | {r['max_staleness']} |"
        )
    lines += [
        "",
        "Where the time goes, ms per update (medians): a fast worker (0) and the slow "
        "one (2); compute alone = the same data + forward + backward in one process with the "
        "machine otherwise as loaded.",
        "",
        "| model | mode | worker 0 pull / compute / push | worker 2 pull / compute / sleep "
        "/ push | compute alone |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["ms_per_update"] is None:
            continue
        fast, slow = r["ms_per_update"][0], r["ms_per_update"][2]
        lines.append(
            f"| {r['model']} | {r['mode']} | {fast['pull_s']:.1f} / {fast['compute_s']:.1f} / "
            f"{fast['push_s']:.1f} | {slow['pull_s']:.1f} / {slow['compute_s']:.1f} / "
            f"{slow['sleep_s']:.1f} / {slow['push_s']:.1f} "
            f"| {result['compute_alone_ms'][r['model']]:.1f} |"
        )
    lines += ["", *READING]
    lines += [
        "",
        "Push + pull time per update of one worker, 10M+ parameters (target: 2 servers below 1):",
        "",
        "| servers | params | push+pull ms per update (each round) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {p['servers']} | {p['params'] / 1e6:.1f}M | {p['push_pull_ms_per_update']:.1f} "
        f"({', '.join(f'{t:.0f}' for t in p['each'])}) |"
        for p in result["push_pull"]
    ]
    lines += ["", "![loss against wall time](benchmarks/results/parameter_server.png)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
