"""`tessera run` hands a script its arguments untouched; `tessera train` under it uses its world."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TINY = (
    "--n-layer 1 --n-embd 16 --n-head 2 --block-size 16 --batch-size 4 --corpus-bytes 20000 "
    "--sample-tokens 0 --no-progress --steps 2"
).split()
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _tessera(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tessera", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )


@pytest.mark.parametrize(
    ("argv", "own", "rest"),
    [
        (["-n", "2", "s.py", "--nproc", "4"], ["-n", "2"], ["s.py", "--nproc", "4"]),
        (["-m", "tessera", "train", "-n", "3"], ["-m"], ["tessera", "train", "-n", "3"]),
        (
            ["--nnodes=2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "-m", "x", "--", "y"],
            ["--nnodes=2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "-m"],
            ["x", "--", "y"],
        ),
        (["-n", "1", "--", "-odd-name.py", "-v"], ["-n", "1"], ["-odd-name.py", "-v"]),
        (["-n", "1"], ["-n", "1"], []),
    ],
)
def test_run_command_line_is_cut_at_the_script(argv, own, rest):
    from tessera.cli import _split_at_script

    assert _split_at_script(argv) == (own, rest)


def test_run_hands_script_and_module_their_arguments_untouched(tmp_path):
    # Words that torchrun's parser (or tessera run's) would take for its own options:
    # --nproc abbreviates --nproc-per-node, -m and --nnodes are options of both.
    words = ["--nproc", "4", "--nnodes", "x", "-m", "--rdzv-endpoint", "--", "-n"]
    echo = (
        "import json, os, sys\n"
        "name = 'rank' + os.environ['RANK'] + '-' + os.path.basename(sys.argv[0]) + '.json'\n"
        "open(name, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    (tmp_path / "echo_script.py").write_text(echo)
    (tmp_path / "echo_module.py").write_text(echo)
    for form in (["echo_script.py"], ["-m", "echo_module"]):
        out = _tessera("run", "-n", "1", *form, *words, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    for file in ("echo_script.py", "echo_module.py"):
        assert json.loads((tmp_path / f"rank0-{file}.json").read_text()) == words


def test_train_under_tessera_run_takes_the_world_it_is_given(tmp_path):
    # --nproc left out: the world is what tessera run started (here one process), so the
    # one-process strategy runs; it used to be checked against --nproc's default of 2.
    command = ["run", "-n", "1", "-m", "tessera", "train", "--strategy", "single"]
    ok = _tessera(*command, *TINY, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "single on 1 rank" in ok.stdout
    # --nproc given and different from -n: refused before training, with one message
    bad = _tessera("run", "-n", "2", "-m", "tessera", "train", "--nproc", "3", *TINY, cwd=tmp_path)
    assert bad.returncode != 0
    assert bad.stderr.count("tessera: error: ") == 1, bad.stderr
    assert "--nproc 3 disagrees with the 2 processes per node" in bad.stderr


def test_bench_runs_the_benchmark_scripts_of_the_checkout(capfd):
    # `tessera bench comm [ARGS]` is `python benchmarks/comm.py [ARGS]`: its options are the
    # all-reduce benchmark's, and `gather` hands the rest to the gather benchmark beside it
    from tessera.cli import main

    assert main(["bench", "comm", "--help"]) == 0
    allreduce = capfd.readouterr().out
    assert main(["bench", "comm", "gather", "--help"]) == 0
    gather = capfd.readouterr().out
    assert "--quick" in allreduce and "--sizes" not in allreduce, allreduce
    assert "--sizes" in gather and "--quick" not in gather, gather


def test_bench_without_the_benchmark_scripts_says_where_to_find_them(monkeypatch, tmp_path, capsys):
    from tessera import cli

    monkeypatch.setattr(cli, "BENCHMARKS", tmp_path)  # an installed wheel: no benchmarks/ folder
    assert cli.main(["bench", "comm", "--quick"]) == 2
    error = capsys.readouterr().err
    assert str(tmp_path / "comm.py") in error and "python benchmarks/comm.py" in error, error


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_config_error_is_printed_by_local_rank_0_at_once_and_by_another_after_a_grace(
    local_rank, monkeypatch, capsys
):
    """Under torchrun every worker validates the same config. Rank 1 used to exit at once and
    silently: torchrun then stopped rank 0 before it printed, and the user saw no reason (a
    flaky `tessera run -n 2 ... --nproc 3` above). Now rank 0 prints at once; another rank holds
    back for the grace, within which torchrun stops it when rank 0 failed alike, and prints
    only if it outlives it (an error of its own)."""
    import tessera.cli as cli

    slept: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert cli.main(["train", "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.count("tessera: error: batch_size must be at least 1") == 1
    assert slept == ([] if local_rank == "0" else [cli.CONFIG_ERROR_GRACE_S])


@pytest.mark.parametrize(
    ("flags", "backend"),
    [
        (["--nnodes", "2"], "static"),  # a fixed world run once: nothing polls the store
        (["--nnodes", "1:2"], "c10d"),  # elastic: the nodes meet again
        (["--nnodes", "2", "--max-restarts", "1"], "c10d"),  # restarts: the nodes meet again
        (["--nnodes", "2", "--rdzv-backend", "c10d"], "c10d"),  # the user's choice is kept
    ],
)
def test_tessera_run_picks_a_rendezvous_that_ends_cleanly(flags, backend, monkeypatch):
    """Under c10d a node whose workers were still exiting failed on the store of the node that
    hosted it and had finished (`RendezvousConnectionError` after a good run: a flaky
    two-node README test); a fixed --nnodes without restarts takes the static rendezvous."""
    from torch.distributed import run as torchrun

    import tessera.cli as cli

    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    argv = ["run", *flags, "--node-rank", "1", "--rdzv-endpoint", "h:1", "-m", "x", "y"]
    assert cli.main(argv) == 0
    (args,) = seen
    assert (args.rdzv_backend, args.rdzv_endpoint, args.node_rank) == (backend, "h:1", 1)
    assert (args.training_script, args.training_script_args) == ("x", ["y"])
