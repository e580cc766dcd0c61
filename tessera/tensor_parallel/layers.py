"""Tensor-parallel layers: dense layers whose weight is split over the ranks of a group.

Megatron-LM (Shoeybi et al. 2019) with t ranks:
- `ColumnParallelLinear`: `A = [A_1 .. A_t]` split by output features; rank i computes
  `X A_i` from the replicated X (f before it). No forward communication unless the output is
  gathered; backward all-reduces dX (f).
- `RowParallelLinear`: `A` split by input features; rank i computes `X_i A_i` from its slice of X
  and the partial results are summed (g): one all-reduce of the output forward, none backward.
- `VocabParallelEmbedding`: the table split by rows (token ids); each rank looks up the ids it
  owns, zeros the rest, and the ranks sum (g).
- `ChannelParallelConv2d`: output channels split (each rank convolves the whole input with its
  filters: the partially connected split of Krizhevsky et al. 2012's two-GPU CNN); the channels
  are all-gathered after it unless the next layer takes them split.
- `ColumnParallelEmbedding`: the table split by columns (the embedding dimension): every rank
  looks up every id in its `C/t` columns and the slices are all-gathered (torch's `ColwiseParallel`
  on an `nn.Embedding`; `VocabParallelEmbedding` is Megatron's split of the rows instead).
- `ColumnParallelConv1D` / `RowParallelConv1D`: Hugging Face's `Conv1D` (GPT-2's layers,
  `y = x W + b` with W of shape `(in, out)`, the transpose of `nn.Linear`'s): the same two splits,
  so a column split slices W's dimension 1 and a row split its dimension 0.
- `RowParallelConv2d`: input channels split, the convolution's analogue of `RowParallelLinear`:
  a convolution is a sum over input channels, so rank i convolves its channel slice with its
  slice of every filter and the partial maps are summed (g). After a `ChannelParallelConv2d`
  that keeps its output split, the pair communicates once forward and once backward.

Every layer is built `from_dense(layer, group=...)`, slicing the dense weights, so the split model
computes what the dense one does. `shard_dims` says which dimension of each parameter is split
(`full_state_dict` reassembles them); `chunks > 1` splits each of that many equal blocks of the
output (fused q/k/v: every rank keeps its heads' q, k and v).
"""

from __future__ import annotations

from typing import Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.tensor_parallel._comm import group_rank, group_size
from tessera.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)

__all__ = [
    "ChannelParallelConv2d",
    "ColumnParallelConv1D",
    "ColumnParallelEmbedding",
    "ColumnParallelLinear",
    "RowParallelConv1D",
    "RowParallelConv2d",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "is_hf_conv1d",
    "shard",
]


def shard(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None, chunks: int = 1
) -> torch.Tensor:
    """This rank's slice of `tensor` along `dim` (of each of `chunks` equal blocks)."""
    size, rank = group_size(group), group_rank(group)
    if tensor.shape[dim] % (size * chunks):
        raise ValueError(
            f"dimension {dim} of size {tensor.shape[dim]} is not divisible by the tensor-parallel "
            f"size {size}" + (f" times {chunks} chunks" if chunks > 1 else "")
        )
    blocks = tensor.chunk(chunks, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).clone()


def keep_frozen(dense: nn.Module, split: nn.Module) -> nn.Module:
    """Give `split`'s parameters the `requires_grad` of `dense`'s of the same name; return `split`.

    A split layer builds new `nn.Parameter`s from slices of the dense weights, and a new
    parameter requires a gradient: without this a frozen layer named in a plan (a fine-tuning
    recipe's frozen base) would silently train.
    """
    for name, param in split.named_parameters(recurse=False):
        dense_param = getattr(dense, name, None)
        if isinstance(dense_param, torch.Tensor):
            param.requires_grad_(dense_param.requires_grad)
    return split


