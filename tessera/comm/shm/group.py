"""Shared-memory allreduce for ranks on one host: reduce in place in a mapped segment.

A segment is a file in /dev/shm that every rank of the group maps; it holds one slot per rank.
Allreduce of n bytes, rank r of p, on an ordinary tensor:
  1. copy the tensor into slot r, all but slice r (n/p bytes) that only rank r reads;
  2. barrier;
  3. reduce slice r: rank r's own values (read from the tensor), then slice r of every other
     slot, into slice r of the group's result area (a second segment); all ranks do this in
     parallel on disjoint slices;
  4. barrier;
  5. copy the result area into the tensor.
Memory traffic per rank ≈ (5 - 1/p)·n, below the (5 + 1/p)·n of copying all of it in and
keeping a reduced copy per slot. On a tensor from `shared_buffer` (it *is* slot r) steps 1 and
5 go: step 3 writes the result into slice r of every slot, in place (n + n bytes). Two barriers
either way. Cost model: 2σ + n(3μ + γ(p-1)/p), times p/cores when ranks outnumber cores
(`tessera.comm.cost`).

Why it is fast: no socket copies, no allocation per call (segments are cached per group and
grow by doubling), and slots written only where no peer reads at the time: the peers read slot
r between the two barriers only, and the result area from the second barrier until they reach
the next one, while rank r writes its slice of it only after that next barrier; so step 5
needs no third barrier and nothing is double-buffered. (Writing the result back into every
slot instead, as before, moved (p-1)/p·n more bytes: in one run alternating the two, 1 MB ~
the same, 4-16 MB 5-13% slower at 2 and 4 ranks, `benchmarks/shm_barrier.py` at the commit
that added the result area. Every rank reducing the whole tensor after one barrier, no second
barrier, was slower still: more reduction work than the barrier it saves.)

The barrier lives in a shared control page. A waiting rank first looks for up to `SPIN_S`
(TESSERA_SHM_SPIN_US, 100 µs by default), calling sched_yield() between looks, then sleeps.
Why both: a kernel wake-up costs ~50-115 µs on this 2-vCPU VM (the sleeping vCPU halts and must
be woken), twice per call; on a 1 MB allreduce, 2 ranks, spin and no spin alternating in one
run (load 1.8), a call went from 227 µs to 132 µs (4 ranks: 747 to 650 µs). A pure busy spin
is a trap when ranks share cores with other work (under load 4: 500 µs became 660-1180 µs, as
the spinner holds the core its peer needs); yielding between looks hands the core to any
runnable process (and helps 4 ranks on 2 cores too). Only the main thread spins: on a side
thread while the main thread computes (DDP's comm stream), a 1 MB call went from 381 µs to
2247 µs with the spin (the spinner holds the GIL and yields its core to the compute thread for
a time slice), so there the rank sleeps at once. Past `SPIN_S` the rank sleeps, so an
idle wait never burns a core.

How a rank sleeps: where every rank of the group has futex(2) and atomic read-modify-writes
(`futex`, `atomics`; Linux on x86_64 or aarch64), each arrival adds one to a shared 32-bit
arrival counter, waiters sleep on that counter, and the last rank to arrive wakes them all with
one call (only if one raised its sleeping flag). Elsewhere, or with TESSERA_SHM_FUTEX=0, each
rank stores its own counter and sleeps in poll() on a named pipe; every arriving rank writes a
byte to each sleeping peer, who wakes, looks, and may sleep again. The futex saves those
intermediate wake-ups with 4 ranks and the pipe's write/poll/read; measured against the pipe,
variants alternating in one run (`benchmarks/shm_barrier.py`, BENCHMARKS.md's comm section).
Either way each rank's own counter names the ranks that never arrived when a wait times out,
and the accesses are sequentially consistent (`atomics`): a release/acquire pair orders each
slot's data before the counter that announces it, on any CPU, and "raise the flag, then look"
against "arrive, then look at the flags" cannot both miss.

Who shares memory is probed, not guessed from host names (`segments.probe`); a group that
cannot share it, or a machine that cannot order the accesses, falls back to the native
algorithm for every shm request. Files get unguessable names, private modes and exclusive
creation, are unlinked as soon as every rank has them mapped, and are cleaned up on SIGTERM
and after dead jobs (`files`).
"""

