"""Model FLOPs utilisation of a run: achieved model FLOP/s over what the devices could do.

MFU = tokens/s x model FLOPs per token / (ranks x peak FLOP/s of one rank) (Chowdhery et al.
2022, PaLM, appendix B): the model's FLOPs, not the hardware's, so activation recomputation does
not raise it.

* FLOPs per token: for tessera's GPT (the demo, or a `--model` that is one) Narayanan et al.
  2021 eq. (3) without recomputation (`tessera.plan.formulas.flops_per_token`); for any other
  model 6 x its parameters per token (Kaplan et al. 2020: 2 forward, 4 backward per parameter,
  attention's sequence term left out), per sample when the data are not token ids.
* Peak: on CUDA the dense 16-bit peak of a known device (A100 312 TFLOP/s, H100 989), else the
  measured matmul rate; on CPU the float32 matmul rate of this rank, measured once per run (on
  rank 0, at its first logged step, with the threads the rank has: about 20 ms) unless
  `tessera plan --cluster this-machine` measured it already for this many ranks (its cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.plan.cluster import CACHE_FILE, matmul_rate
from tessera.plan.model import from_module

__all__ = ["ModelFlops", "device_peak_flops"]

_CUDA_PEAKS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
"""Dense bf16 tensor-core peaks (NVIDIA data sheets) of the devices the presets describe."""


def device_peak_flops(device: torch.device, world_size: int = 1) -> tuple[float, str]:
    """Peak FLOP/s of one rank on `device` and where the number comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in _CUDA_PEAKS.items():
            if key in name:
                return peak, f"{key} data sheet"
        return matmul_rate(size=4096, seconds=0.2), "measured matmul rate"
    if CACHE_FILE.is_file():
        cached = json.loads(CACHE_FILE.read_text())
        if cached.get("ranks") == world_size and "matmul_flops" in cached:
            return float(cached["matmul_flops"]), f"{CACHE_FILE} (tessera plan)"
    return matmul_rate(size=256, seconds=0.02), "measured matmul rate"


@dataclass
class ModelFlops:
    """What turns a run's tokens/s into MFU; the peak is found at the first `mfu` call."""

    flops_per_token: float
    device: torch.device
    world_size: int
    peak: tuple[float, str] | None = field(default=None, repr=False)
    """Peak FLOP/s of one rank and its source, once known."""

    @classmethod
    def for_run(cls, model: nn.Module, device: torch.device, world_size: int) -> ModelFlops:
        """The model's FLOPs per token (see the module docstring), counted before any split."""
        return cls(from_module(model).flops_per_token(), device, world_size)

    @property
    def peak_source(self) -> str:
        """Where the peak comes from (a data sheet, a measurement, the plan's cache file)."""
        return self._peak()[1]

    def _peak(self) -> tuple[float, str]:
        if self.peak is None:
            self.peak = device_peak_flops(self.device, self.world_size)
        return self.peak

    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilisation at `tokens_per_s` over all ranks (a fraction: 0.5 is 50%)."""
        return tokens_per_s * self.flops_per_token / (self._peak()[0] * self.world_size)
