"""Launch and init: return values, rank failures, silent deaths, timeouts, torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import tessera
from tessera.errors import LaunchTimeout, RankFailedError


def _allreduce_ranks(offset: float) -> tuple:
    ctx = tessera.init()
    value = torch.tensor([ctx.rank + offset])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend, str(ctx.device), value.item()


def test_launch_returns_every_rank_value_in_order(run_ranks):
    results = run_ranks(_allreduce_ranks, 3, 10.0)
    assert [r[:5] for r in results] == [(r, 3, r, "gloo", "cpu") for r in range(3)]
    assert all(r[5] == 0 + 1 + 2 + 3 * 10.0 for r in results)


def _rank_one_raises() -> None:
    ctx = tessera.init()
    if ctx.rank == 1:
        raise RuntimeError("rank one gives up")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here, waiting for rank 1 forever


def test_failing_rank_is_named_and_others_are_stopped(run_ranks):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_rank_one_raises, 2)
    assert info.value.rank == 1
    assert "rank 1 failed: RuntimeError: rank one gives up" in str(info.value)
    assert "_rank_one_raises" in info.value.remote_traceback
    assert time.monotonic() - started < 30  # rank 0 was stopped, not left to its 300 s timeout


def _rank_zero_dies() -> None:
    ctx = tessera.init()
    if ctx.rank == 0:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_rank_dying_without_a_word_is_reported(run_ranks):
    with pytest.raises(RankFailedError, match="rank 0 failed: process exited with code 3"):
        run_ranks(_rank_zero_dies, 2)


def _rank_one_hangs() -> None:
    ctx = tessera.init()
    if ctx.rank == 1:
        time.sleep(600)


def test_launch_deadline_names_unfinished_ranks(run_ranks):
    with pytest.raises(LaunchTimeout) as info:
        # The deadline must outlast starting both ranks (about 2 s each; 12 s was once too
        # short on a 2-core machine running three tests at a time: both ranks were still in
        # init), so that only the hanging rank is unfinished when it expires.
        run_ranks(_rank_one_hangs, 2, deadline_s=30)
    assert info.value.unfinished_ranks == [1]


def _collective_with_absent_peer() -> None:
    ctx = tessera.init(timeout_s=2)
    if ctx.rank == 1:
        time.sleep(30)  # never joins the all_reduce
        return
    dist.all_reduce(torch.ones(1))


def test_blocking_collective_times_out_with_the_group_timeout(run_ranks):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_collective_with_absent_peer, 2)
    assert info.value.rank == 0
    assert time.monotonic() - started < 25  # the 2 s group timeout fired, not the 30 s sleep


def test_init_in_a_plain_process_is_a_world_of_one():
    script = textwrap.dedent(
        """
        import json, tessera, torch, torch.distributed as dist
        import os
        from tessera.comm.api import _timeout
        from tessera.runtime import current_context
        ctx = tessera.init(timeout_s=7.5)  # the bound travels in the Context, not os.environ
        t = torch.tensor([5.0]); dist.all_reduce(t)
        print(json.dumps([ctx.rank, ctx.world_size, ctx.backend, t.item(), ctx.timeout_s,
                          _timeout(None), "TESSERA_TIMEOUT_S" in os.environ,
                          current_context() is ctx is tessera.init()]))
        tessera.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.pop("TESSERA_TIMEOUT_S", None)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    reported = json.loads(out.stdout.strip().splitlines()[-1])
    assert reported == [0, 1, "gloo", 5.0, 7.5, 7.5, False, True]


