"""Fault tolerance: injected faults (TESSERA_FAULT), automatic restarts, elastic world size.

For ddp, zero2, zero3, pipeline and hybrid, one run with several faults in one TESSERA_FAULT spec
and `max_restarts=3` must end with the parameters (`torch.equal`, AdamW) and the logged losses
of the same strategy's uninterrupted run. The faults rotate over the strategies so that every
kind (kill, raise, checkpoint) falls on a checkpoint step and off one, on rank 0 and rank 1.
Each restart must resume from the newest checkpoint written before its fault, which the
metrics.jsonl restart lines say: resuming from scratch would give the same parameters (exact
resume) but other restart lines, so a supervisor that lost the checkpoint is caught too.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _tolerance import check_close
from test_trainer_oracle import oracle_run  # tests/ is on sys.path under pytest

from tessera.cli import main as tessera_main
from tessera.errors import ConfigError, RankFailedError
from tessera.train import build_config, latest_checkpoint, load_checkpoint, run_training
from tessera.train import faults as faults_module
from tessera.train.faults import (
    FAULT_ENV,
    Fault,
    FaultInjector,
    InjectedFault,
    check_faults,
    faults_from_env,
    fired_faults,
    parse_faults,
)
from tessera.train.metrics import read_events, read_metrics
from tessera.train.restarts import (
    RestartsExhausted,
    check_restart_options,
    next_world_size,
    supervise,
)
from tessera.zero._safetensors import TensorFile
from tessera.zero.checkpoint import load_shard_files

STEPS = 6
EVERY = 3
"""Checkpoints after steps 3 and 6."""

TINY: dict[str, Any] = {
    "model": {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 16},
    "batch_size": 4,
    "corpus_bytes": 20_000,
    "sample_tokens": 0,
    "progress": False,
    "optimizer": "adamw",
    "warmup_steps": 1,
    "checkpoint_every": EVERY,
    "steps": STEPS,
    "nproc": 2,
}

# strategy -> (its options, the faults of its run). Steps 3 and 6 are checkpoint steps.
# kill:  off (ddp 2, zero2 5), on (pipeline 3)
# raise: on (zero2 3), off (zero3 4, pipeline 5, hybrid 2)
# checkpoint (always on one): rank 0's checkpoint.pt (ddp 3, hybrid 6: the last save),
#   rank 1's ZeRO shard (zero3 3)
RUNS: dict[str, tuple[dict[str, Any], str]] = {
    "ddp": ({"strategy": "ddp", "bucket_cap_mb": 0.01}, "1:2:kill,0:3:checkpoint"),
    "zero2": ({"strategy": "zero2", "bucket_cap_mb": 0.01}, "0:3:raise,1:5:kill"),
    "zero3": ({"strategy": "zero3"}, "1:3:checkpoint,0:4:raise"),
    "pipeline": ({"strategy": "pipeline", "microbatches": 2}, "1:3:kill,0:5:raise"),
    "hybrid": (
        {"strategy": "hybrid", "dp": 2, "zero": 1, "microbatches": 2},
        "0:2:raise,0:6:checkpoint",
    ),
}


def _config(strategy: str, out: Path, **overrides: Any) -> Any:
    return build_config(TINY, RUNS[strategy][0], {"out": str(out), **overrides})


def _final_state(run_dir: Path) -> dict[str, Any]:
    """The last checkpoint's engine state and step; ZeRO shards read tensor by tensor."""
    path = latest_checkpoint(run_dir)
    checkpoint = load_checkpoint(path)
    state = {"step": checkpoint["step"], "engine": checkpoint["engine"]}
    if "zero_shards" in checkpoint["engine"]:
        folder = path.parent / checkpoint["engine"]["zero_shards"]
        for meta in load_shard_files(folder):
            with TensorFile(folder / meta["tensors"]) as tensors:
                for key in tensors.keys():
                    state[f"rank{meta['rank']}|{key}"] = tensors.get(key)
    return state


