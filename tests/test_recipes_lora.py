"""A PEFT LoRA model (frozen base, adapters trained) under every strategy (issue 29).

A tiny Hugging Face GPT-2 built from a config (nothing downloaded), wrapped by `peft`'s LoRA on
its attention projection (`c_attn`, B initialised non-zero so that both adapter matrices get a
gradient), trained through `tessera.setup` for 3 AdamW steps under single, ddp, torch-ddp,
zero1-3, zero2/zero3 with `offload="cpu"`, pipeline, tensor (a plan that splits the MLP, which
LoRA does not wrap) and hybrid (dp=2, tp=2 and pp=2). Against a plain PyTorch loop written here
on the whole batch: every adapter trained as the loop trains it (`_tolerance.check_close`, the
same loop in float64 as the yardstick) and every base weight bit for bit its initial value, and
the engine's module still has exactly the adapters trainable.

A layer LoRA wraps cannot be tensor-split (the adapter's matrices would need the same split):
`setup` refuses it in one message, with the built-in GPT-2 plan and with a plan naming the
wrapped layer's `base_layer`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close

import tessera
from tessera.zero import OffloadPolicy

pytest.importorskip("peft")

ROWS, VOCAB, LR, STEPS = 4, 32, 1e-2, 3
BLOCKS = "base_model.model.transformer.h"
MLP_PLAN = {f"{BLOCKS}.*.mlp.c_fc": "column", f"{BLOCKS}.*.mlp.c_proj": "row"}
STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("single", {}),
    ("ddp", {}),
    ("torch-ddp", {}),
    ("zero1", {}),
    ("zero2", {}),
    ("zero3", {}),
    ("zero2", {"offload": OffloadPolicy(device="cpu")}),
    ("zero3", {"offload": OffloadPolicy(device="cpu")}),
    ("pipeline", {"split": [f"{BLOCKS}.1"], "microbatches": 2}),
    ("tensor", {"plan": MLP_PLAN}),
    ("hybrid", {"dp": 2, "microbatches": 2}),
    ("hybrid", {"tp": 2, "plan": MLP_PLAN, "microbatches": 2}),
    ("hybrid", {"pp": 2, "split": [f"{BLOCKS}.1"], "microbatches": 2}),
]


def _lora_gpt2() -> torch.nn.Module:
    """The same tiny LoRA GPT-2 on every rank and in the oracle (seeded); dropout off so that
    ranks and the oracle draw nothing."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    lora = LoraConfig(
        r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False
    )
    return get_peft_model(GPT2LMHeadModel(config), lora)


def _loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + step)
    ids = torch.randint(0, VOCAB, (ROWS, 7), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _plain() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The oracle (float32) and the yardstick (float64): 3 AdamW steps on the whole batch."""
    states = []
    for dtype in (torch.float32, torch.float64):
        model = _lora_gpt2().to(dtype)
        optimizer = _adamw(p for p in model.parameters() if p.requires_grad)
        for step in range(STEPS):
            ids, targets = _batch(step)
            _loss(model(ids), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states[0], states[1]


def _cases() -> None:
    ctx = tessera.init()
    initial = _lora_gpt2()
    adapters = {n for n, p in initial.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    base = {k: v for k, v in initial.state_dict().items() if k not in adapters}
    oracle, exact = _plain()
    for strategy, options in STRATEGIES:
        what = f"{strategy} {options}"
        world = 1 if strategy == "single" else ctx.world_size
        rank = 0 if strategy == "single" else ctx.rank
        engine = tessera.setup(_lora_gpt2(), _adamw, strategy=strategy, loss_fn=_loss, **options)
        trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
        assert all("lora_" in n for n in trainable), (what, trainable - adapters)
        rows = ROWS // world
        for step in range(STEPS):
            engine.train_step(tuple(t[rank * rows : (rank + 1) * rows] for t in _batch(step)))
            engine.step()
        state = engine.full_state_dict()
        assert set(state) == set(oracle), (what, set(state) ^ set(oracle))
        for key, value in base.items():  # the base took no step: its initial bits
            assert torch.equal(state[key], value), (what, key)
        moved = [k for k in adapters if not torch.equal(state[k], initial.state_dict()[k])]
        assert sorted(moved) == sorted(adapters), (what, adapters - set(moved))
        check_close(state, oracle, exact, what=what)
        engine.close()
    for options in ({}, {"plan": {f"{BLOCKS}.*.attn.c_attn.base_layer": "column"}}):
        with pytest.raises(ValueError, match=r"c_attn is wrapped by an adapter .*merge_and_unl"):
            tessera.setup(_lora_gpt2(), _adamw, strategy="tensor", loss_fn=_loss, **options)


def test_a_lora_model_trains_its_adapters_only_under_every_strategy(run_ranks):
    run_ranks(_cases, 2)
