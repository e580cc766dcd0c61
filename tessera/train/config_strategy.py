"""The checks of the strategy knobs a `TrainConfig` holds: where the offload group and activation
checkpointing apply, and what a model-parallel layout (dp x tp x pp) needs of the GPT and the
batch. Each reads what the chosen strategy declares (`tessera.strategies.registry.capabilities`),
never its name.
"""

from __future__ import annotations

from typing import Any

from tessera.errors import ConfigError
from tessera.strategies.registry import capabilities, offered_by

__all__ = ["check_memory_options", "check_model_parallel"]

OFFLOAD_MOMENTS = ("fp32", "bf16", "bf16-stochastic")  # tessera.zero.policy.MOMENT_STORAGE


def check_memory_options(config: Any) -> None:
    """Offload and activation checkpointing: where they apply, and nvme_dir up front."""
    if config.offload not in (None, "cpu", "nvme"):
        raise ConfigError(f"offload must be cpu, nvme or unset, got {config.offload!r}")
    caps = capabilities(config.strategy)
    if config.offload and not caps.takes("offload"):
        raise ConfigError(
            f"offload={config.offload} offloads ZeRO's sharded state: it needs strategy "
            f"{_either(offered_by('offload'))}, not {config.strategy}"
        )
    if config.offload and config.optimizer != "adamw":
        raise ConfigError(f"offload={config.offload} runs a CPU Adam: it needs optimizer adamw")
    if config.offload != "nvme" and config.nvme_dir is not None:
        raise ConfigError("nvme_dir needs offload nvme")
    if config.offload_params and (not caps.takes("offload_params") or config.offload is None):
        raise ConfigError(
            "offload_params moves ZeRO-3's partitions: use "
            f"{_either(offered_by('offload_params'))} with offload"
        )
    if config.offload_moments not in OFFLOAD_MOMENTS:
        raise ConfigError(
            f"offload_moments must be one of {', '.join(OFFLOAD_MOMENTS)}, "
            f"got {config.offload_moments!r}"
        )
    if config.offload_moments != "fp32" and config.offload != "cpu":
        raise ConfigError(
            f"offload_moments={config.offload_moments} is CPUAdam's storage: it needs offload "
            f"cpu, not offload {config.offload}"
        )
    if config.delayed_update and config.offload != "cpu":  # as tessera.zero.delayed checks
        raise ConfigError(
            "delayed_update overlaps ZeRO-Offload's host step with the next forward/backward:"
            f" it needs offload cpu, not offload {config.offload}"
        )
    if config.offload == "nvme":
        from tessera.optim.swap_files import check_swap_dir

        try:
            check_swap_dir(config.nvme_dir)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error)) from None
    if config.activation_checkpointing and not caps.activation_checkpointing:
        raise ConfigError(
            f"activation_checkpointing wraps the whole GPT's blocks; strategy "
            f"{config.strategy} splits the model its own way and does not support it"
        )


def check_model_parallel(config: Any, dp: int, tp: int, pp: int) -> None:
    """What the pipeline and tensor-parallel engines need of the GPT and the batch (a user's
    model: of the batch; tessera.train.preflight checks the model)."""
    model, v = config.model, config.virtual_stages
    if (config.schedule == "interleaved") != (v > 1) or v < 1:
        raise ConfigError(f"--virtual-stages {v}: >= 2 with --schedule interleaved, else 1")
    if v > 1 and config.microbatches % pp:
        raise ConfigError(f"interleaved: microbatches must be a multiple of pp ({pp})")
    if v > 1 and config.model_factory is None and model.n_layer < pp * v:
        raise ConfigError(
            f"interleaved: {model.n_layer} GPT blocks cannot fill {pp * v} chunks"
        )
    if config.model_factory is None and model.n_head % tp:
        raise ConfigError(
            f"model.n_head ({model.n_head}) must be divisible by the tensor-parallel "
            f"degree ({tp})"
        )
    if config.model_factory is None and pp > model.n_layer + 2:  # [embedding, *blocks, head]
        raise ConfigError(
            f"{pp} pipeline stages need at least {pp - 2} blocks (each stage holds one of "
            f"embedding, blocks, head); model.n_layer is {model.n_layer}"
        )
    rows = config.batch_size // dp
    if capabilities(config.strategy).takes("microbatches") and config.microbatches > rows:
        raise ConfigError(
            f"microbatches ({config.microbatches}) must not exceed the batch each pipeline "
            f"splits: batch_size {config.batch_size} / dp {dp} = {rows} sequences"
        )


def _either(names: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c"."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "none"
