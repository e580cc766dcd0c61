"""Deterministic per-rank batches: W data-parallel ranks together see one process's batch.

Each global batch is a pure function of ``(seed, step)``: no iterator or sampler state, so a
resumed run draws exactly the batches an uninterrupted run would, and every rank computes the
same global batch locally and keeps its own contiguous slice. Because rank r holds rows
``[r*b, (r+1)*b)`` with ``b = global_batch_size // world_size``, concatenating the ranks' slices
in rank order gives the single-process batch row for row, and averaging the ranks' mean
gradients gives exactly the single-process mean gradient (DESIGN principle 2).
"""

from __future__ import annotations

import torch

__all__ = ["LMBatches", "local_batch_size", "shard_indices"]

# Mixes (seed, counter) into one generator seed; prime, so (seed, step) pairs with
# step < 1_000_003 never collide.
_SEED_STRIDE = 1_000_003


def _generator(seed: int, counter: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * _SEED_STRIDE + counter)


def local_batch_size(global_batch_size: int, rank: int, world_size: int) -> int:
    """Rows per rank, ``global_batch_size // world_size``; validates the rank and divisibility."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    if global_batch_size % world_size != 0:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be divisible by "
            f"world_size ({world_size})"
        )
    return global_batch_size // world_size


class LMBatches:
    """Random windows of a token stream for next-token prediction, sharded by rank.

    The global batch of ``step`` is ``global_batch_size`` windows whose start offsets are drawn
    uniformly (with replacement, as nanoGPT does) by a generator seeded from ``(seed, step)``.
    """

    def __init__(
        self, tokens: torch.Tensor, *, block_size: int, global_batch_size: int, seed: int = 0
    ) -> None:
        if tokens.dim() != 1 or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a 1-D int64 tensor, got {tokens.dtype} of shape "
                f"{tuple(tokens.shape)}"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"need at least block_size + 1 = {block_size + 1} tokens, got {tokens.numel()}"
            )
        self.tokens = tokens
        self.block_size = block_size
        self.global_batch_size = global_batch_size
        self.seed = seed

    def batch(
        self, step: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s slice of the global batch of ``step``: ``x, y`` each ``(b, T)``.

        ``y[i, t] == x[i, t + 1]``: the target is the next token. ``b`` is
        ``global_batch_size // world_size`` and ``T`` is ``block_size``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        b = local_batch_size(self.global_batch_size, rank, world_size)
        num_starts = self.tokens.numel() - self.block_size  # windows need block_size + 1 tokens
        starts = torch.randint(
            num_starts, (self.global_batch_size,), generator=_generator(self.seed, step)
        )  # (G,): every rank draws the whole global batch, then keeps its slice
        starts = starts[rank * b : (rank + 1) * b]  # (b,)
        offsets = starts[:, None] + torch.arange(self.block_size + 1)  # (b, T + 1)
        windows = self.tokens[offsets.to(self.tokens.device)]  # (b, T + 1)
        return windows[:, :-1], windows[:, 1:]

    def split(self, val_fraction: float) -> tuple[LMBatches, LMBatches]:
        """Train batches over the first ``1 - val_fraction`` of the tokens, val over the rest."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        cut = int(self.tokens.numel() * (1.0 - val_fraction))
        kwargs = {"block_size": self.block_size, "global_batch_size": self.global_batch_size}
        return (
            LMBatches(self.tokens[:cut], seed=self.seed, **kwargs),
            LMBatches(self.tokens[cut:], seed=self.seed + 1, **kwargs),
        )


def _epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(num_samples)
    return torch.randperm(num_samples, generator=_generator(seed, epoch))


def shard_indices(
    num_samples: int,
    step: int,
    global_batch_size: int,
    rank: int,
    world_size: int,
    *,
    seed: int,
    shuffle: bool = True,
) -> torch.Tensor:
    """Indices ``(b,)`` of a map-style data set for ``rank`` at ``step``.

    The sample stream is the concatenation of per-epoch permutations (epoch ``e`` shuffled by a
    generator seeded from ``(seed, e)``); the global batch of ``step`` is the next
    ``global_batch_size`` entries of that stream, so a batch may straddle an epoch boundary and
    no sample is dropped or padded. Rank r takes the contiguous slice ``[r*b, (r+1)*b)``.

    Like ``torch.utils.data.DistributedSampler``, every rank derives the same epoch permutation
    from a shared seed and keeps a disjoint part of it, so no index is communicated. Unlike it,
    the part is a contiguous slice of each global batch rather than every W-th index of the
    epoch, and nothing is padded: the union over ranks of one step's indices is exactly the
    batch one process would draw at that step, for any world size.
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    b = local_batch_size(global_batch_size, rank, world_size)
    start = step * global_batch_size + rank * b
    positions = torch.arange(start, start + b)  # (b,) positions in the endless sample stream
    epochs = positions // num_samples  # (b,)
    indices = torch.empty(b, dtype=torch.long)
    for epoch in torch.unique(epochs).tolist():  # one or a few epochs per batch
        in_epoch = epochs == epoch
        order = _epoch_order(num_samples, epoch, seed, shuffle)  # (N,)
        indices[in_epoch] = order[positions[in_epoch] % num_samples]
    return indices
