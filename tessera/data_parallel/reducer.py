"""The reducer: autograd hooks that launch each bucket's all-reduce as soon as it is complete.

During backward, a post-accumulate-grad hook on every parameter marks its gradient as arrived.
When the last member of a bucket arrives, that bucket (and any later ones already complete) is
submitted to the group's communication stream (`tessera.comm.stream`), strictly in bucket order,
so every rank issues the same collectives in the same order while backward keeps computing the
gradients of earlier layers. At the end of backward (an autograd engine callback) the reducer
waits for the buckets still in flight: that wait is the communication backward could not hide
(`exposed_comm_s`).

The stream is one FIFO thread per process group, shared with every other engine on the group (a
second `DataParallel`, ZeRO): collectives keep one order across engines, and each carries its
engine's label so that ranks which submit in different orders get `CollectiveMismatch` instead of
averaging the wrong buckets. `submit` runs other collectives (ZeRO's parameter gathers) on that
same stream. The reduction itself releases the GIL while it waits on sockets or shared memory.

Rounds. Each backward is one reduction round: `.grad` ends as the sum over backwards of the
group-mean gradient, as with torch's DDP. A round starts at the wrapped forward
(`prepare_for_backward`) or, for a backward without a forward since the last one ended (a second
`backward(retain_graph=True)`, a loss on parameters used outside forward), at that backward's
first gradient; a round started that way cannot know which parameters the backward reaches, so at
its end every bucket not yet launched is reduced too (a missing gradient counts as zero). A
gradient that arrives for a parameter already counted in a round still running (marked unused at
forward, or reached twice in one backward by reentrant checkpointing) is still reduced if its
bucket has not been launched; once it has, the gradient cannot be reduced any more: it raises,
naming the parameter, instead of staying on this rank only.

With `release_buffers=True` (ZeRO-2/3) a bucket's buffer exists only from its first gradient
until its reduction has finished: the full gradients are freed as soon as they are reduced.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch import nn

from tessera.comm.stream import stream_for
from tessera.data_parallel.bucket import Bucket, BufferFactory, assign_buckets
from tessera.errors import CollectiveTimeout
from tessera.runtime.wait import wait_or_raise

__all__ = ["Reducer"]


class Reducer:
    """Bucketed, overlapped gradient reduction for a list of parameters.

    Why so many parameters: DDP and the three ZeRO stages share this one reducer, and each
    keyword is where they differ (how a bucket is reduced, allocated and released, which units
    it follows); all but the parameters are keywords.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        cap_bytes: int,
        reduce_bucket: Callable[[Bucket], None],
        rank: int,
        timeout_s: float,
        allocate: BufferFactory | None = None,
        units: Sequence[int] | None = None,
        release_buffers: bool = False,
        group: dist.ProcessGroup | None = None,
        engine_kind: str = "DataParallel",
    ) -> None:
        kwargs = {"allocate": allocate} if allocate is not None else {}
        if release_buffers:  # allocated at the first gradient: set-up never holds them all
            kwargs["allocate"] = _no_buffer
        self.buckets = assign_buckets(named_params, cap_bytes, **kwargs, units=units)
        self._allocate = allocate
        self.release_buffers = release_buffers
        """Allocate each bucket's buffer at its first gradient and free it once reduced."""
        self._where = {
            id(param): (bucket, position)
            for bucket in self.buckets
            for position, param in enumerate(bucket.params)
        }
        self._reduce_bucket = reduce_bucket
        self._rank = rank
        self._timeout_s = timeout_s
        self.stream = stream_for(group)
        """The group's one communication stream, shared with every engine on the group."""
        self.engine = self.stream.register(engine_kind)
        """This reducer's label on the stream (the same on every rank of the group)."""
        self._futures: list[Future] = []
        self._next_launch = 0
        self._callback_queued = False
        self._round_ended = False  # the backward of the current round has finished
        self._round_from_forward = False  # started by `prepare_for_backward` (forward)
        self._lock = threading.Lock()  # hooks of one backward may run on autograd worker threads
        self.sync_enabled = True
        """False inside `no_sync()`: gradients accumulate locally, nothing is launched."""
        self.exposed_comm_s = 0.0
        """Seconds the end of the last backward waited for reductions still in flight."""
        self.drop_unused_gradients = False
        """True (DataParallel's `find_unused_parameters`): at the end of each round a parameter
        that no rank used keeps no gradient (`drop_globally_unused`)."""
        self._group = group
        self._unused_here: set[int] = set()  # ids: no gradient on this rank in this round
        self._handles = [
            param.register_post_accumulate_grad_hook(self._on_gradient) for _, param in named_params
        ]
        for bucket in self.buckets:
            bucket.reset()
            if release_buffers:
                self._release(bucket)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction inside the block; gradients accumulate locally (in the
        bucket buffers, which `release_buffers` keeps until reduced). The first backward
        outside the block (after a forward) reduces the accumulated gradients once."""
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def submit(self, fn: Callable[..., object], *args: object, item: int = -1) -> Future:
        """Run `fn(*args)` on the group's stream, after every collective already queued there.

        `item` (a bucket or unit index) labels its collectives for the cross-rank check.
        """
        return self.stream.submit(fn, *args, label=self.engine.label(item))

    def _ensure_buffer(self, bucket: Bucket) -> None:
        if self.release_buffers and bucket.buffer.numel() == 0 and bucket.offsets[-1] > 0:
            first = bucket.params[0]
            allocate = self._allocate or (lambda n, d, v: torch.zeros(n, dtype=d, device=v))
            bucket.buffer = allocate(bucket.offsets[-1], first.dtype, first.device)

    @staticmethod
    def _release(bucket: Bucket) -> None:
        """Drop the bucket's buffer and its members' gradient views (they alias the buffer)."""
        bucket.buffer = bucket.buffer.new_empty(0)
        bucket.forget_views()
        for param in bucket.params:
            param.grad = None

    def _reduce_and_release(self, bucket: Bucket) -> None:
        self._reduce_bucket(bucket)
        self._release(bucket)

    def prepare_for_backward(self, unused: Sequence[nn.Parameter] = ()) -> None:
        """Start a new reduction round; `unused` parameters count as arrived (zero gradient)."""
        self._start_round(from_forward=True)
        self._unused_here = {id(p) for p in unused if p.grad is None}
        for param in unused:
            bucket, position = self._where[id(param)]
            self._ensure_buffer(bucket)
            self._adopt_gradient(param, bucket, position)
            self._mark(bucket, position)

    @staticmethod
    def _adopt_gradient(param: nn.Parameter, bucket: Bucket, position: int) -> None:
        """Make `param.grad` the bucket's view, moving a freshly allocated gradient into it."""
        view = bucket.view(position)
        grad = param.grad
        if grad is None:
            view.zero_()  # unused this step: contributes zero, and the buffer may hold old values
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # after zero_grad(set_to_none=True) autograd allocated a new tensor
        else:
            return
        param.grad = view

    def _start_round(self, *, from_forward: bool) -> None:
        if self._futures:
            self.wait()  # a round must not forget reductions still in flight
        self._next_launch = 0
        self._callback_queued = False
        self._round_ended = False
        self._round_from_forward = from_forward
        self._unused_here = set()
        for bucket in self.buckets:
            bucket.reset()

    def _on_gradient(self, param: torch.Tensor) -> None:
        bucket, position = self._where[id(param)]
        with self._lock:
            self._ensure_buffer(bucket)
            self._adopt_gradient(param, bucket, position)
            if not self.sync_enabled:
                return
            if bucket.ready[position]:
                if not self._round_ended:
                    if bucket.index >= self._next_launch:
                        return  # counted once; its new gradient is in the buffer, not yet sent
                    raise RuntimeError(
                        f"rank {self._rank}: parameter {bucket.names[position]!r} received a "
                        "second gradient after its bucket was launched in this reduction round "
                        "(it was marked unused at forward, or one backward reached it twice, as "
                        "reentrant checkpointing does): the gradient would stay on this rank "
                        "only. Use the parameter inside the wrapped forward (or pass "
                        "find_unused_parameters=False), and checkpoint with use_reentrant=False."
                    )
                # A backward with no forward since the last one ended: a round of its own.
                self._start_round(from_forward=False)
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
            self._mark(bucket, position)

    def _mark(self, bucket: Bucket, position: int) -> None:
        if bucket.ready[position]:
            return
        bucket.ready[position] = True
        bucket.pending -= 1
        while (
            self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0
        ):
            launched = self.buckets[self._next_launch]
            reduce = self._reduce_and_release if self.release_buffers else self._reduce_bucket
            self._futures.append(self.submit(reduce, launched, item=launched.index))
            self._next_launch += 1

    def _launch_the_rest(self) -> None:
        """Count every gradient that has not arrived as zero, launching the remaining buckets."""
        for bucket in self.buckets[self._next_launch :]:
            for position, ready in enumerate(bucket.ready):
                if not ready:
                    self._ensure_buffer(bucket)
                    self._adopt_gradient(bucket.params[position], bucket, position)
                    self._mark(bucket, position)

    def _finish(self) -> None:
        """End of backward: every gradient must have arrived; wait for the reductions."""
        self._callback_queued = False
        self._round_ended = True
        if not self._round_from_forward:
            self._launch_the_rest()  # a round without forward cannot tell unused from late
        if self._next_launch < len(self.buckets):
            missing = [
                name
                for bucket in self.buckets[self._next_launch :]
                for name, ready in zip(bucket.names, bucket.ready)
                if not ready
            ]
            if self.engine.kind == "DataParallel":
                advice = "pass find_unused_parameters=True"
            else:  # ZeRO reduces every flat buffer whole: it has no unused-parameter mode
                advice = "set requires_grad=False on them before wrapping the model"
            raise RuntimeError(
                f"rank {self._rank}: parameters received no gradient in this backward: "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. If the model "
                f"does not use them every step, {advice}."
            )
        self.wait()
        if self.drop_unused_gradients:
            self.drop_globally_unused()

    def drop_globally_unused(self) -> None:
        """Set `.grad` to None on the parameters no rank of the group used in this round.

        Their averaged gradient is zero, but a zero gradient is not what one process has: its
        `.grad` stays None and the optimizer skips the parameter (no weight decay, no moment
        update). PyTorch DDP leaves a globally unused parameter's gradient untouched for the same
        reason. Collective: one all-reduce of a flag per parameter.
        """
        params = [p for bucket in self.buckets for p in bucket.params]
        used = torch.tensor(
            [int(id(p) not in self._unused_here) for p in params], device=params[0].device
        )

        def count(flags: torch.Tensor) -> None:
            dist.all_reduce(flags, group=self._group)

        self.stream.run(count, used, label=self.engine.label(), what="unused-parameter flags")
        for param, users in zip(params, used.tolist()):
            if users == 0:
                param.grad = None

    def wait(self) -> None:
        """Block until every launched bucket is reduced; re-raise a failed reduction."""
        began = time.perf_counter()
        futures, self._futures = self._futures, []
        for index, future in enumerate(futures):
            try:
                wait_or_raise(
                    future,
                    f"all_reduce of gradient bucket {index}",
                    self._timeout_s,
                    self._rank,
                    "another rank has not finished its backward (or has failed)",
                )
            except CollectiveTimeout:
                raise  # reported now: draining the rest would wait out each one's bound too
            except BaseException:
                _drain(futures[index + 1 :], self._timeout_s)  # nothing of ours stays queued
                raise
        self.exposed_comm_s = time.perf_counter() - began

    def remove_hooks(self) -> None:
        """Detach from the parameters (the module can then be wrapped again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        futures, self._futures = self._futures, []
        _drain(futures, self._timeout_s)  # the stream is shared: nothing of ours stays queued


def _drain(futures: Sequence[Future], timeout_s: float) -> None:
    """Wait for `futures` without raising: their failure was (or will be) reported elsewhere."""
    for future in futures:
        try:
            future.result(timeout=timeout_s)
        except BaseException:  # noqa: BLE001, S110 - already reported by the failing wait
            pass


def _no_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty stand-in for a bucket buffer that `_ensure_buffer` allocates when it is needed."""
    return torch.empty(0, dtype=dtype, device=device)
