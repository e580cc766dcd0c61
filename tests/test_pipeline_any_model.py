"""Pipeline and hybrid training of models unlike tessera's GPT, against a plain PyTorch loop.

The engines are `tessera.strategies.pipeline.PipelineEngine` (pipeline and hybrid); the oracle is
the same model trained here on the whole global batch by plain PyTorch (float32), and the
yardstick the same in float64 (`_tolerance.check_close`). For each model, on every rank: the loss
and this rank's stage gradients after one `train_step`, the whole model after one SGD step
(`full_state_dict`, plain keys), and after three AdamW steps with a fresh engine.

Models: a residual network whose blocks sit in an `nn.ModuleDict` called one by one, with a
parameter used directly in forward, an attention-like mask computed in the first stage and used
in every block (so two tensors cross the stage boundary) and its output head tied to its
embedding (the tied gradient is summed across stages); a tiny Hugging Face BERT classifier built
from a config, trained on dict batches with its own loss; an MLP with a user loss, as a plain
module (traced) and as an `nn.Sequential` (cut at its layers, untraced).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close, to_float64
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import tessera
from tessera.models import GPT, GPTConfig
from tessera.pipeline import HybridPolicy, PipelinePolicy
from tessera.pipeline.trace import trace_stages
from tessera.strategies.pipeline import PipelineEngine, _tensor_parallel

VOCAB, WIDTH, SEQ, ROWS = 11, 8, 5, 8
SGD_LR, ADAMW_LR = 0.5, 1e-2


class ResidualNet(nn.Module):
    """Not a chain: ModuleDict blocks on a residual stream, a mask every block reads, a scale
    parameter used directly, and the output head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleDict({f"b{i}": nn.Linear(WIDTH, WIDTH) for i in range(4)})
        self.scale = nn.Parameter(torch.ones(WIDTH) + 0.1 * torch.randn(WIDTH))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: Any = None) -> torch.Tensor:
        h = self.emb(ids)  # (labels: the batch's, for the user's loss_fn(output, batch))
        keep = mask.unsqueeze(-1).float()
        for name in ("b0", "b1", "b2", "b3"):
            h = h + torch.tanh(self.blocks[name](h)) * keep
        return (h * self.scale) @ self.emb.weight.t()


class MLP(nn.Module):
    """A plain MLP module (its forward is traced to be cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Branchy(nn.Module):
    """A forward with data-dependent Python control flow: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.body = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        if h.sum() > 0:
            h = -h
        return self.body(h)


def _seq_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=SEQ,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def _user_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss of the user's, not a torch one: mean of a Huber-like penalty."""
    d = output - targets
    return (torch.sqrt(1 + d * d) - 1).mean()


def _residual_loss(output: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), batch["labels"].flatten())


def _residual_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    mask = torch.rand(ROWS, SEQ, generator=g) > 0.3
    return {
        "ids": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
        "mask": mask,
        "labels": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
    }


def _bert_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[::3, -2:] = 0  # padded rows: the extended mask matters
    return {
        "input_ids": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (ROWS,), generator=g),
    }


def _mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def _decay(step: int) -> float:
    """A learning-rate schedule of the user's: big steps first (the lr the steps must use)."""
    return 4.0 / (1 + step) ** 2


def _built(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)  # every rank and the oracle: the same initial weights
    return factory()


def _shard(batch: Any, rank: int, world: int) -> Any:
    """This rank's rows of the global batch (what a data loader hands each rank)."""
    rows = ROWS // world
    if isinstance(batch, Mapping):
        return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
    return tuple(t[rank * rows : (rank + 1) * rows] for t in batch)


def _oracle_loss(model: nn.Module, batch: Any, loss_fn: Any) -> torch.Tensor:
    if isinstance(batch, Mapping):
        out = model(**batch)
        return loss_fn(out, batch) if loss_fn is not None else out.loss
    return loss_fn(model(batch[0]), batch[1])


def named_shape(model: nn.Module, key: str) -> torch.Size:
    return dict(model.named_parameters())[key].shape


