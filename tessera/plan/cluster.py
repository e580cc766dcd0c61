"""What the planner assumes about the machines: `Cluster`, its presets, and this machine measured.

A cluster is devices grouped in nodes, each device with memory and a peak matmul rate, linked
inside a node (NVLink) and across nodes (InfiniBand) by links of a bandwidth and a latency. The
planner turns a link into `tessera.comm.cost.CostParams` (α = latency, β = 1/bandwidth) and asks
the cost model for each collective, so the same alpha-beta-gamma formulas price a DGX and the
processes of this machine.

`this_machine()` measures instead of assuming: the matmul rate of one rank (a float32 `mm`, with
the thread count a rank of `--nproc` ranks gets), the cost of torch's AdamW step per parameter and
per tensor with those threads, and the cost model's constants fitted by `tessera.comm.calibrate`
on that many local ranks (at least two), and what a pipeline step costs there besides compute
(`plan.pipeline_cost`: per message, per step). They are cached in a JSON file, so a run
measures once per machine and rank count (`recalibrate=True` measures again).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tessera.comm.cost import CostParams

__all__ = [
    "CACHE_FILE",
    "PRESETS",
    "Cluster",
    "adamw_cost",
    "matmul_rate",
    "preset",
    "this_machine",
]

CACHE_FILE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "tessera"
    / ("this-machine.json")
)
"""Where `this_machine` keeps what it measured."""


@dataclass(kw_only=True, frozen=True)
class Cluster:
    """Devices, their memory and speed, and the two kinds of links between them."""

    name: str = "custom"
    devices: int
    per_node: int
    memory_bytes: float
    """Memory of one device (what must hold its model states and activations)."""
    peak_flops: float
    """Peak (dense 16-bit tensor core, or measured matmul) FLOP/s of one device."""
    intra_bandwidth: float
    """Bytes/s one device sends to another inside a node (one direction)."""
    inter_bandwidth: float
    """Bytes/s one device sends across nodes (its share of the node's network)."""
    intra_latency: float = 5e-6
    inter_latency: float = 1e-5
    host_bandwidth: float = 25e9
    """Bytes/s between a device and host memory (PCIe), for offload cpu."""
    cpu_adam_bytes_per_s: float = 50e9
    """Host memory bandwidth for CPU Adam: 28 bytes per parameter per step (FORMULAS.md)."""
    nvme_bandwidth: float = 3e9
    """Bytes/s to and from NVMe, for offload nvme."""
    reduce_bytes_per_s: float = 1.5e12
    """Bytes/s a device adds two vectors (γ = 1/this): its memory bandwidth."""
    optimizer_s_per_param: float | None = None
    """Seconds a device's own Adam step takes per parameter. None: memory-bound, 28 bytes a
    parameter (FORMULAS.md) at `reduce_bytes_per_s`, as a fused GPU kernel runs."""
    optimizer_s_per_tensor: float = 0.0
    """Seconds the step adds per parameter tensor (CPU: torch's per-tensor AdamW loop; a GPU's
    fused multi-tensor kernel: nothing)."""
    overlap: bool = True
    """Communication can run beside compute (a GPU's copy engines and NICs); False where the
    same cores do both (CPU ranks on a shared host): nothing is hidden."""
    shared_cores: int | None = None
    """The devices are processes sharing this many cores (`this-machine`), one thread each:
    a pipeline stage that waits gives its core to the others
    (`formulas.bubble_fraction_on_shared_cores`). None: each device computes on its own."""
    pipeline_message_s: float | None = None
    """Seconds one pipeline message (an activation forward or a gradient backward across one
    stage boundary, per micro-batch) adds to a step besides its bytes over the link, as a
    rank sees it: measured on `this-machine` (`plan.pipeline_cost`: sends, wake-ups and the
    schedule's host work, on cores the ranks share). None: the link's latency α, each
    device paying its own messages (a GPU's copy engines move them)."""
    pipeline_step_s: float = 0.0
    """Seconds a pipeline engine's step adds whatever its micro-batches, beyond what a
    data-parallel engine's step costs (this machine: the gather of the global batch over all
    ranks, the loss broadcast; measured by `plan.pipeline_cost`). 0: not priced."""
    algorithms: tuple[str, ...] = ("native",)
    """Collective algorithms the cost model may choose between (`comm.cost.choose`)."""
    measured: dict[str, Any] = field(default_factory=dict)
    """For `this-machine`: what was measured (and when)."""

    def __post_init__(self) -> None:
        for name in ("devices", "per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("memory_bytes", "peak_flops", "intra_bandwidth", "inter_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.devices > self.per_node and self.devices % self.per_node:
            raise ValueError(
                f"--devices {self.devices} is not a whole number of nodes of "
                f"--per-node {self.per_node}"
            )

    def optimizer_s(self, params: float, tensors: int) -> float:
        """Seconds of a device's own Adam step over `params` parameters in `tensors` tensors."""
        per_param = self.optimizer_s_per_param
        if per_param is None:
            per_param = 28 / self.reduce_bytes_per_s
        return params * per_param + tensors * self.optimizer_s_per_tensor

    @property
    def nodes(self) -> int:
        """Whole nodes (one when the devices fill less than a node)."""
        return max(1, self.devices // self.per_node)

    def link(self, intra: bool) -> CostParams:
        """The cost model's constants of one link kind (inside a node if `intra`)."""
        base = CostParams(**self.measured["cost"]) if "cost" in self.measured else CostParams()
        if "cost" in self.measured and intra:
            return base  # this machine: one node, the fitted constants as they are
        latency = self.intra_latency if intra else self.inter_latency
        bandwidth = self.intra_bandwidth if intra else self.inter_bandwidth
        return replace(
            base,
            alpha=latency,
            alpha_native=latency,
            beta=1.0 / bandwidth,
            gamma=1.0 / self.reduce_bytes_per_s,
        )

    def describe(self) -> str:
        """One line for the top of the plan's table."""
        return (
            f"{self.name}: {self.devices} devices, {self.per_node} per node, "
            f"{self.memory_bytes / 1e9:.0f} GB, {self.peak_flops / 1e12:.3g} TFLOP/s, "
            f"links {self.intra_bandwidth / 1e9:.3g} GB/s in a node, "
            f"{self.inter_bandwidth / 1e9:.3g} GB/s across"
        )


PRESETS: dict[str, dict[str, Any]] = {
    # NVIDIA DGX A100 (the machines of Narayanan et al. 2021): 8 GPUs per node, 312 TFLOP/s
    # bf16 dense, NVLink3 300 GB/s each way, 8 x 200 Gb/s HDR InfiniBand per node (25 GB/s per
    # GPU), PCIe gen4 host links.
    "a100-80g-dgx": dict(
        per_node=8,
        memory_bytes=80e9,
        peak_flops=312e12,
        intra_bandwidth=300e9,
        inter_bandwidth=25e9,
        host_bandwidth=25e9,
        reduce_bytes_per_s=2.0e12,
    ),
    # NVIDIA DGX H100: 989 TFLOP/s bf16 dense, NVLink4 450 GB/s each way, 8 x 400 Gb/s NDR
    # (50 GB/s per GPU), PCIe gen5.
    "h100-80g-dgx": dict(
        per_node=8,
        memory_bytes=80e9,
        peak_flops=989e12,
        intra_bandwidth=450e9,
        inter_bandwidth=50e9,
        host_bandwidth=50e9,
        reduce_bytes_per_s=3.35e12,
    ),
}
"""Named clusters (`--cluster NAME`); `--devices` says how many devices (default: one node)."""


def preset(name: str, devices: int | None = None, **overrides: Any) -> Cluster:
    """The preset `name` with `devices` devices (default one node) and any field overridden."""
    if name == "this-machine":
        return replace(this_machine(ranks=devices or 2), **overrides)
    if name not in PRESETS:
        choices = ", ".join([*PRESETS, "this-machine"])
        raise ValueError(f"unknown --cluster {name!r}; choose one of {choices}")
    values = {**PRESETS[name], **overrides}
    return Cluster(name=name, devices=devices or values["per_node"], **values)


def matmul_rate(size: int = 512, seconds: float = 0.3, device: Any = "cpu") -> float:
    """FLOP/s of a float32 (size x size) @ (size x size) on `device` (CPU: this process's
    threads), the median of repeated runs.

    The operands come from a generator of their own: a trainer measures this between steps, and
    drawing from torch's global generator would change the run's random stream (dropout), so a
    resumed run would no longer equal an uninterrupted one.
    """
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator)
    b = torch.randn(size, size, device=device, generator=generator)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / sorted(times)[len(times) // 2]


def adamw_cost(seconds: float = 0.2) -> tuple[float, float]:
    """(seconds per parameter, seconds per tensor) of torch's AdamW step on the CPU as the
    trainer builds it there (the default, per-tensor implementation), with this process's
    threads: one 2^20-element tensor, then 64 tensors of 16 elements (their per-tensor cost).
    Medians of repeated steps, parameters and gradients from a generator of their own."""
    import torch

    def step_time(shapes: list[int]) -> float:
        generator = torch.Generator().manual_seed(0)
        params = [torch.randn(n, generator=generator).requires_grad_() for n in shapes]
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        optimizer.step()  # warm-up: the state is allocated
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times) < 5:
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    per_tensor = step_time([16] * 64) / 64
    per_param = max(0.0, step_time([2**20]) - per_tensor) / 2**20
    return per_param, per_tensor


_CACHED_KEYS = {"adamw_s_per_param", "pipeline_message_s", "pipeline_step_s"}
"""What a cache written before a cost was measured lacks (it is measured again)."""


def _calibrate_rank() -> dict[str, float]:
    """One rank of the calibration: `comm.calibrate` on the default group (the plan's ranks)."""
    import torch

    from tessera.comm.calibrate import calibrate
    from tessera.runtime.context import init

    init()
    torch.set_num_threads(1)
    return asdict(calibrate(repeats=9))


def _measure(ranks: int) -> dict[str, Any]:
    import torch

    from tessera.plan.pipeline_cost import measure_pipeline
    from tessera.runtime.launch import launch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    try:
        rate = matmul_rate()
        adam_per_param, adam_per_tensor = adamw_cost()
    finally:
        torch.set_num_threads(threads)
    # the links as the plan's ranks see them: more ranks than cores take turns on them, and a
    # collective then waits for each to be scheduled (4 ranks on 2 cores: ddp's all-reduce
    # measured 20x what two ranks' constants predicted, BENCHMARKS.md "plan_check")
    cost = launch(_calibrate_rank, max(2, ranks), timeout_s=120)[0]
    pipeline = measure_pipeline(ranks, beta=cost["beta"])  # the same ranks, sharing the cores
    return {
        "matmul_flops": rate,
        "adamw_s_per_param": adam_per_param,
        "adamw_s_per_tensor": adam_per_tensor,
        "cost": cost,
        **pipeline,
        "ranks": ranks,
        "measured_at": time.time(),
    }


def this_machine(
    *, ranks: int = 2, cache: Path | None = None, recalibrate: bool = False
) -> Cluster:
    """This host as a cluster of `os.cpu_count()` CPU "devices" (one node), measured once.

    peak_flops is the matmul rate of one rank of `ranks` sharing the cores (what the trainer's
    ranks get: `runtime.context` gives each cores // ranks threads, at least one; more ranks than
    cores take turns, so each gets cores / ranks of its thread's rate); the links are the cost
    model fitted by `comm.calibrate` on `ranks` local ranks (at least two), and a pipeline
    message and step as `plan.pipeline_cost` times them on those ranks; memory is the host's
    RAM shared by `ranks` ranks. Measured values are read from `cache` (default `CACHE_FILE`)
    when present.
    """
    path = cache or CACHE_FILE
    measured: dict[str, Any] | None = None
    if path.is_file() and not recalibrate:
        measured = json.loads(path.read_text())
        if measured.get("ranks") != ranks or not _CACHED_KEYS <= set(measured):
            measured = None  # another rank count, or measured before some cost was
    if measured is None:
        measured = _measure(ranks)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measured, indent=1))
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cost = measured["cost"]
    return Cluster(
        name="this-machine",
        devices=ranks,
        per_node=max(ranks, cores),
        memory_bytes=ram / ranks,
        peak_flops=measured["matmul_flops"] * min(1.0, cores / ranks),
        intra_bandwidth=1.0 / cost["beta"],
        inter_bandwidth=1.0 / cost["beta"],
        intra_latency=cost["alpha_native"],
        inter_latency=cost["alpha_native"],
        host_bandwidth=1.0 / cost["mu"],
        cpu_adam_bytes_per_s=1.0 / cost["mu"],
        reduce_bytes_per_s=1.0 / cost["gamma"],
        optimizer_s_per_param=measured["adamw_s_per_param"] * max(1.0, ranks / cores),
        optimizer_s_per_tensor=measured["adamw_s_per_tensor"] * max(1.0, ranks / cores),
        overlap=False,
        shared_cores=cores,
        pipeline_message_s=measured["pipeline_message_s"],
        pipeline_step_s=measured["pipeline_step_s"],
        algorithms=("native", "ring", "shm"),
        measured=measured,
    )
