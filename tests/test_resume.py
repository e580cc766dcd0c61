"""`tessera train` resumes bit for bit with AdamW, for every strategy, and survives `kill -9`.

For each registered strategy: `--steps 2k` straight, and `--steps k` then `--resume DIR --steps
2k`, must end with the same parameters, optimizer state (every rank's: ZeRO shards, local-SGD
replicas) and RNG states, compared with `torch.equal`, and the same metrics.jsonl losses: a
resumed run performs the very float operations of the straight one, so nothing is approximate.

The kill tests hold a real trainer inside a save (`tessera.checkpoint.atomic.pause_point`, enabled
by an environment variable), SIGKILL its whole process group, and resume from what is on disk.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tessera
from tessera.train import build_config, latest_checkpoint, load_checkpoint, run_training
from tessera.train.loop import train_worker
from tessera.train.metrics import read_metrics
from tessera.train.resume import config_layers_for_resume
from tessera.zero._safetensors import TensorFile
from tessera.zero.checkpoint import load_shard_files

K = 2
"""Steps before the checkpoint, and after it."""

TINY: dict[str, Any] = {
    "model": {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 16, "dropout": 0.1},
    "batch_size": 4,
    "corpus_bytes": 20_000,
    "sample_tokens": 0,
    "progress": False,
    "optimizer": "adamw",
    "warmup_steps": 1,
    "log_every": 1,
    "checkpoint_every": 100,
    "grad_clip": 1.0,
}
"""Dropout on: a resumed run must also restore every rank's random state."""

RUNS: dict[str, dict[str, Any]] = {
    "single": {"strategy": "single", "nproc": 1},
    "ddp": {"strategy": "ddp", "bucket_cap_mb": 0.01},
    "torch-ddp": {"strategy": "torch-ddp"},
    # Resumed between two averages (every 3 steps, resumed after 2): the counter matters.
    "local-sgd": {"strategy": "local-sgd", "average_every": 3},
    "zero1": {"strategy": "zero1", "bucket_cap_mb": 0.01},  # several flat shards
    "zero2": {"strategy": "zero2", "bucket_cap_mb": 0.01},
    "zero3": {"strategy": "zero3"},
    "zero3-bf16": {"strategy": "zero3", "mixed_precision": "bf16"},
    # fp16: the loss scaler's state travels in the (sharded) checkpoint's payload
    # fp16 from a scale that overflows (steps 1, 2 skipped), then grows after each clean step: a
    # resumed run that forgot the scale would skip step 3 too
    "zero2-fp16": {
        "strategy": "zero2",
        "mixed_precision": "fp16",
        "loss_scale_init": 2.0**19,
        "loss_scale_growth_interval": 1,
    },
    # ZeRO-Infinity: moments, masters and parameter partitions in files; blocks recomputed.
    "zero3-nvme": {
        "strategy": "zero3",
        "mixed_precision": "bf16",
        "offload": "nvme",
        "offload_params": True,
        "activation_checkpointing": True,
    },
    "pipeline": {"strategy": "pipeline", "microbatches": 2},
    "pipeline-interleaved": {  # two chunks of one block per rank: the ring of chunks resumes
        "strategy": "pipeline",
        "schedule": "interleaved",
        "virtual_stages": 2,
        "microbatches": 2,
        "model": {"n_layer": 4},
    },
    "tensor": {"strategy": "tensor"},
    "hybrid-zero1": {"strategy": "hybrid", "dp": 2, "zero": 1, "microbatches": 2},
    "hybrid-zero2": {"strategy": "hybrid", "dp": 2, "zero": 2, "microbatches": 2},
}
"""Run name -> its config: every registered strategy, and the variants that save differently."""


def _config(run: str, out: Path, steps: int) -> Any:
    layers = {"nproc": 2, **RUNS[run]}
    if layers.get("offload") == "nvme":
        layers["nvme_dir"] = str(out.parent)  # the swap files' private folder goes beside
    return build_config(TINY, {"steps": steps, "out": str(out), **layers})