def _assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: values differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def _expected_restarts(spec: str) -> list[tuple[int, int]]:
    """(resumed step, failed rank) per fault: the newest checkpoint saved before the fault.

    A fault at step S fires before step S runs (a `checkpoint` fault: during the save after it),
    so the newest complete checkpoint is the last multiple of EVERY below S.
    """
    faults = sorted(parse_faults(spec), key=lambda fault: fault.step)
    return [(((f.step - 1) // EVERY) * EVERY, f.rank) for f in faults]


@pytest.mark.parametrize("strategy", sorted(RUNS))
def test_faulted_run_with_restarts_equals_the_uninterrupted_run(tmp_path, monkeypatch, strategy):
    straight = tmp_path / "straight"
    monkeypatch.delenv(FAULT_ENV, raising=False)
    run_training(_config(strategy, straight))
    spec = RUNS[strategy][1]
    monkeypatch.setenv(FAULT_ENV, spec)
    faulted = tmp_path / "faulted"
    summary = run_training(_config(strategy, faulted), max_restarts=3)

    _assert_equal(_final_state(faulted), _final_state(straight), strategy)
    assert _losses(faulted) == _losses(straight)  # bit for bit, one record per step
    assert [step for step, _ in _losses(faulted)] == list(range(1, STEPS + 1))
    events = read_events(faulted / "metrics.jsonl", "restart")
    assert [(e["step"], e["rank"]) for e in events] == _expected_restarts(spec)
    faults = sorted(parse_faults(spec), key=lambda fault: fault.step)
    for event, fault in zip(events, faults):  # the cause names what happened
        expected = "exited with code -9" if fault.kind != "raise" else str(fault)
        assert expected in event["cause"], (event, fault)
    assert summary["restarts"] == len(faults)
    fired = [Fault(r["rank"], r["step"], r["kind"]) for r in fired_faults(faulted)]
    assert sorted(fired) == sorted(faults)  # each fired once, none left unfired


def test_exhausted_restarts_stop_the_run_with_every_failure_listed(tmp_path, monkeypatch):
    # max_restarts=1: the first raise is restarted (the run goes on past step 1, since that
    # fault fired already), the second one ends the run.
    monkeypatch.setenv(FAULT_ENV, "0:1:raise,0:2:kill,0:3:raise")
    config = build_config(TINY, {"strategy": "single", "nproc": 1, "out": str(tmp_path)})
    with pytest.raises(RestartsExhausted) as caught:
        run_training(config, max_restarts=1)
    message = str(caught.value)
    assert "failed 2 times (1 restart allowed)" in message, message
    assert "1. rank 0 of 1: InjectedFault: rank 0: injected fault 0:1:raise" in message
    assert "2. rank 0 of 1: process exited with code -9" in message
    assert isinstance(caught.value, RankFailedError)  # callers catching the launcher's error
    assert len(caught.value.failures) == 2
    assert [e["step"] for e in read_events(tmp_path / "metrics.jsonl", "restart")] == [0]
    # Without restarts the launcher's own error comes through unchanged.
    monkeypatch.setenv(FAULT_ENV, "0:1:raise")
    fresh = build_config(TINY, {"strategy": "single", "nproc": 1, "out": str(tmp_path / "b")})
    (tmp_path / "b").mkdir()
    with pytest.raises(RankFailedError, match="injected fault 0:1:raise") as plain:
        supervise(fresh, tmp_path / "b", False, max_restarts=0)
    assert not isinstance(plain.value, RestartsExhausted)


def test_a_run_folder_whose_checkpoints_all_fail_verification_restarts_from_scratch(
    tmp_path, monkeypatch
):
    # A run saved step 3; then its only checkpoint rots. `--resume --max-restarts 1`: the first
    # launch finds nothing that verifies and fails; the restart must start from step 0 (as the
    # README promises), not try the rotten checkpoint again, and end where the first run did.
    monkeypatch.delenv(FAULT_ENV, raising=False)
    changes = {"strategy": "single", "nproc": 1, "steps": 3, "out": str(tmp_path)}
    run_training(build_config(TINY, changes))
    first = _final_state(tmp_path)
    state = latest_checkpoint(tmp_path)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 1
    state.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        run_training(build_config(TINY, changes), resume=True, max_restarts=1)
    _assert_equal(_final_state(tmp_path), first, "from scratch")
    assert [step for step, _ in _losses(tmp_path)] == [1, 2, 3]  # the old records went
    events = read_events(tmp_path / "metrics.jsonl", "restart")
    assert [(e["step"], e["restart"]) for e in events] == [(0, 1)]
    assert "cannot resume" in events[0]["cause"]


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("1:2", "'1:2' is malformed"),
        ("1:2:kill,x:2:raise", "'x:2:raise': rank 'x'"),
        ("0:0:kill", "'0:0:kill': step '0'"),
        ("0:-3:kill", "'0:-3:kill': step '-3'"),
        ("0:2:explode", "unknown kind 'explode'"),
        ("0:2:kill,0:2:raise", "'0:2:raise': rank 0 already has a fault at step 2"),
        ("0:2:kill,", "entry '' is malformed"),
    ],
)
def test_malformed_fault_specs_are_one_error_naming_the_entry(spec, named):
    with pytest.raises(ConfigError, match="TESSERA_FAULT entry") as caught:
        parse_faults(spec)
    assert named in str(caught.value)


def test_fault_specs_parse_and_are_checked_against_the_run(tmp_path, monkeypatch):
    assert parse_faults(None) == parse_faults("  ") == ()
    assert parse_faults(" 1:3:kill , 0:12:slow,2:4:hang,0:6:checkpoint,0:1:raise") == (
        Fault(1, 3, "kill"),
        Fault(0, 12, "slow"),
        Fault(2, 4, "hang"),
        Fault(0, 6, "checkpoint"),
        Fault(0, 1, "raise"),
    )
    config = _config("ddp", tmp_path)
    bad = {
        "2:1:kill": "rank 2 does not exist (2 ranks)",
        "0:7:kill": "step 7 is past the last (6)",
        "0:4:checkpoint": "no checkpoint is saved after step 4",
        "1:3:checkpoint": "rank 1 writes no checkpoint file under strategy 'ddp'",
    }
    for spec, message in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_faults(parse_faults(spec), config, 2, sharded=False)
    check_faults(parse_faults("1:3:checkpoint"), config, 2, sharded=True)  # ZeRO: every rank
    # From the environment, before anything starts: the strategy's engine says how it saves.
    monkeypatch.setenv(FAULT_ENV, "1:3:checkpoint")
    with pytest.raises(ConfigError, match="rank 1 writes no checkpoint file"):
        faults_from_env(config, 2)
    assert faults_from_env(_config("zero2", tmp_path), 2) == (Fault(1, 3, "checkpoint"),)


class _FakeClock:
    """Stands in for `time` in tessera.train.faults: sleeping advances the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_slow_and_hang_faults_in_one_process(tmp_path, monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(faults_module, "time", clock)
    slow = FaultInjector(parse_faults("0:3:slow,1:3:raise"), tmp_path, rank=0, timeout_s=5.0)
    for step, work_s in ((1, 0.5), (2, 0.5), (3, 0.25), (4, 0.5)):
        slow.at_step(step)
        clock.now += work_s  # the step itself
    slow.at_step(5)
    # From step 3 on, 9x the previous iteration before each step (10x slower); not before.
    assert clock.sleeps == [9 * 0.5, 9 * 0.25, 9 * 0.5]
    assert [(r["rank"], r["step"], r["kind"]) for r in fired_faults(tmp_path)] == [(0, 3, "slow")]
    # A restarted run finds the record: the fault does not fire again.
    clock.sleeps.clear()
    again = FaultInjector(parse_faults("0:3:slow"), tmp_path, rank=0, timeout_s=5.0)
    for step in (3, 4, 5):
        again.at_step(step)
        clock.now += 1.0
    assert clock.sleeps == []
    # A hang sleeps until killed; if nobody kills it within twice the timeout it says so.
    hang = FaultInjector(parse_faults("1:2:hang"), tmp_path, rank=1, timeout_s=5.0)
    hang.at_step(1)
    began = clock.now
    with pytest.raises(InjectedFault, match="1:2:hang hung for 10 s and nobody stopped it"):
        hang.at_step(2)
    assert clock.now - began == pytest.approx(10.0)
    raised = FaultInjector(parse_faults("1:3:raise"), tmp_path, rank=1, timeout_s=5.0)
    with pytest.raises(InjectedFault, match="rank 1: injected fault 1:3:raise"):
        raised.at_step(3)
    raised.at_step(3)  # fired once per run folder: a second pass goes on


def test_a_logged_step_lasts_as_long_as_its_slowest_rank():
    from tessera.train.loop import _record

    def rank(loss: float, step_s: float, comm_s: float) -> dict[str, float]:
        measured = {"loss": loss, "step_s": step_s, "comm_s": comm_s, "peak_mem_mb": 1.0}
        return {**measured, "model_state_mb": -1.0}

    # Rank 1 waited in the gradient all-reduce for a straggler, rank 0 was the straggler.
    record = _record(7, [rank(2.0, 0.25, 0.0625), rank(4.0, 2.0, 1.5)], tokens=1000, lr=0.5)
    assert record["step_s"] == 2.0 and record["tokens_per_s"] == 500.0
    assert record["comm_s"] == 1.5 and record["compute_s"] == 0.5
    assert record["loss"] == 3.0 and record["step"] == 7 and record["lr"] == 0.5
    assert "model_state_mb" not in record  # not measured by every rank


def test_the_logged_rates_follow_a_slowed_rank(tmp_path, monkeypatch):
    # From step 2 on rank 1 runs 10x slower: it sleeps before each step, and rank 0 waits for it
    # inside the step's all-reduce. A synchronous step lasts as long as its slowest rank, so the
    # logged steps account for most of the run's time, sleeps included; taking the fastest
    # rank's time (rank 1 measures only its own compute) would log a tenth of it.
    monkeypatch.setenv(FAULT_ENV, "1:2:slow")
    summary = run_training(_config("ddp", tmp_path))
    assert [(r["rank"], r["kind"]) for r in fired_faults(tmp_path)] == [(1, "slow")]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert sum(r["step_s"] for r in records) > 0.5 * summary["wall_s"]  # about 0.9; fastest: 0.05
    tokens = TINY["batch_size"] * TINY["model"]["block_size"]
    for record in records:
        assert record["tokens_per_s"] == pytest.approx(tokens / record["step_s"])
    middle = sorted(r["step_s"] for r in records)[STEPS // 2 - 1 : STEPS // 2 + 1]
    assert summary["step_s"] == pytest.approx(sum(middle) / 2)  # the median of the records
    # the rate: every step's tokens over every step's time (not a median of per-step rates)
    total = sum(r["step_s"] for r in records)
    assert summary["tokens_per_s"] == pytest.approx(tokens * len(records) / total)


def test_bad_restart_options_and_fault_specs_fail_the_command_before_any_rank(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    base = ["train", "--nproc", "2", "--steps", "2", "--out", str(out), "--no-progress"]
    assert tessera_main([*base, "--max-restarts", "-1"]) == 2
    assert "--max-restarts must not be negative, got -1" in capsys.readouterr().err
    assert tessera_main([*base, "--strategy", "pipeline", "--min-nproc", "1"]) == 2
    assert "strategy 'pipeline' cannot change its world size" in capsys.readouterr().err
    assert tessera_main([*base, "--min-nproc", "3"]) == 2
    assert "--min-nproc must be in 1..nproc (2), got 3" in capsys.readouterr().err
    monkeypatch.setenv(FAULT_ENV, "0:1:kill;1:2:raise")
    assert tessera_main(base) == 2
    assert "TESSERA_FAULT entry '0:1:kill;1:2:raise' is malformed" in capsys.readouterr().err
    assert not out.exists()  # refused before the run folder was made


def test_elastic_restart_after_a_lost_rank_continues_on_fewer_ranks(tmp_path, monkeypatch):
    """4 ranks, rank 3 killed at step 3: the restart resumes checkpoint 2 on 2 ranks (batch 4
    does not split over 3), with the same global batch, so the run still follows one process
    (SGD with momentum: see DESIGN.md, Testing, for why not Adam here). That a rank that raised
    keeps the world is checked in test_elastic_rule_and_its_refusals."""
    common = {"optimizer": "sgd", "lr": 0.05, "warmup_steps": 0, "checkpoint_every": 2}
    config = build_config(
        TINY, common, {"strategy": "ddp", "nproc": 4, "steps": 4, "out": str(tmp_path)}
    )
    monkeypatch.setenv(FAULT_ENV, "3:3:kill")
    run_training(config, max_restarts=1, min_nproc=2)
    restarts = read_events(tmp_path / "metrics.jsonl", "restart")
    assert [(e["step"], e["rank"], e["world_size"]) for e in restarts] == [(2, 3, 2)]
    oracle, exact = oracle_run(config, "fp32"), oracle_run(config, "fp64")
    params = load_checkpoint(latest_checkpoint(tmp_path))["engine"]["model"]
    check_close(params, oracle["state"], exact["state"], what="elastic ddp 4 -> 2")
    losses = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    check_close(losses, oracle["losses"], exact["losses"], what="elastic ddp losses")


def test_elastic_rule_and_its_refusals(tmp_path):
    from tessera.train.restarts import Failure

    config = build_config(TINY, {"strategy": "zero2", "nproc": 4, "batch_size": 12})
    lost, raised = Failure(4, 3, "killed", lost=True), Failure(4, 0, "raised", lost=False)
    assert next_world_size(config, 4, lost, 2) == 3  # 12 splits over 3
    assert next_world_size(config, 3, lost, 2) == 2
    assert next_world_size(config, 2, lost, 2) == 2  # not below --min-nproc
    assert next_world_size(config, 4, raised, 2) == 4  # an exception is not a lost rank
    assert next_world_size(config, 4, lost, None) == 4  # not elastic unless asked
    eight = build_config(TINY, {"strategy": "ddp", "nproc": 4, "batch_size": 8})
    assert next_world_size(eight, 4, lost, 3) == 4  # 8 does not split over 3: no smaller world
    assert next_world_size(eight, 4, lost, 1) == 2  # the largest allowed one below 4
    refused = [
        RUNS["pipeline"][0],
        RUNS["hybrid"][0],
        {"strategy": "tensor"},
        {"strategy": "local-sgd"},
        {"strategy": "single", "nproc": 1},
    ]
    for options in refused:
        with pytest.raises(ConfigError, match="cannot change its world size"):
            check_restart_options(build_config(TINY, options), 0, 1)


def test_tessera_run_passes_restarts_and_elastic_nodes_to_torchrun(monkeypatch):
    from torch.distributed import run as torchrun

    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    argv = ["run", "-n", "2", "--nnodes", "1:2", "--max-restarts", "3"]
    argv += ["--rdzv-endpoint", "localhost:29400", "train.py", "--max-restarts", "9"]
    assert tessera_main(argv) == 0
    (args,) = seen
    assert (args.max_restarts, args.nnodes, args.nproc_per_node) == (3, "1:2", "2")
    assert args.training_script_args == ["--max-restarts", "9"]  # the script's own, untouched


def test_a_worker_restarted_by_torchrun_resumes_the_run_folder(tmp_path, monkeypatch):
    """Under torchrun the elastic agent restarts the workers: TORCHELASTIC_RESTART_COUNT > 0
    makes `tessera train` resume from the run folder (here a world of one, in this process)."""
    import socket

    out = tmp_path / "run"
    config = build_config(TINY, {"strategy": "single", "nproc": 1, "out": str(out), "steps": 3})
    run_training(config)  # the run the agent's first workers left: checkpoint at step 3
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TESSERA_INIT_FILE", raising=False)
    from tessera.runtime.context import shutdown

    try:
        resumed = build_config(TINY, {"strategy": "single", "nproc": 1, "out": str(out)})
        summary = run_training(resumed)
    finally:
        shutdown()
    assert summary["steps_this_run"] == STEPS - 3
    (event,) = read_events(out / "metrics.jsonl", "restart")
    assert (event["step"], event["rank"], event["restart"]) == (3, None, 1)
    assert "torchrun restarted the workers" in event["cause"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == "1"
