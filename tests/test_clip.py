"""`tessera.optim.clip` (the one global-norm clipping) and `tessera.comm.flat`, against torch's own.

The clipping is checked directly against `torch.nn.utils.clip_grad_norm_`, then through each
engine that calls it (ZeRO, the pipeline) against a plain PyTorch loop on one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.comm.flat import flatten, unflatten_into
from tessera.optim.clip import clip_grad_norm, squared_sum, sum_over

EPS32 = torch.finfo(torch.float32).eps


def _grads(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    return [scale * torch.randn(shape, generator=generator) for shape in shapes]


def _torch_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    norm = float(nn.utils.clip_grad_norm_(params, max_norm))
    return norm, [p.grad for p in params]


@pytest.mark.parametrize(
    ("scale", "max_norm"),
    [
        (1.0, 1.0),  # clipped
        (1.0, 100.0),  # below the bound: untouched
        (1e-8, 1e-8),  # norm ~5e-8: torch's +1e-6 dominates the coefficient (~0.02, not ~0.2)
    ],
)
def test_clip_grad_norm_matches_torch_on_one_process(scale, max_norm):
    grads = _grads(0, scale)
    original = [g.clone() for g in grads]
    norm64 = float(torch.cat([g.double().reshape(-1) for g in grads]).norm())
    torch_norm, torch_grads = _torch_clip(grads, max_norm)
    norm = clip_grad_norm(grads, max_norm)
    # float64 sum of 68 squares: relative error <= 68 * 2^-53, far below 1e-13
    assert norm == pytest.approx(norm64, rel=1e-13)
    assert norm == pytest.approx(torch_norm, rel=4 * EPS32)  # torch sums in float32
    coefficient = min(1.0, max_norm / (norm64 + 1e-6))
    for mine, theirs, before in zip(grads, torch_grads, original):
        exact = before.double() * coefficient
        if coefficient == 1.0:
            assert torch.equal(mine, before)
        # one float32 rounding of the product: half an ulp, |exact| * eps32 bounds it
        assert ((mine.double() - exact).abs() <= EPS32 * exact.abs()).all()
        # torch's coefficient comes from its float32 norm: a few ulps from ours
        torch.testing.assert_close(mine, theirs, rtol=4 * EPS32, atol=0.0)


def test_squared_sum_weights_and_skips_missing_gradients():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0]])
    assert squared_sum([a, None, b]).item() == 30.0
    assert squared_sum([a, None, b], [0.5, 7.0, 0.0]).item() == 12.5
    assert squared_sum([]).dtype == torch.float64


def test_flatten_and_unflatten_into_round_trip_and_refuse_mismatches():
    tensors = [torch.arange(6.0).view(2, 3).t(), torch.tensor([7.0]), torch.zeros(2, 2)]
    flat = flatten(tensors)
    assert torch.equal(flat, torch.tensor([0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 7.0, 0, 0, 0, 0]))
    targets = [torch.empty(3, 2), torch.empty(1), torch.empty(2, 2)]
    unflatten_into(flat * 2, targets)
    for target, tensor in zip(targets, tensors):
        assert torch.equal(target, tensor * 2)
    with pytest.raises(ValueError, match="flat buffer has 3 elements, the tensors 11"):
        unflatten_into(torch.zeros(3), targets)
    with pytest.raises(ValueError, match="one dtype"):
        flatten([torch.zeros(1), torch.zeros(1, dtype=torch.float64)])


class _Scale(nn.Module):
    """A weight used directly in forward (no submodule), as the clip must count it too."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _Scale(8), nn.Linear(8, 8), nn.Linear(8, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)


def _oracle(dtype: torch.dtype, max_norm: float) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain PyTorch on one process: full-batch mean loss, torch's clip, one SGD step (lr 0.1)."""
    model = _model().to(dtype)
    x, y = _data()
    F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
    norm = float(nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return norm, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _within(mine: torch.Tensor, oracle: torch.Tensor, ref64: torch.Tensor) -> bool:
    """|mine - ref64| <= 4 |oracle - ref64| + 16 eps32 |ref64| + tiny, elementwise.

    C = 4: the engines add the same float32 products in another order (micro-batches, shards,
    the cross-rank average), a few roundings more than the oracle; 16 eps32 covers elements
    where the oracle happens to round exactly; 1e-12 covers exact zeros.
    """
    mine, oracle = mine.double(), oracle.double()
    bound = 4 * (oracle - ref64).abs() + 16 * EPS32 * ref64.abs() + 1e-12
    return bool(((mine - ref64).abs() <= bound).all())


def _clip_ranks(max_norm: float) -> dict:
    torch.set_num_threads(1)
    ctx = tessera.init()
    rank, world = ctx.rank, ctx.world_size
    out: dict = {}
    # the helper itself: every rank holds a disjoint part of one gradient list
    grads = _grads(5)
    mine = [g.clone() for i, g in enumerate(grads) if i % world == rank]
    out["helper_norm"] = clip_grad_norm(mine, max_norm, all_reduce=sum_over(None))
    out["helper_grads"] = {i: g for i, g in zip(range(rank, len(grads), world), mine)}
    x, y = _data()
    rows = x.shape[0] // world
    # ZeRO-2: each rank its rows; the optimizer clips the averaged gradient's slices
    model, optimizer = tessera.zero.initialize(_model(), torch.optim.SGD, stage=2, lr=0.1)
    part = slice(rank * rows, (rank + 1) * rows)
    F.mse_loss(model(x[part]), y[part]).backward()
    out["zero_norm"] = optimizer.clip_grad_norm(max_norm)
    optimizer.step()
    out["zero_params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the pipeline: two stages, two micro-batches; each stage clips its own layers' gradients
    pipe = tessera.pipeline.Pipeline(_model(), num_microbatches=2, balance=[3, 2])
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
    out["pipe_norm"] = pipe.clip_grad_norm(max_norm)
    with torch.no_grad():
        for p in pipe.module.parameters():
            p -= 0.1 * p.grad
    out["pipe_params"] = {pipe.full_key(k): v.clone() for k, v in pipe.module.state_dict().items()}
    return out


def test_every_engine_clips_the_global_norm_like_torch_on_one_process(run_ranks):
    max_norm = 0.05  # below every norm here: the scaling is exercised
    results = run_ranks(_clip_ranks, 2, max_norm)
    norm32, params32 = _oracle(torch.float32, max_norm)
    norm64, params64 = _oracle(torch.float64, max_norm)
    helper_norm, helper_grads = _torch_clip(_grads(5), max_norm)
    for result in results:
        assert result["helper_norm"] == pytest.approx(helper_norm, rel=4 * EPS32)
        for i, grad in result["helper_grads"].items():
            torch.testing.assert_close(grad, helper_grads[i], rtol=4 * EPS32, atol=0.0)
        for engine in ("zero", "pipe"):
            error = abs(result[f"{engine}_norm"] - norm64)
            assert error <= 4 * abs(norm32 - norm64) + 16 * EPS32 * norm64, engine
    for name in params64:
        assert _within(results[0]["zero_params"][name], params32[name], params64[name]), name
    stage_params = {**results[0]["pipe_params"], **results[1]["pipe_params"]}
    assert stage_params.keys() == params64.keys()
    for name, value in stage_params.items():
        assert _within(value, params32[name], params64[name]), name