class _Parallel(nn.Module):
    shard_dims: dict[str, int] = {}
    """Parameter name -> split dimension (names absent are replicated)."""
    chunks = 1

    def _setup(
        self,
        group: dist.ProcessGroup | None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        """The group and this rank's place in it; given, this rank's weight (and bias) slices
        become its parameters."""
        self.group = group
        self.tp_size = group_size(group)
        self.tp_rank = group_rank(group)
        if weight is not None:
            self.weight = nn.Parameter(weight)
            self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def _split_weights(
        cls, dense: nn.Module, group: dist.ProcessGroup | None, chunks: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`dense`'s weight sliced along `shard_dims["weight"]` (of each of `chunks` blocks), and
        its bias sliced likewise where `shard_dims` splits it, else copied whole (a row split
        adds it once, after the sum). The dense weights are sliced, never re-initialised."""
        weight = shard(dense.weight.detach(), cls.shard_dims["weight"], group, chunks)
        if dense.bias is None:
            return weight, None
        if "bias" in cls.shard_dims:
            return weight, shard(dense.bias.detach(), cls.shard_dims["bias"], group, chunks)
        return weight, dense.bias.detach().clone()


class _ColumnParallel(_Parallel):
    """A dense layer's output features split (its weight's `shard_dims["weight"]`, its bias); y
    split unless `gather_output`. `_local(x, weight, bias)` is the dense layer's computation."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, group=None, gather_output=False
    ) -> None:
        super().__init__()
        self._setup(group, weight, bias)
        self.gather_output = gather_output

    @classmethod
    def from_dense(
        cls,
        dense: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        chunks: int = 1,
    ) -> Self:
        """Split `dense` by output features (`chunks`: each of that many blocks, as q/k/v)."""
        weight, bias = cls._split_weights(dense, group, chunks)
        layer = cls(weight, bias, group=group, gather_output=gather_output)
        layer.chunks = chunks
        return layer

    @staticmethod
    def _local(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The dense layer's computation on this rank's slices (each subclass names its own)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., in)` replicated -> `(..., out / t)` (or `(..., out)` gathered)."""
        y = self._local(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.group, -1) if self.gather_output else y


class ColumnParallelLinear(_ColumnParallel):
    """`y = x A^T + b` with A's rows (output features) split; y split unless `gather_output`.
    The weight is `(out / t, in)`."""

    shard_dims = {"weight": 0, "bias": 0}
    _local = staticmethod(F.linear)


class RowParallelLinear(_Parallel):
    """`y = sum_i x_i A_i^T + b` with A's columns (input features) split; y replicated."""

    shard_dims = {"weight": 1}

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, group=None, input_is_parallel=True
    ) -> None:
        super().__init__()
        self._setup(group, weight, bias)  # (out, in / t); the bias replicated
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        *,
        group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
    ) -> RowParallelLinear:
        """Split `linear` by input features (its weights sliced, not re-initialised)."""
        weight, bias = cls._split_weights(linear, group)
        return cls(weight, bias, group=group, input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., in / t)` split (or `(..., in)` replicated) -> `(..., out)` replicated."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group, -1)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y  # bias once, after the sum


class VocabParallelEmbedding(_Parallel):
    """An embedding table split by rows: rank i owns ids `[i V/t, (i+1) V/t)`."""

    shard_dims = {"weight": 0}

    def __init__(self, weight: torch.Tensor, *, group=None) -> None:
        super().__init__()
        self._setup(group)
        self.weight = nn.Parameter(weight)  # (V / t, C)
        self.start = self.tp_rank * weight.shape[0]
        self.end = self.start + weight.shape[0]

    @classmethod
    def from_dense(
        cls, embedding: nn.Embedding, *, group: dist.ProcessGroup | None = None
    ) -> VocabParallelEmbedding:
        """Split `embedding` by rows (its weights sliced)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding supports no padding_idx and no max_norm")
        return cls(shard(embedding.weight.detach(), 0, group), group=group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `(...)` -> embeddings `(..., C)`, replicated."""
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.group)


class ColumnParallelEmbedding(_Parallel):
    """An embedding table split by columns: rank i holds dimensions `[i C/t, (i+1) C/t)` of every
    id's vector; the looked-up slices are all-gathered, so the output is replicated.

    Unlike `VocabParallelEmbedding` it keeps `padding_idx` (a row's columns are padding on every
    rank alike) and needs no masking of foreign ids. `max_norm` renormalises whole rows, whose
    norm no rank sees, so it is refused.
    """

    shard_dims = {"weight": 1}

    def __init__(self, embedding: nn.Embedding, *, group=None) -> None:
        super().__init__()
        self._setup(group)
        if embedding.max_norm is not None:
            raise ValueError(
                "ColumnParallelEmbedding: max_norm renormalises whole rows; unsupported"
            )
        self.weight = nn.Parameter(shard(embedding.weight.detach(), 1, group))  # (V, C / t)
        self.padding_idx = embedding.padding_idx
        self.scale_grad_by_freq, self.sparse = embedding.scale_grad_by_freq, embedding.sparse

    @classmethod
    def from_dense(
        cls, embedding: nn.Embedding, *, group: dist.ProcessGroup | None = None
    ) -> ColumnParallelEmbedding:
        """Split `embedding` by columns (its weights sliced)."""
        return cls(embedding, group=group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `(...)` -> embeddings `(..., C)`, replicated."""
        local = F.embedding(
            ids, self.weight, self.padding_idx, None, 2.0, self.scale_grad_by_freq, self.sparse
        )
        return gather_from_tensor_parallel(local, self.group, -1)


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for Hugging Face's `transformers.pytorch_utils.Conv1D`, recognised by its class name
    and module so that tessera never imports transformers for a model that has none."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers"


def _conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x W (+ b)` over the last dimension, as `Conv1D.forward` computes it (one addmm)."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return y.view(*x.shape[:-1], weight.shape[1])


class ColumnParallelConv1D(_ColumnParallel):
    """Hugging Face's `Conv1D` with W's columns (output features) split; y split unless
    `gather_output`. Keeps Conv1D's `(in, out)` layout, so its state has the dense keys."""

    shard_dims = {"weight": 1, "bias": 0}
    _local = staticmethod(_conv1d)

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, group=None, gather_output=False
    ) -> None:
        super().__init__(weight, bias, group=group, gather_output=gather_output)  # (in, out / t)
        self.nx, self.nf = weight.shape  # Conv1D's names, local sizes


