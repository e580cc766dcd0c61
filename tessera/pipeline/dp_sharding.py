"""Data parallelism across the dp axis of a mesh, inside each pipeline stage: DDP, ZeRO-1, ZeRO-2.

The dp peers of a mesh hold the same pipeline stage (and tensor-parallel shard), so the stage can
be made data parallel exactly as a whole model is: with tessera's own `DataParallel` reducer
(gradient buckets all-reduced, `StageDataParallel`), or sharded with `tessera.zero`'s
`ZeroStage1` / `ZeroStage2` (flat buckets, rank r owns slice r of each, reduce-scatter the
gradients, step the slice, all-gather the parameters; Rajbhandari et al. 2020, `StageZero`).

What a pipeline changes is *when* a gradient is final. A stage runs m micro-batch backwards per
step; reducing after each one would cost m reduce-scatters per step, which is why DeepSpeed
refuses ZeRO-2 with pipeline parallelism. Here the reducer is silent during the schedule
(gradients accumulate locally, as under DDP's `no_sync`) and is armed just before the stage's
W pass (`Pipeline(defer_weight_grads=True)`, see `deferred.py`):

* the gradients already complete at that point (layer norms, embeddings, the tied embedding
  after its cross-stage sum) are marked ready;
* every linear layer's gradient arrives once, from the W pass, whose gradient hooks launch each
  bucket's reduce-scatter as soon as the bucket is complete, overlapping the W pass.

The same holds for plain DDP, whose bucket all-reduces then overlap the W pass. Under ZeRO-2 a
bucket's full gradient is freed as soon as it is reduced: full gradients exist only for the
buckets not reduced yet (every bucket at the end of the W pass only if the W pass outruns the
communication, as on a tiny model) and none between steps. Communication per step: one
reduce-scatter and one all-gather of the stage, 2Ψ/pp elements, as for an all-reduce. Without
deferral every gradient is complete before the W pass and all the buckets are reduced then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from tessera.data_parallel.ddp import DataParallel
from tessera.data_parallel.policy import DDPPolicy
from tessera.data_parallel.reducer import Reducer
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.stage1 import ZeroStage1
from tessera.zero.stage2 import ZeroStage2

__all__ = ["StageDataParallel", "StageZero"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer over the parameters it is given (ZeRO: over this rank's slices)."""


class _ArmedForWeightPass:
    """A gradient reducer kept silent during a pipeline's schedule and armed for its W pass."""

    reducer: Reducer
    find_unused_parameters = False
    """True: a trainable parameter with no gradient when armed is averaged as zero; False: an
    error naming it (PyTorch DDP's meaning of the knob)."""

    def arm(self, ready: list[nn.Parameter]) -> None:
        """Before the W pass: `ready` gradients are complete; the rest arrive through hooks.
        A frozen parameter among `ready` has no gradient and no place in the buckets: skipped."""
        ready = [p for p in ready if p.requires_grad]
        if not self.find_unused_parameters:
            ids = {id(p) for p in ready}
            unused = [name for name, p in self._names() if p.grad is None and id(p) in ids]
            if unused:
                raise RuntimeError(
                    f"stage parameters received no gradient in this step: "
                    f"{', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}. If the model "
                    "does not use them every step, pass find_unused_parameters=True."
                )
        self.reducer.sync_enabled = True
        self.reducer.exposed_comm_s = 0.0
        self.reducer.prepare_for_backward(unused=ready)

    def _names(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for b in self.reducer.buckets for name, p in zip(b.names, b.params)]

    def finish(self) -> float:
        """After the step's backward: wait for every bucket's reduction, silence the reducer.

        Returns the seconds spent waiting for reductions, the communication the W pass did not
        hide (the end of the W pass's backward waits for them; a stage without a W pass here).
        """
        waited_in_weight_pass = self.reducer.exposed_comm_s
        self.reducer.wait()
        self.reducer.sync_enabled = False
        return waited_in_weight_pass + self.reducer.exposed_comm_s


class StageDataParallel(_ArmedForWeightPass):
    """DDP of one pipeline stage's `module` over the dp `group`: gradients averaged in buckets
    (each wait bounded by `timeout_s`; None: this rank's `Context.timeout_s`)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup,
        bucket_cap_mb: float = DDPPolicy.bucket_cap_mb,
        timeout_s: float | None = None,
    ) -> None:
        # the stage's forward is driven by the pipeline, not by the wrapper: its buffers (none in
        # the GPT) would not be re-broadcast, so they are not broadcast at all
        self.ddp = DataParallel(
            module,
            group=group,
            bucket_cap_mb=bucket_cap_mb,
            broadcast_buffers=False,
            timeout_s=timeout_s,
        )
        self.reducer = self.ddp.reducer
        self.reducer.sync_enabled = False  # silent during the schedule's micro-batches

    def finish(self) -> float:
        """As the base's; with `find_unused_parameters` a parameter no dp peer used then keeps
        no gradient, as on one process (ZeRO steps its flat slices whole: a zero gradient)."""
        seconds = super().finish()
        if self.find_unused_parameters:
            self.reducer.drop_globally_unused()
        return seconds


class StageZero(_ArmedForWeightPass):
    """ZeRO stage 1 or 2 of one pipeline stage's `module` over the dp `group`."""

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        stage: int,
        group: dist.ProcessGroup,
        norm_weight: dict[int, float],
        bucket_cap_mb: float = DDPPolicy.bucket_cap_mb,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeRO inside pipeline stages is stage 1 or 2, got {stage}")
        cls = ZeroStage1 if stage == 1 else ZeroStage2
        self.inner: ZeroOptimizer = cls(
            module, make_optimizer, group=group, bucket_cap_mb=bucket_cap_mb
        )
        self.optimizer = self.inner.optimizer
        self.reducer = self.inner.reducer
        self.reducer.sync_enabled = False  # silent during the schedule's micro-batches
        # per element of this rank's slices: 1 if it counts in the global gradient norm
        weights = {name: norm_weight[id(p)] for name, p in module.named_parameters()}
        self._norm_weights = []
        for flat in self.inner.flats:
            full = torch.zeros(
                flat.flat_param.numel(), dtype=torch.float64, device=flat.flat_param.device
            )
            offsets = flat.layout.offsets
            for index, name in enumerate(flat.layout.names):
                full[offsets[index] : offsets[index + 1]] = weights[name]
            self._norm_weights.append(full[flat.lo : flat.hi])

    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (its reduced slices)."""
        total = torch.zeros((), dtype=torch.float64)
        pairs = zip(self.inner.gradient_slices(), self._norm_weights)
        for index, (grad, weight) in enumerate(pairs):
            part = (grad.double().square() * weight.to(grad.device)).sum()
            total = part if index == 0 else total + part.to(total.device)  # on the grads' device
        return total

    def step(self) -> None:
        """Step this rank's slices (at the lr of the optimizer's `param_groups`), all-gather them
        into the parameters, clear the gradients."""
        self.inner.step()
        self.inner.zero_grad()

    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state on this rank (from storages)."""
        return self.inner.memory_usage()["total"]
