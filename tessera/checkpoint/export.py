"""Export trained weights in the formats other tools load without tessera.

- `safetensors`: one `model.safetensors` whose keys are exactly `module.state_dict()`'s. Tensors
  that share storage (tied weights: an embedding and an output head) are written once per key, as
  copies, because the safetensors format refuses aliasing; `load_state_dict` re-ties nothing but
  loads every key. A Hugging Face model's `config.json` is written beside it, so the folder also
  loads with `from_pretrained`.
- `hf`: `module.save_pretrained(path, state_dict=state)`: the folder `transformers`'
  `AutoModel*.from_pretrained(path)` reads (its config.json and safetensors weights).

Both are written beside their final name and renamed into it once complete
(`tessera.checkpoint.atomic.replace_atomically`): an export killed half-way leaves no half file
under the name a loader opens, and the files get the mode a plain `open` gives.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tessera.checkpoint.atomic import replace_atomically

__all__ = ["EXPORT_FORMATS", "export_model", "untied"]

EXPORT_FORMATS = ("safetensors", "hf")
WEIGHTS_FILE = "model.safetensors"


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` on the CPU, contiguous, with no two keys sharing storage (later ones copied)."""
    seen: set[int] = set()
    out = {}
    for key, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _is_hf(module: nn.Module) -> bool:
    return hasattr(module, "save_pretrained") and hasattr(module, "config")


def export_model(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    path: str | Path,
    format: str = "safetensors",
) -> Path:
    """Write `state` (the full `module.state_dict()`) to `path`; return the weights' path.

    `path` is a folder, or for `safetensors` also a file ending in `.safetensors`. `module` gives
    the structure (its keys are checked against `state`; `hf` needs a transformers model).
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {EXPORT_FORMATS}")
    expected = set(module.state_dict(keep_vars=True))  # the keys (ZeRO-3: storage is freed)
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"state does not match {type(module).__name__}.state_dict(): missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    path = Path(path)
    if format == "hf":
        if not _is_hf(module):
            raise ValueError(
                f"format hf writes a transformers model with save_pretrained; "
                f"{type(module).__name__} is not one (use format safetensors)"
            )
        weights = untied(state)
        return replace_atomically(
            path,
            lambda tmp: module.save_pretrained(tmp, state_dict=weights, safe_serialization=True),
        )
    from safetensors.torch import save_file

    file = path if path.suffix == ".safetensors" else path / WEIGHTS_FILE
    weights = untied(state)
    replace_atomically(file, lambda tmp: save_file(weights, str(tmp), metadata={"format": "pt"}))
    if _is_hf(module) and file.parent == path:
        replace_atomically(path / "config.json", lambda tmp: module.config.to_json_file(str(tmp)))
    return file
