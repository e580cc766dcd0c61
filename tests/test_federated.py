"""Federated learning: partitioners, FedAvg / FedProx / FedSGD against plain loops written here,
secure aggregation (exact sums, dropout recovery, threshold, masking) and the DP accountant.

Oracles are independent: local SGD is `torch.optim.SGD` on a model trained in the test, the
weighted average a loop over clients, the RDP of the sampled Gaussian a numerical integral of the
Renyi divergence. The only thing the oracles borrow from the code under test is the documented
order in which a client visits its samples (`client_generator`), which is data, not computation.
"""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

from tessera.federated import (
    ALGORITHMS,
    SCHEMES,
    DPConfig,
    History,
    RDPAccountant,
    SecAggConfig,
    SecureAggregationError,
    SimulationConfig,
    partition,
    secure_sum,
    simulate,
)
from tessera.federated.aggregate import make_report, mean_of_reports
from tessera.federated.client import client_generator
from tessera.federated.privacy import clip_update, rdp_sampled_gaussian
from tessera.federated.secure_aggregation import SecAggClient, SecAggServer, quantize


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a loaded 2-core machine: extra intra-op threads only spin (measured: one
    thread runs these tests 30x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# partitioners


def _labels(num_per_class: int, num_classes: int = 10, seed: int = 0) -> np.ndarray:
    labels = np.repeat(np.arange(num_classes), num_per_class)
    return np.random.default_rng(seed).permutation(labels)


def _check_is_a_partition(parts: list[np.ndarray], num_samples: int) -> None:
    everything = np.concatenate(parts)
    assert len(everything) == num_samples and len(np.unique(everything)) == num_samples


def test_partition_schemes_sizes_skew_and_determinism():
    assert SCHEMES == ("iid", "shards", "dirichlet")
    labels = _labels(200)  # 2000 samples, 10 classes
    # iid: sizes differ by at most one, every client sees most classes.
    iid = partition(labels, 30, scheme="iid", seed=3)
    _check_is_a_partition(iid, 2000)
    assert {len(p) for p in iid} <= {66, 67}
    assert np.mean([len(np.unique(labels[p])) for p in iid]) > 9
    # shards: 100 clients x 2 shards of 10 samples; a class (200 samples) fills 20 whole shards,
    # so every shard holds one label and every client at most two.
    shards = partition(labels, 100, scheme="shards", shards_per_client=2, seed=3)
    _check_is_a_partition(shards, 2000)
    assert {len(p) for p in shards} == {20}
    assert max(len(np.unique(labels[p])) for p in shards) <= 2
    assert np.mean([len(np.unique(labels[p])) for p in shards]) > 1.5  # dealt at random
    # dirichlet: per class, proportions over clients ~ Dir(alpha). Small alpha: a client's data
    # is dominated by few classes; huge alpha: each client holds ~1/K of every class.
    skewed = partition(labels, 10, scheme="dirichlet", alpha=0.05, seed=3)
    even = partition(labels, 10, scheme="dirichlet", alpha=1e4, seed=3)
    _check_is_a_partition(skewed, 2000)
    _check_is_a_partition(even, 2000)
    for p in even:
        counts = np.bincount(labels[p], minlength=10)
        assert np.all(np.abs(counts - 20) <= 3), counts  # std of a class share ~ 20/sqrt(1e4)
    top_share = [np.bincount(labels[p]).max() / len(p) for p in skewed if len(p)]
    assert np.mean(top_share) > 0.6
    # determinism: a seed fixes the split; another seed changes it
    for scheme in SCHEMES:
        a = partition(labels, 10, scheme=scheme, seed=5)
        b = partition(torch.as_tensor(labels), 10, scheme=scheme, seed=5)
        c = partition(labels, 10, scheme=scheme, seed=6)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_partition_bad_input():
    labels = _labels(10)
    with pytest.raises(ValueError, match="unknown scheme 'zipf'"):
        partition(labels, 5, scheme="zipf")
    for alpha in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha must be"):
            partition(labels, 5, scheme="dirichlet", alpha=alpha)
    with pytest.raises(ValueError, match="cannot make 120 shards"):
        partition(labels, 60, scheme="shards")
    with pytest.raises(ValueError, match="num_clients"):
        partition(labels, 0)
    with pytest.raises(ValueError, match="integers"):
        partition(labels.astype(float), 5)


# ---------------------------------------------------------------------------------------------
# local training and averaging against plain loops


class OddNet(nn.Module):
    """Unlike tessera's models: ModuleDict blocks called one by one, one block called twice,
    a weight used directly in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"inp": nn.Linear(6, 8), "mix": nn.Linear(8, 8)})
        self.head_weight = nn.Parameter(torch.randn(3, 8) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks["inp"](x))
        h = torch.tanh(self.blocks["mix"](torch.tanh(self.blocks["mix"](h))))
        return F.linear(h, self.head_weight)


def _model_fn(dtype=torch.float32):
    def make() -> nn.Module:
        torch.manual_seed(11)
        return OddNet().to(dtype)

    return make


def _data(num: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num, 6, generator=g, dtype=torch.float64)
    y = (x[:, :3] @ torch.randn(3, 3, generator=g, dtype=torch.float64)).argmax(1)
    return x.to(dtype), y


def _local_sgd(model, x, y, *, round_index, client, epochs, batch_size, lr, mu, seed):
    """One client's local training, the plain way: torch.optim.SGD, prox term through autograd."""
    anchor = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = client_generator(seed, round_index, client)
    n = len(y)
    step = n if batch_size is None else batch_size
    for _ in range(epochs):
        order = torch.arange(n) if batch_size is None else torch.randperm(n, generator=generator)
        for start in range(0, n, step):
            batch = order[start : start + step]
            loss = F.cross_entropy(model(x[batch]), y[batch])
            if mu:
                prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
                loss = loss + mu / 2 * prox
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@pytest.mark.parametrize(
    ("algorithm", "mu", "batch_size"),
    [("fedavg", 0.0, 7), ("fedprox", 0.5, 7), ("fedavg", 0.0, None)],
)
def test_one_client_equals_local_sgd(algorithm, mu, batch_size):
    """FedAvg/FedProx with a single client is that client's local SGD, round after round."""
    x, y = _data(45)  # 45 = 6 batches of 7 + a partial one of 3
    settings = dict(epochs=2, batch_size=batch_size, lr=0.3, mu=mu, seed=4)
    history = simulate(
        _model_fn(), (x, y), (x, y), partition=[np.arange(45)], num_clients=1,
        clients_per_round=1, local_epochs=2, batch_size=batch_size, lr=0.3, rounds=3,
        algorithm=algorithm, mu=mu, seed=4,
    )  # fmt: skip
    results = {}
    for dtype in (torch.float32, torch.float64):
        model = _model_fn(dtype)()
        for round_index in (1, 2, 3):
            _local_sgd(model, x.to(dtype), y, round_index=round_index, client=0, **settings)
        results[dtype] = model.state_dict()
    check_close(history.state_dict, results[torch.float32], results[torch.float64], what=algorithm)
    assert len(history.accuracy) == len(history.loss) == 4 and len(history.round_s) == 3


def test_weighted_mean_is_exact_against_a_loop(caplog):
    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(4)]
    weights = [3.0, 17.0, 1.0, 40.0]
    total, weight_sum = torch.zeros(50, dtype=torch.float64), 0.0
    for update, weight in zip(updates, weights):
        total += update * weight
        weight_sum += weight
    reports = [(k, make_report(u, w)) for k, (u, w) in enumerate(zip(updates, weights))]
    assert torch.equal(mean_of_reports(reports, 50), total / weight_sum)
    # bad reports are rejected (and logged, naming the client); the others still count
    bad = reports[1][1].clone()
    bad[5] = float("nan")
    with caplog.at_level(logging.WARNING):
        mean = mean_of_reports([reports[0], (7, bad), (8, torch.zeros(3)), *reports[2:]], 50)
    assert "client 7" in caplog.text and "non-finite" in caplog.text
    assert "client 8" in caplog.text and "shape" in caplog.text
    keep = [0, 2, 3]
    expected = sum(updates[k] * weights[k] for k in keep) / sum(weights[k] for k in keep)
    torch.testing.assert_close(mean, expected, rtol=1e-15, atol=1e-15)


