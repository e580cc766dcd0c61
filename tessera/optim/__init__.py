"""Optimizers for host-memory training: `CPUAdam`, the fused CPU Adam(W) of ZeRO-Offload."""

from tessera.optim.cpu_adam import CPUAdam, native_kernel_available

__all__ = ["CPUAdam", "native_kernel_available"]
