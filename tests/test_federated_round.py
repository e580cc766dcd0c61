"""The federated round written once (`tessera.federated.round`): its draws, checks, privacy and
step against a round written by hand in this file, and the guards that keep `simulate` and the
deployed server on that one object (so the two cannot drift)."""

from __future__ import annotations

import ast
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_federated import _data, _odd_model

from tessera.federated import DPConfig, simulate
from tessera.federated.client import ClientSettings
from tessera.federated.round import FederatedRound, RoundConfig


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Scripted:
    """A transport whose clients send fixed updates (no training): what the round makes of them
    is all there is to see. Records every task it was given."""

    def __init__(self, pool, updates, weights) -> None:
        self._pool, self.updates, self.weights, self.tasks = pool, updates, weights, []

    def pool(self, round_index):
        return self._pool

    def train(self, task):
        self.tasks.append(task)
        for client in task.reporting:
            yield client, self.updates[client], self.weights[client]

    def secure_sum(self, task):
        raise AssertionError("a plain round asked for a secure sum")

    def traffic(self):
        return 3, 5


def _noise(seed: int, round_index: int, count: int) -> torch.Tensor:
    """`DPConfig.insecure_noise_seed`'s documented draws: a generator seeded from the seed and
    the round, N(0, 1) in float64."""
    words = np.random.SeedSequence([seed, round_index]).generate_state(2)
    generator = torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))
    return torch.randn(count, generator=generator, dtype=torch.float64)


def _by_hand(vector, pool, updates, weights, *, per_round, dropout, seed, rounds, dp, lr, algo):
    """The documented round, written out: select, then drop; clip under DP; weighted (or fixed-
    denominator, noised) mean in float64 in client order; the server step. Returns the vector
    after each round, the (selected, dropped) of each round."""
    rng = np.random.default_rng(seed)
    vectors, draws = [], []
    for round_index in range(1, rounds + 1):
        chosen = rng.choice(len(pool), per_round, replace=False)
        selected = sorted(int(pool[int(i)]) for i in chosen)
        dropped = sorted(int(u) for u in rng.choice(selected, round(dropout * per_round), False))
        numerator = torch.zeros(len(vector), dtype=torch.float64)
        denominator = 0.0
        for client in selected:
            if client in dropped:
                continue
            update, weight = updates[client].double(), weights[client]
            if dp is not None:
                norm = float(update.norm())
                update = update * (dp.clip / norm) if norm > dp.clip else update
            numerator += update * weight
            denominator += weight
        if dp is not None:
            noise = _noise(dp.insecure_noise_seed, round_index, len(vector))
            mean = (numerator + noise * (dp.noise_multiplier * dp.clip)) / per_round
        else:
            mean = numerator / denominator
        step = -lr * mean if algo == "fedsgd" else mean
        vector = (vector.double() + step).to(vector.dtype)
        vectors.append(vector)
        draws.append((selected, dropped))
    return vectors, draws


@pytest.mark.parametrize(
    "algo, dp",
    [("fedavg", None), ("fedsgd", None),
     ("fedavg", DPConfig(clip=0.7, noise_multiplier=0.5, insecure_noise_seed=4))],
)  # fmt: skip
def test_the_round_draws_checks_and_steps_as_written_by_hand(algo, dp):
    """Pool of non-contiguous ids, 4 of 7 drawn and 1 of them dropped, three rounds: the same
    clients, and the same vector bit for bit (the same float64 operations in the same order)."""
    pool = [2, 5, 7, 11, 13, 17, 19]
    g = torch.Generator().manual_seed(0)
    updates = {u: torch.randn(40, generator=g) for u in pool}  # norms about 6: clipped under DP
    weights = {u: float(3 + u % 5) if dp is None else 1.0 for u in pool}  # DP: each weighs 1
    clip = None if dp is None else dp.clip  # these clients do not clip: the server does
    settings = ClientSettings(algorithm=algo, lr=0.3, seed=9, clip=clip)
    config = RoundConfig(clients_per_round=4, client=settings, dp=dp, dropout=0.25)
    vector = torch.randn(40, generator=g)
    server, transport = FederatedRound(config, vector.clone()), _Scripted(pool, updates, weights)
    expected, draws = _by_hand(vector, pool, updates, weights, per_round=4, dropout=0.25, seed=9,
                               rounds=3, dp=dp, lr=0.3, algo=algo)  # fmt: skip
    for round_index in range(1, 4):
        result = server.run(round_index, transport)
        assert (result.selected, result.dropped) == draws[round_index - 1]
        assert result.reported == [u for u in result.selected if u not in result.dropped]
        assert transport.tasks[-1].round_index == round_index
        assert torch.equal(server.vector, expected[round_index - 1]), round_index
        assert result.stepped and (result.bytes_up, result.bytes_down) == (3, 5)
        assert (result.epsilon is None) == (dp is None)
    if dp is not None:  # the accountant's sample rate is clients_per_round / len(pool)
        assert result.epsilon == pytest.approx(_epsilon(dp, 4 / 7, rounds=3))


def _epsilon(dp: DPConfig, rate: float, rounds: int) -> float:
    from tessera.federated.privacy import RDPAccountant

    accountant = RDPAccountant()
    accountant.step(dp.noise_multiplier, rate, num_steps=rounds)
    return accountant.epsilon(dp.delta)


