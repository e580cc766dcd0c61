"""Interleaved 1F1B (v model chunks per rank) against a plain PyTorch loop written here.

The model is the user's `nn.Sequential`, unlike anything tessera builds: a token embedding whose
weight the output head reuses (tied across the first and the last rank), and one `nn.Linear`
placed twice in the chain (its two uses land in two chunks of the same rank, so its gradient
accumulates there without an exchange). It is trained through `tessera.setup(strategy=
"pipeline" / "hybrid", schedule="interleaved", virtual_stages=v)`; the oracle is the same model
on the whole batch in one process, in float32, and the yardstick the same in float64
(`_tolerance.check_close`): the loss, this rank's gradients, one SGD step, three AdamW steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close, to_float64
from torch import nn

import tessera
from tessera.models import GPT, GPTConfig
from tessera.pipeline import Pipeline, bubble_fraction, max_in_flight, schedule, simulate

VOCAB, WIDTH, SEQ, ROWS = 13, 8, 3, 8
SGD_LR, ADAMW_LR = 0.5, 1e-2


class TiedHead(nn.Module):
    """Logits from the embedding's own weight (the user's tied output layer)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding, self.norm = embedding, nn.LayerNorm(WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h) @ self.embedding.weight.t()


def _chain() -> nn.Sequential:
    """8 layers: embedding, six hidden ones (layer 1 is layer 5 too), the tied head."""
    torch.manual_seed(0)  # every rank and the oracle: the same initial weights
    emb, shared = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH)
    hidden = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(
        emb, shared, hidden[0], hidden[1], hidden[2], shared, hidden[3], TiedHead(emb)
    )


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _shard(batch: tuple, rank: int, world: int) -> tuple:
    rows = ROWS // world
    return tuple(t[rank * rows : (rank + 1) * rows] for t in batch)


def _grads(engine: Any) -> dict[str, torch.Tensor]:
    return {engine.full_key(k): p.grad for k, p in engine.pipe.module.named_parameters()}


