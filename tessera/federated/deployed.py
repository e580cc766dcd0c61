"""Deployed federated learning over gRPC: a server process and client processes (or machines).

The server owns the global model and no data; clients own data and no one else's model updates.
Clients pull: `join`, then poll `task` until they are selected for a round (they get the global
weights and the training settings), train with the same `client.local_update` as simulation and
send a `report`; the server aggregates with the same `aggregate` code. A round starts once
`clients_per_round` clients have joined (waiting at most `join_timeout_s`), draws them with a
`seed`-ed generator, and closes when all selected clients reported or `round_timeout_s` passed;
with fewer than `quorum` usable reports the round is skipped and the model kept. Clients may join
between rounds and leave at any time. Every call carries the shared `token` (compared in constant
time); TLS is used when a certificate and key are given. One generic unary gRPC method carries
`wire` messages (no generated stubs). Not yet: secure aggregation and DP over the network.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from tessera.federated import wire
from tessera.federated.aggregate import (
    ALGORITHMS,
    make_report,
    server_step,
    sum_of_reports,
    sum_to_mean,
    update_problem,
)
from tessera.federated.client import client_generator, load_vector, local_update

__all__ = ["FederatedServer", "ServerConfig", "connect", "serve"]

log = logging.getLogger(__name__)
METHOD = "/tessera.federated.Federated/Call"


@dataclass(kw_only=True, frozen=True)
class ServerConfig:
    """A deployed run: the FedAvg settings of `simulate` plus the network's."""

    token: str
    """Shared secret every client must present."""
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

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("ServerConfig: a non-empty token is required")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"ServerConfig: unknown algorithm {self.algorithm!r}")
        if not 1 <= self.quorum <= self.clients_per_round:
            raise ValueError(f"ServerConfig: quorum {self.quorum} not in 1..clients_per_round")


@dataclass
class ServerHistory:
    """What a deployed run produced (the server has no test data: no accuracy)."""

    state_dict: dict = field(default_factory=dict)
    round_s: list[float] = field(default_factory=list)
    reported: list[list[int]] = field(default_factory=list)
    bytes_up: list[int] = field(default_factory=list)
    bytes_down: list[int] = field(default_factory=list)


