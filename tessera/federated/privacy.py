"""Differential privacy for federated averaging: clip each client, noise the sum, count epsilon.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models"):
each client's update is clipped to L2 norm `clip`, the server adds Gaussian noise of standard
deviation `noise_multiplier * clip` to every coordinate of the sum of the clipped updates, and
divides by a fixed denominator: the expected number of reports, `clients_per_round` (McMahan et
al.'s fixed-denominator estimator, Algorithm 1 with W = qN): dividing by the number that arrived
would make the step depend on who took part, which the accountant does not cover. One client
changes the sum by at most `clip`, so each round is a Gaussian mechanism with noise multiplier
sigma = `noise_multiplier`, run on a sample of `q = clients_per_round / num_clients` of the
clients (client-level privacy).

The noise comes from the operating system's CSPRNG (`os.urandom`, turned into normal draws by
Box-Muller), fresh each round: nothing public (the run's `seed`, which deployed clients receive)
determines it, so nobody can regenerate and subtract it. `DPConfig(insecure_noise_seed=...)`
draws it from a seeded generator instead, for tests that compare runs bit for bit; anyone who
knows that seed removes the noise, so it voids the privacy guarantee.

The accountant tracks Renyi differential privacy (Mironov 2017, "Renyi Differential Privacy")
of the sampled Gaussian mechanism at integer orders alpha, from Mironov, Talwar & Zhang 2019
("Renyi Differential Privacy of the Sampled Gaussian Mechanism", sec. 3.3, integer alpha):

    A_alpha = sum_{k=0..alpha} C(alpha, k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 sigma^2))
    RDP(alpha) = log(A_alpha) / (alpha - 1)          (q = 1 gives alpha / (2 sigma^2))

RDP adds up over rounds, and converts to (epsilon, delta)-DP by (Balle et al. 2020, "Hypothesis
Testing Interpretations and Renyi Differential Privacy", Thm. 21; also Canonne et al. 2020):

    epsilon = min_alpha  RDP(alpha) + log((alpha - 1)/alpha) - (log delta + log alpha)/(alpha - 1)

The analysis assumes Poisson sampling of clients; simulation draws a fixed number per round
without replacement, the usual approximation (as in McMahan et al. 2018), and the fixed
denominator above is the one that analysis pairs with it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DPConfig",
    "RDPAccountant",
    "add_noise",
    "clip_update",
    "gaussian_noise",
    "private_mean",
    "rdp_sampled_gaussian",
]

DEFAULT_ORDERS = tuple(range(2, 257))
"""Integer Renyi orders the accountant tracks (small orders matter for large epsilon, large
orders for small epsilon)."""


@dataclass(kw_only=True, frozen=True)
class DPConfig:
    """Client-level differential privacy for `simulate`."""

    clip: float
    """L2 norm each client's update is clipped to (the sensitivity of the sum)."""
    noise_multiplier: float
    """Noise standard deviation on the sum, in units of `clip` (sigma)."""
    delta: float = 1e-5
    """The delta of the reported (epsilon, delta); below 1 / number of clients, by convention."""
    insecure_noise_seed: int | None = None
    """TESTING ONLY: draw the noise from a generator seeded with this (and the round) instead of
    the OS's CSPRNG, so that runs repeat bit for bit. Whoever knows it can regenerate the noise
    and subtract it: no privacy is left. None (the default): fresh OS randomness every round."""

    def __post_init__(self) -> None:
        if not self.clip > 0 or not math.isfinite(self.clip):
            raise ValueError(f"DPConfig: clip must be a finite number > 0, got {self.clip}")
        if not self.noise_multiplier > 0 or not math.isfinite(self.noise_multiplier):
            raise ValueError(f"DPConfig: noise_multiplier must be > 0, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"DPConfig: delta must be in (0, 1), got {self.delta}")
        seed = self.insecure_noise_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"DPConfig: insecure_noise_seed must be an int >= 0 or None: {seed}")


def clip_update(update: torch.Tensor, clip: float) -> torch.Tensor:
    """`update` scaled down to L2 norm `clip` if it is longer (unchanged otherwise)."""
    norm = float(update.double().norm())
    return update * (clip / norm) if norm > clip else update


