"""`tessera train --model/--data/--loss`: a user's model, data and loss, through the CLI.

Resume is exact for them as for the demo GPT (3 steps, then --resume to 6, equals 6 straight,
bit for bit, the straight run evaluating on held-out data as it goes); errors stop before any
rank starts (no run folder is even created); checkpoints export to safetensors whose keys are
the model's. The factories live in tests/user_workloads.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import user_workloads
from safetensors.torch import load_file

from tessera.cli import main
from tessera.train import latest_checkpoint, load_checkpoint
from tessera.train.export import checkpoint_model_state
from tessera.train.metrics import read_events, read_metrics

ROOT = Path(__file__).resolve().parents[1]
# --decay-steps pinned: a --model's default decay spans its --steps, so a run extended by --resume
# would follow another schedule than one run straight to the same step
SMALL = ["--batch-size", "8", "--no-progress", "--lr", "0.01", "--warmup-steps", "2",
         "--decay-steps", "450"]  # fmt: skip
WORKLOADS = {
    # (inputs, targets) items and a user loss
    "ddp": ["--model", "user_workloads:mlp", "--data", "user_workloads:pairs",
            "--loss", "user_workloads:mse"],
    # dict items and the model's own loss
    "zero3": ["--model", "user_workloads:classifier", "--data", "user_workloads:dicts"],
    # the same, cut into two pipeline stages at a module inside the model (a traced split)
    "pipeline": ["--model", "user_workloads:classifier", "--data", "user_workloads:dicts",
                 "--split", "body.2", "--microbatches", "2"],
}  # fmt: skip


def _train(*args: str) -> None:
    assert main(["train", "--nproc", "2", *SMALL, *args]) == 0


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run_dir)
    return checkpoint_model_state(path, load_checkpoint(path))


@pytest.mark.parametrize("strategy", sorted(WORKLOADS))
def test_three_steps_then_resume_to_six_equals_six_straight(tmp_path, monkeypatch, strategy):
    workload = ["--strategy", strategy, *WORKLOADS[strategy], "--checkpoint-every", "3"]
    # the straight run also evaluates (its data as the held-out set): it must change no step
    data = WORKLOADS[strategy][WORKLOADS[strategy].index("--data") + 1]
    evaluation = ["--eval-every", "2", "--eval-batches", "2", "--eval-data", data]
    _train(*workload, *evaluation, "--steps", "6", "--out", str(tmp_path / "straight"))
    _train(*workload, "--steps", "3", "--out", str(tmp_path / "split"))
    assert main(["train", "--resume", str(tmp_path / "split"), "--steps", "6"]) == 0
    runs = ["split"]
    if strategy == "ddp":  # a rank killed at step 5, every rank restarted from step 3's save
        monkeypatch.setenv("TESSERA_FAULT", "1:5:kill")
        _train(*workload, "--steps", "6", "--max-restarts", "1", "--out", str(tmp_path / "killed"))
        monkeypatch.delenv("TESSERA_FAULT")
        assert len(read_events(tmp_path / "killed/metrics.jsonl", "restart")) == 1
        runs.append("killed")
    straight = _final(tmp_path / "straight")
    expected = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "straight/metrics.jsonl")]
    assert len(expected) == 6
    evaluated = [r for r in read_metrics(tmp_path / "straight/metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4, 6] and evaluated[-1]["val_loss"] > 0
    for run in runs:
        losses = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / run / "metrics.jsonl")]
        assert losses == expected, run
        resumed = _final(tmp_path / run)
        assert resumed.keys() == straight.keys()
        for key in straight:
            assert torch.equal(resumed[key], straight[key]), (run, key)
    assert not (tmp_path / "split" / "sample.txt").exists()  # the demo GPT's only
    # export: every key of the user's model, the trained values (ZeRO-3: consolidated shards)
    out = tmp_path / "export"
    assert main(["checkpoint", "export", str(tmp_path / "split"), str(out)]) == 0
    exported = load_file(out / "model.safetensors")
    factory = getattr(user_workloads, WORKLOADS[strategy][1].split(":")[1])
    assert sorted(exported) == sorted(factory().state_dict())  # the file sorts its keys
    for key in straight:
        assert torch.equal(exported[key], straight[key].float()), key


def test_export_of_an_earlier_step_and_refusals(tmp_path, capsys):
    _train(*WORKLOADS["ddp"], "--steps", "2", "--checkpoint-every", "1", "--out", str(tmp_path))
    out = tmp_path / "step1.safetensors"
    assert main(["checkpoint", "export", str(tmp_path), "--step", "1", str(out)]) == 0
    step1 = load_checkpoint(tmp_path / "checkpoints/step-00000001/state.pt")["engine"]["model"]
    exported = load_file(out)
    assert exported.keys() == step1.keys()
    assert all(torch.equal(exported[k], step1[k]) for k in step1)
    assert not torch.equal(exported["0.weight"], _final(tmp_path)["0.weight"])
    capsys.readouterr()
    assert main(["checkpoint", "export", str(tmp_path), "--format", "hf", str(tmp_path / "h")]) == 2
    assert "Sequential is not one (use format safetensors)" in capsys.readouterr().err
    assert main(["checkpoint", "export", str(tmp_path), "--step", "7", str(out)]) == 2
    assert "no complete checkpoint of step 7 (has [2, 1])" in capsys.readouterr().err
    # a resume with another --model or --data is refused before any rank starts
    for flag, other in (
        ("--model", "user_workloads:classifier"),
        ("--data", "user_workloads:dicts"),
    ):
        assert main(["train", "--resume", str(tmp_path), "--steps", "3", flag, other]) == 2
        field = {"--model": "model_factory", "--data": "data"}[flag]
        assert f"differing keys: {field} (" in capsys.readouterr().err


def test_a_jsonl_file_of_fields_trains(tmp_path, capsys):
    rows = [dict(user_workloads.Dicts()[i]) for i in range(32)]
    lines = [json.dumps({"features": r["features"].tolist(), "labels": r["labels"]}) for r in rows]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    model = ["--model", "user_workloads:classifier", "--data", str(tmp_path / "train.jsonl")]
    _train(*model, "--steps", "2", "--eval-data", str(tmp_path / "train.jsonl"),
           "--out", str(tmp_path / "run"))  # fmt: skip
    records = read_metrics(tmp_path / "run/metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and records[0]["loss"] > 0
    # the same file with more lines is other data: its resume is refused before any rank starts
    with (tmp_path / "train.jsonl").open("a") as file:
        file.write("\n".join(lines[:8]) + "\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", "3"]) == 2
    assert "another workload; differing: items (32 -> 40)" in capsys.readouterr().err
    assert read_metrics(tmp_path / "run/metrics.jsonl") == records


def _error(capsys, *args: str, cwd: Path) -> str:
    capsys.readouterr()
    out = cwd / "run"
    assert main(["train", "--nproc", "2", "--no-progress", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("tessera: error:") == 1
    assert not out.exists()  # refused before the run folder, so before any rank
    return err


def test_errors_stop_before_any_rank_starts(tmp_path, capsys):
    pairs, dicts = "user_workloads:pairs", "user_workloads:dicts"
    (tmp_path / "bad.jsonl").write_text('{"x": [1, 2]}\n{not json\n')
    (tmp_path / "plan.yaml").write_text("body.0: column\nbody.2: diagonal\n")
    cases = [
        (["--model", "user_workloads:nope", "--data", pairs],
         "--model 'user_workloads:nope': user_workloads has no attribute 'nope'"),
        (["--model", "no_such_module:build", "--data", pairs], "no module named 'no_such_module'"),
        (["--model", "user_workloads:mlp", "--data", str(tmp_path / "missing.txt")],
         "missing.txt: no such file or folder"),
        (["--model", "user_workloads:mlp", "--data", str(tmp_path / "bad.jsonl")],
         "bad.jsonl:2 is not JSON"),
        (["--model", "user_workloads:classifier_without_loss", "--data", dicts],
         "returned no loss for a dict item with keys ['features', 'labels']: give --loss"),
        (["--model", "user_workloads:mlp", "--data", pairs], "(inputs, targets) items need --loss"),
        (["--model", "user_workloads:mlp", "--data", "user_workloads:wrong_items",
          "--loss", "user_workloads:mse"], "items must be (inputs, targets) pairs or dicts"),
        (["--model", "user_workloads:mlp", "--data", dicts, "--loss", "user_workloads:mse"],
         "one forward and loss of --model user_workloads:mlp on one dict item"),
        (["--data", pairs], "--data goes with --model: the demo GPT trains on --corpus"),
        (["--model", "hf:GPT2LMHeadModel", "--data", pairs], "give --model-config FILE"),
        (["--model", "user_workloads:mlp", "--data", pairs, "--loss", "user_workloads:mse",
          "--strategy", "pipeline", "--split", "nope"], "--split 'nope': Sequential has no module"),
        (["--model", "user_workloads:mlp", "--data", pairs, "--loss", "user_workloads:mse",
          "--strategy", "pipeline", "--split", "2,2"], "names a module twice"),  # the policy's
        (["--model", "user_workloads:mlp", "--data", pairs, "--split", "0"],
         "--split cuts pipeline stages: strategy ddp has none"),
        (["--model", "user_workloads:mlp", "--data", pairs, "--strategy", "tensor",
          "--tp-plan", str(tmp_path / "plan.yaml")],
         "'body.2': 'diagonal' is not one of column, row, embedding"),
    ]  # fmt: skip
    for args, message in cases:
        assert message in _error(capsys, *args, cwd=tmp_path), args


def test_a_module_in_the_current_directory_trains_from_a_console_script(tmp_path):
    """A console script's sys.path starts at its bin folder, not the current directory: the
    trainer (and its ranks) import `--model mine:build` from the current directory anyway."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/tessera_entry.py").write_text(
        "import sys\nfrom tessera.cli import main\n\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"  # as pip's console scripts
    )
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.py").write_text(
        "from user_workloads import Pairs, mse\nimport torch\n"
        "def build():\n    return torch.nn.Linear(6, 2)\n"
    )
    (work / "user_workloads.py").write_text((ROOT / "tests/user_workloads.py").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = ["--model", "mine:build", "--data", "mine:Pairs", "--loss", "mine:mse", "--steps", "2"]
    done = subprocess.run(
        [sys.executable, str(tmp_path / "bin/tessera_entry.py"), "train", *args, *SMALL,
         "--nproc", "2", "--out", "run"],
        cwd=work, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "samples/s" in done.stdout and "generated for the demo GPT only" in done.stdout
    assert len(read_metrics(work / "run/metrics.jsonl")) == 2
