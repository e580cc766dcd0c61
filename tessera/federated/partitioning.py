"""Split a labelled data set over federated clients: IID, label shards, or Dirichlet label skew.

Federated data is rarely identically distributed: a phone sees its owner's photos, not a uniform
draw of everyone's. The three schemes below are the ones papers compare against:

- `"iid"`: a random permutation cut into `num_clients` near-equal parts (sizes differ by <= 1).
- `"shards"` (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", sec. 3): sort the samples by label, cut them into
  `num_clients * shards_per_client` contiguous shards of near-equal size, deal the shards out at
  random, `shards_per_client` to each client. With 2 shards a client sees about 2 labels.
- `"dirichlet"`: label skew controlled by one concentration `alpha`. Convention (Yurochkin et al.
  2019, Hsu et al. 2019, "Measuring the effects of non-identical data distribution"; the one most
  benchmarks use): for every class c independently, draw proportions p_c ~ Dir(alpha * 1_K) over
  the K clients and give client k the share p_c[k] of class c's (shuffled) samples. Small alpha
  (0.1) gives each class to few clients; large alpha tends to IID. Client sizes then vary, and a
  client may receive no sample at all: simulation gives such a client zero weight.

Everything is drawn from `numpy.random.default_rng(seed)`, so a seed fixes the split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SCHEMES", "partition"]

SCHEMES = ("iid", "shards", "dirichlet")
"""Partition scheme names accepted by `partition`."""


def partition(
    labels: Sequence[int] | np.ndarray,
    num_clients: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    shards_per_client: int = 2,
    seed: int = 0,
) -> list[np.ndarray]:
    """Indices of each client's samples: a list of `num_clients` sorted int64 arrays.

    Every sample goes to exactly one client. `labels` are integer class labels (a tensor, array
    or list); `alpha` is used by `"dirichlet"` only, `shards_per_client` by `"shards"` only.
    """
    labels = np.asarray(labels.cpu() if hasattr(labels, "cpu") else labels)
    if labels.ndim != 1:
        raise ValueError(f"partition: labels must be one-dimensional, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"partition: labels must be integers, got dtype {labels.dtype}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"partition: num_clients must be a positive integer, got {num_clients}")
    if scheme not in SCHEMES:
        raise ValueError(f"partition: unknown scheme {scheme!r}; choose one of {SCHEMES}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = _iid(len(labels), num_clients, rng)
    elif scheme == "shards":
        parts = _shards(labels, num_clients, shards_per_client, rng)
    else:
        parts = _dirichlet(labels, num_clients, alpha, rng)
    return [np.sort(part).astype(np.int64) for part in parts]


def _iid(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    if num_samples < num_clients:
        raise ValueError(f"partition: {num_samples} samples cannot fill {num_clients} clients")
    return np.array_split(rng.permutation(num_samples), num_clients)


def _shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    if int(shards_per_client) != shards_per_client or shards_per_client < 1:
        raise ValueError(
            f"partition: shards_per_client must be a positive integer, got {shards_per_client}"
        )
    num_shards = num_clients * shards_per_client
    if len(labels) < num_shards:
        raise ValueError(
            f"partition: {len(labels)} samples cannot make {num_shards} shards "
            f"({num_clients} clients x {shards_per_client} shards)"
        )
    # A random tie-break inside each label, so which samples of a label share a shard is random.
    by_label = np.lexsort((rng.random(len(labels)), labels))
    shards = np.array_split(by_label, num_shards)
    order = rng.permutation(num_shards)
    dealt = order.reshape(num_clients, shards_per_client)  # row k: client k's shard numbers
    return [np.concatenate([shards[s] for s in row]) for row in dealt]


def _dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    if not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"partition: dirichlet alpha must be a finite number > 0, got {alpha}")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        proportions = rng.dirichlet(np.full(num_clients, float(alpha)))
        # Cut points from the cumulative proportions: client k gets members[cuts[k-1]:cuts[k]].
        cuts = np.round(np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
        for k, piece in enumerate(np.split(members, cuts)):
            parts[k].append(piece)
    return [np.concatenate(pieces) for pieces in parts]
