"""A run folder's checkpoints: one per saved step, complete or ignored, verified, pruned safely.

The folder-level rules are checked on files written by `checkpoint_series` itself, with the same
calls in the same order as the training loop (`begin_save`, write, `hash_share`, `commit`,
`prune`); the trainer-level ones (fallback to the previous checkpoint, refusal of another
config, older run folders) on one-process runs in this process. The `kill -9` moments of a real
save are in test_resume.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tessera.checkpoint import series
from tessera.errors import CheckpointError, ConfigError
from tessera.train import build_config, latest_checkpoint, load_checkpoint, run_training
from tessera.train.metrics import read_metrics
from tessera.train.resume import config_layers_for_resume


def _save(run_dir: Path, step: int, keep: int = 2, files: dict[str, bytes] | None = None) -> Path:
    """What the loop does on one rank, with `files` standing for the state and the shards."""
    partial = series.begin_save(run_dir, step)
    files = files or {"state.pt": b"state %d" % step, "zero/rank-00000-of-00001.pt": b"shard"}
    for name, data in files.items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(data)
    shares = [series.hash_share(partial, rank, 2) for rank in range(2)]  # two ranks' shares
    folder = series.commit(partial, step, {k: v for s in shares for k, v in s.items()})
    series.prune(run_dir, keep)
    return folder


def _steps(run_dir: Path) -> list[int]:
    return [series.checkpoint_step(f) for f in series.complete_checkpoints(run_dir)]


def test_each_step_is_kept_until_newer_ones_are_complete(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=2)
    assert _steps(tmp_path) == [30, 20]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints/step-00000030/state.pt"
    assert series.checkpoint_step(latest_checkpoint(tmp_path)) == 30
    # A save killed after writing every file and even its manifest, before the rename: the
    # folder is not complete, is never read, and does not count against --keep-checkpoints.
    partial = series.begin_save(tmp_path, 40)
    (partial / "state.pt").write_bytes(b"state 40")
    series.write_atomically(partial / series.MANIFEST_FILE, lambda f: f.write(b"{}"))
    assert latest_checkpoint(tmp_path).parent.name == "step-00000030"
    assert _steps(tmp_path) == [30, 20]
    # The next save clears it (and any temporary file of a killed atomic write) first.
    (tmp_path / "checkpoints/.manifest.json.1234.tmp").write_bytes(b"half")
    _save(tmp_path, 40, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000040"]


def test_a_checkpoint_that_fails_its_checksum_gives_way_to_the_previous_one(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    shard = newest / "zero/rank-00000-of-00001.pt"
    shard.write_bytes(b"shaRd")  # same size, one byte flipped
    with pytest.warns(RuntimeWarning, match=f"{shard}.* checksum mismatch"):
        assert latest_checkpoint(tmp_path).parent.name == "step-00000001"
    shard.write_bytes(b"sha")
    with pytest.warns(RuntimeWarning, match=f"{shard} is truncated: 3 bytes, the manifest says 5"):
        assert latest_checkpoint(tmp_path).parent.name == "step-00000001"
    shard.unlink()
    with pytest.warns(RuntimeWarning, match=f"{shard} is missing"):
        series.latest_checkpoint(tmp_path)
    shard.write_bytes(b"shard")
    (newest / "stray.pt").write_bytes(b"")  # a checkpoint is exactly what its manifest lists
    with pytest.raises(CheckpointError, match=r"does not list: \['stray.pt'\]"):
        series.verify(newest)
    (newest / "stray.pt").unlink()
    assert latest_checkpoint(tmp_path).parent.name == "step-00000002"
    (tmp_path / "checkpoints/step-00000001/state.pt").write_bytes(b"state 9")
    with pytest.warns(RuntimeWarning) as caught:
        (newest / "state.pt").write_bytes(b"state 8")
        assert latest_checkpoint(tmp_path) is None  # no verified checkpoint: nothing to resume
    assert len(caught) == 2


def _rot(folder: Path) -> None:
    """Flip one byte of a checkpoint's state file (same size: only the checksum can tell)."""
    state = folder / "state.pt"
    data = bytearray(state.read_bytes())
    data[0] ^= 1
    state.write_bytes(bytes(data))


def test_prune_counts_only_checkpoints_that_verify(tmp_path):
    # An earlier run saved up to step 30, whose checkpoint then rotted; the resumed run went on
    # from step 20 and now commits step 25 with keep=1. Step 30 must not take step 25's place.
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=3)
    _rot(tmp_path / "checkpoints/step-00000030")
    _save(tmp_path, 25, keep=1)
    assert _steps(tmp_path) == [30, 25]  # the rotten one stays, uncounted; 20 and 10 went
    with pytest.warns(RuntimeWarning, match="step-00000030.* checksum mismatch"):
        assert latest_checkpoint(tmp_path).parent.name == "step-00000025"
    # keep=2 keeps the two newest that verify; a rotten one between them is not counted either.
    _save(tmp_path, 26, keep=2)
    _rot(tmp_path / "checkpoints/step-00000026")
    _save(tmp_path, 27, keep=2)
    assert _steps(tmp_path) == [30, 27, 26, 25]
    _save(tmp_path, 28, keep=2)  # older than the oldest kept: deleted, verified or not
    assert _steps(tmp_path) == [30, 28, 27]
    # Saving the rotten step again replaces it, and it counts from then on.
    _save(tmp_path, 30, keep=2)
    assert _steps(tmp_path) == [30, 28]
    assert series.verify(tmp_path / "checkpoints/step-00000030")["step"] == 30


