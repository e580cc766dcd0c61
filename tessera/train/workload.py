"""What a run trains: the model, the batch of each step, the loss, and what identifies them.

`build_workload(config)` gives every rank the same `Workload`:

- the demo (no `--model`): the character-level GPT on the corpus, next-token cross-entropy, a
  text sample generated at the end;
- a user's (`--model PKG.MODULE:FACTORY | hf:CLASS --data ... [--loss PKG.MODULE:FN]`): the
  model the factory builds, batches drawn from the data set (`tessera.data.batches`), and the
  loss of the batch rule: `loss(output, targets)` for (inputs, targets) items, `loss(output,
  batch)` for dict items, or for dict items without `--loss` the model's own `output.loss` /
  `output["loss"]` (the Hugging Face convention).

In both, the batch of a step is a pure function of (seed, step), so a resumed run draws what an
uninterrupted one would; it is the whole optimizer step's batch, `batch_size * grad_accum` rows,
drawn as one (the engine cuts it into the micro-batches), so accumulation changes no data.
`identity` goes into every checkpoint, and a resume whose workload identifies differently is
refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.data import CharTokenizer, LMBatches, load_corpus
from tessera.data.batches import Batch, DatasetBatches, item_kind
from tessera.data.imports import load_reference
from tessera.data.loader import BatchShape, default_workers, split_keys, step_loader
from tessera.data.passes import chunk_shares, eval_loader
from tessera.data.sources import open_data
from tessera.data.stream import StreamLoader, is_stream, stream_items
from tessera.errors import ConfigError
from tessera.models import GPT, GPTConfig
from tessera.models.user import model_factory, read_model_config
from tessera.train.config import TrainConfig
from tessera.train.config_build import config_to_dict

__all__ = [
    "Workload",
    "build_workload",
    "corpus_batches",
    "gpt_sample",
    "held_out_batches",
    "next_token_loss",
]

LossFn = Callable[[Any, Any], torch.Tensor]
DEFAULT_COLLATE = BatchShape().collate_fn


@dataclass(frozen=True)
class Workload:
    """Everything a rank needs to train, besides the strategy and the optimizer."""

    model_fn: Callable[[], nn.Module]
    """Builds the model; called after `torch.manual_seed(seed)` so every rank has the same."""
    batches: Callable[[int, int, int], Batch]
    """`(step, rank, world_size) -> batch`: this rank's rows of the global batch of `step`."""
    loss_fn: LossFn | None
    """`(output, targets)` for pair batches, `(output, batch)` for dict batches; None: dict
    batches whose model computes its own loss (`tessera.strategies.batch`'s rule)."""
    batch_kind: str
    """"pair" or "dict": how the loop hands a batch to the engine."""
    tokens_per_step: int
    """Tokens (samples, for data that is not token ids) in one optimizer step's global batch
    (every micro-batch of it)."""
    unit: str
    """"tokens" or "samples": what `tokens_per_step` counts."""
    identity: dict[str, Any]
    """Stored in checkpoints: a resume must build the same workload."""
    sample: Callable[[dict[str, torch.Tensor]], str] | None = None
    """The demo GPT's end-of-run text sample from the trained weights; None for user models."""
    eval_data: Any = field(default=None)
    """The `--eval-data` set, loaded and checked."""
    eval_batches: Callable[[int, int, int], Batch] | None = None
    """`(i, rank, world_size) -> batch`: this rank's rows of held-out batch i (a pure function of
    the seed: every evaluation sees the same batches); None when the run does not evaluate, or
    evaluates one pass over all of --eval-data (`eval_pass`)."""
    loader: Callable[..., Iterable[Batch]] | None = None
    """`(start=, stop=, rank=, world_size=, pin_memory=)`: this rank's batches of steps
    `start .. stop - 1`, fetched by loader workers (`tessera.data.loader`); None: the loop
    calls `batches` (the demo's token windows, in memory)."""
    eval_pass: Callable[..., Iterable[tuple[Batch, int]]] | None = None
    """`(rank=, world_size=, pin_memory=)`: this rank's `(batch, items in it)` of one pass over
    all of --eval-data (`tessera.data.passes`); None unless the run evaluates so."""
    steps_per_epoch: int | None = None
    """Optimizer steps in one pass over --data (None: the demo, whose windows have no epochs)."""


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-character prediction: logits (b, T, vocab), targets (b, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


HELD_OUT = 0.1
"""The demo's held-out share of the corpus (its end): never trained on, whether the run evaluates
or not, so that a run with evaluation takes the very steps of one without."""


def corpus_batches(config: TrainConfig) -> tuple[CharTokenizer, LMBatches]:
    """The demo's tokenizer and training batch stream: the corpus the config names less its
    held-out end (`held_out_batches`), cut into blocks; the batch of a step is a pure function
    of (seed, step), which is what makes resume exact."""
    tokenizer, batches = _corpus(config)
    return tokenizer, batches.split(HELD_OUT)[0]


def held_out_batches(config: TrainConfig, corpus: LMBatches | None = None) -> LMBatches:
    """The demo's evaluation batches: windows of the corpus's last `HELD_OUT` share, drawn with
    seed + 1 (`LMBatches.split`); ConfigError if that share is shorter than one window.
    `corpus`: the whole corpus's batches, if read already."""
    batches = corpus if corpus is not None else _corpus(config)[1]
    try:
        return batches.split(HELD_OUT)[1]
    except ValueError as exc:
        raise ConfigError(
            f"--eval-every: the corpus's held-out {HELD_OUT:.0%} is too short for one window of "
            f"block_size {config.model.block_size} ({exc}); raise --corpus-bytes"
        ) from None


def _corpus(config: TrainConfig) -> tuple[CharTokenizer, LMBatches]:
    text = load_corpus(config.corpus, max_bytes=config.corpus_bytes)
    tokenizer = CharTokenizer.from_text(text)
    batches = LMBatches(
        tokenizer.encode_tensor(text),
        block_size=config.model.block_size,
        global_batch_size=config.step_batch_size,  # one batch per optimizer step (grad_accum)
        seed=config.seed,
    )
    return tokenizer, batches


def gpt_sample(
    weights: dict[str, torch.Tensor],
    model_config: GPTConfig,
    tokenizer: CharTokenizer,
    config: TrainConfig,
) -> str:
    """Generate from a fresh copy of the trained GPT, whatever split trained it."""
    if config.sample_tokens == 0:
        return ""
    model = GPT(model_config)
    model.load_state_dict(weights)
    model.eval()
    prompt = "def " if set("def ") <= set(tokenizer.chars) else tokenizer.chars[0]
    idx = tokenizer.encode_tensor(prompt)[None, :]  # (1, len(prompt))
    generator = torch.Generator().manual_seed(config.seed)
    out = model.generate(idx, config.sample_tokens, temperature=0.8, top_k=20, generator=generator)
    return tokenizer.decode(out[0])


def demo_model_config(config: TrainConfig, vocab_size: int) -> GPTConfig:
    """The demo GPT's shape: the config's `model` section and the corpus's vocabulary."""
    return GPTConfig(vocab_size=vocab_size, **config_to_dict(config)["model"])


def _demo(config: TrainConfig) -> Workload:
    tokenizer, corpus = _corpus(config)
    batches = corpus.split(HELD_OUT)[0]  # as corpus_batches, without reading the corpus again
    model_config = demo_model_config(config, tokenizer.vocab_size)
    return Workload(
        model_fn=partial(GPT, model_config),
        batches=batches.batch,
        loss_fn=next_token_loss,
        batch_kind="pair",
        tokens_per_step=config.step_batch_size * config.model.block_size,
        unit="tokens",
        identity={"tokenizer": tokenizer.to_dict()},  # the key older checkpoints hold
        sample=lambda weights: gpt_sample(weights, model_config, tokenizer, config),
        eval_batches=held_out_batches(config, corpus).batch if config.eval_every else None,
    )


def _first_items(dataset: Any, spec: str, shape: BatchShape) -> Batch:
    """Collate the first two items (one if that is all): checks their kind and shapes agree."""
    if not is_stream(dataset) and len(dataset) < 1:
        raise ConfigError(f"{spec}: the data set is empty")
    try:
        if is_stream(dataset):
            items = list(islice(stream_items(dataset, 0), 2))
        else:
            items = [dataset[i] for i in range(min(2, len(dataset)))]
        if shape.collate_fn is DEFAULT_COLLATE:
            item_kind(items[0])
        return shape(items)
    except Exception as exc:
        raise ConfigError(f"{spec}: {type(exc).__name__}: {exc}") from None


def _tokens_per_item(sample: Batch) -> tuple[int, str]:
    if isinstance(sample, dict) and "input_ids" in sample:
        return sample["input_ids"][0].numel(), "tokens"
    return 1, "samples"


def _batch_kind(sample: Batch) -> str:
    return "dict" if isinstance(sample, Mapping) else "pair"


def _shape(config: TrainConfig) -> BatchShape:
    """The collate step of --collate, --input-keys and --target-keys."""
    settings = config.loader
    collate_fn = None
    if settings.collate is not None:
        collate_fn = load_reference(settings.collate, what="--collate")
    return BatchShape(collate_fn, split_keys(settings.input_keys), split_keys(settings.target_keys))


def _workers(config: TrainConfig) -> int:
    """--num-workers, or for -1 the machine's default for the ranks it runs."""
    if config.loader.num_workers >= 0:
        return config.loader.num_workers
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return default_workers(int(local) if local else config.nproc)


def _eval_pass(config: TrainConfig, dataset: Any, shape: BatchShape, workers: int) -> Any:
    """`Workload.eval_pass` of --eval-data: one pass, split over the ranks."""
    global_batch = config.batch_size

    def make(*, rank: int, world_size: int, pin_memory: bool) -> Iterable[tuple[Batch, int]]:
        shares = chunk_shares(len(dataset), global_batch, rank, world_size)
        loader = eval_loader(
            dataset,
            shape,
            global_batch_size=global_batch,
            seed=config.seed + 1,
            rank=rank,
            world_size=world_size,
            num_workers=workers,
            pin_memory=pin_memory,
        )
        return zip(loader, (len(share) for share in shares))

    return make


@dataclass(frozen=True)
class _TrainingData:
    batches: Callable[[int, int, int], Batch]
    loader: Callable[..., Iterable[Batch]]
    steps_per_epoch: int | None
    items: int | None


def _training_data(
    config: TrainConfig, dataset: Any, shape: BatchShape, workers: int
) -> _TrainingData:
    """The batches of --data: a map-style set's epochs (`tessera.data.order`) or a stream's
    items in order (`tessera.data.stream`), with the loader that fetches them."""
    G = config.step_batch_size
    if is_stream(dataset):
        if config.loader.epochs:
            raise ConfigError(
                f"--epochs needs the length of --data {config.data}, a streaming data set: "
                "give --steps"
            )

        def first(step: int, rank: int, world_size: int) -> Batch:  # preflight's one row
            b = G // world_size
            return shape(list(islice(stream_items(dataset, config.seed), b)))

        def loader(*, start, stop, rank, world_size, pin_memory, state=None) -> StreamLoader:
            return StreamLoader(
                dataset, shape, global_batch_size=G, steps=(start, stop),
                rank_world=(rank, world_size), seed=config.seed, num_workers=workers,
                pin_memory=pin_memory, state=state,
            )  # fmt: skip

        return _TrainingData(first, loader, None, None)
    try:
        batches = DatasetBatches(dataset, global_batch_size=G, seed=config.seed, collate_fn=shape)
    except ValueError as exc:
        raise ConfigError(f"--data {config.data}: {exc}") from None

    def steps(*, state: Any = None, **where: Any) -> Iterable[Batch]:
        return step_loader(dataset, batches.order, shape, num_workers=workers, **where)

    return _TrainingData(batches.batch, steps, batches.order.steps_per_epoch, len(dataset))


def _user(config: TrainConfig) -> Workload:
    """Why so long: it opens and checks the data, the evaluation data and the loss, and builds
    the loaders of both, each step short and in the order its errors should come."""
    assert config.model_factory is not None and config.data is not None
    build = model_factory(config.model_factory, config.model_config)
    opened = open_data(config.data, tokenizer=config.tokenizer, block_size=config.model.block_size)
    shape = _shape(config)
    sample = _first_items(opened.dataset, config.data, shape)
    kind = _batch_kind(sample)
    loss_fn: LossFn | None = None  # dict items without --loss: the model's own (batch rule)
    if config.loss is not None:
        loss_fn = load_reference(config.loss, what="--loss")
    elif kind == "pair":
        raise ConfigError(
            "(inputs, targets) items need --loss PKG.MODULE:FN: loss(output, targets)"
        )
    workers = _workers(config)
    train = _training_data(config, opened.dataset, shape, workers)
    eval_data = eval_batches = eval_pass = None
    if config.eval_data is not None:
        eval_opened = open_data(
            config.eval_data,
            tokenizer=config.tokenizer,
            block_size=config.model.block_size,
            what="--eval-data",
        )
        eval_kind = _batch_kind(_first_items(eval_opened.dataset, config.eval_data, shape))
        if eval_kind != kind:
            raise ConfigError(
                f"--eval-data {config.eval_data} has {eval_kind} items, --data has {kind} items"
            )
        eval_data = eval_opened.dataset
        if is_stream(eval_data):
            raise ConfigError(
                f"--eval-data {config.eval_data} is a streaming data set: evaluation passes "
                "over a set of known length (a map-style data set)"
            )
    if config.eval_every and config.eval_batches == 0:  # one pass over all of it
        if len(eval_data) < config.nproc:
            raise ConfigError(
                f"--eval-data {config.eval_data} has {len(eval_data)} items, fewer than the "
                f"{config.nproc} ranks that split it"
            )
        eval_pass = _eval_pass(config, eval_data, shape, workers)
    elif config.eval_every:  # (the config refused --eval-every without --eval-data)
        try:
            eval_batches = DatasetBatches(
                eval_data,
                global_batch_size=config.batch_size,
                seed=config.seed + 1,
                collate_fn=shape,
            ).batch
        except ValueError as exc:
            raise ConfigError(f"--eval-data {config.eval_data}: {exc}") from None
    per_item, unit = _tokens_per_item(sample)
    settings = config.loader
    identity = {
        "workload": {
            "model": config.model_factory,
            "data": config.data,
            "loss": config.loss,
            "model_config": read_model_config(config.model_config) if config.model_config else None,
            "items": train.items,
            "tokenizer": opened.tokenizer,
            "order": "epochs",  # batches drawn from epochs' permutations (tessera.data.order)
            "collate": [settings.collate, settings.input_keys, settings.target_keys],
        }
    }
    return Workload(
        model_fn=build,
        batches=train.batches,
        loss_fn=loss_fn,
        batch_kind=kind,
        tokens_per_step=config.step_batch_size * per_item,
        unit=unit,
        identity=identity,
        eval_data=eval_data,
        eval_batches=eval_batches,
        loader=train.loader,
        eval_pass=eval_pass,
        steps_per_epoch=train.steps_per_epoch,
    )


def build_workload(config: TrainConfig) -> Workload:
    """The run's workload: the demo GPT, or the user's model, data and loss (ConfigError if any
    of them cannot be loaded)."""
    return _demo(config) if config.model_factory is None else _user(config)
