"""`swap_idle`: GeePS-style parameter swapping - only the blocks at work hold their parameters.

Cui et al., "GeePS: Scalable deep learning on distributed GPUs with a GPU-specialized parameter
server" (EuroSys 2016), section 3.3: a layer's parameters are needed only while that layer runs
forward or backward, so they can live in host memory in between, and be brought back just before
use, the next few ahead of time. Here the blocks (found like `checkpoint_activations`' blocks:
the children with parameters of every `nn.ModuleList`/`nn.Sequential`, a `ModuleDict`'s children)
keep their parameters in a file (`nvme_dir`; on a CPU-only machine this is what saves resident
memory) or in a host copy (`nvme_dir=None`; on a GPU that frees device memory, on a CPU it
saves nothing and exists to test the mechanism). Resident are the running block and the next
`keep` (prefetched by a reader thread).

How it stays correct for any forward (the same two rules as ZeRO-3, `tessera/zero/stage3.py`,
both on the one residency scheduler, `tessera/memory/residency.py`):

* forward: a block's pre-hook brings its parameters in (waiting for the prefetch) and prefetches
  the next `keep` blocks in the order of the last forward; a block that has finished is swapped
  out as soon as another block starts, unless it is in that window;
* backward: every parameter autograd saves is packed as "block b's tensor" by a saved-tensor
  hook and unpacking brings block b in (and prefetches the `keep` before it), so backward never
  reads a swapped-out storage. Once every gradient of a block has arrived it is swapped out.

The storage of each block is one flat tensor whose views are its parameters; swapping out
resizes it to zero bytes in place, so views and saved tensors keep their shape and see the data
again after it is brought back. Gradients stay in memory (as in GeePS, where they go to the
parameter server). `step(optimizer)` runs the optimizer block by block - brought in, stepped with
only its gradients visible, written behind - so the step needs one block resident at a time and
equals `optimizer.step()` for any optimizer that updates each parameter from its own gradient
and state (SGD, Adam, AdamW; not LAMB-like global norms).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from tessera.memory.blocks import find_blocks
from tessera.memory.residency import ResidencyScheduler, in_backward
from tessera.optim.swap_files import SwapFile, SwapFolder

__all__ = ["IdleSwapper", "swap_idle"]


class _Block:
    """One block's parameters as views of one flat tensor, and where it lives when idle."""

    def __init__(self, index: int, module: nn.Module, store: SwapFile | None) -> None:
        self.index = index
        self.module = module
        self.params = [p for p in module.parameters()]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise TypeError(
                f"swap_idle: block {index} ({type(module).__name__}) mixes parameter dtypes "
                f"{sorted(map(str, dtypes))}; a block is swapped as one flat tensor"
            )
        numel = sum(p.numel() for p in self.params)
        self.flat = torch.empty(numel, dtype=self.params[0].dtype)
        offset = 0
        with torch.no_grad():
            for param in self.params:
                view = self.flat[offset : offset + param.numel()]
                view.copy_(param.reshape(-1))
                param.data = view.view_as(param)
                offset += param.numel()
        self.nbytes = numel * self.flat.element_size()
        self.store = store
        self.host: torch.Tensor | None = None
        self.resident = True
        self.loading: Future | None = None
        self.writing: Future | None = None

    @property
    def storage(self) -> torch.UntypedStorage:
        return self.flat.untyped_storage()