def _double(batch: Any) -> Any:
    if isinstance(batch, tuple):
        return tuple(to_float64(t) for t in batch)
    return to_float64(batch)


def _stage_grads(engine: Any) -> dict[str, torch.Tensor]:
    return {engine.full_key(k): p.grad for k, p in engine.pipe.module.named_parameters()}


def _check_model(
    ctx,
    factory,
    batch_fn,
    loss_fn,
    build,
    policy,
    skip_adamw=(),
    sharded=False,
    resume=False,
    clip=0.0,
):
    """Loss, gradients and one SGD step (clipped to `clip` if set); then three AdamW steps with
    a LambdaLR schedule attached to `engine.optimizer`; all against the oracle. `resume`: then a
    fresh engine loaded from `state_dict()` takes a fourth step bit for bit."""
    rank, world = ctx.rank, ctx.world_size
    engine = build(
        _built(factory),
        lambda ps: torch.optim.SGD(ps, lr=SGD_LR),
        ctx,
        loss_fn=loss_fn,
        grad_clip=clip,
        policy=policy,
    )
    oracle, exact = _built(factory), _built(factory).double()
    batch = batch_fn(0)
    loss = engine.train_step(_shard(batch, rank, world))
    oracle_loss = _oracle_loss(oracle, batch, loss_fn)
    exact_loss = _oracle_loss(exact, _double(batch), loss_fn)
    check_close([loss], [oracle_loss.item()], [exact_loss.item()], what=f"{factory.__name__} loss")
    oracle_loss.backward()
    exact_loss.backward()
    mine = _stage_grads(engine)
    assert mine, "this rank's stage holds parameters"
    if sharded:  # tensor-parallel shards: compare the unsharded parameters only
        mine = {k: g for k, g in mine.items() if g.shape == named_shape(oracle, k)}
    named = [dict(m.named_parameters(remove_duplicate=False)) for m in (oracle, exact)]
    check_close(
        mine,
        {k: named[0][k].grad for k in mine},
        {k: named[1][k].grad for k in mine},
        what=f"{factory.__name__} rank {rank} gradients",
    )
    engine.step()
    for model in (oracle, exact):
        if clip:  # the global norm, the tied embedding counted once
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip  # it acts
        torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    state = engine.full_state_dict()
    assert list(state) == list(oracle.state_dict())  # the user's model's own keys, in order
    check_close(
        state, oracle.state_dict(), exact.state_dict(), what=f"{factory.__name__} after SGD"
    )
    engine.close()

    engine = build(
        _built(factory),
        lambda ps: torch.optim.AdamW(ps, lr=ADAMW_LR),
        ctx,
        loss_fn=loss_fn,
        policy=policy,
    )
    oracle, exact = _built(factory), _built(factory).double()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=ADAMW_LR) for m in (oracle, exact)]
    schedules = [LambdaLR(o, _decay) for o in [engine.optimizer, *optimizers]]
    for step in range(3):
        batch = batch_fn(step)
        engine.train_step(_shard(batch, rank, world))
        engine.step()
        for model, optimizer, b in zip((oracle, exact), optimizers, (batch, _double(batch))):
            _oracle_loss(model, b, loss_fn).backward()
            optimizer.step()
            optimizer.zero_grad()
        for schedule in schedules:
            schedule.step()
    assert engine.optimizer.param_groups[0]["lr"] == ADAMW_LR * _decay(3)
    state = engine.full_state_dict()
    keep = [k for k in state if not any(s in k for s in skip_adamw)]
    check_close(
        {k: state[k] for k in keep},
        {k: oracle.state_dict()[k] for k in keep},
        {k: exact.state_dict()[k] for k in keep},
        what=f"{factory.__name__} after 3 AdamW steps",
    )
    assert engine.model_state_bytes() > 0
    if resume:
        saved = engine.state_dict()
        engine.train_step(_shard(batch_fn(3), rank, world))
        engine.step()
        want = engine.full_state_dict()
        engine.close()
        again = build(
            _built(factory),
            lambda ps: torch.optim.AdamW(ps, lr=ADAMW_LR),
            ctx,
            loss_fn=loss_fn,
            policy=policy,
        )
        again.load_state_dict(saved)  # (a traced split: before its first batch cuts it)
        again.train_step(_shard(batch_fn(3), rank, world))
        again.step()
        got = again.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), "resumed step differs"
        engine = again
    engine.close()
    return engine


