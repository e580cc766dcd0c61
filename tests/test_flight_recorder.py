"""A rank that stops answering: the others time out naming it, and every rank leaves a record.

Three ranks; the last one skips a collective that the other two call, once per transport
(tessera's ring over point-to-point messages, tessera's shared-memory transport, gloo through
`tessera.comm` as "native", and gloo called directly through torch.distributed), each on its own
group with a short timeout. The live ranks must raise within the timeout, name rank 2, and write
`hang-rank-N.json` with their last collectives and the wait that failed; at the end the launcher
stops the job with SIGTERM, and the stuck rank, sleeping in Python, writes its record too. (gloo
names no rank when it times out: `flight_recorder.reached` marks points every rank passes, and
the error names the ranks that did not reach this rank's last one; the trainer marks each step.)
"""

from __future__ import annotations

import datetime
import json
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tessera
from tessera.comm import all_reduce, dump_on_failure, set_dump_dir
from tessera.errors import CollectiveTimeout, RankFailedError
from tessera.runtime.flight_recorder import install_signal_dump, reached
from tessera.train import build_config
from tessera.train.loop import train_worker

TIMEOUT_S = 1.0
KINDS = ("ring", "shm", "native", "gloo")
STUCK = 2


def _one_rank_stops(root: str) -> None:
    ctx = tessera.init()
    install_signal_dump()
    report: dict[str, dict] = {}
    for kind in KINDS:
        timeout = datetime.timedelta(seconds=TIMEOUT_S)  # gloo's own, for the direct call
        group = dist.new_group(list(range(ctx.world_size)), timeout=timeout)
        set_dump_dir(Path(root) / kind)
        x = torch.ones(7)
        algorithm = "native" if kind == "gloo" else kind
        all_reduce(x, algorithm=algorithm, group=group)  # every rank: history, shm segment
        if ctx.rank != STUCK:  # the stuck rank does not call the next one
            began = time.monotonic()
            try:
                with dump_on_failure():
                    if kind == "gloo":
                        reached("the direct gloo call")  # a point the stuck rank never reaches
                        dist.all_reduce(x, group=group)
                    else:
                        all_reduce(x, algorithm=algorithm, group=group, timeout=TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - reported to the test below
                error = f"{type(exc).__name__}: {exc}"
                report[kind] = {"error": error, "seconds": time.monotonic() - began}
        dist.barrier()  # the stuck rank "wakes up" once the others have given up
    reports: list[dict] = [{}] * ctx.world_size
    dist.all_gather_object(reports, report)
    set_dump_dir(Path(root) / "stopped")
    if ctx.rank == STUCK:
        time.sleep(120)  # hangs; the launcher's SIGTERM ends it (and its handler dumps)
    if ctx.rank == 0:  # ends the job: the launcher then stops every other rank
        raise RuntimeError("REPORT" + json.dumps(reports))


def _record(path: Path) -> dict:
    assert path.is_file(), f"no flight record {path}"
    return json.loads(path.read_text())


def test_a_rank_that_stops_is_named_and_every_rank_dumps(run_ranks, tmp_path):
    with pytest.raises(RankFailedError) as stopped:
        run_ranks(_one_rank_stops, 3, str(tmp_path), deadline_s=90)
    reports = json.loads(str(stopped.value).split("REPORT", 1)[1].splitlines()[0])
    for rank in (0, 1):
        for kind in KINDS:
            found = reports[rank][kind]
            # Reported within the timeout (plus the moment spent gathering who arrived).
            assert found["seconds"] < TIMEOUT_S + 5, (rank, kind, found)
            record = _record(tmp_path / kind / f"hang-rank-{rank}.json")
            assert record["rank"] == rank and record["world_size"] == 3
            last = record["collectives"][-1]
            assert set(last) >= {"seq", "kind", "algorithm", "op", "shape", "group_ranks"}
            assert last["shape"] == [7] and last["group_ranks"] == [0, 1, 2]
            assert record["stacks"], "the Python stacks of the rank's threads"
            if kind == "gloo":  # gloo's own timeout, named by the points the ranks reached
                named = "ranks [2] have not reached 'the direct gloo call' (stopped or hung?)"
                assert found["error"].startswith("CollectiveTimeout"), found
                assert named in found["error"] and "Timed out" in found["error"], found
                assert named in record["reason"]
                assert last["algorithm"] == "native"  # the last tessera collective, the warm-up
                continue
            # tessera's collectives name the rank that never arrived, and the record says so.
            assert f"have not reached collective #{last['seq']}" in found["error"], found
            assert "ranks [2]" in found["error"] and "flight record" in found["error"]
            assert last["algorithm"] == kind and last["kind"] == "all_reduce"
            waiting = record["waiting"]
            assert waiting["seq"] == last["seq"] and waiting["missing_ranks"] == [STUCK]
    # The stuck rank: no record from a timeout (it never waited), one from SIGTERM, whose last
    # collective is one before the one the others waited in.
    for kind in KINDS:
        assert not (tmp_path / kind / f"hang-rank-{STUCK}.json").exists()
    stuck = _record(tmp_path / "stopped" / f"hang-rank-{STUCK}.json")
    assert stuck["reason"].startswith("signal SIGTERM")
    assert "time.sleep(120)" in "".join(stuck["stacks"].values())
    live = _record(tmp_path / "native" / "hang-rank-0.json")
    assert stuck["collectives"][-1]["seq"] < live["collectives"][-1]["seq"]


def test_the_trainer_names_a_rank_stuck_in_a_save_and_dumps_into_its_run_folder(tmp_path):
    # Rank 0 holds inside its checkpoint write (the test hook of tessera.checkpoint.atomic); rank 1
    # waits at the checkpoint's barrier, a direct gloo call, until the run's 2 s timeout.
    config = build_config(
        {
            "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
            "batch_size": 4,
            "corpus_bytes": 20_000,
            "sample_tokens": 0,
            "progress": False,
            "strategy": "torch-ddp",
            "nproc": 2,
            "steps": 1,
            "timeout_s": 2.0,
            "out": str(tmp_path),
        }
    )
    hold = {"TESSERA_TEST_PAUSE": f"write:{tmp_path}/*state.pt"}
    with pytest.raises(RankFailedError) as failed:
        tessera.launch(train_worker, 2, config, str(tmp_path), False, env=hold, deadline_s=90)
    message = str(failed.value).splitlines()[0]
    assert message.startswith("rank 1 failed: CollectiveTimeout"), message
    assert "ranks [0] have not reached 'checkpoint of step 1: files written'" in message
    waiting = _record(tmp_path / "hang-rank-1.json")
    assert waiting["reason"].startswith("CollectiveTimeout") and waiting["rank"] == 1
    assert waiting["collectives"] == []  # torch DDP calls gloo itself: no tessera collective
    stuck = _record(tmp_path / "hang-rank-0.json")  # written on the launcher's SIGTERM
    assert stuck["reason"].startswith("signal SIGTERM")
    assert "pause_point" in "".join(stuck["stacks"].values())  # where it was stuck
    assert not list((tmp_path / "checkpoints").iterdir())[0].name.startswith("step-")


NATIVE_WAIT_S = 60.0
"""The stuck ranks' own timeouts: far beyond the test, so only a signal ends them."""


def _two_ranks_stuck_in_gloo(root: str) -> None:
    import os
    import signal

    from tessera.comm import set_checks

    ctx = tessera.init()
    install_signal_dump()
    set_dump_dir(root)
    set_checks(False)  # no descriptor exchange first: the wait is inside gloo's all_reduce
    long = datetime.timedelta(seconds=NATIVE_WAIT_S)
    with_1 = dist.new_group([0, 1], timeout=long)
    with_2 = dist.new_group([0, 2], timeout=long)
    pids: list[int] = [0] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    x = torch.ones(5)
    if ctx.rank == 1:  # through tessera.comm: gloo's all_reduce, then a native work.wait()
        all_reduce(x, algorithm="native", group=with_1, timeout=NATIVE_WAIT_S)
    elif ctx.rank == 2:  # torch.distributed directly: gloo blocks inside C++
        dist.all_reduce(x, group=with_2)
    # Rank 0 never calls either, and stays alive (its connections open): the others stay stuck
    # in their native waits until it sends them SIGTERM, as a launcher would.
    time.sleep(3.0)
    for pid in pids[1:]:
        os.kill(pid, signal.SIGTERM)
    time.sleep(NATIVE_WAIT_S / 2)  # the launcher stops this rank once a stuck one has ended
    raise RuntimeError("the stuck ranks did not end on SIGTERM")


def test_a_rank_stuck_inside_a_gloo_collective_dumps_on_sigterm(run_ranks, tmp_path):
    with pytest.raises(RankFailedError) as ended:
        run_ranks(_two_ranks_stuck_in_gloo, 3, str(tmp_path), deadline_s=90)
    # The Python handler cannot run (the main threads never leave gloo): the watcher thread
    # writes each record while the main thread is still stuck (its stack says where), then
    # ends its rank by SIGTERM itself. (Before: the records came only once rank 0 gave up and
    # its exit broke the waits, NATIVE_WAIT_S / 2 later, from inside the Python handler.)
    message = str(ended.value).splitlines()[0]
    assert re.match(r"rank [12] failed: process exited with code -15 without reporting", message)
    through_tessera = _record(tmp_path / "hang-rank-1.json")
    assert through_tessera["reason"].startswith("signal SIGTERM")
    last = through_tessera["collectives"][-1]
    assert (last["kind"], last["algorithm"], last["shape"]) == ("all_reduce", "native", [5])
    assert last["group_ranks"] == [0, 1]
    waiting = through_tessera["waiting"]  # stuck in that very collective, since rank 0's signal
    assert waiting["seq"] == last["seq"] and waiting["waited_s"] < NATIVE_WAIT_S / 4, waiting
    main = _main_stack(through_tessera)
    assert "work.wait(" in main and "_on_signal" not in main, main
    direct = _record(tmp_path / "hang-rank-2.json")
    assert direct["reason"].startswith("signal SIGTERM")
    main = _main_stack(direct)
    assert "dist.all_reduce(x, group=with_2)" in main and "_on_signal" not in main, main


def _main_stack(record: dict) -> str:
    return next(stack for name, stack in record["stacks"].items() if name.startswith("MainThread"))


def _answer_usr1_then_fork(root: str) -> None:
    import os
    import signal
    import sys

    set_dump_dir(root)
    install_signal_dump()
    record = Path(root) / "hang-rank-0.json"
    os.kill(os.getpid(), signal.SIGUSR1)  # a question: answered, and the process goes on
    deadline = time.monotonic() + 20
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    answered = record.read_text()
    child = os.fork()
    if child == 0:  # a forked child (a data-loader worker) stopped by SIGTERM: only it ends
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(20)
        os._exit(3)  # not reached: SIGTERM ended it
    _, status = os.waitpid(child, 0)
    time.sleep(1.0)  # time for a wrongly woken watcher of this process to act
    assert os.waitstatus_to_exitcode(status) == -signal.SIGTERM
    assert record.read_text() == answered  # the child's record went nowhere new either
    sys.exit(0 if json.loads(answered)["reason"].startswith("signal SIGUSR1") else 5)


def test_sigusr1_is_answered_and_a_forked_childs_signal_does_not_reach_its_parent(tmp_path):
    import multiprocessing

    process = multiprocessing.get_context("fork").Process(
        target=_answer_usr1_then_fork, args=(str(tmp_path),)
    )
    process.start()
    process.join(60)
    assert process.exitcode == 0  # -15: the child's SIGTERM woke the parent's watcher


def _a_peer_gives_up_first() -> str:
    """Rank 1 never joins; rank 2 waits on it with a short timeout, then closes its connections
    (as a rank that gives up and exits does); rank 0, whose ring neighbour is rank 2, waits with a
    long timeout and sees gloo's "Connection closed by peer" long before its own deadline."""
    ctx = tessera.init()
    all_reduce(torch.ones(8), algorithm="ring")
    if ctx.rank == 1:
        time.sleep(2 * TIMEOUT_S + 1)  # alive, never reaching the next collective
        return ""
    start = time.monotonic()
    try:
        all_reduce(torch.ones(8), algorithm="ring", timeout=TIMEOUT_S if ctx.rank == 2 else 30.0)
    except CollectiveTimeout as exc:
        if ctx.rank == 2:
            dist.destroy_process_group()  # closes its connections, as an exiting rank does
        return f"{time.monotonic() - start:.2f} {exc}"
    return "completed"


def test_a_wait_cut_short_by_a_peer_that_gave_up_names_the_missing_rank():
    """The peer's closed connection is diagnosed like a timeout (the rank that never arrived
    is named), not reported as gloo's bare "Connection closed by peer"."""
    results = tessera.launch(_a_peer_gives_up_first, 3, deadline_s=60)
    for rank in (0, 2):
        message = results[rank].split(" ", 1)[1]
        assert "ranks [1] have not reached" in message, (rank, message)
    assert float(results[0].split()[0]) < 15.0, results[0]  # cut short by rank 2, not its 30 s
