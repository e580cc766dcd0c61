"""ZeRO-Offload / -Infinity through the one device-parametrised path (`tessera.zero.host_link`).

The model's tensors stay on its device (here the CPU), and under offload the step reads and
writes a distinct set of host tensors: each bucket's reduced gradient partition goes down as soon
as it is reduced, the updated partition comes back up at publish. On a CPU-only machine these
are the same copies a CUDA run makes (there asynchronously, through pinned buffers on a side
stream), so here we check, through `tessera.setup`:

* offload="cpu" and "nvme" equal the same run without offload (CPUAdam named as the optimizer:
  the same kernel on the same elements, bit for bit), for zero1/2/3, fp32 and bf16, with the
  gradient clip on the host copies, and a plain PyTorch AdamW loop written here within the
  suite's derived tolerance; a save after 2 steps loads into a fresh engine whose 3rd step is the
  straight run's;
* the copies are per bucket: one down per bucket and backward, one up per bucket and step (and,
  with ZeRO-3's parameters offloaded, one up per unit gathered), and the first goes down while
  the backward is still running;
* the device path under `FakeTensorMode` (CUDA tensors on this machine): the engine built on
  "cuda" parameters keeps its host buffers on the CPU and its device buffers on "cuda", and its
  host transfers run without mixing devices;
* `gpu`-marked (skipped without CUDA): the same equivalence on CUDA, and a model whose fp32
  masters and Adam moments would not fit in the GPU's free memory trains under offload.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _tolerance import check_close
from torch import nn

import tessera

HYPER = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
CLIP = 0.5
STEPS = 3


class Tower(nn.Module):
    """Not tessera's: a stem, three residual blocks in a ModuleList (ZeRO-3's units), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(12, 48)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 48), nn.Tanh()) for _ in range(3)
        )
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 12, generator=generator), torch.randn(8, 4, generator=generator)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _oracle(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain PyTorch: AdamW and torch's clip on the whole batch, written here, not tessera's."""
    model = Tower().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        _loss(model(x.to(dtype)), y.to(dtype)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


# (strategy, precision, offload device, offload ZeRO-3's parameters)
RUNS = [
    ("zero1", "fp32", "cpu", False),
    ("zero2", "fp32", "cpu", False),
    ("zero3", "fp32", "cpu", False),
    ("zero1", "fp32", "nvme", False),
    ("zero2", "fp32", "nvme", False),
    ("zero3", "fp32", "nvme", True),
    ("zero2", "bf16", "cpu", False),
    ("zero3", "bf16", "nvme", True),
    ("zero3", "fp32", "cpu", True),
    ("zero3", "bf16", "cpu", True),
]


def _engine(ctx, strategy: str, precision: str, offload: Any, device: str = "cpu") -> Any:
    """A fresh engine; without offload the inner optimizer is CPUAdam itself (what offload runs
    the user's AdamW as), so the two runs step with the same kernel."""
    from tessera.optim import CPUAdam

    if offload is None:
        factory = lambda params: CPUAdam(params, **HYPER)  # noqa: E731
    else:
        factory = lambda params: torch.optim.AdamW(params, **HYPER)  # noqa: E731
    options = {"offload": offload} if offload is not None else {}
    if strategy != "zero3":
        options["bucket_cap_mb"] = 0.004  # several buckets: copies per bucket show
    return tessera.setup(
        Tower().to(device), factory, strategy=strategy, loss_fn=_loss, grad_clip=CLIP,
        precision=precision, ctx=ctx, **options,
    )  # fmt: skip


def _train(engine: Any, ctx, steps: range, device: str = "cpu") -> list[dict[str, int]]:
    """Train this rank's half of each batch; the link's copy counts after each step."""
    counts = []
    for step in steps:
        x, y = _batch(step)
        rows = slice(4 * ctx.rank, 4 * ctx.rank + 4)
        engine.train_step((x[rows].to(device), y[rows].to(device)))
        engine.step()
        link = engine.zero.link
        counts.append(dict(link.copies) if link is not None else {})
    return counts


def _offload_ranks(nvme_root: str) -> dict:
    from tessera.zero import OffloadPolicy

    ctx = tessera.init()
    torch.set_num_threads(1)
    out: dict = {}
    plain: dict = {}
    for strategy, precision, device, params in RUNS:
        key = (strategy, precision)
        if key not in plain:
            engine = _engine(ctx, strategy, precision, None)
            _train(engine, ctx, range(STEPS))
            plain[key] = engine.full_state_dict()
            engine.close()
        folder = Path(nvme_root) / f"{strategy}-{precision}-{device}-{params}"  # shared by ranks
        swap = folder / f"swap{ctx.rank}"
        nvme = dict(nvme_dir=str(swap), nvme_buffer_mb=2) if device == "nvme" else {}
        if nvme:
            Path(nvme["nvme_dir"]).mkdir(parents=True)
        offload = OffloadPolicy(device=device, params=params, **nvme)
        engine = _engine(ctx, strategy, precision, offload)
        zero = engine.zero
        assert zero.link is not None and all(
            g.data_ptr() != s.data_ptr()
            for g, s in zip(zero.link.grads, [zero.layout.gradient_slice(f) for f in zero.flats])
        ), "the host gradients must be tensors of their own"
        counts = _train(engine, ctx, range(2))
        engine.save(folder / "ckpt")
        counts += _train(engine, ctx, range(2, STEPS))
        units = len(zero._flats_of_unit) if strategy == "zero3" else 0
        resumed = _engine(ctx, strategy, precision, offload)
        resumed.load(folder / "ckpt")
        _train(resumed, ctx, range(2, STEPS))
        out[(strategy, precision, device, params)] = {
            "straight": engine.full_state_dict(),
            "resumed": resumed.full_state_dict(),
            "plain": plain[key],
            "counts": counts,
            "buckets": len(zero.flats),
            "units": units,
        }
        engine.close()
        resumed.close()
    return out


def test_offload_equals_no_offload_through_setup(run_ranks, tmp_path):
    """zero1-3 x cpu/nvme (fp32 and bf16, ZeRO-3's parameters offloaded too under nvme) on 2
    ranks: offload bit-equal to no offload, resumed bit-equal to straight, both within the
    derived tolerance of plain AdamW; the copies counted per bucket."""
    results = run_ranks(_offload_ranks, 2, str(tmp_path))
    oracle, reference = _oracle(torch.float32), _oracle(torch.float64)
    for (strategy, precision, device, params), got in results[0].items():
        what = f"{strategy} {precision} offload={device} params={params}"
        for name, value in got["plain"].items():
            assert torch.equal(got["straight"][name], value), (what, name)
            assert torch.equal(got["resumed"][name], value), (what, "resumed", name)
        if precision == "fp32":
            check_close(got["straight"], oracle, reference, what=what)
        buckets, units = got["buckets"], got["units"]
        assert buckets >= 3, (what, buckets)
        for step, counts in enumerate(got["counts"][:2], start=1):  # before the save
            assert counts["to_host"] == buckets * step, (what, counts)  # a bucket per backward
            if params:  # ZeRO-3's partitions off the device: each gather uploads one, in the
                # forward and again in the backward (all but the root, kept between the two)
                assert counts["to_device"] >= (2 * units - 1) * step, (what, counts)
            else:  # the step's result: a bucket per step
                assert counts["to_device"] == buckets * step, (what, counts)


def _during_backward_ranks() -> list[int]:
    """zero2, offload="cpu": when the gradient of the stem's output is computed (before the
    stem's own parameter gradients, so before the last bucket can be reduced), how many buckets
    have gone down in this backward."""
    ctx = tessera.init()
    torch.set_num_threads(1)
    engine = _engine(ctx, "zero2", "fp32", "cpu")
    link, buckets = engine.zero.link, len(engine.zero.flats)
    seen: list[int] = []

    def stem_output_gradient(grad: torch.Tensor) -> None:
        before = len(seen) * buckets  # the copies of the earlier backwards
        deadline = time.monotonic() + 20.0  # the communication thread copies bucket 0 meanwhile
        while link.copies["to_host"] == before and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(link.copies["to_host"] - before)

    def hook_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(stem_output_gradient)

    handle = engine.module.stem.register_forward_hook(hook_output)
    _train(engine, ctx, range(2))
    handle.remove()
    engine.close()
    return [buckets, *seen]


def test_gradients_go_down_per_bucket_during_the_backward(run_ranks):
    """The gradient partition of a bucket goes to the host as soon as that bucket is reduced,
    not after the backward: before the first layer's gradients exist, at least one bucket (and
    not yet the first layer's own) has been copied, in both backwards."""
    for buckets, *seen in run_ranks(_during_backward_ranks, 2):
        assert buckets >= 3
        assert len(seen) == 2 and all(1 <= n < buckets for n in seen), (buckets, seen)


# --- the device path on a CPU-only machine ------------------------------------------------------
# `FakeTensorMode` cannot run this path on a CPU-only torch build: `Tensor.copy_` and slicing of
# a fake "cuda" tensor take a CUDA device guard in their Python bindings, which raises "PyTorch
# is not linked with support for cuda devices" before the fake kernel is reached. So the CPU
# plays both sides here: every storage is tagged "device" or "host", the tag follows each op's
# output, and what CUDA would refuse fails the test: an op that reads both sides (a CPU
# accumulator added to a device norm), a collective on a host tensor (NCCL takes device tensors
# only), `.numpy()` on a device tensor. The only crossings allowed are the link's own copies.


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.untyped_storage().nbytes() else 0


class _TwoSides:
    """The tags, and the checks on ops, collectives and `.numpy()` (see above)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.tags: dict[int, str] = {}
        self.errors: list[str] = []
        self.crossing = False
        self.local = threading.local()
        sides = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return sides.dispatch(func, args, kwargs or {})

        self.mode = Mode

    def tag(self, tensors: Any, side: str) -> None:
        for tensor in tensors:
            if tensor is not None and _storage(tensor):
                self.tags[_storage(tensor)] = side

    def side(self, tensors: list[torch.Tensor]) -> set[str]:
        return {self.tags[_storage(t)] for t in tensors if _storage(t) in self.tags}

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        from torch.utils._pytree import tree_flatten

        if getattr(self.local, "in_collective", False):  # the CPU transport's own tensors
            return func(*args, **kwargs)  # (shared-memory segments no dispatch made: no tags)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        sides = self.side(inputs)
        if len(sides) > 1 and not self.crossing:
            self.errors.append(f"{func} reads device and host tensors")
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.crossing or func is torch.ops.aten.copy_.default:
            return out  # the target keeps its side (a crossing is retagged by the link's copy)
        for tensor in outputs:
            if _storage(tensor):
                if len(sides) == 1:
                    self.tags[_storage(tensor)] = next(iter(sides))
                else:
                    self.tags.pop(_storage(tensor), None)  # a new tensor: no side yet
        return out

    def collective(self, fn: Any) -> Any:
        def checked(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            for t in [tensor, kwargs.get("out")]:
                if t is not None and self.side([t]) == {"host"}:
                    self.errors.append(f"{fn.__name__} on a host tensor")
            self.local.in_collective = True  # its transport is NCCL's on a GPU, not ours
            try:
                return fn(tensor, *args, **kwargs)
            finally:
                self.local.in_collective = False

        return checked


def _two_sides_ranks() -> dict:
    """zero1-3 with offload (cpu, and ZeRO-3's parameters on the host) through tessera.setup,
    the CPU playing device and host: what CUDA would refuse, listed."""
    from tessera import comm
    from tessera.zero import OffloadPolicy
    from tessera.zero.host_link import HostLink
    from tessera.zero.optimizer import ZeroOptimizer

    ctx = tessera.init()
    torch.set_num_threads(1)
    sides = _TwoSides()
    copy, on_device, numpy = HostLink._copy, ZeroOptimizer._on_device, torch.Tensor.numpy

    def link_copy(self, kind, index, source, target, **how):  # the one sanctioned crossing
        sides.crossing = True
        try:
            copy(self, kind, index, source, target, **how)
        finally:
            sides.crossing = False
        sides.tag([target], "host" if kind == "to_host" else "device")

    def to_device(self, tensor, host=False):  # on CUDA a copy; on the CPU `.to` would alias
        sides.crossing = True
        try:
            moved = on_device(self, tensor, host=host).clone()
        finally:
            sides.crossing = False
        sides.tag([moved], "host" if host else "device")
        return moved

    def checked_numpy(tensor, *args, **kwargs):
        inside = getattr(sides.local, "in_collective", False)  # the CPU transport's own
        if sides.side([tensor]) == {"device"} and not inside:
            sides.errors.append(".numpy() of a device tensor")
        return numpy(tensor, *args, **kwargs)

    from tessera.optim import CPUAdam

    cpu_step = CPUAdam.step

    def host_step(self, *args, **kwargs):  # the kernel reads raw host memory
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and sides.side([param, param.grad]) != {"host"}:
                    sides.errors.append("CPUAdam steps a tensor not known to be the host's")
        return cpu_step(self, *args, **kwargs)

    HostLink._copy, ZeroOptimizer._on_device, torch.Tensor.numpy = (
        link_copy,
        to_device,
        checked_numpy,
    )
    CPUAdam.step = host_step
    for name in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
        setattr(comm, name, sides.collective(getattr(comm, name)))
    out = {}
    for strategy, params in (("zero1", False), ("zero2", False), ("zero3", False), ("zero3", True)):
        engine = _engine(ctx, strategy, "bf16", OffloadPolicy(device="cpu", params=params))
        zero = engine.zero
        sides.tags.clear()
        sides.tag([*engine.module.parameters(), *[f.flat_param for f in zero.flats]], "device")
        sides.tag([f.grad_shard for f in zero.flats] + zero.layout.parameter_shards(), "device")
        sides.tag([f.bucket.buffer for f in zero.flats], "device")
        sides.tag([*zero.link.grads, *zero.link.staging, *[f.master for f in zero.flats]], "host")
        if params:
            sides.tag(zero.layout.parameter_shards(), "host")
        worker, on_worker = zero.reducer.stream, sides.mode()
        worker.run(on_worker.__enter__, what="two sides on the communication thread")
        with sides.mode():
            _train(engine, ctx, range(2))
            state = engine.full_state_dict()
        worker.run(on_worker.__exit__, None, None, None, what="off")
        out[(strategy, params)] = (list(sides.errors), sorted(state))
        sides.errors.clear()
        engine.close()
    return out


def test_the_device_path_keeps_device_and_host_apart(run_ranks):
    """The engine under offload, the CPU playing both sides: no op mixes device and host
    tensors but the link's copies, no collective runs on a host tensor, no `.numpy()` reads a
    device tensor, for zero1-3 (bf16: the conversions too) and ZeRO-3's host parameters."""
    for result in run_ranks(_two_sides_ranks, 2):
        for (strategy, params), (errors, names) in result.items():
            assert names, strategy
            assert errors == [], (strategy, params, sorted(set(errors))[:5])


# --- on a GPU ---------------------------------------------------------------------------------


def _gpu_offload_ranks() -> dict:
    """On CUDA (one rank per GPU): zero1-3 with offload cpu and nvme (ZeRO-3's parameters in
    files) against the same run without offload (torch's AdamW on the device), and the delayed
    update; the link's device, pinning and copies."""
    import tempfile

    from tessera.zero import OffloadPolicy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ctx = tessera.init()
    assert ctx.device.type == "cuda" and ctx.backend == "nccl"
    out: dict = {}
    swap_root = Path(tempfile.mkdtemp(prefix=f"tessera-offload-{ctx.rank}-"))
    runs = [("zero1", "cpu", False), ("zero2", "cpu", False), ("zero3", "cpu", False)]
    runs += [("zero2", "nvme", False), ("zero3", "nvme", True), ("zero3", "cpu", True)]
    for strategy, device, params in runs:
        plain = tessera.setup(
            Tower().to(ctx.device), lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER),
            strategy=strategy, loss_fn=_loss, grad_clip=CLIP, ctx=ctx,
        )  # fmt: skip
        _train_rows(plain, ctx)
        nvme = {}
        if device == "nvme":
            nvme = dict(nvme_dir=str(swap_root), nvme_buffer_mb=2)
        offload = OffloadPolicy(device=device, params=params, **nvme)
        engine = _engine(ctx, strategy, "fp32", offload, device=str(ctx.device))
        link = engine.zero.link
        assert link.device == ctx.device and link.pinned and link.grads[0].is_pinned()
        assert all(f.master.device.type == "cpu" for f in engine.zero.flats)
        _train_rows(engine, ctx)
        out[(strategy, device, params)] = (
            {k: v.cpu() for k, v in engine.full_state_dict().items()},
            {k: v.cpu() for k, v in plain.full_state_dict().items()},
            dict(link.copies),
            len(engine.zero.flats),
        )
        engine.close()
        plain.close()
    dpu = OffloadPolicy(device="cpu", delayed_update=True, delayed_update_after=1)
    engine = _engine(ctx, "zero2", "bf16", dpu, device=str(ctx.device))
    losses = _train_rows(engine, ctx)
    engine.zero.finish_step()
    out["dpu"] = losses
    engine.close()
    return out


def _train_rows(engine: Any, ctx) -> list[float]:
    """STEPS steps on this rank's rows of each batch (8 rows over 1, 2, 4 or 8 ranks)."""
    per = 8 // ctx.world_size
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        rows = slice(per * ctx.rank, per * (ctx.rank + 1))
        losses.append(float(engine.train_step((x[rows].to(ctx.device), y[rows].to(ctx.device)))))
        engine.step()
    return losses


@pytest.mark.gpu
def test_offload_on_cuda_equals_no_offload(run_ranks):
    """ZeRO-Offload from GPU memory: every stage with offload cpu/nvme equals the run without
    offload within the suite's derived tolerance of plain AdamW (CPUAdam on the host against
    torch's AdamW on the device: another association of the same formula), with one copy down
    per bucket and backward; the delayed update trains on CUDA (finite losses)."""
    world = max(n for n in (1, 2, 4, 8) if n <= torch.cuda.device_count())
    results = run_ranks(_gpu_offload_ranks, world, deadline_s=900)
    oracle, reference = _oracle(torch.float32), _oracle(torch.float64)
    for key, value in results[0].items():
        if key == "dpu":
            assert all(torch.isfinite(torch.tensor(value))), value
            continue
        offloaded, plain, copies, buckets = value
        check_close(offloaded, oracle, reference, what=f"{key} offload on cuda")
        check_close(plain, oracle, reference, what=f"{key} no offload on cuda")
        assert copies["to_host"] == STEPS * buckets, (key, copies)


def _gpu_memory_rank(cap_gib: float) -> dict:
    """A model whose fp32 masters and Adam moments (12 bytes a parameter) exceed the GPU memory
    allowed to this process (`cap_gib`), while its bf16 parameters and gradients fit: zero2
    bf16 with offload="cpu" trains; without offload the same model runs out of memory."""
    import gc

    ctx = tessera.init()
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, ctx.device)
    width, depth = 4096, 24  # 403 M parameters: 4.8 GB of masters and moments, 0.8 GB bf16

    def model() -> nn.Module:
        torch.manual_seed(0)
        with torch.device(ctx.device):
            return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])

    def loss(output: torch.Tensor, _: Any) -> torch.Tensor:
        return output.float().square().mean()

    def factory(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)

    numel = width * width * depth
    out = {"state_bytes": 12 * numel, "cap": int(cap_gib * 2**30)}
    x = torch.randn(16, width, device=ctx.device)
    engine = tessera.setup(
        model(), factory, strategy="zero2", precision="bf16", offload="cpu", loss_fn=loss,
        ctx=ctx,
    )  # fmt: skip
    torch.cuda.reset_peak_memory_stats(ctx.device)
    out["losses"] = []
    for _ in range(2):
        out["losses"].append(float(engine.train_step((x, x))))
        engine.step()
    out["peak"] = torch.cuda.max_memory_allocated(ctx.device)
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    try:
        plain = tessera.setup(
            model(), factory, strategy="zero2", precision="bf16", loss_fn=loss, ctx=ctx
        )
        for _ in range(2):
            plain.train_step((x, x))
            plain.step()
        out["plain"] = "trained"
    except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError only since 2.5)
        out["plain"] = "out of memory"
    return out


