"""Mesh axes, 4-stage pipelines, and the GPT on dp x tp x pp meshes equal to one process."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tolerance import check_close
from test_pipeline import _check_mlp  # tests/ is on sys.path under pytest

import tessera
from tessera.models import GPT, GPTConfig
from tessera.pipeline import HybridPolicy
from tessera.runtime.mesh import AXES, Mesh
from tessera.strategies.engine import Engine
from tessera.strategies.pipeline import PipelineEngine

CONFIG = GPTConfig(vocab_size=12, block_size=8, n_layer=2, n_head=4, n_embd=16)
GLOBAL_BATCH = 8


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _sgd(params):
    # SGD with momentum: attention key biases have a true gradient of zero, which Adam would
    # turn into reduction-order noise of full size (DESIGN.md, Testing)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, 12, (GLOBAL_BATCH, 8), generator=generator),
            torch.randint(0, 12, (GLOBAL_BATCH, 8), generator=generator),
        )
        for _ in range(3)
    ]


def _step(engine, x, y):
    loss = engine.train_step((x, y))
    norm = engine.clip_grad_norm(0.5)  # below the norms seen here: clipping is active
    engine.step()  # grad_clip=0: the optimizer step alone, at its own lr (0.1)
    return loss, norm


def _check_mesh(ctx):
    mesh = Mesh(dp=2, tp=2)
    assert [mesh.size(axis) for axis in AXES] == [1, 2, 2]
    assert mesh.rank("tp") == ctx.rank % 2 and mesh.rank("dp") == ctx.rank // 2
    assert dist.get_process_group_ranks(mesh.group("tp")) == [ctx.rank - ctx.rank % 2] + [
        ctx.rank - ctx.rank % 2 + 1
    ]
    value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(value, group=mesh.group("dp"))
    assert value.item() == (0 + 2 if ctx.rank % 2 == 0 else 1 + 3)
    with pytest.raises(ValueError, match="the world has 4"):
        Mesh(dp=3)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        mesh.group("sp")


def hybrid_worker(degrees):
    ctx = tessera.init()
    _check_mesh(ctx)
    for name in ("naive", "gpipe", "1f1b"):  # every schedule on 4 stages too (same spawn)
        for m in (4, 6):
            _check_mlp(name, m, batch=7)
    torch.manual_seed(0)
    base = GPT(CONFIG)
    batches = _batches()
    reference = Engine(copy.deepcopy(base), _sgd, ctx, loss_fn=_loss)
    expected = [_step(reference, x, y) for x, y in batches]
    # float64: the exact answer
    exact = Engine(copy.deepcopy(base).double(), _sgd, ctx, loss_fn=_loss)
    exact_steps = [_step(exact, x, y) for x, y in batches]
    rows = GLOBAL_BATCH // ctx.world_size
    shard = slice(ctx.rank * rows, (ctx.rank + 1) * rows)  # the loop's per-rank shard
    for dp, tp, pp, zero in degrees:
        policy = HybridPolicy(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=2)
        make = partial(PipelineEngine, loss_fn=_loss, policy=policy)
        engine = make(copy.deepcopy(base), _sgd, ctx)
        # this rank keeps its stage's tensors only; other stages' layers are freed (meta)
        assert not any(p.is_meta for p in engine.pipe.module.parameters())
        assert any(p.is_meta for p in engine.module.parameters()) == (pp > 1)
        for (x, y), oracle, exact_step in zip(batches[:2], expected, exact_steps):
            # losses and norms: sums over micro-batches, shards and ranks in another order
            ours = _step(engine, x[shard], y[shard])
            check_close(ours, oracle, exact_step, what=f"loss, norm {dp, tp, pp, zero}")
        if zero:  # this rank's optimizer holds half of its stage's parameters (dp = 2)
            stage_numel = sum(p.numel() for p in engine.pipe.module.parameters())
            (slice_,) = engine.optimizer.param_groups[0]["params"]
            assert slice_.numel() == -(-stage_numel // 2)
            # between steps ZeRO-2 holds no full gradient, ZeRO-1 all of them
            engine.train_step(tuple(t[shard] for t in batches[0]))
            held = [p.grad is not None for p in engine.pipe.module.parameters()]
            assert not any(held) if zero == 2 else all(held)
            engine.zero.inner.zero_grad()
        state = engine.state_dict()  # checkpoint after 2 steps, resume in a fresh engine
        resumed = make(GPT(CONFIG), _sgd, ctx)
        resumed.load_state_dict(state)
        x, y = batches[2]
        _step(resumed, x[shard], y[shard])
        full = resumed.full_state_dict()
        assert full.keys() == reference.module.state_dict().keys()
        # 3 SGD steps of reordered float32 sums, measured against the float64 run
        check_close(
            {k: full[k] for k in exact.module.state_dict()},
            reference.module.state_dict(),
            exact.module.state_dict(),
            what=f"weights {dp, tp, pp, zero}",
        )
    return True


@pytest.mark.slow
def test_hybrid_meshes_train_the_gpt_like_one_process(run_ranks):
    # (dp, tp, pp, zero): zero=1 shards each stage's optimizer state over its dp group (ZeRO-1),
    # zero=2 its gradients too, reduced bucket by bucket during the stage's W pass (ZeRO-2)
    degrees = [(2, 2, 1, 0), (1, 2, 2, 0), (2, 1, 2, 0), (1, 1, 4, 0), (1, 4, 1, 0)]
    degrees += [(2, 1, 2, 1), (2, 2, 1, 1), (2, 1, 2, 2), (2, 2, 1, 2)]
    assert run_ranks(hybrid_worker, 4, degrees, deadline_s=180) == [True] * 4


def test_mesh_must_multiply_to_the_world_size():
    with pytest.raises(ValueError, match="the world has 1"):
        Mesh(dp=2, tp=1)
    with pytest.raises(ValueError, match="positive int"):
        Mesh(dp=0)


def test_axes_are_named_outermost_first():
    # pp outermost, tp innermost: tp peers are consecutive ranks (checked in _check_mesh)
    assert AXES == ("pp", "dp", "tp")
