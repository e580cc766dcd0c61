"""A steady-state training step waits for nothing on the device and adds few operators.

On a GPU the host queues kernels ahead of the device; two things tessera adds to a plain loop's
step cost there, and both are counted here on the CPU over one step (after 2 warm-up steps), on
the calling thread and on the communication stream's worker:

- a **host read** of a tensor's value stalls the host until the device's queue drains:
  `.item()`, `float(t)`, `bool(t)`, `int(t)` (each runs `aten._local_scalar_dense`, seen by a
  `TorchDispatchMode`) and `.tolist()`, `.cpu()`, `.numpy()` (no operator on a CPU tensor: seen
  by a `TorchFunctionMode`). A step through `tessera.setup` (single, ddp, zero1-3; fp32, bf16
  with the trainer's default clip; 1 and 2 ranks; with `nn.CrossEntropyLoss`, whose items
  tessera weighs over the ranks) makes none; nor does fp16 where the optimizer's step takes
  `found_inf` (torch's fused Adam/AdamW/SGD, as here; `_skips_on_device`): the inf/nan flag goes
  to that step and the loss scale is updated on the device (`tests/test_fp16_device_skip.py`).
  That holds under zero1-3 as well (FP16_SYNCS): the fused optimizer steps the masters, and a
  step it skips leaves them as they were, which publishing again changes nothing of. (With
  offload or the delayed update, CPUAdam's step takes no flag: one read a step, the skip.)
- an **operator** is at least one kernel launch (5-10 us of host time). tessera's extra
  operators per step over the plain loop written here are what each strategy needs, counted
  from the code (`_allowed_extra`), not a round number.

Both loops use fused AdamW: torch's default CPU AdamW reads its step counter with `.item()` per
parameter (a host-resident counter, no device sync on a GPU, but it would hide tessera's reads).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import tessera
from tessera.comm import stream as comm_stream

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SYNCS = {"single": 0, "ddp": 0, "zero1": 0, "zero2": 0, "zero3": 0}
"""fp16's reads a step: none where the fused optimizer skips on the device, as here (else one:
whether any rank's gradients hold inf/nan; see the module doc)."""
SYNC = str(torch.ops.aten._local_scalar_dense.default)
VOCAB, WIDTH, ROWS, COLUMNS = 24, 16, 4, 6


class _Tagger(nn.Module):
    """A user's token tagger (tessera never built it): embedding, norm, MLP, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(tokens))
        return self.head(torch.relu(self.hidden(x))).transpose(1, 2)  # (rows, classes, columns)


PARAMETERS = 7
"""`_Tagger`'s parameter tensors: embedding, norm weight and bias, two Linears' weight and bias."""


READS = (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy)
"""Tensor methods that hand values to the host without an aten operator on a CPU tensor (on a
GPU each is a copy to the host: a sync), counted by name; `.item()`, `float(t)`, `bool(t)` and
`int(t)` run `aten._local_scalar_dense`, counted as an operator."""


class _Ops(TorchDispatchMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func in READS:
            self.counts[f"read {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _one_step(step: Callable[[], None]) -> tuple[collections.Counter, collections.Counter]:
    """The operators of `step()` on this thread, and those the communication stream's worker
    runs for it (each stream task under a counter of its own)."""
    main: collections.Counter = collections.Counter()
    worker: collections.Counter = collections.Counter()
    run_labeled = comm_stream._run_labeled

    def counted(future: Any, fn: Callable, args: tuple, label: int) -> None:
        def under_counter(*a: Any) -> Any:
            with _Reads(worker), _Ops(worker):
                return fn(*a)

        run_labeled(future, under_counter, args, label)

    comm_stream._run_labeled = counted
    try:
        with _Reads(main), _Ops(main):
            step()
    finally:
        comm_stream._run_labeled = run_labeled
    return main, worker


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(VOCAB, (ROWS, COLUMNS), generator=generator)
    targets = tokens.roll(-1, dims=1)
    targets[0, :2] = -100  # ignored: the ranks' item counts differ, weighed over ranks
    return tokens, targets


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def _plain(precision: str, clip: float, rank: int) -> Callable[[], None]:
    """The plain loop: autocast forward, backward, (clip), fused AdamW step, zero_grad."""
    torch.manual_seed(0)
    model = _Tagger()
    optimizer = _adamw(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    x, y = _batch(rank)
    dtype = DTYPES[precision]

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.weights = model.state_dict  # type: ignore[attr-defined]
    return step


def _tessera(strategy: str, precision: str, clip: float, rank: int) -> Callable[[], None]:
    torch.manual_seed(0)
    engine = tessera.setup(
        _Tagger(), _adamw, strategy=strategy, loss_fn=nn.CrossEntropyLoss(),
        precision=precision, grad_clip=clip,
    )  # fmt: skip
    batch = _batch(rank)

    def step() -> None:
        engine.train_step(batch)
        engine.step()

    step.weights = engine.full_state_dict  # type: ignore[attr-defined]
    return step


def _steady(step: Callable[[], None]) -> tuple[collections.Counter, collections.Counter]:
    step()
    step()
    return _one_step(step)


def _counts(configs: list[tuple[str, str, float]]) -> dict[str, Any]:
    """On each rank: per config, host reads and operators of one steady step (tessera), and
    the plain loop's operators per precision; the weights after those 3 steps (fp32)."""
    rank = tessera.init().rank
    out: dict[str, Any] = {"plain": {}, "weights": {}}
    for precision in DTYPES:
        step = _plain(precision, 0.0, rank)
        out["plain"][precision], _ = _steady(step)
        if precision == "fp32":
            out["weights"]["plain"] = step.weights()
    for strategy, precision, clip in configs:
        step = _tessera(strategy, precision, clip, rank)
        main, worker = _steady(step)
        out[f"{strategy} {precision} clip={clip:g}"] = (main, worker)
        if precision == "fp32" and clip == 0:
            out["weights"][strategy] = step.weights()
    return out


