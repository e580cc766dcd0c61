"""The loader of `tessera train --data`: workers, epochs, the user's collate, and throughput.

The order is checked against a plain re-derivation written here (seeded permutations per epoch,
each item fetched under its own seed); runs go through `tessera train` with data tessera never
built (tests/user_data_loading.py: images augmented in the workers, variable-length text padded
by the user's collate, a two-input model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import user_data_loading as udl

from tessera.checkpoint.series import STATE_FILE, step_folder
from tessera.cli import main
from tessera.data.batches import DatasetBatches
from tessera.data.loader import BatchShape, step_loader
from tessera.data.order import EpochOrder
from tessera.train import latest_checkpoint, load_checkpoint
from tessera.train.export import checkpoint_model_state
from tessera.train.metrics import read_metrics

QUIET = ["--no-progress", "--checkpoint-every", "0", "--warmup-steps", "0"]
IMAGES = ["--model", "user_data_loading:cnn", "--data", "user_data_loading:images",
          "--loss", "user_data_loading:cross_entropy"]  # fmt: skip


def _plain_batch(dataset, seed: int, step: int, batch: int) -> list:
    """The items of `step`, derived here without tessera: epoch e's permutation from a generator
    seeded `seed * 1_000_003 + e`, N // batch steps an epoch, the item at position p of step s
    fetched with torch's CPU generator seeded ((seed * 1_000_003 + s) * 1_000_033 + p)."""
    per_epoch = len(dataset) // batch
    epoch, within = divmod(step, per_epoch)
    order = torch.randperm(
        len(dataset), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    )
    items = []
    for position, index in enumerate(order[within * batch : (within + 1) * batch].tolist()):
        torch.manual_seed(((seed * 1_000_003 + step) * 1_000_033 + position) & ((1 << 63) - 1))
        items.append(dataset[index])
    return items


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def test_workers_yield_the_plain_batches_of_any_step_range_and_leave_the_rng_alone():
    dataset, seed, batch = udl.Images(40), 3, 8  # 5 steps an epoch; steps 3..11 cross two
    shape = BatchShape()
    expected = [shape(_plain_batch(dataset, seed, step, batch)) for step in range(3, 12)]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for workers in (0, 2):
        order = EpochOrder(len(dataset), batch, seed)
        loader = step_loader(
            dataset, order, shape, start=3, stop=12, rank=0, world_size=1,
            num_workers=workers, pin_memory=False,
        )  # fmt: skip
        got = list(loader)
        assert len(got) == 9 and all(_equal(g, e) for g, e in zip(got, expected)), workers
        assert torch.equal(torch.get_rng_state(), before), workers  # dropout's stream untouched
    # two ranks' rows, in rank order, are the one-process batch (augmentation included)
    halves = [
        list(step_loader(dataset, EpochOrder(40, batch, seed), shape, start=3, stop=5, rank=r,
                         world_size=2, num_workers=1, pin_memory=False))
        for r in (0, 1)
    ]  # fmt: skip
    for step in range(2):
        joined = [torch.cat([halves[0][step][i], halves[1][step][i]]) for i in range(2)]
        assert _equal(joined, expected[step])


def test_every_epoch_is_a_fresh_permutation_computed_once(monkeypatch):
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or real(*a, **k))
    order = EpochOrder(64, 16, seed=0)
    epochs = [torch.cat([order.indices(s) for s in range(e * 4, e * 4 + 4)]) for e in range(3)]
    assert len(calls) == 3  # once per epoch, not once per step
    for indices in epochs:
        assert sorted(indices.tolist()) == list(range(64))
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    assert EpochOrder(70, 16).steps_per_epoch == 4  # the 6 left over are dropped each epoch
    with pytest.raises(ValueError, match="fewer than the global batch"):
        EpochOrder(15, 16)


def _run(out: Path, *args: str) -> None:
    assert main(["train", *QUIET, "--out", str(out), *args]) == 0


def _weights(run: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run) if step is None else step_folder(run, step) / STATE_FILE
    return checkpoint_model_state(path, load_checkpoint(path))


