"""Point-to-point channels through shared memory: one producer, one consumer, a ring of slots.

A pipeline link between two processes of one host carries activations one way and gradients
the other. Over gloo a send goes through a socket and the sender's isend competes with its
compute; here a send copies the tensor into a free slot of a ring in a shared mapping and
returns, and the receiver copies it out when it needs it. One `Endpoint` per process and link
holds both directions: a ring it produces into and a ring it consumes from.

Layout. A control file of two pages, one per direction (the creator's outgoing ring first):
the producer's words on one cache line (`_HEAD` messages published, `_PRODUCER_SLEEPING`,
`_GENERATION` of the data segment, its slot count and size, and the segment's name), the
consumer's on another (`_TAIL` messages consumed, `_CONSUMER_SLEEPING`).
Messages live in a data segment of `slots` slots; slot `k % slots` holds message k: a header
(tag, dtype, shape, bytes) and the payload. Message k may be written once `k - tail < slots`
and read once `head > k`. The counters are stored after the data they announce and loaded
before it is read, with sequentially consistent atomics (`atomics.Words`): a release/acquire
pair, so the reader never sees a counter before the bytes it covers.

Growing. The producer creates the data segment at its first send, sized for that message; a
larger message later waits until the consumer has drained the ring, then the producer maps a
new segment (generation + 1) and publishes its name before the message. The consumer maps the
new generation when it next reads and unlinks the file (the producer does if the consumer
never came).

Waiting. A waiter raises its sleeping flag, looks at the counters again and sleeps in poll() on
its own named pipe, which the other side writes a byte to after moving a counter (the
handshake of `group.ShmGroup.barrier`). Only the peer holds that pipe's write end, so when the
peer exits or dies the kernel reports a hang-up: the waiter raises `PeerLostError` at once,
naming the peer, instead of waiting out its deadline. Every wait has the deadline `timeout_s`
and raises `CollectiveTimeout` naming this rank, the peer and the operation.

Files: `files` names, creates and cleans them up; each lives in /dev/shm only until the
peer has mapped or opened it.
"""

from __future__ import annotations

import os
import secrets
import select
import time
import weakref
from collections.abc import Callable

import torch

from tessera.comm.shm import atomics, files
from tessera.comm.shm.segments import PAGE, Segment
from tessera.errors import CollectiveTimeout, PeerLostError

__all__ = ["DTYPES", "Endpoint", "ring_available"]

# int64 words of a direction's control page; producer and consumer words on separate lines
_HEAD, _PRODUCER_SLEEPING, _GENERATION, _SLOTS, _SLOT_BYTES = 0, 1, 2, 3, 4
_TAIL, _CONSUMER_SLEEPING = 8, 9
_NAME_AT, _NAME_MAX = 256, 256  # bytes of the page holding the current data segment's name
_TOKEN_AT = 1024  # bytes of the first page: the creator's token, checked by the peer
_WORDS_PER_PAGE = PAGE // 8

_HEADER_WORDS = 16  # slot header: tag, dtype, ndim, nbytes, shape[MAX_DIMS], padding
_HEADER = 8 * _HEADER_WORDS  # payload offset: 128 bytes, two cache lines
MAX_DIMS = 8
_MIN_SLOT = 64 << 10
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
"""Element types a channel carries, each sent as its index here (the slot header's dtype word;
`pipeline.messages` codes its stage boundaries' dtypes with the same table)."""


def ring_available() -> bool:
    """Whether this machine orders shared-memory accesses well enough for a channel."""
    return atomics.MODE is not None


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit


