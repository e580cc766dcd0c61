"""`strategy="tensor"` on models unlike tessera's GPT equals a plain PyTorch loop.

Two ranks, each handed its half of the global batch (the engine gathers the halves): an MLP with
an embedding, a plan and a user loss; a Hugging Face GPT-2 (fused `Conv1D` q/k/v, tied LM head,
its own loss) with the built-in plan; a Hugging Face BERT classifier (dict batches with padding
masks). Gradients (the split ones gathered), one SGD step, then more steps (AdamW, an lr schedule,
clipping) against the same model trained by a loop in this file, with tolerances from
`_tolerance.py`; then the plan errors, each raised before any module changes.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close, to_float64
from torch import nn

import tessera
from tessera.models import GPT, GPTConfig
from tessera.strategies.batch import gather_batch
from tessera.strategies.tensor import TensorEngine
from tessera.tensor_parallel import (
    ColumnParallelConv1D,
    ColumnParallelEmbedding,
    RowParallelConv1D,
    TensorPolicy,
    builtin_plan,
    full_state_dict,
    hf_bert_plan,
    hf_gpt2_plan,
    load_full_state_dict,
    parallelize,
    parallelize_model,
)

transformers = pytest.importorskip("transformers")

WORLD = 2


class _EmbedMLP(nn.Module):
    """Token ids -> embedding (split over its dimension) -> mean -> MLP (column, row) -> 4."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.mlp = nn.Sequential(
            OrderedDict(up=nn.Linear(8, 16), act=nn.GELU(), down=nn.Linear(16, 8))
        )
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.mlp(self.embed(ids).mean(1))))


MLP_PLAN = {"embed": "embedding", "mlp.up": "column", "mlp.down": "row"}


def _user_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.smooth_l1_loss(out, target) + 0.1 * out.square().mean()


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _shard(batch, rank: int):
    """This rank's rows of every tensor of `batch` (its share of the global batch)."""
    if isinstance(batch, dict):
        return {k: _shard(v, rank) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_shard(v, rank) for v in batch)
    return batch.chunk(WORLD)[rank]


def _plain_loss(model: nn.Module, batch, loss_fn):
    """The plain loop's forward: the HF convention for dicts, the user's loss for pairs."""
    if isinstance(batch, dict):
        return model(**batch).loss
    inputs, targets = batch
    return loss_fn(model(inputs), targets)


def _gathered_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """The dense gradients of a split module: `full_state_dict` gathers whatever the parameters
    hold, so the gradients are swapped in for the call and swapped back."""
    params = list(module.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        full = full_state_dict(module)
    finally:
        for p, data in zip(params, saved):
            p.data = data
    return full


def _dense_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def _compare(engine, dense, dense64, batches, make_optimizer, *, what, skip=(), clip=0.0,
             schedule=None):  # fmt: skip
    """Train the engine and the plain loop (fp32 oracle, fp64 reference) on `batches`; check
    losses and the first step's gradients, and the parameters after every step."""
    rank = tessera.init().rank
    optimizers = [make_optimizer(m.parameters()) for m in (dense, dense64)]
    schedulers = []
    if schedule is not None:
        schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (engine.optimizer, *optimizers)
        ]
    for step, batch in enumerate(batches):
        loss = engine.train_step(_shard(batch, rank))
        losses = []
        for model in (dense, dense64):
            data = to_float64(batch) if model is dense64 else batch
            value = _plain_loss(model, data, engine.loss_fn)
            value.backward()
            losses.append(value.detach())
        check_close(torch.tensor(float(loss)), *losses, what=f"{what}: loss of step {step}")
        if step == 0:
            grads = {k: v for k, v in _gathered_grads(engine.module).items() if k not in skip}
            oracle, ref = (_dense_grads(m) for m in (dense, dense64))
            keys = [k for k in oracle if k not in skip]
            check_close(
                {k: grads[k] for k in keys},
                {k: oracle[k] for k in keys},
                {k: ref[k] for k in keys},
                what=f"{what}: gradients",
            )
        engine.step()
        for model, optimizer in zip((dense, dense64), optimizers):
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
    full, state, state64 = engine.full_state_dict(), dense.state_dict(), dense64.state_dict()
    assert list(full) == list(state), what  # the user's plain keys, in order
    keys = [k for k in state if k not in skip]
    check_close(
        {k: full[k] for k in keys},
        {k: state[k] for k in keys},
        {k: state64[k] for k in keys},
        what=f"{what}: parameters after {len(batches)} steps",
    )


