"""What travels between a deployed federated server and its clients, and the checks on it.

A message is `b"TFL1"`, a 4-byte big-endian header length, a JSON header, and an optional
payload of float64 values (a flat parameter vector or a report). No pickle: a message from the
network is data, never code. Every message a client may send has a fixed set of header fields
(`CLIENT_FIELDS`); the server refuses anything else, so no inputs or labels can ride along, and
the only payload a client sends is its report `[weight * update, weight]` of the model's size.
"""

from __future__ import annotations

import json
import struct

import numpy as np

__all__ = ["CLIENT_FIELDS", "WireError", "check_client_message", "decode", "encode"]

MAGIC = b"TFL1"
CLIENT_FIELDS = {
    "join": {"kind", "token", "client"},
    "task": {"kind", "token", "client"},
    "report": {"kind", "token", "client", "round"},
}
"""Header fields allowed in each kind of client message (nothing that could carry data)."""


class WireError(ValueError):
    """A message is malformed or not allowed."""


def encode(header: dict, payload: np.ndarray | None = None) -> bytes:
    """One message: magic, header length, JSON header, float64 payload."""
    text = json.dumps(header).encode()
    body = b"" if payload is None else np.ascontiguousarray(payload, dtype="<f8").tobytes()
    return MAGIC + struct.pack(">I", len(text)) + text + body


def decode(message: bytes) -> tuple[dict, np.ndarray | None]:
    """Inverse of `encode`; raises `WireError` on anything malformed."""
    if len(message) < 8 or message[:4] != MAGIC:
        raise WireError("not a tessera federated message")
    (length,) = struct.unpack(">I", message[4:8])
    try:
        header = json.loads(message[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"unreadable header: {error}") from None
    if not isinstance(header, dict):
        raise WireError("the header is not an object")
    body = message[8 + length :]
    if len(body) % 8:
        raise WireError(f"payload of {len(body)} bytes is not float64 values")
    return header, (np.frombuffer(body, dtype="<f8") if body else None)


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
    if kind == "report":
        if payload is None or payload.shape != (report_size,):
            size = None if payload is None else payload.size
            raise WireError(f"report of {size} values, expected {report_size}")
    elif payload is not None:
        raise WireError(f"{kind} message may not carry a payload")
    return kind
