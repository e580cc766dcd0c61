"""Checkpoint files, shared by the strategy libraries and the trainer (layer 1).

* `files`: atomic, checksummed files (`save_checkpoint` / `load_checkpoint`);
* `series`: a run's `checkpoints/step-N/` folders with manifests, their pruning and the newest
  verified one (`latest_checkpoint`);
* `export`: a full state dict as safetensors or a Hugging Face folder (`export_model`).
"""

from tessera.checkpoint.export import EXPORT_FORMATS, export_model

__all__ = ["EXPORT_FORMATS", "export_model"]
