"""A federated client's local work: SGD on its own data from the global weights, or one gradient.

The client receives the global parameters as one flat vector, loads them into a replica model and
returns one flat vector the server can average:

- FedAvg (McMahan et al. 2017, Algorithm 1): `epochs` passes of plain SGD (no momentum, no weight
  decay) over the client's samples in mini-batches of `batch_size` (the last one may be smaller;
  `None` = the whole client data as one batch); the client returns `w_local - w_global`.
- FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): the same local SGD
  on `loss + mu/2 ||w - w_global||^2`; the proximal term's gradient `mu (w - w_global)` is added to
  each mini-batch gradient directly rather than through autograd (same value, no extra graph).
- FedSGD: one full-batch gradient at the global weights; the client returns that gradient and the
  server takes the step (`aggregate.server_step`).

The loss is the mean cross-entropy of the model's logits. Only parameters are federated: buffers
(BatchNorm statistics) stay the global model's. Each epoch visits the samples in the order
`torch.randperm(n, generator=client_generator(seed, round_index, client))` (one generator per
client and round, advanced epoch after epoch), so a run is reproducible and a test can replay it.

`client_update` is the whole of a selected client's work in a round, shared by the in-process
clients of `simulate` and by `deployed_client`: local training with the round's
`ClientSettings`, then, under differential privacy, the clip to `clip` and the weight 1 (else the
weight is the client's sample count).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from tessera.federated.privacy import clip_update

__all__ = ["ClientSettings", "client_generator", "client_update", "load_vector", "local_update"]


@dataclass(kw_only=True, frozen=True)
class ClientSettings:
    """What a selected client is told each round (the deployed server sends these fields in the
    header of its `train` / `shares` task, by these names)."""

    algorithm: str = "fedavg"
    """fedavg, fedprox or fedsgd (`aggregate.ALGORITHMS`)."""
    epochs: int = 1
    """Local passes over the client's samples (fedavg, fedprox)."""
    batch_size: int | None = 10
    """Local mini-batch size; None: all the client's samples in one batch."""
    lr: float = 0.1
    """Local SGD learning rate (and the server's for fedsgd)."""
    mu: float = 0.0
    """FedProx's proximal weight (0: none)."""
    seed: int = 0
    """The run's public seed: with the round and the client id it orders the client's samples."""
    clip: float | None = None
    """Differential privacy's clip (`DPConfig.clip`): the client clips its update to this L2 norm
    and weighs 1. None: no DP, the client weighs its sample count."""

    def header(self) -> dict:
        """The fields as they travel in a task's header."""
        return asdict(self)

    @classmethod
    def from_header(cls, header: dict) -> ClientSettings:
        """The settings from a task's header (KeyError if one is missing)."""
        return cls(**{f.name: header[f.name] for f in fields(cls)})


def client_update(
    model: nn.Module,
    global_vector: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    settings: ClientSettings,
    *,
    round_index: int,
    client: int,
) -> tuple[torch.Tensor, float]:
    """One selected client's `(update, weight)` for round `round_index` (module docstring)."""
    s = settings
    update = local_update(
        model, global_vector, inputs, labels, algorithm=s.algorithm, epochs=s.epochs,
        batch_size=s.batch_size, lr=s.lr, mu=s.mu,
        generator=client_generator(s.seed, round_index, client),
    )  # fmt: skip
    if s.clip is None:
        return update, float(len(labels))
    return clip_update(update, s.clip), 1.0  # DP: bounded influence, equal weights


def load_vector(params: list[torch.Tensor], vector: torch.Tensor) -> None:
    """Copy a flat vector into `params` (in place; unlike `vector_to_parameters`, which makes
    the parameters views of the vector, so that training would overwrite the global weights)."""
    offset = 0
    with torch.no_grad():
        for param in params:
            param.copy_(vector[offset : offset + param.numel()].view_as(param))
            offset += param.numel()


def client_generator(seed: int, round_index: int, client: int) -> torch.Generator:
    """The generator ordering one client's samples in one round (independent of other clients)."""
    state = np.random.SeedSequence([int(seed), int(round_index), int(client)]).generate_state(2)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def local_update(
    model: nn.Module,
    global_vector: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    algorithm: str,
    epochs: int,
    batch_size: int | None,
    lr: float,
    mu: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """The client's flat update: `w_local - w_global` (fedavg, fedprox) or the gradient (fedsgd).

    `model` is a replica whose parameters are overwritten with `global_vector`; `inputs` and
    `labels` are the client's samples only.

    Why so many parameters: the training knobs are named one by one (keywords), so that local
    training reads without the round's `ClientSettings`, whose seed and clip are not its concern.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    load_vector(params, global_vector)
    model.train()
    if algorithm == "fedsgd":
        loss = F.cross_entropy(model(inputs), labels)
        return parameters_to_vector(torch.autograd.grad(loss, params)).detach()
    anchors = [p.detach().clone() for p in params] if mu else None
    num_samples = len(labels)
    step = num_samples if batch_size is None else batch_size
    for _ in range(epochs):
        order = torch.randperm(num_samples, generator=generator) if batch_size else None
        for start in range(0, num_samples, step):
            batch = slice(start, start + step) if order is None else order[start : start + step]
            loss = F.cross_entropy(model(inputs[batch]), labels[batch])
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for index, (param, grad) in enumerate(zip(params, grads)):
                    if anchors is not None:  # FedProx: d/dw mu/2 ||w - w_global||^2
                        grad = grad + mu * (param - anchors[index])
                    param.sub_(grad, alpha=lr)
    return (parameters_to_vector(params) - global_vector).detach()
