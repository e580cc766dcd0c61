"""A strategy declares what it can do, and the trainer reads the declaration, never its name.

A toy strategy registered from this file (`register_strategy`, its `Capabilities` on its policy
class) gets, with no edit in tessera: its policy's field as a `tessera train` flag and YAML key,
checked by its policy before any rank starts; an elastic restart on fewer ranks, which resumes
its checkpoint on another world size; `tessera checkpoint export`. An undeclared twin is refused
the restart and the resume, with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tessera.checkpoint.files import load_checkpoint
from tessera.checkpoint.series import latest_checkpoint
from tessera.cli import main
from tessera.errors import ConfigError
from tessera.strategies import registry
from tessera.strategies.capabilities import Capabilities
from tessera.train import build_config, run_training
from tessera.train.metrics import read_events, read_metrics
from tessera.train.restarts import check_restart_options
from tessera.train.resume_rules import check_resume_world

TINY = (
    "--n-layer 1 --n-embd 16 --n-head 2 --block-size 16 --batch-size 4 --corpus-bytes 5000 "
    "--sample-tokens 0 --no-progress --checkpoint-every 1 --lr-schedule constant"
).split()

BUILT: list[Any] = []
"""The policies the toy's builder was given in this process."""


@dataclass(kw_only=True, frozen=True)
class ToyPolicy:
    """The toy's knob, with its one default and its one check."""

    capabilities: ClassVar[Capabilities] = Capabilities(elastic=True, resume_any_world=True)
    toy_width: int = field(default=3, metadata={"help": "The toy's width (a test knob)."})

    def __post_init__(self) -> None:
        if self.toy_width < 1:
            raise ValueError(f"toy_width must be at least 1, got {self.toy_width}")


@dataclass(kw_only=True, frozen=True)
class BoundPolicy:
    """A strategy that declares nothing: what tessera assumes of an unknown one."""


def build_toy(model, optimizer_factory, ctx, *, loss_fn=None, grad_clip=0.0, policy=None):
    """PyTorch's DDP under another name; records the policy it was given."""
    from tessera.strategies.torch_ddp import TorchDDPEngine

    BUILT.append(policy)
    return TorchDDPEngine(model, optimizer_factory, ctx, loss_fn=loss_fn, grad_clip=grad_clip)


def _register() -> None:
    """Register both toys in this process (once)."""
    if "toy" not in registry._user_strategies:
        registry.register_strategy("toy", policy=ToyPolicy)(build_toy)
        registry.register_strategy("toy-bound", policy=BoundPolicy)(build_toy)


class RegisterToys:
    """A callback whose unpickling registers the toys in a spawned rank (the user's module
    registering its strategy at import does the same)."""

    def __getstate__(self) -> dict[str, Any]:
        return {"register": True}  # (an empty state would skip __setstate__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        _register()

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Nothing: it only brings the registration along."""


@pytest.fixture
def toys(monkeypatch):
    """The toys registered in this process for one test (the registry restored after)."""
    monkeypatch.setattr(registry, "_user_strategies", {})
    _register()
    BUILT.clear()


def test_a_registered_strategy_gets_its_flags_checked_by_its_policy(toys, tmp_path, capsys):
    monkeypatch_chdir = pytest.MonkeyPatch()
    monkeypatch_chdir.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit):
            main(["train", "--help"])
        assert re.search(r"--toy-width TOY_WIDTH\s+The toy's width", capsys.readouterr().out)
        # its policy checks the value, once, before any rank starts
        assert main(["train", "--strategy", "toy", "--toy-width", "0", *TINY]) == 2
        err = capsys.readouterr().err
        assert err == "tessera: error: strategy toy: toy_width must be at least 1, got 0\n"
        assert BUILT == [] and not (tmp_path / "runs").exists()
        assert main(["train", "--strategy", "toy", "--toy-width", "5", "--nproc", "1",
                     "--steps", "2", "--out", "run", *TINY]) == 0  # fmt: skip
    finally:
        monkeypatch_chdir.undo()
    assert BUILT == [ToyPolicy(toy_width=5)]
    saved = yaml.safe_load((tmp_path / "run/config.yaml").read_text())
    assert saved["options"] == {"toy_width": 5}
    # the YAML key is the same option; a key its policy lacks is refused by name
    assert build_config({"strategy": "toy", "options": {"toy_width": 7}}).options["toy_width"] == 7
    with pytest.raises(ConfigError, match="strategy 'toy' has no option 'depth'"):
        build_config({"strategy": "toy", "options": {"depth": 7}})
    with pytest.raises(ConfigError, match=r"are its flags \['--comm-algorithm'\]"):
        build_config({"strategy": "ddp", "options": {"algorithm": "ring"}})  # one way to set it
    # export: the trained model of the checkpoint, as for tessera's own strategies
    assert main(["checkpoint", "export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out/model.safetensors")
    weights = load_checkpoint(latest_checkpoint(tmp_path / "run"))["engine"]["model"]
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[key], weights[key]) for key in weights)


def test_a_declared_elastic_strategy_restarts_on_fewer_ranks_and_resumes_there(
    toys, tmp_path, monkeypatch
):
    config = build_config(
        {"strategy": "toy", "nproc": 2, "steps": 3, "out": str(tmp_path / "run")},
        {"model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16}},
        {"batch_size": 4, "corpus_bytes": 5000, "sample_tokens": 0, "progress": False},
        {"checkpoint_every": 1, "options": {"toy_width": 2}},
    )
    bound = build_config({"strategy": "toy-bound", "nproc": 2})
    check_restart_options(config, 1, min_nproc=1)
    refused = r"'toy-bound' cannot change its world size .*elastic strategies: ddp, torch-ddp, toy,"
    with pytest.raises(ConfigError, match=refused):
        check_restart_options(bound, 1, min_nproc=1)
    check_resume_world("toy", 2, 1)
    with pytest.raises(ConfigError, match="it is not known to reshard its checkpoints"):
        check_resume_world("toy-bound", 2, 1)
    # rank 1 dies at step 2: the restart runs on one rank from the checkpoint of step 1
    monkeypatch.setenv("TESSERA_FAULT", "1:2:kill")
    summary = run_training(config, max_restarts=1, min_nproc=1, callbacks=[RegisterToys()])
    assert summary is not None and (summary["steps"], summary["restarts"]) == (3, 1)
    restarts = read_events(tmp_path / "run/metrics.jsonl", "restart")
    assert [(r["step"], r["rank"]) for r in restarts] == [(1, 1)], restarts
    records = read_metrics(tmp_path / "run/metrics.jsonl")
    ranks = [(r["step"], len(r["peak_mem_mb"])) for r in records]
    assert ranks == [(1, 2), (2, 1), (3, 1)]  # resumed on one rank the checkpoint of two
