"""Optimizers for host-memory training: `CPUAdam`, the fused CPU Adam(W) of ZeRO-Offload, and
`NVMeAdam`, the same step with its state streamed from files (ZeRO-Infinity); and
`DynamicLossScaler`, the loss scale of fp16 training."""

from tessera.optim.cpu_adam import CPUAdam, native_kernel_available
from tessera.optim.loss_scale import DynamicLossScaler
from tessera.optim.nvme import NVMeAdam

__all__ = ["CPUAdam", "DynamicLossScaler", "NVMeAdam", "native_kernel_available"]
