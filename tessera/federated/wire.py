"""What travels between a deployed federated server and its clients, and the checks on it.

A message is `b"TFL1"`, a payload type byte (0 none, 1 float64, 2 uint64, 3 float32), a 4-byte
big-endian header length, a JSON header, and an optional payload (a flat parameter vector, an
update, or a masked report of secure aggregation). No pickle: a message from the network is data,
never code. Every message a client may send has a fixed set of header fields (`CLIENT_FIELDS`);
the server refuses anything else, so no inputs or labels can ride along. The payloads a client
sends are its update (the model's size, float32 unless the server asks for float64, with its
weight in the header: the server forms the report `[weight * update, weight]` in float64) or, in
secure aggregation, its masked report (uint64, the model's size + 1).

`message_limit` is the largest message a run may exchange (the gRPC limit both ends set): the
vector plus room for the header, so models of any size up to gRPC's 2 GiB ceiling travel in one
message (no chunking: a model past the ceiling is refused when the server starts).
"""

from __future__ import annotations

import json
import struct

import numpy as np

__all__ = [
    "CLIENT_FIELDS",
    "PAYLOAD",
    "WireError",
    "check_client_message",
    "decode",
    "encode",
    "message_limit",
]

MAGIC = b"TFL1"
METHOD = "/tessera.federated.Federated/Call"
"""The one generic unary gRPC method that carries every message."""
WIRE_DTYPES = {"float32": np.float32, "float64": np.float64}
"""How vectors may travel (`ServerConfig.wire_dtype`)."""
CLIENT_FIELDS = {
    "join": {"kind", "token", "client"},
    "task": {"kind", "token", "client"},
    "report": {"kind", "token", "client", "round", "weight"},
    # secure aggregation (Bonawitz et al. 2017): public keys, encrypted shares, masked report,
    # the shares that remove masks
    "keys": {"kind", "token", "client", "round", "c", "s"},
    "shares": {"kind", "token", "client", "round", "outbox"},
    "masked": {"kind", "token", "client", "round"},
    "unmask": {"kind", "token", "client", "round", "s", "b"},
}
PAYLOAD = {"report": (np.dtype("<f4"), np.dtype("<f8")), "masked": (np.dtype("<u8"),)}
"""The payload types of the client messages that carry one: an update of the model's size, or a
masked report of the model's size + 1."""
_CODES = {0: None, 1: np.dtype("<f8"), 2: np.dtype("<u8"), 3: np.dtype("<f4")}
_CODE_OF = {dtype: code for code, dtype in _CODES.items() if dtype is not None}
HEADER_ROOM = 16 * 2**20
"""Bytes a message may hold beyond its vector: the JSON header (rosters and share inboxes of
secure aggregation, at most 4,096 holders of about 300 bytes each)."""
GRPC_CEILING = 2**31 - 1
"""gRPC's largest message (its lengths are 32-bit signed)."""


def message_limit(numel: int) -> int:
    """The largest message of a run over a model of `numel` parameters (a uint64 masked report
    of numel + 1 values, the largest payload, plus `HEADER_ROOM`); ValueError past gRPC's."""
    limit = 8 * (numel + 1) + HEADER_ROOM
    if limit > GRPC_CEILING:
        raise ValueError(
            f"federated: a model of {numel} parameters needs messages of {limit} bytes, past "
            f"gRPC's {GRPC_CEILING}; vectors are not chunked"
        )
    return limit


class WireError(ValueError):
    """A message is malformed or not allowed."""


def encode(header: dict, payload: np.ndarray | None = None) -> bytes:
    """One message: magic, header length, JSON header, payload (uint64, float32 or float64 as
    given; other floating types travel as float64)."""
    text = json.dumps(header).encode()
    if payload is None:
        return MAGIC + struct.pack(">BI", 0, len(text)) + text
    payload = np.asarray(payload)
    code = _CODE_OF.get(payload.dtype.newbyteorder("<"), 1)
    body = np.ascontiguousarray(payload, dtype=_CODES[code])
    return b"".join([MAGIC, struct.pack(">BI", code, len(text)), text, memoryview(body).cast("B")])


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
    body = memoryview(message)[9 + length :]  # a view: a large payload is not copied
    size = 0 if code == 0 else _CODES[code].itemsize
    if (code == 0) != (not len(body)) or (size and len(body) % size):
        raise WireError(f"payload of {len(body)} bytes does not match its type {code}")
    return header, (np.frombuffer(body, dtype=_CODES[code]) if len(body) else None)


def check_client_message(header: dict, payload: np.ndarray | None, report_size: int) -> str:
    """The message kind, after checking it carries only what that kind may (else `WireError`)."""
    kind = header.get("kind")
    if kind not in CLIENT_FIELDS:
        raise WireError(f"unknown message kind {kind!r}")
    extra = set(header) - CLIENT_FIELDS[kind]
    if extra:
        raise WireError(f"{kind} message carries fields {sorted(extra)}: refused (data stays home)")
    client = header.get("client")
    if isinstance(client, bool) or not isinstance(client, int):
        raise WireError(f"{kind} message needs an integer client id")
    if kind in PAYLOAD:
        expected = report_size - 1 if kind == "report" else report_size
        if payload is None or payload.shape != (expected,) or payload.dtype not in PAYLOAD[kind]:
            size = None if payload is None else f"{payload.size} {payload.dtype}"
            types = " or ".join(str(t) for t in PAYLOAD[kind])
            raise WireError(f"{kind} of {size} values, expected {expected} {types}")
    elif payload is not None:
        raise WireError(f"{kind} message may not carry a payload")
    if kind == "report":
        weight = header.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise WireError("report message needs a numeric weight")
    return kind
