"""Sharded ZeRO checkpoints: consolidation, resharding 4 -> 2 ranks, refusal, the trainer."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from test_trainer_oracle import oracle_run  # tests/ is on sys.path under pytest

import tessera
from tessera.errors import CheckpointError
from tessera.models import GPT, GPTConfig
from tessera.train import build_config, latest_checkpoint, load_checkpoint, run_training
from tessera.train.metrics import read_metrics
from tessera.zero import consolidate, full_state_dict, initialize, load_shards, save_shard

CONFIG = GPTConfig(vocab_size=19, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _model(config: GPTConfig = CONFIG) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 19, (12, 9), generator=torch.Generator().manual_seed(step))
    return idx[:, :-1], idx[:, 1:]


def _loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _steps(model, opt, steps: range, rank: int, world: int) -> None:
    for step in steps:
        x, y = (t.tensor_split(world)[rank] for t in _batch(step))
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()


def _save_on_four(folder: str) -> dict:
    ctx = tessera.init()
    model, opt = initialize(_model(), torch.optim.SGD, stage=3, lr=0.1, momentum=0.9)
    _steps(model, opt, range(3), ctx.rank, ctx.world_size)
    save_shard(folder, opt)
    return full_state_dict(model)


def _resume_on_two(folder: str) -> dict:
    ctx = tessera.init()
    found = {}
    other = _model(GPTConfig(vocab_size=19, block_size=8, n_layer=2, n_head=2, n_embd=24))
    before = [p.detach().clone() for p in other.parameters()]
    _, wrong = initialize(other, torch.optim.SGD, stage=2, lr=0.1, momentum=0.9)
    try:
        load_shards(wrong, folder)
    except CheckpointError as exc:
        found["refused"] = str(exc)
    found["untouched"] = all(torch.equal(a.float(), b) for a, b in zip(other.parameters(), before))
    wrong.remove_hooks()
    model, opt = initialize(_model(), torch.optim.SGD, stage=2, lr=0.1, momentum=0.9)
    load_shards(opt, folder)
    found["loaded"] = full_state_dict(model)
    _steps(model, opt, range(3, 6), ctx.rank, ctx.world_size)
    found["final"] = full_state_dict(model)
    return found


def test_shards_consolidate_and_reshard_from_four_ranks_to_two(run_ranks, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    saved = run_ranks(_save_on_four, 4, str(tmp_path / "shards"))[0]
    out = consolidate(tmp_path / "shards", tmp_path / "model.safetensors")
    plain = safetensors.load_file(str(out))  # no tessera involved in reading it
    fresh = GPT(CONFIG)
    fresh.load_state_dict(plain)  # tied head and embedding: both keys, same values
    assert plain.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(plain[key], value), key
    x, _ = _batch(0)
    reference = _model()
    reference.load_state_dict(saved)
    assert torch.equal(fresh(x), reference(x))

    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "shards", broken)
    data = bytearray((broken / "rank-00001-of-00004.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (broken / "rank-00001-of-00004.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-00001-of-00004.safetensors is corrupt"):
        consolidate(broken, tmp_path / "never.safetensors")
    (broken / "rank-00002-of-00004.pt").unlink()
    with pytest.raises(CheckpointError, match=r"shard files of ranks \[2\] \(of 4\) are missing"):
        consolidate(broken, tmp_path / "never.safetensors")
    assert not (tmp_path / "never.safetensors").exists()

    found = run_ranks(_resume_on_two, 2, str(tmp_path / "shards"))[0]
    assert "another model: parameter 'blocks.0.attn.proj.bias' has shape [16]" in found["refused"]
    assert found["untouched"]  # refused whole: nothing partially loaded
    for key, value in saved.items():
        assert torch.equal(found["loaded"][key], value), key
    # One process, six steps on the whole batch, SGD with momentum, in float32 and float64:
    # 4 then 2 ranks average in other orders than one process, float32 rounding only.
    oracles = []
    for dtype in (torch.float32, torch.float64):
        model = _model().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _steps(model, opt, range(6), 0, 1)
        oracles.append(model.state_dict())
    final = {key: found["final"][key] for key in oracles[1]}
    check_close(final, *oracles, what="ZeRO-3 saved on 4 ranks, resumed on 2")


TINY = {
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
    "batch_size": 8,
    "corpus_bytes": 50_000,
    "sample_tokens": 0,
    "progress": False,
    "optimizer": "sgd",
    "lr": 0.05,
    "warmup_steps": 0,
    "checkpoint_every": 4,
}


def test_trainer_zero3_equals_one_process_and_resumes_from_four_ranks_on_two(tmp_path):
    def train(out: str, steps: int, **extra) -> None:
        run_training(build_config(TINY, {"steps": steps, "out": str(tmp_path / out), **extra}))

    train("single", 8, strategy="single", nproc=1)
    train("split", 4, strategy="zero3", nproc=4)
    layers = {**TINY, "steps": 8, "strategy": "zero3", "nproc": 2, "out": str(tmp_path / "split")}
    run_training(build_config(layers), resume=True)
    losses = {
        run: torch.tensor([r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl")])
        for run in ("single", "split")
    }
    assert len(losses["split"]) == 8
    # Sums over 1, 4 then 2 ranks differ in float32 rounding only (gradient clipping included):
    # both runs against the plain loop of test_trainer_oracle.py in float32 and float64.
    config = build_config(TINY, {"steps": 8, "strategy": "single", "nproc": 1})
    oracle, exact = oracle_run(config, "fp32"), oracle_run(config, "fp64")
    for run in ("single", "split"):
        check_close(losses[run].tolist(), oracle["losses"], exact["losses"], what=f"{run} losses")
    result = subprocess.run(
        [sys.executable, "-m", "tessera", "checkpoint", "consolidate", "split", "out.safetensors"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    merged = load_file(str(tmp_path / "out.safetensors"))
    single = load_checkpoint(latest_checkpoint(tmp_path / "single"))["engine"]["model"]
    assert merged.keys() == single.keys()
    assert exact["state"].keys() == single.keys()
    check_close(merged, oracle["state"], exact["state"], what="consolidated ZeRO-3 weights")
    assert latest_checkpoint(tmp_path / "split").parent.name == "step-00000008"
