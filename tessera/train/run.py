"""One `tessera train` job: settle the config and the run folder, start the ranks, report.

Three ways to start, one worker function (`train_worker`):
- under `torchrun` / `tessera run` (WORLD_SIZE is set): this process is a rank; run it here (a
  worker its elastic agent restarted resumes from the run folder by itself);
- `--nproc 1` without restarts: one rank in this process, no spawn;
- otherwise: `tessera.train.restarts.supervise` starts `nproc` local ranks and restarts them
  after a failure, up to `max_restarts` times.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tessera.checkpoint import series
from tessera.errors import ConfigError
from tessera.runtime.context import shutdown
from tessera.runtime.devices import check_visible_gpus
from tessera.strategies.own_job import JobTools
from tessera.strategies.registry import own_entry_point
from tessera.train.callbacks import check_callbacks
from tessera.train.config import TrainConfig
from tessera.train.config_build import config_to_dict
from tessera.train.faults import faults_from_env
from tessera.train.loop import train_worker
from tessera.train.metrics import read_metrics
from tessera.train.optimizers import lr_at, make_optimizer
from tessera.train.preflight import preflight_workload
from tessera.train.restarts import (
    check_restart_options,
    has_checkpoint,
    restarted_by_torchrun,
    supervise,
)
from tessera.train.resume import check_fresh_out, check_resume
from tessera.train.workload import gpt_sample

__all__ = ["print_summary", "run_training"]


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "TESSERA_INIT_FILE" not in os.environ


WORKLOAD_FILE = "workload.json"
"""What identifies a `--model` run's workload (`Workload.identity`), written beside config.yaml so
that a resume with other data (another length, another vocabulary) is refused before any rank
starts; the ranks check the checkpoint's own copy again."""


def _check_workload(run_dir: Path, checked: dict[str, Any] | None, resume: bool) -> None:
    """Refuse to resume a run whose saved workload identity differs from this one's."""
    saved_file = run_dir / WORKLOAD_FILE
    if checked is None or not resume or not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text()).get("workload", {})
    now = json.loads(json.dumps(checked["identity"]))["workload"]  # as JSON would hold it
    differing = [
        f"{key} ({saved.get(key)!r} -> {now.get(key)!r})"
        for key in sorted({*saved, *now})
        if saved.get(key) != now.get(key)
    ]
    if differing:
        raise ConfigError(
            f"cannot resume {run_dir}: it was trained on another workload; differing: "
            f"{', '.join(differing)}"
        )


def _write_workload(checked: dict[str, Any] | None, run_dir: Path) -> None:
    if checked is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / WORKLOAD_FILE).write_text(json.dumps(checked["identity"], indent=1))


def _choose_run_dir(config: TrainConfig, resume: bool) -> Path:
    if config.out is not None:
        run_dir = Path(config.out)
        if not resume and series.has_checkpoint(run_dir):
            raise ConfigError(
                f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                "or choose another --out"
            )
        if not resume:
            check_fresh_out(config, run_dir)
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


def job_tools() -> JobTools:
    """The trainer's functions a strategy that runs its own job calls (ps: the servers'
    optimizer and schedule, the config record, the sample, the earlier run's log on resume)."""
    return JobTools(
        make_optimizer=make_optimizer,
        lr_at=lr_at,
        config_to_dict=config_to_dict,
        gpt_sample=gpt_sample,
        read_metrics=read_metrics,
    )