class Endpoint:
    """This process's end of a link: a ring it sends into and a ring it receives from.

    Setting up takes one exchange with the peer through any transport: both sides build an
    `Endpoint` (exactly one with `creator=True`), trade `offer()`s, call `connect(theirs)`,
    trade the verdicts, then `unlink()` their files. `me` and `peer` are the ranks that error
    messages name; `slots` bounds how many sent messages may wait unread before `send` blocks.
    """

    def __init__(
        self, me: int, peer: int, *, creator: bool, timeout_s: float, slots: int = 4
    ) -> None:
        if atomics.MODE is None:
            raise ValueError("no ordered shared-memory access on this machine")
        if slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {slots}")
        files.install_sigterm_cleanup()
        self.me, self.peer, self.creator, self.timeout_s = me, peer, creator, timeout_s
        self.slots = slots
        self.bytes_sent = 0
        self._control: Segment | None = None
        self._token = secrets.token_hex(16) if creator else ""
        self._peer_pipe = -1
        self._pipe_name = files.create_fifo()
        # Read-only: the peer's write end is the only one, so its exit shows as a hang-up.
        self._inbox = files.open_checked(self._pipe_name, os.O_RDONLY | os.O_NONBLOCK, True)
        self._fds = [self._inbox]  # closed by `close`, or when the endpoint is collected
        self._closer = weakref.finalize(self, _close_fds, self._fds)
        self._poll = select.poll()
        self._poll.register(self._inbox, select.POLLIN)
        if creator:
            self._control = Segment.create("control", 2, PAGE)
            self._control.map[_TOKEN_AT : _TOKEN_AT + 32] = self._token.encode()
        # producer state
        self._data: Segment | None = None
        self._generation = 0
        self._segments: list[str] = []  # files we created; the consumer unlinks them
        self._head = 0
        # consumer state
        self._in_data: Segment | None = None
        self._in_generation = 0
        self._tail = 0
        self._stash: dict[int, torch.Tensor] = {}  # messages read ahead of the one awaited

    # ----------------------------------------------------------------------------- setup
    def offer(self) -> str:
        """What the peer needs to connect: our pipe, and the control file and its token."""
        control = self._control.name if self._control is not None else ""
        return f"{self._pipe_name} {control} {self._token}"

    def connect(self, offer: str) -> bool:
        """Open the peer's pipe (and map the creator's control file); False if not possible."""
        try:
            pipe, control, token = (offer.split(" ") + ["", ""])[:3]
            self._peer_pipe = files.open_checked(pipe, os.O_WRONLY | os.O_NONBLOCK, True)
            self._fds.append(self._peer_pipe)
            if not self.creator:
                self._control = Segment.open(control, 2, PAGE)
                if bytes(self._control.map[_TOKEN_AT : _TOKEN_AT + 32]) != token.encode():
                    raise ValueError(f"{control} does not hold the creator's token")
        except (OSError, ValueError):
            return False
        raw, view = self._control.raw, memoryview(self._control.map)
        self._words = atomics.Words(raw, view, atomics.MODE)
        self._nap_ms = atomics.NAP_MS[atomics.MODE]
        out_page, in_page = (0, 1) if self.creator else (1, 0)
        self._out, self._in = out_page * _WORDS_PER_PAGE, in_page * _WORDS_PER_PAGE
        return True

    def unlink(self) -> None:
        """Remove our setup files (call once both sides connected, or gave up)."""
        files.unlink(self._pipe_name)
        if self._control is not None and self.creator:
            files.unlink(self._control.name)

    def close(self) -> None:
        """Close the pipes (the peer's next wait reports us gone) and drop our files."""
        self.unlink()
        for name in self._segments:  # (already gone once the consumer mapped them)
            files.unlink(name)
        self._segments = []
        self._closer()

    # --------------------------------------------------------------------------- waiting
    def _wait(self, ready: Callable[[], bool], sleeping: int, what: str) -> None:
        """Return once `ready()`; sleep in poll() meanwhile; raise past the deadline or when
        the peer is gone."""
        if ready():
            return
        words, deadline = self._words, time.monotonic() + self.timeout_s
        while True:
            # Raise the flag, then look: the other side moves its counter, then looks at the
            # flag; sequential consistency lets at most one of the two looks miss the other.
            words.store(sleeping, 1)
            if ready():
                words.store(sleeping, 0)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                words.store(sleeping, 0)
                raise CollectiveTimeout(
                    self.me,
                    f"{what} (shared-memory link with rank {self.peer})",
                    self.timeout_s,
                    f"rank {self.peer} did not take its part (stopped, or the ranks disagree on "
                    "the order of messages?)",
                )
            events = self._poll.poll(min(self._nap_ms, remaining * 1000))
            try:
                os.read(self._inbox, 4096)  # drain the tokens; the counters are the truth
            except BlockingIOError:
                pass
            if any(event & (select.POLLHUP | select.POLLERR) for _, event in events):
                words.store(sleeping, 0)
                if ready():
                    return
                raise PeerLostError(self.me, self.peer, what)

    def _wake(self, sleeping: int, what: str) -> None:
        """After moving a counter: write a token to the peer's pipe if it sleeps."""
        if self._words.load(sleeping):
            try:
                os.write(self._peer_pipe, b"x")
            except BlockingIOError:
                pass  # the pipe is full of tokens: it will wake anyway
            except BrokenPipeError as exc:
                raise PeerLostError(self.me, self.peer, what) from exc

    # ----------------------------------------------------------------------------- send
    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Copy `tensor` into the next free slot and return (blocks only while the ring is
        full, at most `timeout_s`). Messages arrive in send order; `tag` names each."""
        if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
            raise ValueError(
                f"rank {self.me}: cannot send a {tensor.dtype} tensor of {tensor.dim()} dims to "
                f"rank {self.peer} (dtypes {[str(d) for d in DTYPES]}, at most {MAX_DIMS} dims)"
            )
        what = f"send of tag {tag} to rank {self.peer}"
        words, out = self._words, self._out
        nbytes = tensor.numel() * tensor.element_size()
        if self._data is None or _HEADER + nbytes > self._data.slot_bytes:
            # a new segment: only once the consumer has read every message of the old one
            drained = self._head
            self._wait(lambda: words.load(out + _TAIL) == drained, out + _PRODUCER_SLEEPING, what)
            self._grow(_HEADER + nbytes)
        head = self._head
        self._wait(
            lambda: head - words.load(out + _TAIL) < self.slots, out + _PRODUCER_SLEEPING, what
        )
        slot = head % self.slots
        header = [tag, DTYPES.index(tensor.dtype), tensor.dim(), nbytes, *tensor.shape]
        header += [0] * (_HEADER_WORDS - len(header))
        with torch.no_grad():
            self._data.slot(slot, _HEADER_WORDS, torch.int64).copy_(torch.tensor(header))
            payload = self._data.slot(slot, tensor.numel(), tensor.dtype, _HEADER)
            payload.view(tensor.shape).copy_(tensor)
        self._head = head + 1
        words.store(out + _HEAD, self._head)  # publishes the slot: after the copy, never before
        self._wake(out + _CONSUMER_SLEEPING, what)
        self.bytes_sent += nbytes

    def _grow(self, need: int) -> None:
        old = self._data.slot_bytes if self._data is not None else 0
        slot_bytes = _round_up(max(need, 2 * old, _MIN_SLOT), PAGE)
        segment = Segment.create("seg", self.slots, slot_bytes)
        name = segment.name.encode()
        page = self._out * 8
        self._control.map[page + _NAME_AT : page + _NAME_AT + _NAME_MAX] = name.ljust(
            _NAME_MAX, b"\0"
        )
        words = self._words
        words.store(self._out + _SLOTS, self.slots)
        words.store(self._out + _SLOT_BYTES, slot_bytes)
        self._generation += 1
        words.store(self._out + _GENERATION, self._generation)  # after the name and sizes
        self._data = segment  # (the old mapping goes with its last view)
        self._segments.append(segment.name)

    # -------------------------------------------------------------------------- receive
    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> torch.Tensor:
        """The message `tag` as a new tensor of `shape` and `dtype` (ValueError if the sender
        sent another); messages of other tags read on the way are kept for their own recv."""
        what = f"receive of tag {tag} from rank {self.peer}"
        while tag not in self._stash:
            got_tag, tensor = self._next(what)
            if got_tag in self._stash:
                raise ValueError(
                    f"rank {self.me}: rank {self.peer} sent tag {got_tag} twice before it "
                    "was received"
                )
            self._stash[got_tag] = tensor
        tensor = self._stash.pop(tag)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"rank {self.me}: {what}: expected {tuple(shape)} {dtype}, rank {self.peer} "
                f"sent {tuple(tensor.shape)} {tensor.dtype}"
            )
        return tensor

    def _next(self, what: str) -> tuple[int, torch.Tensor]:
        """Copy the oldest unread message out of its slot and free the slot."""
        words, inn, tail = self._words, self._in, self._tail
        self._wait(lambda: words.load(inn + _HEAD) > tail, inn + _CONSUMER_SLEEPING, what)
        generation = words.load(inn + _GENERATION)
        if generation != self._in_generation:
            page = inn * 8
            raw = bytes(self._control.map[page + _NAME_AT : page + _NAME_AT + _NAME_MAX])
            slots, slot_bytes = words.load(inn + _SLOTS), words.load(inn + _SLOT_BYTES)
            name = raw.rstrip(b"\0").decode()
            self._in_data = Segment.open(name, slots, slot_bytes)
            files.unlink(name)  # mapped: the memory lives on until both sides unmap it
            self._in_generation = generation
        data = self._in_data
        slot = tail % (data.raw.numel() // data.slot_bytes)
        header = data.slot(slot, _HEADER_WORDS, torch.int64).tolist()
        tag, dtype, ndim, nbytes = header[:4]
        dtype, shape = DTYPES[dtype], header[4 : 4 + ndim]
        tensor = torch.empty(shape, dtype=dtype)
        tensor.copy_(data.slot(slot, nbytes // dtype.itemsize, dtype, _HEADER).view(shape))
        self._tail = tail + 1
        words.store(inn + _TAIL, self._tail)  # frees the slot: after the copy out
        self._wake(inn + _PRODUCER_SLEEPING, what)
        return tag, tensor
