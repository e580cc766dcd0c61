"""Consistency policies: when may a worker read the parameters? Pure clock rules, no processes.

A worker's *clock* is the number of its updates a server has applied. Before its next update a
worker at clock `c` asks to read; the policy answers from `c` and the slowest live worker's clock:

- `BSP()` bulk-synchronous: read only when every live worker has reached `c` (no worker reads
  clock t+1 parameters before every step-t gradient is applied). Valiant 1990.
- `ASP()` asynchronous: never wait (Hogwild-style, Recht et al. 2011; Dean et al. 2012).
- `SSP(staleness=K)` stale-synchronous: read when the slowest live worker has reached `c - K`.
  `K = 0` is BSP, `K = inf` is ASP. Ho et al., "More Effective Distributed ML via a Stale
  Synchronous Parallel Parameter Server" (NIPS 2013).

A policy with bound 0 also tells the server to aggregate (apply the mean of the W gradients of a
clock at once, synchronous data parallelism); any other bound applies each gradient on arrival.
So `SSP(0)` trains exactly like `BSP()`, not merely with the same clock rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tessera.errors import ConfigError

__all__ = ["ASP", "BSP", "SSP", "ConsistencyPolicy", "resolve_policy"]

DEFAULT_SSP_STALENESS = 2
"""`consistency="ssp"` without a bound means `SSP(staleness=2)`."""


@runtime_checkable
class ConsistencyPolicy(Protocol):
    """What a server asks before serving a read."""

    @property
    def staleness_bound(self) -> float:
        """Largest allowed `clock - min_clock` at a read: 0 (BSP) up to `math.inf` (ASP)."""
        ...

    def may_read(self, clock: int, min_live_clock: int) -> bool:
        """May a worker that has completed `clock` updates read now?"""
        ...


def _check_clocks(clock: int, min_live_clock: int) -> None:
    if clock < 0 or min_live_clock < 0:
        raise ValueError(f"clocks are counts of updates, got clock={clock}, min={min_live_clock}")


@dataclass(frozen=True)
class SSP:
    """Stale-synchronous parallel: a worker runs at most `staleness` clocks ahead of the slowest."""

    staleness: float = DEFAULT_SSP_STALENESS
    """Clocks a reader may be ahead of the slowest live worker; 0 = BSP, `math.inf` = ASP."""

    def __post_init__(self) -> None:
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, (int, float)):
            raise ConfigError(f"SSP staleness must be a number, got {self.staleness!r}")
        if math.isnan(self.staleness) or self.staleness < 0:
            raise ConfigError(f"SSP staleness must be >= 0, got {self.staleness}")
        if not math.isinf(self.staleness) and self.staleness != int(self.staleness):
            raise ConfigError(
                f"SSP staleness must be a whole number of clocks or inf, got {self.staleness}"
            )

    @property
    def staleness_bound(self) -> float:
        """The bound K."""
        return self.staleness

    def may_read(self, clock: int, min_live_clock: int) -> bool:
        """Read when the slowest live worker has reached `clock - K`."""
        _check_clocks(clock, min_live_clock)
        return clock - min_live_clock <= self.staleness


@dataclass(frozen=True)
class BSP:
    """Bulk-synchronous parallel: every worker reads the same clock; SSP with K = 0."""

    @property
    def staleness_bound(self) -> float:
        """Always 0."""
        return 0

    def may_read(self, clock: int, min_live_clock: int) -> bool:
        """Read only when every live worker has completed `clock` updates."""
        _check_clocks(clock, min_live_clock)
        return min_live_clock >= clock


@dataclass(frozen=True)
class ASP:
    """Asynchronous parallel: never wait; SSP with K = infinity."""

    @property
    def staleness_bound(self) -> float:
        """Always infinity."""
        return math.inf

    def may_read(self, clock: int, min_live_clock: int) -> bool:
        """Always."""
        _check_clocks(clock, min_live_clock)
        return True


_NAMED = {"bsp": BSP, "asp": ASP, "ssp": SSP}


def resolve_policy(consistency: str | ConsistencyPolicy) -> ConsistencyPolicy:
    """`"bsp"`, `"asp"`, `"ssp"` (= `SSP(2)`) or a policy object -> a policy object."""
    if isinstance(consistency, str):
        key = consistency.strip().lower()
        if key not in _NAMED:
            raise ConfigError(
                f"unknown consistency {consistency!r}: choose 'bsp', 'asp', 'ssp' or pass "
                "BSP(), ASP(), SSP(staleness=K)"
            )
        return _NAMED[key]()
    if isinstance(consistency, ConsistencyPolicy):
        return consistency
    raise ConfigError(f"consistency must be a name or a policy object, got {consistency!r}")


def aggregates(policy: ConsistencyPolicy) -> bool:
    """True when the server applies the mean of a whole clock at once (bound 0)."""
    return policy.staleness_bound == 0
