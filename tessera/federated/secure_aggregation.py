"""Secure aggregation (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", the semi-honest protocol of Fig. 4), optionally over a sparse graph (SecAgg+,
Bell et al. 2020): the server learns the sum, not the terms.

Every client u quantises its report x_u to fixed point in the ring Z_{2^64} (numpy uint64, whose
addition wraps exactly mod 2^64) and sends

    y_u = x_u + PRG(b_u) + sum_{v in N(u), v > u} PRG(s_uv) - sum_{v in N(u), v < u} PRG(s_uv)

where N(u) are u's neighbours (every other client by default; see `_graph`), s_uv = s_vu is the
hash of the X25519 agreement of u's and v's mask keys (`_agree`) and b_u a private seed. The
pairwise masks cancel in the sum over all clients. PRG(seed) is the AES-256-CTR keystream under
key `seed` from the counter block 0^96 || 2, read as little-endian uint64; it is the AES-GCM
encryption of zeros under the all-zero nonce (whose ciphertext is exactly that keystream, NIST SP
800-38D: GCTR from inc32(J0)), tag dropped, because OpenSSL's stitched AES-GCM runs faster here
than its plain CTR mode (7 against 13 us for the benchmark's 4,811 coordinates). Rounds:

0. advertise keys: each client sends two X25519 public keys (c: encrypting shares, s: masks); the
   server fixes the graph and sends each client its neighbours' keys;
1. share keys: each client splits its mask secret key s_sk and its seed b_u into t-of-(|N(u)|+1)
   Shamir shares (`_shamir`; holders: its neighbours and itself) and sends share v, encrypted
   with AES-GCM under the c-key agreement with v, to v through the server (which cannot read it);
2. masked input: the clients that are still there send y_u; the others have dropped out;
3. unmask: for each dropped client v the survivors among its neighbours send their shares of
   s_sk_v (the server then recomputes and removes v's pairwise masks from its surviving
   neighbours' inputs); for each survivor u they send their shares of b_u. An honest client never
   reveals both kinds for one client, so the server never unmasks a single input.

The round needs at least `threshold` survivors, every client whose secret must be recovered
needs `threshold` surviving holders of its shares, and the survivors must stay connected in the
graph (see below); otherwise it stops with `SecureAggregationError` before anything is revealed.
Sums of quantised values are exact integers; the only error is quantisation: with `frac_bits` f,
each coordinate of each report is rounded to a multiple of 2^-f, so the dequantised sum of n
reports is within n * 2^-(f+1) of the exact sum (plus the float64 rounding of the final division
by 2^f). The ring holds sums in +-2^(63-f) (+-2^31 by default): a client refuses to quantise a
report with a coordinate of magnitude 2^(63-f) / n or more (n: the round's participants), so the
sum of n reports cannot wrap around (`quantize`'s `count`).

Client ids are Shamir evaluation points (client u holds the share at u + 1 in GF(2^26 - 5)):
they must lie in 0 .. `MAX_CLIENT_ID` - 1 (id -1 would hold f(0), the secret itself).

Security, for a semi-honest server colluding with c clients while d clients drop out. Complete
graph (Bonawitz et al.): every input stays hidden while c < t (the colluders hold fewer than t
shares of any honest client's secrets), and the round completes while d <= n - t. With k
neighbours (`SecAggConfig(neighbours=k)`) the same conditions hold per neighbourhood: hidden
while fewer than t of an honest client's k + 1 share holders collude (c < t suffices), complete
while each client whose secret is needed keeps t surviving holders (d <= k + 1 - t suffices);
and one more the complete graph meets trivially: unmasking would give the server the sum of
each connected group of survivors separately, so the server refuses to unmask (the round is
abandoned) when the survivors' graph is disconnected (`SecAggServer.collect_masked`). A Harary
graph is k-vertex-connected, so d < k dropouts never trigger that refusal. Bell et al. prove
that a random graph of degree k = O(log n) keeps these failures negligible when c and d are
constant fractions of n (the abstract's figure, semi-malicious setting: with 10^4 clients each
talks to 3% of them and its input is summed with at least 5,000 others, withstanding 5% corrupt
clients and 5% dropouts); that analysis is for n in the thousands. For rounds of ten clients a
small k is a cost trade-off with the worst-case guarantees above, not their theorem.

Cost per client: 2 keys, 2k X25519 agreements (k = n - 1 for the complete graph), k + 1 PRG
expansions of the vector, one vectorised Shamir split; the server: k agreements and expansions per
dropped client, one expansion per survivor, one batched Lagrange interpolation per set of share
holders. The X25519 agreements dominate for small models (about 35 us of CPU each on the
benchmark machine, against about 7 us to expand a 4,811-coordinate mask); the protocol fixes their
number, and around them nothing is redone: a client agrees each key once, a public key is parsed
once per process (`_public_key`), and a round's seeds are recovered with one set of Lagrange
weights per set of holders.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tessera.errors import TesseraError
from tessera.federated import _shamir
from tessera.federated._graph import degree, harary_graph

__all__ = [
    "MAX_CLIENT_ID",
    "SecAggClient",
    "SecAggConfig",
    "SecAggServer",
    "SecureAggregationError",
    "SecureSum",
    "dequantize",
    "quantize",
    "secure_sum",
]

FRAC_BITS = 32
"""Default fixed-point fraction bits: resolution 2^-32, range +-2^31 for the whole sum."""
MAX_CLIENT_ID = _shamir.PRIME - 1
"""Client ids are 0 .. MAX_CLIENT_ID - 1 (= 2^26 - 7): id u holds the Shamir share at u + 1,
which must be a non-zero element of the field."""
_ROUTING = struct.Struct(">qq")
_RECORD_BYTES = _ROUTING.size + 2 * _shamir.SHARE_BYTES  # sender, recipient, s_sk and b shares


class SecureAggregationError(TesseraError):
    """A secure-aggregation round cannot complete (too few survivors, a bad message)."""


@dataclass(frozen=True)
class SecAggConfig:
    """How `simulate` and the deployed server run secure aggregation (`secure_aggregation=`).

    `secure_aggregation=True` means `SecAggConfig()`: the complete graph of Bonawitz et al. 2017.
    `neighbours=k` runs SecAgg+ (Bell et al. 2020): each client agrees keys, masks and shares
    secrets with k others in a random k-regular Harary graph the server draws each round; read the
    security note in this module's docstring before lowering k.
    """

    neighbours: int | None = None
    """k, the degree of the graph (None: every other client; capped at the round's size - 1;
    rounded up to even when the round has an odd number of clients)."""
    threshold: int | None = None
    """Shares that recover a client's secrets, out of its k + 1 holders (its neighbours and
    itself); default: a strict majority of them."""

    def __post_init__(self) -> None:
        if self.neighbours is not None and (
            isinstance(self.neighbours, bool) or not isinstance(self.neighbours, int)
            or self.neighbours < 2
        ):  # fmt: skip
            raise ValueError(f"SecAggConfig: neighbours={self.neighbours!r} must be an int >= 2")
        if self.threshold is not None and (
            isinstance(self.threshold, bool) or not isinstance(self.threshold, int)
            or self.threshold < 1
        ):  # fmt: skip
            raise ValueError(f"SecAggConfig: threshold={self.threshold!r} must be an int >= 1")


def as_config(secure_aggregation: bool | SecAggConfig, threshold: int | None = None):
    """`SecAggConfig` or None from a `secure_aggregation=` argument (True: the complete graph);
    `threshold` is the deployed config's separate field, which must not contradict it."""
    if isinstance(secure_aggregation, SecAggConfig):
        if threshold is not None and secure_aggregation.threshold not in (None, threshold):
            raise ValueError(
                f"secure aggregation: threshold={threshold} contradicts SecAggConfig's threshold"
                f"={secure_aggregation.threshold}"
            )
        if threshold is not None:
            return SecAggConfig(secure_aggregation.neighbours, threshold)
        return secure_aggregation
    if not isinstance(secure_aggregation, bool):
        raise TypeError(
            "secure_aggregation must be True, False or a SecAggConfig, got "
            f"{type(secure_aggregation).__name__}"
        )
    return SecAggConfig(threshold=threshold) if secure_aggregation else None


