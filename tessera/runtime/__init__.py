"""Where processes come from: joining the process group, local launch, errors and timeouts."""

from tessera.runtime.context import (
    DEFAULT_TIMEOUT_S,
    Context,
    default_timeout_s,
    init,
    shutdown,
)
from tessera.runtime.launch import launch

__all__ = ["DEFAULT_TIMEOUT_S", "Context", "default_timeout_s", "init", "launch", "shutdown"]
