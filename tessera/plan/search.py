"""Every strategy that applies to a model on a cluster, its memory per device and its step time.

`plan(model, cluster, batch=B, microbatch=b)` enumerates data parallelism (ZeRO 0-3, offload cpu or
nvme), tensor parallelism t (groups that tile a node), pipeline parallelism p (m = B / (dp b)
micro-batches, GPipe, 1F1B or interleaved with v = 2 chunks per device) and their mixes, with and
without full activation recomputation, and returns an `Estimate` per strategy, best first: those
that fit before those that do not, then by predicted step time. A device holds Ψ / (t p)
parameters, plus what every tensor-parallel rank keeps whole (`ModelSpec.tensor_replicated_params`:
layer norms, row-parallel biases, position embedding), before ZeRO splits them over dp.

Two ways to price a step, after what the rate X per device means:
* `achieved_flops` X is an end-to-end throughput, as Narayanan et al. 2021 report theirs (model
  FLOPs of a step over its whole time, communication and bubbles included): the step is the
  iteration's FLOPs as they count them (their Eq. 3, which counts the recomputed forward
  whether a strategy recomputes or not: their rates are measured so) over n X, and nothing is
  added (Eq. 4, 8TP/(nX), for a whole run). Every strategy then takes the same time; the plan
  orders them by what the compute-only mode would add at that rate.
* otherwise X is a compute-only rate (the cluster's peak, or `compute_flops`, what `tessera
  compare` measures of a rank's step alone) and the step is compute + exposed communication +
  bubble (+ offload traffic), as follows.
* compute: the iteration's FLOPs (`formulas.flops_per_iteration`) over n devices at X FLOP/s;
* tensor parallelism: per layer and micro-batch 4 all-reduces of b s h 16-bit values (2 forward,
  2 backward; 6 when recomputing), inside a node, all exposed (they sit between the matmuls);
* pipeline: per micro-batch one activation send forward and one gradient send backward of
  b s h / t values (scatter/gather, Narayanan et al. 2021 section 4.1), exposed; where the
  cluster measured what a message and a step of the pipeline engine cost on cores its ranks
  share (`Cluster.pipeline_message_s`, `pipeline_step_s`: this machine, `plan.pipeline_cost`),
  per micro-batch and stage boundary, forward and backward, spread over the ranks
  (`pipeline_messages`), plus the per-step cost;
* data parallelism, as tessera's engines run it: the gradient all-reduce (ZeRO-1: an all-gather
  of the parameters after an all-reduce in place on one host, a reduce-scatter across hosts,
  `zero.stage1`; ZeRO-2: reduce-scatter + all-gather; ZeRO-3 also gathers the parameters for
  each micro-batch's forward and backward, but for the root unit (embeddings) that it keeps
  between them, Rajbhandari et al. 2020 section 7) of this device's
  parameters, across nodes when the group spans them; m accumulated micro-batches reduce
  once, after the last (the engine's `no_sync`, so ZeRO-2/3 then hold whole gradients)
  (`data_parallel_collectives`); without a pipeline it overlaps the backward pass (DDP's
  buckets) and only what exceeds it is exposed; after a pipeline flush it is all exposed;
* bubble: `formulas.bubble_fraction(p, m, v)` of the compute; on a cluster whose devices are
  processes sharing fewer cores (`Cluster.shared_cores`, this machine), a waiting stage lends
  its core to the busy ones and the bubble is `formulas.bubble_fraction_on_shared_cores`;
* offload: the 4 bytes per parameter PCIe traffic of ZeRO-Offload and CPU Adam's 28 bytes per
  parameter of host memory traffic; nvme also reads and writes the optimizer state;
* the device's own optimizer step (without offload): the parameters it steps (all of its
  stage's under DDP, 1/dp under ZeRO) times the cluster's cost per parameter (GPUs: 28 bytes at
  memory bandwidth), plus a cost per tensor stepped (this machine: torch's AdamW loops over
  tensors on the CPU; ZeRO steps a few flat buffers, DDP every parameter tensor). On CPU ranks
  this was the term that separated ddp from zero1/zero2 in `benchmarks/plan_check.py`.
Each collective's time is `tessera.comm.cost.predict` with the cluster's link constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.comm.api import GATHER_ALGORITHMS
from tessera.comm.cost import choose, predict
from tessera.plan.cluster import Cluster
from tessera.plan.formulas import (
    bubble_fraction,
    bubble_fraction_on_shared_cores,
    flops_per_iteration,
    model_state_bytes,
)
from tessera.plan.model import ModelSpec

__all__ = [
    "PRECISIONS",
    "Estimate",
    "Strategy",
    "data_parallel_collectives",
    "enumerate_strategies",
    "estimate",
    "pipeline_messages",
    "plan",
]

PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}
"""Bytes per parameter (parameter, gradient, optimizer state) for Adam: mixed precision (fp16/bf16
copies, fp32 master + moments; ZeRO's K = 12) or plain fp32 (the parameters are the masters)."""

SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass(frozen=True)
class Strategy:
    """One way to split the work: dp x tp x pp, ZeRO stage, offload, schedule, recomputation."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    offload: str | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: bool = False
    chunks: int = 1
    """Model chunks per device (v) of the interleaved schedule."""

    @property
    def name(self) -> str:
        """What the table calls it (the trainer's strategy names where one matches)."""
        if self.tp == 1 and self.pp == 1:
            base = "ddp" if self.zero == 0 else f"zero{self.zero}"
            base += f"+offload-{self.offload}" if self.offload else ""
            base += f" dp={self.dp}" if self.dp > 1 else ""
        elif self.dp == 1 and self.pp == 1:
            base = f"tensor t={self.tp}"
        elif self.dp == 1 and self.tp == 1:
            base = f"pipeline p={self.pp}"
        else:
            base = f"hybrid dp={self.dp} tp={self.tp} pp={self.pp}"
            base += f" zero{self.zero}" if self.zero else ""
        if self.pp > 1:
            v = f" v={self.chunks}" if self.schedule == "interleaved" else ""
            base += f" {self.schedule}{v} m={self.microbatches}"
        return base + (" +recompute" if self.recompute else "")


@dataclass(frozen=True)
class Estimate:
    """What the planner predicts for one strategy (bytes per device, seconds per step)."""

    strategy: Strategy
    params: float
    grads: float
    optimizer: float
    activations: float
    fits: bool
    compute_s: float
    comm_s: float
    bubble_s: float
    offload_s: float
    tokens_per_s: float
    days: float | None
    host_bytes: float = 0.0
    """Optimizer state offloaded to host memory (per device), not counted in memory_bytes."""
    optimizer_s: float = 0.0
    """The device's own optimizer step (offloaded: in `offload_s`, the host's)."""

    @property
    def memory_bytes(self) -> float:
        """Everything one device holds: model states and activations."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def model_state_bytes(self) -> float:
        """Parameters, gradients and optimizer state (what a run's model_state_mb measures)."""
        return self.params + self.grads + self.optimizer

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.compute_s + self.comm_s + self.bubble_s + self.offload_s + self.optimizer_s

    def to_json(self) -> dict[str, Any]:
        """The `--json` record of this strategy (the schema of issue 22)."""
        s = self.strategy
        return {
            "name": s.name,
            "dp": s.dp,
            "tp": s.tp,
            "pp": s.pp,
            "zero": s.zero,
            "offload": s.offload,
            "microbatches": s.microbatches,
            "schedule": s.schedule if s.pp > 1 else None,
            "recompute": s.recompute,
            "fits": self.fits,
            "memory_bytes": self.memory_bytes,
            "memory": {
                "params": self.params,
                "grads": self.grads,
                "optimizer": self.optimizer,
                "activations": self.activations,
            },
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "bubble_s": self.bubble_s,
            "offload_s": self.offload_s,
            "optimizer_s": self.optimizer_s,
            "tokens_per_s": self.tokens_per_s,
            "days": self.days,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_strategies(
    model: ModelSpec,
    cluster: Cluster,
    *,
    batch: int,
    microbatch: int,
    recompute: tuple[bool, ...] = (False, True),
) -> list[Strategy]:
    """Every dp x tp x pp split of the cluster's devices that the batch and the model allow."""
    n = cluster.devices
    found: list[Strategy] = []
    for tp in _divisors(n):
        if tp > 1 and (cluster.per_node % tp or not model.is_transformer or model.heads % tp):
            continue  # groups that tile a node, splitting a transformer's heads evenly
        for pp in _divisors(n // tp):
            if pp > 1 and (not model.is_transformer or model.layers % pp):
                continue  # whole layers per stage
            dp = n // (tp * pp)
            if batch % (dp * microbatch):
                continue
            m = batch // (dp * microbatch)
            if pp > 1 and m < pp:
                continue  # fewer micro-batches than stages leaves stages idle by construction
            zeros = (0,) if dp == 1 else (0, 1, 2, 3) if pp == 1 else (0, 1, 2)
            for zero in zeros:
                offloads = (None, "cpu", "nvme") if zero and tp == pp == 1 else (None,)
                for offload in offloads:
                    for schedule in SCHEDULES if pp > 1 else ("1f1b",):
                        chunks = 2 if schedule == "interleaved" else 1
                        if chunks > 1 and (model.layers // pp) % chunks:
                            continue
                        for rc in recompute:
                            found.append(
                                Strategy(dp, tp, pp, zero, offload, m, schedule, rc, chunks)
                            )
    return found


def _collective(cluster: Cluster, nbytes: float, world: int, kind: str, intra: bool) -> float:
    if world <= 1 or nbytes <= 0:
        return 0.0
    params = cluster.link(intra)
    algorithms = cluster.algorithms  # gathers: those `comm.all_gather` may choose (`_auto_half`)
    if kind != "all_reduce":
        algorithms = tuple(a for a in algorithms if a in GATHER_ALGORITHMS) or ("native",)
    algorithm = choose(nbytes, world, params, candidates=algorithms, kind=kind)
    return predict(algorithm, nbytes, world, params, kind=kind)


def _device_params(s: Strategy, model: ModelSpec) -> float:
    """Parameters of one device before ZeRO: Ψ over the stages, split over the tensor-parallel
    ranks but for what each of them holds whole (`ModelSpec.tensor_replicated_params`)."""
    whole = model.tensor_replicated_params() if s.tp > 1 else 0.0
    return (model.params - whole) / (s.tp * s.pp) + whole / s.pp


def _memory(
    s: Strategy, model: ModelSpec, cluster: Cluster, microbatch: int, precision: str
) -> tuple[dict[str, float], float]:
    param_b, grad_b, optim_b = PRECISIONS[precision]
    shard = _device_params(s, model)
    states = model_state_bytes(
        round(shard), s.dp, s.zero, param_bytes=param_b, grad_bytes=grad_b, optimizer_bytes=optim_b
    )
    states = {k: float(v) for k, v in states.items()}
    if s.zero >= 2 and s.pp == 1 and s.microbatches > 1:  # accumulating, the engine's no_sync
        states["gradients"] += float(grad_b * round(shard))  # holds whole buckets beside shards
    states["host"] = 0.0
    if s.offload:  # the optimizer step runs on the host (CPU Adam), its state in host memory
        # beside it the gradient partition copied down, and a partition in the parameters'
        # bytes: fp32, the master (the device's copy is not stepped); mixed, the pinned buffer
        # each upload converts into (`tessera.zero.host_link`)
        part = round(shard) / s.dp if s.zero else round(shard)
        host = states["optimizer"] + (grad_b + param_b) * part
        states["host"], states["optimizer"] = host, 0.0
    layers = model.layers / s.pp
    in_flight = s.microbatches if s.schedule == "gpipe" else min(s.pp, s.microbatches)
    kind = "full" if s.recompute else "none"
    act = model.activation_bytes(microbatch, layers=layers, t=s.tp, recompute=kind) * in_flight
    if s.recompute:  # the layer being recomputed holds its whole working set for a moment
        act += model.activation_bytes(microbatch, layers=1, t=s.tp)
    return states, act * param_b / 2  # Korthikanti's bytes are 16-bit: fp32 doubles them


def _bubble(s: Strategy, cluster: Cluster) -> float:
    """The bubble over compute: (p - 1)/(v m) on devices of their own, less where the devices
    share cores and an idle stage lends its core to the busy ones; there the interleaved
    schedule is priced as 1F1B, its shorter bubble buying nothing: the cores an idle stage
    lends are used either way (BENCHMARKS.md, "pipeline_interleaved": no gain on 2 cores)."""
    shared = cluster.shared_cores
    if s.pp == 1 or shared is None or s.dp * s.tp * s.pp <= shared:
        return bubble_fraction(s.pp, s.microbatches, s.chunks)
    return bubble_fraction_on_shared_cores(s.pp, s.microbatches, s.dp * s.tp, shared)


def pipeline_messages(s: Strategy) -> float:
    """Messages per rank and step of a pipeline on cores its ranks share: per micro-batch, per
    stage boundary (p v - 1 of them, v chunks a device), one forward and one backward, each
    pipeline's spread over its p ranks (every rank's sends and receives take the cores'
    time alike; a middle stage has both, an end stage one side)."""
    return 2 * s.microbatches * (s.pp * s.chunks - 1) / s.pp


def _pipeline_time(s: Strategy, cluster: Cluster, message_bytes: float) -> float:
    """Exposed seconds of a pipeline's messages (and, where measured, its engine's per-step
    costs): on devices of their own, each device's 2 m v sends at the link's latency and
    bandwidth (Narayanan et al. 2021 section 4.1); where the cluster measured a message as
    processes sharing cores see it (`Cluster.pipeline_message_s`, this machine), that cost
    instead of the latency, `pipeline_messages` of them, plus `Cluster.pipeline_step_s`."""
    link = cluster.link(s.tp * s.pp <= cluster.per_node)
    if cluster.pipeline_message_s is None:
        one = link.alpha_native + message_bytes * link.beta
        return 2 * s.microbatches * s.chunks * one
    one = cluster.pipeline_message_s + message_bytes * link.beta
    return pipeline_messages(s) * one + cluster.pipeline_step_s


def _stepped(s: Strategy, model: ModelSpec, shard: float) -> tuple[float, int]:
    """Parameters and tensors one device's optimizer steps: its stage's tensors whole (tensor
    parallelism cuts each, their count stays), or under ZeRO its slice of the flat buffers: two
    per unit (the trainer's weight-decay groups never share a buffer), one unit for stages 1
    and 2, one per layer and the rest (embeddings, final norm) for stage 3."""
    if s.zero == 0:
        return shard, max(1, round(model.tensors / s.pp))
    units = round(model.layers / s.pp) + 1 if s.zero == 3 and model.layers else 1
    return shard / s.dp, 2 * units


def data_parallel_collectives(
    s: Strategy, shard: float, precision: str, one_host: bool, root: float = 0.0
) -> list[tuple[str, float]]:
    """The dp group's collectives of one optimizer step, (kind, bytes each), as tessera's engines
    issue them for a device holding `shard` parameters: DDP all-reduces the gradients; ZeRO-1
    all-reduces them in place on one host (`zero.stage1`), reduce-scatters across hosts, then
    all-gathers the parameters; ZeRO-2 reduce-scatters and all-gathers; ZeRO-3 gathers the
    parameters for each micro-batch's forward and again for its backward, but for the `root`
    parameters (its root unit, kept from the forward's end to the backward's start).
    Accumulated micro-batches reduce once, after the last (the engine's `no_sync`)."""
    if s.dp == 1:
        return []
    param_b, grad_b, _ = PRECISIONS[precision]
    grads, params = shard * grad_b, shard * param_b
    m = s.microbatches if s.pp == 1 else 1  # a pipeline's micro-batches are not accumulation
    if s.zero == 0:
        return [("all_reduce", grads)]
    if s.zero == 1:
        return [("all_reduce" if one_host else "reduce_scatter", grads), ("all_gather", params)]
    if s.zero == 2:
        return [("reduce_scatter", grads), ("all_gather", params)]
    backward = ("all_gather", (shard - root) * param_b)
    return [("reduce_scatter", grads)] + [("all_gather", params), backward] * m


def _data_parallel_time(
    s: Strategy, cluster: Cluster, shard: float, root: float, compute: float, precision: str
) -> float:
    """Exposed seconds of the dp group's gradient (and ZeRO's parameter) collectives."""
    intra = s.dp * s.tp <= cluster.per_node
    found = data_parallel_collectives(s, shard, precision, one_host=intra, root=root)
    dp_time = sum(_collective(cluster, nbytes, s.dp, kind, intra) for kind, nbytes in found)
    if s.pp == 1 and cluster.overlap:  # beside the backward (ZeRO-3's gathers: forward too)
        window = compute if s.zero == 3 else compute * (0.75 if s.recompute else 2 / 3)
        dp_time = max(0.0, dp_time - window)
    return dp_time


def estimate(
    s: Strategy,
    model: ModelSpec,
    cluster: Cluster,
    *,
    batch: int,
    microbatch: int,
    tokens: float | None = None,
    achieved_flops: float | None = None,
    compute_flops: float | None = None,
    precision: str = "mixed",
) -> Estimate:
    """Memory per device and step time of strategy `s` (see the module docstring): with
    `achieved_flops` (end to end) the FLOPs over that rate alone; else compute at
    `compute_flops` (default the peak) plus exposed communication, bubble and offload.

    Why so many parameters: the strategy, the model, the cluster, the batch (two) and what
    the estimate is priced at (tokens, one of two rates, precision) are each a caller's choice.
    """
    if achieved_flops is not None and compute_flops is not None:
        raise ValueError("give achieved_flops (end to end) or compute_flops, not both")
    states, act = _memory(s, model, cluster, microbatch, precision)
    param_b, grad_b, optim_b = PRECISIONS[precision]
    n = s.dp * s.tp * s.pp
    flops_rate = achieved_flops or compute_flops or cluster.peak_flops
    # an end-to-end rate counts FLOPs as Megatron-LM does: Eq. 3, the recomputed forward included
    counted = s.recompute or achieved_flops is not None
    if model.is_transformer:
        flops = flops_per_iteration(
            batch, model.seq, model.layers, model.hidden, model.vocab, recompute=counted
        )
    else:
        flops = model.flops_per_token(recompute=counted) * batch * model.seq
    compute = flops / (n * flops_rate)
    act_bytes = param_b * microbatch * model.seq * model.hidden  # one b x s x h activation
    comm = 0.0
    if s.tp > 1:
        per_layer = 6 if s.recompute else 4
        count = s.microbatches * (model.layers / s.pp) * per_layer
        comm += count * _collective(cluster, act_bytes, s.tp, "all_reduce", intra=True)
    if s.pp > 1:
        comm += _pipeline_time(s, cluster, act_bytes / s.tp)
    shard = _device_params(s, model)
    root = model.params_outside_layers()
    comm += _data_parallel_time(s, cluster, shard, root, compute, precision)
    offload = 0.0
    if s.offload:
        part = shard / s.dp
        offload = part * (param_b + grad_b) / cluster.host_bandwidth
        offload += part * 28 / cluster.cpu_adam_bytes_per_s
        if s.offload == "nvme":
            offload += 2 * part * optim_b / cluster.nvme_bandwidth
    bubble = _bubble(s, cluster) * compute
    optimizer = 0.0 if s.offload else cluster.optimizer_s(*_stepped(s, model, shard))
    if achieved_flops is not None:  # measured end to end: the overheads are in the rate
        comm = bubble = offload = optimizer = 0.0
    step = compute + comm + bubble + offload + optimizer
    tokens_per_s = batch * model.seq / step
    total = states["params"] + states["gradients"] + states["optimizer"] + act
    return Estimate(
        strategy=s,
        params=states["params"],
        grads=states["gradients"],
        optimizer=states["optimizer"],
        activations=act,
        fits=total <= cluster.memory_bytes,
        compute_s=compute,
        comm_s=comm,
        bubble_s=bubble,
        offload_s=offload,
        optimizer_s=optimizer,
        host_bytes=states["host"],
        tokens_per_s=tokens_per_s,
        days=tokens / tokens_per_s / 86400 if tokens else None,
    )


def plan(
    model: ModelSpec,
    cluster: Cluster,
    *,
    batch: int,
    microbatch: int = 1,
    tokens: float | None = None,
    achieved_flops: float | None = None,
    compute_flops: float | None = None,
    recompute: tuple[bool, ...] = (False, True),
    precision: str = "mixed",
) -> list[Estimate]:
    """Every applicable strategy's estimate, best first (fitting ones by step time, then the rest
    by memory; with `achieved_flops` equal step times are ordered by the compute-only step at
    that rate). ValueError if the batch splits no way over the devices.

    Why so many parameters: as `estimate`'s, and which recomputation choices to search."""
    if batch < 1 or microbatch < 1:
        raise ValueError(f"--batch and --microbatch must be at least 1 ({batch}, {microbatch})")
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}")
    strategies = enumerate_strategies(
        model, cluster, batch=batch, microbatch=microbatch, recompute=recompute
    )
    if not strategies:
        raise ValueError(
            f"--batch {batch} with --microbatch {microbatch} splits over no data-parallel degree "
            f"of {cluster.devices} devices: make the batch a multiple of microbatch x dp"
        )
    common = {"batch": batch, "microbatch": microbatch, "tokens": tokens, "precision": precision}
    found = [
        estimate(
            s, model, cluster, achieved_flops=achieved_flops, compute_flops=compute_flops, **common
        )
        for s in strategies
    ]
    tie = [0.0] * len(found)
    if achieved_flops is not None:  # what the overheads would add: the better of equal steps
        rate = {"compute_flops": achieved_flops}
        tie = [estimate(s, model, cluster, **rate, **common).step_s for s in strategies]
    order = sorted(
        range(len(found)),
        key=lambda k: (
            not found[k].fits,
            (found[k].step_s, tie[k]) if found[k].fits else (found[k].memory_bytes, 0.0),
        ),
    )
    return [found[k] for k in order]