def check_client_id(client: object) -> int:
    """`client` as an int if it can take part in secure aggregation (else ValueError)."""
    if isinstance(client, bool) or not isinstance(client, (int, np.integer)):
        raise ValueError(f"secure aggregation: client id {client!r} is not an integer")
    if not 0 <= int(client) < MAX_CLIENT_ID:
        raise ValueError(
            f"secure aggregation: client id {client} must be in 0..{MAX_CLIENT_ID - 1} (ids are "
            f"Shamir evaluation points, id + 1 in GF(2^26 - 5))"
        )
    return int(client)


def quantize(vector: torch.Tensor, frac_bits: int = FRAC_BITS, count: int = 1) -> np.ndarray:
    """`round(vector * 2^frac_bits)` as two's-complement uint64 (a ring element per coordinate).

    `count` is the number of reports that will be summed: every coordinate must be below
    2^(63 - frac_bits) / count in magnitude, so that the sum cannot wrap around the ring
    (refused with `SecureAggregationError` otherwise, and for non-finite values)."""
    if count < 1:
        raise ValueError(f"secure aggregation: count must be >= 1, got {count}")
    scaled = vector.detach().to(torch.float64).numpy() * 2.0**frac_bits  # a new array
    limit = 2.0**63 / count
    if scaled.size and not -limit < scaled.min() <= scaled.max() < limit:  # False for NaN
        raise SecureAggregationError(
            f"secure aggregation: a value cannot be represented: the sum of {count} reports must "
            f"stay in +-2^{63 - frac_bits}, so each value in +-2^{63 - frac_bits}/{count} "
            f"(largest magnitude {float(np.abs(scaled).max()) * 2.0**-frac_bits:.6g})"
        )
    ring = np.empty(scaled.shape, dtype=np.int64)
    np.rint(scaled, out=ring, casting="unsafe")  # rounded, then converted (exact: |x| < 2^62)
    return ring.view(np.uint64)


