"""Typed errors: each names what failed, where (which rank, which operation) and the likely cause.

Distributed failures are hard to read because the rank that reports a problem is rarely the rank
that caused it. Every error raised by tessera therefore carries the rank it concerns, so that a
user reading one line knows where to look.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "ConfigError",
    "LaunchTimeout",
    "PeerLostError",
    "RankFailedError",
    "TesseraError",
]


class TesseraError(Exception):
    """Base class of every error tessera raises on purpose."""


class ConfigError(TesseraError, ValueError):
    """A configuration is invalid; raised before any process starts."""


class CheckpointError(TesseraError):
    """A checkpoint is missing, truncated, corrupt or does not match the run; nothing was loaded."""


class RankFailedError(TesseraError):
    """A worker rank raised; carries that rank's number and its formatted traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class LaunchTimeout(TesseraError, TimeoutError):
    """Local ranks did not finish within the whole-run deadline the caller asked for.

    A deadline is not a hang detector: the ranks may simply need longer. A wait between ranks
    that never completes raises `CollectiveTimeout` in the rank instead, naming the operation.
    """

    def __init__(self, deadline_s: float, unfinished_ranks: list[int]) -> None:
        self.deadline_s = deadline_s
        self.unfinished_ranks = unfinished_ranks
        super().__init__(
            f"ranks {unfinished_ranks} had not finished at the run's deadline_s of "
            f"{deadline_s:.0f} s; they were stopped"
        )


class CollectiveTimeout(TesseraError, TimeoutError):
    """A collective or point-to-point wait passed its timeout."""

    flight_record: str | None = None
    """Path of this rank's flight record (`tessera.runtime.flight_recorder`), if one was written."""

    def __init__(self, rank: int, op: str, timeout_s: float, detail: str = "") -> None:
        self.rank = rank
        self.op = op
        self.timeout_s = timeout_s
        text = f"rank {rank}: {op} did not complete within {timeout_s:g} s"
        super().__init__(f"{text}; {detail}" if detail else text)


class PeerLostError(TesseraError, ConnectionError):
    """The process at the other end of a link exited or died while this rank waited on it."""

    def __init__(self, rank: int, peer: int, op: str) -> None:
        self.rank = rank
        self.peer = peer
        self.op = op
        super().__init__(
            f"rank {rank}: {op}: rank {peer} closed the shared-memory link (it exited or died; "
            f"see rank {peer}'s own error)"
        )


class CollectiveMismatch(TesseraError):
    """Ranks called different collectives, or the same one with different shapes or dtypes."""
