"""What crosses a stage boundary: a tuple of tensors, described once per step, sent as one message.

A stage of an `nn.Sequential` hands the next one a single activation; a stage cut out of any other
model hands it whatever the later stages still need, e.g. BERT's hidden states *and* the extended
attention mask its embedding stage computed. So a boundary carries a tuple of tensors of any of
`DTYPES` (float activations, integer or bool masks).

Per step and boundary the sender first posts one metadata message (`encode_specs`: each tensor's
dtype and micro-batch 0's shape, and every micro-batch's dim-0 size), because gloo needs the exact
receive size. A tensor whose dim 0 is micro-batch 0's size is "batched": its dim 0 follows each
micro-batch's size; any other tensor keeps its shape in every micro-batch.

Then every micro-batch's tuple travels as one message (`pack`): a single tensor as itself (no copy,
today's path), several as one byte buffer of 8-byte aligned segments. One message per micro-batch
keeps the schedule's message count, tags and ring slots what they are for one tensor. Gradients
travel back the same way for the tuple's floating-point tensors only (`grad_layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tessera.comm.shm.channel import DTYPES as _CODED

__all__ = [
    "DTYPES",
    "MAX_TENSORS",
    "TensorSpec",
    "decode_specs",
    "encode_specs",
    "floating",
    "layout",
    "meta_length",
    "pack",
    "parts",
    "unpack",
]

DTYPES = [dtype for dtype in _CODED if not dtype.is_complex]
"""Element types a stage boundary may carry: the transport's table (`comm.shm.channel.DTYPES`,
whose index is each one's code in the metadata message) but for complex ones."""

MAX_TENSORS = 8
"""Most tensors one stage boundary carries (the metadata message has a fixed length)."""

_MAX_DIMS = 8
_PER_TENSOR = 2 + _MAX_DIMS  # dtype index, ndim, shape padded with zeros
_ALIGN = 8


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a boundary: its dtype, micro-batch 0's shape, and whether dim 0 is batched."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    batched: bool

    def shape_for(self, size: int) -> tuple[int, ...]:
        """The shape in a micro-batch of `size` rows."""
        return (size, *self.shape[1:]) if self.batched else self.shape


def meta_length(num_microbatches: int) -> int:
    """Length of the metadata message for `num_microbatches` (int64 elements)."""
    return 1 + MAX_TENSORS * _PER_TENSOR + num_microbatches


def encode_specs(tensors: Sequence[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The metadata message of micro-batch 0's `tensors` and every micro-batch's size."""
    if not 0 < len(tensors) <= MAX_TENSORS:
        raise ValueError(f"a stage boundary carries 1 to {MAX_TENSORS} tensors, not {len(tensors)}")
    values = [len(tensors)]
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() > _MAX_DIMS or t.dtype not in DTYPES:
            what = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"stage output {what} cannot be sent to the next stage")
        values += [DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())]
    values += [0] * (MAX_TENSORS - len(tensors)) * _PER_TENSOR
    return torch.tensor(values + list(sizes), dtype=torch.int64)


def decode_specs(meta: torch.Tensor) -> tuple[list[TensorSpec], list[int]]:
    """`(specs, sizes)` from `encode_specs`'s message."""
    values = meta.tolist()
    count, sizes = values[0], values[1 + MAX_TENSORS * _PER_TENSOR :]
    specs = []
    for k in range(count):
        base = 1 + k * _PER_TENSOR
        dtype, ndim = DTYPES[values[base]], values[base + 1]
        shape = tuple(values[base + 2 : base + 2 + ndim])
        specs.append(TensorSpec(dtype, shape, ndim > 0 and shape[0] == sizes[0]))
    return specs, sizes


def floating(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a boundary that carry gradients back (floating point)."""
    return [t for t in tensors if t.is_floating_point()]


def parts(tensors: Sequence[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """`(shape, dtype)` of each tensor: what `layout` and `unpack` take."""
    return [(tuple(t.shape), t.dtype) for t in tensors]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty((), dtype=dtype).element_size()


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def layout(
    parts: Sequence[tuple[Sequence[int], torch.dtype]],
) -> tuple[tuple[int, ...], torch.dtype]:
    """`(shape, dtype)` of the message carrying tensors of `parts` (shape, dtype) each."""
    if len(parts) == 1:
        return tuple(parts[0][0]), parts[0][1]
    return (sum(_padded(_nbytes(s, d)) for s, d in parts),), torch.uint8


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One message of `tensors` (detached): the tensor itself if alone, else aligned bytes."""
    if len(tensors) == 1:
        return tensors[0].detach().contiguous()
    segments = []
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = _padded(raw.numel()) - raw.numel()
        segments += [raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw]
    return torch.cat(segments) if segments else torch.zeros(0, dtype=torch.uint8)


def unpack(
    message: torch.Tensor, parts: Sequence[tuple[Sequence[int], torch.dtype]]
) -> tuple[torch.Tensor, ...]:
    """The tensors `pack` put into `message`, given their `(shape, dtype)`s."""
    if len(parts) == 1:
        return (message,)
    out, offset = [], 0
    for shape, dtype in parts:
        n = _nbytes(shape, dtype)
        out.append(message[offset : offset + n].view(dtype).reshape(shape))
        offset += _padded(n)
    return tuple(out)