def dequantize(total: np.ndarray, frac_bits: int = FRAC_BITS) -> torch.Tensor:
    """The float64 value of a ring element read as a signed fixed-point number."""
    # times 2^-f is division by 2^f exactly; one pass, converting as it multiplies
    return torch.from_numpy(np.multiply(total.view(np.int64), 2.0**-frac_bits, dtype=np.float64))


@functools.lru_cache(maxsize=4)
def _zeros(num_bytes: int) -> bytes:
    return bytes(num_bytes)


_NONCE = bytes(12)


def _prg(seed: bytes, length: int) -> np.ndarray:
    """PRG(seed): `length` uint64 words of AES-256-CTR keystream (module docstring), read-only."""
    stream = AESGCM(seed).encrypt(_NONCE, _zeros(8 * length), None)
    return np.frombuffer(stream, dtype=np.uint64, count=length)


@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> X25519PublicKey:
    """A public key parsed once per process (public data: sharing it across simulated clients
    reveals nothing, and parsing costs a sixth of an agreement)."""
    return X25519PublicKey.from_public_bytes(raw)


def _agree(private: X25519PrivateKey, own: bytes, public: bytes, purpose: bytes) -> bytes:
    """The 32-byte key both ends of a pair derive for `purpose`: one BLAKE2b-256 hash (RFC 7693)
    personalised with `purpose`, of the X25519 shared secret followed by the pair's two public
    keys in byte order (`own` is this end's, `public` the other's).

    Why a hash and not HKDF: Bonawitz et al. 2017 (sec. 3, "Key Agreement") instantiate
    KA.agree as Diffie-Hellman followed by a hash of the shared secret, and RFC 7748 (sec. 6.1)
    says to pass K = X25519(a, B) to a KDF "that includes K, K_A, and K_B", as libsodium's
    crypto_kx does with BLAKE2b over K || K_A || K_B. The public keys bind the key to this pair
    and this round (every round draws fresh keys); the personalisation separates the two
    purposes, which use different key pairs anyway (c for shares, s for masks: merging those
    would let a server that calls a live client dropped learn its mask key and its seed). One
    hash costs about 0.4 us here against 3 us for HKDF's two HMACs."""
    shared = private.exchange(_public_key(public))
    context = own + public if own < public else public + own
    return hashlib.blake2b(shared + context, digest_size=32, person=purpose).digest()


