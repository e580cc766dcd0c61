"""Flower's simulation (Ray backend) on the FedAvg task of `federated.py`; prints one JSON line.

Run by `federated.py` in a subprocess with a Python that has `flwr[simulation]` (the `bench-fl`
extra: `pip install -e ".[bench,bench-fl]"`). Same data, split, shards (tessera's `partition`,
seed 0), model, 100 clients, 10 per round, E = 1, B = 10, SGD 0.1 (no momentum); a client visits
its samples in a fresh random order each round, like tessera's clients and the plain loop.
Flower draws the clients of a round itself (its own random sampling), so its accuracy curve is
the same task with other draws, not the same run. Flower's default simulation settings are kept
(Ray, 2 CPUs per client app: one client at a time on this 2-core machine).

Measured: `round_s`, from the strategy's `configure_train` to the end of its `aggregate_train`
(sampling, sending, local training, replies, averaging; not the evaluation, as in tessera's
`History.round_s`); `startup_s`, from `run_simulation` to the first round's start (Ray and the
simulation engine coming up); `import_s` (importing flwr); test accuracy after every round
(server-side `evaluate_fn`, outside the round time).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import flwr  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

_IMPORTED = time.perf_counter()
NUM_CLIENTS = 100
_DATA: dict = {}


def _task():
    """(train, test, parts), built once per process (Ray runs client apps in worker processes)."""
    if not _DATA:
        from federated import _digits

        from tessera.federated import partition

        torch.set_num_threads(1)
        train, test = _digits()
        parts = partition(train[1], NUM_CLIENTS, scheme="shards", seed=0)
        _DATA.update(train=train, test=test, parts=parts)
    return _DATA["train"], _DATA["test"], _DATA["parts"]


def _new_model():
    from federated import _model

    return _model()


client_app = ClientApp()


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    (x, y), _, parts = _task()
    indices = torch.tensor(parts[int(context.node_config["partition-id"])])
    model = _new_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    order = indices[torch.randperm(len(indices))]
    for start in range(0, len(order), 10):
        batch = order[start : start + 10]
        optimizer.zero_grad()
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(indices)}),
        }
    )
    return Message(content=content, reply_to=msg)


class _TimedFedAvg(FedAvg):
    """FedAvg that stamps the start and end of each round's training part."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.starts: list[float] = []
        self.ends: list[float] = []

    def configure_train(self, server_round, arrays, config, grid):  # noqa: D102
        self.starts.append(time.perf_counter())
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):  # noqa: D102
        result = super().aggregate_train(server_round, replies)
        self.ends.append(time.perf_counter())
        return result


def main() -> None:
    """Run Flower's simulation and print the measurements as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    accuracy: list[float] = []
    strategy = _TimedFedAvg(
        fraction_train=10 / NUM_CLIENTS,
        fraction_evaluate=0.0,
        min_train_nodes=10,
        min_available_nodes=NUM_CLIENTS,
    )

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        _, (x, y), _ = _task()
        model = _new_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            accuracy.append(float((model(x).argmax(1) == y).float().mean()))
        return MetricRecord({"accuracy": accuracy[-1]})

    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(_new_model().state_dict()),
            num_rounds=args.rounds,
            evaluate_fn=evaluate,
        )

    called = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=NUM_CLIENTS)
    round_s = [end - start for start, end in zip(strategy.starts, strategy.ends)]
    print(
        json.dumps(
            {
                "flwr": flwr.__version__,
                "import_s": _IMPORTED - _T0,
                "startup_s": strategy.starts[0] - called,
                "round_s": round_s,
                "accuracy": accuracy,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
