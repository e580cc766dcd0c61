"""A knob's whole declaration lives on its policy field, and the trainer's flags are generated
from it without changing a single one.

`TrainConfig`'s strategy knobs (`--bucket-cap-mb`, `--schedule`, `--servers`...) and each of
tessera's strategies' `Capabilities.options` are generated from the policy fields that declare
them (`tessera.strategies.knobs`). These tests hold the generation to what the hand-written lists
were (captured below from main before the move), and each knob to exactly one declaring field.
A built-in strategy is declared in its adapter file, found there by the registry, which spells
no strategy's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from tessera import errors as tessera_errors
from tessera.cli import _parser
from tessera.strategies.capabilities import FOLDED
from tessera.strategies.knobs import declared_knobs, home_of, knob_name
from tessera.strategies.registry import (
    BUILTIN_STRATEGIES,
    OWN_ENTRY_POINTS,
    builtin_policies,
    capabilities,
)
from tessera.train.config import TrainConfig

FLAGS_BEFORE: dict[str, str] = {
    "--config": "None",
    "--resume": "None",
    "--max-restarts": "0",
    "--min-nproc": "None",
    "--strategy": "'ddp'",
    "--nproc": "2",
    "--steps": "450",
    "--seed": "0",
    "--batch-size": "32",
    "--grad-accum": "1",
    "--optimizer": "'adamw'",
    "--optimizer-args": "None",
    "--lr-schedule": "'cosine'",
    "--lr": "0.003",
    "--warmup-steps": "10",
    "--decay-steps": "None",
    "--weight-decay": "0.1",
    "--grad-clip": "1.0",
    "--bucket-cap-mb": "25.0",
    "--comm-algorithm": "'auto'",
    "--find-unused-parameters --no-find-unused-parameters": "False",
    "--average-every": "8",
    "--mixed-precision": "None",
    "--loss-scale-init": "65536.0",
    "--loss-scale-growth-interval": "2000",
    "--offload": "None",
    "--nvme-dir": "None",
    "--nvme-buffer-mb": "64.0",
    "--offload-params --no-offload-params": "False",
    "--offload-moments": "'fp32'",
    "--delayed-update --no-delayed-update": "False",
    "--delayed-update-after": "40",
    "--meta-init --no-meta-init": "True",
    "--activation-checkpointing --no-activation-checkpointing": "False",
    "--compile --no-compile": "False",
    "--dp": "1",
    "--tp": "1",
    "--pp": "0",
    "--zero": "0",
    "--microbatches": "4",
    "--schedule": "'1f1b'",
    "--virtual-stages": "1",
    "--servers": "1",
    "--workers": "2",
    "--consistency": "'bsp'",
    "--staleness": "2",
    "--slow-worker": "None",
    "--model": "None",
    "--model-config": "None",
    "--data": "None",
    "--tokenizer": "None",
    "--loss": "None",
    "--eval-data": "None",
    "--split": "None",
    "--tp-plan": "None",
    "--corpus": "'stdlib'",
    "--corpus-bytes": "1000000",
    "--log-every": "1",
    "--checkpoint-every": "50",
    "--keep-checkpoints": "2",
    "--sample-tokens": "200",
    "--timeout-s": "300.0",
    "--out": "None",
    "--progress --no-progress": "True",
    "--eval-every": "0",
    "--eval-batches": "0",
    "--log-with": "None",
    "--n-layer": "4",
    "--n-head": "4",
    "--n-embd": "128",
    "--block-size": "128",
    "--dropout": "0.0",
    "--num-workers": "-1",
    "--epochs": "0",
    "--collate": "None",
    "--input-keys": "None",
    "--target-keys": "None",
}
"""Every `tessera train` flag (with its --no- form) -> repr of its default, as main had them
before the knobs moved onto the policies (config flags: the config field's default)."""

_ZERO_OFFLOAD = {
    "offload": "offload",
    "nvme_dir": FOLDED,
    "nvme_buffer_mb": FOLDED,
    "offload_moments": FOLDED,
    "delayed_update": FOLDED,
    "delayed_update_after": FOLDED,
}
_PIPELINE = {
    "split": "split",
    "microbatches": "microbatches",
    "schedule": "schedule",
    "virtual_stages": "virtual_stages",
}
OPTIONS_BEFORE: dict[str, dict[str, str]] = {
    "single": {},
    "torch-ddp": {"find_unused_parameters": "find_unused_parameters"},
    "ddp": {
        "bucket_cap_mb": "bucket_cap_mb",
        "comm_algorithm": "algorithm",
        "find_unused_parameters": "find_unused_parameters",
    },
    "local-sgd": {"average_every": "average_every", "comm_algorithm": "algorithm"},
    "zero1": {"bucket_cap_mb": "bucket_cap_mb", **_ZERO_OFFLOAD},
    "zero2": {"bucket_cap_mb": "bucket_cap_mb", **_ZERO_OFFLOAD},
    "zero3": {"bucket_cap_mb": "bucket_cap_mb", **_ZERO_OFFLOAD, "offload_params": FOLDED},
    "pipeline": _PIPELINE,
    "tensor": {"tp_plan": "plan"},
    "hybrid": {
        "dp": "dp",
        "tp": "tp",
        "pp": "pp",
        "zero": "zero",
        "tp_plan": "plan",
        "bucket_cap_mb": "bucket_cap_mb",
        "find_unused_parameters": "find_unused_parameters",
        **_PIPELINE,
    },
    "ps": {
        name: name for name in ("servers", "workers", "consistency", "staleness", "slow_worker")
    },
}
"""Each built-in strategy's `Capabilities.options`, as registry.py listed them by hand."""


def _train_parser() -> argparse.ArgumentParser:
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["train"]


def _config_default(dest: str) -> object:
    cls, *path, leaf = [TrainConfig, *dest.split(".")]
    for name in path:
        cls = typing.get_type_hints(cls)[name]
    if leaf not in cls.__dataclass_fields__:  # (--config, --resume...: the parser's own)
        return None
    field = cls.__dataclass_fields__[leaf]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def test_the_train_flags_and_their_defaults_are_unchanged():
    flags = {}
    for action in _train_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        default = _config_default(action.dest)
        if action.dest in ("max_restarts", "min_nproc"):
            default = action.default
        flags[" ".join(action.option_strings)] = repr(default)
    assert flags == FLAGS_BEFORE


def test_the_builtin_strategies_options_are_derived_as_they_were_listed():
    names = [*BUILTIN_STRATEGIES, *OWN_ENTRY_POINTS]
    assert {name: dict(capabilities(name).options) for name in names} == OPTIONS_BEFORE


def test_every_config_knob_comes_from_exactly_one_policy_field():
    knobs = {f.name: f for f in dataclasses.fields(TrainConfig) if "policy" in f.metadata}
    declared = declared_knobs(builtin_policies())
    assert set(knobs) == set(declared)
    hints = typing.get_type_hints(TrainConfig)
    own = TrainConfig.__dict__["__annotations__"]  # (the fields TrainConfig writes itself)
    for name, knob in knobs.items():
        policy, field_name = knob.metadata["policy"]
        home = policy.__dataclass_fields__[field_name]
        assert name not in own, f"{name}: declared on {policy.__name__}, not in TrainConfig"
        assert knob.metadata["help"] == home.metadata["help"], name
        assert knob.default == home.default, name
        policy_type = typing.get_type_hints(policy)[field_name]
        assert hints[name] == home.metadata.get("config_type", policy_type), name
        assert knob_name(policy, field_name) == name
    # every other policy field that is one of these knobs points at that one home
    homes = {(d.policy, d.field) for d in declared.values()}
    for policy in _every_policy():
        for field in dataclasses.fields(policy):
            if knob_name(policy, field.name) is None:
                continue
            assert home_of(policy, field.name) in homes, (policy.__name__, field.name)
            if home_of(policy, field.name) != (policy, field.name):
                assert "help" not in field.metadata, (policy.__name__, field.name)
                home, home_field = home_of(policy, field.name)
                assert field.default == home.__dataclass_fields__[home_field].default


def _every_policy() -> list[type]:
    found, pending = [], list(builtin_policies())
    while pending:
        policy = pending.pop()
        if policy in found or not dataclasses.is_dataclass(policy):
            continue
        found.append(policy)
        pending += [
            f.metadata["folds"] for f in dataclasses.fields(policy) if "folds" in f.metadata
        ]
        pending += [t for t in typing.get_type_hints(policy).values() if isinstance(t, type)]
    return found


TOY_ADAPTER = '''
"""A built-in strategy's adapter file, as a new one would be written: nothing else is edited."""
from dataclasses import dataclass, field

from tessera.strategies.capabilities import Capabilities
from tessera.strategies.engine import Engine
from tessera.strategies.registry import declare_strategy


@dataclass(kw_only=True, frozen=True)
class ToyDepthPolicy:
    toy_depth: int = field(default=2, metadata={"help": "toy-builtin: the depth (a test knob)."})

    def __post_init__(self) -> None:
        if self.toy_depth < 1:
            raise ValueError(f"toy_depth must be at least 1, got {self.toy_depth}")


declare_strategy(
    "toy-builtin", Engine, policy=ToyDepthPolicy, capabilities=Capabilities(elastic=True)
)
'''


def test_a_builtin_strategy_is_declared_in_its_adapter_file_and_found_there(tmp_path, monkeypatch):
    import sys

    import tessera.strategies as package
    from tessera.strategies import registry
    from tessera.strategies.engine import Engine
    from tessera.strategies.entry import make_policy

    (tmp_path / "toy_builtin_adapter.py").write_text(TOY_ADAPTER)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    # the adapters already imported keep their declarations; the registry looks again
    monkeypatch.setattr(registry, "_declared", dict(registry._builtins()))
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.delitem(sys.modules, "tessera.strategies.toy_builtin_adapter", raising=False)
    try:
        assert "toy-builtin" in registry.strategy_names()
        assert registry.STRATEGIES["toy-builtin"] is Engine
        caps = registry.capabilities("toy-builtin")
        assert caps.elastic and dict(caps.options) == {"toy_depth": "toy_depth"}
        knob = declared_knobs(registry.builtin_policies())["toy_depth"]  # a config field, a flag
        assert (knob.default, knob.help) == (2, "toy-builtin: the depth (a test knob).")
        with pytest.raises(ValueError, match="toy_depth must be at least 1"):
            make_policy("toy-builtin", {"toy_depth": 0})
    finally:
        sys.modules.pop("tessera.strategies.toy_builtin_adapter", None)


def test_the_registry_spells_no_strategy_name():
    import ast
    import inspect

    from tessera.strategies import capabilities as capabilities_module
    from tessera.strategies import registry

    names = {*BUILTIN_STRATEGIES, *OWN_ENTRY_POINTS}
    for module in (registry, capabilities_module):
        tree = ast.parse(inspect.getsource(module))
        spelled = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names
        }
        assert not spelled, (
            f"{module.__name__} names strategies {spelled}: declare them in adapters"
        )