_MASK = b"tessera-sa-mask"  # BLAKE2b personalisations (at most 16 bytes)
_SHARES = b"tessera-sa-share"


class SecAggClient:
    """One client's side of a secure-aggregation round (fresh keys every round)."""

    def __init__(self, client_id: int) -> None:
        self.client_id = check_client_id(client_id)
        self._c_key = X25519PrivateKey.generate()
        self._s_key = X25519PrivateKey.generate()
        # raw 32-byte public keys, computed once: advertised, and part of every pair's KDF input
        self._c_public = self._c_key.public_key().public_bytes_raw()
        self._s_public = self._s_key.public_key().public_bytes_raw()
        self._seed = os.urandom(32)  # b_u
        # sender -> its (s_sk share, b share) as wire bytes (`_shamir.share_from_bytes` reads
        # them), checked on arrival; the unmask round sends them as they are
        self._held: dict[int, tuple[bytes, bytes]] = {}
        self._roster: dict[int, tuple[bytes, bytes]] = {}
        # KA(c_u, C_v) = KA(c_v, C_u): the key u encrypts its shares for v with is the key v
        # encrypted its shares for u with, so u agrees it (and sets up its cipher) once per partner.
        self._share_ciphers: dict[int, AESGCM] = {}

    def advertise_keys(self) -> tuple[bytes, bytes]:
        """Round 0: the public c-key and s-key."""
        return self._c_public, self._s_public

    def share_keys(self, roster: Mapping[int, tuple[bytes, bytes]], threshold: int) -> dict:
        """Round 1: `{v: ciphertext}`, the shares for each neighbour v, encrypted to v. `roster`
        holds the public keys of this client's neighbours and its own (all clients by default)."""
        if self.client_id not in roster:
            raise SecureAggregationError(
                f"secure aggregation: client {self.client_id} is not in the roster it was sent"
            )
        if not 1 <= threshold <= len(roster):
            raise SecureAggregationError(
                f"secure aggregation: client {self.client_id} cannot split its secrets "
                f"{threshold}-of-{len(roster)}"
            )
        self._roster = dict(roster)
        holders = sorted(self._roster)
        shares = _shamir.split(
            [self._s_key.private_bytes_raw(), self._seed], [v + 1 for v in holders], threshold
        )
        out, encoded = {}, shares.astype(">u4")  # big-endian words, converted once
        for v, share_bytes in zip(holders, encoded):
            if v == self.client_id:
                own = share_bytes.tobytes()
                self._held[v] = own[: _shamir.SHARE_BYTES], own[_shamir.SHARE_BYTES :]
                continue
            key = _agree(self._c_key, self._c_public, self._roster[v][0], _SHARES)
            cipher = self._share_ciphers[v] = AESGCM(key)
            record = _ROUTING.pack(self.client_id, v) + share_bytes.tobytes()
            nonce = os.urandom(12)  # both ends encrypt under this key: random nonces never meet
            out[v] = nonce + cipher.encrypt(nonce, record, None)
        return out

    def masked_input(
        self,
        report: np.ndarray,
        inbox: Mapping[int, bytes],
        partners: Collection[int] | None = None,
    ) -> np.ndarray:
        """Round 2: store the shares sent to this client, return y_u (see the module docstring).

        `partners` are the clients that completed round 1 (default: the whole roster); pairwise
        masks are only added with them, since only their shares can remove a mask later.
        """
        records = []
        for sender, ciphertext in inbox.items():
            if sender not in self._roster or sender == self.client_id:
                raise SecureAggregationError(
                    f"secure aggregation: client {self.client_id} got shares from {sender}, "
                    f"not a neighbour"
                )
            record = self._share_ciphers[sender].decrypt(ciphertext[:12], ciphertext[12:], None)
            if len(record) != _RECORD_BYTES or _ROUTING.unpack_from(record) != (
                sender, self.client_id
            ):  # fmt: skip
                raise SecureAggregationError(
                    f"secure aggregation: a bad or misrouted share record from {sender}"
                )
            records.append(record[_ROUTING.size :])
        if records:  # all shares checked in one numpy pass, kept as bytes
            if (np.frombuffer(b"".join(records), dtype=">u4") >= _shamir.PRIME).any():
                raise SecureAggregationError("secure aggregation: a share outside the field")
            half = _shamir.SHARE_BYTES
            self._held.update((u, (r[:half], r[half:])) for u, r in zip(inbox, records))
        report = np.asarray(report, dtype=np.uint64)
        masked = np.add(report, _prg(self._seed, len(report)))  # a new array: report untouched
        for v, (_, s_public) in self._roster.items():
            if v == self.client_id or (partners is not None and v not in partners):
                continue
            mask = _prg(_agree(self._s_key, self._s_public, s_public, _MASK), len(masked))
            (np.add if self.client_id < v else np.subtract)(masked, mask, out=masked)
        return masked

    def unmask(self, dropped: Collection[int], survivors: Collection[int]) -> dict:
        """Round 3: shares of s_sk for dropped clients, of b for survivors (never both for one),
        as `{"s": {client: bytes}, "b": {client: bytes}}` for the clients it holds shares of."""
        if set(dropped) & set(survivors):
            raise SecureAggregationError("secure aggregation: a client both dropped and survived")
        held = self._held
        return {
            "s": {v: held[v][0] for v in dropped if v in held},
            "b": {u: held[u][1] for u in survivors if u in held},
        }


