"""A secure-aggregation round over the network: the deployed server's side of Bonawitz et al.'s
four phases (`keys`, `shares`, `masked`, `unmask`), driven through `FederatedServer._collect`
with the same `SecAggServer` as simulation.

A client whose `keys`, `shares` or `unmask` message is malformed is dropped from the round (it
counts as a dropout of that phase: logged, never an exception that stops `run()`), and the round
goes on with the others while the threshold allows. Masked reports cannot be inspected; the one
check left, on the unmasked sum's total weight, is the round's (`round.FederatedRound`), as in
simulation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tessera.federated import wire
from tessera.federated.secure_aggregation import SecAggServer, dequantize

if TYPE_CHECKING:
    from tessera.federated.deployed import FederatedServer

log = logging.getLogger("tessera.federated.deployed")  # one logger for the deployed server


def secure_round(server: FederatedServer, selected: set[int]) -> tuple[torch.Tensor, list[int]]:
    """Bonawitz et al.'s four rounds over the network (see `secure_aggregation`)."""
    config = server.config.secagg
    secagg = SecAggServer(selected, config.threshold, config.neighbours)
    round_index = server._round

    def ask(kind: str, **fields) -> Callable[[int], bytes]:
        message = wire.encode({"kind": kind, "round": round_index, **fields})
        return lambda _: message

    keys = _well_formed(server, "keys", server._collect("keys", selected, ask("keys")),
                        lambda h: (_public(h["c"]), _public(h["s"])))  # fmt: skip
    roster = secagg.collect_keys(keys)

    def shares_task(client: int) -> bytes:  # a client gets its neighbours' keys and its own
        keys = secagg.neighbourhood(client)
        return wire.encode(
            {"kind": "shares", **server._settings(), "threshold": secagg.threshold,
             "count": len(roster),
             "roster": {str(u): [c.hex(), s.hex()] for u, (c, s) in keys.items()}},
            server._global_payload(),
        )  # fmt: skip

    outboxes = _well_formed(
        server, "shares", server._collect("shares", set(roster), shares_task),
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

    masked = server._collect("masked", set(partners), masked_task)
    dropped, survivors = secagg.collect_masked({u: p for u, (_, p) in masked.items()})
    unmask = server._collect("unmask", set(survivors), ask("unmask", dropped=dropped,
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


def _well_formed(server: FederatedServer, kind: str, collected: dict, parse) -> dict:
    """`{client: parse(header)}` for the clients whose `kind` message parses; a malformed one
    drops its sender from this round (logged), and the round goes on without it."""
    parsed = {}
    for client, (header, _) in sorted(collected.items()):
        try:
            parsed[client] = parse(header)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            log.warning("federated server: client %s dropped from round %d: a malformed %s "
                        "message (%s)", client, server._round, kind, error)  # fmt: skip
    return parsed
