"""Model-parallel runs a model cannot take are refused before any rank starts, naming the flag.

Before, each was a ValueError raised in every rank after the processes had started (a traceback
per rank, naming `split=` / `plan=`, the library's arguments, not the flags): a pipeline of a
model that is no `nn.Sequential` without `--split`, tensor parallelism of a model without a
built-in plan and no `--tp-plan`, a plan pattern that matches no module, and a column-parallel
conv whose split output meets a BatchNorm (which holds every channel's statistics) before the
row conv. `tessera.setup` refuses the last one too, before it changes the model.
"""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.cli import main
from tessera.tensor_parallel import check_plan

PAIRS = ["--data", "user_workloads:pairs", "--loss", "user_workloads:mse"]
IMAGES = ["--data", "user_recipes:images", "--loss", "user_recipes:cross_entropy"]
CONV_PLAN = {"conv1": "column", "conv2": "row"}


def _refused(tmp_path, capsys, *args: str) -> str:
    out = tmp_path / "run"
    capsys.readouterr()
    argv = ["train", "--nproc", "2", "--batch-size", "8", "--no-progress", "--out", str(out)]
    assert main([*argv, *args]) == 2, args
    err = capsys.readouterr().err
    assert err.count("tessera: error:") == 1, err
    assert "Traceback" not in err
    assert not out.exists()  # refused before the run folder: no rank, no hang-rank-N.json
    return err


def test_pipeline_and_tensor_refusals_name_the_flags(tmp_path, capsys):
    (tmp_path / "nothing.yaml").write_text("'nope.*': column\n")
    (tmp_path / "conv.yaml").write_text("conv1: column\nconv2: row\n")
    cases = [
        (["--model", "user_workloads:classifier", "--data", "user_workloads:dicts",
          "--strategy", "pipeline"],
         "cuts --model user_workloads:classifier (a Classifier) into 2 stages: give --split"),
        (["--model", "user_workloads:mlp", *PAIRS, "--strategy", "tensor"],
         "(a Sequential) has no built-in plan, give --tp-plan FILE"),
        (["--model", "user_workloads:mlp", *PAIRS, "--strategy", "tensor",
          "--tp-plan", str(tmp_path / "nothing.yaml")],
         "nothing.yaml: plan pattern 'nope.*' matches no submodule"),
        (["--model", "user_recipes:conv_net", *IMAGES, "--strategy", "tensor",
          "--tp-plan", str(tmp_path / "conv.yaml")],
         "bn1: a BatchNorm2d after the column-parallel conv conv1"),
    ]  # fmt: skip
    for args, message in cases:
        err = _refused(tmp_path, capsys, *args)
        assert message in err, (args, err)
        assert "split=" not in err and "plan=" not in err, err


def test_setup_refuses_a_norm_inside_a_split_conv_pair_and_leaves_the_model():
    import user_recipes

    model = user_recipes.conv_net()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match="bn1: a BatchNorm2d after the column-parallel conv"):
        tessera.setup(
            model, lambda p: torch.optim.SGD(p, lr=0.1), strategy="tensor", plan=CONV_PLAN,
            loss_fn=torch.nn.functional.cross_entropy,
        )  # fmt: skip
    assert isinstance(model.conv1, torch.nn.Conv2d)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the launcher's check, no process group: the same refusal; a plan without the pair passes
    with pytest.raises(ValueError, match="bn1: a BatchNorm2d after the column-parallel conv"):
        check_plan(model, CONV_PLAN, 2)
    check_plan(model, {"head": "column"}, 2)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        check_plan(model, {"head": "column"}, 3)


def test_a_rank_failing_on_its_own_leaves_no_hang_records(tmp_path, capsys):
    """Rank 1 raises a ValueError building the model; rank 0, waiting for it in DDP's first
    broadcast, is stopped (or sees the link close). Nothing hung: no hang-rank-N.json stays."""
    out = tmp_path / "run"
    argv = ["train", "--nproc", "2", "--batch-size", "8", "--no-progress", "--out", str(out),
            "--model", "user_recipes:fails_on_rank_one", *PAIRS, "--strategy", "ddp"]  # fmt: skip
    assert main(argv) == 2
    assert "this model cannot be built on rank 1" in capsys.readouterr().err
    assert (out / "config.yaml").is_file()  # the ranks ran
    assert sorted(p.name for p in out.glob("hang-rank-*.json")) == []