def test_init_under_tessera_run_matches_the_launcher(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(
        textwrap.dedent(
            f"""
        import json, tessera, torch, torch.distributed as dist
        ctx = tessera.init()
        t = torch.tensor([float(ctx.rank)]); dist.all_reduce(t)
        with open(r"{tmp_path}/rank" + str(ctx.rank) + ".json", "w") as f:
            json.dump([ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend, t.item()], f)
        tessera.shutdown()
        """
        )
    )
    subprocess.run(
        [sys.executable, "-m", "tessera", "run", "-n", "2", str(script)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports == [[r, 2, r, "gloo", 1.0] for r in range(2)]


def test_fork_start_method_runs_functions_defined_anywhere():
    scale = 3.0

    def local_function() -> float:  # not importable by name: only fork can run it
        ctx = tessera.init()
        value = torch.tensor([ctx.rank * scale])
        dist.all_reduce(value)
        return value.item()

    assert tessera.launch(local_function, 2, start_method="fork", deadline_s=60) == [3.0, 3.0]
    with pytest.raises(ValueError, match="start_method must be"):
        tessera.launch(local_function, 2, start_method="thread")


def test_every_module_takes_its_timeout_from_one_source(monkeypatch):
    import re
    from pathlib import Path

    from tessera.comm.api import _timeout as comm_timeout
    from tessera.runtime.context import DEFAULT_TIMEOUT_S, default_timeout_s

    monkeypatch.delenv("TESSERA_TIMEOUT_S", raising=False)
    assert default_timeout_s() == DEFAULT_TIMEOUT_S == 300.0
    monkeypatch.setenv("TESSERA_TIMEOUT_S", "7.5")
    assert default_timeout_s() == comm_timeout(None) == 7.5
    for bad in ("abc", "0", "-3", "nan", "inf"):  # once read as 300 s, a crash, or no bound
        monkeypatch.setenv("TESSERA_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=f"TESSERA_TIMEOUT_S='{bad}' is not a positive"):
            default_timeout_s()
    # ...and no other module reads the variable itself (ddp, zero, pipeline, wavefront, ...)
    package = Path(tessera.__file__).parent
    readers = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(r"\benviron\b[^\n]*(TESSERA_TIMEOUT_S|TIMEOUT_VARIABLE)", path.read_text())
    ]
    assert readers == ["runtime/context.py"]


def test_the_context_timeout_bounds_waits_as_a_value(monkeypatch):
    # A wait takes its bound from the Context it was built with, never from the environment
    # (which says 3 s here): past 0.05 s it raises naming the rank and the operation.
    import threading
    from concurrent.futures import Future

    from tessera.errors import CollectiveTimeout
    from tessera.runtime.context import Context
    from tessera.runtime.wait import wait_or_raise
    from tessera.zero.delayed import DelayedUpdate

    monkeypatch.setenv("TESSERA_TIMEOUT_S", "3")
    environment = dict(os.environ)
    ctx = Context(rank=5, world_size=8, local_rank=1, local_world_size=4,
                  device=torch.device("cpu"), backend="gloo", timeout_s=0.05)  # fmt: skip
    release = threading.Event()
    delayed = DelayedUpdate(after=0, rank=ctx.rank, timeout_s=ctx.timeout_s)
    delayed.launch(release.wait)  # a background step that never finishes
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"^rank 5: the delayed \(background\) optimizer "
                       r"step did not complete within 0.05 s; the host"):  # fmt: skip
        delayed.wait()
    with pytest.raises(CollectiveTimeout, match=r"^rank 5: all_gather of unit 2 did not complete "
                       r"within 0.05 s; another rank has not reached"):  # fmt: skip
        wait_or_raise(Future(), "all_gather of unit 2", ctx.timeout_s, ctx.rank)
    assert time.monotonic() - started < 2.5
    release.set()
    # a task that timed out itself keeps its own, more precise error (its peer named)
    inner = Future()
    inner.set_exception(CollectiveTimeout(5, "recv from rank 2", 1.0, "rank 2 stopped"))
    with pytest.raises(CollectiveTimeout, match="recv from rank 2 did not complete within 1 s"):
        wait_or_raise(inner, "the step", ctx.timeout_s, ctx.rank)
    assert dict(os.environ) == environment


def test_ranks_are_spawned_when_variables_read_at_process_start_changed(monkeypatch):
    # A forked rank cannot take MALLOC_* / OMP_* / LD_PRELOAD from its environment any more:
    # glibc, OpenMP and the loader read them when the process started. Such a launch spawns.
    import importlib

    spawner = importlib.import_module("tessera.runtime.spawner")
    monkeypatch.setattr(spawner, "_server_environment", spawner._start_variables())
    assert spawner.process_context().get_start_method() == "forkserver"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert spawner.process_context().get_start_method() == "spawn"
    assert spawner.process_context("fork").get_start_method() == "fork"


def _sleep_then_report(seconds: float) -> float:
    ctx = tessera.init()
    time.sleep(seconds)
    return ctx.timeout_s


def test_launch_timeout_is_the_per_wait_bound_not_a_run_deadline():
    # timeout_s reaches every rank as the bound of each wait; a run longer than it is not
    # stopped (before, launch's timeout_s was a whole-run deadline that killed it).
    bounds = tessera.launch(_sleep_then_report, 2, 3.0, timeout_s=1.5, deadline_s=120)
    assert bounds == [1.5, 1.5]
    with pytest.raises(ValueError, match="deadline_s"):
        tessera.launch(_sleep_then_report, 1, 0.0, deadline_s=0)
