"""What travels between a deployed federated server and its clients, and the checks on it.

A message is `b"TFL1"`, a payload type byte (0 none, 1 float64, 2 uint64), a 4-byte big-endian
header length, a JSON header, and an optional payload (a flat parameter vector, a report, or a
masked report of secure aggregation). No pickle: a message from the
network is data, never code. Every message a client may send has a fixed set of header fields
(`CLIENT_FIELDS`); the server refuses anything else, so no inputs or labels can ride along, and
the only payload a client sends is its report `[weight * update, weight]` of the model's size.
"""

from __future__ import annotations

import json
import struct

import numpy as np

__all__ = ["CLIENT_FIELDS", "PAYLOAD", "WireError", "check_client_message", "decode", "encode"]

MAGIC = b"TFL1"
CLIENT_FIELDS = {
    "join": {"kind", "token", "client"},
    "task": {"kind", "token", "client"},
    "report": {"kind", "token", "client", "round"},
    # secure aggregation (Bonawitz et al. 2017): public keys, encrypted shares, masked report,
    # the shares that remove masks
    "keys": {"kind", "token", "client", "round", "c", "s"},
    "shares": {"kind", "token", "client", "round", "outbox"},
    "masked": {"kind", "token", "client", "round"},
    "unmask": {"kind", "token", "client", "round", "s", "b"},
}
PAYLOAD = {"report": np.dtype("<f8"), "masked": np.dtype("<u8")}
"""The payload type of the client messages that carry one (of the model's size + 1)."""
_CODES = {0: None, 1: np.dtype("<f8"), 2: np.dtype("<u8")}
"""Header fields allowed in each kind of client message (nothing that could carry data)."""


class WireError(ValueError):
    """A message is malformed or not allowed."""


def encode(header: dict, payload: np.ndarray | None = None) -> bytes:
    """One message: magic, header length, JSON header, float64 payload."""
    text = json.dumps(header).encode()
    if payload is None:
        code, body = 0, b""
    else:
        code = 2 if np.asarray(payload).dtype == np.uint64 else 1
        body = np.ascontiguousarray(payload, dtype=_CODES[code]).tobytes()
    return MAGIC + struct.pack(">BI", code, len(text)) + text + body


def decode(message: bytes) -> tuple[dict, np.ndarray | None]:
    """Inverse of `encode`; raises `WireError` on anything malformed."""
    if len(message) < 9 or message[:4] != MAGIC or message[4] not in _CODES:
        raise WireError("not a tessera federated message")
    code, length = struct.unpack(">BI", message[4:9])
    try:
        header = json.loads(message[9 : 9 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"unreadable header: {error}") from None
    if not isinstance(header, dict):
        raise WireError("the header is not an object")
    body = message[9 + length :]
    if len(body) % 8 or (code == 0) != (not body):
        raise WireError(f"payload of {len(body)} bytes does not match its type {code}")
    return header, (np.frombuffer(body, dtype=_CODES[code]) if body else None)


def check_client_message(header: dict, payload: np.ndarray | None, report_size: int) -> str:
    """The message kind, after checking it carries only what that kind may (else `WireError`)."""
    kind = header.get("kind")
    if kind not in CLIENT_FIELDS:
        raise WireError(f"unknown message kind {kind!r}")
    extra = set(header) - CLIENT_FIELDS[kind]
    if extra:
        raise WireError(f"{kind} message carries fields {sorted(extra)}: refused (data stays home)")
    if not isinstance(header.get("client"), int):
        raise WireError(f"{kind} message needs an integer client id")
    if kind in PAYLOAD:
        if payload is None or payload.shape != (report_size,) or payload.dtype != PAYLOAD[kind]:
            size = None if payload is None else f"{payload.size} {payload.dtype}"
            raise WireError(f"{kind} of {size} values, expected {report_size} {PAYLOAD[kind]}")
    elif payload is not None:
        raise WireError(f"{kind} message may not carry a payload")
    return kind