CONFIGS = [(s, p, 1.0 if p == "bf16" else 0.0) for s in STRATEGIES for p in DTYPES]
"""Every strategy in every precision; bf16 with the trainer's default clip (1.0), the others
without (`tessera.setup`'s default)."""


@pytest.mark.parametrize("world", [1, 2])
def test_a_steady_step_reads_nothing_from_the_device(run_ranks, world):
    """Zero host reads a step in fp32 and bf16 (clipped), FP16_SYNCS in fp16, on every
    rank, under every data-parallel strategy and single."""
    for counts in run_ranks(_counts, world, CONFIGS):
        reads = {key: _host_reads(main + worker) for key, (main, worker) in _tessera_rows(counts)}
        expected = {
            key: FP16_SYNCS[key.split()[0]] if " fp16 " in key else 0
            for key, _ in _tessera_rows(counts)
        }
        assert reads == expected
        assert all(_host_reads(plain) == 0 for plain in counts["plain"].values())  # the oracle's


def _host_reads(counts: collections.Counter) -> int:
    """Host reads of a step: each `_local_scalar_dense` and each call of a `READS` method."""
    return counts[SYNC] + sum(v for k, v in counts.items() if k.startswith("read "))


def _tessera_rows(counts: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(key, value) for key, value in counts.items() if key not in ("plain", "weights")]


def _allowed_extra(strategy: str, precision: str) -> collections.Counter:
    """The operators a step of `strategy` on one rank adds to the plain loop on the calling
    thread, each from the code (one bucket here: the model is far below the default bucket size).

    - every strategy: 1 `detach`, the loss kept for the returned `StepLoss` without its graph;
    - ddp, zero1-3 (gradients reduced in buckets): per parameter 1 `copy_`, the gradient
      autograd allocated (after `zero_grad(set_to_none=True)`) copied into its bucket's flat
      buffer, which the reduction and the sharded step read (torch DDP copies the same way);
    - zero1-3: per bucket 1 `detach`, the master slice handed to the all-gather that publishes
      it (`HeldMasters.published`); in bf16 (ZeRO keeps bf16 weights, so its gradients are
      bf16) also 1 `copy_`, the gradient slice widened into the float32 buffer torch's AdamW
      reads beside the float32 master (`HeldMasters._widened`, a buffer kept between steps);
    - zero1, whose buckets stay (on one rank its own average): per bucket 1 `slice`, the step's
      gradient, its part of the bucket (`gradient_slice`);
    - zero2/3 (gradient buckets freed once reduced): per bucket 1 `zero_`, the step's gradient
      slice cleared after the step (`ZeroOptimizer.zero_grad`: each round adds into it), and 1
      `zeros`, a fresh bucket buffer at its first gradient (zeroed: its padding is reduced too),
      cut into its members' views once (1 `split_with_sizes`, 1 `view` a parameter).
    zero3's gathers around forward and backward add more (the benchmark reports them); the
    communication stream's worker runs the reductions (ops of their own, beside backward).
    """
    allowed = collections.Counter({"aten.detach.default": 1})
    if strategy == "single":
        return allowed
    allowed["aten.copy_.default"] += PARAMETERS
    if strategy == "ddp":
        return allowed
    allowed["aten.detach.default"] += 1
    if precision == "bf16":
        allowed["aten.copy_.default"] += 1
    if strategy == "zero1":
        allowed["aten.slice.Tensor"] += 1
        return allowed
    allowed["aten.zero_.default"] += 1
    allowed["aten.zeros.default"] += 1
    allowed["aten.split_with_sizes.default"] += 1
    allowed["aten.view.default"] += PARAMETERS
    return allowed


def test_extra_operators_per_step_are_what_the_strategy_needs(run_ranks):
    """On one rank, tessera's step runs the plain loop's operators plus `_allowed_extra`; and
    in fp32 it trains the plain loop's weights bit for bit: on one rank every strategy runs the
    same operators on the same values in the same order (the mean over one rank is the identity,
    and fused AdamW is elementwise, over a parameter or over ZeRO's flat master alike)."""
    configs = [(s, p, 0.0) for p in ("fp32", "bf16") for s in STRATEGIES]
    counts = run_ranks(_counts, 1, configs)[0]
    for strategy, precision, _ in configs:
        main, _ = counts[f"{strategy} {precision} clip=0"]
        extra = main - counts["plain"][precision]  # (ZeRO's bf16 weights: fewer casts, not more)
        if strategy != "zero3":
            assert extra == _allowed_extra(strategy, precision), (strategy, precision, extra)
    plain = counts["weights"]["plain"]
    for strategy in STRATEGIES:
        weights = counts["weights"][strategy]
        assert weights.keys() == plain.keys()
        assert all(torch.equal(weights[k], plain[k]) for k in plain), strategy
