"""Simulate federated training: many clients in one process, one after another, same server code.

One round (McMahan et al. 2017, Algorithm 1): draw `clients_per_round` distinct clients; each
loads the global weights and runs `client.local_update` on its own samples; a `dropout` share of
them never report; the others' reports are summed (in the clear, or through secure aggregation so
that the server only sees masked vectors and their sum); with differential privacy the updates
are clipped before and noised after summing (the noisy sum divided by `clients_per_round`, the
expected number of reports, however many arrived); the server takes one step. Test loss and
accuracy are measured after round 0 (the initial model) and after every round.

The round itself (selection, the server's checks, the sum, privacy, the step, and the order of
the random draws) is `round.FederatedRound`, the same object the deployed server drives;
`simulate` hands it `InProcessClients`, a transport whose clients live in this process. One
`numpy.random.default_rng(seed)` draws, each round, the selected clients, then the dropped ones
(whether or not secure aggregation is on, so the same clients drop either way); partitioning
draws from its own generator with the same `seed`. DP noise does not come from `seed`: it is
fresh OS randomness (`privacy`), unless the testing option `DPConfig(insecure_noise_seed=...)`
fixes it.

Clients are trained in turn in one replica model: a client costs its few SGD steps, not a process,
so hundreds of clients run on a laptop. Dropped clients skip training: they never report, and
nothing they would compute reaches the server (their secure-aggregation masks are recovered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from tessera.federated.aggregate import ALGORITHMS, make_report, update_problem
from tessera.federated.client import ClientSettings, client_update, load_vector
from tessera.federated.partitioning import SCHEMES
from tessera.federated.partitioning import partition as make_partition
from tessera.federated.privacy import DPConfig
from tessera.federated.round import FederatedRound, RoundConfig, RoundTask
from tessera.federated.secure_aggregation import SecAggConfig, as_config, secure_sum

__all__ = ["History", "SimulationConfig", "simulate"]

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class History:
    """What a federated run produced; lists of measurements have one entry per round."""

    state_dict: dict[str, torch.Tensor]
    """The final global model's state dict."""
    accuracy: list[float] = field(default_factory=list)
    """Test accuracy after round 0 (the initial model) and after every round: rounds + 1 values."""
    loss: list[float] = field(default_factory=list)
    """Test mean cross-entropy, like `accuracy`."""
    round_s: list[float] = field(default_factory=list)
    """Wall time of each round (training, aggregation and step; not the evaluation)."""
    bytes_up: list[int] = field(default_factory=list)
    """Bytes the clients sent the server each round (updates, or keys + shares + masked inputs)."""
    bytes_down: list[int] = field(default_factory=list)
    """Bytes the server sent the clients each round (global weights, secure-aggregation lists)."""
    epsilon: list[float] = field(default_factory=list)
    """With `dp`: the privacy spent so far after each round (epsilon at the config's delta)."""
    selected: list[list[int]] = field(default_factory=list)
    """Clients drawn each round."""
    dropped: list[list[int]] = field(default_factory=list)
    """Selected clients that never reported, each round."""


