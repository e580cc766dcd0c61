"""Nothing hangs silently: a record of every collective, timeouts and mismatches that explain.

Each rank keeps the last `HISTORY` collectives it called (sequence number, op, algorithm, shape,
dtype, call site) in a ring buffer, `history()`. Two checks turn the classic silent failures into
typed errors:

- Mismatch: each collective carries a small descriptor (sequence number, op, algorithm, reduction,
  dtype, root, shape) to its ring neighbour with the first message (shm: through the segment).
  If ring neighbours agree, all ranks agree; otherwise `CollectiveMismatch` says what each called.
  At least one rank raises; a rank whose left neighbour happens to match it may instead time out
  waiting for a peer that raised. With 2 or 3 ranks no data moves between disagreeing ranks; with
  4 or more, two groups of ranks that each agree internally could still exchange data.
- Timeout: every wait has a deadline. A watchdog thread notices waits that last longer than a
  moment and posts "rank r waits in collective #s" to the process group's store; the rank whose
  deadline passes reads those posts and names the ranks that never reached #s (the watchdog and
  the posts are `tessera.runtime.progress`; the error itself is built by the runtime's
  `flight_recorder.timeout_error`, which writes the rank's record first, with this module's
  history in it: comm registers `history_rows` with the recorder, which imports no comm).

`set_checks(False)` (or TESSERA_COMM_CHECK=0) turns the descriptor exchange off for speed.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from tessera.comm._ops import ALGORITHMS, OPS, SUPPORTED_DTYPES
from tessera.errors import CollectiveMismatch
from tessera.runtime import flight_recorder

__all__ = ["HISTORY", "Record", "checks_enabled", "history", "set_checks"]

HISTORY = 64
_KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "shared_buffer")
DESCRIPTOR_LEN = 17  # int64 words; see `describe_words`
_MAX_DIMS = 8


@dataclass(frozen=True)
class Record:
    """One collective as this rank called it."""

    seq: int
    kind: str
    algorithm: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group_ranks: tuple[int, ...]
    call_site: str
    label: int = 0
    """Which engine issued it, and which of its buckets (`encode_label`); 0: no engine."""


_history: collections.deque[Record] = collections.deque(maxlen=HISTORY)
_checks = os.environ.get("TESSERA_COMM_CHECK", "1") not in ("0", "false", "off")


def set_checks(enabled: bool) -> None:
    """Turn the cross-rank descriptor check on or off (must be the same on every rank)."""
    global _checks
    _checks = bool(enabled)


def checks_enabled() -> bool:
    """Whether collectives exchange descriptors to detect mismatched calls."""
    return _checks


def history() -> list[Record]:
    """The last `HISTORY` collectives this rank called, oldest first."""
    return list(_history)


_HERE = os.path.dirname(__file__)


def _call_site() -> str:
    # The first frame outside tessera/comm: the line of user (or strategy) code that called us.
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def record(
    seq: int, kind: str, algorithm: str, op: str, tensor: torch.Tensor, ranks: tuple[int, ...]
) -> Record:
    """Append one collective to this rank's history and return its record."""
    entry = Record(
        seq, kind, algorithm, op, tuple(tensor.shape), tensor.dtype, ranks, _call_site(), _label()
    )
    _history.append(entry)
    return entry


# ----------------------------------------------------------------------------------- descriptors
def describe(entry: Record, root: int = -1) -> torch.Tensor:
    """The int64 descriptor sent to the ring neighbour: what this rank is about to do."""
    return torch.tensor(describe_words(entry, root), dtype=torch.int64)


def describe_words(entry: Record, root: int = -1) -> list[int]:
    """The descriptor as `DESCRIPTOR_LEN` integers (shm writes them into its control page)."""
    words = [
        entry.seq,
        _KINDS.index(entry.kind),
        ALGORITHMS.index(entry.algorithm),
        OPS.index(entry.op) if entry.op in OPS else -1,
        SUPPORTED_DTYPES.index(entry.dtype) if entry.dtype in SUPPORTED_DTYPES else -1,
        root,
        len(entry.shape),
        0,  # free for the transport (shm writes a shared tensor's offset here)
    ]
    shape = list(entry.shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(entry.shape), _MAX_DIMS))
    if len(entry.shape) > _MAX_DIMS:  # fold the remaining dims into the last word
        shape[-1] = int(torch.tensor(entry.shape[_MAX_DIMS - 1 :]).prod())
    return words + shape + [entry.label]  # the issuing engine and bucket, word 16


