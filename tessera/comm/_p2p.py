"""Point-to-point messages with deadlines: the only way the algorithms talk (besides shm).

`Comm` is made once per collective call. It knows the group (group-relative ranks, translated to
global ranks for torch.distributed), the deadline, and the collective's descriptor: the first
message to the right neighbour carries it (on its own tag, posted before any data), and the first
data message waits until the left neighbour's descriptor arrived and matched. Posting data first
would save one latency, but gloo aborts the whole process when a message is larger than the
buffer posted for it, so a shape mismatch must be caught before any data moves.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.comm import diagnostics
from tessera.errors import CollectiveMismatch
from tessera.runtime import flight_recorder, progress
from tessera.runtime.devices import collective_device

__all__ = ["Comm", "GroupInfo", "group_info"]

_DATA_TAG = 0
_CHECK_TAG = 0x7E55  # descriptors travel on their own tag: never mixed up with data
SECOND_TAG = 0x7E56
"""A second data tag: messages on it are matched apart from those on the first, so an algorithm
can post receives of a later phase before all receives of the earlier one are posted (far from
the small tags pipeline links use for micro-batches)."""


@dataclass(frozen=True)
class GroupInfo:
    """Where this process stands in a group: group-relative rank and the global ranks."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    ranks: tuple[int, ...]  # global rank of each group rank
    key: str  # names the group in the store and in caches

    def global_rank(self, group_rank: int) -> int:
        """The global rank of group rank `group_rank` (what torch.distributed's p2p wants)."""
        return self.ranks[group_rank]


_infos: dict[object, GroupInfo] = {}
_seqs: dict[str, int] = {}


def group_info(group: dist.ProcessGroup | None) -> GroupInfo:
    """The (cached) `GroupInfo` of `group`; None means the default (world) group."""
    cache_key = group if group is not None else "world"
    info = _infos.get(cache_key)
    if info is None:
        if not dist.is_initialized():
            raise RuntimeError("tessera.comm needs a process group: call tessera.init() first")
        g = group if group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(g))
        rank = dist.get_rank(g)
        if rank < 0:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the group {ranks}")
        # Two groups may hold the same ranks: the group's name (the same on every rank) tells
        # them apart in the caches, sequence numbers and store keys.
        name = getattr(g, "group_name", "") or str(id(g))
        info = GroupInfo(group, rank, len(ranks), ranks, f"{name}:" + "-".join(map(str, ranks)))
        _infos[cache_key] = info
    return info


def next_seq(info: GroupInfo) -> int:
    """The sequence number of the group's next collective (the same on every member)."""
    seq = _seqs.get(info.key, 0) + 1
    _seqs[info.key] = seq
    return seq


