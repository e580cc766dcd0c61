"""Tensor parallelism equals the dense module: outputs, gradients, parameters after steps."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import (
    ChannelParallelConv2d,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_state_dict,
    parallelize,
    parallelize_gpt,
    vocab_parallel_cross_entropy,
)
from tessera.tensor_parallel._comm import STATS

# Split matmuls sum their products in another order than the dense ones (and the all-reduce adds
# partial sums): equal up to float32 rounding of values O(1), so 1e-5 absolute / relative.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _close_states(tp_state, dense_state):
    assert tp_state.keys() == dense_state.keys()
    for key, value in dense_state.items():
        torch.testing.assert_close(tp_state[key], value, **TOL, msg=key)


def _train(model, batches, loss_fn, optimizer):
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _check_mlp():
    torch.manual_seed(0)
    dense = nn.Sequential(
        OrderedDict(up=nn.Linear(8, 16), act=nn.GELU(), down=nn.Linear(16, 8), out=nn.Linear(8, 4))
    )
    tp = parallelize(copy.deepcopy(dense), {"up": "column", "down": "row", "out": "column_gather"})
    assert isinstance(tp.up, ColumnParallelLinear) and isinstance(tp.down, RowParallelLinear)
    assert tp.up.weight.shape == (8, 8)  # half of 16 output features on each of 2 ranks
    x = torch.randn(6, 8, requires_grad=True)
    x_tp = x.detach().clone().requires_grad_()
    torch.testing.assert_close(tp(x_tp), dense(x), **TOL)
    dense(x).square().sum().backward()
    tp(x_tp).square().sum().backward()
    torch.testing.assert_close(x_tp.grad, x.grad, **TOL)  # f all-reduced the input gradient
    batches = [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(3)]
    # AdamW: every parameter here has a non-zero gradient, so Adam's division is harmless.
    _train(dense, batches, F.mse_loss, torch.optim.AdamW(dense.parameters(), lr=1e-2))
    _train(tp, batches, F.mse_loss, torch.optim.AdamW(tp.parameters(), lr=1e-2))
    _close_states(full_state_dict(tp), dense.state_dict())
    # one all-reduce forward (g, after down) and one backward (f, before up), plus out's gather
    calls = STATS["calls"]
    tp(x_tp).sum().backward()
    assert STATS["calls"] - calls == 4  # g + gather forward; f(up) + f(out) backward


def _check_gpt():
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16)
    torch.manual_seed(0)
    dense = GPT(config)
    tp = parallelize_gpt(copy.deepcopy(dense))
    idx = torch.randint(0, 16, (3, 8))
    torch.testing.assert_close(tp(idx), dense(idx), **TOL)
    batches = [(torch.randint(0, 16, (3, 8)), torch.randint(0, 16, (3, 8))) for _ in range(3)]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    # SGD with momentum: attention key biases have a true gradient of zero (DESIGN.md, Testing).
    _train(dense, batches, loss_fn, torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9))
    _train(tp, batches, loss_fn, torch.optim.SGD(tp.parameters(), lr=0.1, momentum=0.9))
    _close_states(full_state_dict(tp), dense.state_dict())


def _check_vocab_and_conv():
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
    dense = nn.ModuleDict({"embed": embed, "head": head})
    tp = parallelize(copy.deepcopy(dense), {"embed": "vocab", "head": "vocab"})
    assert isinstance(tp["embed"], VocabParallelEmbedding)
    ids, targets = torch.randint(0, 10, (4, 5)), torch.randint(0, 10, (4, 5))
    torch.testing.assert_close(tp["embed"](ids), embed(ids), **TOL)
    dense_loss = F.cross_entropy(head(embed(ids)).flatten(0, 1), targets.flatten())
    local_logits = tp["head"](tp["embed"](ids))  # (4, 5, 10/2): this rank's vocabulary slice
    tp_loss = vocab_parallel_cross_entropy(local_logits, targets).mean()
    torch.testing.assert_close(tp_loss, dense_loss, **TOL)
    dense_loss.backward()
    tp_loss.backward()
    full = {n: p.grad for n, p in tp.named_parameters()}
    rank, size = tessera.init().rank, 2
    torch.testing.assert_close(full["embed.weight"], embed.weight.grad.chunk(size)[rank], **TOL)
    torch.testing.assert_close(full["head.weight"], head.weight.grad.chunk(size)[rank], **TOL)

    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    conv_tp = parallelize(copy.deepcopy(conv), {"0": "column"})
    assert isinstance(conv_tp[0], ChannelParallelConv2d) and conv_tp[0].weight.shape[0] == 4
    images = torch.randn(2, 3, 6, 6)
    batches = [(images, torch.randn(2, 4, 4, 4)) for _ in range(2)]
    _train(conv, batches, F.mse_loss, torch.optim.AdamW(conv.parameters(), lr=1e-2))
    _train(conv_tp, batches, F.mse_loss, torch.optim.AdamW(conv_tp.parameters(), lr=1e-2))
    _close_states(full_state_dict(conv_tp), conv.state_dict())


def _check_bad_input():
    with pytest.raises(ValueError, match="not divisible"):
        parallelize(nn.Sequential(nn.Linear(4, 5)), {"0": "column"})
    with pytest.raises(ValueError, match="not divisible"):
        parallelize_gpt(GPT(GPTConfig(vocab_size=8, n_layer=1, n_head=3, n_embd=12)))


def tp_worker():
    tessera.init()
    torch.manual_seed(1)  # the same data on both ranks, as tensor parallelism needs
    _check_mlp()
    _check_gpt()
    _check_vocab_and_conv()
    _check_bad_input()
    return True


def test_tensor_parallel_layers_equal_dense_modules_on_two_ranks(run_ranks):
    assert run_ranks(tp_worker, 2, timeout_s=120) == [True, True]


def test_plan_errors_before_any_communication():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="matches no submodule"):
        parallelize(model, {"nope.*": "column"})
    with pytest.raises(ValueError, match="unknown tensor-parallel style"):
        parallelize(model, {"0": "diagonal"})
    with pytest.raises(ValueError, match="style 'row' takes"):
        parallelize(model, {"1": "row"})
    assert isinstance(model[0], nn.Linear)  # nothing was replaced
