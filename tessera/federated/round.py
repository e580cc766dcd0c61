"""One federated round, written once and handed its transport: `simulate` and the deployed server
both drive a `FederatedRound`, so that simulation and deployment cannot drift (as Flower's
`Strategy` drives both its simulation and its deployment).

The round owns everything the server decides; the transport only carries work to the clients
and their answers back:

1. selection, from the pool of available clients the transport offers (`Transport.pool`);
2. the server's checks of each plain report (shape, finite values, its weight: >= 0, at most
   `max_weight`, exactly 1 under DP) and, under DP, its own clip of each update, so that no client
   moves the sum by more than the clip whatever it sent; with secure aggregation the only check
   left is on the unmasked sum's total weight, and a round that fails it is abandoned;
3. the sum, in float64 in client order (`aggregate`), or the transport's secure sum;
4. the quorum: with fewer usable reports than `quorum` the round is skipped, the model kept;
5. DP-FedAvg (`privacy`): noise on the sum, the fixed denominator `clients_per_round`, and the
   accountant's step at sample rate `clients_per_round / len(pool)`;
6. the server step (`aggregate.server_step`).

Random draws: one `numpy.random.default_rng(seed)`, owned by the round, draws each round first
the selected clients (`choice(len(pool), clients_per_round)` over the sorted pool; `simulate`'s
pool is 0..num_clients-1), then the simulated dropouts among them (`choice(selected,
round(dropout * clients_per_round))`, drawn even when that is 0, so that the same clients are
selected with and without dropouts or secure aggregation). The DP noise does not come from this
generator (`privacy`: the OS's CSPRNG, or `DPConfig.insecure_noise_seed` in tests); the clients'
sample orders come from `client.client_generator(seed, round, client)`. Nothing else draws, so a
deployed run over clients 0..n-1 is the simulated one bit for bit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tessera.federated.aggregate import (
    ALGORITHMS,
    make_report,
    server_step,
    sum_to_mean,
    update_problem,
)
from tessera.federated.client import ClientSettings
from tessera.federated.privacy import DPConfig, RDPAccountant, clip_update, private_mean
from tessera.federated.secure_aggregation import SecAggConfig

__all__ = ["FederatedRound", "RoundConfig", "RoundResult", "RoundTask", "Transport"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class RoundConfig:
    """The server's settings of every round (what `simulate` and `ServerConfig` have in common)."""

    clients_per_round: int
    """Clients drawn each round (and the DP denominator)."""
    client: ClientSettings = field(default_factory=ClientSettings)
    """What the selected clients are told (its `clip` must be `dp.clip`, None without DP)."""
    dp: DPConfig | None = None
    """Client-level differential privacy (None: plain weighted means)."""
    secagg: SecAggConfig | None = None
    """Secure aggregation's settings (None: the server sums plain reports)."""
    dropout: float = 0.0
    """Simulation only: the share of the selected clients told not to report (a deployed round
    has 0: its clients drop out on their own)."""
    quorum: int = 1
    """Fewest usable reports that make a round count. 0 (simulation): every round steps, even
    one in which every selected client dropped (under DP its noise is released and counted)."""
    max_weight: float | None = None
    """The largest weight a plain report may claim (None: any finite weight >= 0); with secure
    aggregation, the bound per survivor on the sum's total weight."""

    def __post_init__(self) -> None:
        if self.clients_per_round < 1:
            raise ValueError(f"RoundConfig: clients_per_round={self.clients_per_round} < 1")
        if self.client.algorithm not in ALGORITHMS:
            raise ValueError(f"RoundConfig: unknown algorithm {self.client.algorithm!r}")
        if self.client.clip != (None if self.dp is None else self.dp.clip):
            raise ValueError(f"RoundConfig: the clients' clip {self.client.clip} is not dp's")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"RoundConfig: dropout={self.dropout} must be in [0, 1)")
        if not 0 <= self.quorum <= self.clients_per_round:
            raise ValueError(f"RoundConfig: quorum {self.quorum} not in 0..clients_per_round")


@dataclass(frozen=True)
class RoundTask:
    """What the round asks its transport to do."""

    round_index: int
    """1 for the first round."""
    selected: list[int]
    """The clients drawn, sorted."""
    dropped: list[int]
    """Simulated dropouts among `selected` (sorted): they must not report."""
    vector: torch.Tensor
    """The global parameters the clients start from."""
    settings: ClientSettings
    """What the clients are told."""
    secagg: SecAggConfig | None
    """Secure aggregation's settings (None in a plain round)."""

    @property
    def reporting(self) -> list[int]:
        """The selected clients that were not told to drop, in order."""
        dropped = set(self.dropped)
        return [u for u in self.selected if u not in dropped]


class Transport(Protocol):
    """How a round reaches its clients: in-process (`simulation`) or over gRPC (`deployed`)."""

    def pool(self, round_index: int) -> Sequence[int]:
        """The available clients, sorted (waiting until there are `clients_per_round`)."""

    def train(self, task: RoundTask) -> Iterable[tuple[int, torch.Tensor, float]]:
        """A plain round: each report that arrived as `(client, update, weight)`, in client
        order (the round checks them; a generator lets each be summed and freed in turn)."""

    def secure_sum(self, task: RoundTask) -> tuple[torch.Tensor, list[int]] | None:
        """A secure round: the unmasked float64 sum of the survivors' reports and the survivors,
        or None if the round was abandoned (the transport says why)."""

    def traffic(self) -> tuple[int, int]:
        """Bytes up (clients to server) and down of the round just run."""


