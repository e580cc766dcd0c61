"""ZeRO-3 on models unlike tessera's own, against plain PyTorch on the whole batch.

Each case is a small model whose forward uses its parameters in a way tessera's GPT does not:
blocks kept in `nn.ModuleDict`s whose children are called one by one, a parameter used directly
(`F.linear(x, self.weight)`), a module called twice, units of one weight, a `torch.no_grad()`
forward between a training forward and its backward, a second (input) gradient after the units
were freed, activation checkpointing, and units chosen with `units=` (classes, name patterns,
nested). For each, on every rank: the gradient slices after one backward, the parameters after
one SGD step without momentum and after three AdamW steps, against an oracle written here as a
plain PyTorch loop; and that units are freed (at most `max_gathered` at once in forward, none
after the step), so that gathering everything once could not pass.

Tolerance. Nothing here is exact: ZeRO averages per-rank means of a split batch where the oracle
takes one mean. Both are fp32 computations of the same float64 quantity, rounding at every
operation in a different order, so each tensor must satisfy
    |zero - ref64| <= C * |oracle32 - ref64| + eps,   C = 4,
(max over the tensor): two orders of one sum have error bounds of the same size, and 4 leaves
room for the two extra roundings of the split (the per-rank mean, the cross-rank mean).
eps = n * 2^-24 * max|ref64| with n the longest reduction (batch rows times the widest layer)
covers tensors that the oracle happens to get exactly right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tessera
from tessera.zero import full_state_dict, initialize
from tessera.zero.partition import padded_numel

IN, WIDTH, CLASSES, BATCH = 5, 8, 4, 12
SGD_LR, ADAMW_LR, ADAMW_STEPS = 0.2, 1e-2, 3
C = 4
"""Allowed multiple of the oracle's own fp32 error (see the module docstring)."""
REDUCTION = BATCH * 2 * WIDTH
"""Longest sum in the forward/backward: batch rows times the widest layer."""
ROUNDING = 2.0**-24


class Gate(nn.Module):
    """A parameter used directly in its owner's forward, not through `nn.Linear`."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(h, self.weight))


class Scale(nn.Module):
    """One weight of one element: a unit smaller than the world (the other shards are padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.9]))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight


class StemHead(nn.Module):
    """Stem and head held by the root unit; subclasses define the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(IN, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self.stem(x)))

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DictBlocks(StemHead):
    """Blocks as `nn.ModuleDict`s whose children are called one by one (the unit never is)."""

    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(WIDTH), "lin": nn.Linear(WIDTH, WIDTH)})
            for _ in range(num_blocks)
        )

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + torch.tanh(block["lin"](block["norm"](h)))
        return h


class DirectWeights(StemHead):
    """`F.linear` on the owner's own weight: `Gate`s called from `ModuleDict`s, and the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"gate": Gate()}) for _ in range(2))
        self.mix = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + block["gate"](h)
        return F.linear(h, self.mix)


class CalledTwice(StemHead):
    """A module called twice in one block, and a whole unit called twice around another."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(WIDTH), "lin": nn.Linear(WIDTH, WIDTH)})
            for _ in range(2)
        )
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block["norm"](h + torch.tanh(block["lin"](block["norm"](h))))
        first, second = self.layers
        return torch.tanh(first(torch.tanh(second(torch.tanh(first(h))))))


class OneWeightUnits(StemHead):
    """Units holding one weight: a scalar (alone in a `ModuleDict`) and a bias-free `Linear`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"scale": Scale()}), nn.Linear(WIDTH, WIDTH, bias=False), Scale()]
        )

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        h = self.layers[0]["scale"](h)
        return self.layers[2](torch.tanh(self.layers[1](h)))


