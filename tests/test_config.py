"""Config: YAML + flags precedence, and every bad input refused with one message, before spawn."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import tessera.train
from tessera.cli import main
from tessera.errors import ConfigError
from tessera.train import build_config, load_yaml, register_strategy


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\nlr: 0.1\nmodel:\n  n_layer: 2\n  n_embd: 64\n")
    config = build_config(load_yaml(path), {"steps": 9, "model": {"n_embd": 32}})
    assert (config.steps, config.lr, config.model.n_layer, config.model.n_embd) == (9, 0.1, 2, 32)
    assert config.batch_size == 32 and config.model.n_head == 4  # defaults kept
    # the demo (`make demo`: `tessera train` with its defaults) runs tessera's own engine;
    # PyTorch's DDP stays the anchor under --strategy torch-ddp (issue 11)
    assert config.strategy == "ddp"


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("bogus: 1\n", [], "unknown config key 'bogus'"),
        ("model:\n  n_layers: 2\n", [], "unknown config key 'model.n_layers'"),
        ('steps: "ten"\n', [], "config key 'steps' must be int, got 'ten'"),
        ("", ["--nproc", "0"], "nproc must be at least 1, got 0"),
        (
            "",
            ["--nproc", "4", "--batch-size", "10"],
            r"batch_size \(10\) must be divisible by the number of ranks \(4\)",
        ),
        ("", ["--corpus", "/no/such/corpus.txt"], "corpus not found: /no/such/corpus.txt"),
        ("", ["--strategy", "single"], "strategy 'single' runs one process; got 2 ranks"),
        ("", ["--strategy", "zero9"], "unknown strategy 'zero9'"),
        ("", ["--n-embd", "30"], r"model.n_embd \(30\) must be divisible by model.n_head \(4\)"),
        ("", ["--lr", "-1"], "lr must be positive, got -1.0"),
        ("- a\n- b\n", [], "must hold a mapping"),
        (
            "",
            ["--strategy", "hybrid", "--nproc", "4", "--dp", "3"],
            r"dp x tp x pp = 3 x 1 x 1 does not equal the 4 ranks",
        ),
        ("", ["--schedule", "zigzag"], "unknown pipeline schedule 'zigzag'"),
        ("", ["--strategy", "hybrid", "--zero", "3"], "zero must be 0, 1 or 2 inside pipeline"),
        # What the model-parallel engines refused only once the ranks had started:
        (
            "",
            ["--strategy", "pipeline", "--microbatches", "64"],
            r"microbatches \(64\) must not exceed the batch each pipeline splits: "
            r"batch_size 32 / dp 1 = 32",
        ),
        (
            "",
            ["--strategy", "hybrid", "--nproc", "4", "--dp", "2", "--microbatches", "17"],
            r"microbatches \(17\) must not exceed .* batch_size 32 / dp 2 = 16",
        ),
        (
            "",
            ["--strategy", "tensor", "--nproc", "4", "--n-head", "2", "--n-embd", "32"],
            r"model.n_head \(2\) must be divisible by the tensor-parallel degree \(4\)",
        ),
        (
            "",
            "--strategy hybrid --nproc 4 --tp 4 --n-head 6 --n-embd 96".split(),
            r"model.n_head \(6\) must be divisible by the tensor-parallel degree \(4\)",
        ),
        (
            "",
            ["--strategy", "pipeline", "--nproc", "4", "--n-layer", "1"],
            r"4 pipeline stages need at least 2 blocks .*model.n_layer is 1",
        ),
    ],
)
def test_bad_config_stops_with_one_message_before_any_process(
    tmp_path, monkeypatch, capsys, yaml_text, flags, message
):
    monkeypatch.chdir(tmp_path)
    import tessera.train.restarts
    import tessera.train.run

    def no_ranks(*_args, **_kwargs):
        raise AssertionError("a rank was started for a config that cannot run")

    monkeypatch.setattr(tessera.train.restarts, "launch", no_ranks)
    monkeypatch.setattr(tessera.train.run, "train_worker", no_ranks)
    (tmp_path / "run.yaml").write_text(yaml_text)
    assert main(["train", "--config", "run.yaml", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: ") and err.count("\n") == 1
    assert re.search(message, err), err
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_missing_config_file_and_resume_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "absent.yaml"]) == 2
    assert "config file not found: absent.yaml" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", "empty"]) == 2
    assert "cannot resume empty: no config.yaml there" in capsys.readouterr().err


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        build_config({"steps": 0})
    with pytest.raises(ConfigError, match="dropout must be in"):
        build_config({"model": {"dropout": 1.5}})


def _fresh_modules(code: str, prefix: tuple[str, ...] = ("tessera",)) -> list[str]:
    """The tessera modules a fresh interpreter has loaded after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return [m for m in json.loads(out.stdout.splitlines()[-1]) if m.startswith(prefix)]


