"""The deployed client: `connect` joins a server, polls for tasks, trains on local data and
sends its updates (plain rounds) or takes part in secure aggregation; only updates, keys,
encrypted shares and masked reports leave it. See `deployed` for the protocol and who gets in.

In a secure round a client drops out of that round (and waits for the next) rather than stop
when it cannot take part: its update is non-finite or too large for the secure sum, or a share
another client sent it through the server does not decrypt or is malformed (the server cannot
check ciphertexts, so this is where a bad one is found).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable

import grpc
import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from torch import nn

from tessera.federated import wire
from tessera.federated.aggregate import make_report
from tessera.federated.client import ClientSettings, client_update
from tessera.federated.secure_aggregation import SecAggClient, SecureAggregationError, quantize

__all__ = ["connect"]

log = logging.getLogger("tessera.federated.deployed")


_TASKS = ("train", "keys", "shares", "masked", "unmask")
"""The tasks a client answers; any other kind (but "done") means: wait and ask again."""


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

    `token` is this client's own token, `client_token(secret, client)`, from the operator.
    Only reports leave the client. Raises `ConnectionError` if no server answers in time,
    `PermissionError` if the server refuses the token, and `TimeoutError` if the server neither
    selects this client nor finishes for `idle_timeout_s` (no wait is unbounded).
    """
    model = model_fn()
    params = [p for p in model.parameters() if p.requires_grad]
    limit = wire.message_limit(sum(p.numel() for p in params))
    channel = _open_channel(address, limit, root_certificate, connect_timeout_s, client)
    call = channel.unary_unary(wire.METHOD)
    session = _Session(call, client, token, connect_timeout_s, model, params, data)
    try:
        session.send({"kind": "join"})
        idle_since = time.monotonic()
        while True:
            task, vector = session.send({"kind": "task"})
            if task["kind"] == "done":
                return session.trained
            waiting = task["kind"] not in _TASKS
            if waiting or task["round"] == session.skipped:
                if time.monotonic() - idle_since > idle_timeout_s:
                    raise TimeoutError(
                        f"federated client {client}: no task from {address} in {idle_timeout_s} s"
                    )
                time.sleep(poll_s)
                continue
            idle_since = time.monotonic()
            session.handle(task, vector)
    finally:
        channel.close()


def _loopback(address: str) -> bool:
    """Whether `address` ("host:port", IPv6 in brackets) names this machine's loopback."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _open_channel(
    address: str, limit: int, root_certificate: bytes | None, timeout_s: float, client: int
) -> grpc.Channel:
    """A channel to the server once it answers (TLS with `root_certificate`), messages up to
    `limit` bytes; `ConnectionError` if none answers within `timeout_s`."""
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    if _loopback(address):  # an http_proxy in the environment cannot reach this machine's own
        options.append(("grpc.enable_http_proxy", 0))  # loopback: gRPC would go through it
    if root_certificate is not None:
        credentials = grpc.ssl_channel_credentials(root_certificate)
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(
            f"federated client {client}: no server at {address} within {timeout_s} s"
        ) from None
    return channel


class _Session:
    """One client's side of a deployed run: its messages to the server and its answer to each
    task (local training, or its part in a secure-aggregation round)."""

    def __init__(
        self,
        call: Callable,
        client: int,
        token: str,
        timeout_s: float,
        model: nn.Module,
        params: list[torch.Tensor],
        data: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        self.call, self.client, self.token, self.timeout_s = call, client, token, timeout_s
        self.model, self.params = model, params
        self.inputs, self.labels = data
        self.trained = 0
        """Rounds this client trained in."""
        self.secure: dict = {}
        """This round's secure-aggregation state: the `SecAggClient`, the quantised report."""
        self.skipped = None
        """A secure round this client dropped out of: its remaining tasks are ignored."""

    def send(self, header: dict, payload=None) -> tuple[dict, np.ndarray | None]:
        """Send one message (with this client's id and token); the server's reply."""
        client = self.client
        try:
            reply = self.call(wire.encode({**header, "token": self.token, "client": client},
                              payload), timeout=self.timeout_s)  # fmt: skip
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PermissionError(f"federated client {client}: {error.details()}") from None
            raise ConnectionError(f"federated client {client}: {error.details()}") from None
        return wire.decode(reply)

    def handle(self, task: dict, vector: np.ndarray | None) -> None:
        """Do one task of `_TASKS` and send its answer."""
        answer = {"kind": task["kind"], "round": task["round"]}
        if task["kind"] in ("train", "shares"):
            global_vector = torch.from_numpy(vector.copy()).to(self.params[0].dtype)
            # the same work as `simulate`'s clients (under DP: clipped, weight 1)
            update, weight = client_update(
                self.model, global_vector, self.inputs, self.labels,
                ClientSettings.from_header(task), round_index=task["round"], client=self.client,
            )  # fmt: skip
            self.trained += 1
        if task["kind"] == "train":
            dtype = wire.WIRE_DTYPES[task["dtype"]]
            payload = update.detach().numpy().astype(dtype, copy=False)
            self.send({**answer, "kind": "report", "weight": weight}, payload)
        elif task["kind"] == "keys":
            self.secure = {"client": SecAggClient(self.client)}
            c_public, s_public = self.secure["client"].advertise_keys()
            self.send({**answer, "c": c_public.hex(), "s": s_public.hex()})
        elif task["kind"] == "shares":
            self._share_keys(answer, task, update, weight)
        elif task["kind"] == "masked":
            self._masked_input(answer, task)
        else:
            shares = self.secure["client"].unmask(task["dropped"], task["survivors"])
            self.send({**answer, **{k: {str(u): v.hex() for u, v in shares[k].items()}
                                    for k in ("s", "b")}})  # fmt: skip

    def _share_keys(self, answer: dict, task: dict, update: torch.Tensor, weight: float) -> None:
        """Quantise this round's report (or drop out of the round), then send the shares."""
        roster = {int(u): (bytes.fromhex(c), bytes.fromhex(s))
                  for u, (c, s) in task["roster"].items()}  # fmt: skip
        try:  # bounded so that the sum of `count` reports fits the ring
            self.secure["report"] = quantize(make_report(update, weight), count=task["count"])
        except SecureAggregationError as error:  # non-finite or too large: drop out
            log.warning("federated client %s: not reporting: %s", self.client, error)
            self.skipped = task["round"]
            return
        outbox = self.secure["client"].share_keys(roster, task["threshold"])
        self.send({**answer, "outbox": {str(v): c.hex() for v, c in outbox.items()}})

    def _masked_input(self, answer: dict, task: dict) -> None:
        """Send the masked report, or drop out of the round if a share sent here is unusable."""
        inbox = {int(u): bytes.fromhex(c) for u, c in task["inbox"].items()}
        try:  # the server cannot check encrypted shares: a bad one is found here
            masked = self.secure["client"].masked_input(
                self.secure["report"], inbox, task["partners"]
            )
        except (InvalidTag, SecureAggregationError, KeyError, ValueError) as error:
            log.warning("federated client %s: dropping out of round %s: a share it was "
                        "sent is unusable (%r)", self.client, task["round"], error)  # fmt: skip
            self.skipped = task["round"]
            return
        self.send(answer, masked)
