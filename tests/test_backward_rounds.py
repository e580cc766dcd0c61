"""Several backward passes before one step (issue 10, finding 4): each one is reduced.

torch's DDP reduces every backward that follows a forward, so after k backwards `.grad` is the sum
over backwards of the group-mean gradient. tessera must give that for forward/backward pairs
without `no_sync`, for a second `backward(retain_graph=True)` of the same forward, and for a loss
on a parameter used again outside forward; and where a gradient cannot be reduced any more, it
must raise naming the parameter instead of leaving it on one rank. Checked for DataParallel and
ZeRO 1-3 (also ZeRO 1-2 through their multi-host reduce-scatter path) against a plain PyTorch
oracle written here: gradients, then one SGD step without momentum (a wrong factor must show).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.data_parallel import DataParallel
from tessera.errors import RankFailedError
from tessera.zero import full_state_dict, initialize

WORLD = 3  # a mean over 3 is not exact in binary, and 3 shards split unevenly
LR = 0.1
SCENARIOS = ("pairs", "retain_graph", "outside_forward")
ENGINES = ("ddp", "zero1", "zero1_ring", "zero2", "zero2_ring", "zero3")
EPS32 = torch.finfo(torch.float32).eps


class _Blocks(nn.Module):
    """Not tessera's kind of model: a ModuleDict whose children are called one by one, a weight
    used directly in forward (`F.linear(x, self.weight)`), a module called twice, a one-weight
    unit, and a forward under no_grad in the middle (its result is only looked at)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 5) * 0.4)
        self.blocks = nn.ModuleDict(
            {"norm": nn.LayerNorm(6), "mix": nn.Linear(6, 6), "head": nn.Linear(6, 3)}
        )
        self.gain = nn.Parameter(torch.tensor([1.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks["norm"](F.linear(x, self.weight))
        h = torch.tanh(self.blocks["mix"](h))
        with torch.no_grad():
            _ = self.blocks["head"](h)  # an inference-only call of a trained module
        h = torch.tanh(self.blocks["mix"](h))
        return self.blocks["head"](h) * self.gain


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return _Blocks().to(dtype)


def _data(rank: int, world: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """This rank's share of two global batches (8 rows each; 3 ranks get 3, 3 and 2)."""
    g = torch.Generator().manual_seed(7)
    xa, xb = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    ya, yb = torch.randint(0, 3, (8,), generator=g), torch.randint(0, 3, (8,), generator=g)
    pick = {"xa": xa, "xb": xb, "ya": ya, "yb": yb}
    return {
        k: v.tensor_split(world)[rank].to(dtype if v.is_floating_point() else v.dtype)
        for k, v in pick.items()
    }


def _backwards(scenario: str, forward: Callable, weight: nn.Parameter, d: dict) -> list:
    """The losses of one round, backwarded in order (`forward` is the wrapped model or not)."""
    if scenario == "pairs":  # accumulation over two forward/backward pairs, no no_sync
        return [
            lambda: F.cross_entropy(forward(d["xa"]), d["ya"]),
            lambda: F.cross_entropy(forward(d["xb"]), d["yb"]),
        ]
    out: dict[str, torch.Tensor] = {}

    def first() -> torch.Tensor:
        out["y"] = forward(d["xa"])
        return F.cross_entropy(out["y"], d["ya"])

    if scenario == "retain_graph":  # a second loss on the same forward's graph
        return [first, lambda: out["y"].square().mean()]
    # an auxiliary loss on a parameter used again outside forward, on rank-local data
    return [first, lambda: F.linear(d["xb"], weight).square().mean()]


def _oracle(scenario: str, world: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Plain PyTorch: per backward, the mean over ranks of each rank's gradient; summed."""
    model = _model(dtype)
    names = [n for n, _ in model.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    rounds = len(_backwards(scenario, model, model.weight, _data(0, world, dtype)))
    for k in range(rounds):
        per_rank = []
        for rank in range(world):
            losses = _backwards(scenario, model, model.weight, _data(rank, world, dtype))
            for earlier in losses[:k]:
                earlier()  # rebuild the graph the k-th loss depends on
            grads = torch.autograd.grad(losses[k](), list(model.parameters()), allow_unused=True)
            per_rank.append(
                [torch.zeros_like(p) if g is None else g for g, p in zip(grads, model.parameters())]
            )
        for i, name in enumerate(names):
            total[name] += sum(grads[i] for grads in per_rank) / world
    stepped = {n: p.detach() - LR * total[n] for n, p in model.named_parameters()}
    return total, stepped


def _ratio(actual: torch.Tensor, oracle: torch.Tensor, ref64: torch.Tensor, terms: int) -> float:
    """Largest |actual - ref64| / bound; <= 1 passes.

    The engine and the oracle sum the same float32 per-rank gradients in different orders, so
    each is off the float64 value by its own roundings: allow 4x the oracle's distance (another
    order of `terms` additions is a few times worse at most, not orders of magnitude), plus a
    floor of `terms` roundings of the largest element where the oracle happens to be exact.
    """
    distance = (actual.double() - ref64).abs()
    bound = 4 * (oracle.double() - ref64).abs() + terms * EPS32 * ref64.abs().max()
    return (distance / bound.clamp_min(1e-30)).max().item()


def _flat_slice(flat, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """`values` laid out like ZeRO's flat buffer `flat`, this rank's slice of it."""
    pieces = [values[name].reshape(-1) for name in flat.layout.names]
    full = torch.cat(pieces)
    full = torch.cat([full, full.new_zeros(flat.flat_param.numel() - full.numel())])
    return full[flat.lo : flat.hi]


def _run_engine(engine: str, scenario: str, ctx) -> float | str:
    model = _model()
    stage = 0 if engine == "ddp" else int(engine[4])
    wrapped, opt = initialize(model, torch.optim.SGD, stage=stage, lr=LR)
    if engine.endswith("_ring"):
        opt.one_host = False  # the reduce-scatter / all-gather path of groups across hosts
    try:
        for loss in _backwards(scenario, wrapped, model.weight, _data(ctx.rank, ctx.world_size)):
            loss().backward(retain_graph=scenario == "retain_graph")
        grads32, stepped32 = _oracle(scenario, ctx.world_size, torch.float32)
        grads64, stepped64 = _oracle(scenario, ctx.world_size, torch.float64)
        terms = ctx.world_size * 2  # two backwards of every rank
        ratios = []
        if stage == 0:
            for name, param in model.named_parameters():
                ratios.append(_ratio(param.grad, grads32[name], grads64[name], terms))
        else:
            for flat, grad in zip(opt.flats, opt.gradient_slices()):
                ours = [_flat_slice(flat, g) for g in (grads32, grads64)]
                ratios.append(_ratio(grad, *ours, terms))
        opt.step()
        for name, value in full_state_dict(model).items():
            ratios.append(_ratio(value, stepped32[name], stepped64[name], terms + 1))
        return max(ratios)
    except Exception as exc:  # noqa: BLE001 - reported per case, so one failure names its case
        return f"{type(exc).__name__}: {exc}"
    finally:
        (opt if stage else wrapped.reducer).remove_hooks()


def _all_cases(cases: list[tuple[str, str]]) -> dict[str, float | str]:
    ctx = tessera.init()
    return {
        f"{engine}/{scenario}": _run_engine(engine, scenario, ctx) for engine, scenario in cases
    }


def test_every_backward_is_reduced_as_torch_ddp_does(run_ranks):
    # ZeRO-3 keeps only shards between forwards: a parameter read outside forward has no storage
    # and torch raises (as under FSDP2), so "outside_forward" is not run for it.
    cases = [(e, s) for e in ENGINES for s in SCENARIOS if e != "zero3" or s != "outside_forward"]
    for found in run_ranks(_all_cases, WORLD, cases):
        assert all(isinstance(v, float) and v <= 1.0 for v in found.values()), found


class _AuxiliaryWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 4, bias=False)  # not used by forward; the first bucket

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _gradient_after_its_bucket_was_reduced() -> None:
    ctx = tessera.init()
    model = _AuxiliaryWeight()
    dp = DataParallel(model, find_unused_parameters=True, bucket_cap_mb=1e-5)
    assert dp.buckets[0].names == ["aux.weight"]
    out = dp(torch.full((2, 4), float(ctx.rank)))  # `aux` is unused: its bucket is sent now
    (out.sum() + model.aux(out).sum()).backward()  # ...and then it gets a gradient


def test_a_gradient_that_cannot_be_reduced_any_more_names_its_parameter(run_ranks):
    expected = r"parameter 'aux.weight' received a second gradient after its bucket was launched"
    with pytest.raises(RankFailedError, match=expected):
        run_ranks(_gradient_after_its_bucket_was_reduced, 2, deadline_s=60)
