"""`wait_or_raise`: the one bounded wait of tessera, turning a silent hang into a typed error.

Every engine hands its collectives to a worker (the group's communication stream, a background
optimizer step) and later waits for the Future. A wait without a bound hangs forever when another
rank stopped; a bound reported as a bare `concurrent.futures.TimeoutError` says nothing of where.
This one wait takes the bound as a value (the `Context`'s `timeout_s`, never read from the
environment here) and raises `CollectiveTimeout` naming this rank and the operation.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tessera.errors import CollectiveTimeout

__all__ = ["wait_or_raise"]

_LIKELY = "another rank has not reached the same operation (or has failed)"


def wait_or_raise(
    future: Future, what: str, timeout_s: float, rank: int, cause: str = _LIKELY
) -> Any:
    """`future`'s result, waiting at most `timeout_s`; its own error is re-raised as is.

    Past the bound: `CollectiveTimeout` "rank R: WHAT did not complete within T s; CAUSE". A task
    that itself raised a timeout (a collective inside it timed out, naming its peer) keeps its
    own, more precise error: only a future still pending is reported as this wait's timeout.
    """
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        if future.done():  # the task's own TimeoutError (a CollectiveTimeout inside it): as is
            raise
        raise CollectiveTimeout(rank, what, timeout_s, cause) from None