def test_two_epochs_run_eight_steps_and_workers_resume_bit_exact(tmp_path):
    """64 augmented images, --batch-size 16, --epochs 2 (--num-workers 0): 8 steps, the epoch in
    metrics.jsonl. --num-workers 2 for 3 steps, resumed to 6, equals its first 6 steps, loss for
    loss and weight for weight; the first loss is the plain batch's through the factory's model."""
    common = ["--nproc", "1", "--strategy", "single", *IMAGES, "--batch-size", "16"]
    common += ["--decay-steps", "8"]  # else a --model run's schedule spans its own --steps
    _run(tmp_path / "epochs", *common, "--epochs", "2", "--num-workers", "0",
         "--checkpoint-every", "6")  # fmt: skip
    records = read_metrics(tmp_path / "epochs" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["epoch"] for r in records] == [s / 4 for s in range(1, 9)]
    first = udl.cross_entropy(*_first_forward(udl.images(), 16))
    # the same float32 batch loss, reduced in another order: a few roundings
    assert records[0]["loss"] == pytest.approx(float(first), rel=8 * torch.finfo(torch.float32).eps)

    _run(tmp_path / "split", *common, "--steps", "3", "--num-workers", "2",
         "--checkpoint-every", "3")  # fmt: skip
    assert main(["train", "--resume", str(tmp_path / "split"), "--steps", "6"]) == 0
    resumed = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records[:6]] and len(resumed) == 6
    a, b = _weights(tmp_path / "epochs", step=6), _weights(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _first_forward(dataset, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The untrained model on step 0's batch, collated by hand."""
    items = _plain_batch(dataset, 0, 0, batch)
    model = udl.cnn()
    with torch.no_grad():
        return model(torch.stack([x for x, _ in items])), torch.stack([y for _, y in items])


def test_padding_collate_with_input_and_target_keys_and_a_two_input_model(tmp_path):
    """Variable-length text padded by the user's collate in 2 workers per rank, on 2 ranks, its
    dict batches split by --input-keys/--target-keys into model(input_ids, lengths) and
    loss(output, labels); ((a, b), y) items call model(a, b). The first logged loss is the plain
    loop's on the same items."""
    text = ["--model", "user_data_loading:bag", "--data", "user_data_loading:texts",
            "--loss", "user_data_loading:cross_entropy", "--collate",
            "user_data_loading:pad_collate", "--input-keys", "input_ids,lengths",
            "--target-keys", "labels"]  # fmt: skip
    _run(tmp_path / "text", "--nproc", "2", "--strategy", "ddp", *text, "--batch-size", "8",
         "--steps", "3", "--num-workers", "2")  # fmt: skip
    batch = udl.pad_collate(_plain_batch(udl.texts(), 0, 0, 8))
    with torch.no_grad():
        plain = udl.cross_entropy(udl.bag()(batch["input_ids"], batch["lengths"]), batch["labels"])
    records = read_metrics(tmp_path / "text" / "metrics.jsonl")
    few = 8 * torch.finfo(torch.float32).eps  # two halves' means against the whole batch's
    assert len(records) == 3 and records[0]["loss"] == pytest.approx(float(plain), rel=few)

    two = ["--model", "user_data_loading:two_input", "--data", "user_data_loading:two_inputs",
           "--loss", "user_data_loading:mse"]  # fmt: skip
    _run(tmp_path / "two", "--nproc", "1", "--strategy", "single", *two, "--batch-size", "8",
         "--steps", "2", "--num-workers", "0", "--grad-accum", "2")  # fmt: skip
    items = _plain_batch(udl.two_inputs(), 0, 0, 16)
    a, b, y = (torch.stack([i[0][0] for i in items]), torch.stack([i[0][1] for i in items]),
               torch.stack([i[1] for i in items]))  # fmt: skip
    with torch.no_grad():
        plain = udl.mse(udl.two_input()(a, b), y)
    first = read_metrics(tmp_path / "two" / "metrics.jsonl")[0]["loss"]
    assert first == pytest.approx(float(plain), rel=few)


def test_bad_loader_options_stop_before_any_rank(tmp_path, capsys):
    cases = {
        ("--epochs", "2"): "--epochs goes with --model",
        ("--input-keys", "a"): "--input-keys and --target-keys go together",
        ("--num-workers", "-2"): "num_workers must be >= 0",
        (*IMAGES, "--collate", "nope"): "--collate 'nope' is not PKG.MODULE:FN",
    }
    for args, message in cases.items():
        assert main(["train", *QUIET, "--out", str(tmp_path / "bad"), *args]) == 2
        assert message in capsys.readouterr().err, args
    assert not (tmp_path / "bad").exists()


def test_the_step_batches_are_the_loader_batches():
    """`DatasetBatches.batch` (what preflight and `--eval-batches K` use) equals the loader."""
    dataset = udl.Images(40)
    batches = DatasetBatches(dataset, global_batch_size=8, seed=1)
    loader = step_loader(dataset, batches.order, BatchShape(), start=0, stop=6, rank=1,
                         world_size=2, num_workers=0, pin_memory=False)  # fmt: skip
    for step, got in enumerate(loader):
        assert _equal(got, batches.batch(step, 1, 2))


def _ids(folder: Path) -> list[list[list[int]]]:
    """The ids of each loss call of rank 0, then of rank 1 (the launching process's own call,
    its check of one item, has no rank), each rank's processes in the order they started."""
    calls: dict[int, list[list[int]]] = {0: [], 1: []}
    files = [p for p in folder.glob("*.txt") if not p.name.startswith("none.")]
    for path in sorted(files, key=lambda p: int(p.name.split(".")[1])):
        lines = path.read_text().splitlines()
        calls[int(path.name.split(".")[0])] += [[int(i) for i in line.split()] for line in lines]
    return [calls[0], calls[1]]


def test_a_stream_splits_over_ranks_and_workers_once_per_epoch_and_resumes_exactly(
    tmp_path, monkeypatch
):
    """An IterableDataset of 20 ids on 2 ranks with 2 workers each, global batch 8: 5 steps are
    two epochs, every id once in each (whichever rank and worker read it); 3 steps resumed to 5
    take the same ids and losses."""
    stream = ["--nproc", "2", "--strategy", "ddp", "--model", "user_data_loading:id_model",
              "--data", "user_data_loading:stream", "--loss", "user_data_loading:logged_mse",
              "--batch-size", "8", "--num-workers", "2", "--checkpoint-every", "3",
              "--decay-steps", "5"]  # fmt: skip (else the schedule spans each run's --steps)
    seen = {}
    for name, steps in (("straight", ["--steps", "5"]), ("split", ["--steps", "3"])):
        (tmp_path / f"{name}-ids").mkdir()
        monkeypatch.setenv("IDS_DIR", str(tmp_path / f"{name}-ids"))
        _run(tmp_path / name, *stream, *steps)
        if name == "split":
            assert main(["train", "--resume", str(tmp_path / "split"), "--steps", "5"]) == 0
        seen[name] = _ids(tmp_path / f"{name}-ids")
    straight = seen["straight"]
    assert [len(calls) for calls in straight] == [5, 5]
    # a step's global batch: rank 0's rows, then rank 1's
    stream_ids = [i for step in range(5) for calls in straight for i in calls[step]]
    epochs = [sorted(stream_ids[:20]), sorted(stream_ids[20:])]
    assert epochs == [list(range(20))] * 2, stream_ids
    assert stream_ids[:20] != stream_ids[20:]  # a fresh order in the second epoch
    assert seen["split"] == straight  # the first run's 3 steps, then the resumed run's 2
    losses = [read_metrics(tmp_path / n / "metrics.jsonl") for n in ("straight", "split")]
    assert [r["loss"] for r in losses[0]] == [r["loss"] for r in losses[1]]


def test_setup_takes_tuple_and_dict_inputs_and_accumulates_them_as_a_plain_loop(run_ranks):
    """`tessera.setup(..., strategy="single", grad_accum=2)`: a batch `((a, b), y)` calls
    model(a, b) and `({"a": a, "b": b}, y)` calls model(a=a, b=b); one SGD step on each equals
    the plain loop's step on the whole batch (accumulation cuts the nested inputs too)."""
    run_ranks(_setup_checks, 1)


def _setup_checks() -> None:
    import tessera

    a, b = torch.randn(6, 5), torch.randn(6, 3)
    y = torch.randn(6, 2)
    plain = udl.two_input()
    udl.mse(plain(a, b), y).backward()
    expected = {n: p.detach() - 0.1 * p.grad for n, p in plain.named_parameters()}
    for batch in (((a, b), y), ({"a": a, "b": b}, y)):
        model = udl.two_input()
        engine = tessera.setup(
            model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="single",
            loss_fn=udl.mse, grad_accum=2,
        )  # fmt: skip
        loss = engine.train_step(batch)
        engine.step()
        # the halves' weighted sum against the whole batch's mean: a few roundings of values
        # of order 1 (the loss, the gradients, lr 0.1 times them)
        tolerance = 8 * torch.finfo(torch.float32).eps
        assert abs(float(loss) - float(udl.mse(udl.two_input()(a, b), y))) < tolerance
        for name, value in model.named_parameters():
            torch.testing.assert_close(value.detach(), expected[name], rtol=0, atol=tolerance)


def test_setup_takes_input_and_target_keys_of_dict_batches(run_ranks):
    """`tessera.setup(..., input_keys=["a", "b"], target_keys=["y"])` on dict batches that also
    hold a key the model must not get ("id"): single and ddp on 2 ranks (each its half of the
    rows) give the plain loop's loss and one SGD step; keys without their partner, or a key the
    batch lacks, are refused in one message."""
    run_ranks(_keyed_checks, 2)


def _keyed_checks() -> None:
    import tessera

    ctx = tessera.init()
    generator = torch.Generator().manual_seed(3)
    a, b, y = (torch.randn(8, n, generator=generator) for n in (5, 3, 2))
    plain = udl.two_input()
    udl.mse(plain(a, b), y).backward()
    expected = {n: p.detach() - 0.1 * p.grad for n, p in plain.named_parameters()}
    rows = slice(4 * ctx.rank, 4 * ctx.rank + 4)
    for strategy, part in (("single", slice(None)), ("ddp", rows)):
        model = udl.two_input()
        engine = tessera.setup(
            model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy, loss_fn=udl.mse,
            input_keys=["a", "b"], target_keys=["y"],
        )  # fmt: skip
        batch = {"a": a[part], "b": b[part], "y": y[part], "id": torch.arange(8)[part]}
        loss = engine.train_step(batch)
        engine.step()
        # two halves' mean against the whole batch's, SGD at lr 0.1: a few float32 roundings
        tolerance = 8 * torch.finfo(torch.float32).eps
        assert abs(float(loss) - float(udl.mse(udl.two_input()(a, b), y))) < tolerance, strategy
        for name, value in model.named_parameters():
            torch.testing.assert_close(value.detach(), expected[name], rtol=0, atol=tolerance)
    model = udl.two_input()
    with pytest.raises(ValueError, match="go together"):
        tessera.setup(model, torch.optim.SGD, strategy="single", input_keys=["a"])
    engine = tessera.setup(
        model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="single", loss_fn=udl.mse,
        input_keys=["a", "c"], target_keys=["y"],
    )  # fmt: skip
    with pytest.raises(ValueError, match="no key 'c'"):
        engine.train_step({"a": a, "b": b, "y": y})


def test_one_pass_splits_every_item_once_over_the_ranks():
    from tessera.data.passes import chunk_shares

    for items in range(1, 30):
        for batch in range(1, 9):
            for world in (1, 2, 3, 4):
                if items < world:
                    with pytest.raises(ValueError, match="fewer than the"):
                        chunk_shares(items, batch, 0, world)
                    continue
                shares = [chunk_shares(items, batch, r, world) for r in range(world)]
                assert len({len(s) for s in shares}) == 1  # every rank takes every chunk
                assert all(len(share) > 0 for s in shares for share in s)  # nothing padded
                seen = sorted(i for s in shares for share in s for i in share)
                assert seen == list(range(items)), (items, batch, world)


@pytest.mark.parametrize("nproc", [1, 2])
def test_val_loss_is_the_plain_mean_over_every_item_of_the_evaluation_set(tmp_path, nproc):
    """13 evaluation items, --batch-size 4, on 1 and 2 ranks: val_loss at the end equals a
    plain loop's mean over all 13 items of the final weights."""
    two = ["--model", "user_data_loading:two_input", "--data", "user_data_loading:two_inputs",
           "--loss", "user_data_loading:mse", "--eval-data", "user_data_loading:two_inputs_13",
           "--eval-every", "2", "--steps", "2", "--batch-size", "4",
           "--num-workers", "1"]  # fmt: skip
    strategy = "single" if nproc == 1 else "ddp"
    _run(tmp_path, "--nproc", str(nproc), "--strategy", strategy, *two)
    model = udl.two_input()
    model.load_state_dict(_weights(tmp_path))
    dataset = udl.two_inputs_13()
    with torch.no_grad():
        losses = [udl.mse(model(a[None], b[None]), y[None]) for (a, b), y in dataset]
    plain = sum(float(loss) for loss in losses) / len(losses)
    val_loss = read_metrics(tmp_path / "metrics.jsonl")[-1]["val_loss"]
    # float32 losses of order 1 summed in another grouping: a few roundings each
    assert val_loss == pytest.approx(plain, rel=16 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("nproc", [1, 2])
def test_val_loss_of_a_token_averaged_loss_is_the_mean_over_every_token(tmp_path, nproc):
    """13 padded sequences of 3-9 tokens (--batch-size 4, so batches and ranks hold different
    token counts), nn.CrossEntropyLoss ignoring the padding's -100: val_loss equals the plain
    loop's summed token losses over the set divided by its tokens, not a mean of batch means."""
    tags = ["--model", "user_data_loading:tagger", "--data", "user_data_loading:texts",
            "--loss", "user_data_loading:token_loss", "--collate", "user_data_loading:tag_collate",
            "--input-keys", "input_ids", "--target-keys", "labels",
            "--eval-data", "user_data_loading:texts_13", "--eval-every", "1", "--steps", "1",
            "--batch-size", "4", "--num-workers", "0"]  # fmt: skip
    strategy = "single" if nproc == 1 else "ddp"
    _run(tmp_path, "--nproc", str(nproc), "--strategy", strategy, *tags)
    model = udl.tagger()
    model.load_state_dict(_weights(tmp_path))
    batch = udl.tag_collate([udl.texts_13()[i] for i in range(13)])
    with torch.no_grad():
        summed = torch.nn.functional.cross_entropy(
            model(batch["input_ids"]), batch["labels"], reduction="sum"
        )
    plain = float(summed) / int((batch["labels"] != -100).sum())
    val_loss = read_metrics(tmp_path / "metrics.jsonl")[-1]["val_loss"]
    # float32 sums of about 80 token losses of order 1 in another grouping
    assert val_loss == pytest.approx(plain, rel=80 * torch.finfo(torch.float32).eps)


def test_the_step_time_counts_the_wait_for_the_batch(tmp_path):
    """Items costing 10 ms each, fetched in the rank (--num-workers 0), 4 a step: every step
    waits at least 40 ms for its batch (data_s), and step_s, which samples/s divides, holds it."""
    slow = ["--model", "user_data_loading:linear", "--data", "user_data_loading:slow",
            "--loss", "user_data_loading:mse", "--batch-size", "4", "--steps", "3",
            "--num-workers", "0", "--nproc", "1", "--strategy", "single"]  # fmt: skip
    _run(tmp_path, *slow)
    records = read_metrics(tmp_path / "metrics.jsonl")
    for record in records:
        assert record["data_s"] >= 4 * udl.SLOW_S
        assert record["step_s"] >= record["data_s"]
        assert record["samples_per_s"] == pytest.approx(4 / record["step_s"])
        assert "tokens_per_s" not in record  # the items are not token ids