@dataclass(frozen=True)
class RoundResult:
    """What one round did."""

    selected: list[int]
    """Clients drawn."""
    dropped: list[int]
    """Simulated dropouts among them."""
    reported: list[int]
    """Clients whose reports counted (usable, in time; the survivors if secure)."""
    stepped: bool
    """Whether the model moved (False: skipped below the quorum, or abandoned)."""
    epsilon: float | None
    """With DP, the privacy spent so far after a round that stepped (else None)."""
    seconds: float
    """Wall time from the draw to the step."""
    bytes_up: int
    """Bytes the clients sent (`Transport.traffic`)."""
    bytes_down: int
    """Bytes the server sent."""


class FederatedRound:
    """The server's half of every round (module docstring); `vector` is the global model."""

    def __init__(self, config: RoundConfig, vector: torch.Tensor) -> None:
        self.config = config
        self.vector = vector
        self.rng = np.random.default_rng(config.client.seed)
        self.accountant = RDPAccountant() if config.dp is not None else None

    def select(self, pool: Sequence[int]) -> tuple[list[int], list[int]]:
        """Draw `(selected, dropped)` from the sorted `pool`, in the documented order."""
        c = self.config
        chosen = self.rng.choice(len(pool), c.clients_per_round, replace=False)
        selected = sorted(int(pool[int(i)]) for i in chosen)
        count = int(round(c.dropout * c.clients_per_round))
        dropped = sorted(int(u) for u in self.rng.choice(selected, count, replace=False))
        return selected, dropped

    def run(self, round_index: int, transport: Transport) -> RoundResult:
        """One round through `transport`: select, collect, check, sum, privacy, step."""
        c = self.config
        pool = transport.pool(round_index)
        start = time.perf_counter()
        selected, dropped = self.select(pool)
        task = RoundTask(round_index, selected, dropped, self.vector, c.client, c.secagg)
        if c.secagg is None:
            total, reported = self._plain_sum(transport.train(task))
        else:
            total, reported = self._checked_secure_sum(transport.secure_sum(task), round_index)
        stepped, epsilon = total is not None and len(reported) >= c.quorum, None
        if not stepped:
            log.warning("federated server: round %d skipped, %d of quorum %d reports",
                        round_index, len(reported), c.quorum)  # fmt: skip
        elif c.dp is not None:
            mean = private_mean(total, c.dp, expected_reports=c.clients_per_round,
                                round_index=round_index)  # fmt: skip
            self.accountant.step(c.dp.noise_multiplier, c.clients_per_round / len(pool))
            epsilon = self.accountant.epsilon(c.dp.delta)
        else:
            mean = sum_to_mean(total)
        if stepped:
            algorithm, lr = c.client.algorithm, c.client.lr
            self.vector = server_step(self.vector, mean, algorithm=algorithm, lr=lr)
        seconds = time.perf_counter() - start
        up, down = transport.traffic()
        return RoundResult(selected, dropped, sorted(reported), stepped, epsilon, seconds,
                           int(up), int(down))  # fmt: skip

    def weight_problem(self, weight: float) -> str | None:
        """Why a claimed weight is refused (None if fine): negative, non-finite, over
        `max_weight`, or other than 1 under DP."""
        c = self.config
        if not 0 <= weight < math.inf:
            return f"weight {weight} is not a finite number >= 0"
        if c.dp is not None and weight != 1:
            return f"weight {weight}: with differential privacy every client weighs 1"
        if c.max_weight is not None and weight > c.max_weight:
            return f"weight {weight} is above max_weight {c.max_weight}"
        return None

    def _plain_sum(
        self, reports: Iterable[tuple[int, torch.Tensor, float]]
    ) -> tuple[torch.Tensor, list[int]]:
        """The sum of the usable reports (checked, clipped under DP) and their clients."""
        numel, dp = self.vector.numel(), self.config.dp
        total, usable = torch.zeros(numel + 1, dtype=torch.float64), []
        for client, update, weight in reports:
            problem = update_problem(update, numel) or self.weight_problem(weight)
            if problem is not None:
                log.warning("federated: rejected the update of client %s: %s", client, problem)
                continue
            if dp is not None:  # enforce the DP bound here: a client may not have clipped
                norm = float(update.double().norm())
                if norm > dp.clip * (1 + 1e-6):  # beyond float32 rounding of an honest clip
                    log.warning("federated: client %s sent an update of norm %.6g > clip %.6g; "
                                "clipped by the server", client, norm, dp.clip)  # fmt: skip
                update = clip_update(update.to(torch.float64), dp.clip)
            total += make_report(update, weight)
            usable.append(client)
        return total, usable

    def _checked_secure_sum(
        self, result: tuple[torch.Tensor, list[int]] | None, round_index: int
    ) -> tuple[torch.Tensor | None, list[int]]:
        """The secure sum if its total weight passes the one check masked reports allow: at most
        `max_weight` per survivor, exactly 1 per survivor under DP (else the round is abandoned)."""
        if result is None:
            return None, []
        total, survivors = result
        weight, count, c = float(total[-1]), len(survivors), self.config
        problem = None
        if c.dp is not None and weight != count:
            problem = (f"the reports' weights sum to {weight}, not 1 per each of the {count} "
                       "survivors (DP); a client claimed another weight")  # fmt: skip
        elif c.max_weight is not None and not weight <= c.max_weight * count:
            problem = (f"the reports' weights sum to {weight}, above max_weight {c.max_weight} "
                       f"for each of the {count} survivors")  # fmt: skip
        if problem is not None:
            log.warning("federated server: round %d abandoned: secure aggregation: %s",
                        round_index, problem)  # fmt: skip
            return None, []
        return total, list(survivors)