class Layers(StemHead):
    """tessera-like: `nn.Sequential` layers in an `nn.ModuleList`, called as a whole."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(2)
        )

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + layer(h)
        return h


class CheckpointedLayers(Layers):
    """Activation checkpointing: backward runs each layer's forward again, with its own
    saved-tensor hooks (ZeRO-3's must not replace them)."""

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + checkpoint(layer, h, use_reentrant=False)
        return h


class Block(nn.Module):
    """Not in any container: only `units=` makes it a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.gate = Gate()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gate(self.norm(h))


class Attributes(StemHead):
    """Blocks held as plain attributes (no `ModuleList`): the default finds no unit."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(h))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    _loss(model, x, y).backward()
    return None


def _no_grad_forward_before_backward(model, x, y) -> None:
    loss = _loss(model, x, y)
    with torch.no_grad():  # evaluation in between: it gathers and frees every unit
        model(x)
    loss.backward()
    return None


def _input_gradient_after_backward(model, x, y) -> torch.Tensor:
    """A backward, then a second pass through the same graph (retained) for d loss / d x."""
    x = x.clone().requires_grad_(True)
    loss = _loss(model, x, y)
    loss.backward(retain_graph=True)  # frees every unit as its gradients are reduced
    (grad_x,) = torch.autograd.grad(loss, x)  # needs every unit's weights again
    return grad_x


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    train: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor | None] = _backward
    """Forward and backward on one batch; may return an input gradient to compare too."""
    units: Any = None
    num_flats: int | None = None
    """Flat buffers `units=` must give (root + units), where the case checks the choice."""
    max_gathered: int | None = None
    """Bound on the units gathered at once during forward (root, current, prefetched)."""


CASES = [
    Case("module_dict_children_called_one_by_one", DictBlocks, max_gathered=3),
    Case("parameter_used_directly_by_f_linear", DirectWeights),
    Case("module_called_twice", CalledTwice),
    Case("units_of_one_weight", OneWeightUnits, num_flats=4),
    Case("no_grad_forward_between_forward_and_backward", Layers, _no_grad_forward_before_backward),
    Case("input_gradient_after_units_were_freed", Layers, _input_gradient_after_backward),
    Case("activation_checkpointing", CheckpointedLayers),
    Case("units_given_as_classes", Attributes, units=[Block], num_flats=3),
    Case(
        "units_given_as_nested_patterns",
        DictBlocks,
        units=["stem", "blocks.*", "blocks.*.lin"],
        num_flats=1 + 1 + 2 * 4,
        max_gathered=4,  # root, a block, its `lin` and the next unit prefetched
    ),
]


