"""A resume refuses every config field that changes what a step computes: all of them, not a sample.

The fields are enumerated from the `TrainConfig` dataclass (nested sections such as `model.*`
included), so a field added later is covered without touching this file; the ones a resume may
change are the set the README documents, written out here as the oracle (a field moved into the
code's changeable set without the README saying so fails). For each other field a real run
folder's config.yaml is given another value of that field and `tessera.train.run_training(...,
resume=True)` must refuse before anything runs, naming it; the documented ones, all changed at
once, must resume.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from tessera.cli import main
from tessera.errors import ConfigError
from tessera.train import TrainConfig, build_config, run_training

MAY_CHANGE = {
    "steps",
    "nproc",
    "out",
    "progress",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "sample_tokens",
    "timeout_s",
    "eval_data",
    "eval_every",
    "eval_batches",
    "log_with",
    "meta_init",
    "loader.num_workers",
}
"""What the README says a resume may change: none of them changes what a step computes."""

TINY: dict[str, Any] = {
    "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
    "batch_size": 4,
    "corpus_bytes": 5_000,
    "sample_tokens": 0,
    "progress": False,
    "strategy": "single",
    "nproc": 1,
    "steps": 1,
}


def _fields(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of a config dataclass, nested sections as `section.field`."""
    hints = typing.get_type_hints(cls)
    names = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            names += _fields(hints[field.name], f"{prefix}{field.name}.")
        else:
            names.append(f"{prefix}{field.name}")
    return names


def _other(value: Any) -> Any:
    """A value unlike `value`, of the kind a config.yaml holds for its field."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, dict):  # (`options`, a registered strategy's: compared whole)
        return {**value, "other": 1}
    assert value is None, value
    return "bf16"  # (a str | None field: mixed_precision's fp32 -> bf16, the case)


def _set(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    head, _, rest = key.partition(".")
    copy = dict(data)
    copy[head] = _set(data[head], rest, value) if rest else value
    return copy


def _get(data: dict[str, Any], key: str) -> Any:
    head, _, rest = key.partition(".")
    return _get(data[head], rest) if rest else data[head]


def test_the_readme_documents_exactly_the_changeable_fields():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    sentence = re.search(r"Resume refuses another config, .*?only(.*?)may change", readme, re.S)
    assert sentence, "README's sentence on what a resume may change"
    assert set(re.findall(r"`([a-z_.]+)`", sentence.group(1))) == MAY_CHANGE


def test_a_resume_refuses_every_field_but_the_documented_ones(tmp_path, capsys):
    out = tmp_path / "run"
    config = build_config(TINY, {"out": str(out)})
    run_training(config)  # a real run folder: config.yaml and a checkpoint of step 1
    saved = yaml.safe_load((out / "config.yaml").read_text())
    fields = _fields(TrainConfig)
    assert "mixed_precision" in fields and "model.n_layer" in fields
    assert MAY_CHANGE <= set(fields), "a documented field no longer exists"
    accepted = []
    for key in fields:
        if key in MAY_CHANGE:
            continue
        old = _other(_get(saved, key))
        (out / "config.yaml").write_text(yaml.safe_dump(_set(saved, key, old), sort_keys=False))
        try:
            run_training(config, resume=True)
        except ConfigError as refused:
            assert f"differing keys: {key} ({old!r} -> " in str(refused), (key, str(refused))
        else:
            accepted.append(key)
    assert accepted == [], f"a resume accepted another value of {accepted}"
    # the documented ones all differ at once: the run resumes (and goes on one step)
    changed = saved
    for key in MAY_CHANGE:
        changed = _set(changed, key, _other(_get(saved, key)))
    (out / "config.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))
    summary = run_training(dataclasses.replace(config, steps=2), resume=True)
    assert summary is not None and (summary["steps"], summary["steps_this_run"]) == (2, 1)
    # the case from the command line: an fp32 run resumed in bf16 is refused, up front
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--mixed-precision", "bf16"]) == 2
    assert "differing keys: mixed_precision (None -> 'bf16')" in capsys.readouterr().err