@pytest.mark.gpu
def test_offload_trains_a_model_whose_optimizer_state_does_not_fit_on_the_gpu(run_ranks):
    out = run_ranks(_gpu_memory_rank, 1, 4.0, deadline_s=900)[0]
    assert out["state_bytes"] > out["cap"], "the test model must not fit without offload"
    assert out["plain"] == "out of memory", out["plain"]
    # The device holds bf16 parameters, their bf16 gradients and the reduced gradient partition
    # (one rank: all of it), 2 + 2 + 2 bytes a parameter (activations: 16 x 4096 per layer, a
    # few MB). Any fp32 master or moment on it would add 4 bytes a parameter: the bound is half.
    numel = out["state_bytes"] // 12
    assert out["peak"] < (6 + 4 / 2) * numel, out  # the device never held the state
    assert all(torch.isfinite(torch.tensor(out["losses"]))), out["losses"]


def _prefetch_ranks() -> list[bool]:
    """zero3, offload="cpu" with the parameters on the host: before each block's forward starts
    (a hook that runs before tessera's), has its unit's upload been issued already (prefetched
    while the block before ran)? Waits up to 20 s for it: an upload made only on demand would
    come after this hook, never during the wait."""
    from tessera.zero import OffloadPolicy

    ctx = tessera.init()
    torch.set_num_threads(1)
    engine = _engine(ctx, "zero3", "fp32", OffloadPolicy(device="cpu", params=True))
    zero, link = engine.zero, engine.zero.link
    unit_of = {id(block): unit for unit, block in enumerate(zero._units, start=1)}
    seen: list[bool] = []

    def before_block(block: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or not recording:
            return
        wanted = {("to_device", f.bucket.index) for f in zero._flats_of_unit[unit_of[id(block)]]}
        deadline = time.monotonic() + 20.0
        while not wanted <= set(link.log) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(wanted <= set(link.log))

    for block in engine.module.blocks[1:]:  # the first block is needed as the forward starts
        block.register_forward_pre_hook(before_block, prepend=True)
    recording = False
    _train(engine, ctx, range(1))  # the first forward records the order units are used in
    recording = True
    link.log.clear()
    _train(engine, ctx, range(1, 2))
    engine.close()
    return seen


def test_zero3_parameters_on_the_host_are_uploaded_ahead_of_use(run_ranks):
    for seen in run_ranks(_prefetch_ranks, 2):
        assert seen == [True, True], seen


def _widened_buffers_ranks() -> dict[str, Any]:
    """bf16 on one rank: zero2 without offload stepping with torch's AdamW (the widened
    gradient buffers after each step), and zero2 with offload="cpu" (CPUAdam)."""
    ctx = tessera.init()
    engine = tessera.setup(
        Tower(), lambda params: torch.optim.AdamW(params, **HYPER), strategy="zero2",
        loss_fn=_loss, precision="bf16", ctx=ctx, bucket_cap_mb=0.004,
    )  # fmt: skip
    pointers = []
    for step in range(3):
        _train(engine, ctx, range(step, step + 1))
        pointers.append({i: b.data_ptr() for i, b in engine.zero.masters.widened.items()})
    widened = sum(b.numel() * b.element_size() for b in engine.zero.masters.widened.values())
    gradients = engine.zero.memory_usage()["gradients"]
    flats = [(f.hi - f.lo, f.master.dtype) for f in engine.zero.flats]
    engine.close()
    offloaded = _engine(ctx, "zero2", "bf16", "cpu")
    _train(offloaded, ctx, range(2))
    offload_widened = len(offloaded.zero.masters.widened)
    offloaded.close()
    return {"pointers": pointers, "widened": widened, "gradients": gradients, "flats": flats,
            "offload_widened": offload_widened}  # fmt: skip


def test_the_host_step_reads_bf16_gradients_without_a_fresh_float32_copy(run_ranks):
    """The step reads float32 gradients; a bf16 run's host gradient slices reach it without a
    fresh float32 tensor per step, which would be page-faulted in each time (96 against 14 ms
    for 50M elements on 2 cores, more than the Adam step itself: BENCHMARKS offload):
    - torch's AdamW (zero2 on the CPU without offload): one float32 buffer per bucket, made at
      the first step and reused after it, counted as gradient memory;
    - CPUAdam (offload="cpu"): no float32 copy at all, its kernel reads the bf16 values."""
    got = run_ranks(_widened_buffers_ranks, 1)[0]
    first, *later = got["pointers"]
    assert len(first) == len(got["flats"]) >= 3  # one per bucket (several buckets here)
    assert all(pointers == first for pointers in later)
    assert got["widened"] == sum(n * 4 for n, dtype in got["flats"] if dtype == torch.float32)
    assert got["gradients"] >= got["widened"]
    assert got["offload_widened"] == 0


def _staged_ranks() -> dict[str, Any]:
    """bf16 offload="cpu" runs (zero2/zero3, zero3 with its parameter partitions on the host
    too, with and without the delayed update), each with the host staging buffers CUDA gets
    (pinned there; forced here) and without them."""
    from tessera.zero import OffloadPolicy
    from tessera.zero.host_link import HostLink

    ctx = tessera.init()
    plain_add = HostLink.add_bucket

    def staging_add(self, numel, compute_dtype, *, converted, published):
        plain_add(self, numel, compute_dtype, converted=converted, published=published)
        if converted and self.staging[-1] is None:  # what a pinned (CUDA) link makes
            self.staging[-1] = self.host_zeros(numel, compute_dtype)

    out = {}
    for strategy, delayed in itertools.product(("zero2", "zero3", "zero3-params"), (False, True)):
        offload = OffloadPolicy(
            device="cpu", delayed_update=delayed, delayed_update_after=1,
            params=strategy == "zero3-params",
        )  # fmt: skip
        for staged in (False, True):
            HostLink.add_bucket = staging_add if staged else plain_add
            try:
                engine = _engine(ctx, strategy.removesuffix("-params"), "bf16", offload)
            finally:
                HostLink.add_bucket = plain_add
            _train(engine, ctx, range(STEPS))
            out[strategy, delayed, staged] = {
                "state": engine.full_state_dict(),
                "copies": dict(engine.zero.link.copies),
                "buckets": len(engine.zero.flats),
            }
            engine.close()
    return out


def test_the_host_step_rounds_the_uploaded_partition_itself(run_ranks):
    """Where the partition goes up through a bf16 staging buffer (CUDA's pinned one), CPUAdam
    writes it there in its own pass (`bf16_out`) and the upload sends it as it is: no rounding
    pass of its own on the training thread. Same values, bit for bit, as rounding it apart
    (the run without staging), for zero2/zero3, with and without the delayed update; and every
    upload of a step's result was one the step had rounded. With ZeRO-3's parameter partitions
    on the host (`params=True`), the host shard takes the step's rounding too, not a second one
    of the master."""
    got = run_ranks(_staged_ranks, 1)[0]
    for (strategy, delayed, staged), run in got.items():
        if not staged:
            continue
        what = f"{strategy} delayed={delayed}"
        apart = got[strategy, delayed, False]
        for name, value in apart["state"].items():
            assert torch.equal(run["state"][name], value), (what, name)
        assert apart["copies"]["staged_by_step"] == 0, what
        if strategy == "zero3-params":  # (its uploads are the gathers' copies of the shards)
            rounded = run["copies"]["staged_by_step"]
            assert rounded == run["buckets"] * (STEPS - delayed), (what, run["copies"])
            continue
        # every upload is a step's result (a bucket per step; under the delayed update the last
        # step is still in flight at the end: full_state_dict reads its masters, nothing goes up)
        uploads = run["copies"]["to_device"]
        assert run["copies"]["staged_by_step"] == uploads, (what, run["copies"])
        assert uploads == run["buckets"] * (STEPS - delayed), (what, run["copies"])
