"""Sequentially consistent loads, stores and adds on shared memory, for the shm barrier.

The shared-memory barrier publishes data with plain stores (tensor copies) and then a counter;
a peer that sees the counter reads the data. That needs the counter store to be a release and
its load an acquire. The sleep/wake-up handshake (a rank raises its "sleeping" flag then reads
the counters; an arriving rank raises its counter then reads the flags) is a store followed by
a load of another word, which only sequential consistency orders: with weaker ordering both
sides can miss each other and the sleeper waits for a wake-up that never comes.

How, and why this way: CPython has no atomics, so `Words` calls libatomic's
`__atomic_load_8` / `__atomic_store_8` with `__ATOMIC_SEQ_CST` through ctypes (about 0.3 µs a
call, against ~50 µs for a kernel wake-up; no compiler needed at install time, and libatomic
ships with GCC's runtime on every Linux distribution). Seq-cst accesses are also acquire and
release, so one kind of access serves both uses. The futex barrier also needs a 32-bit
fetch-and-add (`__atomic_fetch_add_4`: the arrival counter that every rank bumps) and load;
plain accesses have no read-modify-write, so it runs only in "atomics" mode. libatomic is used
only where it says 8-byte atomics are lock-free (so are 4-byte ones then): the lock-based
fallback locks within one process, not across processes.

Without libatomic, x86-64 still works with plain accesses: its memory model (TSO) keeps stores
in order and loads in order, which is acquire/release; only the store-then-load handshake can
reorder, and the barrier bounds that case by napping at most 1 ms (`NAP_MS`). Elsewhere
(ARM, POWER without libatomic) nothing orders the accesses, so `MODE` is None and shared
memory is not used: every collective falls back to the native algorithm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

import torch

__all__ = ["MODE", "NAP_MS", "Words", "ordering_mode"]

_SEQ_CST = 5  # __ATOMIC_SEQ_CST in GCC's memory-order numbering


def _libatomic() -> tuple | None:
    """(load, store, load_4, fetch_add_4) from libatomic if 8-byte atomics are lock-free there,
    else None."""
    if sys.maxsize < 2**63 - 1:
        return None
    name = ctypes.util.find_library("atomic")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        lock_free = lib.__atomic_is_lock_free
        load, store = lib.__atomic_load_8, lib.__atomic_store_8
        load_4, fetch_add_4 = lib.__atomic_load_4, lib.__atomic_fetch_add_4
    except (OSError, AttributeError):
        return None
    lock_free.restype, lock_free.argtypes = ctypes.c_bool, [ctypes.c_size_t, ctypes.c_void_p]
    if not lock_free(8, None):
        return None
    load.restype, load.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int]
    store.restype, store.argtypes = None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    load_4.restype, load_4.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_int]
    fetch_add_4.restype = ctypes.c_uint32
    fetch_add_4.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    return load, store, load_4, fetch_add_4


def ordering_mode(machine: str | None = None, have_atomics: bool | None = None) -> str | None:
    """How shared memory is ordered here: "atomics", "x86-tso" or None (not at all).

    `machine` and `have_atomics` default to this machine's (tests pass others).
    """
    machine = platform.machine() if machine is None else machine
    if have_atomics is None:
        have_atomics = _libatomic() is not None
    if have_atomics:
        return "atomics"
    if machine.lower() in ("x86_64", "amd64"):
        return "x86-tso"
    return None


MODE = ordering_mode()
"""How this process orders its shared-memory accesses (see the module docstring)."""

NAP_MS = {"atomics": 100.0, "x86-tso": 1.0}
"""Longest sleep between two looks at the counters: with real atomics no wake-up is missed, so
the nap only bounds how late a timeout is noticed; with plain x86 accesses it bounds a missed
wake-up."""

_LOAD_STORE = _libatomic() if MODE == "atomics" else None


class Words:
    """The int64 words of a shared mapping, read and written with sequential consistency."""

    def __init__(self, raw: torch.Tensor, view: memoryview, mode: str) -> None:
        if mode not in NAP_MS:
            raise ValueError(f"no ordered shared-memory access on this machine (mode {mode!r})")
        if mode == "atomics" and _LOAD_STORE is None:
            raise ValueError("libatomic's lock-free 8-byte atomics are not available here")
        self.mode = mode
        self._raw = raw  # keeps the mapping's address valid while this object lives
        self._base = raw.data_ptr()
        self._view = view.cast("q")
        if mode == "atomics":
            self._load, self._store, self._load_4, self._fetch_add_4 = _LOAD_STORE

    def load(self, index: int) -> int:
        """Word `index` (a seq-cst load: sees every store that preceded the matching store)."""
        if self.mode == "atomics":
            return self._load(self._base + 8 * index, _SEQ_CST)
        return self._view[index]

    def store(self, index: int, value: int) -> None:
        """Set word `index` (a seq-cst store: every earlier write is visible before it)."""
        if self.mode == "atomics":
            self._store(self._base + 8 * index, value, _SEQ_CST)
        else:
            self._view[index] = value

    def address(self, byte: int) -> int:
        """The address of byte `byte` of the mapping (for futex(2), `futex`)."""
        return self._base + byte

    def load32(self, byte: int) -> int:
        """The unsigned 32-bit word at byte offset `byte` (4-aligned), seq-cst. "atomics" only."""
        return self._load_4(self._base + byte, _SEQ_CST)

    def add32(self, byte: int, value: int) -> int:
        """Atomically add `value` to the 32-bit word at `byte`, wrapping; return the new value.
        A seq-cst read-modify-write, so only in "atomics" mode (plain x86 accesses have none)."""
        return (self._fetch_add_4(self._base + byte, value, _SEQ_CST) + value) & 0xFFFFFFFF
