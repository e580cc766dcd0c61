"""The trainer's knobs, read from the policy fields that declare them.

A strategy library's policy (a frozen dataclass, layer 2) is the one home of each of its knobs:
the field's default, its check (`__post_init__`), and, in the field's `metadata`, what
`tessera train` needs to offer it as a flag and a YAML key. The policies write plain metadata
keys (they import nothing from here, which sits above them):

- `"help"`: the field is a trainer knob declared here: the knob's default is the field's, its
  type the field's annotation, this its `--help` line.
- `"knob"`: the knob's name (config field, YAML key, `--flag`) where it is not the field's name
  (`DDPPolicy.algorithm` is `comm_algorithm`).
- `"config_type"`: the type of the knob's command-line form where it is not the field's (a file
  name for a plan, a comma-separated string for a list, a device name for a group).
- `"same_as"`: `(PolicyClass, field)`: the field is that policy's knob (ZeRO's bucket size is
  DDP's), declared there.
- `"folds"`: a policy class whose knobs are flags of their own that the trainer folds into this
  one option (the offload group: `--nvme-dir`, `--offload-moments`... into ZeRO's `offload`).
- `"old_names"`: former names of a renamed knob: its old flag and YAML key still work, each use
  printing one deprecation line (`tessera.train.config_knobs.RENAMED`).

A field of a policy whose type is itself a policy (`HybridPolicy.pipeline`) is a part: the part's
knobs that the composed policy takes by name are the composed policy's options too.

From this one declaration come the trainer's config fields (`tessera.train.config_knobs`) and
each built-in strategy's `Capabilities.options` (`options_of`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tessera.strategies.capabilities import FOLDED

__all__ = [
    "Knob",
    "declared_knobs",
    "home_of",
    "knob_name",
    "option_names",
    "options_of",
]


@dataclass(frozen=True)
class Knob:
    """One trainer knob, as its home policy field declares it."""

    name: str
    """Config field, YAML key and (dashed) flag."""
    policy: type
    """The policy class whose field declares it (its home)."""
    field: str
    """That field's name."""
    annotation: Any
    """The config's type: the field's, or its `config_type`."""
    default: Any
    """The field's default (declared once, there)."""
    help: str
    """Its line in `tessera train --help`."""
    old_names: tuple[str, ...] = ()
    """Its former names (a renamed knob's old flag and YAML key, deprecated)."""


def option_names(cls: type) -> list[str]:
    """The keywords policy class `cls` takes: its fields, and the knobs of its parts that a
    composed policy (`HybridPolicy`) also takes by name."""
    names = [field.name for field in dataclasses.fields(cls) if field.init]
    keywords = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    taken = inspect.signature(cls).parameters.values()
    return names + [p.name for p in taken if p.kind in keywords and p.name not in names]


def home_of(policy: type, name: str) -> tuple[type, str]:
    """(policy class, field) that declares the knob of `policy`'s field `name` (itself unless
    the field is `same_as` another's)."""
    field = policy.__dataclass_fields__[name]
    if "same_as" in field.metadata:
        return home_of(*field.metadata["same_as"])
    return policy, name


def knob_name(policy: type, name: str) -> str | None:
    """The trainer knob `policy`'s field `name` is, or None where it is not one."""
    home, field_name = home_of(policy, name)
    metadata = home.__dataclass_fields__[field_name].metadata
    if "help" not in metadata:
        return None
    return metadata.get("knob", field_name)


def _parts(policy: type) -> dict[str, type]:
    """Field -> policy class of each part `policy` holds (`HybridPolicy.pipeline`...)."""
    hints = typing.get_type_hints(policy)
    return {
        field.name: hints[field.name]
        for field in dataclasses.fields(policy)
        if isinstance(hints[field.name], type) and dataclasses.is_dataclass(hints[field.name])
    }


def options_of(policy: type, *, leaving_out: Iterable[str] = ()) -> dict[str, str]:
    """`Capabilities.options` of a strategy whose policy is `policy`: each trainer knob its
    fields (and its parts' fields it takes by name) declare -> the policy keyword it becomes
    (`FOLDED`: part of a `folds` option); `leaving_out`: knobs of the policy a strategy does not
    take (zero1/2 and ZeRO-3's `offload_params`)."""
    options: dict[str, str] = {}
    parts = _parts(policy)
    takes = set(option_names(policy))
    for field in dataclasses.fields(policy):
        name = knob_name(policy, field.name)
        if name is not None:
            options[name] = field.name
        if "folds" in field.metadata:
            group = field.metadata["folds"]
            for inner in dataclasses.fields(group):
                folded = knob_name(group, inner.name)
                if folded is not None:
                    options[folded] = FOLDED
        if field.name in parts:
            part = parts[field.name]
            for inner in dataclasses.fields(part):
                name = knob_name(part, inner.name)
                if name is not None and inner.name in takes:
                    options[name] = inner.name
    leave = set(leaving_out)
    return {knob: keyword for knob, keyword in options.items() if knob not in leave}


def declared_knobs(policies: Iterable[type]) -> dict[str, Knob]:
    """Every trainer knob the policies declare (their folded groups and parts included), by
    name, in the order found; a knob declared by two fields is refused (ValueError)."""
    knobs: dict[str, Knob] = {}
    seen: set[type] = set()
    pending = list(policies)
    while pending:
        policy = pending.pop(0)
        if policy in seen or not dataclasses.is_dataclass(policy):
            continue
        seen.add(policy)
        hints = typing.get_type_hints(policy)
        for field in dataclasses.fields(policy):
            if "folds" in field.metadata:
                pending.insert(0, field.metadata["folds"])  # (its group next)
            if "help" not in field.metadata:
                continue
            name = field.metadata.get("knob", field.name)
            if name in knobs:
                raise ValueError(
                    f"knob {name!r} is declared by {knobs[name].policy.__name__}."
                    f"{knobs[name].field} and {policy.__name__}.{field.name}: declare it once "
                    f"(the other field `same_as` it)"
                )
            knobs[name] = Knob(
                name=name,
                policy=policy,
                field=field.name,
                annotation=field.metadata.get("config_type", hints[field.name]),
                default=field.default,
                help=field.metadata["help"],
                old_names=tuple(field.metadata.get("old_names", ())),
            )
        pending.extend(_parts(policy).values())
    return knobs