def explain(words: list[int]) -> str:
    """A readable form of a descriptor, for error messages."""
    seq, kind, algo, op, dtype, root, ndim = words[:7]
    shape = tuple(words[8 : 8 + min(ndim, _MAX_DIMS)])
    label = words[8 + _MAX_DIMS] if len(words) > 8 + _MAX_DIMS else 0

    def pick(names: tuple, i: int) -> str:
        return str(names[i]) if 0 <= i < len(names) else "?"

    text = f"#{seq} {pick(_KINDS, kind)}(shape={shape}, dtype={pick(SUPPORTED_DTYPES, dtype)}"
    text += f", op={pick(OPS, op)}, algorithm={pick(ALGORITHMS, algo)}"
    text += f", root={root}" if root >= 0 else ""
    return text + (f", issued by {describe_label(label)})" if label else ")")


def compare(mine: list[int], theirs: list[int], rank: int, peer: int) -> None:
    """Raise `CollectiveMismatch` unless the peer's descriptor words equal this rank's."""
    if mine == theirs:
        return
    raise CollectiveMismatch(
        f"rank {rank} called {explain(mine)} but rank {peer} called "
        f"{explain(theirs)}: every rank of a group must call the same collectives, "
        "in the same order, with the same shapes, dtypes and ops"
    )


# ---------------------------------------------------------------------------------- labels
ENGINE_KINDS = ("DataParallel", "ZeRO-1", "ZeRO-2", "ZeRO-3", "tensor parallel", "engine")
"""Engines that label their collectives (`tessera.comm.stream.EngineTag`)."""
_ITEM_BITS = 24
_ORDINAL_BITS = 16
_label_of_thread = threading.local()


def encode_label(kind: str, ordinal: int, item: int = -1) -> int:
    """One int64 naming engine `kind`'s `ordinal`-th instance on a group and its `item`.

    The same on every rank for the same engine and bucket (ordinals follow construction order),
    so a descriptor check also catches two equal-shaped buckets of different engines.
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; one of {ENGINE_KINDS}")
    if not 0 <= ordinal < 2**_ORDINAL_BITS or not -1 <= item < 2**_ITEM_BITS - 1:
        raise ValueError(f"engine ordinal {ordinal} or item {item} out of range")
    code = ENGINE_KINDS.index(kind) + 1
    return (code << (_ORDINAL_BITS + _ITEM_BITS)) | (ordinal << _ITEM_BITS) | (item + 1)


def describe_label(label: int) -> str:
    """`encode_label`'s words back in text: "DataParallel#1 item 3"."""
    code = label >> (_ORDINAL_BITS + _ITEM_BITS)
    ordinal = (label >> _ITEM_BITS) & (2**_ORDINAL_BITS - 1)
    item = (label & (2**_ITEM_BITS - 1)) - 1
    kind = ENGINE_KINDS[code - 1] if 1 <= code <= len(ENGINE_KINDS) else "?"
    return f"{kind}#{ordinal}" + (f" item {item}" if item >= 0 else "")


def set_label(label: int) -> int:
    """Label the collectives this thread issues from now on; returns the previous label."""
    previous = _label()
    _label_of_thread.value = label
    return previous


def _label() -> int:
    return getattr(_label_of_thread, "value", 0)


def history_rows() -> list[dict[str, Any]]:
    """`history()` as plain data, for the flight record's "collectives" list."""
    return [
        {
            "seq": entry.seq,
            "kind": entry.kind,
            "algorithm": entry.algorithm,
            "op": entry.op,
            "shape": list(entry.shape),
            "dtype": str(entry.dtype).removeprefix("torch."),
            "group_ranks": list(entry.group_ranks),
            "call_site": entry.call_site,
            "issued_by": describe_label(entry.label) if entry.label else None,
        }
        for entry in history()
    ]


flight_recorder.record_collectives_from(history_rows)