def test_fedavg_round_is_the_count_weighted_average_of_client_models():
    x, y = _data(8 + 20 + 36, seed=1)
    parts = [np.arange(0, 8), np.arange(8, 28), np.arange(28, 64)]  # unequal: weights matter
    history = simulate(
        _model_fn(), (x, y), (x, y), partition=parts, num_clients=3, clients_per_round=3,
        local_epochs=2, batch_size=None, lr=0.5, rounds=1, seed=2,
    )  # fmt: skip
    results = {}
    for dtype in (torch.float32, torch.float64):
        start = _model_fn(dtype)()
        averaged = {k: torch.zeros_like(v) for k, v in start.state_dict().items()}
        for client, part in enumerate(parts):
            model = copy.deepcopy(start)
            settings = dict(epochs=2, batch_size=None, lr=0.5, mu=0.0, seed=2)
            _local_sgd(model, x[part].to(dtype), y[part], round_index=1, client=client, **settings)
            for k, v in model.state_dict().items():
                averaged[k] += v * (len(part) / 64)
        results[dtype] = averaged
    check_close(history.state_dict, results[torch.float32], results[torch.float64], what="fedavg")


def test_fedsgd_is_one_full_batch_step_per_round():
    x, y = _data(50, seed=2)
    parts = [np.arange(0, 5), np.arange(5, 20), np.arange(20, 50)]
    history = simulate(
        _model_fn(), (x, y), (x, y), partition=parts, num_clients=3, clients_per_round=3,
        lr=0.7, rounds=2, algorithm="fedsgd", seed=0,
    )  # fmt: skip
    results = {}
    for dtype in (torch.float32, torch.float64):
        model = _model_fn(dtype)()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.7)
        for _ in range(2):  # the gradient of the mean loss over all clients' samples
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(dtype)), y).backward()
            optimizer.step()
        results[dtype] = model.state_dict()
    check_close(history.state_dict, results[torch.float32], results[torch.float64], what="fedsgd")


def test_simulate_history_and_learning():
    x, y = _data(600, seed=3)
    history = simulate(
        _model_fn(), (x[:500], y[:500]), (x[500:], y[500:]), partition="iid", num_clients=20,
        clients_per_round=4, rounds=6, lr=0.5, dropout=0.25, seed=1,
    )  # fmt: skip
    assert isinstance(history, History)
    assert len(history.accuracy) == len(history.loss) == 7
    assert len(history.round_s) == len(history.bytes_up) == len(history.bytes_down) == 6
    assert history.epsilon == []
    numel = sum(p.numel() for p in OddNet().parameters())
    # 4 selected get the model (4 bytes a float), 3 report an update and their weight
    assert history.bytes_down == [4 * numel * 4] * 6
    assert history.bytes_up == [3 * (numel * 4 + 8)] * 6
    assert all(len(s) == 4 and len(d) == 1 and set(d) <= set(s) for s, d in
               zip(history.selected, history.dropped))  # fmt: skip
    assert history.loss[-1] < history.loss[0]


def test_simulate_takes_its_knobs_as_a_config_or_as_keywords():
    """`simulate(config=SimulationConfig(...))` is the keyword form; keywords override a config's
    fields; an unknown knob or a bad value is refused before anything is built."""
    x, y = _data(40)
    knobs = dict(partition="iid", num_clients=4, clients_per_round=2, rounds=2, lr=0.2, seed=3)
    by_keywords = simulate(_model_fn(), (x, y), (x, y), **knobs)
    by_config = simulate(_model_fn(), (x, y), (x, y), config=SimulationConfig(**knobs))
    assert by_config.selected == by_keywords.selected and by_config.loss == by_keywords.loss
    for name, value in by_keywords.state_dict.items():
        assert torch.equal(by_config.state_dict[name], value), name
    overridden = simulate(
        _model_fn(), (x, y), (x, y), SimulationConfig(**{**knobs, "lr": 0.01}), lr=0.2
    )
    assert overridden.loss == by_keywords.loss
    built = []
    with pytest.raises(TypeError, match="'rounds_'"):
        simulate(lambda: built.append(1), (x, y), (x, y), rounds_=2)
    with pytest.raises(ValueError, match="clients_per_round=5"):
        SimulationConfig(num_clients=4, clients_per_round=5)
    with pytest.raises(TypeError, match="SimulationConfig"):
        simulate(lambda: built.append(1), (x, y), (x, y), config=dict(knobs))
    assert not built


