"""tessera beside its anchors on GPUs (NCCL), when this machine has them.

Runs, on every CUDA device of the machine (one rank per device, NCCL):
- all_reduce of 1, 16 and 128 MB of float32: `torch.distributed.all_reduce` (the anchor) against
  `tessera.comm.all_reduce` with "auto" (which must resolve to NCCL's own collective for device
  tensors) and with "ring" (tessera's ring over NCCL point-to-point messages);
- training steps of the demo GPT through `tessera.setup`: tessera's `ddp` against PyTorch's
  DDP (`torch-ddp`), and tessera's `zero3` against FSDP2 (`fully_shard` on every block, then
  the root), on the same model, data and optimizer (AdamW).

Both sides alternate in blocks on the same ranks (A B A B ...), every time is a median over
repeats measured after `torch.cuda.synchronize()`, and the tables give ratios (anchor time /
tessera time: above 1 means tessera is faster). Without CUDA it says so and writes nothing.

    python benchmarks/gpu.py [--quick]

Writes benchmarks/results/gpu.json and benchmarks/results/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tessera
from tessera import comm
from tessera.models import GPT, GPTConfig

RESULTS = Path(__file__).parent / "results"
SIZES_MB = (1, 16, 128)
GPT_SHAPE = dict(n_layer=8, n_embd=768, n_head=12, block_size=256, vocab_size=512)


def _timed(fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls, each fenced by a device synchronisation."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _all_reduce_rows(repeats: int) -> list[dict[str, Any]]:
    ctx = tessera.init()
    rows = []
    for size_mb in SIZES_MB:
        x = torch.ones(size_mb * 2**18, device=ctx.device)
        anchor, auto, ring = [], [], []
        for _ in range(3):  # blocks: anchor, auto, ring, anchor, ...
            anchor.append(_timed(lambda x=x: dist.all_reduce(x), repeats))
            auto.append(_timed(lambda x=x: comm.all_reduce(x, algorithm="auto"), repeats))
            ring.append(_timed(lambda x=x: comm.all_reduce(x, algorithm="ring"), repeats))
        rows.append(
            {
                "size_mb": size_mb,
                "nccl_s": statistics.median(anchor),
                "auto_s": statistics.median(auto),
                "ring_s": statistics.median(ring),
            }
        )
    return rows


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _fsdp2_step(model: torch.nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    _loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _training_rows(steps: int, batch: int) -> list[dict[str, Any]]:
    from torch.distributed.fsdp import fully_shard

    ctx = tessera.init()
    config = GPTConfig(**GPT_SHAPE)
    generator = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(config.vocab_size, (batch, config.block_size), generator=generator)
    x, y = x.to(ctx.device), x.roll(-1, dims=1).to(ctx.device)

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(config).to(ctx.device)

    def tessera_step(strategy: str) -> Any:
        engine = tessera.setup(model(), adamw, strategy=strategy, loss_fn=_loss)

        def step() -> None:
            engine.train_step((x, y))
            engine.step()

        return step

    def fsdp2() -> Any:
        net = model()
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        optimizer = adamw(net.parameters())
        return lambda: _fsdp2_step(net, optimizer, x, y)

    pairs = {"ddp": ("torch-ddp", None), "zero3": (None, fsdp2)}
    rows = []
    for ours, (anchor_strategy, anchor_builder) in pairs.items():
        mine = tessera_step(ours)
        theirs = tessera_step(anchor_strategy) if anchor_strategy else anchor_builder()
        for fn in (mine, theirs):  # warm-up: allocator, NCCL communicators, kernels
            _timed(fn, 2)
        ours_s, anchor_s = [], []
        for _ in range(3):
            ours_s.append(_timed(mine, steps))
            anchor_s.append(_timed(theirs, steps))
        rows.append(
            {
                "strategy": ours,
                "anchor": anchor_strategy or "fsdp2",
                "tessera_step_s": statistics.median(ours_s),
                "anchor_step_s": statistics.median(anchor_s),
            }
        )
        del mine, theirs
        torch.cuda.empty_cache()
    return rows


def _rank(repeats: int, steps: int, batch: int) -> dict[str, Any]:
    ctx = tessera.init()
    result: dict[str, Any] = {"world": ctx.world_size, "device": torch.cuda.get_device_name()}
    if ctx.world_size > 1:
        result["all_reduce"] = _all_reduce_rows(repeats)
    result["training"] = _training_rows(steps, batch)
    return result


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "## gpu",
        "",
        f"{result['world']} x {result['device']}, NCCL; medians, anchor time / tessera time "
        "(above 1: tessera faster). Written by `benchmarks/gpu.py`.",
        "",
    ]
    if "all_reduce" in result:
        lines += [
            "| size | NCCL all_reduce | tessera auto | ratio | tessera ring | ratio |",
            "|---|---|---|---|---|---|",
        ]
        for row in result["all_reduce"]:
            lines.append(
                f"| {row['size_mb']} MB | {row['nccl_s'] * 1e3:.3f} ms | "
                f"{row['auto_s'] * 1e3:.3f} ms | {row['nccl_s'] / row['auto_s']:.2f}x | "
                f"{row['ring_s'] * 1e3:.3f} ms | {row['nccl_s'] / row['ring_s']:.2f}x |"
            )
        lines.append("")
    lines += ["| tessera | anchor | tessera step | anchor step | ratio |", "|---|---|---|---|---|"]
    for row in result["training"]:
        lines.append(
            f"| {row['strategy']} | {row['anchor']} | {row['tessera_step_s'] * 1e3:.1f} ms | "
            f"{row['anchor_step_s'] * 1e3:.1f} ms | "
            f"{row['anchor_step_s'] / row['tessera_step_s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run the comparison on every CUDA device here, if there is one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device on this machine: nothing to compare (run this on a GPU host)")
        return None
    repeats, steps = (5, 5) if args.quick else (20, 20)
    world = torch.cuda.device_count()
    result = tessera.launch(_rank, world, repeats, steps, 8)[0]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "gpu.md").write_text(_markdown(result))
    print(_markdown(result))
    return result


if __name__ == "__main__":
    main()
