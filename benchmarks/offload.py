"""How large a GPT trains under a resident-memory budget, without offload, with `cpu` and `nvme`;
and what activation checkpointing costs and saves on the 12-block GPT.

Part 1 (ZeRO-Offload / ZeRO-Infinity). Each trial is a fresh rank process (`tessera.launch`, one
rank) that builds a 12-block GPT of width C (in bf16, as a mixed-precision user would), wraps it
with `tessera.zero.initialize(stage=3, mixed_precision="bf16")` and `offload=None`, `"cpu"` or
`"nvme"` (`offload_params=True`: moments, fp32 masters and the parameter partition in files) and
trains 3 AdamW steps. The figure is the process's whole peak RSS (VmHWM, torch import, set-up and
steps included), against the budget. For each mode the widths are tried in increasing order until
one exceeds the budget. The nvme trial also reads its storage I/O (/proc/self/io) to report the
disk bandwidth used, against this machine's measured O_DIRECT bandwidth.

Part 2 (activation checkpointing). The 12-block GPT with and without `checkpoint_activations`:
activation memory as autograd's saved bytes (`tessera.memory.saved_activation_bytes`) and as the
peak RSS growth of a forward+backward in a fresh process, and step time (forward, backward, AdamW),
interleaved A B A B, medians and ratio.

    python benchmarks/offload.py [--budget-mb 1024] [--widths 256 384 512 640 768 1024 1280]

Writes benchmarks/results/offload.json and benchmarks/results/offload.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # large frees go back to the system
LAYERS, HEADS, BATCH, CONTEXT, VOCAB = 12, 8, 1, 64, 96


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _io_bytes() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _gpt(width: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    from tessera.models import GPT, GPTConfig

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=VOCAB, block_size=CONTEXT, n_layer=LAYERS, n_head=HEADS, n_embd=width
        )
        return GPT(config)
    finally:
        torch.set_default_dtype(previous)


def offload_trial(width: int, mode: str, nvme_dir: str) -> dict:
    """One rank: build, wrap, train 3 steps; peak RSS, step times, storage I/O."""
    import tessera
    from tessera.zero import initialize

    tessera.init()
    torch.set_num_threads(1)
    baseline_kib = _status_kib("VmRSS")
    model = _gpt(width)
    params = sum(p.numel() for p in model.parameters())
    extra = {}
    if mode == "nvme":
        extra = dict(nvme_dir=nvme_dir, nvme_buffer_mb=64, offload_params=True)
    offload = None if mode == "none" else mode
    model, optimizer = initialize(
        model, torch.optim.AdamW, stage=3, mixed_precision="bf16", offload=offload, **extra
    )
    generator = torch.Generator().manual_seed(0)
    times, io_before = [], _io_bytes()
    for step in range(3):
        idx = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator)
        began = time.perf_counter()
        optimizer.zero_grad()
        logits = model(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
        if step == 0:
            io_before, io_began = _io_bytes(), time.perf_counter()
    io_after, io_s = _io_bytes(), time.perf_counter() - io_began
    optimizer.remove_hooks()
    return {
        "width": width,
        "params": params,
        "mode": mode,
        "peak_rss_mb": _status_kib("VmHWM") / 1024,
        "baseline_rss_mb": baseline_kib / 1024,
        "step_s": statistics.median(times[1:]),
        "read_gb_s": (io_after[0] - io_before[0]) / io_s / 1e9,
        "write_gb_s": (io_after[1] - io_before[1]) / io_s / 1e9,
    }


def disk_bandwidth(folder: str, total_mb: int = 512, chunk_mb: int = 64) -> dict[str, float]:
    """This machine's O_DIRECT write and read bandwidth through tessera's SwapFile (GB/s)."""
    from tessera.optim.swap_files import SwapFolder, aligned_empty

    swap = SwapFolder(folder, purpose="bandwidth probe")
    chunk = aligned_empty(chunk_mb * 2**20 // 4, torch.float32).normal_()
    file = swap.file("probe.bin", total_mb * 2**20)
    count = total_mb // chunk_mb
    began = time.perf_counter()
    for index in range(count):
        file.write(index * chunk.numel() * 4, chunk)
    os.fsync(file._fd)
    write_s = time.perf_counter() - began
    began = time.perf_counter()
    for index in range(count):
        file.read(index * chunk.numel() * 4, chunk)
    read_s = time.perf_counter() - began
    swap.close()
    nbytes = count * chunk.numel() * 4
    return {
        "write_gb_s": nbytes / write_s / 1e9,
        "read_gb_s": nbytes / read_s / 1e9,
        "direct": file.direct,
    }


def largest_per_mode(budget_mb: float, widths: list[int], nvme_dir: str) -> dict:
    import tessera

    found: dict[str, dict] = {}
    trials = []
    for mode in ("none", "cpu", "nvme"):
        start = found["none"]["width"] if mode != "none" and "none" in found else widths[0]
        for width in [w for w in widths if w >= start]:  # offload fits at least what none fits
            result = tessera.launch(offload_trial, 1, width, mode, nvme_dir, deadline_s=1800)[0]
            result["fits"] = result["peak_rss_mb"] <= budget_mb
            trials.append(result)
            print(
                f"  {mode:5s} C={width:5d} {result['params'] / 1e6:7.1f} M params: peak RSS "
                f"{result['peak_rss_mb']:7.0f} MB, step {result['step_s']:.2f} s"
                f"{'' if result['fits'] else '  (over budget)'}",
                flush=True,
            )
            if not result["fits"]:
                break
            found[mode] = result
    return {"largest": found, "trials": trials}


def checkpointing_trial(checkpointed: bool, width: int, batch: int) -> dict:
    """Peak RSS growth of one forward+backward of the 12-block GPT (fresh process)."""
    from tessera.memory import checkpoint_activations

    torch.set_num_threads(1)
    model = _gpt(width, torch.float32)
    if checkpointed:
        checkpoint_activations(model)
    idx = torch.randint(0, VOCAB, (batch, CONTEXT), generator=torch.Generator().manual_seed(0))
    model(idx).float().square().mean().backward()  # warm-up: gradients allocated
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    model(idx).float().square().mean().backward()
    return {"peak_growth_mb": (_status_kib("VmHWM") - before) / 1024}


def checkpointing(width: int, batch: int, rounds: int) -> dict:
    import tessera
    from tessera.memory import checkpoint_activations, saved_activation_bytes

    torch.set_num_threads(1)
    models = {"plain": _gpt(width, torch.float32), "checkpointed": _gpt(width, torch.float32)}
    checkpoint_activations(models["checkpointed"])
    optimizers = {k: torch.optim.AdamW(m.parameters()) for k, m in models.items()}
    idx = torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=torch.Generator().manual_seed(1))
    saved = {}
    for name, model in models.items():
        _, found = saved_activation_bytes(
            lambda m=model: m(idx[:, :-1]).square().mean(), exclude=model.parameters()
        )
        saved[name] = found["host"] / 2**20
    times: dict[str, list[float]] = {k: [] for k in models}
    for round_index in range(rounds):
        order = list(models) if round_index % 2 == 0 else list(models)[::-1]
        for name in order:
            model, optimizer = models[name], optimizers[name]
            began = time.perf_counter()
            optimizer.zero_grad()
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            times[name].append(time.perf_counter() - began)
    rss = {
        name: tessera.launch(checkpointing_trial, 1, name == "checkpointed", width, batch)[0][
            "peak_growth_mb"
        ]
        for name in models
    }
    step = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {
        "width": width,
        "batch": batch,
        "context": CONTEXT,
        "saved_mb": saved,
        "rss_growth_mb": rss,
        "step_s": step,
        "memory_ratio_saved": saved["plain"] / saved["checkpointed"],
        "memory_ratio_rss": rss["plain"] / rss["checkpointed"],
        "time_ratio": step["checkpointed"] / step["plain"],
    }


def swap_trial(swapped: bool, width: int, nvme_dir: str) -> dict:
    """Whole-process peak RSS and time of forward+backward of the 12-block fp32 GPT, with its
    idle blocks' parameters in files (`swap_idle(keep=2)`) or not (fresh process each)."""
    from tessera.memory import swap_idle

    torch.set_num_threads(1)
    baseline = _status_kib("VmRSS") / 1024
    model = _gpt(width, torch.float32)
    swapper = swap_idle(model, keep=2, nvme_dir=nvme_dir) if swapped else None
    idx = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(3):
        began = time.perf_counter()
        model.zero_grad(set_to_none=False)
        model(idx).square().mean().backward()
        times.append(time.perf_counter() - began)
    resident = swapper.resident_bytes() / 2**20 if swapper else None
    peak = _status_kib("VmHWM") / 1024  # before close(), which brings every block back
    if swapper is not None:
        swapper.close()
    return {
        "peak_rss_mb": peak,
        "baseline_rss_mb": baseline,
        "step_s": statistics.median(times[1:]),
        "block_params_resident_after_backward_mb": resident,
        "param_mb": sum(p.numel() for p in model.parameters()) * 4 / 2**20,
    }