class IdleSwapper:
    """What `swap_idle` installs on a module; `close()` removes hooks and files."""

    def __init__(self, module: nn.Module, *, keep: int, nvme_dir: str | None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"swap_idle: keep must be an int >= 0, got {keep!r}")
        modules = find_blocks(module)
        if not modules:
            raise ValueError(
                f"swap_idle: {type(module).__name__} has no blocks (children with parameters of "
                "an nn.ModuleList / nn.Sequential / nn.ModuleDict) to swap"
            )
        self.module = module
        self.keep = keep
        total = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
        self.folder = (
            SwapFolder(nvme_dir, purpose="swap_idle", need_bytes=total) if nvme_dir else None
        )
        _refuse_tied(module, modules)
        self.blocks: list[_Block] = []
        for index, sub in enumerate(modules):
            nbytes = sum(p.numel() * p.element_size() for p in sub.parameters())
            store = (
                self.folder.file(f"block-{index}.bin", nbytes, direct=False)
                if self.folder
                else None
            )
            self.blocks.append(_Block(index, sub, store))
        self._lock = threading.RLock()
        self._residency = ResidencyScheduler(
            len(self.blocks),
            bring_in=self._bring_in,
            prefetch=self._request,
            end_of_backward=self._end_of_backward,
            lock=self._lock,
            window=keep,
            keep_unseen=True,
        )
        for block in self.blocks:
            self._residency.track(block.flat, block.index)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tessera-swap-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tessera-swap-write")
        self._active: set[int] = set()
        self._saved_hooks: Any = None
        self._hooks = [
            module.register_forward_pre_hook(self._enter_root),
            module.register_forward_hook(self._exit_root, always_call=True),
        ]
        for block in self.blocks:
            self._hooks.append(block.module.register_forward_pre_hook(self._make_enter(block)))
            self._hooks.append(
                block.module.register_forward_hook(self._make_exit(block), always_call=True)
            )
            for param in block.params:
                if param.requires_grad:
                    hook = self._make_arrival(block)
                    self._hooks.append(param.register_post_accumulate_grad_hook(hook))
        for block in self.blocks:
            self._write_out(block, dirty=True)
        self._drain()

    # -- moving one block ----------------------------------------------------------------------
    def _load(self, block: _Block) -> None:
        """Runs on the reader thread: allocate the storage again and fill it."""
        if block.writing is not None:
            block.writing.result()  # the file must hold the last values before it is read
        block.storage.resize_(block.nbytes)
        if block.store is not None:
            block.store.read(0, block.flat)
        else:
            assert block.host is not None
            block.flat.copy_(block.host)

    def _request(self, index: int) -> None:
        """Start bringing block `index` in unless it is resident or on its way."""
        block = self.blocks[index]
        with self._lock:
            if not block.resident and block.loading is None:
                block.loading = self._reader.submit(self._load, block)

    def _bring_in(self, index: int) -> None:
        self._request(index)
        self._finish_loading(self.blocks[index])

    def _finish_loading(self, block: _Block) -> None:
        """Wait for a load in flight, if any: the block is resident after it."""
        with self._lock:
            if block.loading is not None:
                block.loading.result()
                block.loading = None
                block.resident = True

    def _write_out(self, block: _Block, *, dirty: bool) -> None:
        """Swap a resident block out; `dirty`: its values changed and go to the store first."""
        with self._lock:
            self._finish_loading(block)
            if not block.resident:
                return
            block.resident = False
            if block.store is None:
                if dirty or block.host is None:
                    block.host = block.flat.detach().clone()
                block.storage.resize_(0)
            elif dirty:
                block.writing = self._writer.submit(self._store_and_free, block)
            else:
                block.storage.resize_(0)

    @staticmethod
    def _store_and_free(block: _Block) -> None:
        block.store.write(0, block.flat)
        block.storage.resize_(0)

    def _drain(self) -> None:
        for block in self.blocks:
            if block.writing is not None:
                block.writing.result()
                block.writing = None

    def _swap_out_except(self, wanted: set[int]) -> None:
        for block in self.blocks:
            if block.index not in wanted and block.index not in self._active:
                self._write_out(block, dirty=False)

    # -- forward ---------------------------------------------------------------------------------
    def _enter_root(self, module: nn.Module, args: tuple) -> None:
        if self._saved_hooks is None and not in_backward():
            self._saved_hooks = self._residency.saved_tensors_hooks()
            self._saved_hooks.__enter__()
            self._residency.start_recording()

    def _exit_root(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
            training = torch.is_grad_enabled()
            if training:
                self._residency.adopt_recording()
            last = self._residency.last_in_order if training else None
            self._swap_out_except({last})  # backward starts with the last block

    def _make_enter(self, block: _Block) -> Any:
        def enter(module: nn.Module, args: tuple) -> None:
            with self._lock:
                ahead = self._residency.ahead(block.index, self.keep)
                self._swap_out_except({block.index, *ahead})
                self._active.add(block.index)
                self._bring_in(block.index)
                for index in ahead:
                    self._request(index)
                self._residency.record(block.index)

        return enter

    def _make_exit(self, block: _Block) -> Any:
        def exit_(module: nn.Module, args: tuple, output: Any) -> None:
            with self._lock:
                self._active.discard(block.index)

        return exit_

    # -- backward: the saved tensors are the scheduler's; gradients arriving ---------------------
    def _make_arrival(self, block: _Block) -> Any:
        wanted = sum(p.requires_grad for p in block.params)

        def arrived(param: torch.Tensor) -> None:
            with self._lock:
                if self._residency.gradient_arrived(block.index, param, wanted):
                    if block.index not in self._active:
                        self._write_out(block, dirty=False)

        return arrived

    def _end_of_backward(self) -> None:
        """Backward is over (the scheduler's callback, under the lock): every block goes."""
        self._swap_out_except(set())

    # -- the optimizer step, one block at a time -----------------------------------------------
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()` with only one block resident at a time (plus the next `keep`).

        The parameters outside blocks are stepped first (those of the module and any others the
        optimizer holds, such as a head outside the swapped module), then each block: brought
        in, stepped with only its gradients visible to the optimizer, written back behind the
        next one. Every parameter is stepped once: each `optimizer.step()` sees the gradients of
        one part only (optimizers skip a parameter whose gradient is None).
        """
        everything = {id(p): p for p in self.module.parameters()}
        for group in optimizer.param_groups:
            everything.update((id(p), p) for p in group["params"])
        params = list(everything.values())
        grads = {id(p): p.grad for p in params}
        in_blocks = {id(p) for b in self.blocks for p in b.params}
        try:
            for param in params:
                if id(param) in in_blocks:
                    param.grad = None
            optimizer.step()  # the parameters outside blocks (the rest have no gradient now)
            for param in params:
                param.grad = None
            for position, block in enumerate(self.blocks):
                self._bring_in(block.index)
                for ahead in self.blocks[position + 1 : position + 1 + self.keep]:
                    self._request(ahead.index)
                for param in block.params:
                    param.grad = grads[id(param)]
                optimizer.step()
                for param in block.params:
                    param.grad = None
                self._write_out(block, dirty=True)
        finally:
            for param in params:
                param.grad = grads[id(param)]
        self._drain()

    def resident_bytes(self) -> int:
        """Bytes of block parameters in memory now (the idle ones count zero)."""
        return sum(block.storage.nbytes() for block in self.blocks)

    def close(self) -> None:
        """Bring every block back, remove the hooks and the files (the module works as before)."""
        self._drain()
        for block in self.blocks:
            self._bring_in(block.index)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._reader.shutdown()
        self._writer.shutdown()
        if self.folder is not None:
            self.folder.close()


def _refuse_tied(module: nn.Module, blocks: list[nn.Module]) -> None:
    """A parameter reachable under a name outside its block (tied weights) cannot be swapped
    with that block: the other user would find it gone."""
    prefixes = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    owner = {}
    for block in blocks:
        for param in block.parameters():
            owner[id(param)] = prefixes[id(block)] + "."
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in owner and not name.startswith(owner[id(param)]):
            raise ValueError(
                f"swap_idle: parameter {name!r} is also block parameter "
                f"{owner[id(param)]}...: tied parameters cannot be swapped with one block"
            )


def swap_idle(module: nn.Module, *, keep: int = 2, nvme_dir: str | None = None) -> IdleSwapper:
    """Keep only the running block's parameters (and the next `keep`) in memory; see above.

    Returns the `IdleSwapper`: call `swapper.step(optimizer)` instead of `optimizer.step()` (the
    step then needs one block at a time), `swapper.close()` to undo. `nvme_dir`: idle parameters
    go to files there (a private folder, removed at close or exit); None keeps a host copy.
    """
    return IdleSwapper(module, keep=keep, nvme_dir=nvme_dir)
