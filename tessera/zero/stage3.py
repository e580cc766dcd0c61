"""ZeRO stage 3 (P_os+g+p): optimizer states, gradients and parameters partitioned.

Rajbhandari et al., SC 2020, section 5.3. The model is cut into units (`units.py`: by default
every child of an `nn.ModuleList`/`nn.Sequential` with parameters, or the modules `units=`
names; the root unit 0 holds the rest). Each unit is one gradient bucket and one flat parameter
buffer, of which a rank keeps only its slice between uses. Correctness rests on two rules that
hold for any `nn.Module`, however its forward calls its children:

* forward: every module that holds parameters directly (and every unit module) has a pre-hook
  that all-gathers the units owning them before it runs, so `b["norm"](x)` on a block kept in
  an `nn.ModuleDict`, or `F.linear(x, self.weight)` in the owner's forward, finds its weights;
* backward: parameters that autograd saves are packed as "unit u's tensor" by a saved-tensor
  hook, and unpacking gathers unit u first. Backward therefore never reads a freed buffer, even
  after a `torch.no_grad()` forward freed everything, in a second backward, or in a re-entrant
  one. The storage is resized in place (`resize_`), so the saved tensors keep their shape.

The saved-tensor hooks, the prefetch order and the end-of-backward callback are the residency
scheduler's (`tessera/memory/residency.py`), shared with `swap_idle`; this class decides what
bringing a unit in means (an all-gather) and when a unit may go.

Freeing is only a memory policy: a unit is freed when a module of another unit starts after it
has finished (a module called twice within its unit stays gathered), at the end of the forward
(except the root, which backward needs first), once every gradient of the unit has arrived in
backward, at the end of backward, and before the optimizer step. Prefetch (in the order units
were first used in the last forward, module order before that): starting a unit queues the next
one; unpacking a unit in backward queues the one before it.

Every gather and free is decided on the training thread from the sequence of hooks, which is the
same on every rank, and the gathers run on the reducer's one communication thread in the order
decided, with the gradient reductions: every rank issues the same collectives in the same order.
Communication per step: all-gather in forward (Ψ), in backward (Ψ), reduce-scatter of gradients
(Ψ) = 3Ψ elements, 1.5x DDP's 2Ψ. Memory per rank: (2 + 2 + K)Ψ/N bytes plus the units in
flight — `memory.estimate_memory(..., stage=3)`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.comm.stream import stream_for
from tessera.data_parallel.bucket import Bucket, assign_buckets
from tessera.memory.residency import ResidencyScheduler, in_backward
from tessera.runtime.wait import wait_or_raise
from tessera.zero.bf16_forward import kept_in_fp32
from tessera.zero.delayed import DEFAULT_WARMUP_STEPS
from tessera.zero.groups import OptimizerGroups
from tessera.zero.materialize import PendingInit, materialize_shards
from tessera.zero.optimizer import ZeroOptimizer, _check_same_model
from tessera.zero.shards import FlatShard
from tessera.zero.stage3_layout import Stage3Layout
from tessera.zero.units import UnitSpec, find_units, parameter_owners, select_units

__all__ = ["ZeroStage3", "find_units"]

_ONE_BUCKET_MB = 2**40
"""Stage 3's bucket cap: one bucket per unit (and dtype), whatever its size."""