from __future__ import annotations

import os
import select
import struct
import threading
import time

import torch
import torch.distributed as dist

from tessera.comm import diagnostics
from tessera.comm._ops import PAIRWISE, accumulate_dtype, combine, finish_mean
from tessera.comm._p2p import GroupInfo
from tessera.comm.shm import files, futex
from tessera.comm.shm.segments import NAME_AT, NAME_MAX, PAGE, Segment, probe
from tessera.runtime import flight_recorder

__all__ = ["SPIN_S", "ShmGroup", "shm_group"]

SPIN_S = float(os.environ.get("TESSERA_SHM_SPIN_US", 100)) * 1e-6
"""How long a barrier polls the counters (yielding the core between looks) before sleeping;
see the module docstring."""

_ALIGN = 64  # slice boundaries on cache lines, so two ranks never write the same line
_BLOCK = 256 << 10  # bytes reduced at a time on the shared path: the write-back hits in cache
_COUNTER = 64  # int64 word of a rank's control slot holding its barrier count
_SLEEPING = 80  # int64 word: 1 while the rank sleeps (poll() or futex) and wants a wake-up
_ARRIVALS_AT = 1024  # byte of the header page: the futex barrier's uint32 arrival counter
_MASK32, _HALF32 = 0xFFFFFFFF, 1 << 31
_DESC = diagnostics.DESCRIPTOR_LEN


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit


