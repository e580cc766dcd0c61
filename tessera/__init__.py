"""tessera: distributed deep-learning training, every strategy in readable Python."""

from tessera import comm, data_parallel, errors, pipeline, tensor_parallel, zero
from tessera.data_parallel import DataParallel
from tessera.mesh import Mesh
from tessera.runtime import Context, init, launch, shutdown

__all__ = [
    "Context",
    "DataParallel",
    "Mesh",
    "comm",
    "data_parallel",
    "errors",
    "init",
    "launch",
    "pipeline",
    "shutdown",
    "tensor_parallel",
    "zero",
]
__version__ = "0.1.0"
