"""Differential privacy for federated averaging: clip each client, noise the sum, count epsilon.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models"):
each client's update is clipped to L2 norm `clip`, the server adds Gaussian noise of standard
deviation `noise_multiplier * clip` to every coordinate of the sum of the clipped updates, and
divides by the number of reports. One client changes the sum by at most `clip`, so each round is
a Gaussian mechanism with noise multiplier sigma = `noise_multiplier`, run on a sample of
`q = clients_per_round / num_clients` of the clients (client-level privacy).

The accountant tracks Renyi differential privacy (Mironov 2017, "Renyi Differential Privacy")
of the sampled Gaussian mechanism at integer orders alpha, from Mironov, Talwar & Zhang 2019
("Renyi Differential Privacy of the Sampled Gaussian Mechanism", sec. 3.3, integer alpha):

    A_alpha = sum_{k=0..alpha} C(alpha, k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 sigma^2))
    RDP(alpha) = log(A_alpha) / (alpha - 1)          (q = 1 gives alpha / (2 sigma^2))

RDP adds up over rounds, and converts to (epsilon, delta)-DP by (Balle et al. 2020, "Hypothesis
Testing Interpretations and Renyi Differential Privacy", Thm. 21; also Canonne et al. 2020):

    epsilon = min_alpha  RDP(alpha) + log((alpha - 1)/alpha) - (log delta + log alpha)/(alpha - 1)

The analysis assumes Poisson sampling of clients; simulation draws a fixed number per round
without replacement, the usual approximation (as in McMahan et al. 2018).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DPConfig", "RDPAccountant", "add_noise", "clip_update", "rdp_sampled_gaussian"]

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

    def __post_init__(self) -> None:
        if not self.clip > 0 or not math.isfinite(self.clip):
            raise ValueError(f"DPConfig: clip must be a finite number > 0, got {self.clip}")
        if not self.noise_multiplier > 0 or not math.isfinite(self.noise_multiplier):
            raise ValueError(f"DPConfig: noise_multiplier must be > 0, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"DPConfig: delta must be in (0, 1), got {self.delta}")


def clip_update(update: torch.Tensor, clip: float) -> torch.Tensor:
    """`update` scaled down to L2 norm `clip` if it is longer (unchanged otherwise)."""
    norm = float(update.double().norm())
    return update * (clip / norm) if norm > clip else update


def add_noise(total: torch.Tensor, config: DPConfig, generator: torch.Generator) -> torch.Tensor:
    """A summed report with N(0, (sigma * clip)^2) added to every coordinate but the count."""
    noise = torch.randn(total.numel() - 1, generator=generator, dtype=torch.float64)
    noisy = total.clone()
    noisy[:-1] += noise * (config.noise_multiplier * config.clip)
    return noisy


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