def _engine(make_model, make_optimizer, *, plan=None, loss_fn=None, grad_clip=0.0):
    """A tensor engine on a fresh copy of the seeded model, and the dense fp32 / fp64 copies."""
    torch.manual_seed(0)
    dense = make_model()
    dense64 = copy.deepcopy(dense).double()
    ctx = tessera.init()
    policy = TensorPolicy(plan=plan)
    engine = TensorEngine(
        copy.deepcopy(dense), make_optimizer, ctx, loss_fn=loss_fn, grad_clip=grad_clip,
        policy=policy,
    )  # fmt: skip
    return engine, dense, dense64


def _check_mlp():
    torch.manual_seed(1)
    batches = [
        (torch.randint(0, 20, (8, 5)), torch.randn(8, 4)) for _ in range(3)
    ]  # global batch of 8 rows, 4 per rank
    sgd = partial(torch.optim.SGD, lr=0.1)
    engine, dense, dense64 = _engine(_EmbedMLP, sgd, plan=MLP_PLAN, loss_fn=_user_loss)
    assert isinstance(engine.module.embed, ColumnParallelEmbedding)
    assert engine.module.embed.weight.shape == (20, 4)  # half of the embedding dimension
    _compare(engine, dense, dense64, batches[:1], sgd, what="mlp, one SGD step")

    # AdamW: every parameter here has a non-zero gradient; a LambdaLR on the engine's optimizer
    adamw = partial(torch.optim.AdamW, lr=1e-2)
    engine, dense, dense64 = _engine(_EmbedMLP, adamw, plan=MLP_PLAN, loss_fn=_user_loss)
    _compare(engine, dense, dense64, batches, adamw, what="mlp, AdamW", schedule=lambda s: 0.5**s)
    local = sum(p.numel() * 4 for p in engine.module.parameters())
    assert local < sum(p.numel() * 4 for p in dense.parameters())  # split layers hold halves
    steps = 4 * len(list(engine.module.parameters()))  # AdamW's step counters (float32 scalars)
    assert engine.model_state_bytes() == 3 * local + steps  # weights + exp_avg + exp_avg_sq

    # a checkpoint: a new engine loaded from it continues exactly as the first one
    state = engine.state_dict()
    torch.manual_seed(5)
    other = TensorEngine(_EmbedMLP(), adamw, tessera.init(), loss_fn=_user_loss,
                         policy=TensorPolicy(plan=MLP_PLAN))  # fmt: skip
    other.load_state_dict(state)
    for e in (engine, other):
        e.train_step(_shard(batches[0], tessera.init().rank))
        e.step()
    mine, theirs = engine.full_state_dict(), other.full_state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    fresh = _EmbedMLP()
    fresh.load_state_dict(mine)  # strict: the dense keys and shapes

    # clipping by the dense model's norm (replicated parameters counted once)
    engine, dense, dense64 = _engine(
        _EmbedMLP, sgd, plan=MLP_PLAN, loss_fn=_user_loss, grad_clip=0.05
    )
    _compare(engine, dense, dense64, batches[:2], sgd, what="mlp, clipped", clip=0.05)


def _check_gpt2():
    torch.manual_seed(2)
    ids = [torch.randint(0, 50, (4, 8)) for _ in range(3)]
    batches = [{"input_ids": x, "labels": x} for x in ids]
    sgd = partial(torch.optim.SGD, lr=0.1)
    engine, dense, dense64 = _engine(_gpt2, sgd)  # plan=None: the built-in GPT-2 plan
    attn = engine.module.transformer.h[0].attn
    assert isinstance(attn.c_attn, ColumnParallelConv1D) and attn.c_attn.weight.shape == (32, 48)
    assert isinstance(attn.c_proj, RowParallelConv1D) and attn.c_proj.weight.shape == (16, 32)
    assert (attn.num_heads, attn.split_size, attn.embed_dim) == (1, 16, 16)  # local heads
    assert engine.module.lm_head.weight is engine.module.transformer.wte.weight  # still tied
    _compare(engine, dense, dense64, batches[:1], sgd, what="gpt2, one SGD step")
    # SGD with momentum over three steps: the key biases' true gradient is zero, so AdamW would
    # amplify rounding noise there (DESIGN.md, Testing)
    momentum = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    engine, dense, dense64 = _engine(_gpt2, momentum)
    _compare(engine, dense, dense64, batches, momentum, what="gpt2, SGD momentum")


def _gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _check_tessera_gpt():
    """plan=None on tessera's own GPT: `parallelize_gpt` (heads and MLPs split)."""
    torch.manual_seed(4)
    batches = [(torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))) for _ in range(2)]
    momentum = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16)
    engine, dense, dense64 = _engine(lambda: GPT(config), momentum, loss_fn=_gpt_loss)
    assert engine.module.blocks[0].attn.n_head == 1  # ParallelCausalSelfAttention, local heads
    _compare(engine, dense, dense64, batches, momentum, what="tessera GPT, SGD momentum")