def _resume(run_dir: Path, steps: int) -> None:
    """What `tessera train --resume DIR --steps N` does."""
    layers = config_layers_for_resume(run_dir)
    run_training(build_config(layers, {"steps": steps, "out": str(run_dir)}), resume=True)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Recursive equality; tensors with `torch.equal` (bit for bit, dtype and shape included)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: lengths differ"
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, f"{where}: dtype differs"
        assert torch.equal(a, b), f"{where}: values differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _final_state(run_dir: Path) -> dict[str, Any]:
    """The last checkpoint: engine state, RNG states, step; ZeRO shards read tensor by tensor."""
    state_file = latest_checkpoint(run_dir)
    checkpoint = load_checkpoint(state_file)
    state = {k: checkpoint[k] for k in ("step", "engine", "rng")}
    if "zero_shards" in checkpoint["engine"]:
        folder = state_file.parent / checkpoint["engine"]["zero_shards"]
        shards = []
        for meta in load_shard_files(folder):
            with TensorFile(folder / meta["tensors"]) as tensors:
                values = {key: tensors.get(key) for key in tensors.keys()}
            drop = ("sha256",)  # a function of the tensors compared next
            shards.append({"meta": {k: v for k, v in meta.items() if k not in drop}, **values})
        state["shards"] = shards
    return state


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def _train_three_ways(runs: list[str], root: str) -> None:
    """On every rank, per run: 2k steps straight; k steps; resumed from step k to 2k.

    The three runs share one spawn (starting ranks costs seconds). Each run starts like a
    fresh process would: `train_worker` seeds the RNG and builds model, engine and groups anew,
    and the resumed run restores every rank's RNG state from the checkpoint.
    """
    for run in runs:
        folder = Path(root) / run
        for name, steps, resume in (("straight", 2 * K, False), ("split", K, False)):
            (folder / name).mkdir(parents=True, exist_ok=True)
            train_worker(_config(run, folder / name, steps), str(folder / name), resume)
        if tessera.init().is_main:
            assert load_checkpoint(latest_checkpoint(folder / "split"))["step"] == K
        train_worker(_config(run, folder / "split", 2 * K), str(folder / "split"), True)


_straight_runs: dict[str, Path] = {}
"""Run name -> its straight run's folder, reused by the kill tests."""


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """`straight(run)`: a run folder of 2k uninterrupted steps (made once per module)."""

    def make(run: str) -> Path:
        if run not in _straight_runs:
            out = tmp_path_factory.mktemp("straight") / run
            run_training(_config(run, out, 2 * K))
            _straight_runs[run] = out
        return _straight_runs[run]

    return make


def _assert_same_run(resumed: Path, straight: Path) -> None:
    assert _losses(resumed) == _losses(straight)  # bit for bit, one record per step
    assert [step for step, _ in _losses(resumed)] == list(range(1, 2 * K + 1))
    assert_same(_final_state(resumed), _final_state(straight), "checkpoint")


@pytest.mark.parametrize(
    "runs",
    [
        ["single"],
        ["ddp", "torch-ddp", "local-sgd"],
        ["zero1", "zero2", "zero3", "zero3-bf16", "zero2-fp16", "zero3-nvme"],
        ["pipeline", "tensor", "hybrid-zero1", "hybrid-zero2"],
        ["pipeline-interleaved"],
    ],
    ids=lambda runs: "+".join(runs),
)
def test_every_strategy_resumes_bit_for_bit_with_adamw(run_ranks, tmp_path, runs):
    nproc = RUNS[runs[0]].get("nproc", 2)
    run_ranks(_train_three_ways, nproc, runs, str(tmp_path), deadline_s=600)
    for run in runs:
        _straight_runs.setdefault(run, tmp_path / run / "straight")
        _assert_same_run(tmp_path / run / "split", tmp_path / run / "straight")


def test_the_resume_tests_cover_every_registered_strategy():
    from tessera.strategies import STRATEGIES as REGISTERED

    assert sorted(REGISTERED) == sorted({options["strategy"] for options in RUNS.values()})