def test_simulate_bad_input(caplog):
    x, y = _data(40)
    data = (x, y)
    with pytest.raises(ValueError, match="clients_per_round=11"):
        simulate(_model_fn(), data, data, num_clients=10, clients_per_round=11, partition="iid")
    with pytest.raises(ValueError, match="unknown algorithm 'fedadam'"):
        simulate(_model_fn(), data, data, num_clients=4, clients_per_round=2, algorithm="fedadam")
    with pytest.raises(ValueError, match="unknown partition 'zipf'"):
        simulate(_model_fn(), data, data, num_clients=4, clients_per_round=2, partition="zipf")
    with pytest.raises(ValueError, match="dropout"):
        simulate(_model_fn(), data, data, num_clients=4, clients_per_round=2, dropout=1.0)
    with pytest.raises(ValueError, match="partition has 2 clients"):
        simulate(_model_fn(), data, data, num_clients=4, clients_per_round=2, partition=[[0], [1]])
    with pytest.raises(ValueError, match="40 inputs"):
        simulate(_model_fn(), data, (x, y[:3]), num_clients=4, clients_per_round=2)
    assert ALGORITHMS == ("fedavg", "fedprox", "fedsgd")
    # A client whose data make its update non-finite is rejected and logged; the round goes on.
    poisoned = x.clone()
    poisoned[:10] = float("inf")
    parts = [np.arange(0, 10), np.arange(10, 25), np.arange(25, 40)]
    for secure in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            history = simulate(
                _model_fn(), (poisoned, y), data, partition=parts, num_clients=3,
                clients_per_round=3, rounds=1, batch_size=None, secure_aggregation=secure,
            )  # fmt: skip
        assert all(torch.isfinite(v).all() for v in history.state_dict.values())
        assert history.state_dict["head_weight"].ne(_model_fn()().head_weight).any()
        if not secure:
            assert "client 0" in caplog.text and "non-finite" in caplog.text


# ---------------------------------------------------------------------------------------------
# secure aggregation

PARTICIPANTS = [3, 5, 8, 13, 21, 34]  # ids need not be contiguous
WIDE = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]  # 12 clients for 4-neighbour graphs


def _reports(length: int = 300, seed: int = 0, ids=PARTICIPANTS) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {u: torch.randn(length, generator=g, dtype=torch.float64) * 40 for u in ids}


def _exact_sum(reports: dict[int, torch.Tensor], survivors, length: int) -> list[float]:
    """The sum of each survivor's fixed-point rounding (round half to even, like np.rint),
    computed with Python integers."""
    exact = [sum(round(float(reports[u][i]) * 2**32) for u in survivors) for i in range(length)]
    return [value / 2**32 for value in exact]


@pytest.mark.parametrize(
    "ids, neighbours, drops",
    [
        (PARTICIPANTS, None, ([], [5], [5, 34])),  # threshold 4 of 6: up to 2 may drop
        # SecAgg+: 4 neighbours, shares 3-of-5 (a client and its neighbours): any 2 may drop
        (WIDE, 4, ([], [7], [2, 37])),
    ],
)
def test_secure_sum_equals_plain_sum_with_and_without_dropouts(ids, neighbours, drops):
    reports = _reports(ids=ids)
    for dropped in drops:
        survivors = [u for u in ids if u not in dropped]
        result = secure_sum(
            {u: reports[u] for u in survivors}, participants=ids, neighbours=neighbours
        )
        # Exact: masks and dropped clients leave no trace.
        assert result.total.tolist() == _exact_sum(reports, survivors, 300), dropped
        # Against the float64 sum: each report rounds by <= 2^-33 per coordinate, and the float64
        # sum of n terms of magnitude M rounds by <= n * eps64 * M.
        plain = sum(reports[u] for u in survivors)
        magnitude = sum(reports[u].abs() for u in survivors)
        bound = len(survivors) * 2.0**-33 + len(survivors) * 2.0**-52 * magnitude
        assert ((result.total - plain).abs() <= bound).all()
        assert result.bytes_up > len(survivors) * 300 * 8 and result.bytes_down > 0


def test_secagg_plus_sends_each_client_only_its_neighbours():
    """With k = 4 of 12, a client's roster, shares and masks cover 4 others, not 11: its upload
    of encrypted shares shrinks in proportion, and the server's graph is the one it routes."""
    reports = _reports(length=50, ids=WIDE)
    full = secure_sum(reports, participants=WIDE)
    sparse = secure_sum(reports, participants=WIDE, neighbours=4)
    assert full.total.tolist() == sparse.total.tolist() == _exact_sum(reports, WIDE, 50)
    masked = 12 * 50 * 8
    assert (sparse.bytes_up - masked) * 11 < (full.bytes_up - masked) * 5


def test_harary_graph_is_symmetric_regular_and_survives_k_minus_1_removals():
    """H(k, n) over a random order: symmetric (the masks cancel), k-regular (odd k with odd n:
    k + 1), and k-vertex-connected: removing any k - 1 clients leaves the rest connected."""
    import itertools

    from tessera.federated._graph import degree, harary_graph

    for count, k in [(12, 4), (12, 3), (9, 3), (7, 2), (6, 5), (6, 9)]:
        clients = [10 * u + 1 for u in range(count)]
        graph = harary_graph(clients, k, np.random.default_rng(count + k))
        expected = degree(k, count)
        assert expected == min(k + (k % 2 and count % 2), count - 1)
        assert sorted(graph) == clients
        for u, vs in graph.items():
            assert u not in vs and len(vs) == expected, (count, k, u)
            assert all(u in graph[v] for v in vs), (count, k, u)  # symmetric
        for removed in itertools.combinations(clients, expected - 1):
            rest = [u for u in clients if u not in removed]
            reached, frontier = {rest[0]}, [rest[0]]
            while frontier:
                frontier = [v for u in frontier for v in graph[u] - set(removed) - reached]
                reached.update(frontier)
            assert reached == set(rest), (count, k, removed)
    orders = {tuple(sorted(harary_graph(WIDE, 4, np.random.default_rng(s))[2])) for s in range(8)}
    assert len(orders) > 1  # the server draws a different graph per round


def _run_round(server: SecAggServer, reports, reporting) -> tuple[dict, dict, dict, dict]:
    """Rounds 0-2 of a hand-driven round: every participant shares keys, `reporting` mask;
    returns the clients, their inboxes, quantised reports and masked inputs."""
    clients = {u: SecAggClient(u) for u in server.participants}
    server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    inboxes = server.route_shares(
        {u: c.share_keys(server.neighbourhood(u), server.threshold) for u, c in clients.items()}
    )
    quantized = {u: quantize(reports[u]) for u in reporting}
    masked = {u: clients[u].masked_input(quantized[u], inboxes[u]) for u in reporting}
    return clients, inboxes, quantized, masked


