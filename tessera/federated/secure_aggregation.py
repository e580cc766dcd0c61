"""Secure aggregation (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", the semi-honest protocol of Fig. 4), optionally over a sparse graph (SecAgg+,
Bell et al. 2020): the server learns the sum, not the terms.

Every client u quantises its report x_u to fixed point in the ring Z_{2^64} (numpy uint64, whose
addition wraps exactly mod 2^64) and sends

    y_u = x_u + PRG(b_u) + sum_{v in N(u), v > u} PRG(s_uv) - sum_{v in N(u), v < u} PRG(s_uv)

where N(u) are u's neighbours (every other client by default; see `_graph`), s_uv = s_vu is the
hash of the X25519 agreement of u's and v's mask keys (`_keys.agree`) and b_u a private seed.
The pairwise masks cancel in the sum over all clients. PRG(seed) is AES-256-CTR's keystream
(`_prg`). Rounds:

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
once per process (`_keys.public_key`), and a round's seeds are recovered with one set of Lagrange
weights per set of holders.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from tessera.federated import _shamir
from tessera.federated._ring import FRAC_BITS, SecureAggregationError, dequantize, quantize
from tessera.federated._secagg_protocol import (
    MAX_CLIENT_ID,
    SecAggClient,
    SecAggServer,
    check_client_id,  # noqa: F401 - re-exported: the deployed server checks ids with it
)

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