def _check_bert():
    torch.manual_seed(3)
    batches = []
    for _ in range(3):
        mask = torch.ones(4, 8, dtype=torch.long)
        mask[1, 5:] = 0  # padded rows
        mask[3, 3:] = 0
        batches.append(
            {
                "input_ids": torch.randint(1, 50, (4, 8)),
                "attention_mask": mask,
                "labels": torch.randint(0, 3, (4,)),
            }
        )
    sgd = partial(torch.optim.SGD, lr=0.1)
    engine, dense, dense64 = _engine(_bert, sgd)
    attn = engine.module.bert.encoder.layer[0].attention.self
    assert (attn.num_attention_heads, attn.all_head_size) == (1, 16)
    _compare(engine, dense, dense64, batches[:1], sgd, what="bert, one SGD step")
    # AdamW: key biases (true gradient zero, see above) are left out of the comparison; a shift
    # of every key by the same vector changes no attention score, so the rest is unaffected
    keys = {k for k in dense.state_dict() if k.endswith("attention.self.key.bias")}
    adamw = partial(torch.optim.AdamW, lr=1e-3)
    engine, dense, dense64 = _engine(_bert, adamw)
    _compare(engine, dense, dense64, batches, adamw, what="bert, AdamW", skip=keys)


def _check_errors():
    ctx = tessera.init()
    sgd = partial(torch.optim.SGD, lr=0.1)
    cases = [
        (_EmbedMLP, {"mlp.up": "column", "norm": "column"}, "norm is a LayerNorm, which style"),
        (_EmbedMLP, {"mlp.up": "column", "nothing.*": "row"}, "'nothing.\\*' matches no submodule"),
        (
            lambda: nn.Sequential(OrderedDict(a=nn.Linear(4, 6), b=nn.Linear(3, 4))),
            {"a": "column", "b": "row"},
            "b: weight dimension 1 \\(3\\) is not divisible by the tensor-parallel size 2",
        ),
        (_EmbedMLP, None, "no built-in tensor-parallel plan for _EmbedMLP"),
        (_gpt2, {"transformer.wte": "embedding"}, "transformer.wte.weight is tied to lm_head"),
        (
            _gpt2,
            {"transformer.h.0.attn.c_attn": "column"},
            "transformer.h.0.attn: a GPT2Attention splits by heads only with \\['c_attn'\\] "
            "'column' and \\['c_proj'\\] 'row'; transformer.h.0.attn.c_proj is not in the plan",
        ),
        (
            _bert,
            {"bert.encoder.layer.0.attention.self.query": "column"},
            "bert.encoder.layer.0.attention.self.key is not in the plan",
        ),
    ]
    for make, plan, message in cases:
        model = make()
        before = {name: type(m) for name, m in model.named_modules()}
        with pytest.raises(ValueError, match=message):
            TensorEngine(model, sgd, ctx, loss_fn=_user_loss, policy=TensorPolicy(plan=plan))
        assert {name: type(m) for name, m in model.named_modules()} == before  # nothing replaced
    # attention heads that do not divide (the q/k/v widths would: 3 x 30 columns)
    config = transformers.GPT2Config(vocab_size=50, n_embd=30, n_layer=1, n_head=3)
    odd = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="transformer.h.0.attn: its 3 attention heads do not"):
        parallelize_model(odd)
    # a Conv1D whose output width does not divide
    with pytest.raises(ValueError, match="0: weight dimension 1 \\(3\\) is not divisible"):
        parallelize(nn.Sequential(transformers.pytorch_utils.Conv1D(3, 4)), {"0": "column"})


def _check_dense_state_round_trip():
    """`full_state_dict` of a plan-split HF GPT-2 loads, strict, into a fresh dense GPT-2, which
    then gives the split model's logits; `load_full_state_dict` takes a dense state back into
    the split model (each rank slicing its shards, per q/k/v block), exactly."""
    torch.manual_seed(0)
    model = _gpt2()
    parallelize(model, hf_gpt2_plan(model))
    fresh = _gpt2()  # other weights (the generator moved on)
    fresh.load_state_dict(full_state_dict(model))
    ids = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(model(input_ids=ids).logits, fresh(input_ids=ids).logits)
    other = _gpt2().state_dict()
    load_full_state_dict(model, other)
    back = full_state_dict(model)
    assert all(torch.equal(back[k], other[k]) for k in other)
    # a Conv1D split by columns with its output gathered: the dense output, whole on every rank
    conv = transformers.pytorch_utils.Conv1D(6, 4)
    split = parallelize(nn.Sequential(copy.deepcopy(conv)), {"0": "column_gather"})
    assert isinstance(split[0], ColumnParallelConv1D) and split[0].weight.shape == (4, 3)
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(split(x), conv(x))


