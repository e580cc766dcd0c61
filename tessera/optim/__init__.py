"""Optimizers for host-memory training: `CPUAdam`, the fused CPU Adam(W) of ZeRO-Offload, and
`NVMeAdam`, the same step with its state streamed from files (ZeRO-Infinity)."""

from tessera.optim.cpu_adam import CPUAdam, native_kernel_available
from tessera.optim.nvme import NVMeAdam

__all__ = ["CPUAdam", "NVMeAdam", "native_kernel_available"]
