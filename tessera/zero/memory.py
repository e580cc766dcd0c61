"""Model-state memory per rank: the ZeRO paper's estimate, and what the tensors really hold.

Rajbhandari et al. (SC 2020), section 3 and figure 1: Ψ parameters on N_d data-parallel ranks,
2 bytes of fp16/bf16 parameter and 2 of gradient per parameter, and K bytes of optimizer state
(K = 12 for mixed-precision Adam: fp32 master weight, momentum and variance). Per rank:

* stage 0 (plain data parallelism): (2 + 2 + K) Ψ
* stage 1 (optimizer states partitioned): 2Ψ + 2Ψ + KΨ / N_d
* stage 2 (and gradients): 2Ψ + (2 + K) Ψ / N_d
* stage 3 (and parameters): (2 + 2 + K) Ψ / N_d

Without mixed precision the same formulas hold with 4-byte parameters and gradients and K = 8
for Adam (the parameters are the master weights), K = 4 for SGD with momentum.

`measure_memory` counts what is actually allocated: the bytes of the storages behind the
parameters, gradients and optimizer states, each storage once (views of a flat buffer are not
counted twice; a storage freed by ZeRO-3 counts zero).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tessera.memory.storage import storage_bytes, storage_id

__all__ = ["estimate_memory", "held_bytes", "measure_memory", "storage_bytes"]


def estimate_memory(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> dict[str, int]:
    """Bytes of model states per rank for ZeRO `stage`, keys params, gradients, optimizer, total.

    A partitioned state holds ceil(Ψ / N_d) elements per rank (the shards are padded equal).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    shard = math.ceil(num_params / world_size)
    params = param_bytes * (shard if stage >= 3 else num_params)
    gradients = grad_bytes * (shard if stage >= 2 else num_params)
    optimizer = optimizer_bytes * (shard if stage >= 1 else num_params)
    return {
        "params": params,
        "gradients": gradients,
        "optimizer": optimizer,
        "total": params + gradients + optimizer,
    }


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def measure_memory(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of params, gradients and optimizer state this rank holds (from tensor storages).

    Works on what `tessera.zero.initialize` returned (the ZeRO optimizer knows its shards) and on
    a plain module and optimizer (stage 0, where the gradients may live in DDP buckets).
    """
    if hasattr(optimizer, "memory_usage"):
        return optimizer.memory_usage()
    seen: set[tuple[str, int]] = set()
    params = list(model.parameters())
    buckets = getattr(model, "buckets", [])
    if buckets:  # DDP's buckets may be views of one shared-memory segment: count the views
        gradients = sum(bucket.nbytes for bucket in buckets)
        seen.update(storage_id(bucket.buffer) for bucket in buckets)
    else:
        gradients = storage_bytes([p.grad for p in params], seen)
    counted = {
        "params": storage_bytes(params, seen),
        "gradients": gradients,
        "optimizer": storage_bytes(_optimizer_tensors(optimizer), seen),
    }
    counted["total"] = sum(counted.values())
    return counted


def held_bytes(zero: Any) -> dict[str, int]:
    """Bytes of params, gradients and optimizer state a `ZeroOptimizer` holds on this rank,
    counted from storages (each once; a freed ZeRO-3 buffer counts zero). Under offload the
    host's buffers (masters, gradient partitions, staging) count with the device's."""
    seen: set[int] = set()
    mixed = zero.mixed_precision is not None
    params = list(zero.module.parameters()) + [f.flat_param for f in zero.flats]
    params += zero.layout.parameter_shards()
    if not mixed:
        params += [f.master for f in zero.flats]
    grads = [p.grad for p in zero.module.parameters()]
    grads += [f.bucket.buffer for f in zero.flats] + [f.grad_shard for f in zero.flats]
    grads += zero.delayed.grads if zero.delayed is not None else []
    grads += list(getattr(zero.masters, "widened", {}).values())  # (kept between steps)
    if zero.link is not None:
        grads += zero.link.grads + zero.link.handed
        params += [t for t in zero.link.staging + zero.link.spare_staging if t is not None]
    states = [
        value
        for state in zero.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    counted = {
        "params": storage_bytes(params, seen),
        "gradients": storage_bytes(grads, seen),
        "optimizer": storage_bytes(
            states + ([f.master for f in zero.flats] if mixed else []), seen
        ),
    }
    counted["total"] = sum(counted.values())
    return counted
