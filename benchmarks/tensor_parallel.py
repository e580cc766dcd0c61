"""tessera tensor parallelism vs torch's `parallelize_module` (ColwiseParallel / RowwiseParallel).

Two modules on 2 ranks (gloo): an MLP (Linear(512, 2048) - GELU - Linear(2048, 512)) and a
pre-LayerNorm transformer block (separate q/k/v projections, 8 heads, the same MLP), input
(8, 128, 512) requiring grad (as inside a model). Both libraries get the same plan: q, k, v and
up column-wise, proj and down row-wise. One step = forward, backward, SGD step; timed from a
barrier to the end on the slowest rank; engines alternate step by step; medians. Also: one process
on the dense module (rank 0 alone), collective calls per step for both (tessera counts its own;
torch's through `CommDebugMode`), and tessera's bytes per rank per step against the closed form
(Megatron: one all-reduce of b s h floats per row layer forward and per column layer backward).

    python benchmarks/tensor_parallel.py [--quick]

Writes benchmarks/results/tensor_parallel.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.tensor_parallel import parallelize
from tessera.tensor_parallel._comm import STATS

RESULTS = Path(__file__).parent / "results"
B, S, H, HEADS = 8, 128, 512, 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """Attention heads are counted from the local width, so the same code runs split."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v, self.proj = (nn.Linear(H, H) for _ in range(4))
        self.mlp = MLP()

    def attention(self, x):
        b, s, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (b, s, H / t) each when split
        heads = q.shape[-1] // (H // HEADS)
        q, k, v = (z.view(b, s, heads, H // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


PLANS = {
    "mlp": (MLP, {"up": "column", "down": "row"}),
    "block": (
        Block,
        {
            "q": "column",
            "k": "column",
            "v": "column",
            "proj": "row",
            "mlp.up": "column",
            "mlp.down": "row",
        },
    ),
}


def _torch_tp(module: nn.Module, plan: dict[str, str]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {
        name: ColwiseParallel() if s == "column" else RowwiseParallel() for name, s in plan.items()
    }
    return parallelize_module(module, mesh, styles)


def _step(module, optimizer, x):
    module(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _timed(module, optimizer, x) -> float:
    dist.barrier()
    began = time.perf_counter()
    _step(module, optimizer, x)
    took = torch.tensor([time.perf_counter() - began])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _bench(name: str, steps: int, rounds: int) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    tessera.init()
    cls, plan = PLANS[name]
    torch.manual_seed(0)
    dense = cls()
    torch.manual_seed(1)
    x = torch.randn(B, S, H, requires_grad=True)
    one = []
    if dist.get_rank() == 0:
        optimizer = torch.optim.SGD(dense.parameters(), lr=1e-3)
        for _ in range(steps * rounds + 1):
            began = time.perf_counter()
            _step(dense, optimizer, x)
            one.append(time.perf_counter() - began)
    box = [statistics.median(one[1:]) if one else 0.0]
    dist.broadcast_object_list(box, src=0)
    engines = {
        "tessera": parallelize(copy.deepcopy(dense), plan),
        "torch": _torch_tp(copy.deepcopy(dense), plan),
    }
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in engines.items()}
    times = {k: [] for k in engines}
    for k, module in engines.items():
        _timed(module, optimizers[k], x)  # warm-up
    before = dict(STATS)
    _step(engines["tessera"], optimizers["tessera"], x)
    tessera_calls = STATS["calls"] - before["calls"]
    tessera_bytes = STATS["all_reduce_bytes"] - before["all_reduce_bytes"]
    with CommDebugMode() as comm:
        _step(engines["torch"], optimizers["torch"], x)
    torch_calls = comm.get_total_counts()
    for _ in range(rounds * steps):  # interleaved step by step: both see the same load
        for k, module in engines.items():
            times[k].append(_timed(module, optimizers[k], x))
    # one all-reduce of (b, s, h) floats per row layer forward and per column layer backward
    layers = len(plan)
    return {
        "module": name,
        "one_process_ms": box[0] * 1e3,
        "tessera_ms": statistics.median(times["tessera"]) * 1e3,
        "torch_ms": statistics.median(times["torch"]) * 1e3,
        "tessera_collectives": tessera_calls,
        "torch_collectives": torch_calls,
        "tessera_mb_per_step": tessera_bytes / 2**20,
        "closed_form_mb_per_step": layers * B * S * H * 4 / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args(argv)
    steps, rounds = (2, 2) if args.quick else (5, 4)
    rows = [tessera.launch(_bench, 2, name, steps, rounds, deadline_s=900)[0] for name in PLANS]
    lines = [
        "| module | one process ms | tessera ms | torch ms | ratio | collectives tessera / torch | "
        "tessera MB/step (closed form) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['module']} | {r['one_process_ms']:.1f} | {r['tessera_ms']:.1f} "
            f"| {r['torch_ms']:.1f} | **{r['torch_ms'] / r['tessera_ms']:.2f}** "
            f"| {r['tessera_collectives']} / {r['torch_collectives']} "
            f"| {r['tessera_mb_per_step']:.1f} ({r['closed_form_mb_per_step']:.1f}) |"
        )
    print("\n".join(lines))
    machine = f"{platform.machine()}, torch {torch.__version__}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tensor_parallel.json").write_text(
        json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n"
    )
    header = [
        "## tensor_parallel: tessera column/row layers vs torch parallelize_module",
        "",
        f"{machine}; 2 ranks (gloo, one machine, 2 cores); input (8, 128, 512) with grad; "
        "one step = forward + backward + SGD. Ratio = torch step time / tessera step time "
        "(above 1: tessera faster). Collectives per step as each library counts them; MB = "
        "bytes each rank hands to all-reduce per step (closed form: one all-reduce of b s h "
        "floats per row layer forward and per column layer backward).",
        "",
    ]
    (RESULTS / "tensor_parallel.md").write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