def _tessera_train_until_paused(
    run_dir: Path, run: str, pause: str, skip: int, keep: int = 2
) -> None:
    """Run `tessera train` until a rank holds at `pause`, then SIGKILL its process group."""
    marker = run_dir.parent / f"{run_dir.name}.paused"
    env = {
        **os.environ,
        "TESSERA_TEST_PAUSE": pause,
        "TESSERA_TEST_PAUSE_SKIP": str(skip),
        "TESSERA_TEST_PAUSE_MARKER": str(marker),
    }
    flags = {
        "--steps": str(2 * K),
        "--checkpoint-every": str(K),
        "--out": str(run_dir),
        "--nproc": str(RUNS[run].get("nproc", 2)),
        "--keep-checkpoints": str(keep),
    }
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(_yaml({k: v for k, v in TINY.items() if k != "checkpoint_every"}))
    command = [sys.executable, "-m", "tessera", "train", "--config", str(config)]
    command += [item for pair in flags.items() for item in pair]
    for key, value in RUNS[run].items():
        if key != "nproc":
            command += [f"--{key.replace('_', '-')}", str(value)]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            if process.poll() is not None:
                _, err = process.communicate()
                pytest.fail(f"the trainer ended before pausing at {pause}:\n{err.decode()}")
            assert time.monotonic() < deadline, f"the trainer never paused at {pause}"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and every rank: no clean-up runs
        process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def _yaml(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(values)


@pytest.mark.parametrize(
    ("run", "pause", "skip"),
    [
        # Mid-save: the ranks write the new step's shards while the previous step is committed.
        pytest.param("zero3", f"write:*/.step-{2 * K:08d}.partial/*", 0, marks=pytest.mark.slow),
        # Every file of the new checkpoint and its manifest are written, the folder is about to
        # be renamed into place: with --keep-checkpoints 1 the previous checkpoint must still be
        # there, since it is the only complete one. (local-sgd saves one state file, as zero2's
        # state.pt: not run again here.)
        ("zero2", f"commit:*/checkpoints/step-{2 * K:08d}", 0),
    ],
)
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path, straight, run, pause, skip):
    run_dir = tmp_path / "killed"
    _tessera_train_until_paused(run_dir, run, pause, skip, keep=1)
    assert latest_checkpoint(run_dir) is not None, "the kill left no complete checkpoint"
    checkpoint = load_checkpoint(latest_checkpoint(run_dir))  # the previous save is whole
    assert checkpoint["step"] == K
    # The killed run had logged steps past its checkpoint: they are dropped on resume.
    assert [step for step, _ in _losses(run_dir)] == list(range(1, 2 * K + 1))
    _resume(run_dir, 2 * K)
    _assert_same_run(run_dir, straight(run))
    # Nothing the killed save left behind remains: no temporary file, no partial shard folder.
    leftovers = list(run_dir.glob(".*")) + list(run_dir.glob("checkpoints/**/.*"))
    assert not leftovers, leftovers
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step-{2 * K:08d}"]


def test_metrics_log_drops_the_records_past_the_resumed_step(tmp_path):
    from tessera.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": {s / 10}}}\n' for s in range(1, 6)))
    log = MetricsLog(path, resume_from_step=3)  # the run died after logging step 5
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    log.write({"step": 4, "loss": 0.0})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_resume_goes_on(tmp_path):
    from tessera.train.metrics import MetricsLog, read_events

    path = tmp_path / "metrics.jsonl"
    lines = [f'{{"step": {s}, "loss": {s / 10}}}\n' for s in range(1, 5)]
    lines.insert(2, '{"event": "restart", "step": 2, "rank": 1}\n')
    torn = '{"step": 5, "lo'  # the run was killed (or the disk filled) in the middle of a line
    path.write_text("".join(lines) + torn)
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl:6: dropping .*'\{\"step\": 5, \"lo'"):
        log = MetricsLog(path, resume_from_step=3)
    assert path.read_text() == "".join(lines[:4])  # the torn line and step 4 are gone, on disk
    log.write({"step": 4, "loss": 0.0})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    assert [e["rank"] for e in read_events(path, "restart")] == [1]
    # A reader of a file that still holds one (a run killed, not yet resumed) skips it too.
    with path.open("a") as file:
        file.write("\x00\x00{garbage\n")
    with pytest.warns(RuntimeWarning, match="metrics.jsonl:6: dropping"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]
    ps = tmp_path / "ps.jsonl"  # the parameter server's lines (read on its resume) have no step
    ps.write_text('{"kind": "worker", "worker": 0}\n{"kind": "gra')
    with pytest.warns(RuntimeWarning, match="ps.jsonl:2: dropping"):
        assert read_metrics(ps) == [{"kind": "worker", "worker": 0}]


def _rewrite_and_die(path: str) -> None:
    import json

    from tessera.train import metrics

    calls = []

    def dumps_then_die(record: Any) -> str:  # the 10th record of the rewrite is never written
        calls.append(record)
        if len(calls) == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        return json.dumps(record)

    metrics.json = type("json", (), {"dumps": staticmethod(dumps_then_die), "loads": json.loads})
    metrics.MetricsLog(Path(path), resume_from_step=1)


def test_a_kill_while_metrics_are_rewritten_on_resume_leaves_the_old_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = "".join(f'{{"step": {s}, "loss": {s / 10}}}\n' for s in range(1, 4))
    text += '{"event": "restart", "step": 1, "rank": 0}\n' * 20
    path.write_text(text)
    process = multiprocessing.get_context("fork").Process(target=_rewrite_and_die, args=(path,))
    process.start()
    process.join(60)
    assert process.exitcode == -signal.SIGKILL  # it died inside the rewrite
    assert path.read_text() == text  # whole, not truncated to what was written before the kill
