"""ZeRO-Offload's uploads on their way while the next host step runs (`HostLink.release_uploads`).

On CUDA a publish queues each updated bf16 partition from a pinned staging buffer to the
device and returns without waiting for the copies: the next host step writes the other staging
set. This machine has no side stream, so the test gives the link one that is asynchronous in
the only way that matters here, a race detector: each queued copy is made at once, but its
host source is snapshotted, and until the host waits for the copy's event that source must not
change (a real DMA may read it at any moment until then). Every queued copy is checked, the
gradient downloads too. The oracle for the values is the same run on this machine's own path
(no staging: the upload rounds the master itself, synchronously).

Without the delayed update each bucket also goes up as soon as the host step has updated it:
the order of steps and copies is checked. On a GPU (`gpu`-marked) the overlapping run is held
to the same run with every copy waited for, bit for bit.

Planted and seen failing: the staging sets not swapped (the next step writes the set on its
way up: a race); the in-flight set's copies not waited for before the set is reused (a race);
the publish waiting for every upload (the overlap gone: nothing left in flight); stage 3's
gathers not waiting for the uploads on their thread; every upload after the whole step.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch
from torch import nn

import tessera

STEPS = 4


class TiedDictNet(nn.Module):
    """Not tessera's: an embedding whose weight is also the output projection, and blocks kept
    in a ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(40, 24)
        self.blocks = nn.ModuleDict(
            {name: nn.Sequential(nn.Linear(24, 24), nn.GELU()) for name in ("a", "b", "c")}
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks.values():
            x = x + block(x)
        return x @ self.embed.weight.t()


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, 40, (3, 6), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


class _QueuedCopy:
    """A copy on the fake side stream: made at once; its source watched until waited for."""

    def __init__(self, source: torch.Tensor, target: torch.Tensor, races: list[str]) -> None:
        target.copy_(source)
        self.source, self.snapshot, self.races = source, source.clone(), races
        self.waited = False

    def check(self) -> None:
        if not self.waited and not torch.equal(self.source, self.snapshot):
            self.races.append(f"a source of {self.source.numel()} elements written while queued")

    def synchronize(self) -> None:
        self.check()
        self.waited = True


def _runs() -> dict[Any, Any]:
    """bf16 offload runs (zero2/zero3, with and without the delayed update) on the CPU's own
    path and on a link with staging buffers and the fake asynchronous side stream."""
    from tessera.zero.host_link import HostLink

    ctx = tessera.init()
    races: list[str] = []
    queued: list[_QueuedCopy] = []
    waits: list[tuple[str, int]] = []
    plain = {name: getattr(HostLink, name) for name in ("add_bucket", "__init__")}

    def add_bucket(self, numel, compute_dtype, *, converted, published):
        plain["add_bucket"](self, numel, compute_dtype, converted=converted, published=published)
        if converted and self.staging[-1] is None:  # what a pinned (CUDA) link makes
            self.staging[-1] = self.host_zeros(numel, compute_dtype)

    def init(self, device, *, huge_pages=False):
        plain["__init__"](self, device, huge_pages=huge_pages)
        self._stream = "the fake side stream"

    def uploads_ready(self):  # a stream's wait for the uploads: which thread, with how many
        waits.append((threading.current_thread().name, len(self._in_flight)))

    def async_copy(self, source, target):
        queued.append(_QueuedCopy(source, target, races))
        return queued[-1]

    out: dict[Any, Any] = {}
    for strategy, delayed, asynchronous in itertools.product(
        ("zero2", "zero3"), (False, True), (False, True)
    ):
        fakes = dict(add_bucket=add_bucket, __init__=init, _async_copy=async_copy)
        fakes.update(device_ready=lambda self: None, uploads_ready=uploads_ready)
        originals = {name: HostLink.__dict__[name] for name in fakes}
        if asynchronous:  # the fakes stay in place until the engine is closed
            for name, fake in fakes.items():
                setattr(HostLink, name, fake)
        try:
            out[strategy, delayed, asynchronous] = _train(ctx, strategy, delayed, queued, races)
        finally:
            for name, original in originals.items():
                setattr(HostLink, name, original)
        out[strategy, delayed, asynchronous]["waits"] = list(waits)
        races.clear()
        queued.clear()
        waits.clear()
    return out


def test_a_publish_leaves_its_staged_uploads_in_flight_and_no_step_writes_them(run_ranks):
    """With staging and an asynchronous side stream: the same values, bit for bit, as the
    synchronous path; after each step the last publish's uploads (one per bucket) are still in
    flight, not waited for; and no queued copy's host source is written before it is waited
    for. zero2 (several buckets, a gather per bucket on 2 ranks) and zero3, with and without
    the delayed update; stage 3's gathers, on another thread, wait for the uploads in flight."""
    for result in run_ranks(_runs, 2):
        for (strategy, delayed, asynchronous), run in result.items():
            what = f"{strategy} delayed={delayed}"
            assert run["races"] == [], (what, run["races"][:3])
            if not asynchronous:
                assert run["in_flight"] == [0] * STEPS, what  # copies made on the spot
                continue
            synchronous = result[strategy, delayed, False]["state"]
            for name, value in synchronous.items():
                assert torch.equal(run["state"][name], value), (what, name)
            buckets = run["buckets"]
            assert strategy == "zero3" or buckets >= 3, what
            assert run["staging_sets"] == (buckets, buckets), what
            # both sets are counted in memory_usage (the synchronous path has none)
            one, other = run["staging_bytes"]
            assert one == other > 0, (what, one, other)
            extra = run["params_bytes"] - result[strategy, delayed, False]["params_bytes"]
            assert extra == one + other, (what, extra, one, other)
            # left in flight by each step: the uploads of the last publish (under the delayed
            # update the warm-up step's, then each step's of the previous step's result)
            assert run["in_flight"] == [buckets] * STEPS, (what, run["in_flight"])
            # stage 3's gathers run on the communication thread, whose stream the publish did
            # not order: each waits there for the uploads in flight (every forward after the
            # first publish, and the backward's gathers again)
            waited = [n for thread, n in run["waits"] if thread.startswith("tessera-stream")]
            if strategy == "zero3":
                assert set(waited) <= {0, buckets}, (what, waited)  # (0: before any publish)
                assert waited.count(buckets) >= 2 * (STEPS - 1), (what, waited)


def _train(ctx, strategy: str, delayed: bool, queued: list, races: list) -> dict[str, Any]:
    from tessera.zero import OffloadPolicy

    offload = OffloadPolicy(device="cpu", delayed_update=delayed, delayed_update_after=1)
    model, factory = _recipe()  # (groups by shape, a frozen block)
    engine = tessera.setup(
        model, factory, strategy=strategy, loss_fn=_loss, precision="bf16", offload=offload,
        ctx=ctx,
        **({"bucket_cap_mb": 0.0005} if strategy == "zero2" else {}),
    )  # fmt: skip
    in_flight = []
    for step in range(STEPS):
        engine.train_step(_batch(step, ctx.rank))
        engine.step()
        in_flight.append(sum(not copy.waited for copy in queued))
    engine.zero.finish_step()
    for copy in queued:
        copy.check()
    link = engine.zero.link
    run = {
        "state": engine.full_state_dict(),
        "in_flight": in_flight,
        "buckets": len(engine.zero.flats),
        "races": list(races),
        "staging_sets": (len(link.staging), len(link.spare_staging)),
        "staging_bytes": [
            sum(t.numel() * t.element_size() for t in buffers if t is not None)
            for buffers in (link.staging, link.spare_staging)
        ],
        "params_bytes": engine.zero.memory_usage()["params"],
    }
    engine.close()
    return run


def _recipe() -> tuple[nn.Module, Any]:
    """The model with a frozen block, and a factory grouping its parameters by shape as nanoGPT
    does, the group without weight decay listed first (ZeRO orders its buckets by group)."""
    model = TiedDictNet()
    model.blocks["c"].requires_grad_(False)

    def factory(_: Any) -> torch.optim.Optimizer:
        trainable = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            [{"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
             {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": 0.1}],
            lr=0.03,
        )  # fmt: skip

    return model, factory


def _step_order_ranks() -> dict[str, list]:
    """One offload step of zero1/zero2 (several buckets) and zero3, bf16 and fp32, on `_recipe`:
    the host step's parameters and the link's copies in the order they happened, and which
    bucket each parameter of the host step (in group order) is the master of."""
    from tessera.optim import CPUAdam
    from tessera.zero.host_link import HostLink

    ctx = tessera.init()
    events: list[tuple[str, int]] = []
    update, copy = CPUAdam._update, HostLink._copy

    def logged_update(self, param, grad, group, target, position):
        update(self, param, grad, group, target, position)
        events.append(("step", position))

    def logged_copy(self, kind, index, source, target, **how):
        copy(self, kind, index, source, target, **how)
        events.append((kind, index))

    CPUAdam._update, HostLink._copy = logged_update, logged_copy
    out = {}
    try:
        for strategy, precision in itertools.product(("zero1", "zero2", "zero3"), ("bf16", "fp32")):
            model, factory = _recipe()
            engine = tessera.setup(
                model, factory, strategy=strategy, loss_fn=_loss, precision=precision,
                offload="cpu", ctx=ctx,
                **({"bucket_cap_mb": 0.0005} if strategy != "zero3" else {}),
            )  # fmt: skip
            engine.train_step(_batch(0, ctx.rank))
            events.clear()
            engine.step()
            zero = engine.zero
            masters = [m for group in zero.optimizer.param_groups for m in group["params"]]
            bucket_of = {id(flat.master): flat.bucket.index for flat in zero.flats}
            out[strategy, precision] = (list(events), [bucket_of[id(m)] for m in masters])
            engine.close()
    finally:
        CPUAdam._update, HostLink._copy = update, copy
    return out


def test_each_bucket_goes_up_as_soon_as_the_host_step_has_updated_it(run_ranks):
    """Without the delayed update the host step's result goes up bucket by bucket: each
    bucket's upload is issued right after its master is stepped, before the next master is
    (on CUDA the copy then runs beside the rest of the step), once per bucket and step. With
    the user's optimizer groups (by shape) and a frozen block: the bucket that goes up is the
    one whose master was just stepped."""
    for result in run_ranks(_step_order_ranks, 2):
        for (strategy, precision), (events, bucket_of) in result.items():
            what = f"{strategy} {precision}"
            assert strategy == "zero3" or len(bucket_of) >= 3, what
            expected = [
                e for position, bucket in enumerate(bucket_of)
                for e in (("step", position), ("to_device", bucket))
            ]  # fmt: skip
            assert [e for e in events if e[0] != "to_host"] == expected, (what, events)


# --- on a GPU ---------------------------------------------------------------------------------


def _cuda_runs() -> dict[Any, Any]:
    """On CUDA (one rank per GPU): bf16 offload runs of zero2/zero3, with and without the
    delayed update, once as they run and once with every copy waited for at each publish (the
    link's release made a full wait: nothing in flight while the next host step runs)."""
    import os

    from tessera.zero import OffloadPolicy
    from tessera.zero.host_link import HostLink

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    torch.use_deterministic_algorithms(True)  # (an op without a deterministic kernel raises)
    ctx = tessera.init()
    assert ctx.device.type == "cuda"
    out: dict[Any, Any] = {}
    overlapping = HostLink.release_uploads
    for strategy, delayed, waiting in itertools.product(
        ("zero2", "zero3"), (False, True), (False, True)
    ):
        if waiting:
            HostLink.release_uploads = HostLink.wait
        try:
            offload = OffloadPolicy(device="cpu", delayed_update=delayed, delayed_update_after=1)
            engine = tessera.setup(
                TiedDictNet().to(ctx.device),
                lambda ps: torch.optim.AdamW(ps, lr=0.03, weight_decay=0.1),
                strategy=strategy, loss_fn=_loss, precision="bf16", offload=offload, ctx=ctx,
                **({"bucket_cap_mb": 0.0005} if strategy == "zero2" else {}),
            )  # fmt: skip
            link = engine.zero.link
            assert link.pinned and all(s is None or s.is_pinned() for s in link.staging)
            for step in range(STEPS):
                tokens, target = _batch(step, ctx.rank)
                engine.train_step((tokens.to(ctx.device), target.to(ctx.device)))
                engine.step()
            engine.zero.finish_step()
            swapped = bool(link.spare_staging)
            state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
            engine.close()
        finally:
            HostLink.release_uploads = overlapping
        out[strategy, delayed, waiting] = (state, swapped)
    return out


@pytest.mark.gpu
def test_uploads_left_in_flight_on_cuda_change_nothing(run_ranks):
    """On CUDA the uploads a publish leaves in flight (pinned staging, a side stream) give the
    same parameters, bit for bit, as waiting for every copy: the same kernels run in the same
    order on the device (deterministic algorithms only), so any difference is a host buffer
    written while its copy was still queued. The staging sets did take turns."""
    world = max(n for n in (1, 2) if n <= torch.cuda.device_count())
    for result in run_ranks(_cuda_runs, world, deadline_s=600):
        for (strategy, delayed, waiting), (state, swapped) in result.items():
            if waiting:
                continue
            what = f"{strategy} delayed={delayed}"
            assert swapped, what
            reference, _ = result[strategy, delayed, True]
            for name, value in reference.items():
                assert torch.equal(state[name], value), (what, name)