def test_the_old_format_checkpoint_stays_until_keep_new_ones_verify(tmp_path):
    # A run folder of the legacy layout: checkpoint.pt and its ZeRO shard folder zero/.
    legacy = tmp_path / series.LEGACY_CHECKPOINT
    legacy.write_bytes(b"legacy checkpoint")
    (tmp_path / "zero/step-00000004").mkdir(parents=True)
    (tmp_path / "zero/step-00000004/rank-0.pt").write_bytes(b"legacy shard")
    _save(tmp_path, 5, keep=2)
    assert legacy.is_file() and (tmp_path / "zero/step-00000004/rank-0.pt").is_file()
    _rot(tmp_path / "checkpoints/step-00000005")  # two new checkpoints, one of them verifies
    _save(tmp_path, 6, keep=2)
    assert legacy.is_file() and (tmp_path / "zero").is_dir()
    _save(tmp_path, 7, keep=2)  # two verified ones now: the legacy checkpoint goes, shards too
    assert not legacy.exists() and not (tmp_path / "zero").exists()
    assert _steps(tmp_path) == [7, 6]


def test_every_hashed_share_is_needed_and_keep_must_be_positive(tmp_path):
    partial = series.begin_save(tmp_path, 5)
    for name in ("state.pt", "zero/a", "zero/b"):
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_bytes(name.encode())
    only_rank_0 = series.hash_share(partial, 0, 2)
    assert sorted(only_rank_0) == ["state.pt", "zero/b"]
    with pytest.raises(CheckpointError, match=r"\['zero/a'\] were written but not hashed"):
        series.commit(partial, 5, only_rank_0)
    assert not series.has_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="keep must be at least 1"):
        series.prune(tmp_path, 0)
    with pytest.raises(ConfigError, match="keep_checkpoints must be at least 1, got 0"):
        build_config({"keep_checkpoints": 0, "nproc": 1, "strategy": "single"})


TINY: dict[str, Any] = {
    "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16, "dropout": 0.1},
    "batch_size": 4,
    "corpus_bytes": 20_000,
    "sample_tokens": 0,
    "progress": False,
    "warmup_steps": 1,
    "strategy": "single",
    "nproc": 1,
    "checkpoint_every": 1,
}
"""Dropout on: a resumed run restores the random state too, so runs compare bit for bit."""


def _train(out: Path, steps: int, **changes: Any) -> None:
    run_training(build_config(TINY, {"steps": steps, "out": str(out), **changes}))


def _resume(out: Path, steps: int, **changes: Any) -> None:
    """What `tessera train --resume OUT --steps N [--flag value...]` does."""
    layers = config_layers_for_resume(out)
    run_training(build_config(layers, {"steps": steps, "out": str(out), **changes}), resume=True)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(out))["engine"]


def test_the_trainer_resumes_from_the_newest_verified_checkpoint_or_refuses(tmp_path):
    _train(tmp_path / "straight", 4)
    _train(tmp_path / "r", 3, keep_checkpoints=2)
    assert _steps(tmp_path / "r") == [3, 2]
    # A run folder as tessera wrote it before per-step checkpoints: one checkpoint.pt beside
    # config.yaml (here step 2's state file, which has the same content).
    (tmp_path / "old").mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(tmp_path / "r" / name, tmp_path / "old" / name)
    shutil.copy(tmp_path / "r/checkpoints/step-00000002/state.pt", tmp_path / "old/checkpoint.pt")
    assert latest_checkpoint(tmp_path / "old") == tmp_path / "old/checkpoint.pt"
    assert series.checkpoint_step(tmp_path / "old/checkpoint.pt") == 2

    # Step 3's state file rots on disk: the resume warns naming it, continues from step 2,
    # and ends on the very parameters and optimizer state of the uninterrupted run.
    rotten = tmp_path / "r/checkpoints/step-00000003/state.pt"
    data = bytearray(rotten.read_bytes())
    data[len(data) // 2] ^= 1
    rotten.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=f"{rotten} is corrupt: checksum mismatch"):
        _resume(tmp_path / "r", 4)
    # The old run was killed in the middle of a metrics line: the resume drops it, says so.
    with (tmp_path / "old/metrics.jsonl").open("a") as file:
        file.write('{"step": 3, "lo')
    with pytest.warns(RuntimeWarning, match="metrics.jsonl:4: dropping a line"):
        _resume(tmp_path / "old", 4)
    straight = _weights(tmp_path / "straight")
    for run in ("r", "old"):
        assert [r["step"] for r in read_metrics(tmp_path / run / "metrics.jsonl")] == [1, 2, 3, 4]
        resumed = _weights(tmp_path / run)
        for key, value in straight["model"].items():
            assert torch.equal(resumed["model"][key], value), (run, key)
        for index, state in straight["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(resumed["optimizer"]["state"][index][name], value), (run, name)
    # The rotten step 3 was written again by the resumed run, and pruned with --keep 2; the
    # old folder's new checkpoints are in the new layout, and replace its checkpoint.pt.
    assert _steps(tmp_path / "r") == [4, 3]
    assert latest_checkpoint(tmp_path / "old").parent.name == "step-00000004"
    assert not (tmp_path / "old/checkpoint.pt").exists()  # pruned as the oldest of three

    # Another config is refused, before anything runs, naming every differing key; the keys
    # that do not change what a step computes may change.
    with pytest.raises(ConfigError) as refused:
        _resume(tmp_path / "r", 6, lr=0.1, seed=3, model={"dropout": 0.0}, log_every=2)
    message = str(refused.value)
    assert "differing keys: lr (0.003 -> 0.1), model.dropout (0.1 -> 0.0), seed (0 -> 3)" in message
    assert "log_every" not in message.split("Only")[0]
    assert _steps(tmp_path / "r") == [4, 3]
