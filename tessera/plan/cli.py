"""`tessera plan`: its flags, the model and cluster they describe, the table, `--json`, `--plot`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tessera.plan.cluster import PRESETS, Cluster, preset
from tessera.plan.commands import TrainCommand, model_flags, train_command
from tessera.plan.model import ModelSpec, from_module, parse_count
from tessera.plan.search import PRECISIONS, Estimate, plan

__all__ = ["add_plan_arguments", "model_from_args", "cluster_from_args", "plan_rows", "run_plan"]

_CLUSTER_FLAGS = {
    "devices": "devices",
    "per_node": "per_node",
    "device_memory": "memory_bytes",
    "peak_flops": "peak_flops",
    "intra": "intra_bandwidth",
    "inter": "inter_bandwidth",
}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tessera plan` (model, cluster, training, output)."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default="gpt",
        help="gpt (with --layers ... --vocab), or any --model the trainer accepts "
        "(PKG.MODULE:FACTORY, hf:CLASS with --model-config): its parameters counted",
    )
    for flag, default in (("layers", 0), ("hidden", 0), ("heads", 0), ("seq", 2048), ("vocab", 0)):
        model.add_argument(f"--{flag}", type=int, default=default)
    model.add_argument("--params", help="parameter count only (7.5B): model states, no activations")
    model.add_argument("--model-config", help="hf:CLASS: its config file (JSON/YAML)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--cluster", help=f"a preset: {', '.join([*PRESETS, 'this-machine'])} (flags override it)"
    )
    cluster.add_argument("--devices", type=int, help="devices in all (default: one node)")
    cluster.add_argument("--per-node", type=int, help="devices per node")
    cluster.add_argument("--device-memory", help="memory of one device, e.g. 80GB")
    cluster.add_argument("--peak-flops", help="peak FLOP/s of one device, e.g. 312T")
    cluster.add_argument("--intra", help="bandwidth inside a node per device, e.g. 300GB/s")
    cluster.add_argument("--inter", help="bandwidth across nodes per device, e.g. 25GB/s")
    train = parser.add_argument_group("training")
    train.add_argument("--batch", type=int, default=512, help="global batch in sequences")
    train.add_argument("--microbatch", type=int, default=1, help="sequences per micro-batch")
    train.add_argument("--tokens", help="tokens to train on (300B): days per strategy")
    rates = train.add_mutually_exclusive_group()
    rates.add_argument(
        "--achieved-flops",
        help="end-to-end FLOP/s per device as Megatron-LM reports it (model FLOPs over the whole "
        "step): the step is the FLOPs over this rate, nothing added",
    )
    rates.add_argument(
        "--compute-flops",
        help="compute-only FLOP/s per device (replaces the peak): communication, bubble and "
        "offload are added to the compute",
    )
    train.add_argument("--recompute", choices=["both", "on", "off"], default="both")
    train.add_argument("--precision", choices=list(PRECISIONS), default="mixed")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--plot", metavar="FILE.png", help="memory and time bars per strategy")
    out.add_argument("--top", type=int, default=20, help="rows of the table and the plot")
    out.add_argument(
        "--all",
        action="store_true",
        help="also the strategies the planner prices but tessera does not run, marked so "
        "(default: only rows with a tessera train command; a --params plan shows them all)",
    )


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model the flags describe; ValueError naming the flag when they do not."""
    if args.params is not None:
        return ModelSpec(params=parse_count(args.params), seq=args.seq, name=f"{args.params}")
    if args.model == "gpt":
        if not (args.layers and args.hidden and args.heads and args.vocab):
            raise ValueError(
                "--model gpt needs --layers, --hidden, --heads and --vocab (or --params)"
            )
        return ModelSpec.gpt(
            layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab
        )
    from tessera.models.user import model_factory

    module = model_factory(args.model, args.model_config)()
    return from_module(module, seq=args.seq, name=args.model)


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The preset `--cluster` with the flags given over it, or a cluster from the flags alone."""
    overrides: dict[str, Any] = {}
    for flag, name in _CLUSTER_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        overrides[name] = value if isinstance(value, int) else parse_count(value, "--" + flag)
    if args.cluster:
        return preset(args.cluster, **overrides)
    missing = [f"--{f.replace('_', '-')}" for f, n in _CLUSTER_FLAGS.items() if n not in overrides]
    missing = [m for m in missing if m not in ("--per-node",)]
    if missing:
        raise ValueError(f"without --cluster, give {', '.join(missing)}")
    overrides.setdefault("per_node", overrides["devices"])
    return Cluster(**overrides)


def report(
    model: ModelSpec,
    estimates: list[Estimate],
    rate: float,
    commands: list[TrainCommand] | None = None,
) -> dict[str, Any]:
    """The `--json` object: params, flops_per_iteration (of the best strategy, recomputation
    included when it recomputes), and every strategy best first, each with the `tessera train`
    line that runs it (`command`, null where tessera cannot, and `not_runnable` says why)."""
    best = estimates[0]
    s = best.strategy
    rows = [e.to_json() for e in estimates]
    for row, command in zip(rows, commands or []):
        row["command"] = command.text or None
        row["not_runnable"] = command.why_not or None
    return {
        "model": model.name,
        "params": model.params,
        "flops_per_iteration": best.compute_s * s.dp * s.tp * s.pp * rate,
        "strategies": rows,
    }


def commands_for(
    args: argparse.Namespace, cluster: Cluster, estimates: list[Estimate]
) -> list[TrainCommand]:
    """The `tessera train` line of every estimate's strategy (`commands.train_command`)."""
    flags = None
    if args.params is None:
        flags = model_flags(
            args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq
        )
        if flags is not None and args.model_config:
            flags = (*flags, "--model-config", args.model_config)
    return [
        train_command(e.strategy, flags, cluster, batch=args.batch, precision=args.precision)
        for e in estimates
    ]


