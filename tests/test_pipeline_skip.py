"""Values that skip stages of a traced pipeline reach every stage that uses them.

A value made in stage 0 and used only in stage 2 (a skip connection over the middle stage) must
travel through stage 1, which does not use it; so must a value used by two later stages that are
not the next one, a value of the middle of a 4-stage cut used only by the last, and a value only
the model's output returns. The oracle is the same model run whole in the test: the chained stages
(one process, any number of stages) must give its output and gradients exactly, and
`tessera.setup(..., strategy="pipeline")` on 3 ranks its loss, gradients and SGD step (float64
yardstick, `_tolerance.check_close`).
"""

from __future__ import annotations

import torch
from _tolerance import check_close, to_float64
from torch import nn

import tessera
from tessera.pipeline.trace import trace_stages

ROWS, LR = 12, 0.5


class Skip(nn.Module):
    """A skip over the middle: `skip` is made before `b` (stage 0) and added after `c` (stage
    2); stage 1 (`b`) never reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        skip = h * 0.5
        h = torch.tanh(self.b(h))
        return self.c(h) + skip


class Long(nn.Module):
    """Four stages: `early` (stage 0) is used by stages 2 and 3, not by 1; `mid` (stage 1) only
    by stage 3; the input itself by stage 3 (every stage reads its micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.s0, self.s1, self.s2, self.s3 = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.s0(x))
        early = h.sigmoid()
        h = torch.tanh(self.s1(h))
        mid = h * h
        h = torch.tanh(self.s2(h)) * early
        return self.s3(h) + early + mid + x


class Aux(nn.Module):
    """A stage-0 value that no stage computes with, only the model's output returns (an
    auxiliary output: hidden states a user's loss reads), beside the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        early = torch.tanh(self.a(x))
        aux = early * 2  # made in stage 0, read by no stage
        return {"logits": self.c(torch.relu(self.b(early))), "aux": aux}


def _chain(model: nn.Module, split: list[str], x: torch.Tensor) -> tuple[list, torch.Tensor]:
    stages, _ = trace_stages(model, split, x)
    received: tuple = ()
    for stage in stages[:-1]:
        received = stage.run(x, received)
    return stages, stages[-1].run(x, received)


def _values(out: torch.Tensor | dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return list(out.values()) if isinstance(out, dict) else [out]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _check_chain(factory: type, split: list[str]) -> list:
    torch.manual_seed(0)
    model, whole = factory(), factory()
    whole.load_state_dict(model.state_dict())
    x = torch.randn(ROWS, 6)
    stages, out = _chain(model, split, x)
    want = whole(x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    sum(v.square().sum() for v in _values(out)).backward()  # the model's own parameters train
    sum(v.square().sum() for v in _values(want)).backward()
    mine, theirs = _grads(model), _grads(whole)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=name)
    return stages


def test_a_skip_over_the_middle_stage_passes_through_it():
    stages = _check_chain(Skip, ["b", "c"])
    # the skip is received and sent on by stage 1, which does not use it
    through = set(stages[1].receives) & set(stages[1].sends)
    assert len(through) == 1 and len(stages[0].sends) == 2 and len(stages[2].receives) == 2


def test_values_used_by_two_later_stages_and_by_the_last_only_reach_them():
    stages = _check_chain(Long, ["s1", "s2", "s3"])
    # stage 1 forwards `early`; stage 2 forwards `early` and `mid` (with its own h)
    assert [len(s.receives) for s in stages] == [0, 2, 3, 3]


def test_a_value_only_the_models_output_returns_reaches_the_last_stage():
    stages = _check_chain(Aux, ["b", "c"])
    assert [len(s.receives) for s in stages] == [0, 2, 2]  # `aux` rides along to the end


def _skip_on_three_ranks() -> None:
    ctx = tessera.init()
    torch.manual_seed(0)
    model, oracle = Skip(), Skip()
    oracle.load_state_dict(model.state_dict())
    exact = Skip().double()
    exact.load_state_dict(to_float64(model.state_dict()))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 8, generator=g)
    rows = slice(ctx.rank * ROWS // 3, (ctx.rank + 1) * ROWS // 3)  # this rank's shard
    engine = tessera.setup(
        model, lambda p: torch.optim.SGD(p, lr=LR), strategy="pipeline", ctx=ctx,
        loss_fn=nn.functional.mse_loss, split=["b", "c"], microbatches=2,
    )  # fmt: skip
    loss = engine.train_step((x[rows], y[rows]))
    losses = [
        nn.functional.mse_loss(m(v), t)
        for m, v, t in ((oracle, x, y), (exact, x.double(), y.double()))
    ]
    check_close([loss], [losses[0].item()], [losses[1].item()], what=f"rank {ctx.rank} loss")
    for value in losses:
        value.backward()
    mine = {engine.full_key(k): p.grad for k, p in engine.pipe.module.named_parameters()}
    assert mine and {k.partition(".")[0] for k in mine} == {"abc"[ctx.rank]}  # its stage
    named = [dict(m.named_parameters()) for m in (oracle, exact)]
    check_close(
        mine, {k: named[0][k].grad for k in mine}, {k: named[1][k].grad for k in mine},
        what=f"rank {ctx.rank} gradients",
    )  # fmt: skip
    engine.step()
    for m in (oracle, exact):
        torch.optim.SGD(m.parameters(), lr=LR).step()
    check_close(engine.full_state_dict(), oracle.state_dict(), exact.state_dict(), what="SGD")
    engine.close()


def test_a_skip_over_the_middle_stage_trains_as_the_whole_model_on_three_ranks(run_ranks):
    run_ranks(_skip_on_three_ranks, 3)