def _gpt() -> nn.Module:
    """tessera's GPT (4 blocks: one per chunk of p = 2, v = 2), for tensor parallelism."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=4, n_embd=8, n_head=2, block_size=SEQ))


def _check(
    ctx: Any, strategy: str, factory: Callable[[], nn.Module] = _chain, **options: Any
) -> None:
    """Loss, this rank's gradients and one SGD step; then three AdamW steps (the user's model:
    the GPT's attention key biases have a true gradient of zero, which Adam amplifies, see
    DESIGN.md); all against the oracle. Tensor-parallel shards: the whole tensors only."""
    engine = tessera.setup(
        factory(),
        lambda ps: torch.optim.SGD(ps, lr=SGD_LR),
        strategy=strategy,
        loss_fn=_loss,
        ctx=ctx,
        **options,
    )
    assert len(engine.pipe.module) == options["virtual_stages"]  # v chunks on this rank
    oracle, exact = factory(), factory().double()
    batch = _batch(0)
    loss = engine.train_step(_shard(batch, ctx.rank, ctx.world_size))
    want = _loss(oracle(batch[0]), batch[1])
    exact_loss = _loss(exact(batch[0]), batch[1])
    check_close([loss], [want.item()], [exact_loss.item()], what=f"{strategy} loss")
    want.backward()
    exact_loss.backward()
    named = [dict(m.named_parameters(remove_duplicate=False)) for m in (oracle, exact)]
    mine = {k: g for k, g in _grads(engine).items() if g.shape == named[0][k].shape}
    assert mine
    check_close(
        mine,
        {k: named[0][k].grad for k in mine},
        {k: named[1][k].grad for k in mine},
        what=f"{strategy} rank {ctx.rank} gradients",
    )
    engine.step()
    for model in (oracle, exact):
        torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    state = engine.full_state_dict()
    assert list(state) == list(oracle.state_dict())
    check_close(state, oracle.state_dict(), exact.state_dict(), what=f"{strategy} after SGD")
    engine.close()
    if factory is not _chain:
        return

    engine = tessera.setup(
        factory(),
        lambda ps: torch.optim.AdamW(ps, lr=ADAMW_LR),
        strategy=strategy,
        loss_fn=_loss,
        ctx=ctx,
        **options,
    )
    oracle, exact = factory(), factory().double()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=ADAMW_LR) for m in (oracle, exact)]
    for step in range(3):
        batch = _batch(step)
        engine.train_step(_shard(batch, ctx.rank, ctx.world_size))
        engine.step()
        for model, optimizer, b in zip((oracle, exact), optimizers, (batch, to_float64(batch))):
            _loss(model(b[0]), b[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
    state = engine.full_state_dict()
    check_close(
        state, oracle.state_dict(), exact.state_dict(), what=f"{strategy} after 3 AdamW steps"
    )
    batch = _batch(9)  # evaluation: the chunks forward only, the same loss as the oracle's
    got = engine.eval_step(_shard(batch, ctx.rank, ctx.world_size))
    with torch.no_grad():
        check_close(
            [got],
            [_loss(oracle(batch[0]), batch[1]).item()],
            [_loss(exact(batch[0]), batch[1]).item()],
            what=f"{strategy} eval loss",
        )
    engine.close()


def _cases() -> None:
    ctx = tessera.init()
    # p=2, v=2: chunks [0,1] [4,5] on rank 0 (the shared Linear twice), [2,3] [6,7] on rank 1
    _check(
        ctx,
        "pipeline",
        schedule="interleaved",
        virtual_stages=2,
        microbatches=4,
        split=["2", "4", "6"],
    )
    # v=4: eight one-layer chunks balanced by parameters (None: p*v stages), m=2 one group
    _check(ctx, "pipeline", schedule="interleaved", virtual_stages=4, microbatches=2)
    with pytest.raises(ValueError, match="multiple of 2"):
        tessera.setup(
            _chain(),
            torch.optim.SGD,
            strategy="pipeline",
            schedule="interleaved",
            virtual_stages=2,
            microbatches=3,
            loss_fn=_loss,
            ctx=ctx,
        )
    bad_split = "gives 2 stages, but the pipeline has 4 ranks .interleaved"  # needs p*v - 1 = 3
    with pytest.raises(ValueError, match=bad_split):
        tessera.setup(
            _chain(),
            torch.optim.SGD,
            strategy="pipeline",
            schedule="interleaved",
            virtual_stages=2,
            split=["4"],
            loss_fn=_loss,
            ctx=ctx,
        )


def test_interleaved_pipeline_equals_a_plain_loop(run_ranks):
    run_ranks(_cases, 2)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_schedule_runs_and_has_its_closed_form_bubble(p, v):
    for m in (p, 2 * p, 4 * p):
        actions = schedule("interleaved", p, m, v)
        for stage in actions:  # every (chunk, micro-batch) forward and backward once
            assert sorted((a.kind, a.chunk, a.microbatch) for a in stage) == sorted(
                (k, c, i) for k in "FB" for c in range(v) for i in range(m)
            )
        timeline = simulate(actions, forward_time=1.0, backward_time=2.0)
        span = max(end for stage in timeline for _, _, end in stage)
        ideal = 3.0 * m  # each stage's work: m forwards and backwards of all its chunks
        assert span - ideal == pytest.approx(bubble_fraction("interleaved", p, m, v) * ideal)
        # v times smaller than 1F1B's; in flight: at most the warm-up's forwards and one more
        one = simulate(schedule("1f1b", p, m), forward_time=1.0, backward_time=2.0)
        one_span = max(end for stage in one for _, _, end in stage)
        assert (span - ideal) * v == pytest.approx(one_span - ideal)
        assert max_in_flight(actions[0]) <= min(m * v, 2 * (p - 1) + (v - 1) * p + 1)


def test_interleaved_bad_input_is_refused_up_front():
    with pytest.raises(ValueError, match="multiple of 4"):
        schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        schedule("interleaved", 2, 4, 1)
    with pytest.raises(ValueError, match="needs schedule 'interleaved'"):
        tessera.pipeline.PipelinePolicy(schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="nn.Sequential"):  # one rank: no ring to interleave on
        Pipeline(_chain(), num_microbatches=2, schedule="interleaved", virtual_stages=2)


def _hybrid_cases() -> None:
    ctx = tessera.init()
    # dp=2 x pp=2, v=2: each replica's two ranks hold two chunks each
    _check(ctx, "hybrid", dp=2, pp=2, schedule="interleaved", virtual_stages=2, microbatches=2)
    # tp=2 x pp=2, v=2 on the GPT (its blocks one per chunk, sharded within each stage)
    _check(
        ctx, "hybrid", _gpt, tp=2, pp=2, schedule="interleaved", virtual_stages=2, microbatches=2
    )


@pytest.mark.slow
def test_interleaved_on_the_hybrid_mesh_equals_a_plain_loop(run_ranks):
    run_ranks(_hybrid_cases, 4)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ({"schedule": "interleaved", "virtual_stages": 2, "microbatches": 3}, "multiple of pp"),
        ({"virtual_stages": 2}, "needs schedule 'interleaved'"),
        ({"schedule": "interleaved"}, "needs virtual_stages >= 2"),  # v = 1: no chunks
        (
            {"schedule": "interleaved", "virtual_stages": 3, "microbatches": 4},
            "4 GPT blocks cannot fill 6 chunks",
        ),
    ],
)
def test_tessera_train_refuses_bad_interleaving_before_any_rank_starts(layer, message):
    from tessera.errors import ConfigError
    from tessera.train import build_config

    base = {"strategy": "pipeline", "nproc": 2, "model": {"n_layer": 4}}
    with pytest.raises(ConfigError, match=message):
        build_config(base, layer)