def test_secure_sum_fails_cleanly_beyond_the_threshold():
    reports = _reports(length=20)
    survivors = PARTICIPANTS[:3]  # 3 of 6 report; the default threshold is a majority, 4
    with pytest.raises(SecureAggregationError, match="only 3 of 6 clients sent their masked"):
        secure_sum({u: reports[u] for u in survivors}, participants=PARTICIPANTS)
    # an explicit lower threshold lets the same round through, exactly
    result = secure_sum({u: reports[u] for u in survivors}, participants=PARTICIPANTS, threshold=3)
    assert result.total.tolist() == _exact_sum(reports, survivors, 20)
    with pytest.raises(ValueError, match="non-participants"):
        secure_sum({99: reports[3]}, participants=PARTICIPANTS)
    with pytest.raises(ValueError, match=r"reports of different shapes \[\(19,\), \(20,\)\]"):
        secure_sum({**reports, PARTICIPANTS[0]: reports[PARTICIPANTS[0]][:19]},
                   participants=PARTICIPANTS)  # fmt: skip
    with pytest.raises(ValueError, match="threshold 6 must be in 1..5, the holders"):
        secure_sum(reports, participants=PARTICIPANTS, neighbours=4, threshold=6)
    # SecAgg+: 9 of 12 report, far above the threshold overall, but one client lost 3 of its 4
    # neighbours: its seed has 2 surviving holders of 3 needed, and the round stops before
    # anyone is asked for a share.
    server = SecAggServer(WIDE, neighbours=4, rng=np.random.default_rng(1))
    _, _, _, masked = _run_round(server, _reports(length=20, ids=WIDE), WIDE)
    victim = WIDE[0]
    gone = sorted(server.graph[victim])[:3]
    with pytest.raises(
        SecureAggregationError, match=f"client {victim}'s seed has only 2 surviving"
    ):
        server.collect_masked({u: m for u, m in masked.items() if u not in gone})
    for bad in (dict(neighbours=1), dict(neighbours=True), dict(threshold=0)):
        with pytest.raises(ValueError, match="SecAggConfig"):
            SecAggConfig(**bad)


@pytest.mark.parametrize("ids, neighbours", [(PARTICIPANTS, None), (WIDE, 4)])
def test_a_masked_input_is_not_the_clients_update(ids, neighbours):
    from tessera.federated import _shamir

    reports = {u: r.abs() for u, r in _reports(length=2000, ids=ids).items()}  # small positive
    server = SecAggServer(ids, neighbours=neighbours)
    clients, inboxes, quantized, masked = _run_round(server, reports, ids)
    record = 16 + 2 * _shamir.SHARE_BYTES  # sender, recipient, two shares
    for u in ids:
        # Unmasked, every value is below 2^40; masked, the values spread over the whole ring:
        # about half the coordinates have the top bit set, almost none stays unchanged.
        assert (quantized[u] < 2**40).all()
        assert (masked[u] == quantized[u]).mean() < 0.001
        assert 0.4 < (masked[u] >= 2**63).mean() < 0.6
        # the server routes ciphertexts (nonce, record, tag), never share values
        assert all(isinstance(c, bytes) and len(c) == 12 + record + 16 for c in inboxes[u].values())
        assert set(inboxes[u]) == set(server.graph[u])
    # One client drops after sharing (the real protocol: masked inputs already include its masks)
    dropped_client = ids[0]
    dropped, survivors = server.collect_masked({u: masked[u] for u in ids[1:]})
    assert dropped == [dropped_client] and survivors == ids[1:]
    responses = {u: clients[u].unmask(dropped, survivors) for u in survivors}
    # a survivor reveals the dropped client's mask key and the survivors' seeds, never both
    for u, r in responses.items():
        holds = server.graph[u] | {u}
        assert set(r["s"]) == {dropped_client} & holds and set(r["b"]) == set(survivors) & holds
    with pytest.raises(SecureAggregationError, match="both dropped and survived"):
        clients[ids[1]].unmask([ids[2]], [ids[2], ids[3]])
    total = server.finish(responses)
    expected = sum(quantized[u].astype(object) for u in survivors)  # Python integers
    assert [int(v) for v in total] == [int(v) % 2**64 for v in expected]


def test_masked_input_is_the_protocol_formula_computed_independently():
    """y_u = x_u + PRG(b_u) + sum_{v in N(u), v > u} PRG(s_uv) - sum_{v in N(u), v < u} PRG(s_uv)
    mod 2^64, with s_uv = BLAKE2b-256(X25519(s_u, S_v) || min(S_u, S_v) || max(S_u, S_v),
    person="tessera-sa-mask") and PRG the AES-256-CTR keystream from counter block 0^96 || 2,
    recomputed here with hashlib, `cryptography`'s CTR mode and Python integers for the ring;
    N(u) the neighbours the server sent u (all others, or a subset). The shares u sent v open
    under BLAKE2b-256(X25519(c_u, C_v) || min(C_u, C_v) || max(C_u, C_v),
    person="tessera-sa-share")."""
    import hashlib

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    length = 37  # not a multiple of the AES block: the keystream's tail is used too

    def prg(seed: bytes) -> list[int]:
        start = bytes(12) + (2).to_bytes(4, "big")
        encryptor = Cipher(algorithms.AES(seed), modes.CTR(start)).encryptor()
        stream = encryptor.update(bytes(8 * length))
        return [int.from_bytes(stream[8 * i : 8 * i + 8], "little") for i in range(length)]

    def pair_key(private, public: bytes, purpose: bytes) -> bytes:
        own = private.public_key().public_bytes_raw()
        shared = private.exchange(X25519PublicKey.from_public_bytes(public))
        data = shared + min(own, public) + max(own, public)
        return hashlib.blake2b(data, digest_size=32, person=purpose).digest()

    def mask_seed(client: SecAggClient, public: bytes) -> bytes:
        return pair_key(client._s_key, public, b"tessera-sa-mask")

    ids = [3, 8, 13, 21, 34]
    for neighbours in (None, 2):
        server = SecAggServer(ids, threshold=2, neighbours=neighbours)
        clients, inboxes, _, _ = _run_round(server, _reports(length, ids=ids), [])
        reports = {u: quantize(_reports(length, ids=ids)[u]) for u in ids}
        for v, inbox in inboxes.items():
            for u, ciphertext in inbox.items():  # opens, and names sender and recipient
                key = pair_key(clients[v]._c_key, server.roster[u][0], b"tessera-sa-share")
                record = AESGCM(key).decrypt(ciphertext[:12], ciphertext[12:], None)
                assert record[:16] == u.to_bytes(8, "big") + v.to_bytes(8, "big")
        for u in ids:
            for partners in (None, [v for v in ids if v != 13]):  # 13 left after round 1
                others = [
                    v for v in sorted(server.graph[u])
                    if partners is None or v in partners
                ]  # fmt: skip
                assert len(server.graph[u]) == (4 if neighbours is None else 2)
                expected = [int(x) for x in reports[u]]
                terms = [prg(clients[u]._seed)] + [
                    [m if u < v else -m for m in prg(mask_seed(clients[u], server.roster[v][1]))]
                    for v in others
                ]
                for term in terms:
                    expected = [e + t for e, t in zip(expected, term)]
                masked = clients[u].masked_input(reports[u], inboxes[u], partners)
                assert masked.dtype == np.uint64
                assert [int(m) for m in masked] == [e % 2**64 for e in expected], (u, partners)


