"""The trainer's evaluation, callbacks and logging: `--eval-every`, `callbacks=`, `--log-with
tensorboard`, plain progress lines when stdout is not a terminal, `--nproc auto`.

In-process runs (`--nproc 1`) of a tiny GPT with dropout (so an evaluation that touched the RNG
stream or left dropout on would change training), and one CLI run on 2 ranks.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from test_readme_commands import readme

import tessera.train as tt
from tessera.checkpoint.files import load_checkpoint
from tessera.checkpoint.series import latest_checkpoint
from tessera.cli import main
from tessera.data import CharTokenizer, LMBatches, load_corpus
from tessera.errors import ConfigError
from tessera.models import GPT, GPTConfig
from tessera.train import build_config, run_training
from tessera.train.callbacks import CallbackRunner
from tessera.train.metrics import read_metrics
from tessera.train.reporting import plain_line

README = Path(__file__).resolve().parents[1] / "README.md"

MODEL = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16, "dropout": 0.1}
BASE = {
    "strategy": "single",
    "nproc": 1,
    "steps": 5,
    "batch_size": 4,
    "corpus_bytes": 20_000,
    "model": MODEL,
    "sample_tokens": 0,
    "checkpoint_every": 0,
    "progress": False,
    "seed": 2,
}
EVAL = {"eval_every": 2, "eval_batches": 3}


class Recorder(tt.Callback):
    """Records every hook call (an in-process run: the caller reads them)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, dict[str, Any]]] = []

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("step", step, metrics))

    def on_eval_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("eval", step, metrics))


def _run(out: Path, callbacks: list[Any] = (), **overrides: Any) -> dict[str, Any]:
    return run_training(build_config(BASE, {"out": str(out), **overrides}), callbacks=callbacks)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(run_dir))["engine"]["model"]


def _plain_val_loss(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """The held-out loss written here: the corpus's last tenth, windows drawn with seed + 1."""
    text = load_corpus("stdlib", max_bytes=BASE["corpus_bytes"])
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode_tensor(text)
    held_out = LMBatches(
        tokens[int(tokens.numel() * 0.9) :],
        block_size=MODEL["block_size"],
        global_batch_size=BASE["batch_size"],
        seed=BASE["seed"] + 1,
    )
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **MODEL))
    model.load_state_dict(weights)
    model = model.to(dtype).eval()
    with torch.no_grad():
        losses = []
        for i in range(EVAL["eval_batches"]):
            x, y = held_out.batch(i)
            losses.append(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).double())
    return float(sum(losses) / len(losses))


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run folder's event files, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_evaluation_changes_no_step_and_is_logged_everywhere(tmp_path):
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    plain = _run(tmp_path / "plain")
    recorder = Recorder()
    logging = {"log_with": "tensorboard"} if tensorboard else {}
    summary = _run(tmp_path / "eval", [recorder], **logging, **EVAL)
    records = read_metrics(tmp_path / "eval" / "metrics.jsonl")
    # a run that evaluates takes exactly the steps of one that does not
    no_eval = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert [r["loss"] for r in records] == [r["loss"] for r in no_eval]
    weights, plain_weights = _weights(tmp_path / "eval"), _weights(tmp_path / "plain")
    assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)
    # every eval_every steps and at the end; the last one is the summary's
    evaluated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert list(evaluated) == [2, 4, 5] and plain["val_loss"] is None
    assert summary["val_loss"] == evaluated[5]
    check_close(
        evaluated[5],
        _plain_val_loss(weights, torch.float32),
        _plain_val_loss({k: v.double() for k, v in weights.items()}, torch.float64),
        what="val_loss",
    )
    # the callbacks: every step, every evaluation (before its step's on_step_end), the record
    calls = [(kind, step) for kind, step, _ in recorder.calls]
    assert calls == [
        ("step", 1),
        ("eval", 2),
        ("step", 2),
        ("step", 3),
        ("eval", 4),
        ("step", 4),
        ("eval", 5),
        ("step", 5),
    ]
    assert [m for kind, _, m in recorder.calls if kind == "step"] == records
    assert (tmp_path / "eval" / "loss.png").stat().st_size > 0
    if not tensorboard:  # everything else is checked above
        pytest.skip("tensorboard is not installed (pip install 'tessera[tensorboard]')")
    # TensorBoard: every step's loss, lr, speed and memory; val_loss where evaluated
    scalars = _scalars(tmp_path / "eval")
    for name in (
        "train/loss", "train/lr", "perf/tokens_per_s", "perf/samples_per_s", "perf/data_s",
        "perf/comm_s", "memory/peak_mem_mb",
    ):  # fmt: skip
        assert [s for s, _ in scalars[name]] == [1, 2, 3, 4, 5], name
    for (step, value), record in zip(scalars["train/loss"], records):
        assert value == pytest.approx(record["loss"], rel=1e-6), step
    assert dict(scalars["eval/loss"]) == pytest.approx(evaluated, rel=1e-6)


class StopAt(tt.Callback):
    """Writes each hook call to `path` (the rank process's calls are not the parent's) and
    stops at step `stop_at`."""

    def __init__(self, path: Path, stop_at: int) -> None:
        self.path, self.stop_at = path, stop_at

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.path, "a") as file:
            file.write(f"{os.getpid()} {step}\n")
        if step == self.stop_at:
            raise tt.StopTraining(f"stopped at {step}")


