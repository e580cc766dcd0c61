"""Tensor parallelism equals the dense module: outputs, gradients, parameters after steps."""

from __future__ import annotations

import copy
from collections import OrderedDict
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import (
    ChannelParallelConv2d,
    ColumnParallelLinear,
    RowParallelConv2d,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_state_dict,
    parallelize,
    parallelize_gpt,
    vocab_parallel_cross_entropy,
)
from tessera.tensor_parallel._comm import STATS

WAIT_S = 60.0
"""Bound of every wait between ranks here: a hang reports within a minute."""

_F32_EPS = torch.finfo(torch.float32).eps


def _assert_near_float64(got, oracle, ref64, what, reduction_length):
    """`got` (fp32, its sums split over ranks) is as close to the float64 reference as the fp32
    one-process oracle is, within a factor 4 (the split regroups each sum into t partial sums
    plus the all-reduce, at most doubling the rounding error, doubled again for slack across
    CPU kernels), plus a floor of one rounding per reduced term (`reduction_length` terms up to
    max|ref64|) for elements the oracle happened to get exact."""
    err = (got.detach().double() - ref64).abs().max().item()
    oracle_err = (oracle.detach().double() - ref64).abs().max().item()
    floor = reduction_length * _F32_EPS * ref64.abs().max().item()
    assert err <= 4 * oracle_err + floor, f"{what}: error {err:.3g}, oracle's {oracle_err:.3g}"


def _double(t):
    return t.double() if t.is_floating_point() else t


def _train(models, batches, loss_fn, make_optimizer):
    """Train each of (tensor-parallel, dense fp32, dense fp64) on the same batches."""
    for model in models:
        optimizer = make_optimizer(model.parameters())
        cast = _double if next(model.parameters()).dtype == torch.float64 else (lambda t: t)
        for x, y in batches:
            loss_fn(model(cast(x)), cast(y)).backward()
            optimizer.step()
            optimizer.zero_grad()


def _close_states(tp, dense, dense64, reduction_length):
    """The gathered tensor-parallel state against the dense fp32 and fp64 ones."""
    tp_state, state, state64 = full_state_dict(tp), dense.state_dict(), dense64.state_dict()
    assert tp_state.keys() == state.keys()
    for key, value in state.items():
        _assert_near_float64(tp_state[key], value, state64[key], key, reduction_length)


