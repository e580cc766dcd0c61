"""The user's model for `tessera train --model`: a factory `PKG.MODULE:FACTORY` or `hf:CLASS`.

`hf:CLASS` names a transformers class, built from a config file and nothing else: no weights or
configs are downloaded. A concrete class (`hf:GPT2LMHeadModel`) is built as
`CLASS(CLASS.config_class(**json))`; an Auto class (`hf:AutoModelForCausalLM`) as
`CLASS.from_config(AutoConfig.for_model(**json))`, the JSON then naming its `model_type`.
The result is a factory: every rank calls it after seeding, so all start from the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from torch import nn

from tessera.data.imports import load_reference
from tessera.errors import ConfigError

__all__ = [
    "HF_PREFIX",
    "build_hf_model",
    "model_factory",
    "read_model_config",
    "unknown_config_keys",
]

HF_PREFIX = "hf:"


def read_model_config(path: str) -> dict[str, Any]:
    """The JSON object of `--model-config`; ConfigError for a missing or malformed file."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--model-config {path}: no such file")
    try:
        values = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model-config {path} is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--model-config {path} must hold one JSON object")
    return values


def _hf_class(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model hf:{name} needs transformers (pip install it)") from None
    cls = getattr(transformers, name, None)
    if cls is None or not isinstance(cls, type):
        raise ConfigError(f"--model hf:{name}: transformers has no model class {name!r}")
    return cls


def _build_hf(cls: Any, values: dict[str, Any]) -> nn.Module:
    from transformers import AutoConfig

    if cls.__name__.startswith("Auto"):
        settings = dict(values)
        model_type = settings.pop("model_type", None)
        if model_type is None:
            raise ConfigError(
                f"--model hf:{cls.__name__} builds from AutoConfig: the --model-config JSON "
                'must name its "model_type" (e.g. "gpt2")'
            )
        return cls.from_config(AutoConfig.for_model(model_type, **settings))
    settings = {k: v for k, v in values.items() if k != "model_type"}
    return cls(cls.config_class(**settings))


def unknown_config_keys(spec: str, values: dict[str, Any]) -> list[str]:
    """The keys of an `hf:` model's config values that its config class does not know.

    A config class takes any keyword and keeps it as an attribute, so a misspelt key
    (`num_hiden_layers`) builds the default model silently; a key is known when the class's
    default config has that attribute (its own fields, the common ones, `attribute_map`
    aliases such as GPT-2's `n_layer`). Hugging Face's `from_pretrained` warns the same way.
    """
    cls = _hf_class(spec[len(HF_PREFIX) :])
    settings = {k: v for k, v in values.items() if k != "model_type"}
    if cls.__name__.startswith("Auto"):
        from transformers import AutoConfig

        if "model_type" not in values:
            return []  # refused when built, with its own message
        default = AutoConfig.for_model(values["model_type"])
    else:
        default = cls.config_class()
    return sorted(key for key in settings if not hasattr(default, key))


def _call_factory(factory: Callable[[], Any], spec: str) -> nn.Module:
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec} returned a {type(model).__name__}, not an nn.Module")
    return model


def build_hf_model(spec: str, values: dict[str, Any]) -> nn.Module:
    """The `hf:CLASS` model of config values `values` (a `--model-config` file's object)."""
    return _build_hf(_hf_class(spec[len(HF_PREFIX) :]), values)


def model_factory(spec: str, model_config: str | None) -> Callable[[], nn.Module]:
    """`() -> nn.Module` for `--model spec`; checks the reference and the config file now."""
    if spec.startswith(HF_PREFIX):
        if model_config is None:
            raise ConfigError(f"--model {spec} is built from a config: give --model-config FILE")
        cls = _hf_class(spec[len(HF_PREFIX) :])
        return partial(_build_hf, cls, read_model_config(model_config))
    if model_config is not None:
        raise ConfigError(f"--model-config configures hf: models; {spec} is a factory")
    return partial(_call_factory, load_reference(spec, what="--model"), spec)
