"""Every command README.md shows, run as written (plus flags that make the model tiny).

Each test takes its command from the README by its exact text, so a README edit that changes a
command fails here until the new command is run too; `test_every_readme_command_is_run_here`
fails for a command no test runs. `tessera` is run as `python -m tessera` (the same `main`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tessera.train.metrics import read_metrics

README = Path(__file__).resolve().parents[1] / "README.md"

TINY_MODEL = (
    "--n-layer 1 --n-embd 32 --n-head 2 --block-size 32 --batch-size 8 --corpus-bytes 50000 "
    "--sample-tokens 20 --no-progress"
).split()
"""Appended to `tessera train` commands: model and data sizes (with a small `--steps` after a
command's own, which the last one given overrides), never the options the README shows."""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
"""Two OpenMP threads per process on a loaded 2-core machine spin at every barrier: 50x slower."""

NOT_RUN = {
    "make demo": "creates a virtualenv and installs from the network; runs `tessera train`",
    "make test": "runs this suite (and creates a virtualenv)",
    "make lint": "creates a virtualenv; `ruff check .` is run by CI",
}
PLAN_COMMAND = (
    "tessera plan --cluster a100-80g-dgx --devices 1024 --layers 96 --hidden 12288 --heads 96 "
    "--seq 2048 --vocab 51200 --batch 2048 --tokens 300B --achieved-flops 140T"
)
"""Run in-process by test_plan.py::test_readme_plan_example_predicts_about_34_days."""
RUN_HERE = (
    "tessera train --help",
    "tessera train --strategy single --nproc 1",
    "tessera train --strategy torch-ddp --nproc 2 --steps 100 --out runs/a",
    "tessera train --resume runs/a --steps 200",
    "tessera train --config my.yaml --lr 1e-3",
    *(
        f"tessera run -n 4 --nnodes 2 --node-rank {node} --rdzv-endpoint host0:29500 "
        "-m tessera train --nproc 4"
        for node in (0, 1)
    ),
    "tessera train --model mymodel:build --data mymodel:train_set --loss mymodel:loss "
    "--out runs/mine",
    "tessera train --model hf:GPT2LMHeadModel --model-config gpt2-tiny.json --data corpus.txt "
    "--out runs/gpt2",
    "tessera checkpoint export runs/gpt2 --format hf gpt2-export",
    "tessera train --nproc 2 --eval-every 50 --eval-batches 8 --out runs/e",  # test_train_eval.py
    PLAN_COMMAND,
)
"""The README commands the tests below run, each through `readme(command)`."""


def readme_commands() -> list[str]:
    """The command lines of README.md's bash blocks, without comments."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    return commands


def readme(command: str) -> list[str]:
    """`command` split into words, after checking that README.md shows it exactly so."""
    assert command in readme_commands(), f"README.md no longer shows: {command}"
    assert command in RUN_HERE, f"list {command!r} in RUN_HERE"
    words = shlex.split(command)
    return [sys.executable, "-m", "tessera", *words[1:]] if words[0] == "tessera" else words


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_train_help_lists_every_option_and_strategy(tmp_path):
    out = _run(readme("tessera train --help"), tmp_path)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    options = ("--strategy", "--nproc", "--steps", "--resume", "--config", "--microbatches")
    for option in (*options, "--model", "--model-config", "--data", "--loss", "--tokenizer"):
        assert option in text
    for strategy in ("single", "torch-ddp", "ddp", "local-sgd", "zero3", "pipeline", "hybrid"):
        assert strategy in text


def test_single_process_reference_run(tmp_path):
    command = readme("tessera train --strategy single --nproc 1")
    out = _run([*command, *TINY_MODEL, "--steps", "5"], tmp_path)
    assert out.returncode == 0, out.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()  # runs/<timestamp>/
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "loss.png",
        "checkpoints/step-00000005",
        "sample.txt",
    ):
        assert (run_dir / name).exists(), name
    assert "single on 1 rank" in out.stdout
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 5


def test_two_rank_run_then_resume_to_a_later_step(tmp_path):
    first = _run(
        [
            *readme("tessera train --strategy torch-ddp --nproc 2 --steps 100 --out runs/a"),
            *TINY_MODEL,
            "--steps",
            "4",
        ],
        tmp_path,
    )
    assert first.returncode == 0, first.stderr
    assert "torch-ddp on 2 ranks" in first.stdout
    command = readme("tessera train --resume runs/a --steps 200")
    resumed = _run([*command, *TINY_MODEL, "--steps", "7"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"steps \(this run / total\)\s*│\s*3 / 7", resumed.stdout)
    rows = read_metrics(tmp_path / "runs/a/metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 8))
    assert set(rows[0]) >= {"step", "loss", "tokens_per_s", "compute_s", "comm_s", "peak_mem_mb"}
    assert len(rows[0]["peak_mem_mb"]) == 2  # one per rank
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "sample.txt"):
        assert (tmp_path / "runs/a" / name).stat().st_size > 0, name  # the README's run folder
    checkpoints = sorted(p.name for p in (tmp_path / "runs/a/checkpoints").iterdir())
    assert checkpoints == ["step-00000004", "step-00000007"]  # --keep-checkpoints 2


def test_flags_override_the_config_file(tmp_path):
    (tmp_path / "my.yaml").write_text("steps: 3\nlr: 0.5\nnproc: 1\nmodel: {n_layer: 1}\n")
    out = _run([*readme("tessera train --config my.yaml --lr 1e-3"), *TINY_MODEL], tmp_path)
    assert out.returncode == 0, out.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["lr"], saved["steps"], saved["nproc"]) == (1e-3, 3, 1)


@pytest.mark.slow
def test_two_nodes_on_loopback_as_the_readme_starts_them(tmp_path):
    """The README's two `tessera run` lines, with one process per node on 127.0.0.1, train
    like one process on the whole batch.

    torchrun's parser used to read the trainer's `--nproc` as an abbreviation of its own
    `--nproc-per-node` ("ambiguous option"), so neither node started.
    """
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = []
    for node in (0, 1):
        command = readme(
            f"tessera run -n 4 --nnodes 2 --node-rank {node} --rdzv-endpoint host0:29500 "
            "-m tessera train --nproc 4"
        )
        # tiny: one process per node (and so --nproc 1, which must equal -n), local rendezvous
        command = [{"4": "1", "host0:29500": endpoint}.get(word, word) for word in command]
        nodes.append(
            subprocess.Popen(
                [*command, *TINY_MODEL, "--steps", "3"],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
            )
        )
    outputs = []
    for process in nodes:
        try:
            out, err = process.communicate(timeout=120)
        finally:
            for other in nodes:  # a failed node leaves the other waiting at the rendezvous
                if other.poll() is None and process.returncode not in (None, 0):
                    other.kill()
        assert process.returncode == 0, err
        outputs.append(out)
    assert sum("ddp on 2 ranks" in out for out in outputs) == 1  # one world of two
    run_dir = tmp_path / "runs/torchrun-tessera"
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 3
    # and the two nodes train as one process on the whole batch: against the plain-loop oracle
    # (not bit for bit against one node of two ranks: a node of one process gives its rank both
    # cores, so its kernels sum in another order than two ranks sharing them)
    from _tolerance import check_close
    from test_trainer_oracle import oracle_run  # tests/ is on sys.path under pytest

    from tessera.train import build_config, latest_checkpoint, load_checkpoint, load_yaml

    trained = load_checkpoint(latest_checkpoint(run_dir))["engine"]["model"]
    config = build_config(load_yaml(run_dir / "config.yaml"))
    oracle, exact = oracle_run(config, "fp32"), oracle_run(config, "fp64")
    check_close(trained, oracle["state"], exact["state"], what="two nodes")


def test_library_example_runs_and_prints_what_the_readme_says(tmp_path):
    code = re.search(r"```python\n(import tessera\n.*?)```", README.read_text(), flags=re.S)[1]
    expected = re.search(r"# (\[.*?\]): every rank's return value", code)[1]
    (tmp_path / "example.py").write_text(code)
    out = _run([sys.executable, "example.py"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == expected == "[0.0, 10.0, 20.0, 30.0]"


GPT2_TINY = {  # no dropout: the logits of the export are compared with the run's own
    "vocab_size": 64, "n_positions": 32, "n_embd": 16, "n_layer": 1, "n_head": 2,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}  # fmt: skip
LOAD_WITHOUT_TESSERA = """
import sys
sys.path.append(sys.argv[1])  # transformers' site-packages only (python -I -S: no .pth files)
sys.modules["tessera"] = None  # and were tessera installed there, importing it would fail
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
with torch.no_grad():
    torch.save(model(torch.tensor([list(range(20))])).logits, sys.argv[3])
"""


@pytest.mark.slow
def test_your_model_and_data_then_an_hf_model_exported_for_transformers(tmp_path, monkeypatch):
    code = re.search(r"```python\n(# mymodel.py.*?)```", README.read_text(), flags=re.S)[1]
    (tmp_path / "mymodel.py").write_text(code)  # the README's module, in the current folder
    small = ["--steps", "2", "--batch-size", "8", "--no-progress"]
    command = readme(
        "tessera train --model mymodel:build --data mymodel:train_set --loss mymodel:loss "
        "--out runs/mine"
    )
    out = _run([*command, *small], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ddp on 2 ranks" in out.stdout and "samples/s" in out.stdout
    assert len(read_metrics(tmp_path / "runs/mine/metrics.jsonl")) == 2
    (tmp_path / "gpt2-tiny.json").write_text(json.dumps(GPT2_TINY))
    words = ["alpha", "beta", "gamma", "delta"]
    (tmp_path / "corpus.txt").write_text(" ".join(words[i * 7 % 4] for i in range(300)))
    command = readme(
        "tessera train --model hf:GPT2LMHeadModel --model-config gpt2-tiny.json --data corpus.txt "
        "--out runs/gpt2"
    )
    # one rank: the README's command as written, without paying a second launch of two ranks
    out = _run([*command, *small, "--block-size", "16", "--nproc", "1"], tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "generated for the demo GPT only" in out.stdout
    assert not (tmp_path / "runs/gpt2/sample.txt").exists()
    monkeypatch.chdir(tmp_path)  # the export in this process (transformers is imported here)
    from tessera.cli import main

    assert main(readme("tessera checkpoint export runs/gpt2 --format hf gpt2-export")[3:]) == 0
    import transformers

    site = str(Path(transformers.__file__).resolve().parents[1])
    script = tmp_path / "load.py"
    script.write_text(LOAD_WITHOUT_TESSERA)
    loaded = _run(
        [sys.executable, "-I", "-S", str(script), site, "gpt2-export", "logits.pt"],
        tmp_path,
        timeout=240,
    )
    assert loaded.returncode == 0, loaded.stderr
    # the trained weights, run in this process: the same logits
    from transformers import GPT2Config, GPT2LMHeadModel

    from tessera.train import latest_checkpoint, load_checkpoint

    model = GPT2LMHeadModel(GPT2Config(**GPT2_TINY)).eval()
    state = load_checkpoint(latest_checkpoint(tmp_path / "runs/gpt2"))["engine"]["model"]
    model.load_state_dict(state)
    with torch.no_grad():
        expected = model(torch.tensor([list(range(20))])).logits
    assert torch.equal(torch.load(tmp_path / "logits.pt"), expected)
    assert not torch.equal(
        expected,
        GPT2LMHeadModel(GPT2Config(**GPT2_TINY)).eval()(torch.tensor([list(range(20))])).logits,
    )  # fmt: skip - trained, not a fresh init
    # safetensors: the keys of model.state_dict(), the tied head included, and config.json
    from safetensors.torch import load_file

    from tessera.train.export import export_run

    file = export_run(tmp_path / "runs/gpt2", tmp_path / "st", format="safetensors")
    assert sorted(load_file(file)) == sorted(model.state_dict())
    assert "lm_head.weight" in load_file(file)
    assert json.loads((tmp_path / "st/config.json").read_text())["n_embd"] == 16


def test_every_readme_command_is_run_here():
    """Every command of README.md is run by a test above or excused in NOT_RUN."""
    missing = set(readme_commands()) - set(RUN_HERE) - set(NOT_RUN)
    assert not missing, f"README.md commands no test runs: {sorted(missing)}"
    assert set(readme_commands()) >= set(RUN_HERE) | set(NOT_RUN)
