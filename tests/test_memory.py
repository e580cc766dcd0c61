"""tessera.memory: activation checkpointing (same gradients, fewer saved bytes) and the report."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.memory import (
    MemoryReport,
    checkpoint_activations,
    checkpointed_blocks,
    report,
    saved_activation_bytes,
)
from tessera.models import GPT, GPTConfig
from tessera.optim import CPUAdam

GPT_SHAPE = dict(vocab_size=40, block_size=16, n_layer=3, n_head=4, n_embd=32, dropout=0.1)
BATCH, TOKENS = 3, 16


class OneWeight(nn.Module):
    """A unit with a single weight, used directly in forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight))


class DictBlocks(nn.Module):
    """Blocks are nn.ModuleDicts whose children the parent calls one by one; one child is called
    twice; one block holds a raw weight used through F.linear in a child."""

    def __init__(self, width: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm": nn.LayerNorm(width),
                    "mlp": nn.Sequential(
                        nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
                    ),
                    "mix": OneWeight(width),
                }
            )
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["mlp"](block["norm"](x))
            x = block["mix"](block["mix"](x))  # called twice
        return self.out(x)


def _saved_bytes(run) -> int:
    """Bytes of distinct storages autograd saves (outside checkpoints) while `run()` executes."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    return sum(seen.values()), loss


def _gpt_loss(model: nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, GPT_SHAPE["vocab_size"], (BATCH, TOKENS + 1), generator=generator)
    torch.manual_seed(100 + seed)  # dropout masks: identical in both runs (and in recompute)
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _dict_loss(model: nn.Module, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 7, 24, generator=generator)
    return model(x).square().mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _same_gradients_saved_bytes(plain, wrapped, loss) -> tuple[int, int]:
    """Bytes autograd saves in the training forward of each model (`loss(model, seed)`), after
    checking that losses and gradients are bit-identical with a no_grad forward of the
    checkpointed model between its training forward and its backward (which changes nothing).

    Recompute runs the same CPU kernels in the same order, dropout with the stashed RNG state:
    bit-identical, so exact equality (no tolerance)."""
    plain_bytes, plain_loss = _saved_bytes(lambda: loss(plain, 1))
    wrapped_bytes, wrapped_loss = _saved_bytes(lambda: loss(wrapped, 1))
    with torch.no_grad():
        loss(wrapped, 2)
    plain_loss.backward()
    wrapped_loss.backward()
    assert torch.equal(plain_loss, wrapped_loss)
    for name, grad in _grads(plain).items():
        assert torch.equal(_grads(wrapped)[name], grad), name
    return plain_bytes, wrapped_bytes


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_gpt_checkpointing_same_gradients_fewer_saved_bytes(offload):
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**GPT_SHAPE))
    wrapped = checkpoint_activations(copy.deepcopy(plain), offload=offload)
    assert checkpointed_blocks(wrapped) == list(wrapped.blocks)
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    plain_bytes, wrapped_bytes = _same_gradients_saved_bytes(plain, wrapped, _gpt_loss)
    # Each checkpoint keeps its block's input, a (B, T, C) fp32 tensor, outside autograd's saves.
    kept_inputs = GPT_SHAPE["n_layer"] * BATCH * TOKENS * GPT_SHAPE["n_embd"] * 4
    blocks_saved = plain_bytes - wrapped_bytes  # what the blocks no longer save
    assert wrapped_bytes + kept_inputs < plain_bytes
    # Inside a GPT block autograd saves at least 8 (B, T, C)-sized tensors (two LayerNorm inputs,
    # qkv input and output, attention output, proj input, the 4C MLP hidden twice), so dropping
    # them for one kept input must save at least 7 inputs' worth per block.
    assert blocks_saved >= 7 * kept_inputs, (plain_bytes, wrapped_bytes, kept_inputs)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_module_dict_blocks_same_gradients(offload):
    torch.manual_seed(0)
    plain = DictBlocks()
    wrapped = checkpoint_activations(copy.deepcopy(plain), offload=offload)
    wrapped_names = {
        name for name, m in wrapped.named_modules() if m in checkpointed_blocks(wrapped)
    }
    expected = {f"blocks.{i}.{child}" for i in range(3) for child in ("norm", "mlp", "mix")}
    assert wrapped_names == expected
    plain_bytes, wrapped_bytes = _same_gradients_saved_bytes(plain, wrapped, _dict_loss)
    # The MLP's 4x-wide hidden (before and after GELU) is no longer saved: at least 2 x 4 = 8
    # (B, 7, 24) tensors per block, minus the inputs the 3 x 4 checkpoint calls keep.
    unit = BATCH * 7 * 24 * 4
    assert plain_bytes - wrapped_bytes >= 3 * 8 * unit - 3 * 4 * unit, (plain_bytes, wrapped_bytes)


def test_every_second_block():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**{**GPT_SHAPE, "n_layer": 4}))
    wrapped = checkpoint_activations(copy.deepcopy(plain), every=2)
    assert checkpointed_blocks(wrapped) == [wrapped.blocks[0], wrapped.blocks[2]]
    _gpt_loss(plain, 3).backward()
    _gpt_loss(wrapped, 3).backward()
    for name, grad in _grads(plain).items():
        assert torch.equal(_grads(wrapped)[name], grad), name


def test_checkpointing_bad_input():
    with pytest.raises(ValueError, match="offload must be one of"):
        checkpoint_activations(DictBlocks(), offload="disk")
    with pytest.raises(ValueError, match="every must be a positive int"):
        checkpoint_activations(DictBlocks(), every=0)
    with pytest.raises(ValueError, match="no blocks to checkpoint"):
        checkpoint_activations(nn.Linear(3, 3))
    model = checkpoint_activations(DictBlocks())
    with pytest.raises(ValueError, match="already activation-checkpointed"):
        checkpoint_activations(model)


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 3, bias=False))


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, CPUAdam])
def test_report_matches_hand_counted_bytes(tmp_path, optimizer_class):
    model = _small_model()
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    x = torch.randn(4, 10)
    loss, activations = saved_activation_bytes(
        lambda: model(x).square().sum(), exclude=model.parameters()
    )
    loss.backward()
    optimizer.step()
    (tmp_path / "states").mkdir()
    (tmp_path / "states" / "shard0.bin").write_bytes(b"\0" * 1000)
    (tmp_path / "extra.bin").write_bytes(b"\0" * 24)
    found = report(model, optimizer, activations=activations, disk_paths=[tmp_path])
    assert isinstance(found, MemoryReport)
    numel = 10 * 5 + 5 + 5 * 3  # two weights and one bias
    assert found.bytes["params"] == {"device": 0, "host": 4 * numel, "disk": 0}
    assert found.bytes["grads"] == {"device": 0, "host": 4 * numel, "disk": 0}
    # Adam: exp_avg and exp_avg_sq per parameter element, one float32 `step` per tensor (3).
    assert found.bytes["optimizer state"] == {"device": 0, "host": 8 * numel + 3 * 4, "disk": 1024}
    # Saved for backward: Linear 1's input x (4 x 10), ReLU's output (4 x 5, which Linear 2 also
    # saves: one storage), square's input (4 x 3); the weights are parameters, not counted.
    assert found.bytes["activations peak"] == {"device": 0, "host": 4 * (40 + 20 + 12), "disk": 0}
    assert found.total() == 4 * numel * 2 + 8 * numel + 12 + 1024 + 4 * 72
    assert "| optimizer state |" in found.table()


def test_report_counts_shared_storage_once():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**GPT_SHAPE))  # lm_head.weight is wte.weight
    found = report(gpt)
    assert found.bytes["params"]["host"] == 4 * gpt.num_parameters()
    assert found.bytes["grads"]["host"] == 0 and found.bytes["optimizer state"]["host"] == 0
    flat = torch.zeros(12)
    model = nn.Module()
    model.a = nn.Parameter(flat[:4])
    model.b = nn.Parameter(flat[4:])
    assert report(model).bytes["params"]["host"] == 48  # two views of one 12-float buffer
    with pytest.raises(ValueError, match="unknown places"):
        report(model, activations={"gpu": 1})


def _zero3_with_checkpointing():
    """ZeRO-3 frees each block's parameters after its forward; the recompute in backward must
    still see them gathered. Two SGD steps with and without checkpointing, same batches."""
    import tessera
    from tessera.zero import full_state_dict, initialize

    ctx = tessera.init()
    torch.set_num_threads(1)
    found = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=19, block_size=8, n_layer=2, n_head=2, n_embd=16))
        if checkpointed:
            checkpoint_activations(model)
        model, optimizer = initialize(model, torch.optim.SGD, stage=3, lr=0.1)
        generator = torch.Generator().manual_seed(5)
        idx = torch.randint(0, 19, (4, 9), generator=generator)
        x, y = idx[:, :-1].tensor_split(2)[ctx.rank], idx[:, 1:].tensor_split(2)[ctx.rank]
        for _ in range(2):
            optimizer.zero_grad()
            F.cross_entropy(model(x).reshape(-1, 19), y.reshape(-1)).backward()
            optimizer.step()
        found[checkpointed] = full_state_dict(model)
    return found


def test_checkpointing_under_zero3_is_exact(run_ranks):
    found = run_ranks(_zero3_with_checkpointing, 2)[0]
    for name, value in found[False].items():  # same kernels, same order: bit-identical
        assert torch.equal(found[True][name], value), name


# --- the residency scheduler (ZeRO-3's gathers and swap_idle share it) ------------------------
def test_residency_end_of_backward_fires_after_a_backward_that_raised():
    # A backward that raises half-way never runs its end-of-backward callback. The scheduler
    # queues that callback once per graph task, so the next backward still gets one (a single
    # "queued" flag would stay set and no later backward would ever release its blocks).
    import threading

    from tessera.memory.residency import ResidencyScheduler

    ended: list[int] = []
    brought: list[int] = []
    scheduler = ResidencyScheduler(
        2,
        bring_in=brought.append,
        prefetch=brought.append,
        end_of_backward=lambda: ended.append(1),
        lock=threading.RLock(),
    )

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom")

    x = torch.randn(3, requires_grad=True)
    weight = nn.Parameter(torch.randn(3))
    scheduler.track(weight, 1)
    with scheduler.saved_tensors_hooks():
        failing = Boom.apply(x) * weight  # backward unpacks `weight` (block 1), then raises
    with pytest.raises(RuntimeError, match="boom"):
        failing.sum().backward()
    assert ended == [] and brought == [1, 0]  # block 1 brought in, block 0 (before it) prefetched
    for _ in range(2):
        with scheduler.saved_tensors_hooks():
            loss = (x[:2] * weight[:2]).sum()  # a view of the block's storage is its tensor too
        loss.backward()
    assert ended == [1, 1] and brought == [1, 0] * 3