def _check_mlp():
    torch.manual_seed(0)
    dense = nn.Sequential(
        OrderedDict(up=nn.Linear(8, 16), act=nn.GELU(), down=nn.Linear(16, 8), out=nn.Linear(8, 4))
    )
    tp = parallelize(copy.deepcopy(dense), {"up": "column", "down": "row", "out": "column_gather"})
    assert isinstance(tp.up, ColumnParallelLinear) and isinstance(tp.down, RowParallelLinear)
    assert tp.up.weight.shape == (8, 8)  # half of 16 output features on each of 2 ranks
    dense64 = copy.deepcopy(dense).double()
    x = torch.randn(6, 8, requires_grad=True)
    x_tp = x.detach().clone().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    outs = [tp(x_tp), dense(x), dense64(x64)]
    _assert_near_float64(*outs, "output", 16)  # sums of 16 features at most
    for out in outs:
        out.square().sum().backward()
    # f all-reduced the input gradient
    _assert_near_float64(x_tp.grad, x.grad, x64.grad, "input gradient", 16)
    # parameter gradients (AdamW below would hide a constant factor): this rank's slices
    rank = tessera.init().rank
    split = {"up.weight": 0, "up.bias": 0, "down.weight": 1, "out.weight": 0, "out.bias": 0}
    dense_params, params64 = dict(dense.named_parameters()), dict(dense64.named_parameters())
    for name, p in tp.named_parameters():
        want, want64 = dense_params[name].grad, params64[name].grad
        if name in split:
            want, want64 = (g.chunk(2, split[name])[rank] for g in (want, want64))
        # each gradient sums over the 6 rows (and 16 features back through down and up)
        _assert_near_float64(p.grad, want, want64, f"gradient of {name}", 6 * 16)
    for model in (dense, tp):
        model.zero_grad()

    # a row layer fed the whole input slices it, and all-gathers its gradient backward
    row = RowParallelLinear.from_dense(copy.deepcopy(dense.down), input_is_parallel=False)
    h = torch.randn(5, 16)
    h_row, h_dense, h64 = (h.clone().requires_grad_() for _ in range(3))
    h64 = h64.detach().double().requires_grad_()
    down64 = copy.deepcopy(dense.down).double()
    outs = [row(h_row), dense.down(h_dense), down64(h64)]
    _assert_near_float64(*outs, "row layer on a whole input", 16)
    for out in outs:
        out.square().sum().backward()
    _assert_near_float64(h_row.grad, h_dense.grad, h64.grad, "its input gradient", 8)
    for model in (dense, dense64):
        model.zero_grad()
    batches = [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(3)]
    # AdamW: every parameter here has a non-zero gradient, so Adam's division is harmless.
    _train((tp, dense, dense64), batches, F.mse_loss, partial(torch.optim.AdamW, lr=1e-2))
    _close_states(tp, dense, dense64, 6 * 16)
    # one all-reduce forward (g, after down) and one backward (f, before up), plus out's gather
    calls = STATS["calls"]
    tp(x_tp).sum().backward()
    assert STATS["calls"] - calls == 4  # g + gather forward; f(up) + f(out) backward


def _check_gpt():
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16)
    torch.manual_seed(0)
    dense = GPT(config)
    dense64 = copy.deepcopy(dense).double()
    tp = parallelize_gpt(copy.deepcopy(dense))
    idx = torch.randint(0, 16, (3, 8))
    _assert_near_float64(tp(idx), dense(idx), dense64(idx), "logits", 2 * 4 * 16)
    batches = [(torch.randint(0, 16, (3, 8)), torch.randint(0, 16, (3, 8))) for _ in range(3)]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    # SGD with momentum: attention key biases have a true gradient of zero (DESIGN.md, Testing).
    sgd = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    _train((tp, dense, dense64), batches, loss_fn, sgd)
    _close_states(tp, dense, dense64, 3 * 8 * 16)  # a weight gradient sums 3 x 8 tokens


def _check_vocab_and_conv():
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
    dense = nn.ModuleDict({"embed": embed, "head": head})
    dense64 = copy.deepcopy(dense).double()
    tp = parallelize(copy.deepcopy(dense), {"embed": "vocab", "head": "vocab"})
    assert isinstance(tp["embed"], VocabParallelEmbedding)
    ids, targets = torch.randint(0, 10, (4, 5)), torch.randint(0, 10, (4, 5))
    # each id's row comes from one rank, the others add exact zeros
    assert torch.equal(tp["embed"](ids), embed(ids))
    dense_loss = F.cross_entropy(head(embed(ids)).flatten(0, 1), targets.flatten())
    logits64 = dense64["head"](dense64["embed"](ids))
    loss64 = F.cross_entropy(logits64.flatten(0, 1), targets.flatten())
    local_logits = tp["head"](tp["embed"](ids))  # (4, 5, 10/2): this rank's vocabulary slice
    tp_loss = vocab_parallel_cross_entropy(local_logits, targets).mean()
    # a softmax over 10 logits (each a sum of 6), averaged over 20 tokens
    _assert_near_float64(tp_loss, dense_loss, loss64, "loss", 10 * 6 + 20)
    for loss in (dense_loss, tp_loss, loss64):
        loss.backward()
    full = {n: p.grad for n, p in tp.named_parameters()}
    rank, size = tessera.init().rank, 2
    for name in ("embed.weight", "head.weight"):
        want = dict(dense.named_parameters())[name].grad.chunk(size)[rank]
        want64 = dict(dense64.named_parameters())[name].grad.chunk(size)[rank]
        _assert_near_float64(full[name], want, want64, f"gradient of {name}", 20 * 10)

    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    conv64 = copy.deepcopy(conv).double()
    conv_tp = parallelize(copy.deepcopy(conv), {"0": "column"})
    assert isinstance(conv_tp[0], ChannelParallelConv2d) and conv_tp[0].weight.shape[0] == 4
    images = torch.randn(2, 3, 6, 6)
    batches = [(images, torch.randn(2, 4, 4, 4)) for _ in range(2)]
    _train((conv_tp, conv, conv64), batches, F.mse_loss, partial(torch.optim.AdamW, lr=1e-2))
    _close_states(conv_tp, conv, conv64, 2 * 6 * 6)  # weight gradients sum 2 x 6 x 6 positions


