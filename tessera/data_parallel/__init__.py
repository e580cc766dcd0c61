"""Data parallelism: tessera's DDP engine (buckets, hooks, overlap), compression, local SGD."""

from tessera.data_parallel.bucket import Bucket, assign_buckets
from tessera.data_parallel.compression import PowerSGD, cast_hook
from tessera.data_parallel.ddp import DataParallel
from tessera.data_parallel.naive import average_gradients, average_parameters
from tessera.data_parallel.policy import DDPPolicy, LocalSGDPolicy, TorchDDPPolicy

__all__ = [
    "Bucket",
    "DDPPolicy",
    "DataParallel",
    "LocalSGDPolicy",
    "PowerSGD",
    "TorchDDPPolicy",
    "assign_buckets",
    "average_gradients",
    "average_parameters",
    "cast_hook",
]