def test_shamir_recovers_from_any_threshold_shares_and_draws_uniform_coefficients():
    """Any t of n shares give the secrets back; the shares of holder x are f(x) for polynomials
    whose constant terms are the secret's 25-bit chunks (checked with Python integers: Lagrange
    at 0 written here); the random coefficients are uniform on GF(2^26 - 5): each of the top 8
    bits is set in half of 8,000 draws (binomial: 0.5 +- 6 sigma, sigma = 0.0056)."""
    import itertools
    import os

    from tessera.federated import _shamir

    p = 2**26 - 5
    secrets = [os.urandom(32), bytes(32), b"\xff" * 32]
    xs = [4, 9, 22, 35, 36]
    shares = _shamir.split(secrets, xs, 3)
    assert shares.shape == (5, 3, _shamir.CHUNKS) and (shares < p).all()
    for subset in itertools.combinations(range(5), 3):
        assert _shamir.combine([xs[i] for i in subset], shares[list(subset)], 3) == secrets
    for chunk in range(_shamir.CHUNKS):
        points = [(xs[i], int(shares[i, 0, chunk])) for i in (0, 2, 4)]
        value = 0
        for x_i, y_i in points:
            weight = 1
            for x_j, _ in points:
                if x_j != x_i:
                    weight = weight * x_j * pow(x_j - x_i, -1, p) % p
            value = (value + weight * y_i) % p
        assert value == int.from_bytes(secrets[0], "big") >> (25 * chunk) & (2**25 - 1)
    with pytest.raises(ValueError, match="cannot recover"):
        _shamir.combine(xs[:2], shares[:2], 3)
    values = _shamir.random_elements((8000,))
    assert ((values >= 0) & (values < p)).all()
    for bit in range(18, 26):
        fraction = ((values >> np.uint64(bit)) & np.uint64(1)).mean()
        assert abs(fraction - 0.5) < 6 * 0.0056, bit


@pytest.mark.parametrize(
    "secure, clients_per_round, dropout",
    [(True, 5, 0.4), (SecAggConfig(neighbours=4), 8, 0.25)],  # SecAgg+: 2 of 8 drop, 3-of-5
)
def test_simulate_secure_equals_plain_and_same_clients_drop(secure, clients_per_round, dropout):
    x, y = _data(200, seed=5)
    runs = {}
    for option in (False, secure):
        runs[option is secure] = simulate(
            _model_fn(), (x, y), (x, y), partition="iid", num_clients=10,
            clients_per_round=clients_per_round, rounds=1, batch_size=10, lr=0.3,
            dropout=dropout, secure_aggregation=option, seed=7,
        )  # fmt: skip
    plain, secured = runs[False], runs[True]
    assert plain.selected == secured.selected and plain.dropped == secured.dropped
    assert len(secured.dropped[0]) == 2  # recovered from the survivors' shares
    for name, value in plain.state_dict.items():
        # The weighted means differ by quantisation only (<= n * 2^-33 / samples), far below
        # float32 resolution: the float32 results differ by at most one rounding step.
        spacing = torch.from_numpy(np.spacing(value.abs().numpy()))
        assert ((secured.state_dict[name] - value).abs() <= spacing).all(), name
    assert secured.bytes_up[0] > plain.bytes_up[0]
    with pytest.raises(SecureAggregationError, match="only 2 of 5 clients"):
        simulate(
            _model_fn(), (x, y), (x, y), partition="iid", num_clients=8, clients_per_round=5,
            rounds=1, dropout=0.6, secure_aggregation=secure,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# differential privacy


def test_rdp_of_the_gaussian_mechanism_closed_form():
    orders = list(range(2, 64))
    for sigma in (0.7, 1.0, 3.0):
        alpha = np.asarray(orders, dtype=np.float64)
        closed_form = alpha / (2 * sigma**2)  # Mironov 2017, Prop. 7
        np.testing.assert_allclose(rdp_sampled_gaussian(1.0, sigma, orders), closed_form,
                                   rtol=1e-14)  # fmt: skip
        # the general (subsampled) sum tends to the same value as q -> 1
        near_one = rdp_sampled_gaussian(1 - 1e-12, sigma, orders)
        np.testing.assert_allclose(near_one, closed_form, rtol=1e-8)
    assert (rdp_sampled_gaussian(0.0, 1.0, orders) == 0).all()


def test_rdp_of_the_sampled_gaussian_against_a_numerical_integral():
    """RDP(alpha) = log E_{z ~ N(0,s^2)} [((1-q) + q N(z;1,s^2) / N(z;0,s^2))^alpha] / (alpha-1)
    (Mironov et al. 2019, sec. 3), integrated here on a fine grid in log space."""
    for q, sigma in [(0.01, 1.0), (0.2, 2.0), (0.5, 0.8)]:
        orders = [2, 3, 8, 16]
        ours = rdp_sampled_gaussian(q, sigma, orders)
        for alpha, value in zip(orders, ours):
            z = np.arange(-30 * sigma, alpha + 30 * sigma, sigma / 200)
            log_ratio = (2 * z - 1) / (2 * sigma**2)  # log N(z;1,s^2) - log N(z;0,s^2)
            log_mixture = np.logaddexp(math.log1p(-q), math.log(q) + log_ratio)
            log_f = -(z**2) / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi))
            log_f += alpha * log_mixture
            peak = log_f.max()
            integral = np.trapezoid(np.exp(log_f - peak), z)
            expected = (peak + math.log(integral)) / (alpha - 1)
            assert abs(value - expected) <= 1e-9 * abs(expected), (q, sigma, alpha)


def test_epsilon_is_sound_for_the_gaussian_mechanism():
    """RDP only bounds the privacy loss: the exact (epsilon, delta) curve of the Gaussian mechanism
    (Balle & Wang 2018, Thm. 8) must give at most delta at the accountant's epsilon."""

    def phi(t: float) -> float:
        return 0.5 * math.erfc(-t / math.sqrt(2))

    for sigma, steps, delta in [(1.0, 1, 1e-5), (4.0, 50, 1e-5), (10.0, 200, 1e-6)]:
        accountant = RDPAccountant()
        accountant.step(sigma, 1.0, num_steps=steps)
        epsilon = accountant.epsilon(delta)
        s = sigma / math.sqrt(steps)  # T Gaussian mechanisms compose to one with sigma/sqrt(T)
        exact_delta = phi(1 / (2 * s) - epsilon * s) - math.exp(epsilon) * phi(
            -1 / (2 * s) - epsilon * s
        )
        assert 0 < exact_delta <= delta, (sigma, steps, epsilon, exact_delta)
    with pytest.raises(ValueError, match="delta"):
        RDPAccountant().epsilon(0.0)


