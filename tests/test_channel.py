"""Shared-memory pipeline links: the ring channel alone (threads and a forked peer, no process
group), then pipelines whose links run over it, against plain PyTorch."""

from __future__ import annotations

import copy
import glob
import multiprocessing
import os
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera
from tessera.comm.shm import files as shm_files
from tessera.comm.shm.channel import Endpoint, ring_available
from tessera.errors import CollectiveTimeout, PeerLostError
from tessera.pipeline import Pipeline

pytestmark = pytest.mark.skipif(not ring_available(), reason="no ordered shared memory here")


def _our_files() -> list[str]:
    return glob.glob(os.path.join(shm_files.SHM_DIR, f"tessera-*-{os.getpid()}-*"))


def _pair(slots: int, timeout_s: float = 20.0) -> tuple[Endpoint, Endpoint]:
    """Both ends of one link in this process (rank 0 creates, rank 1 joins)."""
    a = Endpoint(0, 1, creator=True, timeout_s=timeout_s, slots=slots)
    b = Endpoint(1, 0, creator=False, timeout_s=timeout_s, slots=slots)
    offer_a, offer_b = a.offer(), b.offer()
    assert a.connect(offer_b) and b.connect(offer_a)
    a.unlink()
    b.unlink()
    return a, b


def test_channel_keeps_order_grows_and_checks_what_it_receives():
    a, b = _pair(slots=3)
    assert _our_files() == []  # setup files exist only until both ends opened them
    messages = [torch.randn(i % 4 + 1, 5, dtype=torch.float64) for i in range(40)]
    big = torch.arange(100_000, dtype=torch.float32).reshape(1000, 100).t()  # not contiguous

    def produce():
        for i, tensor in enumerate(messages):  # 40 messages through 3 slots: wraps 13 times
            a.send(tensor, tag=i)
        a.send(big, tag=99)  # larger than the slots: the ring grows once drained

    thread = threading.Thread(target=produce)
    thread.start()
    for i, tensor in enumerate(messages):
        assert torch.equal(b.recv(tensor.shape, tensor.dtype, i), tensor), i
    assert torch.equal(b.recv((100, 1000), torch.float32, 99), big)
    thread.join()
    assert _our_files() == []  # the grown segment was unlinked once the consumer mapped it
    # out of order by tag: later messages read on the way are kept for their own receive
    b.send(torch.ones(2), tag=5)
    b.send(torch.zeros(3, dtype=torch.int64), tag=6)
    b.send(torch.tensor([True, False]), tag=7)
    assert torch.equal(a.recv((3,), torch.int64, 6), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(a.recv((2,), torch.bool, 7), torch.tensor([True, False]))
    assert torch.equal(a.recv((2,), torch.float32, 5), torch.ones(2))
    b.send(torch.ones(2, 3), tag=8)
    with pytest.raises(ValueError, match=r"receive of tag 8 from rank 1: expected \(3, 2\)"):
        a.recv((3, 2), torch.float32, 8)
    with pytest.raises(ValueError, match="cannot send a torch.complex128"):
        a.send(torch.zeros(2, dtype=torch.complex128), tag=9)
    a.close()
    b.close()


def test_full_ring_holds_the_sender_back_until_a_slot_frees_then_times_out_naming_the_peer():
    a, b = _pair(slots=2, timeout_s=30.0)
    for i in range(2):
        a.send(torch.full((4,), float(i)), tag=i)
    done = threading.Event()

    def third():
        a.send(torch.full((4,), 2.0), tag=2)
        done.set()

    thread = threading.Thread(target=third)
    thread.start()
    time.sleep(0.3)
    assert not done.is_set(), "a send overwrote a slot the receiver had not read"
    assert torch.equal(b.recv((4,), torch.float32, 0), torch.zeros(4))
    assert done.wait(20), "a freed slot did not wake the blocked sender"
    thread.join()
    for i in (1, 2):
        assert torch.equal(b.recv((4,), torch.float32, i), torch.full((4,), float(i)))
    # the ring full again and nobody reading: the deadline, naming both ranks and the operation
    a.timeout_s = b.timeout_s = 0.3
    a.send(torch.ones(4), tag=3)
    a.send(torch.ones(4), tag=4)
    with pytest.raises(CollectiveTimeout, match=r"rank 0: send of tag 5 to rank 1 .*within 0.3 s"):
        a.send(torch.ones(4), tag=5)
    with pytest.raises(CollectiveTimeout, match=r"rank 0: receive of tag 1 from rank 1"):
        a.recv((4,), torch.float32, 1)
    a.close()
    b.close()


def _peer(offer: str, pipe) -> None:
    """A forked peer: joins the link, sends one message, then dies without closing anything."""
    b = Endpoint(1, 0, creator=False, timeout_s=20.0, slots=2)
    pipe.send((b.offer(), b.connect(offer)))
    pipe.recv()  # the parent has connected
    b.send(torch.arange(3.0), tag=0)
    os._exit(0)


def test_a_peer_that_dies_is_reported_at_once_and_its_files_are_gone():
    a = Endpoint(0, 1, creator=True, timeout_s=60.0, slots=2)
    parent, child = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=_peer, args=(a.offer(), child))
    process.start()
    their_offer, joined = parent.recv()
    assert joined and a.connect(their_offer)
    a.unlink()
    parent.send("go")
    assert torch.equal(a.recv((3,), torch.float32, 0), torch.arange(3.0))
    began = time.monotonic()
    with pytest.raises(PeerLostError, match="rank 0: receive of tag 1 from rank 1: rank 1 closed"):
        a.recv((3,), torch.float32, 1)
    assert time.monotonic() - began < 30  # reported, not waited out (the deadline is 60 s)
    process.join(10)
    a.close()
    # the peer's segment (SIGKILL-like exit, no cleanup) was unlinked when we mapped it; its
    # setup pipe is swept by the next group setup like any dead process's file
    shm_files.sweep_stale()
    assert glob.glob(os.path.join(shm_files.SHM_DIR, f"tessera-*-{process.pid}-*")) == []
    assert _our_files() == []