@dataclass(frozen=True)
class SimulationConfig:
    """The knobs of `simulate`, one default each; checked when made, before anything is built.

    Each field may also be passed to `simulate` as a keyword of the same name.
    """

    partition: str | Sequence[np.ndarray] = "shards"
    """A scheme of `partitioning.SCHEMES` (with default alpha / shards) or a list of index
    arrays, one per client."""
    num_clients: int = 100
    """Clients holding data; the pool each round draws from."""
    clients_per_round: int = 10
    """Clients drawn each round (and the DP denominator)."""
    local_epochs: int = 1
    """Passes each selected client makes over its samples."""
    batch_size: int | None = 10
    """A client's SGD batch (None: its whole data, one step per epoch: FedSGD-like)."""
    lr: float = 0.1
    """The clients' SGD learning rate."""
    rounds: int = 100
    """Rounds to run (0: only evaluate the initial model)."""
    algorithm: str = "fedavg"
    """One of `aggregate.ALGORITHMS`."""
    mu: float = 0.0
    """FedProx's proximal weight."""
    secure_aggregation: bool | SecAggConfig = False
    """True for Bonawitz et al.'s complete graph, a `SecAggConfig` for a threshold or SecAgg+'s
    k neighbours."""
    dp: DPConfig | None = None
    """Client-level differential privacy (None: plain weighted means)."""
    dropout: float = 0.0
    """The share of the selected clients that never report, each round."""
    seed: int = 0
    """Selection, dropouts, partitioning and the clients' sample orders (not the DP noise)."""

    def __post_init__(self) -> None:
        _check_numbers(self.num_clients, self.clients_per_round, self.local_epochs,
                       self.batch_size, self.lr, self.rounds, self.mu)  # fmt: skip
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"simulate: dropout={self.dropout} must be in [0, 1)")
        as_config(self.secure_aggregation)  # raises on a bad value
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"simulate: unknown algorithm {self.algorithm!r}; choose one of {ALGORITHMS}"
            )
        if self.dp is not None and not isinstance(self.dp, DPConfig):
            raise TypeError(
                f"simulate: dp must be a DPConfig or None, got {type(self.dp).__name__}"
            )


_KNOBS = tuple(f.name for f in dataclasses.fields(SimulationConfig))


def simulate(
    model_fn: Callable[[], nn.Module],
    train: Pair,
    test: Pair,
    config: SimulationConfig | None = None,
    **knobs: Any,
) -> History:
    """Train `model_fn()`'s model federatedly on `train`, evaluating on `test`; see the module doc.

    The knobs are a `SimulationConfig` (`config`), or its fields as keywords
    (`simulate(model_fn, train, test, rounds=5, lr=0.05)`), which override `config`'s.
    `model_fn` must return a model of the same architecture each call: the first is the global
    model, the second the replica clients train in.
    """
    unknown = sorted(set(knobs) - set(_KNOBS))
    if unknown:
        raise TypeError(f"simulate() got unexpected keyword arguments {unknown}; knobs: {_KNOBS}")
    if config is not None and not isinstance(config, SimulationConfig):
        raise TypeError(f"simulate: config must be a SimulationConfig, got {type(config).__name__}")
    cfg = dataclasses.replace(config or SimulationConfig(), **knobs)
    train_x, train_y = _check_pair(train, "train")
    test_x, test_y = _check_pair(test, "test")
    parts = _client_parts(cfg.partition, train_y, cfg.num_clients, cfg.seed)

    global_model, replica = model_fn(), model_fn()
    params = [p for p in global_model.parameters() if p.requires_grad]
    settings = ClientSettings(
        algorithm=cfg.algorithm, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
        mu=cfg.mu, seed=cfg.seed, clip=cfg.dp and cfg.dp.clip,
    )  # fmt: skip
    round_config = RoundConfig(
        clients_per_round=cfg.clients_per_round, client=settings, dp=cfg.dp,
        secagg=as_config(cfg.secure_aggregation), dropout=cfg.dropout, quorum=0,
    )  # fmt: skip
    server = FederatedRound(round_config, parameters_to_vector(params).detach().clone())
    transport = InProcessClients(replica, train_x, train_y, parts)
    history = History(state_dict={})
    _evaluate(global_model, test_x, test_y, history)
    for round_index in range(1, cfg.rounds + 1):
        result = server.run(round_index, transport)
        history.round_s.append(result.seconds)
        history.bytes_up.append(result.bytes_up)
        history.bytes_down.append(result.bytes_down)
        history.selected.append(result.selected)
        history.dropped.append(result.dropped)
        if result.epsilon is not None:
            history.epsilon.append(result.epsilon)
        load_vector(params, server.vector)
        _evaluate(global_model, test_x, test_y, history)
    history.state_dict = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    return history