def test_epsilon_matches_a_published_figure():
    """opacus's accountant test (pytorch/opacus, opacus/tests/accountants_test.py,
    test_rdp_accountant): sigma 1.5, q 0.04, 2250 steps, delta 1e-5 -> epsilon 7.32911117143,
    minimised over orders that include fractional ones near the optimum (alpha ~ 4). Ours
    minimises over integer orders only, so it may only be larger, and by little: the curve is
    flat near its minimum (measured: +0.01%); 1e-3 absolute bounds the difference."""
    accountant = RDPAccountant()
    accountant.step(1.5, 0.04, num_steps=2250)
    assert 7.32911117143 <= accountant.epsilon(1e-5) <= 7.32911117143 + 1e-3


def test_epsilon_at_one_order_is_the_published_conversion():
    """With one order the accountant's epsilon is Balle et al. 2020, Thm. 21, in closed form:
    eps = T alpha / (2 sigma^2) + log((alpha-1)/alpha) - (log delta + log alpha) / (alpha-1)."""
    for alpha, sigma, steps, delta in [(2, 1.0, 1, 1e-5), (9, 3.0, 40, 1e-6), (32, 10.0, 5, 1e-3)]:
        accountant = RDPAccountant(orders=[alpha])
        accountant.step(sigma, 1.0, num_steps=steps)
        rdp = steps * alpha / (2 * sigma**2)
        expected = (
            rdp + math.log((alpha - 1) / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        )
        assert accountant.epsilon(delta) == pytest.approx(max(expected, 0.0), rel=1e-12)


def test_simulate_with_dp_clips_noises_and_counts_epsilon():
    x, y = _data(120, seed=6)
    parts = [np.arange(k * 12, (k + 1) * 12) for k in range(10)]  # equal sizes
    common = dict(partition=parts, num_clients=10, clients_per_round=4, rounds=3, lr=0.5, seed=3)
    dp = DPConfig(clip=0.05, noise_multiplier=1.3, delta=1e-4)
    history = simulate(_model_fn(), (x, y), (x, y), dp=dp, **common)
    accountant, expected = RDPAccountant(), []
    for _ in range(3):
        accountant.step(1.3, 4 / 10)
        expected.append(accountant.epsilon(1e-4))
    assert history.epsilon == expected and expected[0] < expected[1] < expected[2]
    # Clipping: with (almost) no noise, one round moves the model by at most `clip`.
    quiet = DPConfig(clip=0.05, noise_multiplier=1e-12)
    one = simulate(_model_fn(), (x, y), (x, y), dp=quiet, **{**common, "rounds": 1})
    start = _model_fn()().state_dict()
    moved = math.sqrt(sum(float(((one.state_dict[k] - v) ** 2).sum()) for k, v in start.items()))
    assert 0.01 < moved <= 0.05 * (1 + 1e-5)
    # Without effective clipping or noise (std 1e-21), one DP round (equal weights) is a plain
    # FedAvg round on equal clients: the float64 means differ by rounding only, so the float32
    # models by at most one rounding step. With noise they differ.
    loose = DPConfig(clip=1e9, noise_multiplier=1e-30)
    plain = simulate(_model_fn(), (x, y), (x, y), **{**common, "rounds": 1})
    same = simulate(_model_fn(), (x, y), (x, y), dp=loose, **{**common, "rounds": 1})
    for k, v in plain.state_dict.items():
        spacing = torch.from_numpy(np.spacing(v.abs().numpy()))
        assert ((same.state_dict[k] - v).abs() <= spacing).all(), k

    # Noise: with updates clipped to nothing, one round moves each coordinate by the noise on the
    # sum over the 4 reports, N(0, (sigma * clip)^2) / 4. The sample std of 152 coordinates is
    # within 30% of it (its relative standard error is 1/sqrt(2 * 152) = 5.7%: 5 sigma).
    noisy = DPConfig(clip=1e-9, noise_multiplier=1e6)
    one = simulate(_model_fn(), (x, y), (x, y), dp=noisy, **{**common, "rounds": 1})
    moved = torch.cat([(one.state_dict[k] - v).flatten().double() for k, v in start.items()])
    assert moved.numel() == 152
    assert abs(float(moved.pow(2).mean().sqrt()) / (1e6 * 1e-9 / 4) - 1) < 0.3
    assert clip_update(torch.tensor([3.0, 4.0]), 1.0).tolist() == pytest.approx([0.6, 0.8])
    assert clip_update(torch.tensor([0.3, 0.4]), 1.0).tolist() == pytest.approx([0.3, 0.4])
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPConfig(clip=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="clip"):
        DPConfig(clip=-1.0, noise_multiplier=1.0)


# ---------------------------------------------------------------------------------------------
# deployed mode over gRPC on loopback


def _odd_model() -> nn.Module:
    torch.manual_seed(11)
    return OddNet()


class _Context:
    """Stands in for grpc.ServicerContext: abort raises, like gRPC's."""

    def abort(self, code, details):
        raise PermissionError(f"{code}: {details}")


def test_deployed_round_equals_simulated_round(tmp_path, monkeypatch):
    """3 client processes started with `python -m tessera.federated client` on loopback, with an
    http proxy in their environment that reaches nothing (as on machines that set one for
    outside traffic): a loopback address must not go through it. Once it did, and the clients
    found no server."""
    for name in ("http_proxy", "https_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    import os
    import subprocess
    import sys
    from pathlib import Path

    import tessera.federated as fl
    from tessera.federated import wire

    ServerConfig, connect, serve = fl.ServerConfig, fl.connect, fl.serve  # the package's names
    x, y = _data(45, seed=8)
    parts = [np.arange(0, 10), np.arange(10, 25), np.arange(25, 45)]
    settings = dict(local_epochs=2, batch_size=4, lr=0.3, seed=5)
    config = ServerConfig(token="s3cret", rounds=2, clients_per_round=3, quorum=3,
                          round_timeout_s=120, join_timeout_s=120, **settings)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    address = f"127.0.0.1:{port}"
    tests, root = Path(__file__).parent, Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{tests}", "OMP_NUM_THREADS": "1"}
    processes = []
    try:
        for k, p in enumerate(parts):
            torch.save((x[p], y[p]), tmp_path / f"client{k}.pt")
            command = [sys.executable, "-m", "tessera.federated", "client", "--server", address,
                       "--data", str(tmp_path / f"client{k}.pt"), "--client", str(k),
                       "--model", "test_federated:_odd_model"]  # fmt: skip
            token = {"TESSERA_FL_TOKEN": fl.client_token("s3cret", k)}  # each its own
            processes.append(subprocess.Popen(command, env={**env, **token}, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))  # fmt: skip
        # meanwhile: a wrong token and messages that could carry data are refused
        with pytest.raises(PermissionError, match="wrong token"):
            connect(address, _odd_model, (x, y), client=9, token="guess", idle_timeout_s=3)
        numel, token = server.vector.numel(), fl.client_token("s3cret", 9)
        for header, payload in [
            ({"kind": "join", "token": token, "client": 9, "inputs": [1.0]}, None),
            ({"kind": "task", "token": token, "client": 9}, np.zeros(3)),
            ({"kind": "report", "token": token, "client": 9, "round": 1, "weight": 1.0},
             np.zeros(numel + 1)),
        ]:  # fmt: skip
            with pytest.raises(PermissionError, match="refused"):
                server.handle(wire.encode(header, payload), _Context())
        history = server.run()
        for process in processes:
            output, _ = process.communicate(timeout=60)
            assert process.returncode == 0, output
            assert "trained in 2 rounds" in output
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        grpc_server.stop(0)
    assert history.reported == [[0, 1, 2], [0, 1, 2]]
    assert len(server.refused) == server.refused_count == 4  # the token, the three messages
    simulated = simulate(
        _odd_model, (x, y), (x, y), partition=parts, num_clients=3, clients_per_round=3,
        rounds=2, **settings,
    )  # fmt: skip
    for name, value in simulated.state_dict.items():  # same code, same order: bit for bit
        assert torch.equal(history.state_dict[name], value), name
    with pytest.raises(ConnectionError, match="no server"):
        connect(address, _odd_model, (x, y), client=0, token=token, connect_timeout_s=0.5)


def test_fl_server_command_reads_its_config_and_times_out_cleanly(tmp_path):
    from tessera.federated.cli import load_model_fn, main

    config = tmp_path / "server.yaml"
    config.write_text(
        "model: test_federated:_odd_model\naddress: 127.0.0.1:0\ntoken: t\nrounds: 1\n"
        "clients_per_round: 2\njoin_timeout_s: 0.3\n"
    )
    with pytest.raises(TimeoutError, match="only 0 clients joined in 0.3 s"):
        main(["server", "--config", str(config)])
    assert load_model_fn("test_federated:_odd_model") is _odd_model
    with pytest.raises(ValueError, match="package.module:function"):
        load_model_fn("no_colon")
    config.write_text("model: test_federated:_odd_model\ntoken: t\nalgorithm: fedadam\n")
    with pytest.raises(ValueError, match="unknown algorithm 'fedadam'"):
        main(["server", "--config", str(config)])
    # secure_aggregation as a mapping of SecAggConfig fields (SecAgg+), checked on construction
    config.write_text(
        "model: test_federated:_odd_model\ntoken: t\nthreshold: 3\n"
        "secure_aggregation: {neighbours: 4, threshold: 2}\n"
    )
    with pytest.raises(ValueError, match="threshold=3 contradicts SecAggConfig's threshold=2"):
        main(["server", "--config", str(config)])


def test_deployed_server_rejects_a_bad_update_and_the_round_goes_on(caplog):
    """One client in a thread trains honestly, another sends a non-finite report: the server
    logs and drops it, and the round counts with the quorum of one (no processes: quick)."""
    import threading

    import grpc

    from tessera.federated import wire
    from tessera.federated.deployed import METHOD, ServerConfig, client_token, connect, serve

    x, y = _data(20, seed=9)
    config = ServerConfig(token="t", rounds=1, clients_per_round=2, quorum=1, batch_size=None,
                          round_timeout_s=60, join_timeout_s=60)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    address = f"127.0.0.1:{port}"
    good = threading.Thread(
        target=connect, args=(address, _odd_model, (x, y)),
        kwargs=dict(client=0, token=client_token("t", 0), idle_timeout_s=60), daemon=True,
    )  # fmt: skip

    def bad_client() -> None:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD)

            def send(header, payload=None):
                message = wire.encode({**header, "token": client_token("t", 1), "client": 1},
                                      payload)  # fmt: skip
                return wire.decode(call(message, timeout=30))[0]

            send({"kind": "join"})
            while (task := send({"kind": "task"}))["kind"] != "train":
                threading.Event().wait(0.02)
            update = np.full(server.vector.numel(), np.nan, dtype=np.float32)
            header = {"kind": "report", "round": task["round"], "weight": 20.0}
            assert send(header, update)["kind"] == "received"

    bad = threading.Thread(target=bad_client, daemon=True)
    try:
        good.start()
        bad.start()
        with caplog.at_level(logging.WARNING):
            history = server.run()
        good.join(timeout=30)
        bad.join(timeout=30)
    finally:
        grpc_server.stop(0)
    assert history.reported == [[0]]  # client 1's report did not count
    assert "rejected the update of client 1" in caplog.text and "non-finite" in caplog.text
    # The model moved by client 0's update alone: one full-batch SGD step on its data. The server
    # adds the float32 difference w_local - w_global (one rounding, <= one spacing of the larger)
    # to w_global in float64 and rounds to float32 (<= half a spacing): 2 spacings bound both.
    model = _odd_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    for name, value in model.state_dict().items():
        larger = torch.maximum(value.abs(), start[name].abs())
        spacing = torch.from_numpy(np.spacing(larger.numpy()))
        assert ((history.state_dict[name] - value).abs() <= 2 * spacing).all(), name
        assert not torch.equal(value, start[name])


def _round_with_client_threads(server, grpc_server, address, x, y, parts, extra=(),
                               model_fn=_odd_model):  # fmt: skip
    """Run the server's rounds with one `connect` client thread per part (plus `extra` threads);
    the server's secret is "t"; stop the gRPC server whatever happens; return its history."""
    import threading

    from tessera.federated.deployed import client_token, connect

    threads = [*extra] + [
        threading.Thread(
            target=connect, args=(address, model_fn, (x[p], y[p])),
            kwargs=dict(client=k, token=client_token("t", k), idle_timeout_s=60),
        )
        for k, p in enumerate(parts)
    ]  # fmt: skip
    for thread in threads:
        thread.daemon = True
    try:
        for thread in threads:
            thread.start()
        history = server.run()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        grpc_server.stop(0)
    return history


@pytest.mark.parametrize(
    "dp", [None, DPConfig(clip=0.1, noise_multiplier=0.8, delta=1e-3, insecure_noise_seed=6)]
)
def test_deployed_secure_aggregation_equals_simulated_secure_aggregation(dp):
    """Clients in threads (quick): the four secure-aggregation phases over gRPC give the same
    quantised sum as simulation, so the same model bit for bit; with DP too (clients clip, the
    server noises the sum, here from the same fixed testing seed, and counts the same epsilon)."""

    from tessera.federated.deployed import ServerConfig, serve

    x, y = _data(40, seed=10)
    parts = [np.arange(0, 8), np.arange(8, 20), np.arange(20, 40)]
    settings = dict(local_epochs=1, batch_size=5, lr=0.3, seed=2)
    config = ServerConfig(token="t", rounds=2, clients_per_round=3, quorum=2, dp=dp,
                          secure_aggregation=True, round_timeout_s=60, join_timeout_s=60,
                          **settings)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    history = _round_with_client_threads(server, grpc_server, f"127.0.0.1:{port}", x, y, parts)
    assert history.reported == [[0, 1, 2], [0, 1, 2]]
    simulated = simulate(
        _odd_model, (x, y), (x, y), partition=parts, num_clients=3, clients_per_round=3,
        rounds=2, secure_aggregation=True, dp=dp, **settings,
    )  # fmt: skip
    for name, value in simulated.state_dict.items():
        assert torch.equal(history.state_dict[name], value), name
    assert history.epsilon == simulated.epsilon and len(history.epsilon) == (0 if dp is None else 2)


def test_deployed_secagg_plus_equals_simulated_and_sends_only_neighbours_keys(monkeypatch):
    """SecAgg+ over gRPC, 5 client threads, 2 neighbours each: every client is sent 3 public keys
    (its neighbours' and its own), not 5, and the sum, hence the model, is the simulated one."""
    from tessera.federated.deployed import ServerConfig, serve

    rosters: list[int] = []
    share_keys = SecAggClient.share_keys

    def recording(self, roster, threshold):
        rosters.append(len(roster))
        return share_keys(self, roster, threshold)

    monkeypatch.setattr(SecAggClient, "share_keys", recording)
    x, y = _data(50, seed=12)
    parts = [np.arange(10 * k, 10 * k + 10) for k in range(5)]
    settings = dict(local_epochs=1, batch_size=5, lr=0.3, seed=3)
    config = ServerConfig(token="t", rounds=1, clients_per_round=5, quorum=5,
                          secure_aggregation=SecAggConfig(neighbours=2), round_timeout_s=60,
                          join_timeout_s=60, **settings)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    history = _round_with_client_threads(server, grpc_server, f"127.0.0.1:{port}", x, y, parts)
    assert history.reported == [[0, 1, 2, 3, 4]] and rosters == [3] * 5
    simulated = simulate(
        _odd_model, (x, y), (x, y), partition=parts, num_clients=5, clients_per_round=5,
        rounds=1, secure_aggregation=SecAggConfig(neighbours=2), **settings,
    )  # fmt: skip
    for name, value in simulated.state_dict.items():
        assert torch.equal(history.state_dict[name], value), name
    with pytest.raises(ValueError, match="contradicts"):
        ServerConfig(token="t", secure_aggregation=SecAggConfig(threshold=2), threshold=3)


def test_deployed_secure_round_survives_a_client_that_drops_after_sharing_keys():
    """Client 3 advertises keys and sends its encrypted shares, then vanishes: the survivors'
    shares of its mask key remove its pairwise masks, and the result is the simulated round of
    the three others, bit for bit."""
    import threading

    import grpc

    from tessera.federated import wire
    from tessera.federated.deployed import METHOD, ServerConfig, client_token, serve

    x, y = _data(30, seed=11)
    parts = [np.arange(0, 6), np.arange(6, 16), np.arange(16, 30)]
    settings = dict(local_epochs=1, batch_size=None, lr=0.3, seed=4)
    config = ServerConfig(token="t", rounds=1, clients_per_round=4, quorum=3,
                          secure_aggregation=True, round_timeout_s=4, join_timeout_s=60,
                          **settings)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    address = f"127.0.0.1:{port}"

    def dropper() -> None:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD)

            def send(header):
                message = wire.encode({**header, "token": client_token("t", 3), "client": 3})
                return wire.decode(call(message, timeout=30))[0]

            send({"kind": "join"})
            secagg = SecAggClient(3)
            while (task := send({"kind": "task"}))["kind"] != "keys":
                threading.Event().wait(0.02)
            c_public, s_public = secagg.advertise_keys()
            send({"kind": "keys", "round": 1, "c": c_public.hex(), "s": s_public.hex()})
            while (task := send({"kind": "task"}))["kind"] != "shares":
                threading.Event().wait(0.02)
            roster = {int(u): (bytes.fromhex(c), bytes.fromhex(s))
                      for u, (c, s) in task["roster"].items()}  # fmt: skip
            outbox = secagg.share_keys(roster, task["threshold"])
            send({"kind": "shares", "round": 1,
                  "outbox": {str(v): c.hex() for v, c in outbox.items()}})  # fmt: skip

    history = _round_with_client_threads(
        server, grpc_server, address, x, y, parts, extra=[threading.Thread(target=dropper)]
    )
    assert history.reported == [[0, 1, 2]]
    simulated = simulate(
        _odd_model, (x, y), (x, y), partition=parts, num_clients=3, clients_per_round=3,
        rounds=1, secure_aggregation=True, **settings,
    )  # fmt: skip
    for name, value in simulated.state_dict.items():
        assert torch.equal(history.state_dict[name], value), name