ENGINE_PACKAGES = ("tessera.zero", "tessera.pipeline", "tessera.data_parallel", "tessera.tensor_")
HEAVY = ("torch.distributed.pipelining", "tessera.train.loop", "tessera.train.engine_setup")
"""What validating a config must not load. Each strategy is declared in its adapter file, so the
config's knobs and each strategy's capabilities load the adapters (about half a second after
torch); torch's pipelining (about two seconds) loads only when a model is traced into stages,
and the trainer's loop only when training starts."""


def test_validating_a_config_loads_the_declarations_not_the_tracer_or_the_loop():
    loaded = _fresh_modules(
        "import tessera.train.config_build as c\n"
        "c.build_config({'strategy': 'hybrid', 'nproc': 4, 'dp': 2})\n"
        "c.build_config({'strategy': 'zero3'})\n"
        "from tessera.train import STRATEGIES\n"
        "assert 'pipeline' in STRATEGIES and len(STRATEGIES) >= 10",
        prefix=("tessera", "torch.distributed.pipelining"),
    )
    assert "tessera.train.config" in loaded
    assert [m for m in loaded if m.startswith(HEAVY)] == []
    # the knobs' homes, and the adapters that declare the strategies
    assert {"tessera.zero.policy", "tessera.pipeline.policy", "tessera.strategies.zero"} <= set(
        loaded
    )


def test_strategy_interface_imports_none_of_its_engines():
    # The old train/strategy.py imported every engine at its bottom, and the engines import it
    # for their base class: a cycle. Now the registry names engines by "module:attribute", and
    # the Engine protocol and `setup` sit in tessera.strategies, above the libraries.
    loaded = _fresh_modules(
        "import tessera.strategies.engine, tessera.strategies.registry, tessera.strategies.entry"
    )
    assert [m for m in loaded if m.startswith(ENGINE_PACKAGES)] == []


def test_registry_loads_each_builtin_on_lookup_and_takes_user_strategies(monkeypatch):
    from tessera.strategies import registry
    from tessera.strategies.engine import Engine, NoOptions

    declared = {
        "single": "Engine",
        "torch-ddp": "TorchDDPEngine",
        "ddp": "DDPEngine",
        "local-sgd": "LocalSGDEngine",
        "zero1": "Zero1Engine",
        "zero2": "Zero2Engine",
        "zero3": "Zero3Engine",
        "pipeline": "PipelineEngine",
        "tensor": "TensorEngine",
        "hybrid": "PipelineEngine",
    }
    assert {name: factory.__name__ for name, factory in registry.STRATEGIES.items()} == declared
    policies = {name: registry.policy_class(name).__name__ for name in declared}
    assert policies == {
        "single": "NoOptions",
        "torch-ddp": "TorchDDPPolicy",
        "ddp": "DDPPolicy",
        "local-sgd": "LocalSGDPolicy",
        "zero1": "ZeroPolicy",
        "zero2": "ZeroPolicy",
        "zero3": "ZeroPolicy",
        "pipeline": "PipelinePolicy",
        "tensor": "TensorPolicy",
        "hybrid": "HybridPolicy",
    }
    monkeypatch.setattr(registry, "_user_strategies", {})

    @register_strategy("mine")
    class Mine(Engine):
        pass

    assert tessera.train.STRATEGIES["mine"] is Mine and "mine" in registry.strategy_names()
    assert registry.policy_class("mine") is NoOptions
    assert build_config({"strategy": "mine", "nproc": 1}).strategy == "mine"
    for taken in ("mine", "zero2"):
        with pytest.raises(ValueError, match=f"strategy '{taken}' is registered twice"):
            register_strategy(taken)(Mine)
    with pytest.raises(KeyError, match="unknown strategy 'nope'"):
        registry.STRATEGIES["nope"]


def test_under_torchrun_the_config_is_checked_against_its_world(monkeypatch):
    # A worker of `tessera run --nnodes 2 -n 4`: 8 ranks, 4 on this machine (nproc = 4).
    monkeypatch.delenv("TESSERA_INIT_FILE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"must be divisible by the number of ranks \(8\)"):
        build_config({"nproc": 4, "batch_size": 12})
    with pytest.raises(ConfigError, match="dp x tp x pp = 2 x 2 x 1 does not equal the 8 ranks"):
        build_config({"strategy": "hybrid", "nproc": 4, "dp": 2, "tp": 2, "pp": 1})
    assert build_config({"strategy": "hybrid", "nproc": 4, "dp": 2, "tp": 2}).nproc == 4
    # tessera's own launcher sets WORLD_SIZE too, with its store file: then nproc is the world
    monkeypatch.setenv("TESSERA_INIT_FILE", "/tmp/store")
    assert build_config({"nproc": 4, "batch_size": 12}).batch_size == 12