def swapping(width: int, nvme_dir: str) -> dict:
    import tessera

    return {
        "width": width,
        **{
            name: tessera.launch(swap_trial, 1, name == "swap_idle", width, nvme_dir)[0]
            for name in ("plain", "swap_idle")
        },
    }


def markdown(result: dict) -> str:
    budget, bandwidth = result["budget_mb"], result["disk"]
    largest = result["offload"]["largest"]
    lines = [
        f"### Largest 12-block GPT that trains with AdamW under a {budget:.0f} MB peak-RSS budget",
        "",
        "ZeRO-3, bf16 compute, fp32 AdamW state, 1 rank, batch 1 x 64 tokens; peak RSS of the "
        "whole process (torch import, set-up, 3 steps).",
        "",
        "| offload | width | parameters | peak RSS | step time | disk read / write used | target |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    base = largest.get("none", {}).get("params")
    for mode in ("none", "cpu", "nvme"):
        found = largest.get(mode)
        if found is None:
            lines.append(f"| {mode} | nothing fits | | | | | |")
            continue
        ratio = f" ({found['params'] / base:.1f}x none)" if base else ""
        disk = (
            f"{found['read_gb_s']:.2f} / {found['write_gb_s']:.2f} GB/s" if mode == "nvme" else "-"
        )
        target = ">= 4x none" if mode == "nvme" else ""
        lines.append(
            f"| {mode} | {found['width']} | {found['params'] / 1e6:.1f} M{ratio} | "
            f"{found['peak_rss_mb']:.0f} MB | {found['step_s']:.2f} s | {disk} | {target} |"
        )
    lines += [
        "",
        f"This machine's disk (O_DIRECT, 64 MB requests): write {bandwidth['write_gb_s']:.2f} GB/s,"
        f" read {bandwidth['read_gb_s']:.2f} GB/s. Every trial, fitting or not:",
        "",
        "| offload | width | parameters | peak RSS | step time |",
        "|---|---:|---:|---:|---:|",
    ]
    for trial in result["offload"]["trials"]:
        lines.append(
            f"| {trial['mode']} | {trial['width']} | {trial['params'] / 1e6:.1f} M | "
            f"{trial['peak_rss_mb']:.0f} MB{'' if trial['fits'] else ' (over)'} | "
            f"{trial['step_s']:.2f} s |"
        )
    ckpt = result["checkpointing"]
    lines += [
        "",
        f"### Activation checkpointing, 12-block GPT (width {ckpt['width']}, batch "
        f"{ckpt['batch']} x {ckpt['context']} tokens, fp32)",
        "",
        "| | activations saved by autograd | peak RSS growth of fwd+bwd | step time (median) |",
        "|---|---:|---:|---:|",
    ]
    for name in ("plain", "checkpointed"):
        lines.append(
            f"| {name} | {ckpt['saved_mb'][name]:.1f} MB | {ckpt['rss_growth_mb'][name]:.1f} MB | "
            f"{ckpt['step_s'][name] * 1e3:.0f} ms |"
        )
    lines += [
        f"| ratio (target) | {ckpt['memory_ratio_saved']:.1f}x less (>= 3x) | "
        f"{ckpt['memory_ratio_rss']:.1f}x less (>= 3x) | {ckpt['time_ratio']:.2f}x (<= 1.4x) |",
    ]
    swap = result.get("swapping")
    if swap:
        lines += [
            "",
            f"### swap_idle (GeePS), 12-block GPT width {swap['width']} (fp32, "
            f"{swap['plain']['param_mb']:.0f} MB of parameters), forward+backward, files on disk",
            "",
            "| | peak RSS (process) | step time (median) |",
            "|---|---:|---:|",
        ]
        for name in ("plain", "swap_idle"):
            lines.append(
                f"| {name} | {swap[name]['peak_rss_mb']:.0f} MB | {swap[name]['step_s']:.2f} s |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mb", type=float, default=1024.0)
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[256, 320, 384, 448, 512, 576, 640, 768, 896, 960, 1024, 1088, 1152, 1280],
    )
    parser.add_argument("--nvme-dir", default=None, help="folder for the swap files (a temp dir)")
    parser.add_argument("--ckpt-width", type=int, default=256)
    parser.add_argument("--ckpt-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--swap-width", type=int, default=768)
    args = parser.parse_args()
    # glibc reads this at process start: set here, inherited by every spawned rank, so freed
    # large blocks go back to the system and peak RSS measures what was live.
    os.environ.update(MALLOC_ENV)
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="tessera-offload-bench-")
    print("disk bandwidth ...", flush=True)
    disk = disk_bandwidth(nvme_dir)
    print(f"  {disk}", flush=True)
    print("activation checkpointing ...", flush=True)
    ckpt = checkpointing(args.ckpt_width, args.ckpt_batch, args.rounds)
    print(f"  {ckpt}", flush=True)
    print("swap_idle ...", flush=True)
    swap = swapping(args.swap_width, nvme_dir)
    print(f"  {swap}", flush=True)
    print(f"largest GPT under {args.budget_mb:.0f} MB ...", flush=True)
    offload = largest_per_mode(args.budget_mb, args.widths, nvme_dir)
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load": os.getloadavg(),
        },
        "budget_mb": args.budget_mb,
        "disk": disk,
        "offload": offload,
        "checkpointing": ckpt,
        "swapping": swap,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offload.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (RESULTS / "offload.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