def plan_rows(
    args: argparse.Namespace,
) -> tuple[ModelSpec, Cluster, list[Estimate], list[TrainCommand]]:
    """What `tessera plan` prints for these flags: the model, the cluster, and the rows best
    first with the command of each (only those tessera runs, unless `--all`)."""
    model = model_from_args(args)
    cluster = cluster_from_args(args)
    recompute = {"both": (False, True), "on": (True,), "off": (False,)}[args.recompute]
    achieved = parse_count(args.achieved_flops, "--achieved-flops") if args.achieved_flops else None
    compute = parse_count(args.compute_flops, "--compute-flops") if args.compute_flops else None
    estimates = plan(
        model,
        cluster,
        batch=args.batch,
        microbatch=args.microbatch,
        tokens=parse_count(args.tokens, "--tokens") if args.tokens else None,
        achieved_flops=achieved,
        compute_flops=compute,
        recompute=recompute,
        precision=args.precision,
    )
    commands = commands_for(args, cluster, estimates)
    if not args.all and any(c.argv for c in commands):  # only what tessera runs
        kept = [k for k, c in enumerate(commands) if c.argv]
        estimates, commands = [estimates[k] for k in kept], [commands[k] for k in kept]
    return model, cluster, estimates, commands


def run_plan(args: argparse.Namespace) -> int:
    """`tessera plan`: predict, print (table or JSON), plot."""
    model, cluster, estimates, commands = plan_rows(args)
    achieved = parse_count(args.achieved_flops, "--achieved-flops") if args.achieved_flops else None
    compute = parse_count(args.compute_flops, "--compute-flops") if args.compute_flops else None
    if args.json:
        rate = achieved or compute or cluster.peak_flops
        print(json.dumps(report(model, estimates, rate, commands)))
    else:
        _print_table(model, cluster, estimates[: args.top], commands)
    if args.plot:
        from tessera.plan.plot import plot_estimates

        plot_estimates(
            estimates[: args.top],
            args.plot,
            title=f"{model.name} on {cluster.name}",
            memory_limit=cluster.memory_bytes,
        )
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _print_table(
    model: ModelSpec, cluster: Cluster, estimates: list[Estimate], commands: list[TrainCommand]
) -> None:
    from rich.console import Console
    from rich.table import Table

    gb = 1e9
    table = Table(title=f"tessera plan: {model.name}, {model.params / 1e9:.3g}B parameters")
    for column in (
        "#", "strategy", "params GB", "grads GB", "optim GB", "act GB", "total GB", "fits",
        "compute s", "comm s", "bubble s", "step s", "tokens/s", "days",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for k, e in enumerate(estimates, 1):
        table.add_row(
            str(k),
            e.strategy.name + ("" if commands[k - 1].argv else " (not run by tessera)"),
            f"{e.params / gb:.2f}",
            f"{e.grads / gb:.2f}",
            f"{e.optimizer / gb:.2f}",
            f"{e.activations / gb:.2f}",
            f"{e.memory_bytes / gb:.2f}",
            "yes" if e.fits else "no",
            f"{e.compute_s:.3g}",
            f"{e.comm_s + e.offload_s:.3g}",
            f"{e.bubble_s:.3g}",
            f"{e.step_s:.3g}",
            f"{e.tokens_per_s:,.0f}",
            "" if e.days is None else f"{e.days:.1f}",
        )
    console = Console(width=200)
    console.print(cluster.describe())
    console.print(table)
    console.print("Run a row (several nodes: each starts it with its own --node-rank):")
    for k, command in enumerate(commands[: len(estimates)], 1):
        console.print(
            f"{k:>3}. {command.text or 'not run by tessera: ' + command.why_not}",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
