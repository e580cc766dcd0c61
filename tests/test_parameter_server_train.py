"""`tessera train --strategy ps`: the reference GPT trained by servers and workers.

Two runs of the command (each spawns 1 server + 2 workers): 4 BSP steps straight, and a run
resumed from the straight run's server checkpoints after step 2, as a crashed run would be. The
straight run is checked against a plain PyTorch loop written here (the global batch, AdamW, the
warmup schedule), its folder and summary table; the resumed run must end bit for bit where the
straight one did (parameters, the servers' AdamW state, each gradient's loss).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from _tolerance import check_close

from tessera.cli import main
from tessera.data import CharTokenizer, LMBatches, load_corpus
from tessera.errors import ConfigError
from tessera.models import GPT, GPTConfig
from tessera.parameter_server.options import parse_slow_workers, ps_policy
from tessera.parameter_server.policy import ASP, BSP, SSP
from tessera.strategies.ps import SERVERS_FOLDER, _server_optimizer
from tessera.strategies.registry import OWN_ENTRY_POINTS, own_entry_point, strategy_names
from tessera.train import build_config, load_checkpoint, run_training
from tessera.train.run import job_tools

STEPS, SPLIT, WORKERS, SERVERS = 4, 2, 2, 1
TINY = {
    "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16, "dropout": 0.0},
    "batch_size": 4,
    "corpus_bytes": 20_000,
    "sample_tokens": 5,
    "progress": False,
    "optimizer": "adamw",
    "lr": 1e-2,
    "warmup_steps": 2,
    "decay_steps": 0,
    "grad_clip": 0.0,
    "weight_decay": 0.1,
    "seed": 3,
}
FLAGS = [
    "--strategy",
    "ps",
    "--servers",
    str(SERVERS),
    "--workers",
    str(WORKERS),
    "--consistency",
    "bsp",
    "--checkpoint-every",
    str(SPLIT),
]


def _oracle(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Synchronous training written out: the whole global batch, AdamW, linear warmup."""
    text = load_corpus("stdlib", max_bytes=TINY["corpus_bytes"])
    tokenizer = CharTokenizer.from_text(text)
    batches = LMBatches(
        tokenizer.encode_tensor(text), block_size=16, global_batch_size=4, seed=TINY["seed"]
    )
    torch.manual_seed(TINY["seed"])
    model = GPT(
        GPTConfig(
            vocab_size=tokenizer.vocab_size,
            n_layer=1,
            n_embd=16,
            n_head=2,
            block_size=16,
            dropout=0.0,
        )
    ).to(dtype)
    # the trainer's AdamW decays matrices and embeddings only, not biases and norm gains
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        groups, lr=TINY["lr"], betas=(0.9, 0.95), weight_decay=TINY["weight_decay"]
    )
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = TINY["lr"] * min(1.0, (step + 1) / TINY["warmup_steps"])
        x, y = batches.batch(step)
        model.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _gradient_losses(run_dir: Path) -> dict[tuple[int, int], float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["worker"], r["clock"]): r["loss"] for r in lines if r["kind"] == "gradient"}


