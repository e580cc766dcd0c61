"""The deployed client: `connect` joins a server, polls for tasks, trains on local data and
sends its updates (plain rounds) or takes part in secure aggregation; only updates, keys,
encrypted shares and masked reports leave it. See `deployed` for the protocol and who gets in.

In a secure round a client drops out of that round (and waits for the next) rather than stop
when it cannot take part: its update is non-finite or too large for the secure sum, or a share
another client sent it through the server does not decrypt or is malformed (the server cannot
check ciphertexts, so this is where a bad one is found).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import torch
from cryptography.exceptions import InvalidTag
from torch import nn

from tessera.federated import wire
from tessera.federated.aggregate import make_report
from tessera.federated.client import ClientSettings, client_update
from tessera.federated.secure_aggregation import SecAggClient, SecureAggregationError, quantize

__all__ = ["connect"]

log = logging.getLogger("tessera.federated.deployed")


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
    model, trained = model_fn(), 0
    params = [p for p in model.parameters() if p.requires_grad]
    limit = wire.message_limit(sum(p.numel() for p in params))
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    if root_certificate is not None:
        credentials = grpc.ssl_channel_credentials(root_certificate)
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    try:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(
            f"federated client {client}: no server at {address} within {connect_timeout_s} s"
        ) from None
    call = channel.unary_unary(wire.METHOD)
    inputs, labels = data

    def send(header: dict, payload=None) -> dict:
        try:
            reply = call(wire.encode({**header, "token": token, "client": client}, payload),
                         timeout=connect_timeout_s)  # fmt: skip
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PermissionError(f"federated client {client}: {error.details()}") from None
            raise ConnectionError(f"federated client {client}: {error.details()}") from None
        return wire.decode(reply)

    secure: dict = {}  # this round's secure-aggregation state: the SecAggClient, the report
    skipped = None  # a secure round this client dropped out of: its remaining tasks are ignored
    try:
        send({"kind": "join"})
        idle_since = time.monotonic()
        while True:
            task, vector = send({"kind": "task"})
            if task["kind"] == "done":
                return trained
            waiting = task["kind"] not in ("train", "keys", "shares", "masked", "unmask")
            if waiting or task["round"] == skipped:
                if time.monotonic() - idle_since > idle_timeout_s:
                    raise TimeoutError(
                        f"federated client {client}: no task from {address} in {idle_timeout_s} s"
                    )
                time.sleep(poll_s)
                continue
            idle_since = time.monotonic()
            answer = {"kind": task["kind"], "round": task["round"]}
            if task["kind"] in ("train", "shares"):
                global_vector = torch.from_numpy(vector.copy()).to(params[0].dtype)
                # the same work as `simulate`'s clients (under DP: clipped, weight 1)
                update, weight = client_update(
                    model, global_vector, inputs, labels, ClientSettings.from_header(task),
                    round_index=task["round"], client=client,
                )  # fmt: skip
                trained += 1
            if task["kind"] == "train":
                dtype = wire.WIRE_DTYPES[task["dtype"]]
                payload = update.detach().numpy().astype(dtype, copy=False)
                send({**answer, "kind": "report", "weight": weight}, payload)
            elif task["kind"] == "keys":
                secure = {"client": SecAggClient(client)}
                c_public, s_public = secure["client"].advertise_keys()
                send({**answer, "c": c_public.hex(), "s": s_public.hex()})
            elif task["kind"] == "shares":
                roster = {int(u): (bytes.fromhex(c), bytes.fromhex(s))
                          for u, (c, s) in task["roster"].items()}  # fmt: skip
                try:  # bounded so that the sum of `count` reports fits the ring
                    secure["report"] = quantize(make_report(update, weight), count=task["count"])
                except SecureAggregationError as error:  # non-finite or too large: drop out
                    log.warning("federated client %s: not reporting: %s", client, error)
                    skipped = task["round"]
                    continue
                outbox = secure["client"].share_keys(roster, task["threshold"])
                send({**answer, "outbox": {str(v): c.hex() for v, c in outbox.items()}})
            elif task["kind"] == "masked":
                inbox = {int(u): bytes.fromhex(c) for u, c in task["inbox"].items()}
                try:  # the server cannot check encrypted shares: a bad one is found here
                    masked = secure["client"].masked_input(
                        secure["report"], inbox, task["partners"]
                    )
                except (InvalidTag, SecureAggregationError, KeyError, ValueError) as error:
                    log.warning("federated client %s: dropping out of round %s: a share it was "
                                "sent is unusable (%r)", client, task["round"], error)  # fmt: skip
                    skipped = task["round"]
                    continue
                send(answer, masked)
            else:
                shares = secure["client"].unmask(task["dropped"], task["survivors"])
                send({**answer, **{k: {str(u): v.hex() for u, v in shares[k].items()}
                                   for k in ("s", "b")}})  # fmt: skip
    finally:
        channel.close()