def _any_model_cases() -> None:
    ctx = tessera.init()
    # (a) non-chain model: two tensors cross the boundary, the tied head's gradient is summed
    split = PipelinePolicy(split=["blocks.b2"], microbatches=2)
    engine = _check_model(
        ctx,
        ResidualNet,
        _residual_batch,
        _residual_loss,
        PipelineEngine,
        split,
        resume=True,
        clip=0.5,
    )
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in engine.pipe.module.parameters()}  # narrowed to the stage
    held = {n for n, p in engine.module.named_parameters() if p.device.type != "meta"}
    expected = {"emb.weight", "blocks.b0.weight", "blocks.b0.bias", "blocks.b1.weight"}
    if ctx.rank == 0:  # this rank keeps only its stage; the tied embedding on both
        assert held == expected | {"blocks.b1.bias"}
    else:
        later = {f"blocks.b{i}.{w}" for i in (2, 3) for w in ("weight", "bias")}
        assert held == {"emb.weight", "scale"} | later
    # (c) an MLP with a user loss: a plain module (traced) and an nn.Sequential (cut at layers)
    _check_model(ctx, MLP, _mlp_batch, _user_loss, PipelineEngine, PipelinePolicy(split=["fc2"]))
    seq = PipelinePolicy(split=["2"], microbatches=4, schedule="gpipe")
    _check_model(ctx, _seq_mlp, _mlp_batch, _user_loss, PipelineEngine, seq)
    # hybrid: pp=2 with a non-GPT model; dp=2 (one stage per replica)
    pp = HybridPolicy(pp=2, split=["blocks.b1"], microbatches=4)
    _check_model(ctx, ResidualNet, _residual_batch, _residual_loss, PipelineEngine, pp)
    dp = HybridPolicy(dp=2, microbatches=2)
    _check_model(ctx, ResidualNet, _residual_batch, _residual_loss, PipelineEngine, dp)
    zero = HybridPolicy(dp=2, zero=1, microbatches=2)
    _check_model(
        ctx, ResidualNet, _residual_batch, _residual_loss, PipelineEngine, zero, resume=True,
        clip=0.5,
    )  # fmt: skip
    # tp=2 with a plan on a model of the user's (one stage runs its modules)
    tp = HybridPolicy(tp=2, plan={"fc1": "column", "fc2": "row"}, microbatches=2)
    _check_model(ctx, MLP, _mlp_batch, _user_loss, PipelineEngine, tp, sharded=True)
    _split_errors(ctx)


def _split_errors(ctx) -> None:
    def build(split, loss_fn=_residual_loss):
        return PipelineEngine(
            _built(ResidualNet),
            lambda ps: torch.optim.SGD(ps, lr=SGD_LR),
            ctx,
            loss_fn=loss_fn,
            policy=PipelinePolicy(split=split),
        )

    batch = _shard(_residual_batch(0), ctx.rank, ctx.world_size)
    # every rank raises the same error before any rank trains (nothing waits on a peer)
    _raises(
        "split point 'blocks.b9': ResidualNet has no submodule 'blocks.b9'",
        lambda: build(["blocks.b9"]),
    )
    _raises(
        "gives 3 stages, but the pipeline has 2 ranks", lambda: build(["blocks.b1", "blocks.b2"])
    )
    _raises("leaves the stage before 'emb' empty", lambda: build(["emb"]).train_step(batch))
    uneven = PipelineEngine(
        _built(ResidualNet),
        torch.optim.SGD,
        ctx,
        loss_fn=_residual_loss,
        policy=PipelinePolicy(split=["blocks.b1"], microbatches=3),
    )
    _raises("must divide into 3 equal micro-batches", lambda: uneven.train_step(batch))
    _raises("ResidualNet returned no loss", lambda: build(["blocks.b1"], None).train_step(batch))
    _raises(
        "split point 'head'",
        lambda: PipelineEngine(
            _built(_gpt),
            torch.optim.SGD,
            ctx,
            loss_fn=_lm_loss,
            policy=PipelinePolicy(split=["head"]),
        ),
    )


