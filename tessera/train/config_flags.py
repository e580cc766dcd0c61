"""`tessera train`'s command-line flags, generated: one per config field (typed and documented
from `TrainConfig` itself), and one per policy field of each strategy added with
`register_strategy` (into the config's `options`), so a user's strategy gets its options on the
command line with no edit here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from typing import Any

__all__ = ["add_config_flags", "add_train_flags", "flag_layer"]


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """Every config flag of `tessera train`: the run's, then the strategies' knobs (generated
    from their policies, `tessera.train.config_knobs`), then the registered strategies'."""
    from tessera.train.config import TrainConfig

    knobs = parser.add_argument_group("strategy options (each declared on its strategy's policy)")
    taken = add_config_flags(parser, TrainConfig, knobs=knobs)
    _add_former_flags(knobs, taken)
    _add_strategy_flags(knobs, taken)


def _add_former_flags(parser: argparse._ActionsContainer, taken: set[str]) -> None:
    """The old flag of each renamed knob (`config_knobs.RENAMED`): not in `--help`, into the
    knob's own field, each use printing one deprecation line."""
    from tessera.train import config_knobs
    from tessera.train.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for old, new in config_knobs.RENAMED.items():
        _add_flag(parser, _flag(old), new, hints[new], argparse.SUPPRESS, former_of=_flag(new))
        taken.add(_flag(old))


def _deprecated(base: type[argparse.Action], new_flag: str) -> type[argparse.Action]:
    """`base` that prints the deprecation line of its (old) flag when it is given."""

    class Deprecated(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
            from tessera.train.config_knobs import warn_renamed

            negated = option_string is not None and option_string.startswith("--no-")
            warn_renamed(option_string, new_flag.replace("--", "--no-", 1) if negated else new_flag)
            super().__call__(parser, namespace, values, option_string)

    return Deprecated


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_flag(
    parser: argparse._ActionsContainer,
    flag: str,
    dest: str,
    annotation: Any,
    help_text: str,
    former_of: str | None = None,
) -> None:
    """`flag` into `dest`, typed by `annotation` (bool: --flag / --no-flag; X | None: X);
    `former_of`: the flag `flag` was renamed to (a use of `flag` prints a deprecation line)."""
    wrap = functools.partial(_deprecated, new_flag=former_of) if former_of else lambda a: a
    if annotation is bool:
        action = wrap(argparse.BooleanOptionalAction)
        parser.add_argument(flag, dest=dest, default=None, help=help_text, action=action)
        return
    arms = [a for a in typing.get_args(annotation) if a is not type(None)]  # X | None
    kind = {int: int, float: float}.get(arms[0] if len(arms) == 1 else annotation, str)
    if dest == "nproc":
        kind = _nproc_value
    name = dest.rpartition(".")[2]
    parser.add_argument(
        flag,
        dest=dest,
        type=kind,
        default=None,
        metavar=name.upper(),
        help=help_text,
        action=wrap(argparse._StoreAction),
    )


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    knobs: argparse._ActionsContainer | None = None,
) -> set[str]:
    """One flag per config field, typed and documented from the dataclass itself; the flags.
    `knobs`: where the strategies' knobs (fields with a home `"policy"`) go, after the others."""
    hints = typing.get_type_hints(cls)
    flags: set[str] = set()
    ordered = sorted(dataclasses.fields(cls), key=lambda field: "policy" in field.metadata)
    for field in ordered:
        annotation = hints[field.name]
        if field.metadata.get("cli") is False:  # (`options`: flags of their own, below)
            continue
        if dataclasses.is_dataclass(annotation):
            flags |= add_config_flags(parser, annotation, prefix=f"{field.name}.")
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"{field.metadata.get('help', '')} (default: {default})"
        if field.name == "strategy":
            from tessera.strategies.registry import OWN_ENTRY_POINTS, strategy_names

            help_text += f"; one of: {', '.join([*strategy_names(), *OWN_ENTRY_POINTS])}"
        flag = field.metadata.get("flag", _flag(field.name))
        target = knobs if knobs is not None and "policy" in field.metadata else parser
        _add_flag(target, flag, prefix + field.name, annotation, help_text)
        flags.add(flag)
    return flags


def _add_strategy_flags(parser: argparse._ActionsContainer, taken: set[str]) -> None:
    """A flag per policy field of each strategy added with `register_strategy` (`--FIELD`, into
    the config's `options`), unless a flag of that name exists; its type from the annotation."""
    from tessera.strategies.registry import user_policies

    for strategy, policy in user_policies().items():
        if not dataclasses.is_dataclass(policy):
            continue
        try:
            hints = typing.get_type_hints(policy)
        except (NameError, TypeError):  # annotations naming what a test function defined
            hints = {}
        for field in dataclasses.fields(policy):
            flag = field.metadata.get("flag", _flag(field.name))
            if flag in taken:
                continue
            taken.add(flag)
            default = field.default if field.default is not dataclasses.MISSING else None
            help_text = f"{field.metadata.get('help', '')} ({strategy}; default: {default})"
            annotation = hints.get(field.name, field.type)
            _add_flag(parser, flag, f"options.{field.name}", annotation, help_text.strip())


def _nproc_value(text: str) -> int | str:
    """`--nproc N` or `--nproc auto` (resolved with the rest of the config)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {text!r}") from None


_NOT_CONFIG = ("command", "config", "resume", "handler", "max_restarts", "min_nproc")
"""`tessera train` options that steer the job rather than configure the training."""


def flag_layer(args: argparse.Namespace) -> dict[str, Any]:
    """The config values given on the command line, nested like the YAML file."""
    layer: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if value is None or dest in _NOT_CONFIG:
            continue
        *parents, leaf = dest.split(".")
        target = layer
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return layer
