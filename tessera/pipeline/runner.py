"""The pipeline runner: each rank runs one stage through a schedule's action list.

`Pipeline(model, num_microbatches=m, schedule="1f1b")` cuts an `nn.Sequential` (or any model with
`split=[module names]`, `trace.py`) into one stage per rank of `group`. `train_step(inputs,
targets, loss_fn)` splits the batch into m micro-batches and executes this stage's actions
(`schedule.schedule`): `F i` receives micro-batch i's tuple of activations from the previous
stage (stage 0 reads the input), runs the stage and posts its tuple to the next stage (the last
stage computes the loss instead); `B i` receives the gradients of the tuple's floating-point
tensors from the next stage (the last stage starts from its loss), back-propagates and posts the
input tuple's gradients to the previous stage (`messages.py`: one message per micro-batch).
Sends never wait for the receiver (a copy into a shared-memory ring when both stages share a
host, else a gloo isend: `links.py`); receives wait with a deadline.
Gradients of the micro-batches accumulate, each loss weighted by its share of the batch, so the
step equals one process on the whole batch for a mean-reduced loss.

With `defer_weight_grads` (the default when m > 1) each stage's backward computes only input
gradients during the schedule and the weight gradients of its linear layers in one W pass at the
end, over the whole batch at once (`deferred.py`: zero-bubble pipelining's B/W split, batched).

Cost per step and stage boundary: m activations forward and m gradients backward, each
`b/m x (activation size)`, plus one small metadata message (shapes) and one broadcast of the loss.
Schedules: naive (layer splitting), GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et
al. 2021); see `schedule.py` for their bubbles and memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.clip import clip_grad_norm, squared_sum, sum_over
from tessera.pipeline import messages
from tessera.pipeline.deferred import WeightGradDeferral
from tessera.pipeline.links import Links, Posted
from tessera.pipeline.microbatch import batch_rows, microbatch_sizes, split_rows
from tessera.pipeline.partition import (
    balance_by_cost,
    balance_from_split,
    check_balance,
    parameter_costs,
    stage_bounds,
)
from tessera.pipeline.schedule import Action, _check
from tessera.pipeline.schedule import schedule as make_schedule
from tessera.pipeline.stage import ModelStage, shared_parameters, slice_stage, tied_parameters
from tessera.pipeline.timeline import Event
from tessera.pipeline.trace import check_split, trace_stages
from tessera.runtime.context import default_timeout_s

__all__ = ["Pipeline"]

_META_TAG, _TIED_TAG = 1 << 20, 1 << 21
_LOOKAHEAD = 2
"""Receives posted ahead of the action needing them, so transfers overlap the current compute."""


@dataclass
class _Step:
    """What one stage keeps during one `train_step`."""

    sizes: list[int]  # dim-0 size of each micro-batch (a middle stage may learn them from metadata)
    inputs: list[Any]  # micro-batches of the model's inputs (every stage that has them)
    targets: list[Any]  # micro-batches of the targets (last stage)
    loss_fn: Callable[[Any, Any], torch.Tensor]
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    stage_inputs: dict[int, tuple] = field(default_factory=dict)  # received, need grads
    outputs: dict[int, Any] = field(default_factory=dict)  # tuple sent (or loss) until backward
    outbox: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)  # gloo sends
    inbox: dict[int, Posted] = field(default_factory=dict)  # tag -> receive posted ahead
    position: int = 0  # index of the current action
    in_specs: list[messages.TensorSpec] | None = None  # the received tuple's tensors
    meta_sent: bool = False


class Pipeline:
    """One stage of a pipeline-parallel model per rank of `group`.

    `model` is an `nn.Sequential` (cut by `balance`, the layer count of each stage, or None to
    balance by parameter count; for balance by measured time: `balance_by_cost(
    measure_layer_times(model, sample), p)`), or any model with `split`: the names of the modules
    where a new stage starts (`trace.py`: traced with torch.export on the first batch, cut by
    PyTorch's pipeline frontend). An `nn.Sequential` split at top-level layers ("2", "5") is cut
    without tracing. A model on one stage needs neither. `num_microbatches` (m) splits each batch;
    `schedule` is "naive", "gpipe" or "1f1b". Every check (schedule name, m, balance, split points)
    raises ValueError before any message is sent.
    Every receive waits at most `timeout_s` (default: this rank's `Context.timeout_s`).
    `defer_weight_grads` computes the linear layers' weight gradients in one W pass per step
    (faster; keeps each linear's input and output gradient until then, see `deferred.py`);
    None (the default) defers when there is more than one micro-batch and the stage runs the
    model's own modules (a traced stage runs ATen graphs, which have no `F.linear` to defer).
    `shm_links` sends to a neighbouring stage through shared memory when both are on one host
    (probed per link, `links.py`); False: always gloo.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_microbatches: int,
        schedule: str = "1f1b",
        group: dist.ProcessGroup | None = None,
        balance: Sequence[int] | None = None,
        split: Sequence[str] | None = None,
        timeout_s: float | None = None,
        defer_weight_grads: bool | None = None,
        shm_links: bool = True,
    ) -> None:
        num_stages = dist.get_world_size(group) if dist.is_initialized() else 1
        _check(schedule, num_stages, num_microbatches)
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        self.num_stages = num_stages
        self.stage_index = dist.get_rank(group) if dist.is_initialized() else 0
        if self.stage_index < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the pipeline's group")
        self.model = model
        self.group = group
        self._timeout_s = timeout_s or default_timeout_s()
        self._shm_links = shm_links
        self._defer = defer_weight_grads
        self.actions: list[Action] = make_schedule(schedule, num_stages, num_microbatches)[
            self.stage_index
        ]
        self.timeline: list[Event] = []
        """This stage's measured events of the last step (`gather_timeline` collects all)."""
        self.links: Links | None = None
        """Messages to the neighbouring stages (`links.transport(stage)`: "shm" or "gloo")."""
        self.deferral: WeightGradDeferral | None = None
        """The W pass of this stage's linear layers (None: weight gradients computed in B)."""
        self.split: list[str] | None = None
        """The split points of a traced pipeline (its stages exist after `prepare`)."""
        self._stage: Any = None
        split = list(split) if split is not None else None
        if split is not None and balance is not None:
            raise ValueError("give split (module names) or balance (layer counts), not both")
        if isinstance(model, nn.Sequential) and split is not None:
            from_split = balance_from_split(len(model), split, num_stages)
            if from_split is not None:  # top-level layers: cut without tracing
                balance, split = from_split, None
        if split is not None or not isinstance(model, nn.Sequential):
            if num_stages == 1 and not split:
                self._build(ModelStage(model), [])
            elif split is None:
                raise ValueError(
                    f"a {type(model).__name__} on {num_stages} stages needs split=[the module "
                    f"names where stages 1..{num_stages - 1} start]"
                )
            else:
                self.split = check_split(model, split, num_stages)
            return
        if balance is None:
            if len(model) < num_stages:
                raise ValueError(f"{len(model)} layers cannot fill {num_stages} stages")
            balance = balance_by_cost(parameter_costs(model), num_stages)
        self.balance = check_balance(balance, len(model), num_stages)
        bounds = stage_bounds(self.balance)
        self._build(slice_stage(model, bounds, self.stage_index), shared_parameters(model, bounds))

    def _build(self, stage: Any, shared: list[tuple[int, list[int]]]) -> None:
        """Adopt this rank's `stage`; `shared`: (position, stages) of the tied parameters."""
        self._stage = stage
        all_params = list(self.model.parameters())
        # (parameter, its position in the full model, the stages holding it), in position order:
        # the position is the message tag, identical on every holder however many other tied
        # groups each holder has (a stage-local index would pair different groups' messages)
        self._tied = [(all_params[k], k, s) for k, s in shared if self.stage_index in s]
        self._tied_ids = {id(p) for p, _, _ in self._tied}
        defer = self._defer
        if defer is None:  # one micro-batch has nothing to batch
            defer = self.num_microbatches > 1 and self.split is None
        if defer:  # a tied parameter's gradient must be whole before the exchange
            self.deferral = WeightGradDeferral(
                p for p in self.module.parameters() if id(p) not in self._tied_ids
            )
        if self.num_stages > 1:
            neighbours = (self.stage_index - 1, self.stage_index + 1)
            # a link's ring must hold what one step may leave unread: metadata, m messages,
            # the tied gradients; then a send never waits for the receiver
            self.links = Links(
                self.group,
                self._timeout_s,
                shm_with=tuple(s for s in neighbours if 0 <= s < self.num_stages)
                if self._shm_links
                else (),
                slots=self.num_microbatches + 2 + len(self._tied),
            )

    @property
    def ready(self) -> bool:
        """False until a traced pipeline has seen its first batch (`prepare`)."""
        return self._stage is not None

    @property
    def module(self) -> nn.Module:
        """This rank's stage: the model's own layers or parameters; build the optimizer on them."""
        if self._stage is None:
            raise RuntimeError("a pipeline split at named modules is traced on its first batch")
        return self._stage.module

    @property
    def stage(self) -> Any:
        """This rank's stage object (`stage.py`'s `StageSlice` / `ModelStage`, a `TracedStage`)."""
        return self._stage

    def prepare(self, inputs: Any) -> None:
        """Trace and cut a pipeline given `split` on its first micro-batch of `inputs` (every
        rank alike, before any message: a split that empties a stage fails here on every rank)."""
        if self._stage is not None:
            return
        sizes = microbatch_sizes(batch_rows(inputs), self.num_microbatches)
        stages, params = trace_stages(self.model, self.split, split_rows(inputs, sizes)[0])
        self._build(stages[self.stage_index], tied_parameters(self.model, params))

    @property
    def is_first(self) -> bool:
        """True on the stage that reads the inputs."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """True on the stage that computes the loss."""
        return self.stage_index == self.num_stages - 1

    def _record(self, kind: str, microbatch: int, start: float) -> None:
        self.timeline.append(Event(self.stage_index, kind, microbatch, start, time.perf_counter()))

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        before_weight_pass: Callable[[list[nn.Parameter]], None] | None = None,
    ) -> float:
        """Forward and backward of all micro-batches; return the batch's mean loss on every rank.

        `inputs` is what the model is called with (a tensor, or a dict for `model(**inputs)`),
        `targets` what `loss_fn(output, targets)` compares with (any tensor / tuple / dict); both
        are cut into micro-batches on dim 0. The first stage needs `inputs` (a traced pipeline:
        every stage), the last `targets`; others may pass None.
        Gradients accumulate into `.grad` of `self.module`'s parameters; the caller steps its
        optimizer. `before_weight_pass(ready)` runs once the schedule is done, before the W pass,
        with the parameters whose gradients are already complete: the others arrive during the W
        pass (through their gradient hooks), which is when a bucketed reducer may reduce them.
        """
        if self.split is not None:
            if inputs is None:
                raise ValueError("every stage of a pipeline split at named modules needs inputs")
            self.prepare(inputs)
        needs_inputs = self.is_first or self.split is not None
        sizes = self._microbatch_sizes(inputs if needs_inputs else targets)
        if self.split is not None and len(set(sizes)) > 1:
            raise ValueError(
                f"a pipeline split at named modules runs the shapes it traced: the batch of "
                f"{sum(sizes)} rows must divide into {self.num_microbatches} equal micro-batches"
            )
        step = _Step(
            sizes=sizes,
            inputs=split_rows(inputs, sizes) if needs_inputs and inputs is not None else [],
            targets=split_rows(targets, sizes) if self.is_last else [],
            loss_fn=loss_fn,
        )
        self.timeline = []
        if self.deferral is not None:
            self.deferral.clear()
        for position, action in enumerate(self.actions):
            step.position = position
            if action.kind == "F":
                self._forward(step, action.microbatch)
            else:
                self._backward(step, action.microbatch)
            step.outbox = [(w, t) for w, t in step.outbox if not w.is_completed()]
        for work, _ in step.outbox:  # (the tensor stays referenced until its send completes)
            self.links.wait(work, "pipeline send")
        self._sum_tied_gradients()
        self._weight_pass(before_weight_pass)
        return self._broadcast_loss(step.loss)

    def _weight_pass(self, before: Callable[[list[nn.Parameter]], None] | None) -> None:
        """Compute the deferred weight gradients (one "W" event), after `before(ready)`."""
        pending = self.deferral.pending() if self.deferral is not None else []
        waiting = {id(p) for p in pending}
        ready = [p for p in self.module.parameters() if id(p) not in waiting]
        if before is not None:
            before(ready)
        if pending:
            began = time.perf_counter()
            self.deferral.weight_pass()
            self._record("W", -1, began)

    def _send(self, step: _Step, tensor: torch.Tensor, stage: int, tag: int) -> None:
        work = self.links.send(tensor, stage, tag)
        if work is not None:  # gloo reads the tensor until the send completes
            step.outbox.append((work, tensor))

    def _expected(self, step: _Step, action: Action) -> tuple[int, tuple, torch.dtype] | None:
        """`(tag, shape, dtype)` of the message `action` waits for; None: none or unknown yet."""
        i = action.microbatch
        if action.kind == "F" and not self.is_first and step.in_specs is not None:
            return (2 * i, *messages.layout(self._in_parts(step, i)))
        if action.kind == "B" and not self.is_last and i in step.outputs:
            floats = messages.floating(step.outputs[i])
            return (2 * i + 1, *messages.layout(messages.parts(floats))) if floats else None
        return None

    @staticmethod
    def _in_parts(step: _Step, i: int) -> list[tuple[tuple, torch.dtype]]:
        return [(spec.shape_for(step.sizes[i]), spec.dtype) for spec in step.in_specs]

    def _receive(self, step: _Step, tag: int) -> torch.Tensor:
        """Wait for the message `tag` of the current action (posted ahead if possible); then
        post the receives of the next `_LOOKAHEAD` actions, overlapping them with this compute."""
        expected = self._expected(step, self.actions[step.position])
        assert expected is not None and expected[0] == tag  # internal invariant
        for ahead in self.actions[step.position : step.position + 1 + _LOOKAHEAD]:
            message = self._expected(step, ahead)
            if message is not None and message[0] not in step.inbox:
                peer = self.stage_index + (-1 if ahead.kind == "F" else 1)
                step.inbox[message[0]] = self.links.post_recv(
                    message[1], message[2], peer, message[0]
                )
        posted = step.inbox.pop(tag)
        return self.links.take(posted, f"pipeline recv of {self.actions[step.position]}")

    def _forward(self, step: _Step, i: int) -> None:
        """F i: receive the previous stage's tuple, run the stage, send its tuple (or the loss)."""
        began = time.perf_counter()
        received: tuple = ()
        if not self.is_first:
            if step.in_specs is None:  # first message of the step: shapes and micro-batch sizes
                meta = self.links.recv(
                    (messages.meta_length(self.num_microbatches),),
                    torch.int64,
                    self.stage_index - 1,
                    _META_TAG,
                )
                step.in_specs, step.sizes = messages.decode_specs(meta)
            message = self._receive(step, 2 * i)
            received = tuple(
                t.detach().requires_grad_(t.is_floating_point())
                for t in messages.unpack(message, self._in_parts(step, i))
            )
            step.stage_inputs[i] = received
            self._record("recv", i, began)
            began = time.perf_counter()
        inputs = step.inputs[i] if step.inputs else None
        with self.deferral.capturing() if self.deferral else contextlib.nullcontext():
            out = self._stage.run(inputs, received)
        if self.is_last:
            # weight by the micro-batch's share: the sum is the whole batch's mean loss
            out = step.loss_fn(out, step.targets[i]) * (step.sizes[i] / sum(step.sizes))
            step.loss += out.detach()
            step.outputs[i] = out
            self._record("F", i, began)
            return
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        self._record("F", i, began)
        step.outputs[i] = out
        began = time.perf_counter()
        if not step.meta_sent:  # shapes first: gloo needs the exact receive size
            meta = messages.encode_specs(out, step.sizes)
            self._send(step, meta, self.stage_index + 1, _META_TAG)
            step.meta_sent = True
        self._send(step, messages.pack(out), self.stage_index + 1, 2 * i)
        self._record("send", i, began)

    def _backward(self, step: _Step, i: int) -> None:
        """B i: receive the output's gradient (or start from the loss), back-propagate, send."""
        began = time.perf_counter()
        if self.is_last:
            step.outputs.pop(i).backward()
        else:
            floats = messages.floating(step.outputs[i])
            if floats:  # (a tuple of integer tensors carries no gradient back)
                message = self._receive(step, 2 * i + 1)  # before the pop: shapes are the outputs'
                grads = messages.unpack(message, messages.parts(floats))
                self._record("recv", i, began)
                began = time.perf_counter()
                pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            step.outputs.pop(i)
        self._record("B", i, began)
        if not self.is_first:
            floats = messages.floating(step.stage_inputs.pop(i))
            if floats:
                grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in floats]
                began = time.perf_counter()
                self._send(step, messages.pack(grads), self.stage_index - 1, 2 * i + 1)
                self._record("send", i, began)

    def _microbatch_sizes(self, batch: Any) -> list[int]:
        """Dim-0 sizes of the micro-batches (ValueError if the batch is smaller than m)."""
        if batch is None:
            if self.is_first or self.is_last:
                raise ValueError("the first stage needs inputs and the last stage targets")
            return []  # a middle stage learns them from the previous stage's metadata
        return microbatch_sizes(batch_rows(batch), self.num_microbatches)

    def _sum_tied_gradients(self) -> None:
        """Add the gradients of parameters held by several stages (e.g. tied embeddings).

        Every holder walks its tied parameters in the full model's parameter order and tags each
        exchange with that global position, so two groups held by different stage sets ({0, 3}
        and {1, 3}) never wait for each other: a holder's earlier exchanges involve only groups
        earlier in the same global order, which their holders reach first too.
        """
        for param, position, stages in self._tied:
            tag = _TIED_TAG + position
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            others = [s for s in stages if s != self.stage_index]
            sends = [self.links.send(grad.detach(), s, tag) for s in others]
            parts = {self.stage_index: grad}
            for s in others:
                parts[s] = self.links.recv(grad.shape, grad.dtype, s, tag)
            for work in sends:  # (None: already copied into a shared-memory ring)
                self.links.wait(work, "pipeline tied-gradient send")
            total = parts[stages[0]].clone()
            for s in stages[1:]:  # the same order on every holder: identical sums
                total += parts[s]
            param.grad = total

    def _broadcast_loss(self, total: torch.Tensor) -> float:
        if self.num_stages == 1:
            return float(total)
        value = total.reshape(1).clone()
        dist.broadcast(value, src=self.links.ranks[-1], group=self.group)
        return float(value)

    def grad_norm_sq(self) -> torch.Tensor:
        """This stage's share of the squared global gradient norm (tied parameters counted once)."""
        params = list(self.module.parameters())
        return squared_sum([p.grad for p in params], [self.counts_in_norm(p) for p in params])

    def full_key(self, stage_key: str) -> str:
        """The full model's key of this stage's state-dict key `stage_key`."""
        return self._stage.full_key(stage_key)

    def counts_in_norm(self, param: nn.Parameter) -> bool:
        """False for a tied parameter on a stage that is not its first holder (count it once)."""
        return id(param) not in self._tied_ids or self._tied_owner(param) == self.stage_index

    def _tied_owner(self, param: nn.Parameter) -> int:
        return next(stages[0] for p, _, stages in self._tied if p is param)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale every stage's gradients so the global norm is at most `max_norm`; return it."""
        return clip_grad_norm(
            [p.grad for p in self.module.parameters()],
            max_norm,
            local_sq_sum=self.grad_norm_sq(),
            all_reduce=sum_over(self.group) if self.num_stages > 1 else None,
        )

    def full_state_dict(
        self, *, stage_state: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The whole model's state dict (the model's own keys) on every rank; collective.

        `stage_state` replaces this stage's `module.state_dict()` (e.g. its tensor-parallel
        shards already gathered into dense tensors).
        """
        stage_state = self.module.state_dict() if stage_state is None else stage_state
        local = {self._stage.full_key(k): v.detach().cpu() for k, v in stage_state.items()}
        if self.num_stages == 1:
            return local
        parts: list[Any] = [None] * self.num_stages
        dist.all_gather_object(parts, local, group=self.group)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        if isinstance(self.model, nn.Sequential) and self.split is None:
            return dict(sorted(merged.items(), key=lambda kv: int(kv[0].partition(".")[0])))
        order = {key: k for k, key in enumerate(self.model.state_dict())}
        return dict(sorted(merged.items(), key=lambda kv: order.get(kv[0], len(order))))

    def gather_timeline(self) -> list[Event]:
        """Every stage's events of the last step, sorted by start time; collective."""
        if self.num_stages == 1:
            return list(self.timeline)
        parts: list[Any] = [None] * self.num_stages
        dist.all_gather_object(parts, self.timeline, group=self.group)
        return sorted((e for part in parts for e in part), key=lambda e: e.start)
