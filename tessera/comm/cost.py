"""The alpha-beta-gamma cost model of every allreduce and the choice of "auto" (pure: no I/O).

Its parameters are fitted on a live group by `tessera.comm.calibrate` (calibrate.py).

α: seconds per message (latency, including Python's per-message overhead), β: seconds per byte
sent, γ: seconds per byte reduced (Hockney's model extended by Thakur, Rabenseifner & Gropp
2005, whose formulas each algorithm's module quotes). Two extra terms describe this library's
other paths: σ, one shared-memory barrier, and μ, seconds per byte of a memory copy, for `shm`;
and α_native for gloo's own (C++) ring, whose per-message cost is lower than ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "CostParams",
    "DEFAULT_PARAMS",
    "KINDS",
    "choose",
    "params_for",
    "predict",
    "set_params",
]

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
"""The collectives `predict` models; all_gather and reduce_scatter know ring, native and shm."""


@dataclass(kw_only=True, frozen=True)
class CostParams:
    """Machine constants of the cost model (seconds; per byte where it says so)."""

    alpha: float = 2.0e-4
    """Latency of one point-to-point message sent by tessera's Python algorithms."""
    beta: float = 1.5e-9
    """Seconds per byte sent point to point (1 / link bandwidth)."""
    gamma: float = 2.5e-10
    """Seconds per byte reduced (one `add_` of two vectors, per byte of one vector)."""
    mu: float = 1.5e-10
    """Seconds per byte of a memory copy (`copy_`), for the shm transport."""
    sigma: float = 3.0e-5
    """One shared-memory barrier (named-pipe tokens)."""
    alpha_native: float = 1.8e-4
    """Latency of one message inside gloo's own allreduce."""
    cores: int = 2
    """Cores of the host: more ranks than cores serialise the shm reduction."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "mu", "sigma", "alpha_native"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative")
        if self.cores < 1:
            raise ValueError("cores must be at least 1")


DEFAULT_PARAMS = CostParams()


def predict(
    algorithm: str,
    nbytes: float,
    world: int,
    params: CostParams | None = None,
    *,
    shared: bool = False,
    kind: str = "all_reduce",
) -> float:
    """Predicted seconds of a collective `kind` of `nbytes` per rank over `world` ranks.

    `nbytes`: the tensor reduced (all_reduce), the gathered output (all_gather) or the input
    scattered (reduce_scatter). `shared`: the tensor comes from `shared_buffer` (all_reduce by
    shm skips the copies in and out).
    """
    c = params or DEFAULT_PARAMS
    p, n = world, float(nbytes)
    if p <= 1:
        return 0.0
    if kind != "all_reduce":
        return _predict_half(algorithm, n, p, c, kind)
    a, b, g = c.alpha, c.beta, c.gamma
    lg = math.ceil(math.log2(p))
    frac = (p - 1) / p
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * n * frac * b + n * frac * g
    if algorithm == "tree":
        return 2 * lg * a + 2 * n * lg * b + n * lg * g
    if algorithm == "butterfly":
        pof2 = 1 << (p.bit_length() - 1)
        fold = 0.0 if pof2 == p else 2 * a + 2 * n * b + n * g
        lgp = int(math.log2(pof2))
        if n < 64 * 1024 or n / 4 < pof2:  # recursive doubling
            return fold + lgp * (a + n * b + n * g)
        f2 = (pof2 - 1) / pof2
        return fold + 2 * lgp * a + 2 * n * f2 * b + n * f2 * g
    if algorithm == "all_to_all":
        return (p - 1) * (a + n * b) + (p - 1) * n * g
    if algorithm == "master_worker":
        return 2 * (p - 1) * (a + n * b) + (p - 1) * n * g
    if algorithm == "round_robin":
        return (p - 1) * (a + n * b + n * g) + lg * (a + n * b)
    if algorithm == "native":
        return 2 * (p - 1) * c.alpha_native + 2 * n * frac * b + n * frac * g
    if algorithm == "shm":
        crowd = max(1.0, p / c.cores)  # ranks beyond the cores take turns
        copies = 1.0 if shared else 3.0  # copy in, write back into every slot, copy out
        return 2 * c.sigma + crowd * n * (copies * c.mu + frac * g)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _predict_half(algorithm: str, n: float, p: int, c: CostParams, kind: str) -> float:
    """all_gather / reduce_scatter: one half of a ring all-reduce, or one shm exchange.

    Ring (Thakur, Rabenseifner & Gropp 2005): (p-1)α + n(p-1)/p·β, plus n(p-1)/p·γ reduced
    for reduce_scatter; native is gloo's ring with its own α. shm (`shm.gather`): one barrier;
    all_gather copies n/p in and the gathered n out, reduce_scatter copies the n(p-1)/p that
    peers read in and reduces this rank's n/p from p copies; ranks beyond the cores take turns.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    frac = (p - 1) / p
    reduced = n * frac * c.gamma if kind == "reduce_scatter" else 0.0
    if algorithm == "ring":
        return (p - 1) * c.alpha + n * frac * c.beta + reduced
    if algorithm == "native":
        return (p - 1) * c.alpha_native + n * frac * c.beta + reduced
    if algorithm == "shm":
        crowd = max(1.0, p / c.cores)
        copied = n * (1 + 1 / p) if kind == "all_gather" else n  # reduce_scatter: n(p-1)/p + n/p
        return c.sigma + crowd * (copied * c.mu + reduced)
    raise ValueError(f"{kind} has no algorithm {algorithm!r} (ring, native, shm)")


def choose(
    nbytes: float,
    world: int,
    params: CostParams | None = None,
    *,
    candidates: tuple[str, ...] = ("ring", "tree", "butterfly", "native", "shm"),
    shared: bool = False,
    kind: str = "all_reduce",
) -> str:
    """The candidate with the smallest predicted time (ties: the earlier candidate)."""
    return min(
        candidates,
        key=lambda name: predict(name, nbytes, world, params, shared=shared, kind=kind),
    )


_calibrated: dict[str, CostParams] = {}


def params_for(key: str) -> CostParams:
    """The calibrated parameters of a group (by key), else the defaults."""
    return _calibrated.get(key, DEFAULT_PARAMS)


def set_params(key: str, params: CostParams) -> None:
    """Use `params` for the group `key` from now on (what `comm.calibrate` measured)."""
    _calibrated[key] = params