def _build(case: Case, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return case.build().to(dtype)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _assert_close(what: str, zero: torch.Tensor, oracle: torch.Tensor, ref: torch.Tensor) -> None:
    """|zero - ref64| <= C |oracle32 - ref64| + eps over the tensor (module docstring)."""
    error = (zero.double() - ref).abs().max().item()
    oracle_error = (oracle.double() - ref).abs().max().item()
    eps = REDUCTION * ROUNDING * ref.abs().max().item()
    assert error <= C * oracle_error + eps, (
        f"{what}: |zero - ref64| = {error:.3g} > {C} * {oracle_error:.3g} + {eps:.3g}"
    )


def _oracle(case: Case, dtype: torch.dtype) -> dict[str, Any]:
    """Plain PyTorch on the whole batch: gradients, one SGD step, ADAMW_STEPS AdamW steps."""
    found: dict[str, Any] = {}
    model = _build(case, dtype)
    x, y = _batch(0)
    found["input_grad"] = case.train(model, x.to(dtype), y)
    found["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    found["sgd"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    model = _build(case, dtype)
    adamw = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, weight_decay=0.1)
    for step in range(ADAMW_STEPS):
        x, y = _batch(step)
        adamw.zero_grad()
        case.train(model, x.to(dtype), y)
        adamw.step()
    found["adamw"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return found


def _grad_slice(grads: dict[str, torch.Tensor], flat: Any) -> torch.Tensor:
    """The oracle's gradients laid out like ZeRO's flat buffer, padded, cut to this rank's slice."""
    full = torch.cat([grads[name].reshape(-1) for name in flat.layout.names])
    padded = full.new_zeros(padded_numel(full.numel(), dist.get_world_size()))
    padded[: full.numel()] = full
    return padded[flat.lo : flat.hi]


def _gathered(opt: Any) -> int:
    return sum(flat.flat_param.untyped_storage().nbytes() > 0 for flat in opt.flats)


def _check_case(case: Case, ctx: Any) -> None:
    oracle, ref = _oracle(case, torch.float32), _oracle(case, torch.float64)
    mine = lambda t: t.tensor_split(ctx.world_size)[ctx.rank]  # noqa: E731
    model, opt = initialize(_build(case), torch.optim.SGD, stage=3, units=case.units, lr=SGD_LR)
    if case.num_flats is not None:
        assert len(opt.flats) == case.num_flats, f"{len(opt.flats)} flat buffers"
    peak = [0]
    watch = [
        m.register_forward_pre_hook(lambda *_: peak.__setitem__(0, max(peak[0], _gathered(opt))))
        for m in model.modules()
    ]
    x, y = _batch(0)
    input_grad = case.train(model, mine(x), mine(y))
    for handle in watch:
        handle.remove()
    if case.max_gathered is not None:
        assert peak[0] <= case.max_gathered, f"{peak[0]} units gathered at once in forward"
    if input_grad is not None:  # our loss is the mean over this rank's rows: world times theirs
        scale = ctx.world_size
        _assert_close(
            "d loss / d x", input_grad, mine(oracle["input_grad"]) * scale,
            mine(ref["input_grad"]) * scale,
        )  # fmt: skip
    for flat, grad in zip(opt.flats, opt.gradient_slices()):
        _assert_close(
            f"gradient of {flat.layout.names}", grad, _grad_slice(oracle["grads"], flat),
            _grad_slice(ref["grads"], flat),
        )  # fmt: skip
    opt.step()
    assert _gathered(opt) == 0, "a unit stayed gathered after backward and step"
    after_sgd = full_state_dict(model)
    opt.remove_hooks()
    for name in oracle["sgd"]:
        _assert_close(f"{name} after SGD", after_sgd[name], oracle["sgd"][name], ref["sgd"][name])

    model, opt = initialize(
        _build(case), torch.optim.AdamW, stage=3, units=case.units, lr=ADAMW_LR, weight_decay=0.1
    )
    for step in range(ADAMW_STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        case.train(model, mine(x), mine(y))
        opt.step()
    after_adamw = full_state_dict(model)
    opt.remove_hooks()
    for name in oracle["adamw"]:
        _assert_close(
            f"{name} after AdamW", after_adamw[name], oracle["adamw"][name], ref["adamw"][name]
        )


def _bad_units() -> list[str]:
    """`units=` entries that cannot be meant: each must be refused with its name."""
    attempts = [
        lambda: initialize(DictBlocks(), torch.optim.SGD, stage=3, units=["blocks.*", "blok.*"]),
        lambda: initialize(DictBlocks(), torch.optim.SGD, stage=3, units=[nn.GRU]),
        lambda: initialize(DictBlocks(), torch.optim.SGD, stage=3, units=[3]),
        lambda: initialize(DictBlocks(), torch.optim.SGD, stage=2, units=["blocks.*"]),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def _every_case(names: list[str]) -> list[str]:
    """Check the named cases (a failure raises on its rank and ends the run), then bad input."""
    ctx = tessera.init()
    torch.set_num_threads(1)
    for case in CASES:
        if case.name in names:
            try:
                _check_case(case, ctx)
            except Exception as exc:
                raise AssertionError(f"case {case.name}, rank {ctx.rank}: {exc}") from exc
    return _bad_units()


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_equals_plain_pytorch_on_models_unlike_tesseras(run_ranks, world):
    bad = run_ranks(_every_case, world, [case.name for case in CASES])[0]
    assert "ValueError: units= entry 'blok.*' matches no submodule of DictBlocks" in bad[0], bad
    assert "ValueError: units= entry 'GRU' matches no submodule" in bad[1], bad
    assert "TypeError: units= takes module classes or name patterns (str), got 3" in bad[2], bad
    assert "ValueError: units= chooses ZeRO-3's gather units; stage 2" in bad[3], bad