def test_closing_removes_a_segment_the_peer_never_mapped():
    a, b = _pair(slots=2)
    a.send(torch.ones(10), tag=0)
    assert len(_our_files()) == 1  # the data segment, waiting for the consumer to map it
    a.close()
    assert _our_files() == []
    b.close()


# ----------------------------------------------------------------------- in a pipeline


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(6, 6, generator=generator), torch.randn(6, 2, generator=generator)


def pipeline_links_worker(private_dir: str) -> dict:
    """2 stages: the link over shared memory, then (rank 1 seeing another /dev/shm, as on
    another host) over gloo, then forced off; gradients of each, for the oracle."""
    tessera.init(timeout_s=30)
    x, y = _batch()
    result = {}
    for case in ("shm", "other host", "off"):
        if case == "other host" and dist.get_rank() == 1:
            shm_files.SHM_DIR = private_dir
        pipe = Pipeline(_model(), num_microbatches=3, balance=[3, 3], shm_links=case != "off")
        pipe.train_step(x, y, F.mse_loss)
        peer = 1 - dist.get_rank()
        endpoint = pipe.links.channels.get(peer)
        result[case] = {
            "transport": pipe.links.transport(peer),
            "shm_bytes": endpoint.bytes_sent if endpoint is not None else 0,
            "grads": [p.grad.clone() for p in pipe.module.parameters()],
        }
        pipe.links.close()
    shm_files.SHM_DIR = "/dev/shm"
    return result


def test_pipeline_sends_over_shared_memory_on_one_host_and_gloo_otherwise(run_ranks):
    with tempfile.TemporaryDirectory() as private_dir:
        ranks = run_ranks(pipeline_links_worker, 2, private_dir, deadline_s=90)
    assert [r["shm"]["transport"] for r in ranks] == ["shm", "shm"]
    assert all(r["shm"]["shm_bytes"] > 0 for r in ranks)  # activations one way, gradients back
    assert [r[c]["transport"] for r in ranks for c in ("other host", "off")] == ["gloo"] * 4
    # the oracle: plain PyTorch on the whole batch, fp32 and float64
    x, y = _batch()
    model = _model()
    model64 = copy.deepcopy(model).double()
    F.mse_loss(model(x), y).backward()
    F.mse_loss(model64(x.double()), y.double()).backward()
    for stage, r in enumerate(ranks):
        want = [p.grad for p in model[3 * stage : 3 * stage + 3].parameters()]
        want64 = [p.grad for p in model64[3 * stage : 3 * stage + 3].parameters()]
        for i, got in enumerate(r["shm"]["grads"]):
            for case in ("other host", "off"):  # the same arithmetic, only the transport differs
                assert torch.equal(got, r[case]["grads"][i])
            check_close(got, want[i], want64[i], what=f"stage {stage} gradient {i}")