class ShmGroup:
    """The shared-memory state of one process group: control page, pipes and segments.

    Created collectively (every rank of the group at once); `same_host` says whether the probe
    (`segments.probe`) found every rank able to share memory with every other.
    """

    def __init__(self, info: GroupInfo) -> None:
        self.info = info
        link = probe(info)
        self.same_host = link is not None
        if link is None:
            return
        self._control = link.control
        self._inbox, self._outboxes = link.inbox, link.outboxes
        self._words, self._nap_ms = link.words, link.nap_ms
        self._slot_words = PAGE // 8
        self._futex = link.futex
        self._arrivals = info.size * PAGE + _ARRIVALS_AT  # byte of the futex barrier's counter
        self._arrivals_address = self._words.address(self._arrivals)
        self._peers = [q for q in range(info.size) if q != info.rank]
        self._poll = select.poll()
        self._poll.register(self._inbox, select.POLLIN)
        self._count = 0  # barriers passed: the same on every rank
        self._segments: dict[str, Segment] = {}  # "scratch", "staging": grown by doubling
        self._shared: list[Segment] = []
        self.turns = 0  # double-buffered collectives done (`gather`): the same on every rank

    # --------------------------------------------------------------------------- barrier
    def _arrived(self, count: int) -> bool:
        load, stride = self._words.load, self._slot_words
        return all(load(q * stride + _COUNTER) >= count for q in self._peers)

    def _spin_stop(self, deadline: float) -> float:
        # Spin on the main thread only: a comm thread beside compute (DDP's stream) would hold
        # the GIL and yield its core to the compute thread for a whole time slice.
        spin_s = SPIN_S if threading.current_thread() is threading.main_thread() else 0.0
        return min(deadline, time.monotonic() + spin_s)  # the spin never outlasts the timeout

    def _wake_needed(self) -> bool:
        load, stride = self._words.load, self._slot_words
        return any(load(q * stride + _SLEEPING) for q in self._peers)

    def barrier(self, op: str, seq: int, timeout_s: float) -> None:
        """Block until every rank of the group reached this barrier (yielding spin, then sleep)."""
        self._count += 1
        count, words, me = self._count, self._words, self.info.rank * self._slot_words
        words.store(me + _COUNTER, count)  # releases this rank's writes; names the late ranks
        if self._futex:
            self._futex_barrier(op, seq, timeout_s, count)
            return
        for q in self._peers:  # wake the ranks that sleep waiting for us
            if words.load(q * self._slot_words + _SLEEPING):
                os.write(self._outboxes[q], b"x")
        deadline = time.monotonic() + timeout_s
        stop = self._spin_stop(deadline)
        while time.monotonic() < stop:  # polite spin: yield the core to whoever needs it
            if self._arrived(count):
                return
            os.sched_yield()
        while True:
            # Raise the flag, then look: an arriving rank stores its counter, then looks at the
            # flag. Sequential consistency lets at most one of the two looks miss the other.
            words.store(me + _SLEEPING, 1)
            if self._arrived(count):
                words.store(me + _SLEEPING, 0)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                words.store(me + _SLEEPING, 0)
                self._timeout(op, seq, timeout_s, count)
            self._poll.poll(min(self._nap_ms, remaining * 1000))
            try:
                os.read(self._inbox, 4096)  # drain tokens; the counters are the truth
            except BlockingIOError:
                pass

    def _futex_barrier(self, op: str, seq: int, timeout_s: float, count: int) -> None:
        """The barrier on one shared arrival counter: the last rank to arrive wakes all at once.

        The counter (32 bits, wrapping) reaches count·p when every rank arrived at barrier
        `count`; no rank can be more than one barrier ahead, so it never strays further than p
        from that target and a wrapped difference tells "reached" from "not yet".
        """
        words, me = self._words, self.info.rank * self._slot_words
        target = count * self.info.size & _MASK32
        if words.add32(self._arrivals, 1) == target:  # last: wake whoever went to sleep
            if self._wake_needed():
                futex.wake(self._arrivals_address)
            return
        deadline = time.monotonic() + timeout_s
        stop = self._spin_stop(deadline)
        while time.monotonic() < stop:
            if (words.load32(self._arrivals) - target) & _MASK32 < _HALF32:
                return
            os.sched_yield()
        words.store(me + _SLEEPING, 1)  # then look: the last arriver adds, then looks at flags
        try:
            while True:
                seen = words.load32(self._arrivals)
                if (seen - target) & _MASK32 < _HALF32:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._timeout(op, seq, timeout_s, count)
                # returns at once if the counter moved since `seen`: no wake-up is lost
                futex.wait(self._arrivals_address, seen, min(self._nap_ms / 1e3, remaining))
        finally:
            words.store(me + _SLEEPING, 0)

    def _timeout(self, op: str, seq: int, timeout_s: float, count: int) -> None:
        load, stride = self._words.load, self._slot_words
        missing = [self.info.ranks[q] for q in self._peers if load(q * stride + _COUNTER) < count]
        waited = {"group": self.info.key, "seq": seq, "op": f"{op} (shm)", "peer": None}
        raise flight_recorder.timeout_with_record(
            dist.get_rank(),
            op,
            timeout_s,
            f"collective #{seq} (shm), waiting for ranks {missing}: "
            f"ranks {missing} have not reached collective #{seq} (never called it?)",
            {**waited, "missing_ranks": missing},
        )

    # --------------------------------------------------------------------------- checks
    def _publish(self, words: list[int] | None, at: int = 0) -> bytes | None:
        """Write this rank's descriptor at byte `at` of its control slot (see `_check`)."""
        if words is None:
            return None
        mine = struct.pack(f"{_DESC}q", *words)
        start = self.info.rank * PAGE + at
        self._control.map[start : start + len(mine)] = mine
        return mine

    def _check(self, mine: bytes | None, at: int = 0) -> None:
        """After the first barrier: every rank's descriptor (at byte `at`) must equal ours."""
        if mine is None:
            return
        for q in self._peers:
            start = q * PAGE + at
            theirs = self._control.map[start : start + len(mine)]
            if theirs != mine:
                diagnostics.compare(
                    list(struct.unpack(f"{_DESC}q", mine)),
                    list(struct.unpack(f"{_DESC}q", theirs)),
                    dist.get_rank(),
                    self.info.ranks[q],
                )

    # -------------------------------------------------------------------------- segments
    def _new_segment(self, slot_bytes: int, timeout_s: float) -> Segment:
        """A new segment: rank 0 creates it and publishes its name in the control page."""
        slot_bytes = _round_up(max(slot_bytes, _ALIGN), PAGE)
        p, header = self.info.size, self.info.size * PAGE + NAME_AT
        if self.info.rank == 0:
            segment = Segment.create("seg", p, slot_bytes)
            try:
                name = segment.name.encode()
                self._control.map[header : header + NAME_MAX] = name.ljust(NAME_MAX, b"\0")
                self.barrier("shm segment", -1, timeout_s)  # the name is out
                self.barrier("shm segment", -1, timeout_s)  # every rank has it mapped
            finally:  # the memory lives until the last rank unmaps it
                files.unlink(segment.name)
            return segment
        self.barrier("shm segment", -1, timeout_s)
        name = bytes(self._control.map[header : header + NAME_MAX]).rstrip(b"\0").decode()
        try:
            segment = Segment.open(name, p, slot_bytes)
        except (OSError, ValueError) as exc:
            raise RuntimeError(
                f"rank {dist.get_rank()}: cannot map the shared-memory segment {name} that "
                f"group rank 0 created ({exc})"
            ) from exc
        self.barrier("shm segment", -1, timeout_s)
        return segment

    def scratch(self, nbytes: int, timeout_s: float, purpose: str = "scratch") -> Segment:
        """The copy-in segment of `purpose`, grown (by doubling, alike on every rank) to `nbytes`
        per slot. "scratch" serves all_reduce and broadcast; "staging" the double-buffered
        all_gather and reduce_scatter (`gather`), whose slots others may still be reading
        when this rank starts its next call, so they must not share a segment with all_reduce.
        """
        segment = self._segments.get(purpose)
        if segment is None or segment.slot_bytes < nbytes:
            old = segment.slot_bytes if segment is not None else 0
            segment = self._segments.pop(purpose, None)  # the old map goes when its views die
            segment = self._segments[purpose] = self._new_segment(max(nbytes, 2 * old), timeout_s)
        return segment

    def shared_buffer(self, numel: int, dtype: torch.dtype, timeout_s: float) -> torch.Tensor:
        """A new (numel,) tensor living in this rank's slot of a dedicated segment."""
        segment = self._new_segment(numel * dtype.itemsize, timeout_s)
        self._shared.append(segment)
        return segment.slot(self.info.rank, numel, dtype)

    def find(self, tensor: torch.Tensor) -> tuple[Segment, int] | None:
        """The shared segment and slot offset `tensor` lives at, if it came from shared_buffer."""
        for segment in self._shared:
            offset = segment.owns(tensor, self.info.rank)
            if offset is not None:
                return segment, offset
        return None

    def _plan(self, segment: Segment, offset: int, numel: int, dtype: torch.dtype) -> tuple:
        """Cached views: every slot as (numel,) and this rank's [lo, hi) slice bounds."""
        key = (offset, numel, dtype)
        plan = segment.plans.get(key)
        if plan is None:
            p = self.info.size
            align = max(1, _ALIGN // dtype.itemsize)
            bounds = [min(numel, _round_up(numel * i // p, align)) for i in range(p)] + [numel]
            slots = [segment.slot(q, numel, dtype, offset) for q in range(p)]
            plan = segment.plans[key] = (slots, bounds)
        return plan

    # ------------------------------------------------------------------------ collectives
    def all_reduce(
        self, tensor: torch.Tensor, op: str, seq: int, timeout_s: float, words=None
    ) -> None:
        """Allreduce `tensor` (any layout and dtype) in place through shared memory."""
        r, n = self.info.rank, tensor.numel()
        found = self.find(tensor)
        if found is None:
            self._all_reduce_copied(tensor, op, seq, timeout_s, words)
            return
        segment, offset = found
        slots, bounds = self._plan(segment, offset, n, tensor.dtype)
        if words is not None:
            words = list(words)
            words[7] = offset  # shared tensors: every rank's must sit at the same offset
        mine = self._publish(words)
        self.barrier("all_reduce", seq, timeout_s)
        self._check(mine)
        lo, hi = bounds[r], bounds[r + 1]
        if hi > lo:
            self._reduce_slice([s[lo:hi] for s in slots], op)
        self.barrier("all_reduce", seq, timeout_s)

    def _all_reduce_copied(
        self, tensor: torch.Tensor, op: str, seq: int, timeout_s: float, words
    ) -> None:
        """Allreduce a tensor that lives outside the segments (see the module docstring)."""
        r, p, n = self.info.rank, self.info.size, tensor.numel()
        nbytes = n * tensor.element_size()
        slots, bounds = self._plan(self.scratch(nbytes, timeout_s), 0, n, tensor.dtype)
        result = self._result_area(-(-nbytes // p), n, tensor.dtype, timeout_s)
        flat = tensor.reshape(-1)  # a view when contiguous, else a copy
        lo, hi = bounds[r], bounds[r + 1]
        slots[r][:lo].copy_(flat[:lo])  # all but slice r: only this rank reads that, from `flat`
        slots[r][hi:].copy_(flat[hi:])
        if words is not None:
            words = list(words)
            words[7] = 0  # the offset of shared tensors (`all_reduce`)
        mine = self._publish(words)
        self.barrier("all_reduce", seq, timeout_s)
        self._check(mine)
        if hi > lo:
            self._reduce_into(flat[lo:hi], [s[lo:hi] for s in slots], result[lo:hi], op)
        self.barrier("all_reduce", seq, timeout_s)
        tensor.copy_(result.view(tensor.shape))

    def _result_area(self, per_slot: int, numel: int, dtype: torch.dtype, timeout_s: float):
        """The (numel,) result area: the start of the "result" segment, shared by all ranks."""
        segment = self.scratch(per_slot, timeout_s, "result")
        key = ("result", numel, dtype)
        view = segment.plans.get(key)
        if view is None:
            view = segment.plans[key] = segment.raw[: numel * dtype.itemsize].view(dtype)
        return view

    def _reduce_into(
        self, own: torch.Tensor, slices: list[torch.Tensor], out: torch.Tensor, op: str
    ) -> None:
        # own: this rank's values of its slice; slices[q]: rank q's (q != rank). The same
        # operations in the same order as `_reduce_slice` (own values, then the others in rank
        # order, in the accumulation dtype), so the bits are the same; the result goes to `out`.
        r, p = self.info.rank, len(slices)
        step = max(1, _BLOCK // out.element_size())
        acc_dtype = accumulate_dtype(out.dtype)
        direct = out.dtype == acc_dtype
        for start in range(0, out.numel(), step):
            stop = start + step
            mine = own[start:stop]
            others = [slices[q][start:stop] for q in range(p) if q != r]
            if not direct:
                acc = mine.to(acc_dtype)
                others = [other.to(acc_dtype) for other in others]
            elif others:
                acc = PAIRWISE[op](mine, others.pop(0), out=out[start:stop])
            else:
                acc = out[start:stop].copy_(mine)
            for other in others:
                combine(acc, other, op)
            finish_mean(acc, op, p)
            if not direct:
                out[start:stop].copy_(acc)

    def _reduce_slice(self, slices: list[torch.Tensor], op: str) -> None:
        # slices[q]: rank q's values of this rank's slice; the result goes into every slot, block
        # by block so that the write-back reads from cache. Each element is reduced by exactly
        # one rank, so every rank ends with the same bits whatever the order.
        r, p = self.info.rank, len(slices)
        step = max(1, _BLOCK // slices[0].element_size())
        acc_dtype = accumulate_dtype(slices[0].dtype)
        for start in range(0, slices[0].numel(), step):
            block = [s[start : start + step] for s in slices]
            acc = block[r] if block[r].dtype == acc_dtype else block[r].to(acc_dtype)
            for q in range(p):
                if q != r:
                    other = block[q] if block[q].dtype == acc_dtype else block[q].to(acc_dtype)
                    combine(acc, other, op)
            finish_mean(acc, op, p)
            if acc.data_ptr() != block[r].data_ptr():
                block[r].copy_(acc)
            for q in range(p):
                if q != r:
                    block[q].copy_(block[r])

    def broadcast(
        self, tensor: torch.Tensor, src: int, seq: int, timeout_s: float, words=None
    ) -> None:
        """Broadcast group rank `src`'s `tensor` through src's slot (2 barriers)."""
        r, n = self.info.rank, tensor.numel()
        segment = self.scratch(n * tensor.element_size(), timeout_s)
        source = segment.slot(src, n, tensor.dtype).view(tensor.shape)
        if r == src:
            source.copy_(tensor)
        mine = self._publish(words)
        self.barrier("broadcast", seq, timeout_s)
        self._check(mine)
        if r != src:
            tensor.copy_(source)
        self.barrier("broadcast", seq, timeout_s)  # the descriptors may be rewritten after this


_groups: dict[str, ShmGroup] = {}


def shm_group(info: GroupInfo) -> ShmGroup:
    """The cached `ShmGroup` of a group (created collectively on first use)."""
    group = _groups.get(info.key)
    if group is None:
        group = _groups[info.key] = ShmGroup(info)
    return group
