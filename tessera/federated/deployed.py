"""Deployed federated learning over gRPC: a server process and client processes (or machines).

The server owns the global model and no data; clients own data and no one else's model updates.
Clients pull: `join`, then poll `task` until they are selected for a round (they get the global
weights and the training settings), train with the same `client.local_update` as simulation and
send a `report`. The server's half of a round (selection, the checks of each report, the sum,
privacy, the step, the order of the random draws) is `round.FederatedRound`, the same object
`simulate` drives: `FederatedServer` is only its transport. A round starts once
`clients_per_round` clients have joined (waiting at most `join_timeout_s`), draws them with a
`seed`-ed generator, and closes when all selected clients reported or `round_timeout_s` passed;
with fewer than `quorum` usable reports the round is skipped and the model kept. Clients may join
between rounds and leave at any time.

Who gets in: the server's `token` is a secret only the operator holds; client k presents its own
token `client_token(token, k)` (an HMAC of its id under the secret, which the operator hands to
client k, e.g. with `tessera fl token --client k`), compared as bytes in constant time. A token
speaks for its own id only: a client cannot join, poll or report as another. A message without a
valid token is refused before the server acts on it (only its JSON header has been parsed and
checked; gRPC bounds its size); the server counts refusals, keeps only the last `REFUSED_KEPT`
reasons and logs at most once per `REFUSE_LOG_EVERY_S` seconds, so peers without a token cannot
grow its memory or its log. TLS is used when a certificate and a key are given (one without the
other is refused).

What a client can do to the model: the server refuses a report whose weight (the client's claimed
sample count) is negative, non-finite or above `max_weight`; with `dp`, every weight must be 1 and
the server clips each update to `dp.clip` itself, so no client moves the sum by more than the
clip, whatever it sends. With secure aggregation the server sees only masked vectors: it cannot
check one client's weight or norm (that would take zero-knowledge range proofs, which this
implementation does not have); it checks the unmasked sum's total weight (at most `max_weight`
per survivor, exactly one per survivor with `dp`) and abandons the round otherwise, but the clip
of each update rests on the clients. Vectors travel as float32 (`wire_dtype`), in one message
whose size limit both ends set from the model's size (`wire.message_limit`).

One generic unary gRPC method carries `wire` messages (no generated stubs); the client side is
`deployed_client.connect`. With `secure_aggregation`, a round runs Bonawitz et al.'s four phases
(`_secure_round`) with the same `SecAggClient` / `SecAggServer` as simulation (over the complete
graph, or SecAgg+'s k-regular one with `SecAggConfig(neighbours=k)`: then a client is sent only
its neighbours' keys and shares); a client that stops after sharing its keys is a dropout whose
masks the others' shares remove, and a client whose `keys`, `shares` or `unmask` message is
malformed is dropped from the round, which goes on without it. A client whose own update is non-
finite or too large for the secure sum's range, or that was sent a share it cannot decrypt, drops
out of that round and waits for the next (`deployed_client`). With `dp`, clients clip and the
server adds the noise (from the OS's CSPRNG; `privacy`), divides by `clients_per_round` and keeps
the accountant, as in `simulate`: a run over clients 0..n-1 equals the simulated one when
`dp.insecure_noise_seed` fixes the noise (tests only).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from tessera.federated import wire
from tessera.federated._secure_round import ServerSide, secure_round
from tessera.federated.aggregate import ALGORITHMS
from tessera.federated.client import ClientSettings, load_vector
from tessera.federated.deployed_client import connect
from tessera.federated.privacy import DPConfig
from tessera.federated.round import FederatedRound, RoundConfig, RoundTask
from tessera.federated.secure_aggregation import (
    SecAggConfig,
    SecureAggregationError,
    as_config,
    check_client_id,
)

__all__ = ["FederatedServer", "ServerConfig", "client_token", "connect", "serve"]

log = logging.getLogger(__name__)
METHOD = wire.METHOD
REFUSED_KEPT = 64
"""How many refusal reasons `FederatedServer.refused` keeps (the newest; all are counted)."""
REFUSE_LOG_EVERY_S = 10.0
"""Refusals are logged at most once per this many seconds (with the count since the last log)."""
WIRE_DTYPES = wire.WIRE_DTYPES


def client_token(secret: str, client: int) -> str:
    """Client `client`'s token under the server's `secret`: HMAC-SHA256 of the id, in hex. The
    operator computes it and gives it to that client only; it proves that id and no other."""
    key = secret.encode("utf-8")
    return hmac.new(key, f"tessera-fl-client:{int(client)}".encode(), hashlib.sha256).hexdigest()


@dataclass(kw_only=True, frozen=True)
class ServerConfig:
    """A deployed run: the FedAvg settings of `simulate` plus the network's."""

    token: str
    """The server's secret (any non-empty string): client k presents `client_token(token, k)`,
    never the secret itself."""
    rounds: int = 10
    clients_per_round: int = 10
    """Clients drawn each round; a round waits until that many have joined."""
    quorum: int = 1
    """Fewest usable reports that make a round count."""
    local_epochs: int = 1
    batch_size: int | None = 10
    lr: float = 0.1
    algorithm: str = "fedavg"
    mu: float = 0.0
    seed: int = 0
    round_timeout_s: float = 60.0
    """Deadline for the selected clients' reports."""
    join_timeout_s: float = 300.0
    """How long a round waits for enough clients to join before the run stops."""
    secure_aggregation: bool | SecAggConfig = False
    """Sum the reports with secure aggregation (the server sees masked vectors only): True for
    the complete graph, `SecAggConfig(neighbours=k)` for SecAgg+ (as in `simulate`)."""
    threshold: int | None = None
    """Secure aggregation's Shamir threshold (default: a majority of each client's share
    holders, the selected clients in the complete graph); may instead be set in SecAggConfig."""
    dp: DPConfig | None = None
    """Client-level DP as in `simulate`: clients clip (and the server clips plain reports again),
    the server noises the sum and divides it by `clients_per_round`."""
    max_weight: float | None = None
    """The largest weight (sample count) a client may claim; larger reports are refused. None:
    no bound beyond finite and >= 0 (a client can then outweigh all others: set it when clients
    are not trusted). With `dp` every weight must be 1 anyway."""
    wire_dtype: str = "float32"
    """How vectors travel (global weights, updates): "float32" (half the bytes; exact for float32
    models) or "float64" (for float64 models). Masked reports are uint64 either way."""

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("ServerConfig: a non-empty token (the server's secret) is required")
        if self.max_weight is not None and not (
            0 < self.max_weight < math.inf and not isinstance(self.max_weight, bool)
        ):  # fmt: skip
            raise ValueError(f"ServerConfig: max_weight={self.max_weight} must be > 0 and finite")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"ServerConfig: wire_dtype {self.wire_dtype!r} not in {list(WIRE_DTYPES)}"
            )
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"ServerConfig: unknown algorithm {self.algorithm!r}")
        if self.dp is not None and not isinstance(self.dp, DPConfig):
            raise TypeError(f"ServerConfig: dp must be a DPConfig, got {type(self.dp).__name__}")
        if not 1 <= self.quorum <= self.clients_per_round:
            raise ValueError(f"ServerConfig: quorum {self.quorum} not in 1..clients_per_round")
        as_config(self.secure_aggregation, self.threshold)  # raises on a contradiction

    @property
    def secagg(self) -> SecAggConfig | None:
        """The secure-aggregation settings, threshold included (None: plain sums)."""
        return as_config(self.secure_aggregation, self.threshold)

    @property
    def round_config(self) -> RoundConfig:
        """The settings `round.FederatedRound` runs every round with (no simulated dropouts)."""
        client = ClientSettings(algorithm=self.algorithm, epochs=self.local_epochs,
                                batch_size=self.batch_size, lr=self.lr, mu=self.mu,
                                seed=self.seed, clip=self.dp and self.dp.clip)  # fmt: skip
        return RoundConfig(clients_per_round=self.clients_per_round, client=client, dp=self.dp,
                           secagg=self.secagg, quorum=self.quorum,
                           max_weight=self.max_weight)  # fmt: skip