class SecAggServer:
    """The server's side: draws the graph, routes keys and encrypted shares, sums masked inputs,
    removes masks.

    It only ever holds public keys, ciphertexts, masked vectors, the shares needed to remove
    masks, and the sum.
    """

    def __init__(
        self,
        participants: Collection[int],
        threshold: int | None = None,
        neighbours: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.participants = sorted(check_client_id(p) for p in participants)
        count = len(self.participants)
        self.neighbours = neighbours
        holders = degree(neighbours, count) + 1
        self.threshold = holders // 2 + 1 if threshold is None else int(threshold)
        if not 1 <= self.threshold <= holders:
            raise ValueError(
                f"secure aggregation: threshold {self.threshold} must be in 1..{holders}, the "
                f"holders of a client's shares (itself and its {holders - 1} neighbours among "
                f"{count} participants)"
            )
        self._rng = rng if rng is not None else np.random.default_rng()  # OS entropy
        self.roster: dict[int, tuple[bytes, bytes]] = {}
        self.graph: dict[int, frozenset[int]] = {}
        self.masked: dict[int, np.ndarray] = {}
        self.survivors: list[int] = []
        self.dropped: list[int] = []

    def collect_keys(self, adverts: Mapping[int, tuple[bytes, bytes]]) -> dict:
        """Round 0: the roster of public keys; draws the graph over the clients that advertised."""
        self.roster = {u: adverts[u] for u in self.participants if u in adverts}
        self._require(len(self.roster), "advertised keys")
        self.graph = harary_graph(sorted(self.roster), self.neighbours, self._rng)
        holders = degree(self.neighbours, len(self.roster)) + 1
        if holders < self.threshold:
            raise SecureAggregationError(
                f"secure aggregation: {len(self.roster)} clients advertised keys, so a client's "
                f"shares have {holders} holders, fewer than the threshold {self.threshold}"
            )
        return dict(self.roster)

    def neighbourhood(self, client: int) -> dict[int, tuple[bytes, bytes]]:
        """The public keys `client` is sent in round 1: its neighbours' and its own."""
        return {v: self.roster[v] for v in sorted(self.graph[client] | {client})}

    def keep_partners(self, partners: Collection[int]) -> None:
        """After round 1: only clients whose shares went out can be unmasked later."""
        self.roster = {u: self.roster[u] for u in sorted(partners) if u in self.roster}
        self._require(len(self.roster), "sent their shares")

    def route_shares(self, outboxes: Mapping[int, Mapping[int, bytes]]) -> dict:
        """Round 1: each client's inbox `{sender: ciphertext}` (the server cannot decrypt them);
        ciphertexts for clients outside the sender's neighbourhood or the roster are dropped."""
        inboxes: dict[int, dict[int, bytes]] = {v: {} for v in self.roster}
        for u, outbox in outboxes.items():
            for v, ciphertext in outbox.items():
                if v in inboxes and v in self.graph.get(u, ()):
                    inboxes[v][u] = ciphertext
        return inboxes

    def collect_masked(self, masked: Mapping[int, np.ndarray]) -> tuple[list[int], list[int]]:
        """Round 2: keep the masked inputs; return (dropped, survivors) for the unmask round,
        after checking that every secret the unmasking needs can be recovered."""
        self.masked = {u: masked[u] for u in self.roster if u in masked}
        self.survivors = sorted(self.masked)
        self.dropped = sorted(set(self.roster) - set(self.masked))
        self._require(len(self.survivors), "sent their masked input")
        alive = set(self.survivors)
        for u in self.survivors:
            self._require_holders(u, len((self.graph[u] | {u}) & alive), "seed")
        for v in self.dropped:
            if self.graph[v] & alive:  # its masks are in a survivor's input
                self._require_holders(v, len(self.graph[v] & alive), "mask key")
        groups = _components(self.graph, alive)
        if len(groups) > 1:  # each group's sum could be unmasked separately
            raise SecureAggregationError(
                f"secure aggregation: the survivors' graph is disconnected into "
                f"{', '.join(str(g) for g in groups)}; unmasking would reveal each group's sum, "
                f"so the round is abandoned (no update was revealed)"
            )
        return self.dropped, self.survivors

    def finish(self, responses: Mapping[int, Mapping[str, Mapping[int, bytes]]]) -> np.ndarray:
        """Round 3: the unmasked sum of the survivors' quantised reports (uint64 ring elements)."""
        self._require(len(responses), "answered the unmask round")
        total = np.zeros_like(next(iter(self.masked.values())))
        for u in self.survivors:
            np.add(total, self.masked[u], out=total)
        for seed in self._recover(responses, "b", self.survivors).values():
            np.subtract(total, _prg(seed, len(total)), out=total)
        alive = set(self.survivors)
        affected = [v for v in self.dropped if self.graph[v] & alive]
        for v, secret in self._recover(responses, "s", affected).items():
            s_key = X25519PrivateKey.from_private_bytes(secret)
            s_public = s_key.public_key().public_bytes_raw()
            if s_public != self.roster[v][1]:
                raise SecureAggregationError(
                    f"secure aggregation: the shares of client {v}'s mask key are inconsistent"
                )
            for u in sorted(self.graph[v] & alive):  # u added +mask if u < v, -mask if u > v
                mask = _prg(_agree(s_key, s_public, self.roster[u][1], _MASK), len(total))
                (np.subtract if u < v else np.add)(total, mask, out=total)
        return total

    def _recover(self, responses, kind: str, clients: list[int]) -> dict[int, bytes]:
        """The secrets of `clients` from the survivors' shares; one Lagrange interpolation per
        set of holders (in the complete graph, one for all)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for client in clients:
            holders = [u for u in sorted(responses) if client in responses[u][kind]]
            self._require_holders(client, len(holders), "seed" if kind == "b" else "mask key")
            groups.setdefault(tuple(holders[: self.threshold]), []).append(client)
        secrets = {}
        for holders, group in groups.items():
            try:  # a malformed share, or shares of no 32-byte secret: refused, never a crash
                parts = [responses[u][kind][c] for u in holders for c in group]
                if any(len(part) != _shamir.SHARE_BYTES for part in parts):
                    raise ValueError(f"a share is not {_shamir.SHARE_BYTES} bytes")
                shares = _shamir.share_from_bytes(b"".join(parts))  # one pass for the group
                shares = shares.reshape(len(holders), len(group), _shamir.CHUNKS)
                recovered = _shamir.combine([u + 1 for u in holders], shares, self.threshold)
            except ValueError as error:
                raise SecureAggregationError(f"secure aggregation: bad shares: {error}") from None
            secrets.update(zip(group, recovered))
        return secrets

    def _require(self, count: int, what: str) -> None:
        if count < self.threshold:
            raise SecureAggregationError(
                f"secure aggregation: only {count} of {len(self.participants)} clients {what}; "
                f"the threshold is {self.threshold}, so the dropped clients' masks cannot be "
                f"recovered and the round is abandoned (no update was revealed)"
            )

    def _require_holders(self, client: int, count: int, secret: str) -> None:
        if count < self.threshold:
            raise SecureAggregationError(
                f"secure aggregation: client {client}'s {secret} has only {count} surviving "
                f"holders of its shares (among itself and its {len(self.graph[client])} "
                f"neighbours), below the threshold {self.threshold}; the round is abandoned "
                f"(no update was revealed)"
            )


def _components(graph: Mapping[int, frozenset[int]], alive: set[int]) -> list[list[int]]:
    """The connected components of the graph restricted to `alive`, each sorted, by first id."""
    groups, seen = [], set()
    for start in sorted(alive):
        if start in seen:
            continue
        seen.add(start)
        group, frontier = [start], [start]
        while frontier:
            frontier = [v for u in frontier for v in graph[u] & alive if v not in seen]
            frontier = sorted(set(frontier))
            seen.update(frontier)
            group.extend(frontier)
        groups.append(sorted(group))
    return groups


@dataclass(frozen=True)
class SecureSum:
    """The result of `secure_sum`: the dequantised total and what the protocol sent."""

    total: torch.Tensor
    """Sum of the survivors' reports (float64), exact up to quantisation (module docstring)."""
    bytes_up: int
    """Bytes clients sent: keys, encrypted shares, masked inputs, unmask shares."""
    bytes_down: int
    """Bytes the server sent: the rosters, the share inboxes, the dropped / survivor lists."""


def secure_sum(
    reports: Mapping[int, torch.Tensor],
    *,
    participants: Collection[int],
    threshold: int | None = None,
    neighbours: int | None = None,
    frac_bits: int = FRAC_BITS,
) -> SecureSum:
    """Run one simulated round: `participants` set up keys, those in `reports` send masked inputs.

    Participants without a report drop out after the key exchange (the hard case: their pairwise
    masks are in their neighbours' inputs and must be recovered from the Shamir shares).
    `neighbours`: None for the complete graph, k for SecAgg+ (`SecAggConfig`).
    """
    missing = set(reports) - set(participants)
    if missing:
        raise ValueError(f"secure aggregation: reports from non-participants {sorted(missing)}")
    server = SecAggServer(participants, threshold, neighbours)
    clients = {u: SecAggClient(u) for u in server.participants}
    server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    rosters = {u: server.neighbourhood(u) for u in clients}
    outboxes = {u: c.share_keys(rosters[u], server.threshold) for u, c in clients.items()}
    inboxes = server.route_shares(outboxes)
    # Quantisation is elementwise, so every client's is done in one pass over the stacked
    # reports (the same ring elements each would compute alone, at one call's overhead).
    shapes = {tuple(report.shape) for report in reports.values()}
    if len(shapes) > 1:
        raise ValueError(f"secure aggregation: reports of different shapes {sorted(shapes)}")
    count = len(server.participants)  # bounds each report so that their sum cannot wrap
    stacked = torch.stack(list(reports.values())) if reports else None
    quantized = quantize(stacked, frac_bits, count) if reports else ()
    masked = {u: clients[u].masked_input(ring, inboxes[u]) for u, ring in zip(reports, quantized)}
    dropped, survivors = server.collect_masked(masked)
    responses = {u: clients[u].unmask(dropped, survivors) for u in survivors}
    total = server.finish(responses)
    ciphertext = sum(len(c) for box in outboxes.values() for c in box.values())
    shares = sum(len(r["s"]) + len(r["b"]) for r in responses.values()) * _shamir.SHARE_BYTES
    up = 64 * len(clients) + ciphertext + sum(m.nbytes for m in masked.values()) + shares
    down = 64 * sum(map(len, rosters.values())) + ciphertext + 8 * len(clients) * len(survivors)
    return SecureSum(dequantize(total, frac_bits), int(up), int(down))
