"""The data a user hands `tessera train --data`: batches as a pure function of (seed, step),
split over ranks like the demo corpus, and every source (factory, .txt, .jsonl, saved folder)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tessera.data.batches import DatasetBatches, collate, item_kind
from tessera.data.sources import open_data
from tessera.data.text import TokenWindows, load_tokenizer
from tessera.errors import ConfigError


class Numbered(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([i, i]), "y": i}


def test_the_ranks_batches_together_are_the_one_process_batch():
    batches = DatasetBatches(Numbered(), global_batch_size=8, seed=3)
    for step in (0, 1, 5):
        whole = batches.batch(step)
        ids = whole["y"].tolist()
        assert len(set(ids)) == 8  # without replacement within the batch
        assert torch.equal(whole["x"][:, 0], whole["y"])
        for world in (2, 4):
            parts = [batches.batch(step, rank, world) for rank in range(world)]
            assert torch.cat([p["y"] for p in parts]).tolist() == ids
    again = DatasetBatches(Numbered(), global_batch_size=8, seed=3)
    assert again.batch(5)["y"].tolist() == batches.batch(5)["y"].tolist()  # pure in (seed, step)
    assert batches.batch(0)["y"].tolist() != batches.batch(1)["y"].tolist()
    other_seed = DatasetBatches(Numbered(), global_batch_size=8, seed=4)
    assert other_seed.batch(0)["y"].tolist() != batches.batch(0)["y"].tolist()
    with pytest.raises(ValueError, match="20 items, fewer than the global batch of 32"):
        DatasetBatches(Numbered(), global_batch_size=32)


def test_collate_pairs_and_dicts():
    x, y = collate([(torch.ones(3), 1), (torch.zeros(3), 0)])
    assert x.shape == (2, 3) and y.tolist() == [1, 0]
    batch = collate([{"a": torch.ones(2)}, {"a": torch.zeros(2)}])
    assert batch["a"].shape == (2, 2)
    assert item_kind((1, 2)) == "pair" and item_kind({"a": 1}) == "dict"
    with pytest.raises(ValueError, match="got a 3-tuple"):
        item_kind((1, 2, 3))
    with pytest.raises(ValueError, match="key 'a' holds a str"):
        item_kind({"a": "text"})
    with pytest.raises(ValueError, match="different shapes"):
        collate([(torch.ones(3), 1), (torch.ones(2), 1)])


def test_text_files_become_windows_with_a_char_or_tokenizers_vocabulary(tmp_path):
    (tmp_path / "t.txt").write_text("abcabcabcab")
    opened = open_data(str(tmp_path / "t.txt"), tokenizer=None, block_size=3)
    assert isinstance(opened.dataset, TokenWindows) and len(opened.dataset) == 3
    item = opened.dataset[1]
    assert item["input_ids"].tolist() == [0, 1, 2] and torch.equal(
        item["labels"], item["input_ids"]
    )
    assert opened.tokenizer == {"type": "char", "chars": "abc"}
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "w.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in ["hello world", "world hello", "x"])
    )
    opened = open_data(str(tmp_path / "w.jsonl"), tokenizer=str(tmp_path / "tokenizer.json"),
                       block_size=2)  # fmt: skip
    assert [opened.dataset[i]["input_ids"].tolist() for i in range(2)] == [[0, 1], [1, 0]]
    assert opened.tokenizer["type"] == "tokenizers" and opened.tokenizer["vocab_size"] == 3
    assert load_tokenizer(None, "ba").identity == {"type": "char", "chars": "ab"}
    with pytest.raises(ConfigError, match="not a tokenizers JSON file"):
        load_tokenizer(str(tmp_path / "t.txt"), "")
    with pytest.raises(ConfigError, match="fewer than one window of 50"):
        open_data(str(tmp_path / "t.txt"), tokenizer=None, block_size=50)


def test_jsonl_fields_become_dict_items(tmp_path):
    rows = [{"ids": [i, i + 1], "label": i % 2, "w": 0.5} for i in range(4)]
    (tmp_path / "f.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    dataset = open_data(str(tmp_path / "f.jsonl"), tokenizer=None, block_size=8).dataset
    assert len(dataset) == 4
    item = dataset[2]
    assert item["ids"].tolist() == [2, 3] and item["label"].item() == 0
    assert item["w"].dtype == torch.float32
    (tmp_path / "ragged.jsonl").write_text('{"ids": [1, 2]}\n{"ids": [1]}\n')
    with pytest.raises(ConfigError, match="field 'ids' does not form a tensor"):
        open_data(str(tmp_path / "ragged.jsonl"), tokenizer=None, block_size=8)
    (tmp_path / "keys.jsonl").write_text('{"a": 1}\n{"b": 1}\n')
    with pytest.raises(ConfigError, match="keys.jsonl:2 has keys"):
        open_data(str(tmp_path / "keys.jsonl"), tokenizer=None, block_size=8)


def _save_to_disk(folder, columns: dict) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes: arrow stream files and state.json."""
    pa = pytest.importorskip("pyarrow")
    folder.mkdir()
    table = pa.table(columns)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text("{}")


def test_a_saved_datasets_folder_is_read_with_pyarrow(tmp_path):
    _save_to_disk(tmp_path / "fields", {"ids": [[1, 2], [3, 4], [5, 6]], "label": [0, 1, 0]})
    dataset = open_data(str(tmp_path / "fields"), tokenizer=None, block_size=8).dataset
    assert len(dataset) == 3 and dataset[1]["ids"].tolist() == [3, 4]
    _save_to_disk(tmp_path / "text", {"text": ["abab", "ba"]})
    opened = open_data(str(tmp_path / "text"), tokenizer=None, block_size=2)
    assert len(opened.dataset) == 3 and opened.tokenizer["chars"] == "\nab"
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict/dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(ConfigError, match=r"a DatasetDict: point it at one split's folder"):
        open_data(str(tmp_path / "dict"), tokenizer=None, block_size=2)


def test_a_saved_folder_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d/state.json").write_text('{"_data_files": []}')
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    with pytest.raises(ConfigError, match=r"needs pyarrow \(pip install pyarrow\)"):
        open_data(str(tmp_path / "d"), tokenizer=None, block_size=2)
