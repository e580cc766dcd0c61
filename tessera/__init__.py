"""tessera: distributed deep-learning training, every strategy in readable Python."""

from tessera import errors
from tessera.runtime import Context, init, launch, shutdown

__all__ = ["Context", "errors", "init", "launch", "shutdown"]
__version__ = "0.1.0"