class ZeroStage3(ZeroOptimizer):
    """Optimizer states, gradients and parameters partitioned; units gathered on use.

    `units`: module classes and/or dotted name patterns choosing what is gathered as one
    (`tessera.zero.units.select_units`); `None` keeps the default `find_units`.
    `offload_params`: this rank's parameter partition stays off the device: with
    `swap_masters` it is the inner optimizer's (an `NVMeAdam` with `swap_params=True`, no copy
    in memory, each gather reads it from disk); else (offload="cpu") it is a host tensor. Each
    gather copies it up first, on the communication stream, so a unit prefetched is also a
    unit uploaded ahead of its use (ZeRO-Infinity's parameter offload).
    `swap_masters`: the fp32 masters are in the inner optimizer's files (`offload="nvme"`).
    `meta_init`: the model was built on the meta device (`tessera.zero.materialize`): each unit
    is initialised in turn and only this rank's slice of it is kept.

    Why so many parameters: the base's keywords plus stage 3's own three (`units`,
    `offload_params`, `meta_init`); `initialize`/`shard` make it from the policies.
    """

    stage = 3
    release_gradients = True
    layout: Stage3Layout
    """The flats and this rank's compute-dtype shard of each (`_new_layout`)."""

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: Any,
        *,
        group: dist.ProcessGroup | None = None,
        mixed_precision: str | None = None,
        units: Sequence[UnitSpec] | UnitSpec | None = None,
        offload_params: bool = False,
        swap_masters: bool = False,
        delayed_update: bool = False,
        delayed_update_after: int = DEFAULT_WARMUP_STEPS,
        host_huge_pages: bool = False,
        host_step: bool = False,
        meta_init: PendingInit | None = None,
    ) -> None:
        self._units = select_units(module, units)
        self._offload_params = offload_params
        """This rank's parameter partition lives off the device (host memory or files)."""
        self._initial: dict[int, tuple[list[str], torch.Tensor]] | None = None
        """A meta-device model's first values: per bucket, its names and this rank's slice."""
        self.groups = make_optimizer = OptimizerGroups.of(module, make_optimizer)  # for layout
        self._fp32_kept = kept_in_fp32(module, mixed_precision)
        if meta_init is not None:
            self._initial = self._materialize(module, meta_init, group)
        # One bucket per unit, whatever its size: the cap never splits one.
        super().__init__(
            module, make_optimizer, group=group, mixed_precision=mixed_precision,
            bucket_cap_mb=_ONE_BUCKET_MB, swap_masters=swap_masters,
            delayed_update=delayed_update, delayed_update_after=delayed_update_after,
            host_huge_pages=host_huge_pages, host_step=host_step,
        )  # fmt: skip
        self._lock = threading.RLock()  # backward hooks may run on autograd's worker threads
        self._residency = ResidencyScheduler(
            len(self._units) + 1,  # the root unit 0, then `self._units`
            bring_in=self._need,
            prefetch=self._prefetch_behind,
            end_of_backward=self._end_of_backward,
            lock=self._lock,
        )
        self._flats_of_unit: dict[int, list[FlatShard]] = {}
        for flat in self.flats:
            unit = self._owner[id(flat.bucket.params[0])]
            self._flats_of_unit.setdefault(unit, []).append(flat)
            self._residency.track(flat.flat_param, unit)
        self._gathered: dict[int, Future] = {}
        """Units gathered or being gathered (as decided; the gather may still be queued)."""
        self._active: dict[int, int] = {}
        """Per unit, how many of its modules are inside their forward now."""
        self._idle: dict[int, None] = {}
        """Gathered units whose modules have all returned: freed when another unit starts."""
        self._calls: list[tuple[nn.Module, tuple[int, ...], Any]] = []
        self._finished: set[int] = set()
        """Units whose every gradient arrived in the running backward: not prefetched again."""
        self._hook_modules()

    def _materialize(
        self, module: nn.Module, pending: PendingInit, group: dist.ProcessGroup | None
    ) -> dict[int, tuple[list[str], torch.Tensor]]:
        """Initialise a meta-device model unit by unit; this rank's slice of each bucket."""
        self.module = module
        named, units = self._ordered_parameters()
        cap = int(_ONE_BUCKET_MB * 2**20)  # the buckets the base's reducer will make
        buckets = assign_buckets(named, cap, allocate=_no_buffer, units=units)
        stream = stream_for(group)
        stream.run(_check_same_model, module, group, what="ZeRO-3 model check")
        src = dist.get_global_rank(group, 0) if group is not None else 0

        def broadcast(flat: torch.Tensor) -> None:
            stream.run(partial(comm.broadcast, group=group), flat, src, what="initial values")

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        slices = materialize_shards(
            module, pending, buckets, self._owner, world=world, rank=rank, broadcast=broadcast
        )
        return {b.index: (list(b.names), slices[b.index]) for b in buckets}

    def _new_layout(self) -> Stage3Layout:
        """Stage 3's layout: a compute-dtype shard per flat, the flat buffer freed."""
        return Stage3Layout(
            self.world,
            self.rank,
            link=self.link,
            huge_pages=self.host_huge_pages,
            shared_master=self.mixed_precision is None and self.delayed is None,
            offload_params=self._offload_params,
            in_files=self._in_files(),
            initial=self._initial,
        )

    def _ordered_parameters(self) -> tuple[list[tuple[str, nn.Parameter]], list[Any]]:
        """Root parameters first, then each unit's, in module order; tied ones go to the root.
        Within a unit, one bucket per optimizer group (and dtype, `kept_in_fp32`)."""
        named = self._sharded_parameters()
        self._owner = parameter_owners(self.module, self._units)
        group, fp32 = self.groups.group, self._fp32_kept
        key = {id(p): (self._owner[id(p)], group[id(p)], id(p) in fp32) for _, p in named}
        named.sort(key=lambda item: key[id(item[1])])  # stable: module order kept
        self._size_of_unit: dict[int, int] = {}
        for _, param in named:
            unit = self._owner[id(param)]
            self._size_of_unit[unit] = self._size_of_unit.get(unit, 0) + 1
        return named, [key[id(p)] for _, p in named]

    def _hook_modules(self) -> None:
        """Hook every module that holds trainable parameters directly, every unit, the root."""
        unit_of_module = {id(unit): index for index, unit in enumerate(self._units, start=1)}
        unit_of_module[id(self.module)] = 0
        for sub in self.module.modules():
            owned = {
                self._owner[id(p)] for p in sub._parameters.values() if p is not None
                and p.requires_grad and self.groups.holds(p)
            }  # fmt: skip
            if id(sub) in unit_of_module:
                owned.add(unit_of_module[id(sub)])
            if owned:
                units = tuple(sorted(owned))
                self._hooks.append(sub.register_forward_pre_hook(partial(self._enter, units)))
                self._hooks.append(sub.register_forward_hook(self._exit, always_call=True))
                self._hooks.append(sub.register_state_dict_pre_hook(_refuse_freed_parameters))
        for bucket in self.reducer.buckets:
            for param in bucket.params:
                hook = partial(self._on_gradient_arrived, self._owner[id(param)])
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    # -- gathering and freeing (decided on the training thread, run on the comm thread) ------
    @torch.no_grad()
    def _gather_unit(self, unit: int) -> None:
        """All-gather a unit's flat buffers into their storage (on the communication thread)."""
        if self.link is not None:  # the shards the last publish sent up may still be on the way
            self.link.uploads_ready()
        for flat in self._flats_of_unit[unit]:
            storage = flat.flat_param.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(flat.flat_param.numel() * flat.flat_param.element_size())
            self.collectives.all_gather_into(flat.flat_param, self._shard_value(flat))

    def _shard_value(self, flat: FlatShard) -> torch.Tensor:
        """This rank's slice of a flat in the compute dtype (from disk under offload_params,
        and then, under offload, copied up into the flat buffer's own slice)."""
        shards = self.layout.shards
        if not self._offload_params:
            return shards[flat.bucket.index]
        if self._in_files():
            value = self.optimizer.read_param(flat.master).to(flat.flat_param.dtype)
        else:
            value = shards[flat.bucket.index]
        if self.link is None:
            return value
        mine = flat.flat_param[flat.lo : flat.hi]
        self.link.to_device(flat.bucket.index, value, mine)
        self.link.device_ready()  # the gather that follows reads `mine` on this stream
        self.link.wait()  # `value` is freed on return
        return mine

    def _in_files(self) -> bool:
        """The parameter partition is the inner optimizer's file (offload="nvme")."""
        return self._offload_params and self.swapped_masters

    def _request(self, unit: int | None) -> Future | None:
        """Queue the gather of a unit unless it is gathered or on its way; its future."""
        if unit is None or unit not in self._flats_of_unit:
            return None
        with self._lock:
            future = self._gathered.get(unit)
            if future is None:
                future = self.reducer.submit(self._gather_unit, unit)
                self._gathered[unit] = future
            return future

    def _need(self, unit: int) -> None:
        """Block until a unit's parameters are complete in its buffers."""
        future = self._request(unit)
        if future is not None:
            self._wait(future, f"all_gather of ZeRO-3 unit {unit}")

    def _wait(self, future: Future, what: str) -> None:
        wait_or_raise(
            future, what, self.timeout_s, dist.get_rank(), "another rank is not at this unit"
        )

    def _release(self, unit: int) -> None:
        """Free a unit's buffers now (after its gather, if one is still in flight)."""
        with self._lock:
            future = self._gathered.pop(unit, None)
            self._idle.pop(unit, None)
            if future is None:
                return
            self._wait(future, f"all_gather of ZeRO-3 unit {unit}")
            for flat in self._flats_of_unit[unit]:
                flat.flat_param.untyped_storage().resize_(0)

    def _release_unused(self, keep: set[int] = frozenset()) -> None:
        """Free every gathered unit that no running forward uses, except `keep`."""
        with self._lock:
            for unit in list(self._gathered):
                if unit not in keep and self._active.get(unit, 0) == 0:
                    self._release(unit)

    def _prefetch_behind(self, unit: int) -> None:
        """Backward nears `unit` (the one before in order): gather it unless it is done."""
        if unit not in self._finished:
            self._request(unit)

    # -- forward: module hooks --------------------------------------------------------------
    def _enter(self, units: tuple[int, ...], module: nn.Module, args: tuple) -> None:
        """Before a module holding parameters of `units` runs: gather them, prefetch the next."""
        with self._lock:
            saved_hooks = None
            # The outermost hooked forward packs saved parameters by unit. Not a forward run by
            # backward (activation checkpointing's recomputation): its tensors are used at once,
            # and a non-reentrant checkpoint must see them with its own hooks.
            if not self._calls and not in_backward():
                saved_hooks = self._residency.saved_tensors_hooks()
                saved_hooks.__enter__()
                if module is self.module:
                    self._residency.start_recording()
            self._calls.append((module, units, saved_hooks))
            starting = [unit for unit in units if self._active.get(unit, 0) == 0]
            for unit in units:
                self._active[unit] = self._active.get(unit, 0) + 1
                self._idle.pop(unit, None)
            if any(unit != 0 for unit in starting):
                for unit in list(self._idle):  # another unit starts: the finished ones go
                    self._release(unit)
            for unit in starting:
                self._need(unit)
                if self._residency.record(unit):
                    for ahead in self._residency.ahead(unit, 1):
                        self._request(ahead)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        """After a module's forward (also when it raised): its units may be freed."""
        with self._lock:
            if not self._calls or self._calls[-1][0] is not module:
                return  # our pre-hook did not run (an earlier pre-hook raised)
            _, units, saved_hooks = self._calls.pop()
            for unit in units:
                self._active[unit] -= 1
                if self._active[unit] == 0:
                    self._idle[unit] = None
            if saved_hooks is not None:
                saved_hooks.__exit__(None, None, None)
            if module is self.module and not self._calls:
                training = torch.is_grad_enabled()
                if training:
                    self._residency.adopt_recording()
                # Backward starts with the root (head, final norm): keep it if one may follow.
                self._release_unused(keep={0} if training else set())

    # -- backward: the saved tensors are the scheduler's; gradients arriving -------------------
    def _on_gradient_arrived(self, unit: int, param: torch.Tensor) -> None:
        """Free a unit once backward has produced every gradient of it."""
        with self._lock:
            if self._residency.gradient_arrived(unit, param, self._size_of_unit[unit]):
                self._finished.add(unit)
                if self._active.get(unit, 0) == 0:
                    self._release(unit)

    def _end_of_backward(self) -> None:
        """Backward is over (the scheduler's callback, under the lock): every unit goes."""
        self._finished.clear()
        self._release_unused()

    # -- the stage's gradient path and step ---------------------------------------------------
    def _reduce_bucket(self, bucket: Bucket) -> None:
        flat = self.flats[bucket.index]
        assert flat.bucket is bucket and flat.grad_shard is not None
        flat.grad_shard.add_(self._reduce_scatter_mean(bucket.buffer, flat.lo, flat.hi))

    def step(self, closure: Any = None) -> None:
        """Free every gathered copy first: after the step it would hold the old values."""
        self._release_unused()
        super().step(closure)

    @torch.no_grad()
    def _send(self, index: int) -> None:
        """Under offload: flat `index`'s updated partition up into its shard (a host shard
        under offload_params: the gathers copy it up); nothing where the gathers read the
        master itself. No collective: the next gathers read the shards."""
        assert self.link is not None
        flat, shard = self.flats[index], self.layout.shards[index]
        if self._in_files() or shard.data_ptr() == flat.master.data_ptr():
            return
        value = self.masters.published(flat)  # on the host
        if self._offload_params:  # the host step's own bf16 rounding where it made one
            rounded = self.link.take_staged(index)
            shard.copy_(value if rounded is None else rounded)
        else:
            self.link.to_device(index, value, shard)

    @torch.no_grad()
    def publish(self) -> None:
        """Refresh each shard from its master (no collective: the next gathers read them)."""
        self._release_unused()  # also after load_shards replaced the masters
        shards = self.layout.shards
        if self.link is not None:  # under offload: each partition goes up into its shard
            sent, self._sent = self._sent, {}
            for index in range(len(self.flats)):
                if index not in sent:
                    self._send(index)
            self.link.device_ready()
            self.link.release_uploads()  # the next step may write its host buffers
            return
        copied = self.mixed_precision is not None or self.delayed is not None
        if copied and not self.swapped_masters:
            for flat, shard in zip(self.flats, shards):
                shard.copy_(flat.master)

    @torch.no_grad()
    def show_values(self, values: list[torch.Tensor]) -> None:
        """Gathers read `values` until the next step publishes the masters (a DPU checkpoint)."""
        self._release_unused()
        for shard, value in zip(self.layout.shards, values):
            shard.copy_(value)


def _no_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)  # layouts only: no gradient buffer


def _refuse_freed_parameters(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """`state_dict()` between steps: raise instead of handing out views of freed storage.

    A ZeRO-3 parameter's storage is freed between uses; torch does not check a view against
    its storage, so `torch.save(model.state_dict())` wrote a file of garbage and reading one of
    its tensors could kill the process. `keep_vars=True` (tessera's own `full_state_dict`,
    which only reads the parameters' identities) is let through."""
    if keep_vars:
        return
    for name, param in module.named_parameters(recurse=False):
        end = (param.storage_offset() + param.numel()) * param.element_size()
        if param.numel() and param.untyped_storage().nbytes() < end:
            raise RuntimeError(
                f"{prefix}{name} is sharded by ZeRO-3 between steps (its storage is freed): "
                "`state_dict()` would read freed memory. Call `engine.full_state_dict()` on "
                "every rank (collective) for the whole model's values, or `engine.save(folder)` "
                "for a checkpoint."
            )
