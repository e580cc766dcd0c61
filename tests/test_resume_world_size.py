"""Resume on another number of ranks: ZeRO reshards and keeps the global batch; others refuse.

A ZeRO-2 run saved on 2 ranks continues on 1: the batch of a step is the same global batch
(split by the new world size), so the run is the same training, differing from one that never
changed world size only by the order of float32 sums. Both halves are therefore measured against
the plain loop of test_trainer_oracle.py in float32 and float64 (tests/_tolerance.py): the first
k steps average two half-batch means, the last k take one mean; each is a reordering of the
oracle's float32 operations, which FACTOR bounds. That the reshard itself moves every value
exactly (torch.equal) is test_zero_resume.py::test_resharding_two_ranks_to_one_loads_every_
state_exactly_and_continues. SGD with momentum, not AdamW: Adam turns reordering noise in
zero-gradient parameters into full-size updates (DESIGN.md, Testing).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from _tolerance import check_close
from safetensors.torch import load_file
from test_trainer_oracle import oracle_run  # tests/ is on sys.path under pytest

from tessera.errors import ConfigError
from tessera.train import TrainConfig, build_config, run_training
from tessera.train.config_build import config_to_dict
from tessera.train.loop import train_worker
from tessera.train.metrics import read_metrics
from tessera.train.resume import config_layers_for_resume
from tessera.train.resume_rules import WORLD_SIZE_FREE_STRATEGIES, check_resume_world
from tessera.zero import consolidate

K = 2
TINY: dict[str, Any] = {
    "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
    "batch_size": 4,
    "corpus_bytes": 20_000,
    "sample_tokens": 0,
    "progress": False,
    "optimizer": "sgd",
    "lr": 0.05,
    "warmup_steps": 0,
    "checkpoint_every": K,
}


def _config(out: Path) -> TrainConfig:
    layers = {"strategy": "zero2", "bucket_cap_mb": 0.001, "nproc": 2, "steps": K}
    return build_config(TINY, layers, {"out": str(out)})


def _resume(out: Path, nproc: int) -> None:
    layers = config_layers_for_resume(out)
    config = build_config(layers, {"steps": 2 * K, "nproc": nproc, "out": str(out)})
    run_training(config, resume=True)


def test_zero2_saved_on_two_ranks_continues_on_one_and_local_sgd_refuses(run_ranks, tmp_path):
    out = tmp_path / "zero2"
    out.mkdir()  # with the config.yaml `tessera train` writes before starting ranks
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(_config(out))))
    run_ranks(train_worker, 2, _config(out), str(out), False)
    # The same files under another strategy's name: local-sgd keeps one replica per rank, so
    # it is refused before any rank starts (only config.yaml and the manifest are read).
    shutil.copytree(out, tmp_path / "local-sgd")
    saved = yaml.safe_load((out / "config.yaml").read_text())
    saved["strategy"] = "local-sgd"
    (tmp_path / "local-sgd/config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError) as refused:
        _resume(tmp_path / "local-sgd", 1)
    assert "cannot resume a local-sgd checkpoint saved on 2 ranks on 1 ranks" in str(refused.value)
    assert "one model replica per rank" in str(refused.value)
    assert len(read_metrics(tmp_path / "local-sgd/metrics.jsonl")) == K  # nothing ran

    _resume(tmp_path / "zero2", 1)
    losses = [r["loss"] for r in read_metrics(tmp_path / "zero2/metrics.jsonl")]
    assert len(losses) == 2 * K
    consolidate(tmp_path / "zero2", tmp_path / "final.safetensors")
    final = load_file(str(tmp_path / "final.safetensors"))
    config = build_config(TINY, {"strategy": "single", "nproc": 1, "steps": 2 * K})
    oracle, exact = oracle_run(config, "fp32"), oracle_run(config, "fp64")
    assert final.keys() == exact["state"].keys()
    check_close(final, oracle["state"], exact["state"], what="zero2 saved on 2, resumed on 1")
    check_close(losses, oracle["losses"], exact["losses"], what="losses across the resume")


@pytest.mark.parametrize("strategy", ["local-sgd", "pipeline", "tensor", "hybrid"])
def test_strategies_split_by_rank_refuse_another_world_size(strategy):
    check_resume_world(strategy, 2, 2)  # the same world size always resumes
    with pytest.raises(ConfigError, match=f"{strategy} checkpoint saved on 4 ranks on 2 ranks"):
        check_resume_world(strategy, 4, 2)
    for free in sorted(WORLD_SIZE_FREE_STRATEGIES):
        check_resume_world(free, 4, 2)
