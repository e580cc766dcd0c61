"""Messages between pipeline stages: shared-memory rings on one host, gloo otherwise.

Each link (two neighbouring stages) is chosen on its own when the stages are built: the two
ranks try to share a shared-memory `Endpoint` (`tessera.comm.shm.channel`) and keep it only if both
could map the other's files, which is the same probe `tessera.comm.same_host` makes for a group
(a file only a process of this host and user can open, holding a random token), asked of the
two ranks of the link alone. So a pipeline spanning two hosts runs its links inside each host
over shared memory and the one between the hosts over gloo.

Why: a gloo send goes through a socket; its isend returns at once, but the transfer then takes
CPU from the sender's compute and the receiver can read only after the kernel has moved the
bytes. Over the ring a send is one copy into a free slot; the receiver's copy out is one more.

Sends return at once on both transports (gloo: a `Work` to wait for before the step ends;
shared memory: nothing, the tensor is already copied). Receives are posted ahead (`post_recv`)
and taken (`take`) when needed; every wait has the deadline `timeout_s`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.comm.shm.channel import Endpoint, ring_available
from tessera.errors import CollectiveTimeout

__all__ = ["Links", "Posted"]

_SETUP_TAG = 1 << 22  # the link's setup messages: never a pipeline message tag
_OFFER_BYTES = 512


@dataclass
class Posted:
    """A receive posted ahead: gloo's `work` filling `buffer`, or a message the ring will hold."""

    stage: int
    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    work: dist.Work | None = None
    buffer: torch.Tensor | None = None


class Links:
    """Point-to-point messages between the stages of one pipeline group, with deadlines.

    `shm_with` lists the stages (group ranks) to try a shared-memory link with, in an order all
    ranks agree on (every rank passes its neighbours in increasing order: the setups then
    chain without a cycle); `slots` is how many messages may wait unread on such a link.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        timeout_s: float,
        *,
        shm_with: tuple[int, ...] = (),
        slots: int = 4,
    ) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.index = dist.get_rank(group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.bytes_sent = 0
        self.channels: dict[int, Endpoint] = {}
        """The shared-memory links, by the stage at their other end."""
        for stage in shm_with:
            endpoint = self._connect(stage, slots)
            if endpoint is not None:
                self.channels[stage] = endpoint

    def transport(self, stage: int) -> str:
        """ "shm" or "gloo": how messages to and from `stage` travel."""
        return "shm" if stage in self.channels else "gloo"

    def close(self) -> None:
        """Close the shared-memory links (their peers' next wait reports this rank gone)."""
        for endpoint in self.channels.values():
            endpoint.close()
        self.channels = {}

    # ----------------------------------------------------------------------------- setup
    def _connect(self, stage: int, slots: int) -> Endpoint | None:
        """Both ends of the link at once: build, trade offers, connect, trade verdicts."""
        me, peer = self.ranks[self.index], self.ranks[stage]
        endpoint, offer = None, ""
        if ring_available():
            try:
                endpoint = Endpoint(
                    me, peer, creator=self.index < stage, timeout_s=self.timeout_s, slots=slots
                )
                offer = endpoint.offer()
            except OSError:
                endpoint = None  # no usable /dev/shm here: this side votes no
        theirs = self._swap(torch.tensor(list(offer.encode().ljust(_OFFER_BYTES, b"\0"))), stage)
        text = bytes(theirs.to(torch.uint8).tolist()).rstrip(b"\0").decode()
        able = endpoint is not None and bool(text) and endpoint.connect(text)
        verdict = self._swap(torch.tensor([int(able)]), stage)
        if endpoint is not None:
            endpoint.unlink()  # both sides have opened what they could
            if not (able and int(verdict[0])):
                endpoint.close()
                endpoint = None
        return endpoint

    def _swap(self, mine: torch.Tensor, stage: int) -> torch.Tensor:
        theirs = torch.empty_like(mine)
        peer = self.ranks[stage]
        receive = dist.irecv(theirs, src=peer, group=self.group, tag=_SETUP_TAG)
        send = dist.isend(mine, dst=peer, group=self.group, tag=_SETUP_TAG)
        self.wait(receive, f"pipeline link setup with stage {stage}")
        self.wait(send, f"pipeline link setup with stage {stage}")
        return theirs

    # -------------------------------------------------------------------------- messages
    def send(self, tensor: torch.Tensor, stage: int, tag: int) -> dist.Work | None:
        """Send `tensor` to `stage` without waiting for the receiver. Over gloo: wait on the
        returned `Work` (and keep `tensor` alive) before the step ends; over shared memory
        the tensor is already copied (None)."""
        self.bytes_sent += tensor.numel() * tensor.element_size()
        endpoint = self.channels.get(stage)
        if endpoint is not None:
            endpoint.send(tensor, tag)
            return None
        tensor = tensor.contiguous()
        return dist.isend(tensor, dst=self.ranks[stage], group=self.group, tag=tag)

    def post_recv(self, shape: tuple, dtype: torch.dtype, stage: int, tag: int) -> Posted:
        """Post a receive of `shape`/`dtype` from `stage`; `take` returns the tensor."""
        posted = Posted(stage, tag, tuple(shape), dtype)
        if stage not in self.channels:
            posted.buffer = torch.empty(shape, dtype=dtype)
            posted.work = dist.irecv(
                posted.buffer, src=self.ranks[stage], group=self.group, tag=tag
            )
        return posted

    def take(self, posted: Posted, what: str) -> torch.Tensor:
        """The posted message, once it arrived; CollectiveTimeout past the deadline."""
        endpoint = self.channels.get(posted.stage)
        if endpoint is not None:
            return endpoint.recv(posted.shape, posted.dtype, posted.tag)
        self.wait(posted.work, what)
        return posted.buffer

    def recv(self, shape: tuple, dtype: torch.dtype, stage: int, tag: int) -> torch.Tensor:
        """Receive `shape`/`dtype` from `stage`; CollectiveTimeout past the deadline."""
        posted = self.post_recv(shape, dtype, stage, tag)
        return self.take(posted, f"pipeline recv from stage {stage} (tag {tag})")

    def wait(self, work: dist.Work | None, what: str) -> None:
        """Wait for a gloo `work` at most the deadline (None: nothing to wait for)."""
        if work is None:
            return
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise CollectiveTimeout(
                dist.get_rank(), what, self.timeout_s, "a neighbouring stage stopped or diverged"
            ) from exc
