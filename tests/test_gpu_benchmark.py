"""`benchmarks/gpu.py --cpu` runs: the GPU check's own code, tiny on the CPU.

A GPU session has minutes of device time and one call to spend them. A script that crashes
there, on a row the CPU could have run, loses the whole call. So the suite runs the script as
the README gives it (`--cpu`: the same rows, a two-layer model, gloo), into a folder of its
own, and checks what it wrote: every pair measured on both sides except FSDP2's CPU offload
(it needs an accelerator), the offload step's parts and split steps (the delayed update also on
one thread fewer where there are two), the host named, the partial results removed, and
BENCHMARKS.md left alone (`--cpu` timings say nothing about a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_row_on_the_cpu(tmp_path):
    benchmarks_md = (ROOT / "BENCHMARKS.md").read_text()
    env = {**os.environ, "TESSERA_BENCH_RESULTS": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert not list(tmp_path.glob("*partial*")), "the partial results outlived the run"
    assert (ROOT / "BENCHMARKS.md").read_text() == benchmarks_md

    pairs = result["training"] + result["offload"]
    assert len(result["training"]) == 7 and len(result["offload"]) == 8
    for row in pairs:
        if "error" in row:  # FSDP2's CPUOffloadPolicy moves state to an accelerator
            assert row["anchor"] == "FSDP2 CPUOffloadPolicy", row
            assert "accelerator" in row["error"], row
            continue
        assert row["tessera_step_s"] > 0 and row["anchor_step_s"] > 0, row
    assert sum("error" not in row for row in result["offload"]) == 5

    parts = {row["part"]: row for row in result["offload_parts"]}
    threads = result["host"]["torch_threads"]
    expected = ["host step, CPUAdam, fp32 moments", "host step, CPUAdam, bf16 moments",
                "yardstick: in-place add of two fp32 tensors on the host",
                "download, device to pinned host", "upload, pinned host to device"]  # fmt: skip
    variants = ["offload=cpu", "offload=cpu delayed"]
    if threads > 1:
        variants.append(f"offload=cpu delayed, host step on {threads - 1} of {threads} threads")
    expected += [f"zero2 {v}: `{half}`" for v in variants for half in ("train_step", "step")]
    assert sorted(parts) == sorted(expected)
    assert all(row["seconds"] > 0 for row in parts.values())
    assert result["host"]["cpus"] == os.cpu_count()
    assert "Host: " in done.stdout and result["gpu_tests"]
