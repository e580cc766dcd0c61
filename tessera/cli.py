"""The `tessera` command: `train` (the main job) and `run` (a thin front of torchrun).

`tessera run [OPTIONS] SCRIPT ARGS...` hands SCRIPT's arguments over untouched: the command line is
cut at SCRIPT (or the module after -m) before any parser sees it, because argparse matches option
prefixes anywhere on the line (torchrun's parser took `train --nproc 4` for its own
`--nproc-per-node`).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError, TesseraError

__all__ = ["main"]


def _flag_layer(args: argparse.Namespace) -> dict[str, Any]:
    """The config values given on the command line, nested like the YAML file."""
    from tessera.train.config_flags import flag_layer

    return flag_layer(args)


def _settle_nproc(user_layers: list[dict[str, Any]], flags: dict[str, Any]) -> None:
    """Under tessera run / torchrun, the processes exist already: nproc is their count per node.

    An `nproc` the user gave (flag or --config file) must agree with it: a different number means
    the user expects another world than the one running, which is refused rather than ignored.
    A saved config being resumed does not count as given.
    """
    from tessera.train.config import torchrun_world

    world = torchrun_world()
    if world is None:
        return
    local = world[1]
    given = [layer["nproc"] for layer in user_layers if layer.get("nproc", "auto") != "auto"]
    if given and given[-1] != local:
        raise ConfigError(
            f"--nproc {given[-1]} disagrees with the {local} processes per node that tessera "
            f"run / torchrun started (-n {local}); under tessera run leave --nproc out"
        )
    flags["nproc"] = local


def _train(args: argparse.Namespace) -> int:
    from tessera.train.config import load_yaml
    from tessera.train.config_build import build_config

    layers = []
    if args.resume:
        from tessera.train.resume import config_layers_for_resume

        layers.append(config_layers_for_resume(args.resume))
    user_layers = [load_yaml(args.config)] if args.config else []
    flags = _flag_layer(args)
    if args.resume:
        flags["out"] = args.resume
    _settle_nproc([*user_layers, flags], flags)
    config = build_config(*layers, *user_layers, flags)
    from tessera.train.run import print_summary, run_training  # the loop: only once valid

    summary = run_training(
        config,
        resume=bool(args.resume),
        max_restarts=args.max_restarts,
        min_nproc=args.min_nproc,
    )
    if summary is not None:
        print_summary(summary)
    return 0


_RUN_OPTIONS_WITH_VALUE = {
    "-n",
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--rdzv-id",
    "--max-restarts",
}


def _split_at_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """`tessera run`'s own options, and [SCRIPT, its arguments...] untouched.

    SCRIPT is the first word that is neither an option nor an option's value; `--` may also mark
    where `tessera run`'s options end.
    """
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:]
        i += 2 if token in _RUN_OPTIONS_WITH_VALUE else 1
    return argv, []


def _rendezvous_backend(nnodes: str, max_restarts: int) -> str:
    """torchrun's rendezvous: static for a fixed `--nnodes` run once, else c10d.

    Under c10d every node's agent polls the store, which lives in one agent's process, at each
    look at its workers; the node hosting it finishes first and exits, and a node whose workers
    were still exiting then failed on the closed store (`RendezvousConnectionError`, as in
    pytorch issue 107021) after training had ended well. A static rendezvous reads the store only
    to start, so a fixed world ends cleanly. An elastic range (MIN:MAX) or restarts, where the
    nodes meet again, keep c10d."""
    return "static" if nnodes.isdigit() and max_restarts == 0 else "c10d"


def _run(args: argparse.Namespace) -> int:
    """Hand the job to torch.distributed.run (torchrun's elastic agent).

    torchrun's parser reads only its own options (and a placeholder script); the real script and
    its arguments are set on the parsed result, so no word of theirs is taken for torchrun's.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from tessera.runtime.devices import check_visible_gpus

    if str(args.nproc_per_node).isdigit():  # NCCL: a GPU per rank, refused before any starts
        check_visible_gpus(int(args.nproc_per_node))
    argv = [
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--nnodes",
        args.nnodes,
        "--node-rank",
        str(args.node_rank),
        "--max-restarts",
        str(args.max_restarts),
    ]
    if args.rdzv_endpoint:
        argv += [
            "--rdzv-backend",
            args.rdzv_backend or _rendezvous_backend(args.nnodes, args.max_restarts),
            "--rdzv-endpoint",
            args.rdzv_endpoint,
            "--rdzv-id",
            args.rdzv_id,
        ]
    elif args.nnodes in ("1", "1:1"):
        argv += ["--standalone"]
    else:
        raise TesseraError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT")
    if args.module:
        argv.append("--module")
    torchrun_args = torchrun.parse_args([*argv, "placeholder-script"])
    torchrun_args.training_script = args.script
    torchrun_args.training_script_args = list(args.script_args)
    try:
        torchrun.run(torchrun_args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
"""The benchmark scripts: the `benchmarks/` folder of the source checkout holding this package.
Benchmark code is not the library's, so an installed wheel has none (`tessera bench` says so)."""


def _bench(args: argparse.Namespace) -> int:
    """`tessera bench comm [options]`: runs `benchmarks/comm.py [options]` in a new interpreter,
    exactly as `python benchmarks/comm.py [options]` from the current folder would."""
    script = BENCHMARKS / f"{args.name}.py"
    if not script.is_file():
        raise TesseraError(
            f"tessera bench runs the scripts of a source checkout's benchmarks/ folder, and "
            f"{script} does not exist (tessera was installed without them): clone the repository "
            f"and run `python benchmarks/{args.name}.py` there"
        )
    return subprocess.run([sys.executable, str(script), *args.bench_args]).returncode


def _checkpoint(args: argparse.Namespace) -> int:
    """`tessera checkpoint consolidate RUN_DIR OUT`: ZeRO shards -> one safetensors file."""
    from tessera.zero import consolidate

    out = consolidate(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    """`tessera checkpoint export RUN_DIR OUT [--step N] [--format F]`."""
    from tessera.train.export import export_run

    out = export_run(args.run_dir, args.out, step=args.step, format=args.format)
    print(f"wrote {out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`tessera plan`: predicted memory and step time of every strategy (tessera.plan)."""
    from tessera.plan.cli import run_plan

    try:
        return run_plan(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _compare(args: argparse.Namespace) -> int:
    """`tessera compare`: each strategy run here for --steps steps against the planner."""
    from tessera.train.compare import compare_runs, markdown, plot

    base: dict[str, Any] = {"batch_size": args.batch_size, "microbatches": args.microbatches}
    if args.model:
        base.update(model_factory=args.model, data=args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = [s.strip() for s in args.strategies.split(",")] if args.strategies else None
    try:
        results = compare_runs(
            base,
            nproc=args.nproc,
            steps=args.steps,
            out=out,
            only=only,
            recalibrate=not args.cached_calibration,
            repeats=args.repeats,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    table = markdown(results, args.nproc)
    (out / "compare.md").write_text(table + "\n")
    print(table)
    png = plot(results, out / "compare.png", f"measured vs predicted, {args.nproc} ranks")
    print(f"wrote {png}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The `tessera` command's parser: every command, its help and its flags.

    Why so long: it is the command line's reference, one `add_argument` per flag read top to
    bottom (the trainer's flags are generated from `TrainConfig`); cut into one function per
    command it would say the same at more length.
    """
    from tessera.train.config_flags import add_train_flags

    # no abbreviations (`--strat zero2` is an error, not --strategy): a flag added later must not
    # change what an old command line means, and a typo must not pick a flag by its prefix
    strict = functools.partial(argparse.ArgumentParser, allow_abbrev=False)
    parser = strict(
        prog="tessera", description="Distributed training, every strategy in readable Python."
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=strict)

    train = commands.add_parser(
        "train",
        help="train your model (--model, --data) or the demo GPT (the main job)",
        description="Train --model on --data, or by default a small GPT on Python's own source. "
        "Flags override --config, which "
        "overrides the defaults. Writes runs/<timestamp>/ (config.yaml, metrics.jsonl, "
        "loss.png, checkpoints/step-N/, sample.txt).",
    )
    train.add_argument("--config", metavar="FILE.yaml", help="YAML file of config values")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR up to --steps")
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="after a rank fails, restart every rank from the newest checkpoint, up to K times "
        "(default: 0)",
    )
    train.add_argument(
        "--min-nproc",
        type=int,
        default=None,
        metavar="M",
        help="elastic: a restart after a lost rank may continue on fewer ranks, down to M "
        "(ddp, torch-ddp, zero1-3)",
    )
    add_train_flags(train)
    train.set_defaults(handler=_train)

    run = commands.add_parser(
        "run",
        allow_abbrev=False,
        help="run a script on N processes per node (a thin front of torchrun)",
        description="Start SCRIPT on N local processes through torch.distributed.run; for several "
        "machines, start it on each with --nnodes, --node-rank and --rdzv-endpoint.",
    )
    run.add_argument("-n", "--nproc-per-node", default="1", help="processes on this node")
    run.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX (elastic)")
    run.add_argument("--node-rank", type=int, default=0, help="rank of this node")
    run.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous")
    run.add_argument(
        "--rdzv-backend",
        default=None,
        help="rendezvous backend (default: static for a fixed --nnodes without restarts, node "
        "rank 0 on HOST hosting the store; else c10d)",
    )
    run.add_argument("--rdzv-id", default="tessera", help="job id shared by all nodes")
    run.add_argument("--max-restarts", type=int, default=0, help="restarts after a failure")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    run.add_argument("script", help="the script (or module with -m) to run")
    run.add_argument("script_args", nargs="*", help="its arguments, passed on untouched")
    run.set_defaults(handler=_run)

    from tessera.plan.cli import add_plan_arguments

    plan = commands.add_parser(
        "plan",
        help="predict memory and step time of every strategy for a model on a cluster",
        description="For a model (--model gpt --layers L --hidden H --heads A --seq S --vocab V, "
        "--params 7.5B, or a --model the trainer accepts) on a cluster (--cluster a100-80g-dgx, "
        "h100-80g-dgx, this-machine, or --devices/--per-node/--device-memory/--peak-flops/"
        "--intra/--inter), every applicable strategy's memory per device and predicted step "
        "time, best first (tessera.plan: the formulas of ZeRO, Megatron-LM and Korthikanti et "
        "al., collectives priced by tessera.comm.cost).",
    )
    add_plan_arguments(plan)
    plan.set_defaults(handler=_plan)

    compare = commands.add_parser(
        "compare",
        help="run each strategy here for a few steps: measured against predicted (PNG, table)",
        description="Each strategy that runs on --nproc ranks trains --steps steps (the demo GPT, "
        "or --model with --data) through the trainer; its median step time and model states per "
        "rank are set against tessera plan's prediction for this machine (measured once, as "
        "`tessera plan --cluster this-machine` does).",
    )
    compare.add_argument("--model", help="PKG.MODULE:FACTORY or hf:CLASS (default: demo GPT)")
    compare.add_argument("--data", help="the --model's data, as for tessera train")
    compare.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    compare.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    compare.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="run the list this many times, round-robin, and compare medians (default 3: one "
        "run of a strategy can be 30%% off the next on a shared machine)",
    )
    compare.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
    compare.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches")
    compare.add_argument("--strategies", help="comma-separated labels to run (default: all)")
    compare.add_argument("--out", default="runs/compare", help="folder of the runs and results")
    compare.add_argument(
        "--cached-calibration",
        action="store_true",
        help="use the machine as last measured instead of measuring it again first",
    )
    compare.set_defaults(handler=_compare)

    bench = commands.add_parser(
        "bench",
        help="run a benchmark against its anchor",
        description="comm: every all-reduce algorithm against torch.distributed's, 4 KB-64 MB, "
        "2 and 4 ranks (tessera bench comm --help for its options). The other benchmarks are "
        "scripts in benchmarks/.",
    )
    bench.add_argument("name", choices=["comm"], help="which benchmark")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="its options")
    bench.set_defaults(handler=_bench)

    commands.add_parser(  # parsed by tessera.federated.cli (see `main`): listed here for --help
        "fl",
        help="federated learning: `tessera fl server --config FILE`, `tessera fl client ...`, "
        "`tessera fl token --client K` (a client's own token)",
    )

    checkpoint = commands.add_parser("checkpoint", help="work with checkpoints")
    actions = checkpoint.add_subparsers(dest="action", required=True, parser_class=strict)
    merge = actions.add_parser(
        "consolidate",
        help="merge a ZeRO run's sharded checkpoint into one plain safetensors state dict",
        description="Stream the rank shards of RUN_DIR (a zero1/zero2/zero3 run) into OUT, a "
        "safetensors file that torch and safetensors load without tessera.",
    )
    merge.add_argument("run_dir", metavar="RUN_DIR", help="run folder (or folder of shard files)")
    merge.add_argument("out", metavar="OUT.safetensors", help="file to write")
    merge.set_defaults(handler=_checkpoint)
    export = actions.add_parser(
        "export",
        help="write a run's trained model as safetensors or a Hugging Face folder (any strategy)",
        description="Load the newest verified checkpoint of RUN_DIR (or --step N's), gather the "
        "full model (ZeRO shards consolidated) and write OUT: safetensors (OUT/model.safetensors, "
        "or OUT itself if it ends in .safetensors; keys equal model.state_dict()) or hf "
        "(save_pretrained: transformers' from_pretrained(OUT) loads it; --model hf: runs only).",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="run folder of tessera train")
    export.add_argument("out", metavar="OUT", help="folder (or .safetensors file) to write")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    export.add_argument("--format", choices=["safetensors", "hf"], default="safetensors")
    export.set_defaults(handler=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tessera` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fl"]:  # its own parser, loaded only when asked for (torch, cryptography)
        from tessera.federated.cli import main as federated_main

        return federated_main(argv[1:])
    script_and_args: list[str] | None = None
    if argv[:1] == ["run"]:
        own, script_and_args = _split_at_script(argv[1:])
        argv = ["run", *own, *script_and_args[:1]]
    args = _parser().parse_args(argv)
    if script_and_args is not None:
        args.script_args = script_and_args[1:]
    try:
        return args.handler(args)
    except TesseraError as exc:
        _report(exc)
        return 2


CONFIG_ERROR_GRACE_S = 10.0
"""How long a worker other than a node's local rank 0 holds back a config error (`_report`):
rank 0 validates the same config in the same time, give or take the import jitter of a loaded
machine (seconds); torchrun's agent looks at its workers every 0.1 s."""


def _report(exc: TesseraError) -> None:
    """Print `tessera: error: ...`, once per node where every worker fails alike.

    Under torchrun every worker validates the same config. Local rank 0 prints at once; the
    others wait up to CONFIG_ERROR_GRACE_S, within which torchrun, seeing rank 0 fail, stops
    them, and print only if they outlive it (an error of their own, a LOCAL_RANK beyond the
    GPUs). A silent rank 1 that exited at once got rank 0 stopped before it had printed: the
    user saw torchrun's report and no reason."""
    if isinstance(exc, ConfigError) and os.environ.get("LOCAL_RANK", "0") != "0":
        time.sleep(CONFIG_ERROR_GRACE_S)
    print(f"tessera: error: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
