"""`--log-with mlflow` and `--log-with wandb`: each record reaches the library's own store in the
run folder, under the grouped tags, read back through the library. Skipped where the optional
extra is not installed (pip install 'tessera[mlflow]' / 'tessera[wandb]')."""

from __future__ import annotations

import json

import pytest

from tessera.train import run_training
from tessera.train.config_build import build_config
from tessera.train.metrics import read_metrics

BASE = {
    "strategy": "single", "nproc": 1, "steps": 3, "batch_size": 4, "corpus_bytes": 20_000,
    "sample_tokens": 0, "progress": False, "checkpoint_every": 0, "eval_every": 2,
    "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
}  # fmt: skip


def test_mlflow_gets_every_record_in_a_local_store(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    run_training(build_config(BASE, {"out": str(tmp_path), "log_with": "mlflow"}))
    records = read_metrics(tmp_path / "metrics.jsonl")
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs(client.get_experiment_by_name("tessera").experiment_id)
    losses = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"])) for r in records]
    evals = client.get_metric_history(run.info.run_id, "eval/loss")
    assert [(m.step, m.value) for m in evals] == [
        (r["step"], pytest.approx(r["val_loss"])) for r in records if "val_loss" in r
    ]
    assert run.data.params["steps"] == "3"
    assert len(client.get_metric_history(run.info.run_id, "perf/tokens_per_s")) == 3


def test_wandb_runs_offline_in_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_training(build_config(BASE, {"out": str(tmp_path), "log_with": "wandb"}))
    records = read_metrics(tmp_path / "metrics.jsonl")
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    summary = json.loads((folder / "files" / "wandb-summary.json").read_text())
    assert summary["train/loss"] == pytest.approx(records[-1]["loss"])
    assert summary["eval/loss"] == pytest.approx(records[-1]["val_loss"])
    assert summary["_step"] == 3
