"""Where `--log-with` sends each logged record besides metrics.jsonl: TensorBoard, MLflow, W&B.

Each is the library's own writer, into the run folder, needing no server or network:

- `tensorboard`: event files (`torch.utils.tensorboard`); a resumed run purges the steps past its
  checkpoint from the older files, as metrics.jsonl drops them;
- `mlflow`: a local file store `RUN/mlruns` (`mlflow ui --backend-store-uri RUN/mlruns`), or
  the server or database `MLFLOW_TRACKING_URI` names; one MLflow run per start of the job (a
  resume starts another, named like the first), the config as its parameters;
- `wandb`: a run under `RUN/wandb`, offline unless `WANDB_MODE` says otherwise (`wandb sync`
  uploads it later), the config as its config.

The tags are grouped (`train/loss`, `eval/loss`, `perf/samples_per_s`, ...:
`tessera.train.reporting.SCALARS`) for all three.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["open_loggers"]


class _TensorBoard:
    def __init__(self, run_dir: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or past it in earlier files are dropped (a resumed run logs
        # those steps again), as MetricsLog drops their lines
        self.writer = SummaryWriter(str(run_dir), purge_step=start + 1 if start else None)

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class _MLflow:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        # MLflow 3 keeps its file store only on request (its default wants a database, i.e.
        # SQLAlchemy, which mlflow-skinny lacks); MLFLOW_TRACKING_URI, if set, wins
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        store = (run_dir / "mlruns").resolve().as_uri()
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or store)
        mlflow.set_experiment("tessera")
        self.run = mlflow.start_run(run_name=run_dir.resolve().name)
        mlflow.log_params({k: str(v)[:500] for k, v in _flat(config).items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class _Wandb:
    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project="tessera",
            name=run_dir.resolve().name,
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def open_loggers(names: list[str], run_dir: Path, start: int, config: dict[str, Any]) -> list[Any]:
    """The writers of `names` (from `--log-with`), each with `log(values, step)` and `close()`."""
    writers: list[Any] = []
    for name in names:
        if name == "tensorboard":
            writers.append(_TensorBoard(run_dir, start))
        elif name == "mlflow":
            writers.append(_MLflow(run_dir, config))
        elif name == "wandb":
            writers.append(_Wandb(run_dir, config))
    return writers