class Comm:
    """Sends and receives of one collective call, with one deadline and a descriptor check."""

    def __init__(
        self,
        info: GroupInfo,
        seq: int,
        op_name: str,
        timeout_s: float,
        descriptor: list[int] | None = None,
    ) -> None:
        self.info = info
        self.rank = info.rank
        self.size = info.size
        self.seq = seq
        self.op_name = op_name
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._descriptor = None
        self._check: tuple[dist.Work, torch.Tensor] | None = None
        self._pending: list[dist.Work] = []
        if descriptor is not None and info.size > 1:
            # on the group's device: NCCL sends device tensors only
            device = collective_device(info.group)
            self._descriptor = torch.tensor(descriptor, dtype=torch.int64, device=device)
            self._post_check(self._descriptor)

    # ------------------------------------------------------------------------------ checks
    def _post_check(self, descriptor: torch.Tensor) -> None:
        right = self.info.global_rank((self.rank + 1) % self.size)
        left = self.info.global_rank((self.rank - 1) % self.size)
        theirs = torch.empty_like(descriptor)
        # The send's completion is awaited in `finish` (gloo needs the buffer alive till then).
        self._pending.append(dist.isend(descriptor, right, group=self.info.group, tag=_CHECK_TAG))
        self._check = (dist.irecv(theirs, left, group=self.info.group, tag=_CHECK_TAG), theirs)

    def verify(self) -> None:
        """Wait for the left neighbour's descriptor and compare it with ours (once per call)."""
        if self._check is None:
            return
        work, theirs = self._check
        self._check = None
        left = (self.rank - 1) % self.size
        self._wait(work, left)
        try:
            diagnostics.compare(
                self._descriptor.tolist(),
                theirs.tolist(),
                dist.get_rank(),
                self.info.global_rank(left),
            )
        except CollectiveMismatch:
            # Let our own descriptor reach the right neighbour first, so that it raises the
            # mismatch too instead of finding a closed connection if this process exits.
            with contextlib.suppress(RuntimeError):
                self._pending[0].wait(datetime.timedelta(seconds=1))
            raise

    # ---------------------------------------------------------------------------- messages
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = _DATA_TAG) -> dist.Work | None:
        """Start sending `tensor` (contiguous) to group rank `peer`; empty tensors send nothing.

        `tag`: the first data tag or `SECOND_TAG`; a receive matches the sends of its tag only.
        """
        if tensor.numel() == 0:
            return None
        self.verify()  # no data before the descriptors agree (see the module docstring)
        work = dist.isend(tensor, self.info.global_rank(peer), group=self.info.group, tag=tag)
        self._pending.append(work)
        return work

    def irecv(
        self, tensor: torch.Tensor, peer: int, tag: int = _DATA_TAG
    ) -> tuple[dist.Work, int] | None:
        """Start receiving into `tensor` (contiguous) from group rank `peer`; wait with `wait`."""
        if tensor.numel() == 0:
            return None
        self.verify()
        work = dist.irecv(tensor, self.info.global_rank(peer), group=self.info.group, tag=tag)
        return work, peer

    def wait(self, handle: tuple[dist.Work, int] | None) -> None:
        """Wait for a receive started by `irecv` (checks the descriptor first)."""
        self.verify()
        if handle is not None:
            self._wait(handle[0], handle[1])

    def wait_sent(self, work: dist.Work | None, peer: int) -> None:
        """Wait until a send started by `isend` is out (its buffer may then be written to).

        The send leaves the list `finish` waits on: gloo counts completions per buffer, so a
        second wait on the same send would wait for a completion that never comes.
        """
        if work is not None:
            self._pending.remove(work)
            self._wait(work, peer)

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Send and return once the message is out (the buffer may then be reused)."""
        work = self.isend(tensor, peer)
        if work is not None:
            self._pending.remove(work)
            self._wait(work, peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Receive into `tensor` from group rank `peer`, blocking until it arrived."""
        self.wait(self.irecv(tensor, peer))

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Send to `dst` while receiving from `src` (the step of every exchange algorithm)."""
        handle = self.irecv(recv, src)
        self.isend(send, dst)
        self.wait(handle)

    def finish(self) -> None:
        """Wait for every outstanding send (and the descriptor) before the call returns."""
        self.verify()
        pending, self._pending = self._pending, []
        for work in pending:
            self._wait(work, None)

    def wait_native(self, work: dist.Work) -> None:
        """Wait for an async torch.distributed collective (started after `verify`)."""
        self._wait(work, None)

    def _wait(self, work: dist.Work, peer: int | None) -> None:
        remaining = self.deadline - time.monotonic()
        info = self.info
        peer_global = None if peer is None else info.global_rank(peer)
        progress.waiting(info.key, self.seq, self.timeout_s)
        try:
            if remaining <= 0 or not work.wait(datetime.timedelta(seconds=remaining)):
                raise RuntimeError("timeout")
        except RuntimeError as exc:
            if not _gave_up(str(exc).lower()):
                raise
            raise flight_recorder.timeout_error(
                info.key, self.seq, info.ranks, self.op_name, self.timeout_s, peer_global
            ) from exc
        finally:
            progress.done_waiting()


def _gave_up(message: str) -> bool:
    """Whether a failed wait means a rank gave up on this collective: its own timeout, or a
    peer's (a peer that times out first closes its connections, and gloo then reports
    "Connection closed by peer" here): either way the ranks that never arrived are named."""
    return any(
        words in message for words in ("timeout", "timed out", "connection closed by peer")
    )
