"""`tessera train --strategy pipeline`: equal to one process, and resumable from its checkpoint."""

from __future__ import annotations

import pytest
import torch

from tessera.train import build_config, load_checkpoint, run_training

TINY = {
    "model": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32},
    "batch_size": 8,
    "corpus_bytes": 50_000,
    "sample_tokens": 0,
    "progress": False,
    "optimizer": "sgd",  # attention key biases: see DESIGN.md, Testing
    "lr": 0.05,
    "warmup_steps": 0,
}


def _params(run_dir):
    return load_checkpoint(run_dir / "checkpoint.pt")["engine"]["model"]


@pytest.mark.slow
def test_pipeline_strategy_trains_and_resumes_like_one_process(tmp_path):
    run_training(
        build_config(
            {**TINY, "steps": 4}, {"strategy": "single", "nproc": 1, "out": str(tmp_path / "a")}
        )
    )
    split = {"strategy": "pipeline", "nproc": 2, "out": str(tmp_path / "b")}
    run_training(build_config({**TINY, "steps": 2, "checkpoint_every": 2}, split))
    state = load_checkpoint(tmp_path / "b/checkpoint.pt")["engine"]
    assert len(state["optimizer"]) == 2  # each stage's optimizer state, by rank
    run_training(build_config({**TINY, "steps": 4}, split), resume=True)
    single, pipeline = _params(tmp_path / "a"), _params(tmp_path / "b")
    assert single.keys() == pipeline.keys()
    for name in single:
        # micro-batch accumulation and the tied-embedding sum reorder float32 additions
        torch.testing.assert_close(pipeline[name], single[name], rtol=1e-5, atol=1e-6, msg=name)
