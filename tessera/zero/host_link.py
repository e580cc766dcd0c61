"""`HostLink`: ZeRO-Offload's traffic between the training device and the host step.

ZeRO-Offload (Ren et al., USENIX ATC 2021) keeps the model, its gradients and the activations
on the accelerator and the fp32 master weights, the gradient partition and Adam's moments in
host memory, where the optimizer step runs. Per step, each rank moves its gradient partition
down (device to host) and its updated parameter partition up (host to device), in the compute
dtype: Ψ/N elements each way. As in the paper, the gradient copies overlap the backward: a
bucket goes down as soon as its reduction has finished, while the backward computes the
gradients of earlier layers. ZeRO-Infinity (Rajbhandari et al., SC 2021) streams the same host
buffers on to NVMe (`tessera.optim.nvme.NVMeAdam`).

One code path, with the device a parameter (`tessera`'s design principle 7): the device is the
parameters' own (`cuda:k`, or `cpu`), and the host buffers are always a set of tensors distinct
from the device's, so the CPU suite runs every copy this class makes. What differs per device:

* on CUDA the host buffers are pinned (page-locked), so the copies are DMA transfers that run
  asynchronously on a side stream (`torch.cuda.Stream`) beside the compute stream; each copy
  waits for the work already queued on the stream that produced its source and records an event
  that the consumer waits on (`wait`, `device_ready`);
* on the CPU the "device" tensors are host memory too: the copies are plain `copy_` calls (the
  host buffers the step streams go on huge pages, `tessera.optim.cpu_adam.host_zeros`). This
  costs a copy of each gradient partition (and, where the master used to alias the parameter
  buffer, of the parameter partition) that a CPU-only run without this class would not pay.

Under a step that writes its result into bf16 staging buffers (CUDA's pinned ones), a publish
does not wait for its uploads: the buffers come in two sets, and each publish hands the set it
sends to the copy stream and gives the next step the other one (`release_uploads`). The host
step that follows, in the background under the delayed update, runs beside the uploads instead
of after them. DeepSpeed's CPU Adam overlaps the same way, copying each finished tile up while
it steps the next (its `step_plus_copy`, double-buffered pinned tiles).

Every copy is counted (`copies`), the latest listed in `log` as ("to_host" | "to_device",
bucket index): the tests check that the copies happen per bucket, during the backward. The link
knows buckets by index only, not the ZeRO optimizer or its flats: the optimizer drives it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from tessera.optim.cpu_adam import CPUAdam, host_zeros

__all__ = ["HostLink", "link_device"]

_LOG_LENGTH = 4096
"""Copies `HostLink.log` remembers (a few steps' worth: it must not grow with the run)."""


def link_device(params: list[torch.Tensor]) -> torch.device:
    """The one device the parameters a ZeRO stage offloads live on; a clear error if several."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(
            f"offload moves one device's parameters to the host; the trainable parameters are "
            f"on {sorted(map(str, devices))}: put the model on one device first"
        )
    return next(iter(devices))


class HostLink:
    """The host side of one ZeRO optimizer's buffers and the copies to and from its device."""

    def __init__(self, device: torch.device | str, *, huge_pages: bool = False) -> None:
        self.device = torch.device(device)
        """Where the parameters, their gradients and the collectives live."""
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        """Host buffers page-locked and copies asynchronous on `_stream` (a real CUDA device)."""
        self._huge_pages = huge_pages and not self.pinned
        self._stream = torch.cuda.Stream(self.device) if self.pinned else None
        self._events: list[tuple[Any, bool]] = []
        """Copies issued and not yet waited for: (CUDA event, an upload from a staging set)."""
        self._in_flight: list[Any] = []
        """The uploads the last publish sent from the staging set now in `spare_staging`, not
        waited for (`release_uploads`): waited for before that set is written again."""
        self._lock = threading.Lock()  # copies are issued by the comm thread and the trainer
        self.grads: list[torch.Tensor] = []
        """Per bucket: this rank's reduced gradient partition on the host (compute dtype)."""
        self.handed: list[torch.Tensor] = []
        """The other set of `grads`, after `hand_over`: the delayed step's, read while the next
        backward's copies go into `grads`."""
        self.staging: list[torch.Tensor | None] = []
        """Per bucket: the updated partition in the compute dtype, on the host, before it goes
        up (None where the fp32 master itself is in the compute dtype)."""
        self.spare_staging: list[torch.Tensor | None] = []
        """The other set of `staging`, made at the first `release_uploads` that swaps them:
        the one the last publish sent, possibly still on its way up."""
        self._swaps = True
        """May the staging sets take turns? Not where a step publishes into them (a swapped
        master's staging buffer holds its only compute-dtype copy: the value of record)."""
        self._sent_staging = False
        """An upload read a staging buffer since the last `release_uploads`."""
        self._fresh: list[bool] = []
        """Per bucket: the host gradient was copied since the last `forget_gradients`."""
        self._staged: set[int] = set()
        """Buckets whose staging buffer the host step filled (`step_outputs`): the next upload
        sends it as it is."""
        self.log: deque[tuple[str, int]] = deque(maxlen=_LOG_LENGTH)
        """The latest copies, in issue order: ("to_host" | "to_device", bucket index)."""
        self.copies = {"to_host": 0, "to_device": 0, "staged_by_step": 0}
        """Copies made so far, per direction; `staged_by_step`: uploads of a partition the
        host step had already rounded into its staging buffer (no conversion pass)."""

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]], huge_pages: bool) -> HostLink:
        """The link of a ZeRO optimizer over the trainable parameters `named`."""
        return cls(link_device([param for _, param in named]), huge_pages=huge_pages)

    # -- host buffers ---------------------------------------------------------------------------
    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero host buffer: pinned for a CUDA device, on huge pages for the CPU step."""
        if self.pinned:
            return torch.zeros(numel, dtype=dtype, pin_memory=True)
        if self._huge_pages:
            return host_zeros((numel,), dtype)
        return torch.zeros(numel, dtype=dtype)

    def add_bucket(
        self, numel: int, compute_dtype: torch.dtype, *, converted: bool, published: bool
    ) -> None:
        """Host buffers of the next bucket: its gradient partition of `numel` elements, and a
        staging buffer where the step's result is `published` into one (a swapped step), or
        `converted` to the compute dtype before an asynchronous upload (pinned: on the CPU
        `copy_` converts as it copies, and the buffer would only cost memory)."""
        self.grads.append(self.host_zeros(numel, compute_dtype))
        staged = published or (converted and self.pinned)
        self.staging.append(self.host_zeros(numel, compute_dtype) if staged else None)
        self._swaps = self._swaps and not published
        self._fresh.append(False)

    # -- copies ---------------------------------------------------------------------------------
    def _copy(
        self,
        kind: str,
        index: int,
        source: torch.Tensor,
        target: torch.Tensor,
        *,
        from_staging: bool = False,
    ) -> None:
        """`target.copy_(source)`; on CUDA asynchronously on the side stream, after the work
        the calling thread's stream has queued (which produced `source`)."""
        with self._lock:
            self.log.append((kind, index))
            self.copies[kind] += 1
            self._sent_staging = self._sent_staging or from_staging
            if self._stream is None:
                target.copy_(source)
                return
            self._events.append((self._async_copy(source, target), from_staging))

    def _async_copy(self, source: torch.Tensor, target: torch.Tensor) -> Any:
        """Queue the copy on the side stream; the event that marks its end."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def to_host(self, index: int, source: torch.Tensor) -> None:
        """Copy bucket `index`'s reduced gradient partition (a device tensor) to the host, as
        soon as its reduction has been queued (called on the communication thread)."""
        self._copy("to_host", index, source.reshape(-1), self.grads[index])
        self._fresh[index] = True

    def hand_over(self) -> list[torch.Tensor]:
        """Give the gradient partitions (every copy of them finished) to a step that reads them
        in the background, and take the other set for the next backward's copies (made at the
        first call): the delayed update's own copy of the partition, without copying it.

        The caller must have read every bucket's gradient (`gradient`) since the last backward,
        and the previous holder of the other set must be done with it."""
        self.wait()
        with self._lock:
            if not self.handed:
                self.handed = [self.host_zeros(g.numel(), g.dtype) for g in self.grads]
            given, self.grads = self.grads, self.handed
            self.handed = given
            self._fresh = [False] * len(self._fresh)
        return given

    def forget_gradients(self) -> None:
        """The gradients were cleared (`zero_grad`): the host copies are stale until the next
        reduction copies them again (a step before that copies the device's zeros)."""
        self._fresh = [False] * len(self._fresh)

    def gradient(self, index: int, device_slice: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Bucket `index`'s gradient partition on the host, every copy of it finished. A bucket
        not reduced since the last `forget_gradients` is copied now from `device_slice()`."""
        if not self._fresh[index]:
            self.to_host(index, device_slice())
        self.wait()
        return self.grads[index]

    def step_outputs(
        self, masters: dict[int, int], optimizer: object
    ) -> tuple[list[torch.Tensor | None], list[int]] | None:
        """The host step's `bf16_out` (CPUAdam's: each updated master also written, rounded to
        bf16, in the same pass) aimed at the staging buffers, and the buckets they cover; None
        where the optimizer is not CPUAdam or no bucket stages bf16. `masters`: id(master) ->
        bucket index. Without it the upload rounds each master in a pass of its own (reading 4
        and writing 2 bytes an element on the host, on the training thread). Call `staged` once
        the step that got them is the one the next upload sends."""
        if not isinstance(optimizer, CPUAdam):
            return None
        outputs: list[torch.Tensor | None] = []
        covered: list[int] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                index = masters.get(id(param))
                staging = self.staging[index] if index is not None else None
                fits = staging is not None and staging.dtype == torch.bfloat16
                outputs.append(staging if fits else None)
                covered += [index] if fits else []
        return (outputs, covered) if covered else None

    def staged(self, indices: list[int]) -> None:
        """The staging buffers of `indices` hold the step's result (see `step_outputs`)."""
        self._staged.update(indices)

    def forget_staged(self, index: int) -> None:
        """Bucket `index`'s master changed otherwise (a checkpoint load): round it anew."""
        self._staged.discard(index)

    def to_device(self, index: int, master: torch.Tensor, target: torch.Tensor) -> None:
        """Copy bucket `index`'s updated partition up into `target` (a device tensor in the
        compute dtype), converted on the host first (into `staging`, pinned) if the dtypes
        differ. The consumer of `target` calls `device_ready` first."""
        source = master.detach().reshape(-1)
        staging = self.staging[index]
        converted = source.dtype != target.dtype and staging is not None
        if converted:
            rounded = self.take_staged(index)
            source = staging.copy_(source) if rounded is None else rounded
        self._copy("to_device", index, source, target.reshape(-1), from_staging=converted)

    def take_staged(self, index: int) -> torch.Tensor | None:
        """Bucket `index`'s staging buffer if the host step rounded its updated partition into
        it (`staged`), for one use (counted in `staged_by_step`); else None."""
        if index not in self._staged:
            return None
        self._staged.discard(index)
        self.copies["staged_by_step"] += 1
        return self.staging[index]

    def uploads_ready(self) -> None:
        """Make the calling thread's device stream wait for the uploads the last publish let
        go (`release_uploads`), and for nothing else on the side stream: for a thread other
        than the one that published (stage 3's gathers, on the communication thread), whose
        stream the publish's `device_ready` did not order."""
        with self._lock:
            last = self._in_flight[-1] if self._in_flight else None
        if last is not None:  # (the side stream runs its copies in order: the last one is enough)
            torch.cuda.current_stream(self.device).wait_event(last)

    def device_ready(self) -> None:
        """Make the calling thread's device stream wait for every copy issued so far."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def release_uploads(self) -> None:
        """End of a publish: block until the copies whose host side the next step may write
        have finished, and let the uploads from staging run on without waiting for them.

        Where this publish sent staging buffers (and no step publishes into them), the sets
        swap: the next step writes the other set, whose uploads, a publish ago, are waited for
        first (long finished by now). Else every copy is waited for, as `wait` does."""
        with self._lock:
            copies, self._events = self._events, []
            swap, self._sent_staging = self._sent_staging and self._swaps, False
        for event, from_staging in copies:
            if not (swap and from_staging):
                event.synchronize()
        if not swap:
            return
        for event in self._in_flight:
            event.synchronize()
        with self._lock:
            self._in_flight = [event for event, from_staging in copies if from_staging]
        if not self.spare_staging:
            self.spare_staging = [
                None if buffer is None else self.host_zeros(buffer.numel(), buffer.dtype)
                for buffer in self.staging
            ]
        self.staging, self.spare_staging = self.spare_staging, self.staging
        self._staged.clear()  # (the step's marks are for the set just sent)

    def wait(self) -> None:
        """Block the host until every copy issued since the last `release_uploads` has
        finished (the host may then read what went down and overwrite what went up; the
        uploads a release let go are waited for by the next one)."""
        with self._lock:
            events, self._events = self._events, []
        for event, _ in events:
            event.synchronize()