class FederatedServer:
    """The server's state and its one gRPC method; `run()` drives the rounds."""

    def __init__(self, model_fn: Callable[[], nn.Module], config: ServerConfig) -> None:
        self.config = config
        self.model = model_fn()
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.vector = parameters_to_vector(self._params).detach().clone()
        self._lock = threading.Condition()
        self._joined: set[int] = set()
        self._round = 0
        self._selected: set[int] = set()
        self._reports: dict[int, torch.Tensor] = {}
        self._done = False
        self._bytes = [0, 0]
        self.refused: list[str] = []  # why messages were refused (for logs and tests)
        self.history = ServerHistory()

    def handle(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Answer one client message (never raises into gRPC: bad messages are refused)."""
        try:
            header, payload = wire.decode(request)
            kind = wire.check_client_message(header, payload, self.vector.numel() + 1)
        except wire.WireError as error:
            self.refused.append(str(error))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"refused: {error}")
        if not hmac.compare_digest(str(header.get("token", "")), self.config.token):
            self.refused.append("wrong token")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong token")
        client = header["client"]
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
        if kind == "task":
            if client not in self._selected or client in self._reports:
                return wire.encode({"kind": "wait"})
            c = self.config
            settings = dict(algorithm=c.algorithm, epochs=c.local_epochs, lr=c.lr, mu=c.mu,
                            batch_size=c.batch_size, seed=c.seed)  # fmt: skip
            return wire.encode({"kind": "train", "round": self._round, **settings}, self.vector)
        if header["round"] != self._round or client not in self._selected:
            return wire.encode({"kind": "late"})
        self._reports[client] = torch.from_numpy(payload.copy())
        return wire.encode({"kind": "received"})

    def run(self) -> ServerHistory:
        """Run every round; returns the history (the final model in `state_dict`)."""
        c = self.config
        rng = np.random.default_rng(c.seed)
        for round_index in range(1, c.rounds + 1):
            with self._lock:
                if not self._lock.wait_for(
                    lambda: len(self._joined) >= c.clients_per_round, timeout=c.join_timeout_s
                ):
                    self._done = True
                    raise TimeoutError(
                        f"federated server: only {len(self._joined)} clients joined in "
                        f"{c.join_timeout_s} s, round {round_index} needs {c.clients_per_round}"
                    )
                start = time.perf_counter()
                pool = sorted(self._joined)
                chosen = rng.choice(len(pool), c.clients_per_round, replace=False)
                self._round, self._reports, self._bytes = round_index, {}, [0, 0]
                self._selected = {pool[i] for i in chosen}
                self._lock.wait_for(
                    lambda: set(self._reports) >= self._selected, timeout=c.round_timeout_s
                )
                reports = dict(self._reports)
                self._selected = set()
                bytes_up, bytes_down = self._bytes
            numel = self.vector.numel()
            total = sum_of_reports(sorted(reports.items()), numel)  # logs and skips bad ones
            usable = [u for u, r in reports.items() if update_problem(r, numel + 1) is None]
            if len(usable) < c.quorum:
                log.warning("federated server: round %d skipped, %d of quorum %d reports",
                            round_index, len(usable), c.quorum)  # fmt: skip
            else:
                mean = sum_to_mean(total)
                self.vector = server_step(self.vector, mean, algorithm=c.algorithm, lr=c.lr)
            self.history.round_s.append(time.perf_counter() - start)
            self.history.reported.append(sorted(reports))
            self.history.bytes_up.append(bytes_up)
            self.history.bytes_down.append(bytes_down)
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
    """Start the gRPC server (TLS if `certificate` and `private_key`); returns it and its port.

    Call `server.run()` to drive the rounds and `grpc_server.stop(grace)` afterwards.
    """
    server = FederatedServer(model_fn, config)
    handler = grpc.method_handlers_generic_handler(
        "tessera.federated.Federated", {"Call": grpc.unary_unary_rpc_method_handler(server.handle)}
    )
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    grpc_server.add_generic_rpc_handlers((handler,))
    if certificate is not None and private_key is not None:
        port = grpc_server.add_secure_port(
            address, grpc.ssl_server_credentials([(private_key, certificate)])
        )
    else:
        port = grpc_server.add_insecure_port(address)
    grpc_server.start()
    return server, grpc_server, port


def connect(
    address: str,
    model_fn: Callable[[], nn.Module],
    data: tuple[torch.Tensor, torch.Tensor],
    *,
    client: int,
    token: str,
    root_certificate: bytes | None = None,
    connect_timeout_s: float = 30.0,
    idle_timeout_s: float = 900.0,
    poll_s: float = 0.02,
) -> int:
    """Take part in a deployed run as client `client` with `data`; returns the rounds trained.

    Only reports leave the client. Raises `ConnectionError` if no server answers in time,
    `PermissionError` if the server refuses the token, and `TimeoutError` if the server neither
    selects this client nor finishes for `idle_timeout_s` (no wait is unbounded).
    """
    if root_certificate is not None:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificate))
    else:
        channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(
            f"federated client {client}: no server at {address} within {connect_timeout_s} s"
        ) from None
    call = channel.unary_unary(METHOD)
    inputs, labels = data
    model, trained = model_fn(), 0
    params = [p for p in model.parameters() if p.requires_grad]

    def send(header: dict, payload=None) -> dict:
        try:
            reply = call(wire.encode({**header, "token": token, "client": client}, payload),
                         timeout=connect_timeout_s)  # fmt: skip
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PermissionError(f"federated client {client}: {error.details()}") from None
            raise ConnectionError(f"federated client {client}: {error.details()}") from None
        return wire.decode(reply)

    try:
        send({"kind": "join"})
        idle_since = time.monotonic()
        while True:
            task, vector = send({"kind": "task"})
            if task["kind"] == "done":
                return trained
            if task["kind"] != "train":
                if time.monotonic() - idle_since > idle_timeout_s:
                    raise TimeoutError(
                        f"federated client {client}: no task from {address} in {idle_timeout_s} s"
                    )
                time.sleep(poll_s)
                continue
            global_vector = torch.from_numpy(vector.copy()).to(params[0].dtype)
            update = local_update(
                model, global_vector, inputs, labels, algorithm=task["algorithm"],
                epochs=task["epochs"], batch_size=task["batch_size"], lr=task["lr"],
                mu=task["mu"], generator=client_generator(task["seed"], task["round"], client),
            )  # fmt: skip
            report = make_report(update, float(len(labels))).numpy()
            send({"kind": "report", "round": task["round"]}, report)
            trained += 1
            idle_since = time.monotonic()
    finally:
        channel.close()
