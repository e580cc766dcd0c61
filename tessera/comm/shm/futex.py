"""Sleeping on a 32-bit word of shared memory until a peer changes it: Linux futex(2).

Why: the shm barrier (`group.ShmGroup.barrier`) used to sleep in poll() on a named pipe that an
arriving rank wrote a byte to, one pipe write per sleeping peer per arrival, each waking a rank
that then found the barrier still short of ranks and slept again. A futex sleeps on the barrier's
own arrival counter: `wait(address, seen, timeout)` returns at once if the word no longer holds
`seen` (the kernel compares under its lock, so a change between the caller's look and the sleep
is never missed), else sleeps until `wake(address)` or the timeout; the last rank to arrive wakes
every sleeper with one call. No file, no token to drain.

The operations are the non-private FUTEX_WAIT / FUTEX_WAKE (the word lives in a MAP_SHARED file
mapping that several processes map at different addresses; the kernel keys it by the page), made
through libc's `syscall()` with ctypes, which releases the GIL for the call, so a comm thread that
sleeps here lets the compute thread run. The futex syscall number is per architecture (Linux's
syscall tables: 202 on x86_64, 98 on aarch64); elsewhere, or if the kernel refuses a probe call,
`AVAILABLE` is False and the barrier keeps the pipe.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

__all__ = ["AVAILABLE", "ENABLED", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG: the word is shared by processes
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
    """libc's syscall(), typed for futex(2), or None where futex is not known to exist."""
    number = _SYS_FUTEX.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return number, call


def _probe() -> tuple | None:
    found = _syscall()
    if found is None:
        return None
    number, call = found
    word = ctypes.c_uint32(0)
    if call(number, ctypes.addressof(word), _FUTEX_WAKE, 1, None) != 0:  # -1: ENOSYS, EPERM...
        return None
    return found


_FOUND = _probe()
AVAILABLE = _FOUND is not None
"""Whether futex(2) works here (Linux on x86_64 or aarch64, and the kernel accepted a probe)."""

ENABLED = os.environ.get("TESSERA_SHM_FUTEX", "1") != "0"
"""Whether new shm groups may use it (TESSERA_SHM_FUTEX=0: the pipe, as where it is missing).
Read when a group is set up; every rank of the group must agree (`segments.probe` votes)."""


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep while the uint32 at `address` holds `seen`, at most `timeout_s` seconds.

    Returns on a wake-up, on a timeout, on a signal, or at once if the word changed: the caller
    looks at the word again in every case (it is the truth, not the reason for returning).
    """
    number, call = _FOUND
    timeout_s = max(timeout_s, 0.0)
    spec = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    expected = seen - 2**32 if seen >= 2**31 else seen  # the kernel compares as a C int
    call(number, address, _FUTEX_WAIT, expected, ctypes.addressof(spec))


def wake(address: int) -> None:
    """Wake every process sleeping in `wait` on the word at `address`."""
    number, call = _FOUND
    call(number, address, _FUTEX_WAKE, _WAKE_ALL, None)