def _self_signed_certificate() -> tuple[bytes, bytes]:
    """A throw-away certificate for 127.0.0.1 and its private key (PEM)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tessera-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def test_deployed_over_tls():
    """With a certificate the server speaks TLS only: a client trusting it trains; a plaintext
    client cannot connect."""
    import threading

    from tessera.federated.deployed import ServerConfig, client_token, connect, serve

    certificate, key = _self_signed_certificate()
    x, y = _data(12, seed=12)
    config = ServerConfig(token="t", rounds=1, clients_per_round=1, batch_size=None,
                          round_timeout_s=60, join_timeout_s=60)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config, certificate=certificate, private_key=key)
    address = f"127.0.0.1:{port}"
    trained = []
    thread = threading.Thread(
        target=lambda: trained.append(connect(address, _odd_model, (x, y), client=0,
                                              token=client_token("t", 0),
                                              root_certificate=certificate, idle_timeout_s=60)),
        daemon=True,
    )  # fmt: skip
    try:
        thread.start()
        history = server.run()
        thread.join(timeout=30)
        with pytest.raises(ConnectionError, match="no server"):
            token = client_token("t", 1)
            connect(address, _odd_model, (x, y), client=1, token=token, connect_timeout_s=1)
    finally:
        grpc_server.stop(0)
    assert trained == [1] and history.reported == [[0]]


def test_tessera_fl_hands_over_to_the_federated_commands(capsys):
    from tessera.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fl", "client", "--help"])
    assert exit_info.value.code == 0
    assert "--server" in capsys.readouterr().out  # the client's own options, not tessera's
