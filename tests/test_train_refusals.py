"""What a user gets wrong on the command line is refused up front, in one message.

Each was accepted before, or failed late with a bare error: a resume asked to stop before the
steps already done, a new run of another model over a run folder that logged steps (but holds no
checkpoint yet), an abbreviated flag (`--strat`), a misspelt `--model-config` key (building the
default model), a vocabulary larger than the model's embedding (an IndexError at some batch), and
`engine.load` of a folder another strategy saved (a bare KeyError).
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from torch import nn

import tessera
from tessera.cli import main
from tessera.train.config import load_yaml

USER = ["--data", "user_workloads:pairs", "--loss", "user_workloads:mse", "--batch-size", "8",
        "--no-progress", "--strategy", "single", "--nproc", "1"]  # fmt: skip


def _refused(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["train", *args]) == 2, args
    err = capsys.readouterr().err
    assert err.count("tessera: error:") == 1, err
    return err


def test_resume_below_the_done_steps_and_another_model_over_a_logged_run(tmp_path, capsys):
    run = tmp_path / "run"
    mlp = ["--model", "user_workloads:mlp", *USER, "--out", str(run)]
    assert main(["train", *mlp, "--steps", "4"]) == 0
    err = _refused(capsys, *mlp, "--steps", "2", "--resume", str(run))
    assert "has done 4 steps" in err and "give at least 4" in err, err
    assert load_yaml(run / "config.yaml")["steps"] == 4  # nothing rewritten
    # the run died before its first checkpoint: steps logged, nothing to resume
    shutil.rmtree(run / "checkpoints")
    probe = ["--model", "user_recipes:probe", *USER, "--out", str(run), "--steps", "2"]
    err = _refused(capsys, *probe)
    assert "holds another run (4 logged steps" in err, err
    assert "model_factory ('user_workloads:mlp' -> 'user_recipes:probe')" in err, err
    assert load_yaml(run / "config.yaml")["model_factory"] == "user_workloads:mlp"
    assert main(["train", *mlp, "--steps", "4"]) == 0  # the same run may start over


def test_abbreviated_flags_are_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--strat", "zero2", "--steps", "1"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --strat zero2" in capsys.readouterr().err


def test_config_typo_warns_and_a_small_vocabulary_is_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 20)  # 28 characters
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps({
        "n_layer": 1, "n_head": 2, "n_embd": 8, "n_positions": 16, "vocab_size": 20,
        "num_hiden_layers": 1,
    }))  # fmt: skip
    args = ["--model", "hf:GPT2LMHeadModel", "--model-config", str(config), "--data", str(text),
            "--block-size", "8", "--batch-size", "4", "--nproc", "1", "--strategy", "single",
            "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    with pytest.warns(UserWarning, match=r"does not know \['num_hiden_layers'\]"):
        err = _refused(capsys, *args)
    assert "embeds 20 token ids (vocab_size) but the tokenizer of --data" in err, err
    assert "has 28 tokens: set vocab_size to at least 28 in --model-config" in err, err
    assert not (tmp_path / "run").exists()
    config.write_text(json.dumps({"n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 28}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # known keys: no warning
        assert main(["train", *args, "--steps", "1", "--sample-tokens", "0"]) == 0


def _engine(strategy: str) -> tessera.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return tessera.setup(
        model, lambda p: torch.optim.AdamW(p, lr=0.1), strategy=strategy,
        loss_fn=nn.functional.mse_loss,
    )  # fmt: skip


def test_loading_another_strategys_folder_names_both(tmp_path):
    messages = {
        ("zero1", "single"): "was saved by zero1, whose files this single engine cannot read "
        r"\(it looks for 'model'\); load it with strategy zero1",
        ("single", "zero1"): "holds no ZeRO shards: it was not saved by a ZeRO engine",
    }
    for (saver, loader), message in messages.items():
        saved = _engine(saver)
        saved.train_step((torch.randn(4, 3), torch.randn(4, 2)))
        saved.step()
        saved.save(tmp_path / saver)
        saved.close()
        engine = _engine(loader)
        with pytest.raises(ValueError, match=message):
            engine.load(tmp_path / saver)
        engine.close()
