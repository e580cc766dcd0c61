"""Setting up a group's shared memory: the segments, and the probe that decides who shares it.

Who shares memory is probed, not guessed from host names (two containers can share a host name
and not a /dev/shm):

  1. every rank creates its wake-up pipe; group rank 0 also the control page (one page per
     rank plus a header page) and writes a random token into the header;
  2. the names and the token are all-gathered; every rank maps the control page, reads the
     token through its own mapping (so the page is really shared, not merely visible) and
     opens every peer's pipe;
  3. the verdicts are all-gathered; every rank has then opened what it could, so the names are
     unlinked at once (`files`: the files exist only between steps 1 and 3).

Unless every rank succeeded, `probe` returns None on every rank and the group has no shared
memory; so too where this machine cannot order shared-memory accesses (`atomics.MODE`). The
verdicts also say whether each rank can sleep on a futex (`futex`) and has atomic
read-modify-writes: the group's barrier uses the futex only if every rank can, the pipes
otherwise, so that a sleeper and its waker always agree on how to wake.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.comm._p2p import GroupInfo
from tessera.comm.shm import atomics, files, futex

__all__ = ["NAME_AT", "NAME_MAX", "PAGE", "Link", "Segment", "probe"]

PAGE = 4096
TOKEN_BYTES = 16  # the probe's token, at the start of the control page's header (last) page
NAME_AT, NAME_MAX = 64, 256  # header bytes holding the name of the segment being set up

_swept = False


class Segment:
    """One mapped file: `slots` slots of `slot_bytes` bytes, one per rank."""

    def __init__(self, name: str, fd: int, slots: int, slot_bytes: int) -> None:
        self.name = name
        self.slot_bytes = slot_bytes
        try:
            size = slots * slot_bytes
            if os.fstat(fd).st_size != size:
                raise ValueError(f"shared-memory file {name} is not {size} bytes long")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.raw = torch.frombuffer(self.map, dtype=torch.uint8)  # (slots * slot_bytes,)
        self.plans: dict[tuple, tuple] = {}

    @classmethod
    def create(cls, kind: str, slots: int, slot_bytes: int) -> Segment:
        """A new file under a fresh random name (see `files`), mapped."""
        name, fd = files.create_file(kind, slots * slot_bytes)
        return cls(name, fd, slots, slot_bytes)

    @classmethod
    def open(cls, name: str, slots: int, slot_bytes: int) -> Segment:
        """Map the file a peer created and published as `name`."""
        return cls(name, files.open_checked(name, os.O_RDWR, fifo=False), slots, slot_bytes)

    def slot(self, rank: int, numel: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """A (numel,) tensor of `dtype` at byte `offset` of `rank`'s slot."""
        start = rank * self.slot_bytes + offset
        return self.raw[start : start + numel * dtype.itemsize].view(dtype)

    def owns(self, tensor: torch.Tensor, rank: int) -> int | None:
        """Byte offset of `tensor` inside `rank`'s slot, or None if it does not live there."""
        base = self.raw.data_ptr() + rank * self.slot_bytes
        ptr = tensor.data_ptr()
        end = ptr + tensor.numel() * tensor.element_size()
        if base <= ptr and end <= base + self.slot_bytes and tensor.is_contiguous():
            return ptr - base
        return None


@dataclass
class Link:
    """What a rank holds once the probe succeeded."""

    control: Segment  # one page per rank (descriptor, barrier words), then the header page
    inbox: int  # our wake-up pipe, open for reading
    outboxes: list[int]  # every peer's wake-up pipe, open for writing (-1 at our own rank)
    words: atomics.Words  # the control page's int64 words, accessed in order
    nap_ms: float
    futex: bool  # every rank sleeps on a futex in the barrier (else on its pipe)


def _close(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def probe(info: GroupInfo) -> Link | None:
    """Collective: the group's shared-memory link, or None (on every rank) if not all can share."""
    global _swept
    files.install_sigterm_cleanup()
    if not _swept:
        _swept = True
        files.sweep_stale()
    mode = atomics.MODE
    inbox_name, offer, control, inbox = None, None, None, -1
    if mode is not None:
        try:
            inbox_name = files.create_fifo()
            # O_RDWR: opening never blocks and the pipe never reports EOF while we hold it.
            inbox = files.open_checked(inbox_name, os.O_RDWR | os.O_NONBLOCK, fifo=True)
            if info.rank == 0:
                control = Segment.create("control", info.size + 1, PAGE)
                token = secrets.token_bytes(TOKEN_BYTES)
                header = info.size * PAGE
                control.map[header : header + TOKEN_BYTES] = token
                offer = (control.name, token)
        except OSError:
            pass  # no usable /dev/shm on this rank: it votes no below
    offers: list = [None] * info.size
    dist.all_gather_object(offers, (inbox_name, offer), group=info.group)
    outboxes: list[int] = []
    able = inbox >= 0 and offers[0][1] is not None and all(o[0] for o in offers)
    if able:
        try:
            control, outboxes = _open_peers(info, offers, control)
        except (OSError, ValueError):
            able = False
    can_futex = futex.AVAILABLE and futex.ENABLED and mode == "atomics"
    votes: list = [None] * info.size
    dist.all_gather_object(votes, (able, can_futex), group=info.group)
    if inbox_name is not None:
        files.unlink(inbox_name)
    if control is not None and info.rank == 0:
        files.unlink(control.name)
    if not all(able for able, _ in votes):
        _close([inbox, *outboxes])
        return None
    words = atomics.Words(control.raw, memoryview(control.map), mode)
    every_futex = all(can for _, can in votes)
    return Link(control, inbox, outboxes, words, atomics.NAP_MS[mode], every_futex)


def _open_peers(
    info: GroupInfo, offers: list, control: Segment | None
) -> tuple[Segment, list[int]]:
    """Map rank 0's control page (checking its token) and open every peer's pipe."""
    p, r = info.size, info.rank
    if r != 0:
        name, token = offers[0][1]
        control = Segment.open(name, p + 1, PAGE)
        header = p * PAGE
        if control.map[header : header + TOKEN_BYTES] != token:
            raise ValueError(f"{name} does not hold group rank 0's token")
    outboxes: list[int] = []
    try:
        for q in range(p):
            flags = os.O_WRONLY | os.O_NONBLOCK
            outboxes.append(files.open_checked(offers[q][0], flags, fifo=True) if q != r else -1)
    except OSError:
        _close(outboxes)
        raise
    return control, outboxes
