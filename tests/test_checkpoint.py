"""Checkpoints: plain torch.save files, old headed ones still read, bad files refused, commits."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

from tessera.errors import CheckpointError
from tessera.train import load_checkpoint, save_checkpoint


def _state() -> dict:
    return {"step": 7, "weights": torch.arange(10.0), "nested": {"names": ["a", "b"]}}


def _headed(state: dict) -> bytes:
    """A checkpoint as tessera wrote it before state.pt became a plain torch.save file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return (
        b"TSRACKP1"
        + hashlib.sha256(payload).digest()
        + len(payload).to_bytes(8, "little")
        + (payload)
    )


def test_round_trip(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", _state())
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and loaded["nested"] == {"names": ["a", "b"]}
    assert torch.equal(loaded["weights"], torch.arange(10.0))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left


def test_a_checkpoint_is_a_plain_torch_save_file(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", _state())
    for weights_only in (False, True):
        loaded = torch.load(path, weights_only=weights_only)
        assert loaded["step"] == 7 and torch.equal(loaded["weights"], torch.arange(10.0))
    torch.save(_state(), tmp_path / "theirs.pt")  # and a torch.save file is a checkpoint
    assert load_checkpoint(tmp_path / "theirs.pt")["step"] == 7


def test_old_headed_checkpoints_still_load(tmp_path):
    path = tmp_path / "old.pt"
    path.write_bytes(_headed(_state()))
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["weights"], torch.arange(10.0))


def test_truncated_checkpoint_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", _state())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(path)
    path.write_bytes(_headed(_state())[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_corrupt_old_checkpoint_is_refused(tmp_path):
    path = tmp_path / "old.pt"
    data = bytearray(_headed(_state()))
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(path)


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", _state())
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        save_checkpoint(path, {"unpicklable": lambda: None})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_a_shard_folder_is_replaced_whole(tmp_path):
    from tessera.zero.checkpoint import _replace_folder

    target, new = tmp_path / "step", tmp_path / ".step.partial"
    target.mkdir()
    (target / "rank-00000-of-00004.pt").write_text("old save")
    new.mkdir()
    (new / "rank-00000-of-00002.pt").write_text("new save")
    _replace_folder(new, target)
    assert [p.name for p in target.iterdir()] == ["rank-00000-of-00002.pt"]  # no stray shard
    assert [p.name for p in tmp_path.iterdir()] == ["step"]  # neither .partial nor .old remain
