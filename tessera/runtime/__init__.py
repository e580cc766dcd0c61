"""Where processes come from: joining the process group, local launch, errors and timeouts
(the Context carries the bound of every wait; `wait_or_raise` is that wait)."""

from tessera.runtime.context import (
    DEFAULT_TIMEOUT_S,
    Context,
    current_context,
    default_timeout_s,
    init,
    shutdown,
)
from tessera.runtime.launch import launch
from tessera.runtime.wait import wait_or_raise

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Context",
    "current_context",
    "default_timeout_s",
    "init",
    "launch",
    "shutdown",
    "wait_or_raise",
]
