"""Reference models: shapes, causality, weight tying, init, generation, configs, trainability."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessera.models import (
    CNN,
    GPT,
    MLP,
    MODELS,
    CNNConfig,
    GPTConfig,
    MLPConfig,
    build_model,
)


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    return GPT(GPTConfig(**{**config, **overrides}))


# ----- shapes -------------------------------------------------------------------------------


def test_mlp_shape_and_layers():
    model = MLP(MLPConfig(in_features=5, hidden=(7, 3), out_features=4))
    assert model(torch.randn(6, 5)).shape == (6, 4)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(5, 7), (7, 3), (3, 4)]
    assert model.num_parameters() == 5 * 7 + 7 + 7 * 3 + 3 + 3 * 4 + 4
    # No hidden layer: plain logistic regression.
    assert MLP(MLPConfig(in_features=5, hidden=(), out_features=2))(torch.randn(1, 5)).shape == (
        1,
        2,
    )


@pytest.mark.parametrize("image_size", [8, 5, 1])
@pytest.mark.parametrize("batch_norm", [True, False])
def test_cnn_shape_any_image_size(image_size, batch_norm):
    config = CNNConfig(
        in_channels=3, image_size=image_size, channels=(4, 6, 8), batch_norm=batch_norm
    )
    model = CNN(config)
    assert model(torch.randn(2, 3, image_size, image_size)).shape == (2, 10)
    has_bn = any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert has_bn == batch_norm
    pools = sum(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    # 8 -> 4 -> 2 -> 1 pools three times; 5 -> 2 -> 1 twice; 1 never.
    assert pools == {8: 3, 5: 2, 1: 0}[image_size]


def test_gpt_shape_and_blocks_module_list():
    model = tiny_gpt()
    idx = torch.randint(11, (3, 8))
    assert model(idx).shape == (3, 8, 11)
    assert model(idx[:, :1]).shape == (3, 1, 11)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    # embed -> blocks -> head is the forward pass (what pipeline stages will run).
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    torch.testing.assert_close(model.head(x), model(idx), rtol=0, atol=0)


def test_gpt_rejects_too_long_sequence():
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size 8"):
        tiny_gpt()(torch.zeros(1, 9, dtype=torch.long))


# ----- GPT properties -----------------------------------------------------------------------


def test_gpt_is_causal():
    model = tiny_gpt().eval()
    idx = torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 5:] = (changed[:, 5:] + 3) % 11
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :5], after[:, :5], rtol=0, atol=0)
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_gpt_weight_tying():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_parameters() == sum(unique.values())
    # Counted once: the tied matrix is 11 x 16 and appears among the parameters a single time.
    all_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert all_params - model.num_parameters() == 11 * 16
    assert model.num_parameters(exclude_position_embedding=True) == model.num_parameters() - 8 * 16


def test_gpt_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=128))
    residual_std = 0.02 / math.sqrt(2 * 8)

    def close_to(weight: torch.Tensor, std: float) -> bool:
        # The sample std of n normal draws has a relative standard error of 1 / sqrt(2 (n - 1)):
        # allow 5 of them (a correct init fails once in ~2 million), while a wrong scale such as
        # the unscaled 0.02 for residual projections is off by 4x.
        spread = 5 / math.sqrt(2 * (weight.numel() - 1))
        return abs(weight.std().item() / std - 1) <= spread

    for block in model.blocks:
        assert close_to(block.attn.proj.weight, residual_std)
        assert close_to(block.mlp.proj.weight, residual_std)
        assert close_to(block.attn.qkv.weight, 0.02)
        assert torch.count_nonzero(block.attn.qkv.bias) == 0
    assert close_to(model.wte.weight, 0.02)


def test_generate_is_deterministic_with_seeded_generator():
    model = tiny_gpt()
    prompt = torch.tensor([[1, 2, 3]])
    first = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7))
    second = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7))
    other = model.generate(prompt, 10, generator=torch.Generator().manual_seed(8))
    assert first.shape == (1, 13)
    assert torch.equal(first[:, :3], prompt)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_generate_crops_context_to_block_size():
    model = tiny_gpt(dropout=0.1).train()
    long_prompt = torch.randint(11, (2, 20), generator=torch.Generator().manual_seed(3))
    out = model.generate(long_prompt, 5, generator=torch.Generator().manual_seed(0))
    # Only the last block_size tokens matter: the same continuation from the cropped prompt.
    cropped = model.generate(long_prompt[:, -8:], 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 25)
    assert torch.equal(out[:, -5:], cropped[:, -5:])
    assert model.training  # generate switches dropout off and restores the mode


def test_generate_greedy_and_top_k_one_agree():
    model = tiny_gpt()
    prompt = torch.tensor([[4, 5]])
    greedy = model.generate(prompt, 6, temperature=0)
    top1 = model.generate(prompt, 6, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy, top1)
    assert greedy[0, 2].item() == model(prompt)[0, -1].argmax().item()
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 1, temperature=-1.0)


# ----- config validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_embd=10, n_head=4), r"n_embd \(10\) must be divisible by n_head \(4\)"),
        (dict(n_layer=0), "n_layer must be positive, got 0"),
        (dict(vocab_size=-1), "vocab_size must be positive"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    ],
)
def test_gpt_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{"vocab_size": 10, **kwargs})


def test_mlp_and_cnn_config_validation():
    with pytest.raises(ValueError, match="hidden widths must all be positive"):
        MLPConfig(hidden=(8, 0))
    with pytest.raises(ValueError, match="in_features must be positive"):
        MLPConfig(in_features=0)
    with pytest.raises(ValueError, match="channels must be a non-empty list"):
        CNNConfig(channels=())
    with pytest.raises(ValueError, match="image_size must be positive"):
        CNNConfig(image_size=0)
    assert MLPConfig(hidden=[3, 4]).hidden == (3, 4)  # lists from JSON become tuples


def test_build_model_registry():
    assert set(MODELS) == {"mlp", "cnn", "gpt"}
    model = build_model("gpt", {"vocab_size": 5, "n_layer": 1, "n_embd": 8, "n_head": 2})
    assert isinstance(model, GPT) and len(model.blocks) == 1
    assert isinstance(build_model("mlp", {"hidden": [4]}), MLP)
    assert isinstance(build_model("cnn", {}), CNN)
    with pytest.raises(ValueError, match="unknown model 'rnn'; valid names: cnn, gpt, mlp"):
        build_model("rnn", {})
    with pytest.raises(ValueError, match="unknown config key\\(s\\) 'n_layers' for model 'gpt'"):
        build_model("gpt", {"vocab_size": 5, "n_layers": 2})
    with pytest.raises(ValueError, match="missing required config key\\(s\\) vocab_size"):
        build_model("gpt", {})


# ----- trainability -------------------------------------------------------------------------


def _train(model, x, y, loss_fn, steps=30, lr=1e-2) -> tuple[float, float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def test_models_fit_a_tiny_batch():
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randint(3, (16,))
    first, last = _train(
        MLP(MLPConfig(in_features=8, hidden=(32,), out_features=3)), x, y, F.cross_entropy
    )
    assert last < 0.3 * first

    images, labels = torch.randn(8, 1, 8, 8), torch.randint(4, (8,))
    cnn = CNN(CNNConfig(channels=(8, 8), num_classes=4))
    first, last = _train(cnn, images, labels, F.cross_entropy)
    assert last < 0.3 * first

    gpt = tiny_gpt()
    tokens = torch.randint(11, (4, 9), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def lm_loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    first, last = _train(gpt, x, y, lm_loss, steps=40)
    # Small init: logits have std ~0.02 * sqrt(n_embd) = 0.08 around zero, so the first loss is
    # the uniform prediction's log(11) within ~1% (the target logits' spread averaged over 32
    # tokens, plus half their variance); 5% leaves a 5x margin, a trained or broken head is off
    # by far more.
    assert first == pytest.approx(math.log(11), rel=0.05)
    assert last < 0.5 * first
