"""The two parties of a secure-aggregation round: `SecAggClient` and `SecAggServer`.

The protocol (its four rounds, its security and its cost) is described in
`tessera.federated.secure_aggregation`, which re-exports both classes; here are its parties'
messages: the client's keys, encrypted shares, masked input and unmask shares, and the
server's routing, checks and unmasking.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tessera.federated import _shamir
from tessera.federated._graph import components, degree, harary_graph
from tessera.federated._keys import MASK, SHARES, agree
from tessera.federated._prg import prg
from tessera.federated._ring import SecureAggregationError

__all__ = ["MAX_CLIENT_ID", "SecAggClient", "SecAggServer", "check_client_id"]

MAX_CLIENT_ID = _shamir.PRIME - 1
"""Client ids are 0 .. MAX_CLIENT_ID - 1 (= 2^26 - 7): id u holds the Shamir share at u + 1,
which must be a non-zero element of the field."""
_ROUTING = struct.Struct(">qq")
_RECORD_BYTES = _ROUTING.size + 2 * _shamir.SHARE_BYTES  # sender, recipient, s_sk and b shares


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
            key = agree(self._c_key, self._c_public, self._roster[v][0], SHARES)
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
        """Round 2: store the shares sent to this client, return y_u (see `secure_aggregation`).

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
        masked = np.add(report, prg(self._seed, len(report)))  # a new array: report untouched
        for v, (_, s_public) in self._roster.items():
            if v == self.client_id or (partners is not None and v not in partners):
                continue
            mask = prg(agree(self._s_key, self._s_public, s_public, MASK), len(masked))
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
        groups = components(self.graph, alive)
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
            np.subtract(total, prg(seed, len(total)), out=total)
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
                mask = prg(agree(s_key, s_public, self.roster[u][1], MASK), len(total))
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
