"""Export a trained model's full state to files other tools read without tessera.

* `safetensors`: one `.safetensors` file whose keys are those of `module.state_dict()`;
  tensors that share storage (tied weights) are written as separate copies, which the format
  requires.
* `hf`: a Hugging Face folder written by the model's own `save_pretrained` (config and
  safetensors weights), which `transformers.AutoModel*.from_pretrained(path)` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = ["EXPORT_FORMATS", "export_model"]

EXPORT_FORMATS = ("safetensors", "hf")


def _plain_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with its own storage (safetensors refuses shared ones)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in state.items():
        value = tensor.detach().to("cpu").contiguous()
        pointer = value.untyped_storage().data_ptr()
        if pointer in seen or value.untyped_storage().nbytes() != value.nbytes:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        out[key] = value
    return out


def export_model(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    path: str | Path,
    format: str = "safetensors",
) -> Path:
    """Write `state` (the full `module.state_dict()`) to `path` in `format`; return the path.

    `safetensors`: `path` is the file. `hf`: `path` is a folder, written by
    `module.save_pretrained` (the module must be a Hugging Face `PreTrainedModel`).
    """
    path = Path(path)
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {EXPORT_FORMATS}")
    tensors = _plain_tensors(state)
    if format == "safetensors":
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))
        return path
    save_pretrained = getattr(module, "save_pretrained", None)
    if save_pretrained is None:
        raise ValueError(
            f"format 'hf' writes a Hugging Face folder with the model's save_pretrained, and "
            f"{type(module).__name__} has none; export it as 'safetensors'"
        )
    save_pretrained(str(path), state_dict=tensors, safe_serialization=True)
    return path
