"""An export keeps every tensor's dtype and value: bf16 and fp16 parameters, int64, bool and
float64 buffers, under every strategy that exports.

The oracle is the user's own `state_dict()`, copied in the test before the engine is built (and,
after a step, the dtypes it had then): each loaded tensor must have its key's dtype and, where
nothing trained it, its exact value. The values are chosen so that a float32 round trip changes
them (2^40 + 1 in an int64, 1/3 in a float64), so a cast is seen in the values too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import tessera
from tessera.checkpoint import export_model


class Mixed(nn.Module):
    """A user's model of many dtypes: a bf16 embedding, an fp16 gate, fp32 linears, and
    buffers that are int64 (a counter past float32's 2^24), bool and float64."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4).to(torch.bfloat16)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float16))
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("count", torch.tensor([3, 2**40 + 1], dtype=torch.int64))
        self.register_buffer("keep", torch.tensor([True, False, True, True]))
        self.register_buffer("third", torch.tensor([1 / 3], dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # every buffer is read (a pipeline stage keeps only what its graph uses): x 1, + 0
        h = self.embed(ids).float() * self.gate.float() * (3 * self.third).float()
        h = torch.relu(self.body(h * self.keep))
        return self.head(h) + (self.count[0] - 3).float()


def _loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 7, (4, 3), generator=g), torch.randint(0, 4, (4, 3), generator=g)


def _check(path: Path, want: dict[str, torch.Tensor], values: bool = True) -> None:
    loaded = load_file(path)
    assert sorted(loaded) == sorted(want)
    for key, tensor in want.items():
        assert loaded[key].dtype == tensor.dtype, (str(path), key, loaded[key].dtype, tensor.dtype)
        assert not values or torch.equal(loaded[key], tensor), (str(path), key)


def test_export_model_writes_each_tensor_in_its_own_dtype(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    state = model.state_dict()
    assert {t.dtype for t in state.values()} == {
        torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.float64
    }  # fmt: skip
    _check(export_model(model, state, tmp_path / "out"), copy.deepcopy(state))


def test_an_engine_export_after_training_keeps_the_models_dtypes(tmp_path):
    """`tessera.setup(...).export` of a trained model: the plain model trained here by the same
    SGD step gives the values (single trains the user's tensors in their own dtype)."""
    torch.manual_seed(0)
    model, oracle = Mixed(), Mixed()
    oracle.load_state_dict(model.state_dict())
    engine = tessera.setup(
        model, lambda p: torch.optim.SGD(p, lr=0.5), strategy="single", loss_fn=_loss
    )
    inputs, targets = _batch()
    engine.train_step((inputs, targets))
    engine.step()
    _loss(oracle(inputs), targets).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.5).step()
    want = oracle.state_dict()
    assert not torch.equal(want["embed.weight"], Mixed().embed.weight)  # it trained
    _check(engine.export(tmp_path / "single.safetensors"), want)


STRATEGIES = {
    "ddp": {},
    "zero1": {},
    "zero3": {},
    "pipeline": {"split": ["head"], "microbatches": 2},
    "tensor": {"plan": {"body": "column", "head": "row"}},
}


def _export_every_strategy(out: str) -> None:
    ctx = tessera.init()
    inputs, targets = _batch()
    rows = slice(ctx.rank * 2, ctx.rank * 2 + 2)
    for strategy, options in STRATEGIES.items():
        torch.manual_seed(0)
        model = Mixed()
        want = copy.deepcopy(model.state_dict())
        engine = tessera.setup(
            model, lambda p: torch.optim.SGD(p, lr=0.5), strategy=strategy, loss_fn=_loss,
            ctx=ctx, **options,
        )  # fmt: skip
        engine.export(Path(out) / strategy / "before.safetensors")
        engine.train_step((inputs[rows], targets[rows]))
        engine.step()
        engine.export(Path(out) / strategy / "after.safetensors")
        saved = engine.state_dict()["model"]  # what a user saves by hand: the same dtypes
        assert {k: t.dtype for k, t in saved.items()} == {k: t.dtype for k, t in want.items()}, (
            strategy
        )
        engine.close()
        if ctx.rank == 0:
            _check(Path(out) / strategy / "before.safetensors", want)
            trained = load_file(Path(out) / strategy / "after.safetensors")
            assert not torch.equal(trained["embed.weight"], want["embed.weight"]), strategy
            buffers = {k: want[k] for k in ("count", "keep", "third")}
            _check_dtypes(trained, want, buffers, strategy)


def _check_dtypes(trained, want, buffers, strategy) -> None:
    for key, tensor in want.items():
        assert trained[key].dtype == tensor.dtype, (strategy, key, trained[key].dtype)
    for key, tensor in buffers.items():
        assert torch.equal(trained[key], tensor), (strategy, key)


@pytest.mark.parametrize("nproc", [2])
def test_every_strategy_exports_the_models_dtypes(run_ranks, tmp_path, nproc):
    """Before training: every tensor equal to the user's state dict, dtype and value; after one
    SGD step: every dtype still the user's, the buffers untouched (ZeRO keeps fp32 masters of
    the bf16 and fp16 parameters: the export gives them back in the model's dtype)."""
    run_ranks(_export_every_strategy, nproc, str(tmp_path))


def test_a_bf16_hugging_face_model_exports_as_bf16_in_both_formats(tmp_path):
    """`format="hf"` (save_pretrained) and `"safetensors"` of a transformers model held in
    bf16: every key's dtype and value is the model's, and `from_pretrained` reads the folder
    back equal (and in bf16)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=5,
    )  # fmt: skip
    model = BertModel(config).to(torch.bfloat16)
    want = copy.deepcopy(model.state_dict())
    engine = tessera.setup(model, lambda p: torch.optim.SGD(p, lr=0.1), strategy="single")
    for format in ("hf", "safetensors"):
        engine.export(tmp_path / format, format)
        loaded = load_file(tmp_path / format / "model.safetensors")
        assert sorted(loaded) == sorted(want), format
        for key, tensor in loaded.items():
            assert tensor.dtype == want[key].dtype and torch.equal(tensor, want[key]), (format, key)
    again = BertModel.from_pretrained(tmp_path / "hf")
    assert again.dtype == torch.bfloat16
    for key, tensor in again.state_dict().items():
        assert tensor.dtype == want[key].dtype and torch.equal(tensor, want[key]), key
