"""ZeRO stage 3 (P_os+g+p): optimizer states, gradients and parameters partitioned.

Rajbhandari et al., SC 2020, section 5.3. The model is cut into units: every child of an
`nn.ModuleList` or `nn.Sequential` that has parameters (a GPT block, an MLP layer), plus the
root for everything else (embeddings, final norm, a tied head; a parameter shared by two units
also belongs to the root). Each unit is one gradient bucket and one flat parameter buffer
(`Reducer(units=...)`), of which a rank keeps only its slice between uses:

* forward: a module pre-hook all-gathers the unit's flat buffer just before its forward and
  queues the gather of the next unit (prefetch: communication overlaps this unit's compute);
  a post-hook frees the buffer's storage (`storage.resize_(0)`: the parameter tensors and the
  references autograd saved keep their shape, so no user code changes);
* backward: a hook on the unit's outputs gathers the unit again when the gradient reaches it,
  and prefetches the unit before it; when the unit's last gradient has arrived its bucket is
  reduce-scattered into this rank's gradient shard, and parameters and gradients are freed;
* the root unit stays gathered from the start of forward to the end of backward.

Communication per step: all-gather in forward (Ψ), all-gather in backward (Ψ), reduce-scatter
of gradients (Ψ) = 3Ψ elements, 1.5x DDP's 2Ψ. Memory per rank: (2 + 2 + K)Ψ/N bytes plus the
units in flight — `memory.estimate_memory(..., stage=3)`. All gathers and reductions run in
order on the reducer's one communication thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from tessera.data_parallel.bucket import Bucket
from tessera.errors import CollectiveTimeout
from tessera.zero.optimizer import FlatShard, ZeroOptimizer

__all__ = ["ZeroStage3", "find_units"]


def find_units(module: nn.Module) -> list[nn.Module]:
    """Children of `nn.ModuleList`/`nn.Sequential` containers that have parameters, outermost."""
    units: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            container = isinstance(parent, (nn.ModuleList, nn.Sequential))
            if container and any(p.requires_grad for p in child.parameters()):
                units.append(child)
            else:
                visit(child)

    visit(module)
    return units


def _direct_parameters(module: nn.Module, skip: set[int]) -> list[nn.Parameter]:
    """Parameters reachable from `module` without entering the modules in `skip`."""
    found = [p for p in module._parameters.values() if p is not None]
    for child in module.children():
        if id(child) not in skip:
            found += _direct_parameters(child, skip)
    return found


class ZeroStage3(ZeroOptimizer):
    """Optimizer states, gradients and parameters partitioned; units gathered on use."""

    stage = 3
    release_gradients = True

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: Any,
        *,
        group: dist.ProcessGroup | None = None,
        mixed_precision: str | None = None,
    ) -> None:
        self._units = find_units(module)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        # One bucket per unit, whatever its size: the cap never splits one.
        super().__init__(
            module,
            make_optimizer,
            group=group,
            mixed_precision=mixed_precision,
            bucket_cap_mb=2**40,
        )
        self._flat_of_unit: dict[int, FlatShard] = {}
        self._shards: list[torch.Tensor] = []
        for flat in self.flats:
            self._flat_of_unit[self._unit_of[id(flat.bucket.params[0])]] = flat
            if self.mixed_precision is None:
                self._shards.append(flat.master.detach())  # the fp32 master is the shard
            else:
                self._shards.append(flat.flat_param[flat.lo : flat.hi].clone())
            flat.flat_param.untyped_storage().resize_(0)
        for unit_id, unit in enumerate(self._units, start=1):
            self._hooks.append(unit.register_forward_pre_hook(partial(self._before_unit, unit_id)))
            self._hooks.append(unit.register_forward_hook(partial(self._after_unit, unit_id)))

    def _ordered_parameters(self) -> tuple[list[tuple[str, nn.Parameter]], list[int]]:
        """Root parameters first, then each unit's, in module order; tied ones go to the root."""
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        owners: dict[int, set[int]] = {id(p): set() for _, p in named}
        for unit_id, unit in enumerate(self._units, start=1):
            for param in unit.parameters():
                owners.get(id(param), set()).add(unit_id)
        for param in _direct_parameters(self.module, {id(u) for u in self._units}):
            owners.get(id(param), set()).add(0)
        self._unit_of = {key: (min(s) if len(s) == 1 else 0) for key, s in owners.items()}
        named.sort(key=lambda item: self._unit_of[id(item[1])])  # stable: module order kept
        return named, [self._unit_of[id(p)] for _, p in named]

    # -- gathering and freeing --------------------------------------------------------------
    @torch.no_grad()
    def _gather(self, flat: FlatShard) -> None:
        """All-gather a unit's flat buffer into its storage (on the communication thread)."""
        storage = flat.flat_param.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(flat.flat_param.numel() * flat.flat_param.element_size())
        self._all_gather_into(flat.flat_param, self._shards[flat.bucket.index], flat.lo)

    def _request(self, unit_id: int) -> None:
        """Queue the gather of a unit (prefetch) unless it is gathered or on its way."""
        flat = self._flat_of_unit.get(unit_id)
        if flat is None:
            return
        with self._lock:
            gathered = flat.flat_param.untyped_storage().nbytes() > 0
            if not gathered and unit_id not in self._pending:
                self._pending[unit_id] = self.reducer.submit(self._gather, flat)

    def _need(self, unit_id: int) -> None:
        """Block until a unit's parameters are complete."""
        flat = self._flat_of_unit.get(unit_id)
        if flat is None:
            return
        with self._lock:
            future = self._pending.pop(unit_id, None)
        if future is not None:
            self._wait(future, f"all_gather of unit {unit_id}")
        if flat.flat_param.untyped_storage().nbytes() == 0:  # freed since (or never queued)
            self._collective(self._gather, flat)

    def _wait(self, future: Future, what: str) -> None:
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise CollectiveTimeout(
                dist.get_rank(), what, self.timeout_s, "another rank is not at this unit"
            ) from None

    def _free(self, unit_id: int) -> None:
        flat = self._flat_of_unit.get(unit_id)
        if flat is not None:
            with self._lock:
                if unit_id not in self._pending:
                    flat.flat_param.untyped_storage().resize_(0)

    # -- hooks ------------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple) -> tuple | None:
        result = super()._before_forward(module, args)
        self._need(0)
        self._request(1)
        return result

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not torch.is_grad_enabled():
            self._free(0)
        return super()._after_forward(module, args, output)

    def _before_unit(self, unit_id: int, module: nn.Module, args: tuple) -> None:
        self._need(unit_id)
        self._request(unit_id + 1)

    def _after_unit(self, unit_id: int, module: nn.Module, args: tuple, output: Any) -> None:
        self._free(unit_id)
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._before_unit_backward, unit_id))

    def _before_unit_backward(self, unit_id: int, grad: torch.Tensor) -> None:
        self._need(unit_id)
        if unit_id > 1:
            self._request(unit_id - 1)

    # -- the stage's gradient path and step ---------------------------------------------------
    def _reduce_bucket(self, bucket: Bucket) -> None:
        flat = self.flats[bucket.index]
        assert flat.bucket is bucket and flat.grad_shard is not None
        flat.grad_shard.add_(self._reduce_scatter_mean(bucket.buffer, flat.lo, flat.hi))
        flat.flat_param.untyped_storage().resize_(0)  # this unit's backward is over

    @torch.no_grad()
    def _publish(self) -> None:
        if self.mixed_precision is not None:
            for flat, shard in zip(self.flats, self._shards):
                shard.copy_(flat.master)

    def _parameter_shards(self) -> list[torch.Tensor]:
        return list(self._shards)