class _ConvNet(nn.Module):
    """A CNN unlike tessera's own: two convolutions paired column -> row, a pooling between
    them, a conv called directly on the row conv's output twice through a ModuleDict."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 6, 3, stride=2, padding=1)
        self.tail = nn.ModuleDict({"act": nn.Tanh(), "mix": nn.Conv2d(6, 6, 1)})

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)  # channel-wise: fine on split channels
        h = self.c2(h)
        return self.tail["mix"](self.tail["act"](self.tail["mix"](h)))


def _check_row_conv():
    """`{"c1": "column", "c2": "row"}` equals the dense CNN: outputs, input and parameter
    gradients, one SGD step without momentum, with one all-reduce forward and one backward."""
    rank = tessera.init().rank
    torch.manual_seed(0)
    dense = _ConvNet()
    dense64 = copy.deepcopy(dense).double()
    tp = parallelize(copy.deepcopy(dense), {"c1": "column", "c2": "row"})
    assert isinstance(tp.c1, ChannelParallelConv2d) and not tp.c1.gather_output
    assert isinstance(tp.c2, RowParallelConv2d) and tp.c2.weight.shape == (6, 4, 3, 3)
    x = torch.randn(2, 3, 8, 8)
    x_tp, x_dense, x64 = (x.clone().requires_grad_() for _ in range(3))
    x64 = x64.detach().double().requires_grad_()
    calls = STATS["calls"]
    out = tp(x_tp)
    assert STATS["calls"] - calls == 1  # g after c2 only: c1's output stays split
    out_dense, out64 = dense(x_dense), dense64(x64)
    # the longest reduction: c2's 8 channels x 3 x 3 taps per output, then mix's 6 channels twice
    _assert_near_float64(out, out_dense, out64, "output", 8 * 9 + 2 * 6)
    target = torch.randn_like(out_dense)
    calls = STATS["calls"]
    F.mse_loss(out, target).backward()
    assert STATS["calls"] - calls == 1  # f before c1 only
    F.mse_loss(out_dense, target).backward()
    F.mse_loss(out64, target.double()).backward()
    # weight gradients sum over batch x positions: 2 x 8 x 8 at c1
    reduction = 2 * 8 * 8
    _assert_near_float64(x_tp.grad, x_dense.grad, x64.grad, "input gradient", reduction)
    split = {"c1.weight": 0, "c1.bias": 0, "c2.weight": 1}  # c2.bias is replicated
    dense_params, params64 = dict(dense.named_parameters()), dict(dense64.named_parameters())
    for name, p in tp.named_parameters():
        want, want64 = dense_params[name].grad, params64[name].grad
        if name in split:  # this rank's slice of the dense gradient
            want, want64 = (g.chunk(2, split[name])[rank] for g in (want, want64))
        _assert_near_float64(p.grad, want, want64, f"gradient of {name}", reduction)
    for model in (tp, dense, dense64):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    full, state64 = full_state_dict(tp), dense64.state_dict()
    for name, value in dense.state_dict().items():
        _assert_near_float64(full[name], value, state64[name], f"stepped {name}", reduction)

    # the row conv alone, fed the whole input (it keeps its channel slice)
    conv = nn.Conv2d(4, 5, 3, padding=1)
    alone = RowParallelConv2d.from_dense(copy.deepcopy(conv), input_is_parallel=False)
    images = torch.randn(2, 4, 5, 5)
    i_tp, i_dense, i64 = (images.clone().requires_grad_() for _ in range(3))
    i64 = i64.detach().double().requires_grad_()
    outs = [alone(i_tp), conv(i_dense), copy.deepcopy(conv).double()(i64)]
    _assert_near_float64(*outs, "row conv on a whole input", 4 * 9)
    for out in outs:
        out.square().sum().backward()
    _assert_near_float64(i_tp.grad, i_dense.grad, i64.grad, "its input gradient", 5 * 9)


def _check_bad_input():
    with pytest.raises(ValueError, match="c1: weight dimension 0 \\(5\\) is not divisible"):
        odd = nn.Sequential(OrderedDict(c1=nn.Conv2d(3, 5, 3), c2=nn.Conv2d(5, 4, 3)))
        parallelize(odd, {"c1": "column", "c2": "row"})
    assert isinstance(odd.c1, nn.Conv2d) and isinstance(odd.c2, nn.Conv2d)  # nothing replaced
    with pytest.raises(ValueError, match="not divisible"):
        parallelize(nn.Sequential(nn.Linear(4, 5)), {"0": "column"})
    with pytest.raises(ValueError, match="not divisible"):
        parallelize_gpt(GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=3, n_embd=12)))


def tp_worker():
    tessera.init(timeout_s=WAIT_S)
    torch.manual_seed(1)  # the same data on both ranks, as tensor parallelism needs
    _check_mlp()
    _check_gpt()
    _check_vocab_and_conv()
    _check_row_conv()
    _check_bad_input()
    return True


def test_tensor_parallel_layers_equal_dense_modules_on_two_ranks(run_ranks):
    assert run_ranks(tp_worker, 2, deadline_s=120) == [True, True]


def test_plan_errors_before_any_communication():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="matches no submodule"):
        parallelize(model, {"nope.*": "column"})
    with pytest.raises(ValueError, match="unknown tensor-parallel style"):
        parallelize(model, {"0": "diagonal"})
    with pytest.raises(ValueError, match="style 'row' takes"):
        parallelize(model, {"1": "row"})
    with pytest.raises(ValueError, match="0 matches plan patterns '0' and '\\?'"):
        parallelize(model, {"0": "column", "?": "row"})
    assert isinstance(model[0], nn.Linear)  # nothing was replaced


def test_conv_plan_errors_name_the_layer_and_replace_nothing():
    def net(c1, c2, between=None):
        layers = OrderedDict(c1=c1, act=nn.ReLU())
        if between is not None:
            layers["between"] = between
        return nn.Sequential(OrderedDict(**layers, c2=c2))

    cases = [
        (net(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3, groups=2)), "c2: .*needs groups=1"),
        (
            net(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.Conv2d(4, 4, 3)),
            "c1: .*needs zero padding",
        ),
        (
            net(nn.Conv2d(3, 8, 3), nn.Conv2d(4, 6, 3), between=nn.Conv2d(8, 4, 1)),
            "c2: its 4 input channels do not match the 8 output channels of the column conv c1",
        ),
    ]
    for model, message in cases:
        with pytest.raises(ValueError, match=message):
            parallelize(model, {"c1": "column", "c2": "row"})
        assert type(model.c1) is nn.Conv2d and type(model.c2) is nn.Conv2d
    lonely = net(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3))
    with pytest.raises(ValueError, match="c2: a row-parallel Conv2d .* the plan has none"):
        parallelize(lonely, {"c2": "row"})
    assert type(lonely.c2) is nn.Conv2d