class RowParallelConv1D(_Parallel):
    """Hugging Face's `Conv1D` with W's rows (input features) split; partial outputs summed,
    the bias (replicated) added once after the sum."""

    shard_dims = {"weight": 0}

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, group=None) -> None:
        super().__init__()
        self._setup(group, weight, bias)  # (in / t, out); the bias replicated
        self.nx, self.nf = weight.shape

    @classmethod
    def from_dense(
        cls, conv: nn.Module, *, group: dist.ProcessGroup | None = None
    ) -> RowParallelConv1D:
        """Split a `Conv1D` by input features (its weights sliced, not re-initialised)."""
        weight, bias = cls._split_weights(conv, group)
        return cls(weight, bias, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., in / t)` split -> `(..., out)` replicated."""
        y = reduce_from_tensor_parallel(_conv1d(x, self.weight, None), self.group)
        return y + self.bias if self.bias is not None else y


class ChannelParallelConv2d(_Parallel):
    """A Conv2d with its output channels split; output gathered on dim 1 unless told not to."""

    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, conv: nn.Conv2d, *, group=None, gather_output: bool = True) -> None:
        super().__init__()
        self._setup(group)
        check_splittable_conv(conv, "ChannelParallelConv2d")
        self.weight = nn.Parameter(shard(conv.weight.detach(), 0, group))  # (out/t, in, kh, kw)
        self.bias = (
            nn.Parameter(shard(conv.bias.detach(), 0, group)) if conv.bias is not None else None
        )
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.gather_output = gather_output

    @classmethod
    def from_dense(
        cls, conv: nn.Conv2d, *, group: dist.ProcessGroup | None = None, gather_output: bool = True
    ) -> ChannelParallelConv2d:
        """Split `conv` by output channels (its weights sliced)."""
        return cls(conv, group=group, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C_in, H, W)` replicated -> `(B, C_out, H', W')` (or `C_out / t` channels)."""
        x = copy_to_tensor_parallel(x, self.group)
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
        return gather_from_tensor_parallel(y, self.group, 1) if self.gather_output else y


class RowParallelConv2d(_Parallel):
    """A Conv2d with its input channels split; the partial outputs summed, the bias added once."""

    shard_dims = {"weight": 1}

    def __init__(self, conv: nn.Conv2d, *, group=None, input_is_parallel: bool = True) -> None:
        super().__init__()
        self._setup(group)
        check_splittable_conv(conv, "RowParallelConv2d")
        self.weight = nn.Parameter(shard(conv.weight.detach(), 1, group))  # (out, in/t, kh, kw)
        # replicated: added after the sum, as one process adds it once
        self.bias = nn.Parameter(conv.bias.detach().clone()) if conv.bias is not None else None
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_dense(
        cls, conv: nn.Conv2d, *, group: dist.ProcessGroup | None = None, input_is_parallel=True
    ) -> RowParallelConv2d:
        """Split `conv` by input channels (its weights sliced, not re-initialised)."""
        return cls(conv, group=group, input_is_parallel=input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C_in / t, H, W)` split (or `C_in` replicated) -> `(B, C_out, H', W')` replicated."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group, 1)
        partial = F.conv2d(x, self.weight, None, self.stride, self.padding, self.dilation)
        y = reduce_from_tensor_parallel(partial, self.group)
        return y + self.bias.view(1, -1, 1, 1) if self.bias is not None else y


def check_splittable_conv(conv: nn.Conv2d, what: str) -> None:
    """ValueError unless `conv` can be split by channels: one group, zero padding.

    A grouped convolution's filters see only their group's input channels, so slicing channels
    across ranks would cut groups apart; other padding modes pad before the convolution and
    are not handled by these layers.
    """
    if conv.groups != 1:
        raise ValueError(f"{what}: a channel-split Conv2d needs groups=1, got groups={conv.groups}")
    if conv.padding_mode != "zeros":
        raise ValueError(
            f"{what}: a channel-split Conv2d needs zero padding, got {conv.padding_mode!r}"
        )