def gaussian_noise(count: int, config: DPConfig, round_index: int) -> torch.Tensor:
    """`count` independent N(0, 1) draws (float64) for one round's noise: from `os.urandom` by
    Box-Muller (53-bit uniforms; u1 in (0, 1] so the logarithm is finite), or, only with the
    testing option `config.insecure_noise_seed`, from a generator seeded by it and the round."""
    if config.insecure_noise_seed is not None:
        state = np.random.SeedSequence([config.insecure_noise_seed, int(round_index)])
        words = state.generate_state(2)
        generator = torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))
        return torch.randn(count, generator=generator, dtype=torch.float64)
    pairs = -(-count // 2)
    words = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs) >> 11
    radius = np.sqrt(-2.0 * np.log((words[0] + 1.0) * 2.0**-53))
    angle = (2 * math.pi * 2.0**-53) * words[1]
    normal = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
    return torch.from_numpy(normal)


def add_noise(total: torch.Tensor, config: DPConfig, round_index: int) -> torch.Tensor:
    """A summed report with N(0, (sigma * clip)^2) added to every coordinate but the count."""
    noise = gaussian_noise(total.numel() - 1, config, round_index)
    noisy = total.to(torch.float64).clone()
    noisy[:-1] += noise * (config.noise_multiplier * config.clip)
    return noisy


def private_mean(
    total: torch.Tensor, config: DPConfig, *, expected_reports: int, round_index: int
) -> torch.Tensor:
    """The DP-FedAvg step from a sum of clipped, weight-1 reports: noise added, divided by the
    fixed `expected_reports` (clients per round), whatever number of reports arrived."""
    if expected_reports < 1:
        raise ValueError(f"private_mean: expected_reports must be >= 1, got {expected_reports}")
    return add_noise(total, config, round_index)[:-1] / expected_reports


def rdp_sampled_gaussian(q: float, sigma: float, orders=DEFAULT_ORDERS) -> np.ndarray:
    """RDP(alpha) of one sampled Gaussian mechanism at each integer order (formula above)."""
    if not 0 <= q <= 1 or not sigma > 0:
        raise ValueError(f"rdp: need 0 <= q <= 1 and sigma > 0, got q={q}, sigma={sigma}")
    result = []
    for alpha in orders:
        if int(alpha) != alpha or alpha < 2:
            raise ValueError(f"rdp: orders must be integers >= 2, got {alpha}")
        if q == 0:
            result.append(0.0)
            continue
        if q == 1:
            result.append(alpha / (2 * sigma**2))
            continue
        k = np.arange(alpha + 1, dtype=np.float64)
        log_binomial = math.lgamma(alpha + 1) - _lgamma(k + 1) - _lgamma(alpha - k + 1)
        log_terms = (
            log_binomial + (alpha - k) * math.log1p(-q) + k * math.log(q)
            + (k * k - k) / (2 * sigma**2)
        )  # fmt: skip
        peak = log_terms.max()  # log-sum-exp: the terms span hundreds of orders of magnitude
        result.append((peak + math.log(np.exp(log_terms - peak).sum())) / (alpha - 1))
    return np.asarray(result)


def _lgamma(values: np.ndarray) -> np.ndarray:
    return np.array([math.lgamma(v) for v in values])


class RDPAccountant:
    """Running RDP of a sequence of sampled Gaussian mechanisms, reported as epsilon at a delta."""

    def __init__(self, orders=DEFAULT_ORDERS) -> None:
        self.orders = tuple(orders)
        self.rdp = np.zeros(len(self.orders))
        self._cache: dict[tuple[float, float], np.ndarray] = {}

    def step(self, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Record `num_steps` rounds of noise multiplier sigma on a sampled share `sample_rate`."""
        key = (float(sample_rate), float(noise_multiplier))
        if key not in self._cache:
            self._cache[key] = rdp_sampled_gaussian(sample_rate, noise_multiplier, self.orders)
        self.rdp = self.rdp + num_steps * self._cache[key]

    def epsilon(self, delta: float) -> float:
        """Smallest epsilon over the orders (Balle et al. 2020 conversion) at this `delta`."""
        if not 0 < delta < 1:
            raise ValueError(f"RDPAccountant: delta must be in (0, 1), got {delta}")
        alpha = np.asarray(self.orders, dtype=np.float64)
        eps = self.rdp + np.log1p(-1 / alpha) - (math.log(delta) + np.log(alpha)) / (alpha - 1)
        return float(max(eps.min(), 0.0))
