"""Data parallelism: tessera's DDP engine (buckets, hooks, overlap), compression, local SGD.

Names load on first use (PEP 562): importing one module of the package (its `policy`, as
`tessera train`'s config does) does not import the rest.
"""

from __future__ import annotations

from tessera.runtime.lazy import lazy_names

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

_LAZY = {
    "Bucket": "tessera.data_parallel.bucket",
    "DDPPolicy": "tessera.data_parallel.policy",
    "DataParallel": "tessera.data_parallel.ddp",
    "LocalSGDPolicy": "tessera.data_parallel.policy",
    "PowerSGD": "tessera.data_parallel.compression",
    "TorchDDPPolicy": "tessera.data_parallel.policy",
    "assign_buckets": "tessera.data_parallel.bucket",
    "average_gradients": "tessera.data_parallel.naive",
    "average_parameters": "tessera.data_parallel.naive",
    "cast_hook": "tessera.data_parallel.compression",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