def test_tessera_train_ps_matches_synchronous_training_and_resumes_bit_for_bit(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    straight = tmp_path / "straight"
    assert (
        main(
            [
                "train",
                "--config",
                str(config),
                *FLAGS,
                "--steps",
                str(STEPS),
                "--out",
                str(straight),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "tessera train: ps on 3 ranks" in table and "total updates/s" in table
    assert "1 / 2 / BSP()" in table and "0: 8" in table  # 8 gradients, all of staleness 0

    # Synchronous data parallelism, as the plain loop computes it.
    weights = load_checkpoint(straight / "checkpoint.pt")["engine"]["model"]
    assert torch.equal(weights["lm_head.weight"], weights["wte.weight"])  # tied, served once
    check_close(weights, _oracle(torch.float32), _oracle(torch.float64), what="ps vs loop")

    # The run folder: metrics (every gradient, each worker, the histogram), plots, sample.
    lines = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["gradient"] * 8 + ["worker"] * 2 + ["staleness_histogram"]
    assert all(r["updates_per_s"] > 0 and r["wait_s"] >= 0 for r in lines if r["kind"] == "worker")
    assert lines[-1]["counts"] == {"0": 8}
    for name in ("loss.png", "metrics.png", "sample.txt", "config.yaml"):
        assert (straight / name).stat().st_size > 0, name

    # A run that crashed after step 2: its server checkpoints of clock 2, its log up to there.
    crashed = tmp_path / "crashed"
    for server in range(SERVERS):
        shard = f"{SERVERS_FOLDER}/server-{server}/applied-{SPLIT * WORKERS:010d}.pt"
        (crashed / shard).parent.mkdir(parents=True)
        shutil.copy(straight / shard, crashed / shard)
    shutil.copy(straight / "config.yaml", crashed / "config.yaml")
    shutil.copy(straight / "checkpoint.pt", crashed / "checkpoint.pt")
    (crashed / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n" for r in lines if r["kind"] == "gradient" and r["clock"] < SPLIT
        )
    )
    assert main(["train", "--resume", str(crashed), "--steps", str(STEPS)]) == 0
    capsys.readouterr()

    assert _gradient_losses(crashed) == _gradient_losses(straight)
    final = f"applied-{STEPS * WORKERS:010d}.pt"
    for server in range(SERVERS):  # parameters, AdamW state, clocks: bit for bit
        ours = torch.load(crashed / SERVERS_FOLDER / f"server-{server}" / final)
        theirs = torch.load(straight / SERVERS_FOLDER / f"server-{server}" / final)
        assert ours.keys() == theirs.keys()
        for piece, other in zip(ours["pieces"], theirs["pieces"], strict=True):
            assert torch.equal(piece, other)
        for key, state in theirs["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(ours["optimizer"]["state"][key][name], value), (key, name)
        assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
        assert ours["clocks"] == theirs["clocks"] == [STEPS] * WORKERS
    resumed = load_checkpoint(crashed / "checkpoint.pt")
    assert resumed["step"] == STEPS
    assert all(torch.equal(resumed["engine"]["model"][k], v) for k, v in weights.items())

    # Starting afresh over server checkpoints, without --resume, is refused.
    with pytest.raises(ConfigError, match="holds the server checkpoints of an earlier run"):
        own_entry_point("ps")(
            build_config(TINY, {"strategy": "ps", "out": str(crashed)}),
            tmp_path / "crashed",
            False,
            job_tools(),
        )


def test_the_server_optimizer_follows_the_schedule_by_clock():
    config = build_config(TINY, {"strategy": "ps", "workers": 2, "warmup_steps": 4})
    lr = TINY["lr"]
    expected_by_clock = [lr * (c + 1) / 4 for c in range(4)] + [lr] * 2
    for per_gradient, lrs in (
        (False, expected_by_clock),  # BSP: one step per clock
        # ASP/SSP: two steps (W = 2) per clock, each with AdamW's lr / W
        (True, [x / 2 for x in expected_by_clock for _ in range(2)]),
    ):
        param = torch.zeros(3, requires_grad=True)
        optimizer = _server_optimizer(config, job_tools(), per_gradient, [param])
        seen = []
        for _ in lrs:
            param.grad = torch.ones(3)
            optimizer.step()
            seen.append(optimizer.param_groups[0]["lr"])
        assert seen == pytest.approx(lrs, rel=1e-12)
        again = _server_optimizer(config, job_tools(), per_gradient, [param])
        again.load_state_dict(optimizer.state_dict())  # a restored server continues the count
        param.grad = torch.ones(3)
        again.step()
        assert again.param_groups[0]["lr"] == pytest.approx(lr / (2 if per_gradient else 1))
    sgd = _server_optimizer(
        build_config(TINY, {"strategy": "ps", "optimizer": "sgd"}),
        job_tools(),
        True,
        [torch.zeros(1, requires_grad=True)],
    )
    sgd.param_groups[0]["params"][0].grad = torch.ones(1)
    sgd.step()  # SGD's gradient is already scaled by 1/W on the server: no lr scaling
    assert sgd.param_groups[0]["lr"] == pytest.approx(lr / 2)  # warmup 2: clock 0 -> lr / 2


def test_ps_options_are_checked_before_anything_starts(monkeypatch):
    def config(**values):
        return build_config(TINY, {"strategy": "ps", **values})

    assert "ps" in OWN_ENTRY_POINTS and "ps" not in strategy_names()  # not an Engine
    assert config(nproc=7).workers == 2  # nproc does not count: servers + workers processes
    assert ps_policy("ssp", 3) == SSP(3) and ps_policy("asp", 3) == ASP()
    assert ps_policy("BSP", 0) == BSP()
    assert parse_slow_workers("1:3, 0:1.5", 2) == {1: 3.0, 0: 1.5}
    for values, message in [
        ({"servers": 0}, "servers must be at least 1 for strategy ps, got 0"),
        ({"workers": 0}, "workers must be at least 1"),
        ({"consistency": "eventual"}, "unknown consistency 'eventual'"),
        ({"staleness": -1}, "staleness must be an integer >= 0, got -1"),
        ({"slow_worker": "2:3"}, "slow_worker '2:3': expected WORKER:FACTOR with WORKER in 0..1"),
        ({"slow_worker": "1:0.5"}, "FACTOR >= 1"),
        ({"slow_worker": "1"}, "expected WORKER:FACTOR"),
        ({"workers": 3}, r"batch_size \(4\) must be divisible by workers \(3\)"),
        ({"strategy": "pss"}, "unknown strategy 'pss'; choose one of .*'ps'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config(**values)
    # The supervisor restarts engines' ranks; ps has its servers' checkpoints and --resume.
    with pytest.raises(ConfigError, match="--max-restarts and --min-nproc are not supported"):
        run_training(config(), max_restarts=1)
    monkeypatch.setenv("WORLD_SIZE", "5")  # under tessera run / torchrun
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    with pytest.raises(ConfigError, match=r"1 \+ 2 must equal the 5 processes"):
        config(servers=1, workers=2, nproc=5)
    assert config(servers=3, workers=2, nproc=5).servers == 3
    assert math.isclose(parse_slow_workers(None, 1).get(0, 1.0), 1.0)
