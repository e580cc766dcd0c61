"""Cleanups on SIGTERM, chained in front of the handler that was there: one chain per process.

SIGTERM is what launchers (tessera's, torchrun's) send to stop a rank, and its default action
ends the process without running `atexit` hooks: files a rank created in shared memory or for
NVMe swapping would outlive it. Each mechanism that creates such files registers its cleanup
here; the first registration installs one handler that runs every cleanup, then does what the
previous handler did (calls it, or, if it was the default action, dies by SIGTERM all the same,
so the parent sees -15). SIG_IGN stays ignored: the process lives on after the cleanups.

Python lets only the main thread install handlers: registered from another thread, a cleanup
waits for the next registration from the main thread, and each mechanism's own sweep of stale
files (`comm.shm.files.sweep_stale`, `optim.swap_files.SwapFolder`) is the backstop, as after
`kill -9`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["on_sigterm"]

_cleanups: list[Callable[[], None]] = []
_previous: Any = None
_installed = False


def on_sigterm(cleanup: Callable[[], None]) -> None:
    """Run `cleanup()` when this process gets SIGTERM (once per distinct callable)."""
    global _previous, _installed
    if cleanup not in _cleanups:
        _cleanups.append(cleanup)
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _previous = signal.signal(signal.SIGTERM, _handle)
    _installed = True


def _handle(signum: int, frame: Any) -> None:
    """Every cleanup (one failing does not stop the others), then the previous handler."""
    for cleanup in list(_cleanups):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - a cleanup must not keep the process from ending
            pass
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action: die by the same signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