class InProcessClients:
    """`simulate`'s transport (`round.Transport`): the clients live in this process and train in
    turn in one replica model; a client told to drop never trains (nothing it would compute
    reaches the server). Bytes are counted as a network would carry them: the global weights to
    each selected client, an update and its weight back (or secure aggregation's messages)."""

    def __init__(self, replica: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                 parts: Sequence[np.ndarray]) -> None:  # fmt: skip
        self.replica, self.inputs, self.labels, self.parts = replica, inputs, labels, parts
        self._traffic = (0, 0)

    def pool(self, round_index: int) -> range:
        """Every client, every round."""
        return range(len(self.parts))

    def _update(self, task: RoundTask, client: int) -> tuple[torch.Tensor, float]:
        indices = torch.as_tensor(self.parts[client])
        return client_update(self.replica, task.vector, self.inputs[indices],
                             self.labels[indices], task.settings, round_index=task.round_index,
                             client=client)  # fmt: skip

    def train(self, task: RoundTask) -> Iterator[tuple[int, torch.Tensor, float]]:
        """Train the reporting clients in client order, yielding each report as it is ready."""
        vector_bytes = task.vector.numel() * task.vector.element_size()
        self._traffic = (0, len(task.selected) * vector_bytes)
        for client in task.reporting:
            update, weight = self._update(task, client)
            self._traffic = (self._traffic[0] + vector_bytes + 8, self._traffic[1])
            yield client, update, weight

    def secure_sum(self, task: RoundTask) -> tuple[torch.Tensor, list[int]]:
        """Every selected client sets up keys; those that report mask their report, the others
        drop out after the key exchange. A client leaves out its own update if it is unusable
        (the server cannot look inside masked vectors)."""
        numel = task.vector.numel()
        reports = {u: make_report(*self._update(task, u)) for u in task.reporting}
        usable = {u: r for u, r in reports.items() if update_problem(r, numel + 1) is None}
        result = secure_sum(usable, participants=task.selected, threshold=task.secagg.threshold,
                            neighbours=task.secagg.neighbours)  # fmt: skip
        down = len(task.selected) * numel * task.vector.element_size()
        self._traffic = (result.bytes_up, down + result.bytes_down)
        return result.total, sorted(usable)

    def traffic(self) -> tuple[int, int]:
        """Bytes of the round just run."""
        return self._traffic


def _evaluate(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, history: History):
    """Append the test loss and accuracy of `model` (evaluation mode, in chunks)."""
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(labels), 4096):
            logits = model(inputs[start : start + 4096])
            target = labels[start : start + 4096]
            loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(dim=1) == target).sum())
    history.loss.append(loss_sum / max(len(labels), 1))
    history.accuracy.append(correct / max(len(labels), 1))


def _check_pair(pair: Pair, name: str) -> Pair:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"simulate: {name} must be an (inputs, labels) pair of tensors")
    inputs, labels = (torch.as_tensor(t) for t in pair)
    if len(inputs) != len(labels) or labels.ndim != 1:
        raise ValueError(
            f"simulate: {name} has {len(inputs)} inputs but labels of shape {tuple(labels.shape)}"
        )
    return inputs, labels.long()


def _client_parts(partition, labels: torch.Tensor, num_clients: int, seed: int) -> list:
    if isinstance(partition, str):
        if partition not in SCHEMES:
            raise ValueError(f"simulate: unknown partition {partition!r}; choose one of {SCHEMES}")
        return make_partition(labels.numpy(), num_clients, scheme=partition, seed=seed)
    parts = [np.asarray(p, dtype=np.int64) for p in partition]
    if len(parts) != num_clients:
        raise ValueError(f"simulate: partition has {len(parts)} clients, num_clients={num_clients}")
    for client, part in enumerate(parts):
        if part.size and (part.min() < 0 or part.max() >= len(labels)):
            raise ValueError(f"simulate: client {client}'s indices leave 0..{len(labels) - 1}")
    return parts


def _check_numbers(num_clients, clients_per_round, local_epochs, batch_size, lr, rounds, mu):
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(
            f"simulate: clients_per_round={clients_per_round} must be in 1..num_clients"
            f"={num_clients}"
        )
    if local_epochs < 1 or rounds < 0:
        raise ValueError(
            f"simulate: need local_epochs >= 1 and rounds >= 0, got {local_epochs}, {rounds}"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"simulate: batch_size must be >= 1 or None, got {batch_size}")
    if not lr > 0 or not mu >= 0:
        raise ValueError(f"simulate: lr={lr} must be > 0 and mu={mu} >= 0")
