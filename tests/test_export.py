"""`tessera.checkpoint.export_model`: safetensors keyed as `state_dict()`, tied weights included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tessera.checkpoint import EXPORT_FORMATS, export_model
from tessera.checkpoint.export import untied


class Tied(nn.Module):
    """An embedding and an output head sharing one weight, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0]))


def test_safetensors_keys_equal_the_state_dict_with_tied_weights(tmp_path):
    model = Tied()
    state = model.state_dict()
    assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()
    path = export_model(model, state, tmp_path / "out")
    assert path == tmp_path / "out" / "model.safetensors"
    loaded = load_file(path)
    assert sorted(loaded) == sorted(state) == ["embed.weight", "head.weight", "scale"]
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    fresh = Tied()
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.head.weight, model.head.weight)
    file = export_model(model, state, tmp_path / "one.safetensors")
    assert file == tmp_path / "one.safetensors" and sorted(load_file(file)) == sorted(state)
    assert not (tmp_path / "out" / "config.json").exists()  # only a transformers model has one


def test_untied_copies_only_what_shares_storage():
    model = Tied()
    out = untied(model.state_dict())
    assert out["embed.weight"].data_ptr() != out["head.weight"].data_ptr()
    assert out["scale"].data_ptr() == model.scale.data_ptr()  # not shared: not copied


def test_export_refusals(tmp_path):
    model = Tied()
    assert EXPORT_FORMATS == ("safetensors", "hf")
    with pytest.raises(ValueError, match="Tied is not one \\(use format safetensors\\)"):
        export_model(model, model.state_dict(), tmp_path, "hf")
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export_model(model, model.state_dict(), tmp_path, "onnx")
    with pytest.raises(ValueError, match=r"missing \['scale'\]"):
        export_model(model, {k: v for k, v in model.state_dict().items() if k != "scale"}, tmp_path)


def test_a_demo_run_exports_its_gpt(tmp_path):
    """`tessera checkpoint export` of the demo: the GPT rebuilt with the checkpoint's vocabulary."""
    from tessera.cli import main
    from tessera.models import GPT, GPTConfig
    from tessera.train import latest_checkpoint, load_checkpoint

    tiny = "--n-layer 1 --n-embd 16 --n-head 2 --block-size 16 --batch-size 4 --corpus-bytes 5000"
    args = ["train", "--strategy", "single", "--nproc", "1", "--steps", "1", "--no-progress"]
    assert main([*args, *tiny.split(), "--sample-tokens", "0", "--out", str(tmp_path)]) == 0
    assert main(["checkpoint", "export", str(tmp_path), str(tmp_path / "gpt")]) == 0
    state = load_checkpoint(latest_checkpoint(tmp_path))
    exported = load_file(tmp_path / "gpt/model.safetensors")
    vocab = len(state["tokenizer"]["chars"])
    model = GPT(GPTConfig(vocab_size=vocab, n_layer=1, n_embd=16, n_head=2, block_size=16))
    assert sorted(exported) == sorted(model.state_dict())
    model.load_state_dict(exported)
    for key, value in state["engine"]["model"].items():
        assert torch.equal(exported[key], value), key
