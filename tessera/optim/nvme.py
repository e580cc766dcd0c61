"""`NVMeAdam`: Adam(W) whose state lives in files, streamed through a fixed set of buffers.

ZeRO-Infinity (Rajbhandari et al., SC 2021, section 5) moves optimizer state to NVMe and streams
it through a small pinned buffer while the step runs. Adam is element-wise, so the step can walk
the state in fixed-size chunks: read chunk k+1 and k+2 ahead (a reader thread), update chunk k
with the same fused kernel as `CPUAdam`, write chunk k-1 behind (a writer thread). Resident memory
is then `slots x chunk x bytes per element`, set by `buffer_mb`, whatever the model size.
ZeRO's checkpoints move ranges of the files through the same buffers (`iter_range`,
`write_range`); `state_dict` / `load_state_dict` (torch's format) hold the state whole.

What is in the files: both moments, and with `swap_params=True` the fp32 parameter itself (the
master weights of mixed precision, which are optimizer state in the ZeRO paper's accounting,
or ZeRO-3's parameter partition). A swapped parameter keeps its shape but no storage; the step
writes each updated chunk into `publish[i]` (the compute-dtype copy the model uses) if given, and
`read_param` / `write_param` give the whole value to checkpoints.

Ordering. Writes of a step are not awaited at its end: they finish while the next forward runs.
A read of a chunk therefore first waits for the pending write of the same chunk (from the last
step) - without that, a read-ahead could overtake a write-behind and feed the step stale state.
`flush()` waits for every write; reading state for a checkpoint flushes first.

Chunks are multiples of 16384 elements, the native kernel's own work unit, so chunk by chunk
the kernel computes exactly what `CPUAdam` computes over the whole tensor (bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.adam import adam as torch_adam_functional

from tessera.optim.cpu_adam import _kernel_or_warn, adam_groups
from tessera.optim.swap_files import ALIGN, SwapFile, SwapFolder, aligned_empty

__all__ = ["CHUNK_QUANTUM", "SLOTS", "NVMeAdam", "nvme_state_bytes"]

CHUNK_QUANTUM = 16384
"""Chunks are a multiple of this many elements (the native kernel's work unit; 64 KiB fp32)."""
SLOTS = 4
"""Buffers in flight: two read ahead, one being updated, one being written behind."""
_AHEAD = 2
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _region(numel: int) -> int:
    """Bytes a parameter's run takes in a file: fp32, padded to the O_DIRECT alignment."""
    return -(-numel * 4 // ALIGN) * ALIGN


def nvme_state_bytes(numels: list[int], swap_params: bool) -> int:
    """Bytes of files the state of parameters of `numels` elements takes (the up-front estimate)."""
    kinds = len(_MOMENTS) + int(swap_params)
    return kinds * sum(_region(n) for n in numels)


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor]
    write: Future | None = None
    pending_keys: list = field(default_factory=list)


class NVMeAdam(torch.optim.Optimizer):
    """Adam / AdamW (as `CPUAdam`) with the moments (and optionally the parameters) on disk.

    `nvme_dir`: an existing writable folder with room for the state (checked before anything is
    written); the files go in a private sub-folder removed at `close()`, exit or SIGTERM
    (`tessera.optim.swap_files`). `buffer_mb`: the staging memory, `SLOTS` chunks of every kind.
    Parameters are flat (1-D), contiguous fp32 CPU tensors (checked again at every step: one
    replaced by `param.data = ...` no longer fits its files). `load_state_dict` takes `CPUAdam`'s
    and torch's Adam(W)'s state dicts (`tessera.optim.cpu_adam.adam_groups`).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        adamw: bool = True,
        *,
        nvme_dir: str,
        buffer_mb: float = 64.0,
        swap_params: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw)
        super().__init__(params, defaults)
        self.params = [p for group in self.param_groups for p in group["params"]]
        for index, param in enumerate(self.params):
            _check_param(param, index)
        self.swap_params = swap_params
        self.kinds = (*_MOMENTS, "param") if swap_params else _MOMENTS
        per_element = 4 * len(self.kinds) + 4  # + an fp32 gradient chunk (converted from bf16)
        chunk = int(buffer_mb * 2**20) // (SLOTS * per_element) // CHUNK_QUANTUM * CHUNK_QUANTUM
        minimum = SLOTS * per_element * CHUNK_QUANTUM / 2**20
        if chunk < CHUNK_QUANTUM:
            raise ValueError(
                f"nvme_buffer_mb={buffer_mb} is too small: {SLOTS} buffers of at least "
                f"{CHUNK_QUANTUM} elements for {len(self.kinds)} state kinds need "
                f"{minimum:.1f} MB"
            )
        self.chunk = chunk
        numels = [p.numel() for p in self.params]
        self._numels = numels
        self.offsets = [0]
        for numel in numels:
            self.offsets.append(self.offsets[-1] + _region(numel))
        self.folder = SwapFolder(
            nvme_dir, purpose="NVMeAdam state", need_bytes=nvme_state_bytes(numels, swap_params)
        )
        self.files: dict[str, SwapFile] = {
            kind: self.folder.file(f"{kind}.bin", self.offsets[-1]) for kind in self.kinds
        }
        self._slots = [
            _Slot({kind: aligned_empty(chunk, torch.float32) for kind in self.kinds})
            for _ in range(SLOTS)
        ]
        self._grad_chunk = torch.empty(chunk, dtype=torch.float32)
        self._next_slot = 0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tessera-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tessera-nvme-write")
        self._pending: dict[tuple[int, int], Future] = {}
        """(parameter, first element) -> the write of that chunk still in flight (or done)."""
        self._on_disk = [False] * len(self.params)
        """Moments written at least once; before that they are zeros and nothing is read."""
        self._kernel = _kernel_or_warn()
        if swap_params:
            for param in self.params:
                if param.untyped_storage().nbytes() == 0:
                    continue  # made without memory: its owner writes the value (write_param)
                self.write_param(param, param.detach())
                param.untyped_storage().resize_(0)

    # -- chunk I/O (reader and writer threads) -----------------------------------------------
    def _span(self, index: int, start: int, end: int) -> tuple[int, int]:
        """(byte offset, elements to transfer) of a chunk: rounded up to the alignment."""
        length = -(-(end - start) * 4 // ALIGN) * ALIGN // 4
        return self.offsets[index] + start * 4, length

    def _load(self, slot: _Slot, index: int, start: int, end: int) -> None:
        pending = self._pending.get((index, start))
        if pending is not None:
            pending.result()  # the last step's write of this very chunk must land first
        offset, length = self._span(index, start, end)
        for kind, buffer in slot.buffers.items():
            if kind in _MOMENTS and not self._on_disk[index]:
                buffer[: end - start].zero_()
            else:
                self.files[kind].read(offset, buffer[:length])

    def _store(self, slot: _Slot, index: int, start: int, end: int) -> None:
        offset, length = self._span(index, start, end)
        for kind, buffer in slot.buffers.items():
            self.files[kind].write(offset, buffer[:length])

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        closure: Any = None,
        *,
        grads: list[torch.Tensor | None] | None = None,
        publish: list[torch.Tensor | None] | None = None,
    ) -> None:
        """One Adam(W) step of every parameter with a gradient (`grads[i]`, else `.grad`).

        `publish[i]`, if given, receives parameter i's updated value (in its own dtype).
        """
        if closure is not None:
            raise ValueError("NVMeAdam does not take a closure")
        jobs = []
        for index, param in enumerate(self.params):
            grad = grads[index] if grads is not None else param.grad
            if grad is None:
                continue
            if not self.swap_params:  # again: `param.data = ...` may have replaced it
                _check_param(param, index)
            if param.numel() != self._numels[index]:
                raise ValueError(
                    f"NVMeAdam: parameter {index} has {param.numel()} elements, its state on disk "
                    f"{self._numels[index]}: it was replaced after the optimizer was built"
                )
            if grad.numel() != param.numel() or grad.device.type != "cpu":
                raise ValueError(
                    f"NVMeAdam: parameter {index} has {param.numel()} elements, its gradient "
                    f"{grad.numel()} on {grad.device}"
                )
            group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
            state = self.state[param]
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            state["step"] += 1
            hyper = _hyper(group, state["step"].item())
            target = publish[index] if publish is not None else None
            for start in range(0, param.numel(), self.chunk):
                end = min(start + self.chunk, param.numel())
                jobs.append((index, start, end, grad.reshape(-1), target, group, hyper))
        reads: dict[int, tuple[_Slot, Future]] = {}

        def issue(position: int) -> None:
            slot = self._slots[self._next_slot]
            self._next_slot = (self._next_slot + 1) % SLOTS
            if slot.write is not None:
                slot.write.result()  # the slot's last chunk is on disk: reuse its buffers
            index, start, end = jobs[position][:3]
            reads[position] = (slot, self._reader.submit(self._load, slot, index, start, end))

        for position in range(min(_AHEAD, len(jobs))):
            issue(position)
        for position, (index, start, end, grad, target, group, hyper) in enumerate(jobs):
            if position + _AHEAD < len(jobs):
                issue(position + _AHEAD)
            slot, read = reads.pop(position)
            read.result()
            self._update(slot, index, start, end, grad, target, group, hyper)
            slot.write = self._writer.submit(self._store, slot, index, start, end)
            self._pending[(index, start)] = slot.write
            if end == self.params[index].numel():
                self._on_disk[index] = True

    def _update(
        self,
        slot: _Slot,
        index: int,
        start: int,
        end: int,
        grad: torch.Tensor,
        target: torch.Tensor | None,
        group: dict[str, Any],
        hyper: dict[str, float],
    ) -> None:
        n = end - start
        buffers = slot.buffers
        param = buffers["param"][:n] if self.swap_params else self.params[index].data[start:end]
        grad = grad[start:end]
        if grad.dtype != torch.float32 or not grad.is_contiguous():
            grad = self._grad_chunk[:n].copy_(grad)
        exp_avg, exp_avg_sq = buffers["exp_avg"][:n], buffers["exp_avg_sq"][:n]
        if self._kernel is not None:
            scalars = {k: v for k, v in hyper.items() if k != "step"}
            self._kernel(param, grad, exp_avg, exp_avg_sq, None, **scalars, adamw=group["adamw"])
        else:
            beta1, beta2 = group["betas"]
            torch_adam_functional(
                [param], [grad], [exp_avg], [exp_avg_sq], [],
                [torch.tensor(hyper["step"] - 1.0)], fused=True,
                decoupled_weight_decay=group["adamw"], amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=False,
            )  # fmt: skip
        if target is not None:
            target.reshape(-1)[start:end].copy_(param)

    # -- whole values (checkpoints, gathers) ---------------------------------------------------
    def flush(self) -> None:
        """Wait until every chunk written behind is on disk."""
        for future in list(self._pending.values()):
            future.result()
        self._pending.clear()

    def _read_whole(self, kind: str, index: int) -> torch.Tensor:
        numel = self.params[index].numel()
        buffer = aligned_empty(_region(numel) // 4, torch.float32)
        self.files[kind].read(self.offsets[index], buffer)
        return buffer[:numel].clone()

    def _write_whole(self, kind: str, index: int, value: torch.Tensor) -> None:
        numel = self.params[index].numel()
        buffer = aligned_empty(_region(numel) // 4, torch.float32)
        buffer.zero_()
        buffer[:numel].copy_(value.reshape(-1))
        self.files[kind].write(self.offsets[index], buffer)

    # -- ranges in chunks (checkpoints: memory bounded by `buffer_mb`, whatever the model) -----
    def _staging(self) -> tuple[torch.Tensor, int]:
        """(an idle buffer of `chunk` fp32 elements, elements per transfer): the first slot's
        buffer, free between steps once the writes behind are flushed. A transfer leaves room
        for rounding its window out to the O_DIRECT alignment on both sides."""
        self.flush()
        return self._slots[0].buffers["exp_avg"], self.chunk - 2 * (ALIGN // 4)

    def _window(self, index: int, start: int, end: int) -> tuple[int, int]:
        """The aligned element window of parameter `index`'s run that holds [start, end)."""
        quantum, region = ALIGN // 4, _region(self._numels[index]) // 4
        return start - start % quantum, min(-(-end // quantum) * quantum, region)

    def iter_range(
        self, kind: str, param: torch.Tensor, start: int, end: int
    ) -> Iterator[torch.Tensor]:
        """Elements [start, end) of one parameter's `kind` ("param", "exp_avg", "exp_avg_sq"),
        chunk by chunk through one staging buffer: each chunk is a view of it, valid until the
        next is asked for (no step and no other range call in between)."""
        index = self._index(param)
        buffer, step = self._staging()
        for first in range(start, end, step):
            last = min(first + step, end)
            if kind in _MOMENTS and not self._on_disk[index]:  # never written: zeros
                yield buffer[: last - first].zero_()
                continue
            lo, hi = self._window(index, first, last)
            self.files[kind].read(self.offsets[index] + 4 * lo, buffer[: hi - lo])
            yield buffer[first - lo : last - lo]

    def write_range(self, kind: str, param: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Write `values` over elements [start, start + numel) of one parameter's `kind`, chunk
        by chunk (each aligned window read, changed and written back: unaligned ranges work).
        A moment written so becomes the state (`moments_written`)."""
        index = self._index(param)
        buffer, step = self._staging()
        values = values.reshape(-1)
        for first in range(0, values.numel(), step):
            last = min(first + step, values.numel())
            lo, hi = self._window(index, start + first, start + last)
            window = buffer[: hi - lo]
            self.files[kind].read(self.offsets[index] + 4 * lo, window)
            window[start + first - lo : start + last - lo].copy_(values[first:last])
            self.files[kind].write(self.offsets[index] + 4 * lo, window)

    def fill_zeros(self, kind: str, param: torch.Tensor) -> None:
        """Set every element of one parameter's `kind` to zero, chunk by chunk."""
        index = self._index(param)
        buffer, _ = self._staging()
        buffer.zero_()
        region = _region(self._numels[index]) // 4
        for first in range(0, region, self.chunk):
            count = min(self.chunk, region - first)  # regions and chunks are ALIGN multiples
            self.files[kind].write(self.offsets[index] + 4 * first, buffer[:count])

    def moments_written(self, param: torch.Tensor) -> None:
        """Declare the moment files of `param` its state (after `write_range`/`fill_zeros`
        filled them): reads no longer see zeros."""
        self._on_disk[self._index(param)] = True

    def _index(self, param: torch.Tensor) -> int:
        for index, candidate in enumerate(self.params):
            if candidate is param:
                return index
        raise KeyError("this parameter is not one of the optimizer's")

    def read_param(self, param: torch.Tensor) -> torch.Tensor:
        """The current value of a swapped parameter (a new fp32 tensor)."""
        self.flush()
        return self._read_whole("param", self._index(param))

    def write_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Replace a swapped parameter's value."""
        self.flush()
        self._write_whole("param", self._index(param), value.float())

    def read_state(self, param: torch.Tensor) -> dict[str, Any]:
        """`step`, `exp_avg`, `exp_avg_sq` of one parameter, read whole (as torch's Adam keeps
        them); empty before its first step."""
        index = self._index(param)
        state = self.state.get(param, {})
        if "step" not in state:
            return {}
        self.flush()
        moments = {kind: self._read_whole(kind, index) for kind in _MOMENTS}
        if not self._on_disk[index]:
            moments = {kind: torch.zeros(param.numel()) for kind in _MOMENTS}
        return {"step": state["step"], **moments}

    def state_dict(self) -> dict[str, Any]:
        """torch's format, the moments read from disk whole (a copy of the whole state: ZeRO's
        checkpoints stream ranges instead, `tessera.zero._offloaded_state`)."""
        packed = super().state_dict()
        for index, param in enumerate(self.params):
            if param in self.state:
                packed["state"][index] = dict(self.read_state(param))
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format: scalars stay in memory, the moments go to the files. Takes
        `CPUAdam`'s and torch's Adam(W)'s state dicts as `CPUAdam.load_state_dict` does."""
        groups = adam_groups(state_dict["param_groups"], self.param_groups, "NVMeAdam")
        self.flush()
        self._on_disk = [False] * len(self.params)  # the loaded state replaces all of it
        small: dict[Any, dict[str, Any]] = {}
        for index, per_param in state_dict["state"].items():
            small[index] = {k: v for k, v in per_param.items() if k not in _MOMENTS}
            for kind in _MOMENTS:
                if kind in per_param:
                    self._write_whole(kind, int(index), per_param[kind])
                    self._on_disk[int(index)] = True
        super().load_state_dict({"state": small, "param_groups": groups})

    def close(self) -> None:
        """Wait for the writer, stop the threads and remove the files (idempotent)."""
        if self._reader is None:
            return
        self.flush()
        self._reader.shutdown()
        self._writer.shutdown()
        self._reader = self._writer = None
        self.folder.close()


def _check_param(param: torch.Tensor, index: int) -> None:
    """NVMeAdam steps a parameter as one run of memory: flat, fp32, CPU and contiguous (a
    strided view would have the elements between its strides overwritten, as in `CPUAdam`)."""
    if param.dtype != torch.float32 or param.device.type != "cpu" or param.dim() != 1:
        raise TypeError(
            f"NVMeAdam takes flat fp32 CPU parameters; parameter {index} is "
            f"{param.dtype} {tuple(param.shape)} on {param.device}"
        )
    if not param.is_contiguous():
        raise ValueError(
            f"NVMeAdam needs contiguous parameters; parameter {index} is a strided view "
            f"(stride {param.stride()}): pass a contiguous copy"
        )


def _hyper(group: dict[str, Any], step: float) -> dict[str, float]:
    """The kernel's scalars for one parameter at `step`, exactly as `CPUAdam` computes them."""
    beta1, beta2 = group["betas"]
    lr, weight_decay = group["lr"], group["weight_decay"]
    return dict(
        step=step,
        beta1=beta1,
        beta2=beta2,
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
        eps=group["eps"],
        weight_decay=weight_decay,
        decay=1.0 - lr * weight_decay,
        step_size=lr / (1.0 - beta1**step),
        inv_bias2_sqrt=1.0 / math.sqrt(1.0 - beta2**step),
    )
