"""One command checks a GPU machine: the `gpu` tests, then tessera beside its anchors on CUDA.

    python benchmarks/gpu.py            # or: make gpu-check   (< 6 minutes on one GPU)
    python benchmarks/gpu.py --cpu      # the same code on the CPU, tiny and fast: does it run?

1. `pytest -m gpu` (tests/test_gpu.py, tests/test_setup.py): every strategy on the GPUs against
   a plain loop, through `tessera.setup` and `tessera train`; the summary line is recorded.
2. Training steps of a GPT-2-small-shaped model (12 x 768, block 1024, bf16 autocast), one rank
   per GPU (NCCL), each pair timed on the same ranks in alternating blocks (A B B A ...: each
   side runs first in half of them, so neither gains from its place), every time a median over
   steps fenced by `torch.cuda.synchronize()`:
   - tessera `single`, `ddp`, `zero2` against the plain PyTorch loop written here (eager);
   - `single` with `--compile` (`Module.compile`) against the plain loop compiled the same way;
   - `ddp` against torch DDP (`torch-ddp`), `zero3` against FSDP2 (`fully_shard`);
   - ZeRO-2/3 with `offload="cpu"` against the same stage without offload, and ZeRO-3's
     offload against FSDP2 with `CPUOffloadPolicy` (the issue's anchor);
   - the offload step decomposed: CPUAdam's host step, the download and the upload, each alone
     at one rank's partition, and a zero2 offload step split into `train_step` and `step`
     (the delayed update also with its host step on one thread fewer).
   A pair whose tessera side cannot run here (offload from GPU memory before it exists) is
   recorded with its error instead of stopping the check. The offload rows run first (their
   figures are the ones still open), and the rows measured so far are rewritten after each
   into benchmarks/results/gpu-partial.json: a run stopped at a time limit keeps them.
3. Ratios (anchor time / tessera time: above 1, tessera is faster) and all-reduce against NCCL
   (with 2+ GPUs) into benchmarks/results/gpu.json, gpu.md and BENCHMARKS.md's `## gpu` section,
   with the device named. `--cpu` writes benchmarks/results/gpu-cpu.json only (CPU timings say
   nothing about a GPU), with `aot_eager` for the compiled rows (no kernels generated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tessera
from tessera import comm
from tessera.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("TESSERA_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
"""Where the results go; `TESSERA_BENCH_RESULTS` (the suite's `--cpu` run: a folder of its own)."""
SIZES_MB = (1, 16, 128)
PARTIAL_SUFFIX = "-partial.json"
"""`gpu-partial.json`: the rows measured so far, rewritten after each; removed once the run has
written its results. A run stopped at its time limit leaves it behind."""
GPU_SHAPE = dict(n_layer=12, n_embd=768, n_head=12, block_size=1024, vocab_size=50304)
OFFLOAD_SHAPE = dict(n_layer=24, n_embd=1024, n_head=16, block_size=1024, vocab_size=50304)
"""GPT-2 medium (355M): the issue's FSDP2 anchor, 602 ms with CPUOffloadPolicy against 141 ms
without it on an H100 (bf16, batch 8 x 1024)."""
TRAIN_BATCH = 16
"""Rows per GPU of the training pairs: the issue's GPT-2-small measurement (56.3 ms a step for the
plain loop). At 8 rows a step is ~30 ms on an H100 and each step's host-side work (every pair is
fenced by a synchronisation per step) weighs twice as much."""
OFFLOAD_BATCH = 8
CPU_SHAPE = dict(n_layer=2, n_embd=64, n_head=2, block_size=64, vocab_size=512)
TESTS_TIMEOUT_S = 240  # of the 6 minutes the whole check may take on one GPU
GPU_TESTS = [
    "tests/test_gpu.py", "tests/test_setup.py", "tests/test_offload_device.py",
    "tests/test_offload_uploads.py",
]  # fmt: skip

Step = Callable[[], None]


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work: first asleep, on a blocking event behind the current
    stream's work, then `torch.cuda.synchronize` for the rest (side streams: the offload's
    uploads). `synchronize` alone spins a core for as long as it waits (CUDA's default for one
    context on many cores). Under the delayed update that core is one of the background host
    step's, and real training, which does not fence every step, does not spin there: the fence
    would slow the host step it is timing (on 2 CPU cores, a busy thread beside CPUAdam's two
    made its step 1.7-1.9x slower: BENCHMARKS offload, "Host-step experiments")."""
    if device.type == "cuda":
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()
        torch.cuda.synchronize(device)


def _timed(fn: Step, steps: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `steps` calls, each fenced by a device synchronisation."""
    times = []
    for _ in range(steps):
        _sync(device)
        began = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class _Bench:
    """The model, data and step builders of one rank (`--cpu`: tiny, fp32, on the CPU)."""

    def __init__(self, cpu: bool, batch: int, shape: dict[str, int] | None = None) -> None:
        self.ctx = tessera.init()
        self.device = self.ctx.device
        self.shape = shape or (CPU_SHAPE if cpu else GPU_SHAPE)
        self.config = GPTConfig(**self.shape)
        self.dtype = None if cpu else torch.bfloat16
        self.backend = "aot_eager" if cpu else "inductor"
        generator = torch.Generator().manual_seed(self.ctx.rank)
        shape = (batch, self.config.block_size)
        x = torch.randint(self.config.vocab_size, shape, generator=generator)
        self.x, self.y = x.to(self.device), x.roll(-1, dims=1).to(self.device)

    def model(self, compiled: bool = False) -> torch.nn.Module:
        torch.manual_seed(0)
        model = GPT(self.config).to(self.device)
        if compiled:
            model.compile(backend=self.backend)
        return model

    def adamw(self, params: Any) -> torch.optim.Optimizer:
        fused = {"fused": True} if self.device.type == "cuda" else {}
        return torch.optim.AdamW(params, lr=1e-4, **fused)

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)

    def plain(self, compiled: bool = False) -> Step:
        """The plain PyTorch loop: forward under autocast, backward, fused AdamW, zero_grad."""
        model = self.model(compiled)
        optimizer = self.adamw(model.parameters())

        def step() -> None:
            with self.autocast():
                loss = _loss(model(self.x), self.y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def tessera(
        self, strategy: str, compiled: bool = False, precision: str = "bf16", **options: Any
    ) -> Step:
        """`tessera.setup` with its defaults: no gradient clipping (`grad_clip=0`), as the plain
        loop does not clip (`tessera train`'s default `--grad-clip 1.0` is not what is timed)."""
        engine = tessera.setup(
            self.model(compiled), self.adamw, strategy=strategy, loss_fn=_loss,
            precision=precision if self.dtype is not None else "fp32", **options,
        )  # fmt: skip

        def step() -> None:
            engine.train_step((self.x, self.y))  # a StepLoss: nothing read, no sync
            engine.step()

        return step

    def fsdp2(self, offload: bool = False) -> Step:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        net = self.model()
        policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
        for block in net.blocks:
            fully_shard(block, **policy)
        fully_shard(net, **policy)
        optimizer = (
            self.adamw(net.parameters())
            if not offload
            else torch.optim.AdamW(net.parameters(), lr=1e-4)
        )  # (offloaded parameters live on the host: no fused CUDA kernel)

        def step() -> None:
            with self.autocast():
                loss = _loss(net(self.x), self.y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step


def _pairs(bench: _Bench) -> list[tuple[str, str, Callable[[], Step], Callable[[], Step]]]:
    """(tessera row, anchor row, tessera builder, anchor builder), in the order they run."""
    t = bench.tessera
    return [
        ("single", "plain loop", lambda: t("single"), bench.plain),
        ("ddp", "plain loop", lambda: t("ddp"), bench.plain),
        ("zero2", "plain loop", lambda: t("zero2"), bench.plain),
        ("single --compile", "plain loop compiled", lambda: t("single", True),
         lambda: bench.plain(True)),
        ("ddp", "torch DDP", lambda: t("ddp"), lambda: t("torch-ddp")),
        ("zero3", "FSDP2", lambda: t("zero3"), bench.fsdp2),
        ("single fp16", "single bf16", lambda: t("single", precision="fp16"),
         lambda: t("single")),
    ]  # fmt: skip


def _offload_pairs(bench: _Bench) -> list[tuple[str, str, Callable[[], Step], Callable[[], Step]]]:
    """ZeRO-Offload from GPU memory against the same stage without it, and against FSDP2's; with
    the delayed parameter update (the host step beside the next forward and backward, after 2
    warm-up steps: the timed steps are delayed ones) too, and with bf16 moments: the host step
    streams 28 bytes a parameter through host memory (20 with bf16 moments), which bounds it
    once the delayed update hides it behind the device's work."""
    from tessera.zero import OffloadPolicy

    t = bench.tessera
    return [
        ("zero2 offload=cpu", "zero2", lambda: t("zero2", offload="cpu"), lambda: t("zero2")),
        ("zero2 offload=cpu delayed", "zero2",
         lambda: t("zero2", offload=OffloadPolicy(delayed_update=True, delayed_update_after=2)),
         lambda: t("zero2")),
        ("zero2 offload=cpu delayed, bf16 moments", "zero2",
         lambda: t("zero2", offload=OffloadPolicy(delayed_update=True, delayed_update_after=2,
                                                  moments="bf16")),
         lambda: t("zero2")),
        ("zero3 offload=cpu", "zero3", lambda: t("zero3", offload="cpu"), lambda: t("zero3")),
        ("zero3 offload=cpu", "FSDP2 CPUOffloadPolicy", lambda: t("zero3", offload="cpu"),
         lambda: bench.fsdp2(offload=True)),
        ("zero3 offload=cpu delayed", "zero3",
         lambda: t("zero3", offload=OffloadPolicy(delayed_update=True, delayed_update_after=2)),
         lambda: t("zero3")),
        ("zero3 offload=cpu delayed", "FSDP2 CPUOffloadPolicy",
         lambda: t("zero3", offload=OffloadPolicy(delayed_update=True, delayed_update_after=2)),
         lambda: bench.fsdp2(offload=True)),
        # (bf16 moments against FSDP2's fp32 ones: less memory traffic, not the same arithmetic)
        ("zero3 offload=cpu delayed, bf16 moments", "FSDP2 CPUOffloadPolicy",
         lambda: t("zero3", offload=OffloadPolicy(delayed_update=True, delayed_update_after=2,
                                                  moments="bf16")),
         lambda: bench.fsdp2(offload=True)),
    ]  # fmt: skip


def _pair_row(bench: _Bench, pair: tuple, steps: int, blocks: int) -> dict[str, Any]:
    ours, anchor, build_ours, build_anchor = pair
    row: dict[str, Any] = {"tessera": ours, "anchor": anchor}
    try:
        mine, theirs = build_ours(), build_anchor()
        for fn in (mine, theirs):  # warm-up: allocator, communicators, compilation
            _timed(fn, 2, bench.device)
        ours_s, anchor_s = [], []
        for block in range(blocks):  # ABBA: each side runs first in every other block
            if block % 2 == 0:
                ours_s.append(_timed(mine, steps, bench.device))
            anchor_s.append(_timed(theirs, steps, bench.device))
            if block % 2 == 1:
                ours_s.append(_timed(mine, steps, bench.device))
    except Exception as exc:  # noqa: BLE001 - recorded: the check goes on with the next pair
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    finally:
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    row["tessera_step_s"] = statistics.median(ours_s)
    row["anchor_step_s"] = statistics.median(anchor_s)
    return row


def _offload_parts(bench: _Bench, repeats: int = 5) -> list[dict[str, Any]]:
    """The parts of an offload step, each timed alone at the size of one rank's partition of the
    offload model (its trainable parameters over the ranks): CPUAdam's host step on bf16
    gradients, writing the bf16 copy that goes up (fp32 and bf16 moments), and the copies of a
    bf16 partition down and up between the device and pinned host memory. Medians of
    `repeats`; `bytes_per_param`: what each touches in memory, for the rate."""
    from tessera.optim import CPUAdam

    numel = sum(p.numel() for p in bench.model().parameters()) // bench.ctx.world_size
    pinned = bench.device.type == "cuda"
    rows = []
    param = torch.nn.Parameter(torch.randn(numel))
    grad = torch.randn(numel).bfloat16()
    out = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pinned)
    for moments, per_param in (("fp32", 28), ("bf16", 20)):
        adam = CPUAdam([param], lr=1e-5, bf16_moments=moments == "bf16")
        step = lambda adam=adam: adam.step(grads=[grad], bf16_out=[out])  # noqa: E731
        row = {"part": f"host step, CPUAdam, {moments} moments", "numel": numel}
        row.update(seconds=_timed(step, repeats, torch.device("cpu")), bytes_per_param=per_param)
        row["threads"] = torch.get_num_threads()
        rows.append(row)
        del adam
    # The host's memory bandwidth as torch's own kernels reach it, for the rates above: CPUAdam
    # is bound by it (BENCHMARKS cpu_adam: the same yardstick on this project's CPU).
    left, right = torch.ones(numel), torch.ones(numel)
    seconds = _timed(lambda: left.add_(right), repeats, torch.device("cpu"))
    rows.append({"part": "yardstick: in-place add of two fp32 tensors on the host",
                 "numel": numel, "seconds": seconds, "bytes_per_param": 12,
                 "threads": torch.get_num_threads()})  # fmt: skip
    device_copy = torch.empty(numel, dtype=torch.bfloat16, device=bench.device)
    for name, fn in (
        ("download, device to pinned host", lambda: out.copy_(device_copy, non_blocking=True)),
        ("upload, pinned host to device", lambda: device_copy.copy_(out, non_blocking=True)),
    ):
        seconds = _timed(fn, repeats, bench.device)
        rows.append({"part": name, "numel": numel, "seconds": seconds, "bytes_per_param": 2})
    return rows  # (the buffers go with this frame, before the engines of _offload_halves)


def _offload_halves(bench: _Bench, repeats: int) -> list[dict[str, Any]]:
    """A zero2 offload step split into its two calls, each fenced by a device synchronisation:
    `train_step` (forward, backward, the downloads) and `step` (the host step and the uploads;
    under the delayed update, the wait for the step launched one call before, which ran beside
    the train_step).

    The delayed update once more with its background step on one thread fewer than the host's
    (the worker takes the thread count set when the engine is made): there the training thread,
    launching the next forward and backward and spinning in the device's waits, shares the cores
    with CPUAdam's OpenMP team. On 2 CPU cores beside one busy process, 20M parameters, one
    thread stepped in 20.5 ms against 23.5 for two (two: 15 against 19 ms alone)."""
    from tessera.zero import OffloadPolicy

    rows = []
    delayed = OffloadPolicy(delayed_update=True, delayed_update_after=2)
    threads = torch.get_num_threads()
    fewer = max(1, threads - 1)
    variants = [("offload=cpu", "cpu", threads), ("offload=cpu delayed", delayed, threads)]
    if fewer < threads:
        name = f"offload=cpu delayed, host step on {fewer} of {threads} threads"
        variants.append((name, delayed, fewer))
    for name, offload, host_threads in variants:
        torch.set_num_threads(host_threads)
        try:
            engine = tessera.setup(
                bench.model(), bench.adamw, strategy="zero2", loss_fn=_loss, offload=offload,
                precision="bf16" if bench.dtype is not None else "fp32",
            )  # fmt: skip
        finally:
            torch.set_num_threads(threads)
        halves: dict[str, Step] = {
            "train_step": lambda engine=engine: engine.train_step((bench.x, bench.y)),
            "step": engine.step,
        }
        times: dict[str, list[float]] = {half: [] for half in halves}
        for index in range(3 + repeats):  # (3 unmeasured: the delayed update's warm-up is 2)
            for half, fn in halves.items():
                _sync(bench.device)
                began = time.perf_counter()
                fn()
                _sync(bench.device)
                if index >= 3:
                    times[half].append(time.perf_counter() - began)
        for half, values in times.items():
            rows.append({"part": f"zero2 {name}: `{half}`", "seconds": statistics.median(values)})
        engine.close()
        torch.set_num_threads(threads)  # (a worker's own setting is the process's too)
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _all_reduce_rows(device: torch.device, steps: int) -> list[dict[str, Any]]:
    rows = []
    for size_mb in SIZES_MB:
        x = torch.ones(size_mb * 2**18, device=device)
        rows.append(
            {
                "size_mb": size_mb,
                "native_s": _timed(lambda x=x: dist.all_reduce(x), steps, device),
                "auto_s": _timed(lambda x=x: comm.all_reduce(x, algorithm="auto"), steps, device),
                "ring_s": _timed(lambda x=x: comm.all_reduce(x, algorithm="ring"), steps, device),
            }
        )
    return rows


def _host() -> dict[str, Any]:
    """The host the offload step runs on: its CPU, cores, threads, NUMA nodes and transparent
    huge pages (the host step is bound by this machine's memory bandwidth, not the GPU's)."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    models = [line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo").splitlines()
              if line.startswith("model name")]  # fmt: skip
    nodes = [n for n in Path("/sys/devices/system/node").glob("node[0-9]*")]
    huge = read("/sys/kernel/mm/transparent_hugepage/enabled").strip()
    return {
        "cpu": models[0] if models else "unknown",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "numa_nodes": len(nodes) or None,
        "transparent_huge_pages": huge or None,
    }


def _rank(cpu: bool, steps: int, blocks: int, batch: int) -> dict[str, Any]:
    bench = _Bench(cpu, batch)
    cuda = bench.device.type == "cuda"
    name = f"{torch.cuda.get_device_name()} (NCCL)" if cuda else "CPU (gloo, --cpu)"
    result: dict[str, Any] = {"world": bench.ctx.world_size, "device": name}
    result["torch"] = torch.__version__
    result["host"] = _host()
    result["precision"] = "bf16 autocast, fused AdamW" if cuda else "fp32, AdamW"
    result["shape"] = {**bench.shape, "batch": batch}
    partial = RESULTS / f"{'gpu-cpu' if cpu else 'gpu'}{PARTIAL_SUFFIX}"

    def save() -> None:  # what is measured so far, should the run be stopped at its time limit
        if bench.ctx.rank == 0:
            RESULTS.mkdir(parents=True, exist_ok=True)
            scratch = partial.with_suffix(".tmp")
            scratch.write_text(json.dumps(result, indent=2))
            scratch.replace(partial)  # whole or not at all, should the run be stopped mid-write

    if bench.ctx.world_size > 1:
        result["all_reduce"] = _all_reduce_rows(bench.device, steps)
    # The offload rows first: the ones whose figures are still open (issue 30).
    offload_batch = batch if cpu else OFFLOAD_BATCH
    big = _Bench(cpu, offload_batch, None if cpu else OFFLOAD_SHAPE)  # GPT-2 medium on a GPU
    result["offload_shape"] = {**big.shape, "batch": offload_batch}
    result["offload"] = []
    for pair in _offload_pairs(big):
        result["offload"].append(_pair_row(big, pair, max(1, steps // 2), blocks))
        save()
    result["offload_parts"] = _offload_parts(big)
    save()
    result["offload_parts"] += _offload_halves(big, repeats=5)
    save()
    del big
    result["training"] = []
    for pair in _pairs(bench):
        result["training"].append(_pair_row(bench, pair, steps, blocks))
        save()
    return result


def _gpu_tests(log: str | None = None) -> str:
    """Run the `gpu` tests; their pytest summary line (skipped on a CPU-only machine). With
    `log`, the summary line of a run already made (`pytest ... | tee LOG`), not run again."""
    if log is not None:
        lines = [line for line in Path(log).read_text().splitlines() if line.strip()]
        return lines[-1] if lines else f"{log} is empty"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(
            [*command, *GPU_TESTS], cwd=ROOT, capture_output=True, text=True,
            timeout=TESTS_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"the gpu tests did not finish in {TESTS_TIMEOUT_S} s"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else f"pytest exited {done.returncode}: {done.stderr[-300:]}"


def _host_line(host: dict[str, Any] | None) -> str:
    """The host in one sentence (older results have none)."""
    if not host:
        return "Host: not recorded."
    nodes = host["numa_nodes"]
    return (
        f"Host: {host['cpu']}, {host['cpus']} CPUs, torch on {host['torch_threads']} threads, "
        f"{nodes if nodes else 'unknown'} NUMA node{'s' if nodes != 1 else ''}, transparent "
        f"huge pages `{host['transparent_huge_pages']}`."
    )


def _markdown(result: dict[str, Any]) -> str:
    shape = result["shape"]
    lines = [
        "## gpu",
        "",
        f"{result['world']} x {result['device']}, torch {result['torch']}; GPT "
        f"{shape['n_layer']} x {shape['n_embd']}, block {shape['block_size']}, batch "
        f"{shape['batch']} per rank, {result['precision']}. Medians; anchor time / tessera "
        "time (above 1: tessera faster). Written by `benchmarks/gpu.py` (`make gpu-check`).",
        "",
        _host_line(result.get("host")),
        "",
        f"gpu tests: `{result['gpu_tests']}`",
        "",
        "| tessera | anchor | tessera step | anchor step | ratio |",
        "|---|---|---|---|---|",
    ]
    for row in result["training"] + result["offload"]:
        if row is result["offload"][0]:
            big = result["offload_shape"]
            shape = f"GPT {big['n_layer']} x {big['n_embd']}, batch {big['batch']}"
            lines.append(f"| *offload: {shape}* | | | | |")
        if "error" in row:
            lines.append(f"| {row['tessera']} | {row['anchor']} | {row['error']} | | |")
            continue
        ours, theirs = row["tessera_step_s"], row["anchor_step_s"]
        lines.append(
            f"| {row['tessera']} | {row['anchor']} | {ours * 1e3:.1f} ms | "
            f"{theirs * 1e3:.1f} ms | {theirs / ours:.2f}x |"
        )
    parts = result.get("offload_parts", [])
    if parts:
        lines += ["", f"The offload step's parts alone, at the partition of one rank "
                  f"({parts[0]['numel'] / 1e6:.1f}M parameters), medians:", "",
                  "| part | time | memory touched |", "|---|---|---|"]  # fmt: skip
    for row in parts:
        touched = ""
        if "bytes_per_param" in row:
            rate = row["numel"] * row["bytes_per_param"] / row["seconds"] / 1e9
            threads = f", {row['threads']} threads" if "threads" in row else ""
            touched = f"{row['bytes_per_param']} B/param: {rate:.1f} GB/s{threads}"
        lines.append(f"| {row['part']} | {row['seconds'] * 1e3:.1f} ms | {touched} |")
    for row in result.get("all_reduce", []):
        lines.append(
            f"\nall_reduce {row['size_mb']} MB: NCCL {row['native_s'] * 1e3:.3f} ms, tessera auto "
            f"{row['native_s'] / row['auto_s']:.2f}x, ring {row['native_s'] / row['ring_s']:.2f}x"
        )
    return "\n".join(lines) + "\n"


def _write_section(markdown: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    """Replace BENCHMARKS.md's `## gpu` section (up to the next `## `), or append one."""
    text = path.read_text()
    start = text.find("\n## gpu\n")
    if start < 0:
        path.write_text(text.rstrip("\n") + "\n\n" + markdown)
        return
    end = text.find("\n## ", start + 1)
    rest = text[end:] if end >= 0 else "\n"
    path.write_text(text[: start + 1] + markdown + rest)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run the GPU check (or, with --cpu, the same code tiny on the CPU)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", "--dry", action="store_true", help="tiny, on the CPU: does it run")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--tests-log", help="the gpu tests' log of a run already made: not rerun")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device here: run it on a GPU host, or --cpu to check that it runs")
        return None
    steps, blocks = (1, 2) if args.cpu else ((5, 2) if args.quick else (8, 4))
    world = 1 if args.cpu else torch.cuda.device_count()
    env = {"TESSERA_BACKEND": "gloo"} if args.cpu else None
    started = time.perf_counter()
    gpu_tests = _gpu_tests(args.tests_log)
    result = tessera.launch(
        _rank, world, args.cpu, steps, blocks, 4 if args.cpu else TRAIN_BATCH, env=env
    )[0]
    result["gpu_tests"] = gpu_tests
    result["seconds"] = round(time.perf_counter() - started, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "gpu-cpu" if args.cpu else "gpu"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"{name}{PARTIAL_SUFFIX}").unlink(missing_ok=True)
    markdown = _markdown(result)
    if not args.cpu:
        (RESULTS / "gpu.md").write_text(markdown)
        _write_section(markdown)
    print(markdown + f"\n({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
