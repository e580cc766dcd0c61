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
Schedules: `schedule.py` (naive, GPipe, 1F1B, interleaved 1F1B with `virtual_stages` v chunks per
rank: `chunks.py`). Actions and messages name a virtual stage `k = chunk * p + stage` (k = stage
without interleaving): F on k receives from k-1 and sends to k+1, the ranks around this one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

import torch
import torch.distributed as dist
from torch import nn

from tessera.optim.clip import clip_grad_norm, squared_sum, sum_over
from tessera.pipeline import messages
from tessera.pipeline.chunks import ChunkedStage, cut_layers, sum_tied_gradients
from tessera.pipeline.deferred import WeightGradDeferral
from tessera.pipeline.links import Links, Posted
from tessera.pipeline.microbatch import batch_rows, microbatch_sizes, split_rows
from tessera.pipeline.partition import balance_from_split
from tessera.pipeline.schedule import Action, _check
from tessera.pipeline.schedule import schedule as make_schedule
from tessera.pipeline.stage import ModelStage, tied_parameters
from tessera.pipeline.timeline import Event
from tessera.pipeline.trace import check_split, trace_stages
from tessera.runtime.context import default_timeout_s
from tessera.runtime.devices import collective_device

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
    # by (chunk, micro-batch): the tuples received (they need grads), sent (or the loss)
    stage_inputs: dict[tuple[int, int], tuple] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    outbox: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)  # gloo sends
    inbox: dict[int, Posted] = field(default_factory=dict)  # tag -> receive posted ahead
    position: int = 0  # index of the current action
    in_specs: dict[int, list[messages.TensorSpec]] = field(default_factory=dict)  # by chunk
    meta_sent: set[int] = field(default_factory=set)  # chunks whose shapes went out


