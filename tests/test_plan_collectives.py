"""The planner prices the data-parallel collectives tessera's engines issue, no others, and
the gradients they hold.

`tessera plan` adds each strategy's gradient and parameter collectives to its step
(`plan.search.data_parallel_collectives`). Here the oracle is the engine itself: a user's model
(a `ModuleDict` of blocks, a tied head, a frozen layer) trains one step through `tessera.setup`
on 2 ranks, with and without gradient accumulation, and every collective it calls is read
from tessera's own record of them (`comm.diagnostics.history`). Their kinds and the elements
they move, summed per kind, must be what the planner lists for the same strategy: a planner
that priced ZeRO-1's all-reduce as a reduce-scatter (half the bytes), or a reduce-scatter per
accumulated micro-batch, fails here. Scalar collectives (the clipped norm, the loss) move a
value a rank and are not the planner's: they are left out by their size. While accumulating,
ZeRO-2/3 hold whole gradient buckets (the engine's `no_sync`), read from the engine's own count
of what it holds (`zero.memory.held_bytes`).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import nn

import tessera
from tessera.comm import diagnostics
from tessera.plan.cluster import preset
from tessera.plan.model import ModelSpec
from tessera.plan.search import Strategy, data_parallel_collectives, estimate
from tessera.zero.memory import held_bytes

VOCAB, WIDTH, ROWS, COLUMNS = 20, 12, 8, 5


class _Blocks(nn.Module):
    """A model tessera never built: a list of blocks, each a ModuleDict (ZeRO-3 units), the
    head tied to the embedding, a frozen projection (no gradient, nothing to reduce)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"mix": nn.Linear(WIDTH, WIDTH), "norm": nn.LayerNorm(WIDTH)})
            for _ in range(3)
        )
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block["mix"](block["norm"](x)))
        x = self.norm(self.frozen(x))
        return (x @ self.embed.weight.t()).transpose(1, 2)  # (rows, vocab, columns)


def _trained(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)  # tied: counted once


def _one_step(strategy: str, accumulate: int) -> tuple[collections.Counter, int, int]:
    """Elements moved per collective kind in one optimizer step (after a warm-up step), the
    trained parameter count and those outside the blocks (ZeRO-3's root unit)."""
    rank = tessera.init().rank
    torch.manual_seed(0)
    model = _Blocks()
    engine = tessera.setup(
        model, lambda params: torch.optim.SGD(params, lr=0.1), strategy=strategy,
        loss_fn=nn.CrossEntropyLoss(), grad_clip=1.0, grad_accum=accumulate,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(rank)
    batch = [torch.randint(VOCAB, (ROWS, COLUMNS), generator=generator) for _ in range(2)]
    engine.train_step(batch)
    engine.step()
    before = diagnostics.history()[-1].seq if diagnostics.history() else -1
    engine.train_step(batch)
    engine.step()
    moved: collections.Counter = collections.Counter()
    for entry in diagnostics.history():
        elements = int(torch.Size(entry.shape).numel())
        if entry.kind == "all_gather":  # recorded: this rank's slice; priced: the output
            elements *= len(entry.group_ranks)
        if entry.seq > before and elements > len(entry.group_ranks):
            moved[entry.kind] += elements
    return moved, _trained(model), _trained(model) - _trained(model.blocks)


def _both(runs: list[tuple[str, int]]) -> list[Any]:
    return [_one_step(strategy, k) for strategy, k in runs]


RUNS = [(s, k) for s in ("ddp", "zero1", "zero2", "zero3") for k in (1, 2)]


@pytest.fixture(scope="module")
def measured() -> list[list[Any]]:
    return tessera.launch(_both, 2, RUNS, deadline_s=120.0)


@pytest.mark.parametrize("run", range(len(RUNS)), ids=[f"{s}-accum{k}" for s, k in RUNS])
def test_the_planner_lists_the_collectives_each_engine_calls(measured, run):
    strategy, accumulate = RUNS[run]
    zero = 0 if strategy == "ddp" else int(strategy[-1])
    for moved, params, root in (ranks[run] for ranks in measured):
        s = Strategy(dp=2, zero=zero, microbatches=accumulate)
        planned = data_parallel_collectives(s, params, "fp32", one_host=True, root=root)
        expected: collections.Counter = collections.Counter()
        for kind, nbytes in planned:
            expected[kind] += int(nbytes) // 4  # fp32: 4 bytes an element
        assert moved == expected


def _cluster():
    return preset("a100-80g-dgx", 2)


def _held_while_accumulating(stage: int) -> tuple[int, int]:
    """Gradient bytes a ZeRO engine holds when the second of 2 accumulated micro-batches
    starts (after the first one's backward, under `no_sync`), and the trained parameter count."""
    tessera.init()
    torch.manual_seed(0)
    model = _Blocks()
    engine = tessera.setup(
        model, lambda params: torch.optim.SGD(params, lr=0.1), strategy=f"zero{stage}",
        loss_fn=nn.CrossEntropyLoss(), grad_accum=2,
    )  # fmt: skip
    held: list[int] = []
    forwards = [0]

    def look(module: nn.Module, args: Any) -> None:
        forwards[0] += 1
        if forwards[0] == 2:
            held.append(held_bytes(engine.zero)["gradients"])

    model.register_forward_pre_hook(look)
    batch = [torch.randint(VOCAB, (ROWS, COLUMNS)) for _ in range(2)]
    engine.train_step(batch)
    engine.step()
    return held[0], _trained(model)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_planner_counts_the_whole_gradients_zero_holds_while_accumulating(run_ranks, stage):
    """Under accumulation ZeRO-2/3 keep whole gradient buckets until the last micro-batch
    (their `no_sync`): the planner's gradient memory is that, not ZeRO's Ψ/N alone."""
    for held, params in run_ranks(_held_while_accumulating, 2, stage):
        s = Strategy(dp=2, zero=stage, microbatches=2)
        planned = estimate(s, ModelSpec(params=params, seq=COLUMNS), _cluster(), batch=ROWS,
                           microbatch=ROWS // 2, precision="fp32")  # fmt: skip
        assert held == planned.grads
