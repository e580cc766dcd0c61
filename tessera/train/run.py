"""One `tessera train` job: settle the config and the run folder, start the ranks, report.

Three ways to start, one worker function (`train_worker`):
- under `torchrun` / `tessera run` (WORLD_SIZE is set): this process is a rank; run it here;
- `--nproc 1`: one rank in this process, no spawn;
- otherwise: `tessera.launch` spawns `nproc` local ranks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from tessera.errors import ConfigError
from tessera.runtime.context import shutdown
from tessera.runtime.launch import launch
from tessera.train.config import TrainConfig, config_to_dict, load_yaml
from tessera.train.loop import CHECKPOINT_NAME, train_worker
from tessera.train.registry import own_entry_point

__all__ = ["config_layers_for_resume", "print_summary", "run_training"]


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "TESSERA_INIT_FILE" not in os.environ


def config_layers_for_resume(run_dir: str | Path) -> dict[str, Any]:
    """The saved config of a run to resume, as the lowest config layer; checks it can resume."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"cannot resume {run_dir}: no config.yaml there (not a tessera run)")
    if not (run_dir / CHECKPOINT_NAME).is_file():
        raise ConfigError(f"cannot resume {run_dir}: it holds no {CHECKPOINT_NAME}")
    return load_yaml(run_dir / "config.yaml")


def _choose_run_dir(config: TrainConfig, resume: bool) -> Path:
    if config.out is not None:
        run_dir = Path(config.out)
        if not resume and (run_dir / CHECKPOINT_NAME).exists():
            raise ConfigError(
                f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                "or choose another --out"
            )
        return run_dir
    if _under_torchrun():
        # Every rank must agree on the folder: derive it from the job id torchrun shares.
        return Path("runs") / f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}"
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _write_config(config: TrainConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    data = config_to_dict(config)
    data["out"] = str(run_dir)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(run_dir / "config.yaml")


def run_training(config: TrainConfig, *, resume: bool = False) -> dict[str, Any] | None:
    """Train as `config` says; return rank 0's summary (None on other ranks under torchrun)."""
    run_dir = _choose_run_dir(config, resume)
    entry = own_entry_point(config.strategy)
    if entry is not None:  # servers and workers: the strategy runs the whole job (ps)
        if not _under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
            _write_config(config, run_dir)
        summary = entry(config, run_dir, resume)
        return summary if not _under_torchrun() or int(os.environ["RANK"]) == 0 else None
    if _under_torchrun():
        if int(os.environ.get("RANK", "0")) == 0:
            _write_config(config, run_dir)
        return train_worker(config, str(run_dir), resume)
    _write_config(config, run_dir)
    if config.nproc == 1:
        try:
            return train_worker(config, str(run_dir), resume)
        finally:
            shutdown()
    return launch(train_worker, config.nproc, config, str(run_dir), resume, timeout_s=None)[0]


def print_summary(summary: dict[str, Any]) -> None:
    """The closing table of a run, and its generated sample."""
    from rich.console import Console
    from rich.table import Table

    ranks = summary["world_size"]
    title = f"tessera train: {summary['strategy']} on {ranks} rank{'s' if ranks > 1 else ''}"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = summary.get("rows")  # a strategy with its own entry point gives its own rows
    if rows is None:
        rows = _engine_rows(summary)
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    if summary["sample"]:
        console.print("[bold]sample:[/bold]")
        console.print(summary["sample"], markup=False, highlight=False)


def _engine_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    comm_share = summary["comm_s"] / summary["step_s"] if summary["step_s"] else 0.0
    rows = [
        ("steps (this run / total)", f"{summary['steps_this_run']} / {summary['steps']}"),
        ("loss (first -> last)", f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"),
        ("tokens/s (median)", f"{summary['tokens_per_s']:,.0f}"),
        ("step time (median)", f"{summary['step_s'] * 1e3:.1f} ms"),
        ("exposed communication", f"{summary['comm_s'] * 1e3:.1f} ms ({comm_share:.0%})"),
        ("peak memory per rank", ", ".join(f"{m:.0f} MB" for m in summary["peak_mem_mb"])),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("run folder", summary["run_dir"]),
    ]
    if summary.get("model_state_mb"):
        states = ", ".join(f"{m:.2f} MB" for m in summary["model_state_mb"])
        rows.insert(-2, ("model states per rank", states))
    return rows