def test_the_round_refuses_bad_reports_clips_under_dp_and_keeps_the_quorum(caplog):
    """The server's checks live in the round, for both paths: a non-finite update, a wrong
    shape, a weight above max_weight are refused (logged, the round goes on); under DP a weight
    other than 1 is refused and a long update clipped by the server; below the quorum the round
    is skipped and the model kept."""
    pool = [0, 1, 2, 3]
    good = torch.full((6,), 0.5)
    updates = {0: good, 1: torch.full((6,), float("nan")), 2: torch.ones(5), 3: good * 2}
    weights = {0: 2.0, 1: 1.0, 2: 1.0, 3: 50.0}
    config = RoundConfig(clients_per_round=4, client=ClientSettings(), max_weight=10.0)
    server = FederatedRound(config, torch.zeros(6))
    with caplog.at_level(logging.WARNING):
        result = server.run(1, _Scripted(pool, updates, weights))
    assert result.reported == [0] and torch.equal(server.vector, good)
    for text in ("client 1: 6 non-finite", "client 2: expected shape (6,)", "above max_weight"):
        assert text in caplog.text, text

    dp = DPConfig(clip=0.1, noise_multiplier=1e-30, insecure_noise_seed=0)
    config = RoundConfig(clients_per_round=4, client=ClientSettings(clip=0.1), dp=dp, quorum=2)
    server = FederatedRound(config, torch.zeros(6))
    updates = {0: good, 1: good, 2: good, 3: good}
    result = server.run(1, _Scripted(pool, updates, {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0}))
    assert result.reported == [0, 1, 3]
    # each update clipped to 0.1, summed over 3 reports, divided by the 4 expected
    assert float(server.vector.norm()) == pytest.approx(0.1 * 3 / 4, rel=1e-6)
    before = server.vector.clone()
    result = server.run(2, _Scripted(pool, updates, {0: 1.0, 1: 7.0, 2: 7.0, 3: 7.0}))
    assert result.reported == [0] and not result.stepped and result.epsilon is None
    assert torch.equal(server.vector, before)
    with pytest.raises(ValueError, match="clip"):
        RoundConfig(clients_per_round=2, dp=dp)  # the clients must be told dp's clip


# ---------------------------------------------------------------------------------------------
# the two paths stay on the one round


DRIVERS = ("simulation.py", "deployed.py", "_secure_round.py", "deployed_client.py")
ROUND_NAMES = {"default_rng", "choice", "permutation", "integers", "private_mean", "add_noise",
               "gaussian_noise", "server_step", "sum_to_mean", "sum_of_reports",
               "mean_of_reports", "RDPAccountant", "clip_update", "make_report"}  # fmt: skip


def test_no_driver_draws_aggregates_or_steps_on_its_own():
    """Selection, the random draws, the checks, DP and the server step are the round's alone:
    neither `simulate`'s module nor the deployed server's may name them (a draw or a step added
    to one path would make it drift from the other). `make_report` is allowed in simulation's
    transport only: its clients form their reports before masking (the deployed client does so
    in `deployed_client`'s secure path)."""
    folder = Path(__file__).parent.parent / "tessera" / "federated"
    allowed = {"simulation.py": {"make_report"}, "deployed_client.py": {"make_report"}}
    for name in DRIVERS:
        tree = ast.parse((folder / name).read_text())
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names}  # fmt: skip
        assert not (used & ROUND_NAMES) - allowed.get(name, set()), name


def test_simulate_and_the_deployed_server_drive_the_same_round_object(monkeypatch):
    """Both paths call `FederatedRound.run` once per round with their own transport; the round's
    generator is in the same state before each round in both (a transport that drew from it, or
    drew in another order, would show here) and the models agree bit for bit. 2 of 3 clients per
    round, so that the draws matter; DP with its testing noise seed."""
    from tessera.federated.deployed import ServerConfig, client_token, connect, serve

    calls: list[tuple[str, dict, list[int]]] = []
    run = FederatedRound.run

    def spy(self, round_index, transport):
        state = self.rng.bit_generator.state
        result = run(self, round_index, transport)
        calls.append((type(transport).__name__, state, result.selected))
        return result

    monkeypatch.setattr(FederatedRound, "run", spy)
    x, y = _data(36, seed=2)
    parts = [np.arange(0, 10), np.arange(10, 22), np.arange(22, 36)]
    dp = DPConfig(clip=0.2, noise_multiplier=0.3, insecure_noise_seed=5)
    knobs = dict(clients_per_round=2, rounds=3, local_epochs=1, batch_size=4, lr=0.2, seed=8)
    simulated = simulate(_odd_model, (x, y), (x, y), partition=parts, num_clients=3, dp=dp,
                         **knobs)  # fmt: skip
    config = ServerConfig(token="t", round_timeout_s=60, join_timeout_s=60, quorum=2, dp=dp,
                          **knobs)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    threads = [
        threading.Thread(
            target=connect, args=(f"127.0.0.1:{port}", _odd_model, (x[p], y[p])),
            kwargs=dict(client=k, token=client_token("t", k), idle_timeout_s=60), daemon=True,
        )
        for k, p in enumerate(parts)
    ]  # fmt: skip
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(server._joined) < 3:  # the whole pool, as in simulation, before round 1
            assert time.monotonic() < deadline
            time.sleep(0.01)
        deployed = server.run()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        grpc_server.stop(0)
    assert [c[0] for c in calls] == ["InProcessClients"] * 3 + ["FederatedServer"] * 3
    assert [c[1:] for c in calls[:3]] == [c[1:] for c in calls[3:]]
    assert len({tuple(c[2]) for c in calls[:3]}) > 1  # the draws differ from round to round
    assert deployed.epsilon == simulated.epsilon and len(deployed.epsilon) == 3
    for name, value in simulated.state_dict.items():
        assert torch.equal(deployed.state_dict[name], value), name