def test_a_callback_stops_every_rank_and_the_stop_is_checkpointed(tmp_path):
    """On 2 ranks: the callback reaches the rank processes pickled, runs on rank 0 only, and its
    StopTraining ends every rank after the step, checkpointed there."""
    calls = tmp_path / "calls.txt"
    # timeout_s: a rank not told of the stop would wait in its next collective; fail fast
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    logging = {"log_with": "tensorboard"} if tensorboard else {}
    summary = _run(
        tmp_path / "stop", [StopAt(calls, 3)], strategy="ddp", nproc=2, timeout_s=30, **EVAL,
        **logging,
    )  # fmt: skip
    pids, steps = zip(*(line.split() for line in calls.read_text().splitlines()))
    assert steps == ("1", "2", "3") and len(set(pids)) == 1 and int(pids[0]) != os.getpid()
    assert summary["stopped_at"] == 3 and summary["stop_reason"] == "stopped at 3"
    assert summary["steps_this_run"] == 3
    records = read_metrics(tmp_path / "stop" / "metrics.jsonl")
    assert records[-1]["step"] == 3
    # evaluated at step 2 (eval_every) and at the stop, on the model the run ends with
    assert [r["step"] for r in records if "val_loss" in r] == [2, 3]
    assert summary["val_loss"] == records[-1]["val_loss"] != records[1]["val_loss"]
    if tensorboard:  # each rank's memory beside the largest
        scalars = _scalars(tmp_path / "stop")
        for rank in (0, 1):
            logged = [value for _, value in scalars[f"memory/peak_mem_mb/rank{rank}"]]
            assert logged == pytest.approx([r["peak_mem_mb"][rank] for r in records])
        largest = [max(r["peak_mem_mb"]) for r in records]
        assert [v for _, v in scalars["memory/peak_mem_mb"]] == pytest.approx(largest)
    assert load_checkpoint(latest_checkpoint(tmp_path / "stop"))["step"] == 3


class _Returns(tt.Callback):
    def on_step_end(self, step: int, metrics: dict[str, Any]) -> bool:
        return True


def test_callback_errors_are_clear_and_come_first(tmp_path):
    local = type("Local", (tt.Callback,), {})  # a class made here cannot be pickled by name
    with pytest.raises(ConfigError, match="cannot be pickled to the spawned ranks"):
        _run(tmp_path / "a", [local()], strategy="ddp", nproc=2)
    assert not (tmp_path / "a").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="neither on_step_end nor on_eval_end"):
        _run(tmp_path / "b", [object()])
    ctx = type("Ctx", (), {"is_main": True, "world_size": 1})()
    with pytest.raises(TypeError, match="raise tessera.train.StopTraining"):
        CallbackRunner([_Returns()], ctx).step_end(1, {})


def test_nproc_auto_and_eval_options_are_checked_up_front():
    expected = torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count()
    assert build_config({"nproc": "auto", "batch_size": 8 * expected}).nproc == expected
    assert build_config({"nproc": "auto", "strategy": "single"}).nproc == 1
    if expected > 1:
        with pytest.raises(ConfigError, match=f"--nproc auto chose {expected} ranks"):
            build_config({"nproc": "auto", "batch_size": 8 * expected + 1})
    with pytest.raises(SystemExit):  # argparse: "--nproc: must be an integer or auto"
        main(["train", "--nproc", "many"])
    with pytest.raises(ConfigError, match="needs --eval-data"):
        build_config({"model_factory": "m:f", "data": "m:d", "eval_every": 5})
    with pytest.raises(ConfigError, match="eval_batches"):
        build_config({"eval_every": 5, "eval_batches": -1})  # 0: one pass over the set
    with pytest.raises(ConfigError, match="strategy ps has its own loop"):
        build_config({"strategy": "ps", "eval_every": 2})
    with pytest.raises(ConfigError, match="log_with must be tensorboard, mlflow or wandb"):
        build_config({"log_with": "visdom"})


def test_plain_progress_lines_when_stdout_is_not_a_terminal(tmp_path):
    """`tessera train` on 2 ranks with its stdout a pipe: one line per logged step, no bar."""
    command = readme("tessera train --nproc 2 --eval-every 50 --eval-batches 8 --out runs/e")
    model = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    done = subprocess.run(  # the README's command, made tiny (a later flag wins)
        [*command, "--steps", "4", "--batch-size", "4", "--corpus-bytes", "20000"]
        + ["--sample-tokens=0", "--checkpoint-every", "0", "--log-every", "2"]
        + ["--eval-every", "3", "--eval-batches=1", *model, "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 3, 4] and "val_loss" in records[1]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert lines == [plain_line(r, 4, "tokens") for r in records]
    assert "\r" not in done.stdout + done.stderr  # no progress bar redraws anywhere


def test_the_readme_early_stopping_callback_stops_after_patience_evaluations():
    code = re.search(r"```python\n(# early_stop.py.*?)```", README.read_text(), flags=re.S)[1]
    namespace: dict[str, Any] = {"__name__": "early_stop"}  # its class, not its training run
    exec(compile(code, "README.md", "exec"), namespace)
    callback = namespace["EarlyStop"](patience=2)
    for step, val_loss in ((25, 3.0), (50, 2.5), (75, 2.6)):  # one evaluation without progress
        callback.on_eval_end(step, {"val_loss": val_loss})
    with pytest.raises(tt.StopTraining, match="not improved for 2 evaluations"):
        callback.on_eval_end(100, {"val_loss": 2.5})
