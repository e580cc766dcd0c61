"""`--log-with mlflow` and `--log-with wandb`: each record reaches the library's own store in the
run folder, under the grouped tags, read back through the library. Skipped where the optional
extra is not installed (pip install 'tessera[mlflow]' / 'tessera[wandb]')."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

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


def _wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run's `.wandb` file: a LevelDB-format log (7-byte header,
    32 KiB blocks of records: crc u32, length u16, type u8, payload; a record split over blocks
    as FIRST, MIDDLE..., LAST) of wandb's `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos = path.read_bytes(), 32768, 7
    payloads, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            payloads.append(pending)
            pending = b""
    rows = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            rows.append({**row, "step": record.history.step.num})
    return rows


def test_wandb_runs_offline_in_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_training(build_config(BASE, {"out": str(tmp_path), "log_with": "wandb"}))
    records = read_metrics(tmp_path / "metrics.jsonl")
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _wandb_history(path)
    assert [(r["step"], r["train/loss"]) for r in rows] == [
        (r["step"], pytest.approx(r["loss"])) for r in records
    ]
    assert [r["eval/loss"] for r in rows if "eval/loss" in r] == [
        pytest.approx(r["val_loss"]) for r in records if "val_loss" in r
    ]