def _check_gather_batch():
    """Shards of different lengths gather in rank order (dicts per key, pairs per element); a
    shard of another trailing shape raises on every rank instead of mismatching the collective."""
    rank = tessera.init().rank
    rows = 3 - rank  # rank 0: 3 rows, rank 1: 2
    shard = {"ids": torch.full((rows, 2), rank), "pair": (torch.arange(rows) + 10 * rank, "tag")}
    full = gather_batch(shard)
    assert torch.equal(full["ids"], torch.tensor([[0, 0]] * 3 + [[1, 1]] * 2))
    assert (
        torch.equal(full["pair"][0], torch.tensor([0, 1, 2, 10, 11])) and full["pair"][1] == "tag"
    )
    with pytest.raises(ValueError, match="batch shards differ beyond dim 0"):
        gather_batch(torch.zeros(2, 3 + rank))


def any_model_worker() -> bool:
    tessera.init(timeout_s=60.0)
    _check_mlp()
    _check_gpt2()
    _check_tessera_gpt()
    _check_bert()
    _check_errors()
    _check_gather_batch()
    _check_dense_state_round_trip()
    return True


def test_tensor_strategy_on_any_model_equals_a_plain_loop(run_ranks):
    assert run_ranks(any_model_worker, WORLD, deadline_s=180) == [True, True]


def test_builtin_plans_name_every_block_module():
    torch.manual_seed(0)
    gpt2, bert = _gpt2(), _bert()
    assert builtin_plan(gpt2) == hf_gpt2_plan(gpt2)
    assert hf_gpt2_plan(gpt2)["transformer.h.1.attn.c_attn"] == "column"
    assert len(hf_gpt2_plan(gpt2)) == 2 * 4
    assert builtin_plan(bert) == hf_bert_plan(bert)
    assert hf_bert_plan(bert)["bert.encoder.layer.1.output.dense"] == "row"
    assert len(hf_bert_plan(bert)) == 2 * 6
    assert builtin_plan(_EmbedMLP()) is None


def test_policy_is_checked_when_made():
    with pytest.raises(ValueError, match="styles one of"):
        TensorPolicy(plan={"mlp.up": "diagonal"})
    with pytest.raises(ValueError, match="plan is empty"):
        TensorPolicy(plan={})
    plan = {"mlp.up": "column"}
    policy = TensorPolicy(plan=plan)
    plan["mlp.down"] = "row"
    assert policy.plan == {"mlp.up": "column"}  # a copy: the caller's later change is not seen
    with pytest.raises(AttributeError):
        policy.plan = None  # frozen
    assert TensorPolicy().plan is None


def test_plans_refused_before_any_change():
    """Instances the split layers cannot reproduce are refused at planning, naming the module."""

    def refused(model: nn.Module, plan: dict[str, str], message: str) -> None:
        before = {name: type(m) for name, m in model.named_modules()}
        with pytest.raises(ValueError, match=message):
            parallelize(model, plan)
        assert {name: type(m) for name, m in model.named_modules()} == before

    def with_linear(**children: nn.Module) -> nn.Module:  # a Linear planned (and valid) first
        return nn.ModuleDict({"first": nn.Linear(4, 4), **children})

    refused(
        with_linear(e=nn.Embedding(6, 4, max_norm=1.0)),
        {"first": "column", "e": "embedding"},
        "e: an Embedding with max_norm renormalises whole rows",
    )
    refused(
        with_linear(e=nn.Embedding(6, 4, padding_idx=0)),
        {"first": "column", "e": "vocab"},
        "e: the vocabulary split takes no padding_idx",
    )
    config = transformers.GPT2Config(n_embd=8, n_head=2, add_cross_attention=True)
    cross = transformers.models.gpt2.modeling_gpt2.GPT2Attention(
        config, is_cross_attention=True, layer_idx=0
    )
    refused(
        nn.ModuleDict({"attn": cross}),
        {"attn.c_attn": "column", "attn.c_proj": "row"},
        "attn: a cross-attention GPT2Attention",
    )
    gpt = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=2, n_embd=8))
    refused(
        gpt,
        {"blocks.0.attn.qkv": "column", "blocks.0.attn.proj": "row"},
        "blocks.0.attn: tessera's CausalSelfAttention .* parallelize_gpt",
    )
