"""Data with no download (stdlib text corpus, synthetic sets) and deterministic rank sharding."""

from tessera.data.corpus import STDLIB_MEMBERS, load_corpus, stdlib_corpus_dir
from tessera.data.sharding import LMBatches, local_batch_size, shard_indices
from tessera.data.synthetic import make_classification, make_images
from tessera.data.tokenizer import CharTokenizer

__all__ = [
    "STDLIB_MEMBERS",
    "CharTokenizer",
    "LMBatches",
    "load_corpus",
    "local_batch_size",
    "make_classification",
    "make_images",
    "shard_indices",
    "stdlib_corpus_dir",
]
