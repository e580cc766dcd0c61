"""Data: tokenizer, corpus, synthetic sets, and rank sharding equal to one-process batches."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from tessera.data import (
    STDLIB_MEMBERS,
    CharTokenizer,
    LMBatches,
    load_corpus,
    local_batch_size,
    make_classification,
    make_images,
    shard_indices,
    stdlib_corpus_dir,
)

# ----- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_round_trip_and_sorted_vocab():
    tokenizer = CharTokenizer.from_text("hello, world\n")
    assert tokenizer.chars == "\n ,dehlorw"
    assert tokenizer.vocab_size == 10
    ids = tokenizer.encode("world, hello")
    assert ids[:5] == [9, 7, 8, 6, 3]  # w o r l d
    assert tokenizer.decode(ids) == "world, hello"
    tensor = tokenizer.encode_tensor("hello")
    assert tensor.dtype == torch.long and tensor.tolist() == tokenizer.encode("hello")
    assert tokenizer.decode(tensor) == "hello"


def test_tokenizer_errors():
    tokenizer = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"character 'z' at position 2 is not in the vocabulary"):
        tokenizer.encode("abz")
    with pytest.raises(ValueError, match=r"token id 3 out of range \[0, 3\)"):
        tokenizer.decode([0, 3])
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer(chars="aa")


def test_tokenizer_dict_is_json_and_round_trips():
    tokenizer = CharTokenizer.from_text("αβγ abc\t")
    state = json.loads(json.dumps(tokenizer.to_dict()))
    restored = CharTokenizer.from_dict(state)
    assert restored == tokenizer
    assert restored.encode("β a\t") == tokenizer.encode("β a\t")
    with pytest.raises(ValueError, match="not a CharTokenizer dict"):
        CharTokenizer.from_dict({"type": "bpe"})


# ----- corpus -------------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_and_starts_with_first_member():
    first = load_corpus(max_bytes=200_000)
    assert first == load_corpus("stdlib", max_bytes=200_000)
    assert 190_000 < len(first) <= 200_000
    head = (stdlib_corpus_dir() / STDLIB_MEMBERS[0]).read_text(encoding="utf-8")[:1000]
    assert first.startswith(head)
    assert list(STDLIB_MEMBERS) == sorted(STDLIB_MEMBERS)
    # A shorter read is a prefix of a longer one: the order is fixed, only the cut moves.
    assert first.startswith(load_corpus(max_bytes=5_000))


def test_default_corpus_size_and_vocab():
    text = load_corpus()
    assert len(text.encode("utf-8", errors="replace")) >= 1_900_000
    assert 60 < CharTokenizer.from_text(text).vocab_size < 1000


def test_corpus_from_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third\n")
    (tmp_path / ".hidden").write_text("secret\n")
    (tmp_path / "bad.bin").write_bytes(b"\xff\n")
    assert load_corpus(str(tmp_path / "a.txt")) == "first\n"
    assert load_corpus(str(tmp_path)) == "first\nsecond\n\ufffd\nthird\n"
    assert load_corpus(str(tmp_path), max_bytes=8) == "first\nse"


def test_corpus_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"corpus path does not exist: '{missing}'")
    ):
        load_corpus(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no text"):
        load_corpus(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        load_corpus(max_bytes=0)


# ----- synthetic ----------------------------------------------------------------------------


def test_make_classification_is_deterministic_and_separable():
    data = make_classification(512, 6, 4, seed=3)
    x, y = data.tensors
    assert x.shape == (512, 6) and x.dtype == torch.float32
    assert y.shape == (512,) and y.dtype == torch.int64 and set(y.tolist()) == {0, 1, 2, 3}
    again = make_classification(512, 6, 4, seed=3).tensors
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, make_classification(512, 6, 4, seed=4).tensors[0])
    # Nearest class mean classifies most points: the classes carry signal, not just noise.
    means = torch.stack([x[y == k].mean(0) for k in range(4)])
    nearest = torch.cdist(x, means).argmin(1)
    assert (nearest == y).float().mean() > 0.8
    with pytest.raises(ValueError, match="num_classes must be positive"):
        make_classification(4, 2, 0, seed=0)


def test_make_images_is_deterministic():
    images, labels = make_images(64, channels=3, size=6, num_classes=5, seed=1).tensors
    assert images.shape == (64, 3, 6, 6) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.max() < 5
    assert torch.equal(
        images, make_images(64, channels=3, size=6, num_classes=5, seed=1).tensors[0]
    )
    # Same class -> same pattern under the noise: class means differ by ~2 per pixel.
    k = labels[0]
    class_mean = images[labels == k].mean(0)
    assert (class_mean.sign() == images[0].sign()).float().mean() > 0.6


# ----- LMBatches ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_lm_batches_union_over_ranks_is_single_process_batch(world_size):
    batches = LMBatches(torch.arange(1000), block_size=16, global_batch_size=8, seed=5)
    for step in (0, 1, 17):
        x_single, y_single = batches.batch(step)
        parts = [batches.batch(step, rank, world_size) for rank in range(world_size)]
        assert all(x.shape == (8 // world_size, 16) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), x_single)
        assert torch.equal(torch.cat([y for _, y in parts]), y_single)


def test_lm_batches_targets_are_next_tokens_and_windows_contiguous():
    x, y = LMBatches(torch.arange(500), block_size=32, global_batch_size=16, seed=0).batch(3)
    assert x.shape == y.shape == (16, 32)
    # With tokens 0..499, each window is a run of consecutive ids and y = x + 1.
    assert torch.equal(y, x + 1)
    assert torch.equal(x - x[:, :1], torch.arange(32).expand(16, 32))
    assert x.min() >= 0 and y.max() <= 499


def test_lm_batches_pure_function_of_seed_and_step():
    tokens = torch.randint(50, (2000,), generator=torch.Generator().manual_seed(0))
    a = LMBatches(tokens, block_size=8, global_batch_size=4, seed=1)
    b = LMBatches(tokens, block_size=8, global_batch_size=4, seed=1)
    later = [a.batch(s)[0] for s in range(5)]  # consuming steps leaves no state behind
    assert torch.equal(b.batch(4)[0], later[4])
    assert torch.equal(a.batch(2)[0], b.batch(2)[0])
    assert not torch.equal(a.batch(2)[0], a.batch(3)[0])
    c = LMBatches(tokens, block_size=8, global_batch_size=4, seed=2)
    assert not torch.equal(a.batch(2)[0], c.batch(2)[0])


def test_lm_batches_errors_and_split():
    batches = LMBatches(torch.arange(100), block_size=8, global_batch_size=6)
    with pytest.raises(
        ValueError, match=r"global_batch_size \(6\) must be divisible by world_size \(4\)"
    ):
        batches.batch(0, 0, 4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        batches.batch(0, 2, 2)
    with pytest.raises(ValueError, match="need at least block_size \\+ 1 = 9 tokens"):
        LMBatches(torch.arange(8), block_size=8, global_batch_size=1)
    train, val = batches.split(0.2)
    assert train.tokens.numel() == 80 and val.tokens.numel() == 20
    assert train.batch(0)[1].max() < 80 and val.batch(0)[0].min() >= 80


# ----- shard_indices ------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shard_indices_union_over_ranks_is_single_process_batch(world_size):
    for step in (0, 3, 11):  # 11 * 8 = 88 > 30: several epochs in
        single = shard_indices(30, step, 8, 0, 1, seed=2)
        parts = [shard_indices(30, step, 8, r, world_size, seed=2) for r in range(world_size)]
        assert torch.equal(torch.cat(parts), single)


def test_shard_indices_epochs_wrap_into_fresh_permutations():
    # 10 samples, batches of 4: step 2 straddles epochs 0 and 1 (positions 8..11).
    stream = torch.cat([shard_indices(10, s, 4, 0, 1, seed=0) for s in range(5)])  # 20 = 2 epochs
    epoch0, epoch1 = stream[:10], stream[10:]
    assert sorted(epoch0.tolist()) == list(range(10))
    assert sorted(epoch1.tolist()) == list(range(10))
    assert not torch.equal(epoch0, epoch1)  # reshuffled each epoch
    # Batch larger than the data set: still the stream, covering whole epochs.
    big = shard_indices(3, 0, 9, 0, 1, seed=0)
    assert all(sorted(big[i : i + 3].tolist()) == [0, 1, 2] for i in (0, 3, 6))
    ordered = torch.cat([shard_indices(10, s, 4, 0, 1, seed=0, shuffle=False) for s in range(5)])
    assert ordered.tolist() == [i % 10 for i in range(20)]


def test_shard_indices_errors():
    with pytest.raises(
        ValueError, match=r"global_batch_size \(10\) must be divisible by world_size \(3\)"
    ):
        shard_indices(100, 0, 10, 0, 3, seed=0)
    with pytest.raises(ValueError, match="num_samples must be positive"):
        shard_indices(0, 0, 4, 0, 1, seed=0)


def test_sharded_gradients_average_to_single_process_gradient():
    """Why contiguous equal slices: the mean of per-rank mean gradients is the global one."""
    x, y = make_classification(64, 5, 3, seed=0).tensors
    model = torch.nn.Linear(5, 3)

    def grad(indices):
        model.zero_grad()
        F.cross_entropy(model(x[indices]), y[indices]).backward()
        return model.weight.grad.clone()

    single = grad(shard_indices(64, 1, 16, 0, 1, seed=9))
    per_rank = [grad(shard_indices(64, 1, 16, r, 4, seed=9)) for r in range(4)]
    torch.testing.assert_close(torch.stack(per_rank).mean(0), single)  # float32 sum order only


def test_local_batch_size_splits_evenly_or_refuses():
    assert [local_batch_size(12, r, 4) for r in range(4)] == [3, 3, 3, 3]
    assert local_batch_size(7, 0, 1) == 7
    with pytest.raises(ValueError, match=r"global_batch_size \(10\) must be divisible"):
        local_batch_size(10, 0, 4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        local_batch_size(4, 2, 2)
    with pytest.raises(ValueError, match="world_size must be positive"):
        local_batch_size(4, 0, 0)
