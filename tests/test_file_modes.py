"""What a run and an export write: the modes a plain `open` gives, and no half export.

Checkpoints, shards, manifests, metrics and exports are written through temporary files
(`mkstemp`: mode 0600) renamed into place; a user sharing a run folder must get the mode any
other output gets under the umask (0644 under 022, 0600 under 077), not a private one. An
export another library writes by name (`save_file`, `save_pretrained`) goes the same way: a
process killed in the middle of it leaves nothing under the name a loader opens.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.cli import main

USER = ["--model", "user_workloads:mlp", "--data", "user_workloads:pairs",
        "--loss", "user_workloads:mse", "--batch-size", "8", "--no-progress"]  # fmt: skip


@pytest.fixture
def umask():
    """Set the process umask for the test (ranks inherit it), restore it after."""
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
        for p in [root, *root.rglob("*")]
        if not p.name.startswith(".")
    }


def test_run_and_export_files_get_the_umask_mode(tmp_path, umask):
    run = tmp_path / "run"
    args = ["train", "--strategy", "zero2", "--nproc", "1", "--steps", "2", "--out", str(run)]
    assert main([*args, *USER]) == 0  # zero2: shard files and a manifest beside state.pt
    assert main(["checkpoint", "export", str(run), str(tmp_path / "exported")]) == 0
    modes = {**_modes(run), **_modes(tmp_path / "exported")}
    files = [name for name in modes if (run / name).is_file() or name == "model.safetensors"]
    assert any(name.endswith("state.pt") for name in files), sorted(modes)
    assert any("shard" in name or "zero" in name for name in files), sorted(modes)
    for name in ("metrics.jsonl", "model.safetensors"):
        assert name in files, sorted(modes)
    wrong = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o644 if name in files else 0o755)
    }
    assert not wrong, wrong
    umask(0o077)  # the umask decides, not a fixed 0644
    assert main(["checkpoint", "export", str(run), str(tmp_path / "private.safetensors")]) == 0
    assert stat.S_IMODE((tmp_path / "private.safetensors").stat().st_mode) == 0o600


_EXPORT = """
import sys
from tessera.train.export import export_run
export_run(sys.argv[1], sys.argv[2], format="safetensors")
"""


def test_a_killed_export_leaves_no_half_file(tmp_path):
    """The export process is held after its weights are written but before the rename (the test
    hook of `tessera.checkpoint.atomic`) and killed there: the final name holds nothing, the
    previous export stays whole; unhindered, the export then completes."""
    run = tmp_path / "run"
    args = ["train", "--strategy", "single", "--nproc", "1", "--steps", "1", "--out", str(run)]
    assert main([*args, *USER]) == 0
    target = tmp_path / "model.safetensors"
    marker = tmp_path / "held"
    env = {
        **os.environ,
        "TESSERA_TEST_PAUSE": f"write:{target}",
        "TESSERA_TEST_PAUSE_MARKER": str(marker),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), str(Path(__file__).parent)]),
    }
    process = subprocess.Popen([sys.executable, "-c", _EXPORT, str(run), str(target)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert process.poll() is None, "the export ended before the pause point"
            assert time.monotonic() < deadline, "the export never reached its pause point"
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert not target.exists()  # held with the whole file written: still not under its name
    assert [p.name for p in tmp_path.glob(".model.safetensors.*.tmp")]  # beside it, hidden
    del env["TESSERA_TEST_PAUSE"]
    subprocess.run([sys.executable, "-c", _EXPORT, str(run), str(target)], env=env, check=True)
    weights = load_file(target)
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}, sorted(weights)
    assert all(torch.isfinite(t).all() for t in weights.values())
