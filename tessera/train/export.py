"""`tessera checkpoint export RUN [--step N] --format safetensors|hf OUT`, for every strategy.

The full model state of a checkpoint: `state.pt`'s `engine["model"]` for the strategies that store
it there (single, torch-ddp, ddp; local-sgd: rank 0's replica; pipeline, tensor, hybrid: the
dense model, gathered at save; ps: the servers' parameters), or the ZeRO shards consolidated into
one state dict (`tessera.zero.consolidate`). The model is rebuilt from the run's config.yaml (the
demo GPT with the vocabulary the checkpoint holds, the `--model` factory, or an `hf:` class with
the model config the checkpoint holds), loaded with the
state (strictly: a checkpoint of another model is refused), and written by
`tessera.checkpoint.export_model`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.checkpoint import export_model, series
from tessera.checkpoint.files import load_checkpoint
from tessera.errors import CheckpointError, ConfigError
from tessera.train.config import load_yaml

__all__ = ["checkpoint_model_state", "export_run"]


def _state_file(run_dir: Path, step: int | None) -> Path:
    if step is None:
        path = series.latest_checkpoint(run_dir)
        if path is None:
            raise CheckpointError(f"{run_dir} holds no complete checkpoint whose checksums verify")
        return path
    folder = series.step_folder(run_dir, step)
    if folder not in series.complete_checkpoints(run_dir):
        steps = [series.checkpoint_step(f) for f in series.complete_checkpoints(run_dir)]
        raise CheckpointError(f"{run_dir} has no complete checkpoint of step {step} (has {steps})")
    series.verify(folder)
    return folder / series.STATE_FILE


def checkpoint_model_state(state_file: Path, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full model state dict a checkpoint holds (consolidating ZeRO shards)."""
    engine = state.get("engine") or {}
    if "zero_shards" in engine:
        from safetensors.torch import load_file

        from tessera.zero import consolidate

        with tempfile.TemporaryDirectory() as scratch:
            merged = consolidate(state_file.parent / engine["zero_shards"], Path(scratch) / "m")
            return load_file(str(merged))
    if "model" not in engine:
        raise CheckpointError(f"{state_file} holds no model state")
    return engine["model"]


def _model(saved: dict[str, Any], state: dict[str, Any]) -> nn.Module:
    """The run's model, built from its saved config and what the checkpoint holds (the demo's
    vocabulary, an hf: model's config): no data or config file of the run is read again."""
    torch.manual_seed(int(saved.get("seed", 0)))
    spec = saved.get("model_factory")
    if spec is None:
        from tessera.models import GPT, GPTConfig

        vocab = len(state["tokenizer"]["chars"])
        return GPT(GPTConfig(vocab_size=vocab, **saved.get("model", {})))
    from tessera.models.user import build_hf_model, model_factory

    if spec.startswith("hf:"):
        return build_hf_model(spec, state["workload"]["model_config"])
    return model_factory(spec, None)()


def export_run(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, format: str = "safetensors"
) -> Path:
    """Export the model of `run_dir`'s checkpoint (the newest, or `step`'s) to `out`."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a tessera run folder (no config.yaml)")
    saved = load_yaml(run_dir / "config.yaml")
    state_file = _state_file(run_dir, step)
    state = load_checkpoint(state_file)
    weights = checkpoint_model_state(state_file, state)
    module = _model(saved, state)
    try:
        module.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointError(f"{state_file} does not fit the run's model: {exc}") from None
    try:
        return export_model(module, module.state_dict(), out, format)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