def run_training(
    config: TrainConfig,
    *,
    resume: bool = False,
    max_restarts: int = 0,
    min_nproc: int | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any] | None:
    """Train as `config` says; return rank 0's summary (None on other ranks under torchrun).

    `max_restarts`: after a rank fails, restart every rank from the newest checkpoint, up to this
    many times; `min_nproc`: restarts after a lost rank may use fewer ranks, down to this many
    (see `tessera.train.restarts`). `callbacks`: objects with `on_step_end(step, metrics)` and/or
    `on_eval_end(step, metrics)`, called on rank 0; a hook stops training early by raising
    `tessera.train.StopTraining` (see `tessera.train.callbacks`). Spawned ranks get them pickled.
    """
    check_restart_options(config, max_restarts, min_nproc)
    spawned = not _under_torchrun() and (config.nproc > 1 or max_restarts > 0)
    callbacks = check_callbacks(callbacks, spawned=spawned)
    entry = own_entry_point(config.strategy)
    if entry is not None and callbacks:
        raise ConfigError(f"callbacks are not supported by --strategy {config.strategy}")
    if entry is not None:  # servers and workers: the strategy runs the whole job (ps)
        if max_restarts or min_nproc is not None:
            raise ConfigError(
                f"--max-restarts and --min-nproc are not supported by --strategy {config.strategy}"
                " (its servers checkpoint their shards; continue a run with --resume)"
            )
        run_dir = _choose_run_dir(config, resume)
        if resume:
            check_resume(config, run_dir)
        if not _under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
            _write_config(config, run_dir)
        summary = entry(config, run_dir, resume, job_tools())
        return summary if not _under_torchrun() or int(os.environ["RANK"]) == 0 else None
    if _under_torchrun():
        if restarted_by_torchrun():  # torchrun's agent restarted us: continue the run folder
            run_dir = _choose_run_dir(config, resume=True)
            resume = resume or has_checkpoint(run_dir)
        else:
            run_dir = _choose_run_dir(config, resume)
        if resume:
            check_resume(config, run_dir)
        checked = preflight_workload(config)  # --model / --data / --loss: opened, one forward
        _check_workload(run_dir, checked, resume)
        faults_from_env(config, int(os.environ["WORLD_SIZE"]))
        if int(os.environ.get("RANK", "0")) == 0:
            _write_config(config, run_dir)
            _write_workload(checked, run_dir)
        return train_worker(config, str(run_dir), resume, callbacks)
    check_visible_gpus(config.nproc)  # NCCL: one GPU per local rank, refused before any starts
    run_dir = _choose_run_dir(config, resume)
    if resume:
        check_resume(config, run_dir)
    checked = preflight_workload(config)  # --model / --data / --loss: opened, one forward
    _check_workload(run_dir, checked, resume)
    faults_from_env(config, config.nproc)  # a malformed TESSERA_FAULT fails here, once
    _write_config(config, run_dir)
    _write_workload(checked, run_dir)
    if config.nproc == 1 and max_restarts == 0:
        try:
            return train_worker(config, str(run_dir), resume, callbacks)
        finally:
            shutdown()
    return supervise(
        config,
        run_dir,
        resume,
        max_restarts=max_restarts,
        min_nproc=min_nproc,
        callbacks=callbacks,
    )


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
    if summary.get("sample_note"):
        console.print(summary["sample_note"])


def _engine_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    comm_share = summary["comm_s"] / summary["step_s"] if summary["step_s"] else 0.0
    rows = [
        ("steps (this run / total)", f"{summary['steps_this_run']} / {summary['steps']}"),
        ("loss (first -> last)", f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"),
        *[
            (f"{key.removesuffix('_per_s')}/s (median)", f"{summary[key]:,.0f}")
            for key in ("samples_per_s", "tokens_per_s")
            if summary.get(key) is not None
        ],
        ("step time (median)", f"{summary['step_s'] * 1e3:.1f} ms"),
        ("waiting for data (median)", f"{summary.get('data_s', 0.0) * 1e3:.1f} ms"),
        ("MFU (median)", f"{summary.get('mfu', float('nan')):.1%} of {summary.get('mfu_peak')}"),
        ("exposed communication", f"{summary['comm_s'] * 1e3:.1f} ms ({comm_share:.0%})"),
        ("peak memory per rank", ", ".join(f"{m:.0f} MB" for m in summary["peak_mem_mb"])),
        ("restarts", str(summary.get("restarts", 0))),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("run folder", summary["run_dir"]),
    ]
    if summary.get("val_loss") is not None:
        rows.insert(2, ("held-out loss (last evaluation)", f"{summary['val_loss']:.3f}"))
    if summary.get("stopped_at") is not None:
        rows.insert(1, ("stopped early", f"step {summary['stopped_at']}: {summary['stop_reason']}"))
    if summary.get("model_state_mb"):
        states = ", ".join(f"{m:.2f} MB" for m in summary["model_state_mb"])
        rows.insert(-2, ("model states per rank", states))
    return rows
