"""A secure-aggregation round over the network: the deployed server's side of Bonawitz et al.'s
four phases (`keys`, `shares`, `masked`, `unmask`), driven through the server's collection of
one phase's messages with the same `SecAggServer` as simulation.

The server (`tessera.federated.deployed.FederatedServer`) hands the round a `ServerSide`: the
round's index, its settings and how to collect a phase. This module therefore does not import
the server's, which calls it: the dependency goes one way.

A client whose `keys`, `shares` or `unmask` message is malformed is dropped from the round (it
counts as a dropout of that phase: logged, never an exception that stops `run()`), and the round
goes on with the others while the threshold allows. Masked reports cannot be inspected; the one
check left, on the unmasked sum's total weight, is the round's (`round.FederatedRound`), as in
simulation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tessera.federated import wire
from tessera.federated.secure_aggregation import SecAggConfig, SecAggServer, dequantize

__all__ = ["ServerSide", "secure_round"]

log = logging.getLogger("tessera.federated.deployed")  # one logger for the deployed server


@dataclass(frozen=True)
class ServerSide:
    """What a secure round needs of the deployed server, for one round."""

    round_index: int
    secagg: SecAggConfig
    collect: Callable[[str, set[int], Callable[[int], bytes]], dict]
    """`collect(phase, expected, task)`: ask the `expected` clients for a `phase` submission
    (`task(client)` is the message each gets); `{client: (header, payload)}` of what arrived
    before the deadline."""
    settings: Callable[[], dict]
    """The task header's training settings (the round, the clients' settings, the dtype)."""
    global_payload: Callable[[], np.ndarray]
    """The global weights as they travel."""


def secure_round(server: ServerSide, selected: set[int]) -> tuple[torch.Tensor, list[int]]:
    """Bonawitz et al.'s four rounds over the network (see `secure_aggregation`)."""
    config = server.secagg
    secagg = SecAggServer(selected, config.threshold, config.neighbours)
    round_index = server.round_index

    def ask(kind: str, **fields) -> Callable[[int], bytes]:
        message = wire.encode({"kind": kind, "round": round_index, **fields})
        return lambda _: message

    keys = _well_formed(server, "keys", server.collect("keys", selected, ask("keys")),
                        lambda h: (_public(h["c"]), _public(h["s"])))  # fmt: skip
    roster = secagg.collect_keys(keys)

    def shares_task(client: int) -> bytes:  # a client gets its neighbours' keys and its own
        keys = secagg.neighbourhood(client)
        return wire.encode(
            {"kind": "shares", **server.settings(), "threshold": secagg.threshold,
             "count": len(roster),
             "roster": {str(u): [c.hex(), s.hex()] for u, (c, s) in keys.items()}},
            server.global_payload(),
        )  # fmt: skip

    outboxes = _well_formed(
        server, "shares", server.collect("shares", set(roster), shares_task),
        lambda h: {int(v): bytes.fromhex(c) for v, c in h["outbox"].items()},
    )  # fmt: skip
    # Only clients whose shares went out can be unmasked later: they are the partners.
    partners = sorted(outboxes)
    secagg.keep_partners(partners)
    inboxes = secagg.route_shares({u: {v: c for v, c in box.items() if v in secagg.roster}
                                   for u, box in outboxes.items()})  # fmt: skip

    def masked_task(client: int) -> bytes:
        inbox = {str(u): c.hex() for u, c in inboxes[client].items()}
        return wire.encode({"kind": "masked", "round": round_index, "inbox": inbox,
                            "partners": partners})  # fmt: skip

    masked = server.collect("masked", set(partners), masked_task)
    dropped, survivors = secagg.collect_masked({u: p for u, (_, p) in masked.items()})
    unmask = server.collect("unmask", set(survivors), ask("unmask", dropped=dropped,
                                                         survivors=survivors))  # fmt: skip
    responses = _well_formed(
        server, "unmask", unmask,
        lambda h: {kind: {int(k): bytes.fromhex(v) for k, v in h[kind].items()} for kind in "sb"},
    )  # fmt: skip
    return dequantize(secagg.finish(responses)), survivors


def _public(text: object) -> bytes:
    """A 32-byte X25519 public key from its hex text (ValueError / TypeError otherwise)."""
    if not isinstance(text, str) or len(text) != 64:
        raise ValueError("a public key is 64 hex digits")
    return bytes.fromhex(text)


def _well_formed(server: ServerSide, kind: str, collected: dict, parse) -> dict:
    """`{client: parse(header)}` for the clients whose `kind` message parses; a malformed one
    drops its sender from this round (logged), and the round goes on without it."""
    parsed = {}
    for client, (header, _) in sorted(collected.items()):
        try:
            parsed[client] = parse(header)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            log.warning("federated server: client %s dropped from round %d: a malformed %s "
                        "message (%s)", client, server.round_index, kind, error)  # fmt: skip
    return parsed