@dataclass
class ServerHistory:
    """What a deployed run produced (the server has no test data: no accuracy)."""

    state_dict: dict = field(default_factory=dict)
    """The final global model's state dict."""
    round_s: list[float] = field(default_factory=list)
    """Wall time of each round, from the draw to the step."""
    reported: list[list[int]] = field(default_factory=list)
    """Each round, the clients whose reports counted (usable, in time; survivors if secure)."""
    bytes_up: list[int] = field(default_factory=list)
    """Bytes of client messages each round (polls included)."""
    bytes_down: list[int] = field(default_factory=list)
    """Bytes of server replies each round."""
    epsilon: list[float] = field(default_factory=list)
    """With `dp`: privacy spent after each round (epsilon at the config's delta)."""


class FederatedServer:
    """The server's state and its one gRPC method; `run()` drives the rounds.

    A round is a sequence of phases; in each, the server tells the expected clients what to do
    (`task`) and collects one submission of the phase's kind from each, until all arrived or the
    deadline passed. Plain rounds have one phase (`train` -> `report`); secure rounds four
    (`keys`, `shares`, `masked`, `unmask`: `_secure_round`).
    """

    def __init__(self, model_fn: Callable[[], nn.Module], config: ServerConfig) -> None:
        self.config = config
        self.model = model_fn()
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        vector = parameters_to_vector(self._params).detach().clone()
        self._rounds = FederatedRound(config.round_config, vector)
        self._lock = threading.Condition()
        self._joined: set[int] = set()
        self._round = 0
        self._phase: str | None = None  # the submission kind being collected
        self._expected: set[int] = set()
        self._task: Callable[[int], bytes] | None = None
        self._collected: dict[int, tuple[dict, np.ndarray | None]] = {}
        self._done = False
        self._bytes = [0, 0]
        self._wire_dtype = WIRE_DTYPES[config.wire_dtype]
        # Refusals: counted, the newest reasons kept, logged at most every REFUSE_LOG_EVERY_S.
        self.refused: collections.deque[str] = collections.deque(maxlen=REFUSED_KEPT)
        self.refused_count = 0
        self._refused_lock = threading.Lock()
        self._refused_logged = (-math.inf, 0)  # (when, refused_count then)
        self.history = ServerHistory()

    def _refuse(self, context: grpc.ServicerContext, code, reason: str) -> None:
        """Record a refusal (bounded memory, rate-limited log) and abort the call with `code`."""
        with self._refused_lock:
            self.refused.append(reason)
            self.refused_count += 1
            now, (last, count_then) = time.monotonic(), self._refused_logged
            if now - last >= REFUSE_LOG_EVERY_S:
                self._refused_logged = (now, self.refused_count)
                log.warning("federated server: refused %d message(s) since the last report, "
                            "the latest: %s", self.refused_count - count_then, reason)  # fmt: skip
        context.abort(code, f"refused: {reason}")

    def handle(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Answer one client message (bad messages are refused with a gRPC error status)."""
        try:
            header, payload = wire.decode(request)
            kind = wire.check_client_message(header, payload, self.vector.numel() + 1)
        except wire.WireError as error:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        client, token = header["client"], header.get("token")
        expected = client_token(self.config.token, client).encode()
        presented = token.encode("utf-8", "surrogatepass") if isinstance(token, str) else b""
        if not hmac.compare_digest(presented, expected):  # bytes: any token, constant time
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, f"client {client}: wrong token")
        if self.config.secagg is not None:
            try:
                check_client_id(client)
            except ValueError as error:
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        with self._lock:
            self._bytes[0] += len(request)
            reply = self._answer(kind, client, header, payload)
            self._bytes[1] += len(reply)
            self._lock.notify_all()
        return reply

    def _answer(self, kind, client, header, payload) -> bytes:
        if kind == "join":
            self._joined.add(client)
            return wire.encode({"kind": "joined"})
        if self._done:
            return wire.encode({"kind": "done"})
        waiting = client not in self._expected or client in self._collected
        if kind == "task":
            return wire.encode({"kind": "wait"}) if waiting else self._task(client)
        if waiting or kind != self._phase or header.get("round") != self._round:
            return wire.encode({"kind": "late"})
        self._collected[client] = (header, None if payload is None else payload.copy())
        return wire.encode({"kind": "received"})

    @property
    def vector(self) -> torch.Tensor:
        """The global parameters (flat), as the round last left them."""
        return self._rounds.vector

    def _settings(self) -> dict:
        """The task header's training settings: the round, the clients' settings, the dtype."""
        settings = self.config.round_config.client.header()
        return dict(round=self._round, **settings, dtype=self.config.wire_dtype)

    def _global_payload(self) -> np.ndarray:
        """The global weights as they travel (`wire_dtype`)."""
        return self.vector.numpy().astype(self._wire_dtype, copy=False)

    def _collect(self, phase: str, expected: set[int], task: Callable[[int], bytes]) -> dict:
        """Ask `expected` clients for a `phase` submission; what arrived before the deadline."""
        with self._lock:
            self._phase, self._expected, self._task, self._collected = phase, expected, task, {}
            self._lock.notify_all()
            self._lock.wait_for(
                lambda: set(self._collected) >= self._expected, timeout=self.config.round_timeout_s
            )
            collected, self._expected, self._phase = dict(self._collected), set(), None
        return collected

    # The transport of `round.FederatedRound`: the round decides, these methods carry.

    def pool(self, round_index: int) -> list[int]:
        """The joined clients, sorted, once `clients_per_round` have joined (else TimeoutError
        after `join_timeout_s`, and the run ends); the round's traffic counts from here."""
        c = self.config
        with self._lock:
            if not self._lock.wait_for(
                lambda: len(self._joined) >= c.clients_per_round, timeout=c.join_timeout_s
            ):
                self._done = True
                raise TimeoutError(
                    f"federated server: only {len(self._joined)} clients joined in "
                    f"{c.join_timeout_s} s, round {round_index} needs {c.clients_per_round}"
                )
            self._round, self._bytes = round_index, [0, 0]
            return sorted(self._joined)

    def train(self, task: RoundTask) -> Iterator[tuple[int, torch.Tensor, float]]:
        """A plain round: send the selected clients the weights and settings, then yield the
        reports that arrived in time, in client order, each freed once the round has summed it."""
        train = wire.encode({"kind": "train", **self._settings()}, self._global_payload())
        collected = self._collect("report", set(task.selected), lambda _: train)
        for client in sorted(collected):
            header, payload = collected.pop(client)
            yield client, torch.from_numpy(payload), float(header["weight"])

    def secure_sum(self, task: RoundTask) -> tuple[torch.Tensor, list[int]] | None:
        """A secure round (`_secure_round`); None if it was abandoned (too few survivors, a
        disconnected graph, a bad message: logged, and `run()` goes on)."""
        try:
            side = ServerSide(self._round, self.config.secagg, self._collect, self._settings,
                              self._global_payload)  # fmt: skip
            return secure_round(side, set(task.selected))
        except SecureAggregationError as error:
            log.warning("federated server: round %d abandoned: %s", task.round_index, error)
            return None

    def traffic(self) -> tuple[int, int]:
        """Bytes of client messages (polls included) and of replies since the round began."""
        with self._lock:
            return self._bytes[0], self._bytes[1]

    def run(self) -> ServerHistory:
        """Run every round; returns the history (the final model in `state_dict`)."""
        for round_index in range(1, self.config.rounds + 1):
            result = self._rounds.run(round_index, self)
            self.history.round_s.append(result.seconds)
            self.history.reported.append(result.reported)
            self.history.bytes_up.append(result.bytes_up)
            self.history.bytes_down.append(result.bytes_down)
            if result.epsilon is not None:
                self.history.epsilon.append(result.epsilon)
        with self._lock:
            self._done = True
        load_vector(self._params, self.vector)
        self.history.state_dict = {k: v.clone() for k, v in self.model.state_dict().items()}
        return self.history


def serve(
    model_fn: Callable[[], nn.Module],
    config: ServerConfig,
    *,
    address: str = "127.0.0.1:0",
    certificate: bytes | None = None,
    private_key: bytes | None = None,
) -> tuple[FederatedServer, grpc.Server, int]:
    """Start the gRPC server (TLS if `certificate` and `private_key`: both or neither, else
    ValueError); returns it and its port. Its message limit follows the model's size.

    Call `server.run()` to drive the rounds and `grpc_server.stop(grace)` afterwards.
    """
    if (certificate is None) != (private_key is None):
        raise ValueError(
            "federated server: TLS needs both a certificate and a private key (got only the "
            f"{'certificate' if private_key is None else 'private key'}); refusing to serve "
            "without TLS"
        )
    server = FederatedServer(model_fn, config)
    limit = wire.message_limit(server.vector.numel())
    handler = grpc.method_handlers_generic_handler(
        "tessera.federated.Federated", {"Call": grpc.unary_unary_rpc_method_handler(server.handle)}
    )
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_receive_message_length", limit),
                 ("grpc.max_send_message_length", limit)],
    )  # fmt: skip
    grpc_server.add_generic_rpc_handlers((handler,))
    if certificate is not None and private_key is not None:
        port = grpc_server.add_secure_port(
            address, grpc.ssl_server_credentials([(private_key, certificate)])
        )
    else:
        port = grpc_server.add_insecure_port(address)
    grpc_server.start()
    return server, grpc_server, port