class Pipeline:
    """One stage of a pipeline-parallel model per rank of `group`.

    `model` is an `nn.Sequential` (cut by `balance`, the layer count of each stage, or None to
    balance by parameter count; for balance by measured time: `balance_by_cost(
    measure_layer_times(model, sample), p)`), or any model with `split`: the names of the modules
    where a new stage starts (`trace.py`: traced with torch.export on the first batch, cut by
    PyTorch's pipeline frontend). An `nn.Sequential` split at top-level layers ("2", "5") is cut
    without tracing. A model on one stage needs neither. `num_microbatches` (m) splits each batch;
    `schedule` is "naive", "gpipe", "1f1b" or "interleaved" (`virtual_stages` v >= 2 chunks per
    rank of an `nn.Sequential`: p*v entries of `balance`, p*v - 1 top-level `split` layers, or
    None for p*v stages balanced by parameters). Every check (schedule name, m, v, balance, split
    points) raises ValueError before any message is sent.
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
        virtual_stages: int = 1,
    ) -> None:
        """Why so many parameters: the model, its cut (balance or split), the schedule (name,
        m, v) and the runtime (group, deadline, W pass, links) are each the caller's choice."""
        num_stages = dist.get_world_size(group) if dist.is_initialized() else 1
        _check(schedule, num_stages, num_microbatches, virtual_stages)
        v = virtual_stages
        if v > 1 and (num_stages < 2 or not isinstance(model, nn.Sequential)):
            raise ValueError(
                "the interleaved schedule cuts an nn.Sequential (or the reference GPT) at its "
                f"layers over at least 2 ranks; got a {type(model).__name__} on {num_stages}"
            )
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        self.num_stages = num_stages
        self.virtual_stages = v
        self.stage_index = dist.get_rank(group) if dist.is_initialized() else 0
        if self.stage_index < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the pipeline's group")
        self.model = model
        self.group = group
        self._timeout_s = timeout_s or default_timeout_s()
        self._shm_links = shm_links
        self._defer = defer_weight_grads
        self.actions: list[Action] = make_schedule(schedule, num_stages, num_microbatches, v)[
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
        self._chunks: list[Any] = []  # the stage's chunks (interleaved), else [the stage]
        split = list(split) if split is not None else None
        if split is not None and balance is not None:
            raise ValueError("give split (module names) or balance (layer counts), not both")
        if isinstance(model, nn.Sequential) and split is not None:
            from_split = balance_from_split(len(model), split, num_stages * v)
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
        self.balance, chunks, ties = cut_layers(model, balance, num_stages, v, self.stage_index)
        self._build(chunks[0] if v == 1 else ChunkedStage(chunks, self.stage_index), ties, chunks)

    def _build(
        self, stage: Any, shared: list[tuple[int, list[int]]], chunks: list[Any] | None = None
    ) -> None:
        """Adopt this rank's `stage` (made of `chunks` when interleaved); `shared`: (position,
        stages) of the tied parameters."""
        self._stage = stage
        self._chunks = chunks or [stage]
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
            p, v = self.num_stages, self.virtual_stages
            neighbours = {self.stage_index - 1, self.stage_index + 1}
            if v > 1:  # chunk c of stage p-1 sends to chunk c+1 of stage 0: a ring
                neighbours = {s % p for s in neighbours} - {self.stage_index}
            # a link's ring must hold what one step may leave unread: metadata, v m messages,
            # the tied gradients; then a send never waits for the receiver
            self.links = Links(
                self.group,
                self._timeout_s,
                shm_with=tuple(sorted(s for s in neighbours if 0 <= s < p))
                if self._shm_links
                else (),
                slots=v * (self.num_microbatches + 1) + 1 + len(self._tied),
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

    def _record(self, kind: str, microbatch: int, start: float, chunk: int = 0) -> None:
        now = time.perf_counter()
        self.timeline.append(Event(self.stage_index, kind, microbatch, start, now, chunk))

    def _virtual(self, chunk: int) -> int:  # this rank's `chunk`'s place in the pipeline
        return chunk * self.num_stages + self.stage_index

    def _peer(self, offset: int) -> int:  # the rank of the virtual stage +1 / -1 (a ring)
        return (self.stage_index + offset) % self.num_stages

    def _tag(self, virtual: int, i: int, backward: bool) -> int:
        """Tag of micro-batch i's activation (backward: gradient) message into `virtual`."""
        return 2 * (virtual * self.num_microbatches + i) + int(backward)

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
                self._forward(step, action.microbatch, action.chunk)
            else:
                self._backward(step, action.microbatch, action.chunk)
            step.outbox = [(w, t) for w, t in step.outbox if not w.is_completed()]
        for work, _ in step.outbox:  # (the tensor stays referenced until its send completes)
            self.links.wait(work, "pipeline send")
        if self._tied:  # (chunks.py: in the full model's parameter order on every holder)
            sum_tied_gradients(self.links, self._tied, self.stage_index, _TIED_TAG)
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
        i, c = action.microbatch, action.chunk
        k = self._virtual(c)
        if action.kind == "F" and k > 0 and c in step.in_specs:
            return (self._tag(k, i, False), *messages.layout(self._in_parts(step, i, c)))
        if action.kind == "B" and not self._last(c) and (c, i) in step.outputs:
            floats = messages.floating(step.outputs[(c, i)])
            parts = messages.parts(floats)
            return (self._tag(k, i, True), *messages.layout(parts)) if floats else None
        return None

    def _last(self, chunk: int) -> bool:  # the pipeline's last virtual stage: takes the loss
        return self._virtual(chunk) == self.num_stages * self.virtual_stages - 1

    @staticmethod
    def _in_parts(step: _Step, i: int, chunk: int) -> list[tuple[tuple, torch.dtype]]:
        return [(spec.shape_for(step.sizes[i]), spec.dtype) for spec in step.in_specs[chunk]]

    def _receive(self, step: _Step, tag: int) -> torch.Tensor:
        """Wait for the message `tag` of the current action (posted ahead if possible); then
        post the receives of the next `_LOOKAHEAD` actions, overlapping them with this compute."""
        expected = self._expected(step, self.actions[step.position])
        assert expected is not None and expected[0] == tag  # internal invariant
        for ahead in self.actions[step.position : step.position + 1 + _LOOKAHEAD]:
            message = self._expected(step, ahead)
            if message is not None and message[0] not in step.inbox:
                peer = self._peer(-1 if ahead.kind == "F" else 1)
                step.inbox[message[0]] = self.links.post_recv(
                    message[1], message[2], peer, message[0]
                )
        posted = step.inbox.pop(tag)
        return self.links.take(posted, f"pipeline recv of {self.actions[step.position]}")

    def _forward(self, step: _Step, i: int, c: int) -> None:
        """F i of chunk c: receive the previous virtual stage's tuple, run the chunk, send its
        tuple on (or take the loss on the last virtual stage)."""
        began = time.perf_counter()
        received: tuple = ()
        k = self._virtual(c)
        if k > 0:
            if c not in step.in_specs:  # first message of the step: shapes and micro-batch sizes
                meta = self.links.recv(
                    (messages.meta_length(self.num_microbatches),),
                    torch.int64,
                    self._peer(-1),
                    _META_TAG + k,
                )
                step.in_specs[c], step.sizes = messages.decode_specs(meta)
            message = self._receive(step, self._tag(k, i, False))
            received = tuple(
                t.detach().requires_grad_(t.is_floating_point())
                for t in messages.unpack(message, self._in_parts(step, i, c))
            )
            step.stage_inputs[(c, i)] = received
            self._record("recv", i, began, c)
            began = time.perf_counter()
        inputs = step.inputs[i] if step.inputs else None
        with self.deferral.capturing() if self.deferral else contextlib.nullcontext():
            out = self._chunks[c].run(inputs, received)
        if self._last(c):
            # weight by the micro-batch's share: the sum is the whole batch's mean loss
            out = step.loss_fn(out, step.targets[i]) * (step.sizes[i] / sum(step.sizes))
            step.loss = step.loss.to(out.device) + out.detach()  # on the loss's device
            step.outputs[(c, i)] = out
            self._record("F", i, began, c)
            return
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        self._record("F", i, began, c)
        step.outputs[(c, i)] = out
        began = time.perf_counter()
        if c not in step.meta_sent:  # shapes first: gloo needs the exact receive size
            meta = messages.encode_specs(out, step.sizes)
            self._send(step, meta, self._peer(1), _META_TAG + k + 1)
            step.meta_sent.add(c)
        self._send(step, messages.pack(out), self._peer(1), self._tag(k + 1, i, False))
        self._record("send", i, began, c)

    def _backward(self, step: _Step, i: int, c: int) -> None:
        """B i of chunk c: receive the output's gradient (or start from the loss),
        back-propagate, send the input's gradient to the previous virtual stage."""
        began = time.perf_counter()
        k = self._virtual(c)
        if self._last(c):
            step.outputs.pop((c, i)).backward()
        else:
            floats = messages.floating(step.outputs[(c, i)])
            if floats:  # (a tuple of integer tensors carries no gradient back)
                # before the pop: the shapes are the outputs'
                message = self._receive(step, self._tag(k, i, True))
                grads = messages.unpack(message, messages.parts(floats))
                self._record("recv", i, began, c)
                began = time.perf_counter()
                pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            step.outputs.pop((c, i))
        self._record("B", i, began, c)
        if k > 0:
            floats = messages.floating(step.stage_inputs.pop((c, i)))
            if floats:
                grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in floats]
                began = time.perf_counter()
                self._send(step, messages.pack(grads), self._peer(-1), self._tag(k - 1, i, True))
                self._record("send", i, began, c)

    def _microbatch_sizes(self, batch: Any) -> list[int]:
        """Dim-0 sizes of the micro-batches (ValueError if the batch is smaller than m)."""
        if batch is None:
            if self.is_first or self.is_last:
                raise ValueError("the first stage needs inputs and the last stage targets")
            return []  # a middle stage learns them from the previous stage's metadata
        return microbatch_sizes(batch_rows(batch), self.num_microbatches)

    def _broadcast_loss(self, total: torch.Tensor) -> float:
        if self.num_stages == 1:
            return float(total)
        value = total.detach().float().reshape(1).to(collective_device(self.group), copy=True)
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

    def clip_grad_norm(self, max_norm: float) -> SupportsFloat:
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
        merged = {key: value for part in parts for key, value in part.items()}
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
