"""What rank 0 shows and logs besides metrics.jsonl: progress, and the --log-with loggers.

Progress (`--progress`, on by default): on a terminal, tqdm's bar; when stdout is not a
terminal (a log file, a pipe, a job scheduler's capture) one plain line per logged step
(`--log-every`) and per evaluation instead, since a bar's redraws would fill the file with
carriage returns. `--log-with` writes the records to TensorBoard, MLflow or W&B
(`tessera.train.loggers`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tessera.train.config import TrainConfig
from tessera.train.config_build import config_to_dict
from tessera.train.config_data import log_with_names
from tessera.train.loggers import open_loggers

__all__ = ["SCALARS", "Reporter", "plain_line"]

SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "epoch": "train/epoch",
    "val_loss": "eval/loss",
    "samples_per_s": "perf/samples_per_s",
    "tokens_per_s": "perf/tokens_per_s",
    "step_s": "perf/step_s",
    "data_s": "perf/data_s",
    "compute_s": "perf/compute_s",
    "comm_s": "perf/comm_s",
    "mfu": "perf/mfu",
}
"""Record fields written as TensorBoard scalars, and their tags, grouped as TensorBoard shows
them (train/, eval/, perf/; memory under memory/: see `_memory`)."""


def _rates(record: dict[str, Any]) -> list[tuple[str, float]]:
    """("samples/s", x) and, for token data, ("tokens/s", y): the record's names, spelled out."""
    names = (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"))
    return [(shown, record[key]) for key, shown in names if key in record]


def plain_line(record: dict[str, Any], steps: int, unit: str) -> str:
    """One step's progress as one line of text (`unit`: kept for callers; the record says)."""
    text = f"step {record['step']}/{steps} loss {record['loss']:.4f}"
    if "val_loss" in record:
        text += f" val_loss {record['val_loss']:.4f}"
    text += f" lr {record['lr']:.3g}"
    for shown, value in _rates(record):
        text += f" {shown} {value:,.0f}"
    if "data_s" in record:
        text += f" data_s {record['data_s']:.3f}"
    return text


def _memory(record: dict[str, Any]) -> dict[str, float]:
    """Peak memory and model states in MB: the largest rank's under the plain name (as the
    summary shows them) and, with several ranks, each rank's as `NAME/rank{r}` (ranks of a
    pipeline or of ZeRO with offload hold different amounts)."""
    found: dict[str, float] = {}
    for name in ("peak_mem_mb", "model_state_mb"):
        per_rank = record.get(name) or []
        if per_rank:
            found[f"memory/{name}"] = max(per_rank)
        if len(per_rank) > 1:
            found.update(
                {f"memory/{name}/rank{rank}": value for rank, value in enumerate(per_rank)}
            )
    return found


class Reporter:
    """Rank 0's progress display and TensorBoard writer for one run (`close` when done)."""

    def __init__(
        self, config: TrainConfig, run_dir: Path, start: int, unit: str, title: str
    ) -> None:
        self.steps, self.unit = config.steps, unit
        self.bar: Any = None
        self.plain = config.progress and not sys.stdout.isatty()
        if config.progress and not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(
                total=config.steps, initial=start, desc=title, unit="step", dynamic_ncols=True
            )
        self.writers = open_loggers(
            log_with_names(config.log_with), run_dir, start, config_to_dict(config)
        )

    def advance(self) -> None:
        """One step done."""
        if self.bar is not None:
            self.bar.update(1)

    def report(self, record: dict[str, Any]) -> None:
        """A record written to metrics.jsonl: show it and log it."""
        if self.bar is not None:
            shown = {"loss": f"{record['loss']:.3f}"}
            shown.update({name: f"{value:,.0f}" for name, value in _rates(record)})
            if "val_loss" in record:
                shown["val_loss"] = f"{record['val_loss']:.3f}"
            self.bar.set_postfix(shown)
        if self.plain:
            print(plain_line(record, self.steps, self.unit), flush=True)
        values = {tag: record[name] for name, tag in SCALARS.items() if name in record}
        for writer in self.writers:
            writer.log({**values, **_memory(record)}, record["step"])

    def close(self) -> None:
        """Close the bar; flush and close the event file."""
        if self.bar is not None:
            self.bar.close()
        for writer in self.writers:
            writer.close()