def test_pipeline_and_hybrid_on_models_unlike_the_gpt_equal_a_plain_loop(run_ranks):
    run_ranks(_any_model_cases, 2)


def _gpt() -> nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_embd=WIDTH, n_head=2, block_size=SEQ))


def _gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(400 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _raises(match: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _hf_and_gpt() -> None:
    ctx = tessera.init()
    # (b) a Hugging Face BERT classifier from a config: dict batches, the model's own loss;
    # hidden states and the extended attention mask cross the boundary. The attention key
    # biases have a true gradient of zero (softmax is shift-invariant), which AdamW turns into
    # full-size steps of rounding noise: they are left out of the AdamW comparison only.
    bert = PipelinePolicy(split=["bert.encoder.layer.1"], microbatches=2)
    _check_model(ctx, _bert, _bert_batch, None, PipelineEngine, bert, skip_adamw=("key.bias",))
    # the reference GPT (its head tied to the token embedding) split at a block
    gpt = PipelinePolicy(split=["blocks.1"], microbatches=2)
    _check_model(ctx, _gpt, _gpt_batch, _lm_loss, PipelineEngine, gpt, skip_adamw=("key",))


def test_hugging_face_bert_and_the_gpt_equal_a_plain_loop(run_ranks):
    run_ranks(_hf_and_gpt, 2)


def test_a_tensor_parallel_plan_is_refused_inside_traced_stages():
    with pytest.raises(ValueError, match="tp > 1 with a MLP split at named modules"):
        _tensor_parallel(MLP(), {"fc1": "column"}, False, None)
    with pytest.raises(ValueError, match="tp > 1 on a MLP needs plan="):
        _tensor_parallel(MLP(), None, True, None)


def test_traced_stages_chain_to_the_model_and_pass_values_through():
    """Three traced stages run one after another in one process give the model's output; the
    mask the first stage computes passes through the second to the third (no processes)."""
    model = _built(ResidualNet)
    batch = _residual_batch(0)
    stages, params = trace_stages(model, ["blocks.b1", "blocks.b3"], batch)
    assert [len(s.receives) for s in stages] == [0, 2, 2]  # hidden states and the mask
    passed = set(stages[1].receives) & set(stages[1].sends)
    assert len(passed) == 1 and len(stages[1].sends) == 2  # the mask passes through, new h
    received: tuple = ()
    for stage in stages[:-1]:
        received = stage.run(batch, received)
    out = stages[-1].run(batch, received)
    torch.testing.assert_close(out, model(**batch), rtol=0, atol=0)
    # the tied embedding is the model's own tensor in the first and the last stage
    assert params[0][0] is model.emb.weight and any(p is model.emb.weight for p in params[2])
    assert not any("forward" in m.__dict__ for m in model.modules())  # split marks removed


def test_policies_refuse_bad_knobs_by_name():
    assert PipelinePolicy(split=["a", "b"]).split == ("a", "b")
    for bad, match in [
        ({"microbatches": 0}, "microbatches must be a positive int"),
        ({"schedule": "zb"}, "unknown pipeline schedule 'zb'"),
        ({"split": ["a", "a"]}, "names a module twice"),
        ({"split": "a"}, "split must be a list of module names"),
    ]:
        with pytest.raises(ValueError, match=match):
            PipelinePolicy(**bad)
    for bad, match in [
        ({"dp": 0}, "dp must be a positive int"),
        ({"pp": -1}, "pp must be a non-negative int"),
        ({"zero": 3}, "zero must be 0, 1 or 2"),
        ({"plan": {"fc1": 1}}, "plan entry .fc1.: 1: patterns are strings and styles one of"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            HybridPolicy(**bad)
    with pytest.raises(AttributeError):  # frozen: one policy, one set of knobs
        PipelinePolicy().microbatches = 2