def test_a_renamed_knob_keeps_its_old_flag_and_key_with_one_deprecation_line(monkeypatch, capsys):
    from dataclasses import dataclass, field

    from tessera.train import build_config, config_knobs
    from tessera.train.config_flags import flag_layer

    @dataclass(kw_only=True, frozen=True)
    class Renamed:
        width: int = field(default=1, metadata={"help": "w", "old_names": ("breadth",)})

    assert config_knobs.renamed(declared_knobs([Renamed])) == {"breadth": "width"}
    # as if DDPPolicy's fields said old_names=("bucket_mb",) and ("unused_ok",)
    renames = {"bucket_mb": "bucket_cap_mb", "unused_ok": "find_unused_parameters"}
    monkeypatch.setattr(config_knobs, "RENAMED", renames)
    parser = _train_parser()
    args = parser.parse_args(["--bucket-mb", "5", "--no-unused-ok", "--steps", "3"])
    assert flag_layer(args) == {"bucket_cap_mb": 5.0, "find_unused_parameters": False, "steps": 3}
    assert capsys.readouterr().err.splitlines() == [
        "tessera: --bucket-mb is deprecated: use --bucket-cap-mb",
        "tessera: --no-unused-ok is deprecated: use --no-find-unused-parameters",
    ]
    assert "--bucket-mb" not in parser.format_help()
    config = build_config({"strategy": "ddp", "bucket_mb": 7.0}, {"unused_ok": True})
    assert (config.bucket_cap_mb, config.find_unused_parameters) == (7.0, True)
    assert capsys.readouterr().err.splitlines() == [
        "tessera: config key 'bucket_mb' is deprecated: use 'bucket_cap_mb'",
        "tessera: config key 'unused_ok' is deprecated: use 'find_unused_parameters'",
    ]
    with pytest.raises(tessera_errors.ConfigError, match="are one knob: set 'bucket_cap_mb'"):
        build_config({"bucket_mb": 7.0, "bucket_cap_mb": 5.0})
    # nothing renamed: the former names are unknown, as any other
    monkeypatch.setattr(config_knobs, "RENAMED", {})
    with pytest.raises(tessera_errors.ConfigError, match="unknown config key 'bucket_mb'"):
        build_config({"bucket_mb": 7.0})
