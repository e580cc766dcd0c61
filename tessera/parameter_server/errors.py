"""Errors of the parameter server; each names the worker or server and the operation."""

from __future__ import annotations

from tessera.errors import TesseraError

__all__ = ["GradientShapeError", "PSTimeout", "PeerRefused", "WorkerLost"]


class PeerRefused(TesseraError, PermissionError):
    """A peer called with another run's token or none (or after being dropped); it was not
    served. A guard against mixed-up jobs, not a security boundary (see `transport`)."""


class GradientShapeError(TesseraError, ValueError):
    """A pushed gradient does not match the server's shard; the push was refused."""


class WorkerLost(TesseraError):
    """A worker fell silent past the timeout; fatal under BSP, the worker is dropped otherwise."""

    def __init__(self, message: str, worker: int | None = None) -> None:
        # One positional message: RPC rebuilds a remote exception as `type(message)`.
        self.worker = worker
        super().__init__(message)


class PSTimeout(TesseraError, TimeoutError):
    """A call to a server or a wait inside one passed its timeout."""
