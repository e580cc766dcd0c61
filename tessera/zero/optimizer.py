"""`ZeroOptimizer`: what the three ZeRO stages share — flat buffers, shards, the sharded step.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020). Every stage keeps, per gradient bucket (`tessera.data_parallel.bucket`), one flat
parameter buffer whose views are the module's parameters, padded to a multiple of the world size
(`partition.py`); rank r owns slice r. The inner `torch.optim` optimizer sees only this rank's
slices (the "master" shards), so its state is 1/N of the whole. It is the user's optimizer,
built on the model's parameters and then given the masters in their place: a bucket never mixes
two of its parameter groups, so each master steps with its group's hyper-parameters
(`tessera.zero.groups`). A step is

    per bucket: gradient slice (reduced by the stage) -> master.grad
    inner optimizer step on the slices
    the stage publishes the new slices (stages 1/2 all-gather the flat buffers)

which is exactly single-process training for any element-wise optimizer (SGD, Adam, AdamW, ...):
an optimizer that mixes elements across a tensor (LAMB's trust ratio, Adafactor) would see
slices instead of whole tensors. With `mixed_precision="bf16"` parameters and gradients are bf16
for compute and communication and the masters are fp32 copies (the paper's K = 12 for Adam).
All collectives run on the group's one communication stream (`tessera.comm.stream`), shared with
any other engine on the group, so every rank issues them in the same order.
`delayed_update=True` runs the inner step in a background thread, overlapped with the next
forward and backward (ZeRO-Offload's DPU): a `DelayedUpdate` (`tessera.zero.delayed`) the
optimizer holds. Where the fp32 masters live (in memory, or in the files of `offload="nvme"`) is
another collaborator, `HeldMasters` or `SwappedMasters` (`tessera.zero.masters`). Under offload
the step's tensors are on the host, moved per bucket by a `HostLink` (`tessera.zero.host_link`).
The flat buffers, slices and masters themselves are a `ShardLayout` (`tessera.zero.shards`),
the collectives a `ZeroCollectives` (`tessera.zero.collectives`): the collaborators receive
those, never this class, so none of them depends on it.

Transport: a reduce-scatter and an all-gather (the paper's Ψ elements each) through
`tessera.comm` with the cost model's choice: on one host its shared-memory collectives
(`comm.shm.gather`: one barrier each, the reduce-scatter moving about a third of the bytes of an
all-reduce), across hosts the ring or gloo's own. Stage 1 on one host reduces gradients with the
in-place all-reduce instead: its buffers keep the group mean between backwards, which gradient
accumulation needs without a separate shard (see `stage1`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.comm.stream import stream_for
from tessera.data_parallel.bucket import Bucket
from tessera.data_parallel.ddp import broadcast_from_first
from tessera.data_parallel.policy import DDPPolicy
from tessera.data_parallel.reducer import Reducer
from tessera.optim.clip import clip_grad_norm
from tessera.runtime.context import current_context
from tessera.zero.bf16_forward import Bf16Forward, kept_in_fp32, to_bf16_storageless
from tessera.zero.collectives import ZeroCollectives
from tessera.zero.delayed import DEFAULT_WARMUP_STEPS, DelayedUpdate, check_collaborators
from tessera.zero.groups import OptimizerGroups
from tessera.zero.host_link import HostLink
from tessera.zero.masters import HeldMasters, SwappedMasters
from tessera.zero.memory import held_bytes
from tessera.zero.partition import padded_numel
from tessera.zero.shards import FlatShard, ShardLayout

__all__ = ["FlatShard", "ZeroOptimizer"]  # FlatShard: its home is tessera.zero.shards


class ZeroOptimizer:
    """Base of `ZeroStage1/2/3`: driven like a `torch.optim.Optimizer` (step, zero_grad)."""

    stage = 0
    release_gradients = False
    """Free each bucket's full gradient once reduce-scattered (stages 2 and 3)."""

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: Any,
        *,
        group: dist.ProcessGroup | None = None,
        mixed_precision: str | None = None,
        bucket_cap_mb: float = DDPPolicy.bucket_cap_mb,
        swap_masters: bool = False,
        delayed_update: bool = False,
        delayed_update_after: int = DEFAULT_WARMUP_STEPS,
        host_huge_pages: bool = False,
        host_step: bool = False,
    ) -> None:
        """Why so many parameters: a keyword per collaborator switch (`zero.api.shard` sets them).
        Why so long: it builds those collaborators (link, layout, reducer, masters) in dependency
        order."""
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs a process group: call tessera.init() first")
        if mixed_precision not in (None, "bf16"):
            raise ValueError(f"mixed_precision must be None or 'bf16', got {mixed_precision!r}")
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = current_context().timeout_s
        self.mixed_precision = mixed_precision
        check_collaborators(delayed_update, delayed_update_after, swap_masters)
        self.groups = OptimizerGroups.of(module, make_optimizer)  # (stage 3 read them first)
        self._fp32_kept = kept_in_fp32(module, mixed_precision)
        self.delayed: DelayedUpdate | None = None
        """The one-step delayed update (ZeRO-Offload's DPU), or None: every step in place."""
        if delayed_update:
            self.delayed = DelayedUpdate(delayed_update_after, self.rank, self.timeout_s)
        self.host_huge_pages = host_huge_pages
        """The buffers the inner optimizer steps (fp32 master and gradient slices) are allocated
        on transparent huge pages (`offload="cpu"`: `CPUAdam` streams them, see `host_zeros`)."""
        self.swapped_masters = swap_masters
        """The fp32 masters live in the inner optimizer's files (`offload="nvme"`): they have
        no storage here; the step publishes each updated chunk into the layout's target."""
        named, units = self._ordered_parameters()
        if not named:
            raise ValueError("the module has no trainable parameters: nothing to shard")
        self.link = HostLink.of(named, host_huge_pages) if host_step else None
        """Offload: the host tensors the step reads and writes, copied to and from the device."""
        self._sent: dict[int, Future | None] = {}
        """Flats the last step sent up as it went (index -> its gather): `publish` skips them."""
        stream = stream_for(group)  # construction's collectives, in order with other engines'
        stream.run(_check_same_model, module, group, what=f"ZeRO-{self.stage} model check")
        self.one_host = self.world > 1 and stream.run(comm.same_host, group, what="host check")
        """Every rank of the group on this host: stage 1 then all-reduces gradients in place."""
        everything = [  # not a meta-device model's parameters: no memory, sent unit by unit
            t for t in [*module.parameters(), *module.buffers()] if t.untyped_storage().nbytes()
        ]
        if self.world > 1:  # (a one-rank group has nothing to copy; the flat copy costs a model)
            stream.run(broadcast_from_first, everything, group, what="parameter broadcast")
        # Each parameter's value until its flat buffer holds it; popped flat by flat, so the
        # originals are freed as the flats fill (memory at set-up: about one model, not two).
        sources = {id(p): p.detach() for _, p in named}
        if mixed_precision == "bf16":  # filled from `sources` by make_flat: untouched till then
            to_bf16_storageless(named, self._fp32_kept)
        world, self.layout = self.world, self._new_layout()
        self.reducer = Reducer(
            named,
            cap_bytes=int(bucket_cap_mb * 2**20),
            reduce_bucket=self._reduce_and_offload,
            rank=dist.get_rank(),
            timeout_s=self.timeout_s,
            allocate=lambda n, dtype, device: self.layout.zeros(
                padded_numel(n, world), dtype, device, stepped=not self.release_gradients
            ),
            units=units,
            release_buffers=self.release_gradients,
            group=group,
            engine_kind=f"ZeRO-{self.stage}",
        )
        self.collectives = ZeroCollectives(self.reducer, group, self.stage, self.timeout_s)
        """The collectives after construction, on the group's stream in order."""
        self.masters: HeldMasters | SwappedMasters = (
            SwappedMasters(self.layout) if swap_masters else HeldMasters(self.layout)
        )
        """Where the masters live: builds the flats and the inner optimizer, runs the step."""
        self.flats: list[FlatShard] = self.layout.flats  # (filled by `masters.build`)
        self.optimizer = self.masters.build(self.reducer.buckets, sources, self._inner_optimizer)
        self._bf16 = Bf16Forward(named[0][1].device.type) if mixed_precision == "bf16" else None
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward),
            module.register_forward_hook(self._after_forward, always_call=True),
        ]

    # -- construction -------------------------------------------------------------------------
    def _new_layout(self) -> ShardLayout:
        """The shard layout of stages 1/2 (stage 3 keeps its own shards: it overrides this)."""
        copied = self.mixed_precision is not None or self.delayed is not None
        return ShardLayout(
            self.world,
            self.rank,
            link=self.link,
            huge_pages=self.host_huge_pages,
            release_gradients=self.release_gradients,
            master_copied=copied or self.link is not None,  # offloaded: a host master
        )

    def _sharded_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters ZeRO shards: trainable ones that a group of the optimizer holds."""
        return [
            (n, p) for n, p in self.module.named_parameters()
            if p.requires_grad and self.groups.holds(p)
        ]  # fmt: skip

    def _ordered_parameters(self) -> tuple[list[tuple[str, nn.Parameter]], list[Any] | None]:
        """Sharded parameters in bucket order, and their units: a bucket never mixes two
        optimizer groups (stage 3 also splits by module unit), nor bf16 parameters with those
        kept fp32. Sorted by descending group, so that buckets (assigned in reverse) come in
        group order, each in reverse module order."""
        named = self._sharded_parameters()
        key = {id(p): (-self.groups.group[id(p)], id(p) in self._fp32_kept) for _, p in named}
        named.sort(key=lambda item: key[id(item[1])])  # stable
        return named, [key[id(p)] for _, p in named]

    def _inner_optimizer(self, masters: list[nn.Parameter]) -> Any:
        """The inner optimizer over `masters` (one per bucket, in order), each in its
        bucket's group, with that group's hyper-parameters (`OptimizerGroups.build`)."""
        buckets = self.reducer.buckets
        return self.groups.build(masters, [self.groups.group[id(b.params[0])] for b in buckets])

    # -- hooks ------------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple) -> tuple | None:
        """Start a reduction round; under bf16 run the forward under autocast (`bf16_forward`)."""
        if torch.is_grad_enabled() and self.reducer.sync_enabled:
            self.reducer.prepare_for_backward()
        return self._bf16.enter(args) if self._bf16 is not None else None

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """bf16: leave the forward's autocast (also when it raised); outputs in fp32."""
        return self._bf16.exit(output) if self._bf16 is not None else None

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """Reduce one bucket's gradients (on the communication stream); per stage."""
        raise NotImplementedError

    def _reduce_and_offload(self, bucket: Bucket) -> None:
        """The stage's reduction; under offload the partition then goes to the host at once."""
        self._reduce_bucket(bucket)
        if self.link is not None:
            flat = self.flats[bucket.index]
            self.link.to_host(bucket.index, self.layout.gradient_slice(flat))

    def step_gradient(self, flat: FlatShard) -> torch.Tensor:
        """The gradient slice the step reads: the stage's, or under offload its host copy."""
        return self.layout.step_gradient(flat)

    def gradient_slices(self) -> list[torch.Tensor]:
        """This rank's averaged gradient slice of every bucket, as the step reads it."""
        return [self.layout.step_gradient(flat) for flat in self.flats]

    def publish(self) -> None:
        """After the inner step (or a checkpoint load): make the new slices visible as the
        module's parameters (stages 1/2: all-gather every flat buffer from the slices, a
        collective; stage 3 overrides)."""
        if self.link is not None:  # under offload: each slice goes up, then the gather
            self._publish_offloaded()
            return
        for index, flat in enumerate(self.flats):
            mine = self.masters.published(flat)
            self.collectives.run(
                self.collectives.all_gather_into, flat.flat_param, mine, item=index
            )

    def _publish_offloaded(self) -> None:
        """Stages 1/2 under offload: each rank's updated partition goes up into its slice of
        the flat buffer, then the flat is all-gathered in place on the group's stream (bucket
        k's gather runs while bucket k+1 goes up), but for the flats the step sent already
        (`_sent`); returns once every copy and gather has been queued and the copies whose host
        side the next step writes have finished (a delayed step starts right after); a staging
        set sent up may still be on its way (`HostLink.release_uploads`)."""
        link = self.link
        assert link is not None
        sent, self._sent = self._sent, {}
        futures = [sent[i] if i in sent else self._send(i) for i in range(len(self.flats))]
        for future in futures:
            if future is not None:
                self.collectives.wait(future, "all_gather")
        link.release_uploads()

    def _send(self, index: int) -> Future | None:
        """Under offload: flat `index`'s updated partition up into its slice of the flat
        buffer, and its all-gather queued after it (stages 1/2; stage 3 overrides)."""
        assert self.link is not None
        flat = self.flats[index]
        mine = flat.flat_param[flat.lo : flat.hi]
        self.link.to_device(index, self.masters.published(flat), mine)
        gather = _gather_uploaded(self.link, self.collectives, flat.flat_param, mine)
        return self.collectives.submit(gather, item=index)

    def visible_slice(self, flat: FlatShard) -> torch.Tensor:
        """This rank's slice of `flat` as forward sees it (stages 1/2: of the flat buffer)."""
        return self.layout.visible_slice(flat)

    @torch.no_grad()
    def show_values(self, values: list[torch.Tensor]) -> None:
        """Make forward see `values` (this rank's slice of each flat), not the masters: a DPU
        checkpoint's parameters, one step behind its masters. Collective on stages 1/2."""
        for index, (flat, value) in enumerate(zip(self.flats, values)):
            target = flat.flat_param[flat.lo : flat.hi]
            target.copy_(value)
            gather = self.collectives.all_gather_into
            self.collectives.run(gather, flat.flat_param, target.detach(), item=index)

    def master_value(self, flat: FlatShard) -> torch.Tensor:
        """This rank's fp32 master slice of `flat` (read back from disk if it is swapped)."""
        return self.masters.value(flat)

    @torch.no_grad()
    def set_master(self, flat: FlatShard, value: torch.Tensor) -> None:
        """Replace this rank's master slice of `flat` (a checkpoint load); `publish` follows."""
        self.masters.set(flat, value)

    # -- the stage's gradient reduction -------------------------------------------------------
    def _reduce_scatter_mean(self, buffer: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """This rank's slice `[lo, hi)` of the group's average of `buffer` (may clobber it).

        One rank: the buffer is its own average, returned as a view (a reduce-scatter over one
        rank copies the whole gradient, a pass over memory per bucket per step for nothing)."""
        if self.world == 1:
            return buffer[lo:hi]
        if self.one_host and not self.release_gradients:  # stage 1: see the module docstring
            comm.all_reduce(buffer, "mean", group=self.group)
            return buffer[lo:hi]
        return comm.reduce_scatter(buffer, "mean", group=self.group)

    # -- the optimizer interface ---------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (set `lr` here, as with any optimizer).

        Under DPU this first waits for the step in flight, which reads them: a new `lr` set for
        the next step must not change the running one."""
        self.wait_for_step()
        return self.optimizer.param_groups

    def wait_for_step(self) -> None:
        """Under DPU: block until the background step has finished (its result unpublished).

        The master weights and the optimizer state are then those after every step taken; the
        module's parameters still show the values of one step before, until the next `step`.
        """
        if self.delayed is not None:
            self.delayed.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the last backward."""
        for param in self.module.parameters():
            param.grad = None
        for flat in self.flats:
            if flat.grad_shard is not None:
                flat.grad_shard.zero_()
        if self.link is not None:
            self.link.forget_gradients()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients to global norm <= `max_norm`; the norm is summed over all shards."""
        return clip_grad_norm(self.gradient_slices(), max_norm, all_reduce=self.reduce_squared_norm)

    def reduce_squared_norm(self, total: torch.Tensor) -> torch.Tensor:
        """A squared norm's shares summed over the group on its stream (offloaded: on the host)."""
        sums = self.collectives.run(_all_reduce_sum, self._on_device(total), self.group)
        return self._on_device(sums, host=True)

    def _on_device(self, tensor: torch.Tensor, host: bool = False) -> torch.Tensor:
        """`tensor` where the collectives run (a host value goes to the device: NCCL); `host`:
        back on the host (offloaded gradients are clipped there, no device scalar beside them)."""
        return tensor if self.link is None else tensor.to("cpu" if host else self.link.device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Step this rank's slices with the inner optimizer, then publish them.

        Under DPU (after the warm-up steps): publish the previous step's result, then launch
        this one in the background; its result is published by the next call.
        """
        if closure is not None:
            raise ValueError("ZeRO optimizers do not take a closure")
        if self.delayed is not None and self.delayed.take_step(
            self.layout, self.optimizer, self.publish
        ):
            return  # in the background; published by the next step
        # Under offload each flat goes up as soon as the host step has updated it, while the
        # step goes on with the next one (DeepSpeed's CPU Adam does the same per tile); the
        # publish then sends the rest. Kept only once the step has finished (a step that
        # raised has sent nothing that a later publish may skip).
        sent: dict[int, Future | None] = {}

        def send(flat: FlatShard) -> None:
            sent[flat.bucket.index] = self._send(flat.bucket.index)

        self.masters.step(after_each=send if self.link is not None else None)
        self._sent = sent
        self.publish()

    @torch.no_grad()
    def finish_step(self) -> None:
        """Under DPU: wait for the step in flight and publish it (collective on stages 1/2), so
        the module's parameters show every step taken (before evaluating or exporting the
        module). The next step then starts from fresh parameters: called mid-training, it
        makes that one step not stale. Without DPU: nothing to do."""
        if self.delayed is not None:
            self.delayed.finish(self.publish)

    def memory_usage(self) -> dict[str, int]:
        """Bytes of params, gradients and optimizer state held on this rank, from storages
        (`tessera.zero.memory.held_bytes`; under offload the host's included)."""
        return held_bytes(self)

    def num_params(self) -> int:
        """Trainable parameters of the whole model (Ψ), each tied tensor once."""
        return sum(flat.layout.numel for flat in self.flats)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, in fp32 (collective: the masters are all-gathered).

        Under DPU: the masters after every step taken, the one in flight included."""
        self.wait_for_step()
        out: dict[str, torch.Tensor] = {}
        for index, flat in enumerate(self.flats):
            master = self._on_device(self.master_value(flat))
            full = self.collectives.run(_all_gather, master, self.group, item=index)
            offsets = flat.layout.offsets
            for index, name in enumerate(flat.layout.names):
                piece = full[offsets[index] : offsets[index + 1]]
                out[name] = piece.view(flat.layout.shapes[index]).clone()
        return out

    def remove_hooks(self) -> None:
        """Detach from the module (after its queued collectives); the optimizer is done.

        Stages 1 and 2 leave the module's parameters at their current values; under stage 3 they
        are freed shards, so call `full_state_dict` first. An `offload="nvme"` optimizer's files
        are removed.
        """
        self.wait_for_step()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.reducer.remove_hooks()
        close = getattr(self.optimizer, "close", None)
        if close is not None:  # offload="nvme": remove its files now, not at exit
            close()


def _gather_uploaded(
    link: HostLink, collectives: ZeroCollectives, full: torch.Tensor, mine: torch.Tensor
) -> Any:
    """The gather of one flat, run on the group's stream once its upload has landed."""

    @torch.no_grad()
    def all_gather() -> None:
        link.device_ready()
        collectives.all_gather_into(full, mine.detach())

    all_gather.__name__ = "all_gather"
    return all_gather


def _all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return comm.all_reduce(tensor, "sum", group=group)


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return comm.all_gather(tensor, group=group)


def _check_same_model(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank must hold the same tensor names, shapes and dtypes as group rank 0."""
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in module.state_dict().items()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for group_rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == everyone[0]:
            continue
        ours = dict((n, (s, d)) for n, s, d in everyone[0])
        other = dict((n, (s, d)) for n, s, d in theirs)
        for name in sorted(set(ours) | set(other)):
            if ours.get(name) != other.get(name):
                raise ValueError(
                    f"rank {dist.get_rank()}: models differ across ranks: {name!r} is "
                    f"{ours.get(name)} on group rank 0 and {other.get(name)} on group rank "
                    f"{group_rank}"
                )
