"""tessera: distributed deep-learning training, every strategy in readable Python."""

from tessera import errors, pipeline, tensor_parallel
from tessera.mesh import Mesh
from tessera.runtime import Context, init, launch, shutdown

__all__ = [
    "Context",
    "Mesh",
    "errors",
    "init",
    "launch",
    "pipeline",
    "shutdown",
    "tensor_parallel",
]
__version__ = "0.1.0"
