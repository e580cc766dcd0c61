"""Federated learning: who gets in, what privacy holds, what a round survives (issue 24, 2-8).

Each test replays one finding of the review: DP noise regenerated from the public seed, the DP
denominator, SecAgg+ unmasking the sums of small groups, a token holder speaking for another
client, unbounded weights and norms, half-configured TLS, non-ASCII tokens, unbounded refusal
records, models too large for gRPC's default message size, malformed secure-aggregation messages,
client ids outside the Shamir field and secure sums that wrap. Most drive `FederatedServer.handle`
directly (no gRPC, no processes); the large-model and malformed-message tests use loopback gRPC.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch
from test_federated import (
    _Context,
    _data,
    _exact_sum,
    _model_fn,
    _odd_model,
    _reports,
    _round_with_client_threads,
    _run_round,
    _self_signed_certificate,
)
from torch import nn

from tessera.federated import (
    DPConfig,
    SecureAggregationError,
    secure_sum,
    simulate,
    wire,
)
from tessera.federated.secure_aggregation import SecAggClient, SecAggServer, quantize

SECRET = "server secret"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([v.flatten().double() for v in state.values()])


# ---------------------------------------------------------------------------------------------
# 2. differential privacy: noise from the OS, a fixed denominator


def test_dp_noise_cannot_be_regenerated_from_the_public_seed():
    """The attack: replay the public seed's draws (selection, dropouts, then the old noise seed),
    regenerate the noise and subtract it. With the update clipped to nothing the released model
    moved by the noise alone; the regenerated noise must not explain it."""
    x, y = _data(120, seed=6)
    parts = [np.arange(k * 12, (k + 1) * 12) for k in range(10)]
    common = dict(partition=parts, num_clients=10, clients_per_round=4, rounds=1, lr=0.5, seed=3)
    start = _flat(_model_fn()().state_dict())
    noisy = DPConfig(clip=1e-9, noise_multiplier=1e6)
    released = _flat(simulate(_model_fn(), (x, y), (x, y), dp=noisy, **common).state_dict) - start
    rng = np.random.default_rng(3)
    selected = sorted(int(c) for c in rng.choice(10, 4, replace=False))
    rng.choice(selected, 0, replace=False)
    generator = torch.Generator().manual_seed(int(rng.integers(2**63)))
    regenerated = torch.randn(len(start), generator=generator, dtype=torch.float64) * 1e-3 / 4
    assert float(released.norm()) > 0.5 * float(regenerated.norm())  # the noise is there
    # 152 coordinates: an unrelated draw correlates by about 1/sqrt(152) = 0.08 (0.4: 5 sigma)
    assert abs(float(torch.corrcoef(torch.stack([released, regenerated]))[0, 1])) < 0.4
    assert float((released - regenerated).norm()) > 0.5 * float(released.norm())
    # Fresh OS entropy every run: the same seed gives different noise ...
    again = _flat(simulate(_model_fn(), (x, y), (x, y), dp=noisy, **common).state_dict) - start
    assert not torch.equal(again, released)
    # ... unless the documented testing option fixes it.
    fixed = DPConfig(clip=1e-9, noise_multiplier=1e6, insecure_noise_seed=17)
    runs = [simulate(_model_fn(), (x, y), (x, y), dp=fixed, **common) for _ in range(2)]
    assert torch.equal(_flat(runs[0].state_dict), _flat(runs[1].state_dict))
    with pytest.raises(ValueError, match="insecure_noise_seed"):
        DPConfig(clip=1.0, noise_multiplier=1.0, insecure_noise_seed=-1)


def test_os_gaussian_noise_has_the_normal_moments():
    """The CSPRNG's Box-Muller draws: mean 0, variance 1, normal tails (200k draws).

    Bounds from the sampling spread at n = 200k: the mean's standard error is 1/sqrt(n) =
    0.0022 (bound 0.02: 9 sigma), the variance's sqrt(2/n) = 0.0032 (6 sigma), the tail
    share's sqrt(0.05 * 0.95 / n) = 0.0005 (10 sigma); a uniform draw of variance 1 has 0
    beyond 1.96 instead of 5%, a halved or doubled scale moves the variance by 0.75 or 3."""
    from tessera.federated.privacy import gaussian_noise

    draws = gaussian_noise(200_001, DPConfig(clip=1.0, noise_multiplier=1.0), round_index=1)
    assert draws.dtype == torch.float64 and draws.shape == (200_001,)
    assert abs(float(draws.mean())) < 0.02 and abs(float(draws.var()) - 1) < 0.02
    assert abs(float((draws.abs() > 1.96).double().mean()) - 0.05) < 0.005


def test_dp_divides_the_noisy_sum_by_the_expected_number_of_reports():
    """McMahan et al. 2018: the noisy sum is divided by the expected number of reports (the
    clients per round), not by how many arrived, which the accountant does not cover. One of
    four clients drops: the DP round (no effective clip or noise, equal weights) moves the model
    3/4 as far as the plain round, which averages over the 3 reports."""
    x, y = _data(120, seed=6)
    parts = [np.arange(k * 12, (k + 1) * 12) for k in range(10)]
    common = dict(partition=parts, num_clients=10, clients_per_round=4, rounds=1, lr=0.5, seed=3,
                  dropout=0.25)  # fmt: skip
    start = _flat(_model_fn()().state_dict())
    plain = simulate(_model_fn(), (x, y), (x, y), **common)
    loose = DPConfig(clip=1e9, noise_multiplier=1e-30, insecure_noise_seed=0)
    private = simulate(_model_fn(), (x, y), (x, y), dp=loose, **common)
    assert plain.dropped == private.dropped and len(private.dropped[0]) == 1
    plain_moved, private_moved = _flat(plain.state_dict) - start, _flat(private.state_dict) - start
    assert float(plain_moved.abs().max()) > 1e-3
    # the models hold float32 weights: each side is rounded to within half a float32 ulp of
    # the largest weight, so two ulps bound their difference (a wrong denominator: 1e-3 off)
    ulps = 2 * torch.finfo(torch.float32).eps * float(start.abs().max())
    assert torch.allclose(private_moved, 0.75 * plain_moved, rtol=0, atol=ulps)


# ---------------------------------------------------------------------------------------------
# 3. SecAgg+: no unmasking of disconnected groups


class _Ring:
    """Stands in for the server's generator: the Harary graph's ring in a chosen order."""

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def permutation(self, count: int) -> np.ndarray:
        assert count == len(self.order)
        return np.asarray(self.order)


def test_secagg_plus_refuses_to_unmask_a_disconnected_survivor_graph():
    """The review's case: 10 clients, k = 4, threshold 3, clients 0, 2, 6, 9 drop. Every secret
    has 3 surviving holders, but the survivors split into {1, 4, 8} and {3, 5, 7}: unmasking
    would give the server each group's sum. Refused; a connected survivor graph goes through."""
    clients = list(range(10))
    ring = [1, 4, 8, 0, 2, 3, 5, 7, 6, 9]
    reports = _reports(length=20, ids=clients)
    server = SecAggServer(clients, threshold=3, neighbours=4, rng=_Ring(ring))
    _, _, _, masked = _run_round(server, reports, clients)
    alive = {1, 4, 8, 3, 5, 7}
    assert all(server.graph[u] & alive <= {1, 4, 8} for u in (1, 4, 8))  # the two groups
    assert all(server.graph[u] & alive <= {3, 5, 7} for u in (3, 5, 7))
    with pytest.raises(SecureAggregationError, match=r"\[1, 4, 8\], \[3, 5, 7\]"):
        server.collect_masked({u: m for u, m in masked.items() if u in alive})
    # Clients 0 and 2 drop: the survivors stay connected around the ring; the sum is exact.
    server = SecAggServer(clients, threshold=3, neighbours=4, rng=_Ring(ring))
    clients_, _, _, masked = _run_round(server, reports, clients)
    survivors = [u for u in clients if u not in (0, 2)]
    dropped, alive_ = server.collect_masked({u: masked[u] for u in survivors})
    responses = {u: clients_[u].unmask(dropped, alive_) for u in alive_}
    from tessera.federated.secure_aggregation import dequantize

    total = dequantize(server.finish(responses))
    assert total.tolist() == _exact_sum(reports, survivors, 20)


# ---------------------------------------------------------------------------------------------
# 4, 5. deployed: identity, weights, norms, TLS, tokens, refusals


def _server(**options):
    from tessera.federated.deployed import FederatedServer, ServerConfig

    settings = dict(token=SECRET, rounds=1, clients_per_round=2, batch_size=None,
                    round_timeout_s=30, join_timeout_s=30)  # fmt: skip
    return FederatedServer(_odd_model, ServerConfig(**{**settings, **options}))


def _sender(server):
    from tessera.federated.deployed import client_token

    def send(client, header, payload=None, token=None):
        token = client_token(SECRET, client) if token is None else token
        message = wire.encode({**header, "client": client, "token": token}, payload)
        return wire.decode(server.handle(message, _Context()))

    return send


def _start(server) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(history=server.run()), daemon=True)
    thread.start()
    return thread, result


def _await(send, client, kind="train") -> tuple[dict, np.ndarray | None]:
    deadline = time.monotonic() + 30
    while (task := send(client, {"kind": "task"}))[0]["kind"] != kind:
        assert time.monotonic() < deadline, task[0]
        time.sleep(0.005)
    return task


def _honest_update(task, vector, x, y, client) -> torch.Tensor:
    from tessera.federated.client import client_generator, local_update

    return local_update(
        _odd_model(), torch.from_numpy(vector.copy()), x, y, algorithm="fedavg", epochs=1,
        batch_size=None, lr=task["lr"], mu=0.0,
        generator=client_generator(task["seed"], task["round"], client),
    )  # fmt: skip


def test_a_client_token_speaks_for_its_own_client_only():
    """The review's attack: client 1 writes client 0's id with its own token, and its report was
    accepted as client 0's while the real client 0 was marked late. Now the server refuses it,
    and client 0's report counts."""
    from tessera.federated.deployed import client_token

    server = _server()
    send = _sender(server)
    tokens = {client_token(SECRET, k) for k in range(50)}
    assert len(tokens) == 50 and client_token("other secret", 0) != client_token(SECRET, 0)
    for k in (0, 1):
        assert send(k, {"kind": "join"})[0]["kind"] == "joined"
    thread, result = _start(server)
    task, vector = _await(send, 0)
    x, y = _data(10, seed=1)
    update = _honest_update(task, vector, x, y, 0).numpy()
    forged = {"kind": "report", "round": task["round"], "weight": 1.0}
    with pytest.raises(PermissionError, match="UNAUTHENTICATED"):
        send(0, forged, np.full_like(update, 5.0), token=client_token(SECRET, 1))
    assert send(0, {**forged, "weight": 10.0}, update)[0]["kind"] == "received"
    task, vector = _await(send, 1)
    assert send(1, {**forged, "weight": 10.0}, update)[0]["kind"] == "received"
    thread.join(timeout=30)
    assert result["history"].reported == [[0, 1]]
    assert server.refused_count == 1 and "wrong token" in server.refused[-1]


def test_the_server_bounds_weights_and_with_dp_clips_updates():
    """A client claiming a huge sample count is refused (max_weight); under DP, a weight other
    than 1 is refused and an update longer than the clip is clipped by the server: one round
    moves the model by at most clip * reports / clients_per_round."""
    x, y = _data(10, seed=1)
    server = _server(max_weight=50)
    send = _sender(server)
    for k in (0, 1):
        send(k, {"kind": "join"})
    thread, result = _start(server)
    task, vector = _await(send, 0)
    update = _honest_update(task, vector, x, y, 0).numpy()
    header = {"kind": "report", "round": task["round"]}
    assert send(0, {**header, "weight": 1e6}, update)[0]["kind"] == "received"
    _await(send, 1)
    assert send(1, {**header, "weight": 10.0}, update)[0]["kind"] == "received"
    thread.join(timeout=30)
    assert result["history"].reported == [[1]]  # client 0's weight was refused
    start = _flat(_odd_model().state_dict())
    moved = _flat(result["history"].state_dict) - start
    ulps = 2 * torch.finfo(torch.float32).eps * float(start.abs().max())  # float32 weights
    assert torch.allclose(moved, torch.from_numpy(update).double(), rtol=0, atol=ulps)

    dp = DPConfig(clip=0.05, noise_multiplier=1e-12, insecure_noise_seed=0)
    server = _server(dp=dp)
    send = _sender(server)
    for k in (0, 1):
        send(k, {"kind": "join"})
    thread, result = _start(server)
    task, vector = _await(send, 0)
    assert task["clip"] == 0.05
    huge = np.full(len(vector), 1e3, dtype=np.float32)  # norm 1e3 * sqrt(152), not clipped
    assert send(0, {**header, "weight": 1.0}, huge)[0]["kind"] == "received"
    _await(send, 1)
    assert send(1, {**header, "weight": 3.0}, huge)[0]["kind"] == "received"  # DP: weight 1
    thread.join(timeout=30)
    assert result["history"].reported == [[0]]
    moved = _flat(result["history"].state_dict) - start
    assert 0.02 < float(moved.norm()) <= 0.05 / 2 * (1 + 1e-5)  # clip / clients_per_round
    with pytest.raises(ValueError, match="max_weight"):
        _server(max_weight=0.0)


def test_tls_needs_both_certificate_and_key():
    from tessera.federated.deployed import ServerConfig, serve

    certificate, key = _self_signed_certificate()
    config = ServerConfig(token=SECRET, rounds=1, clients_per_round=1)
    for half in (dict(certificate=certificate), dict(private_key=key)):
        with pytest.raises(ValueError, match="both a certificate and a private key"):
            serve(_odd_model, config, **half)


def test_non_ascii_secrets_and_tokens_are_compared_as_bytes():
    """A non-ASCII server secret works; a non-ASCII or non-string presented token is refused
    (UNAUTHENTICATED), never a TypeError that locks everyone out."""
    server = _server(token="sécret ✓ 秘密")
    from tessera.federated.deployed import client_token

    send = _sender(server)
    good = client_token("sécret ✓ 秘密", 3)
    assert send(3, {"kind": "join"}, token=good)[0]["kind"] == "joined"
    for bad in ("jéton ✓", "", 42, None, good + "0"):
        with pytest.raises(PermissionError, match="UNAUTHENTICATED"):
            send(3, {"kind": "join"}, token=bad)
    assert server.refused_count == 5


def test_refusals_are_counted_but_their_records_and_logs_are_bounded(caplog):
    """10,000 messages without a valid token: the server counts them all but keeps only the last
    reasons and logs a bounded number of warnings (not one per call)."""
    from tessera.federated.deployed import REFUSED_KEPT

    server = _server()
    send = _sender(server)
    with caplog.at_level(logging.WARNING, logger="tessera.federated.deployed"):
        for k in range(10_000):
            with pytest.raises(PermissionError):
                send(k, {"kind": "join"}, token=f"guess {k}")
    assert server.refused_count == 10_000 and len(server.refused) == REFUSED_KEPT <= 100
    assert server.refused[-1] == "client 9999: wrong token"
    warnings = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(warnings) <= 3 and "client 0: wrong token" in warnings[0].getMessage()
    assert not server._joined


# ---------------------------------------------------------------------------------------------
# 6. large models deployed


class _RssSampler:
    """The growth of this process's resident memory over a `with` block (sampled every 5 ms
    from /proc/self/statm by a thread): the block's own peak, whatever ran before it."""

    def __enter__(self) -> _RssSampler:
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.growth = self.peak - self.base

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        import os

        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(10_000, 1_000)  # 10,001,000 parameters: 40 MB in float32


def test_a_10m_parameter_model_trains_deployed():
    """gRPC's default 4 MiB limit stopped any model over ~524k parameters (float64 vectors). Now
    the limits follow the model's size and vectors travel as float32: one round of two clients
    on a 10M-parameter model gives the simulated model bit for bit, in seconds."""
    from tessera.federated.deployed import ServerConfig, serve

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 10_000, generator=g), torch.tensor([3, 700, 5, 999])
    parts = [np.arange(0, 2), np.arange(2, 4)]
    settings = dict(local_epochs=1, batch_size=None, lr=0.1, seed=1)
    config = ServerConfig(token="t", rounds=1, clients_per_round=2, quorum=2, round_timeout_s=60,
                          join_timeout_s=60, **settings)  # fmt: skip
    sampler = _RssSampler()
    began = time.perf_counter()
    with sampler:
        server, grpc_server, port = serve(_wide_model, config)
        history = _round_with_client_threads(
            server, grpc_server, f"127.0.0.1:{port}", x, y, parts, model_fn=_wide_model
        )
    elapsed = time.perf_counter() - began
    numel = 10_001_000
    assert history.reported == [[0, 1]]
    # float32 on the wire: each client got the weights once and sent one update (4 B each)
    assert 2 * 4 * numel < history.bytes_down[0] < 2 * 4 * numel * 1.01
    assert 2 * 4 * numel < history.bytes_up[0] < 2 * 4 * numel * 1.01
    # Server and two clients in one process: three models (40 MB each), float64 reports and
    # sums (80 MB each), messages in flight: hundreds of MB, not gigabytes. Seconds on 2 idle
    # cores; the bound leaves room for a loaded machine.
    assert elapsed < 60, elapsed
    assert sampler.growth < 1.5 * 2**30, sampler.growth / 2**20
    print(f"10M model: {elapsed:.1f} s, resident memory +{sampler.growth / 2**20:.0f} MiB")
    simulated = simulate(
        _wide_model, (x, y), (x[:1], y[:1]), partition=parts, num_clients=2, clients_per_round=2,
        rounds=1, **settings,
    )  # fmt: skip
    for name, value in simulated.state_dict.items():
        assert torch.equal(history.state_dict[name], value), name
    # one message per vector: past gRPC's 2 GiB ceiling (about 266M parameters) it is refused
    assert wire.message_limit(266_000_000) < 2**31
    with pytest.raises(ValueError, match="past gRPC's"):
        wire.message_limit(267_000_000)


def test_vectors_travel_as_float32_unless_float64_is_asked_for():
    """The global weights go out in `wire_dtype` and the updates come back in it; a float64 run
    over a float64 model is exact, a float32 one sends half the bytes."""
    x, y = _data(10, seed=1)
    for dtype in ("float32", "float64"):
        server = _server(wire_dtype=dtype, clients_per_round=1)
        send = _sender(server)
        send(0, {"kind": "join"})
        thread, result = _start(server)
        task, vector = _await(send, 0)
        assert task["dtype"] == dtype and vector.dtype == np.dtype(dtype)
        update = _honest_update(task, vector, x, y, 0).numpy().astype(dtype)
        header = {"kind": "report", "round": task["round"], "weight": 10.0}
        assert send(0, header, update)[0]["kind"] == "received"
        thread.join(timeout=30)
        assert result["history"].reported == [[0]]
    with pytest.raises(ValueError, match="wire_dtype"):
        _server(wire_dtype="float16")


# ---------------------------------------------------------------------------------------------
# 7. malformed secure-aggregation messages


def test_a_malformed_keys_or_shares_message_drops_that_client_only():
    """Client 3 sends keys that are not hex in round 1 and an outbox of numbers in round 2: each
    time it is dropped from the round, which the other three complete; the model is the
    simulated one of the three."""
    import grpc

    from tessera.federated.deployed import METHOD, ServerConfig, client_token, serve

    x, y = _data(30, seed=11)
    parts = [np.arange(0, 6), np.arange(6, 16), np.arange(16, 30)]
    settings = dict(local_epochs=1, batch_size=None, lr=0.3, seed=4)
    config = ServerConfig(token="t", rounds=2, clients_per_round=4, quorum=3,
                          secure_aggregation=True, round_timeout_s=20, join_timeout_s=60,
                          **settings)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    address = f"127.0.0.1:{port}"

    def rogue() -> None:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD)

            def send(header):
                message = wire.encode({**header, "token": client_token("t", 3), "client": 3})
                return wire.decode(call(message, timeout=30))[0]

            def wait(kind, round_index):
                while (task := send({"kind": "task"}))["kind"] != kind or (
                    task["round"] != round_index
                ):  # fmt: skip
                    threading.Event().wait(0.01)
                return task

            send({"kind": "join"})
            wait("keys", 1)
            send({"kind": "keys", "round": 1, "c": 7, "s": "not hex"})
            wait("keys", 2)
            c_public, s_public = SecAggClient(3).advertise_keys()
            send({"kind": "keys", "round": 2, "c": c_public.hex(), "s": s_public.hex()})
            wait("shares", 2)
            send({"kind": "shares", "round": 2, "outbox": {"0": 7, "1": ["x"]}})

    history = _round_with_client_threads(
        server, grpc_server, address, x, y, parts, extra=[threading.Thread(target=rogue)]
    )
    assert history.reported == [[0, 1, 2], [0, 1, 2]]
    simulated = simulate(
        _odd_model, (x, y), (x, y), partition=parts, num_clients=3, clients_per_round=3,
        rounds=2, secure_aggregation=True, **settings,
    )  # fmt: skip
    for name, value in simulated.state_dict.items():
        assert torch.equal(history.state_dict[name], value), name


# ---------------------------------------------------------------------------------------------
# 8. client ids and the range of secure sums


def test_secure_aggregation_validates_client_ids():
    """Client u's shares are evaluated at u + 1 in GF(2^26 - 5): -1 would evaluate at 0, the
    secret itself, and ids from 2^26 - 6 leave the field. Refused everywhere they enter."""
    from tessera.federated.secure_aggregation import MAX_CLIENT_ID

    assert MAX_CLIENT_ID == 2**26 - 6
    for bad in (-1, 2**26 - 6, 2**40):
        with pytest.raises(ValueError, match="client id"):
            SecAggServer([0, 1, bad])
        with pytest.raises(ValueError, match="client id"):
            SecAggClient(bad)
    reports = _reports(length=10, ids=[0, 5, 2**26 - 7])
    result = secure_sum(reports, participants=sorted(reports))
    assert result.total.tolist() == _exact_sum(reports, sorted(reports), 10)
    server = _server(secure_aggregation=True)
    send = _sender(server)
    for bad in (-1, 2**26 - 6):
        with pytest.raises(PermissionError, match="client id"):
            send(bad, {"kind": "join"})
    assert send(2**26 - 7, {"kind": "join"})[0]["kind"] == "joined"
    assert server._joined == {2**26 - 7}


def test_secure_sums_that_cannot_be_represented_are_refused():
    """Three reports of 1e9 summed to -1294967296 (past 2^31 with 32 fraction bits). Each report
    must now fit 2^31 / participants, so the sum cannot wrap: just inside it is exact, past it
    refused."""
    big = {u: torch.tensor([1e9, 1.0], dtype=torch.float64) for u in (0, 1, 2)}
    with pytest.raises(SecureAggregationError, match="cannot be represented"):
        secure_sum(big, participants=[0, 1, 2])
    inside = {u: torch.tensor([7e8, -7e8], dtype=torch.float64) for u in (0, 1, 2)}
    assert secure_sum(inside, participants=[0, 1, 2]).total.tolist() == [2.1e9, -2.1e9]
    with pytest.raises(SecureAggregationError, match="cannot be represented"):
        quantize(torch.tensor([7e8]), count=4)  # four such reports would reach 2.8e9
    assert quantize(torch.tensor([7e8]), count=3).view(np.int64).tolist() == [7e8 * 2**32]


def test_secure_rounds_check_the_total_weight(caplog):
    """Masked reports hide each weight, but the sum's total weight is checked: three honest
    clients of 6, 10 and 14 samples (30) exceed max_weight 9 per survivor (27), and the round is
    abandoned, the model kept; with max_weight 10 (30 allowed) the same round counts."""
    from tessera.federated.deployed import ServerConfig, serve

    x, y = _data(30, seed=11)
    parts = [np.arange(0, 6), np.arange(6, 16), np.arange(16, 30)]
    histories = {}
    for max_weight in (9, 10):
        config = ServerConfig(token="t", rounds=1, clients_per_round=3, quorum=3,
                              secure_aggregation=True, round_timeout_s=20, join_timeout_s=60,
                              batch_size=None, max_weight=max_weight)  # fmt: skip
        server, grpc_server, port = serve(_odd_model, config)
        with caplog.at_level(logging.WARNING, logger="tessera.federated.deployed"):
            histories[max_weight] = _round_with_client_threads(
                server, grpc_server, f"127.0.0.1:{port}", x, y, parts
            )
    assert histories[9].reported == [[]] and histories[10].reported == [[0, 1, 2]]
    assert "weights sum to 30.0, above max_weight 9" in caplog.text
    start = _flat(_odd_model().state_dict())
    assert torch.equal(_flat(histories[9].state_dict), start)
    assert not torch.equal(_flat(histories[10].state_dict), start)


def test_fl_token_command_prints_a_clients_token(tmp_path, capsys, monkeypatch):
    """The operator's `tessera fl token --client K` gives client K's token from the server's
    secret (its config's token, or TESSERA_FL_SECRET), which the server accepts for K only."""
    from tessera.federated.cli import main
    from tessera.federated.deployed import client_token

    config = tmp_path / "server.yaml"
    config.write_text("model: test_federated:_odd_model\ntoken: sécret\n")
    assert main(["token", "--client", "7", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == client_token("sécret", 7)
    monkeypatch.setenv("TESSERA_FL_SECRET", SECRET)
    assert main(["token", "--client", "3"]) == 0
    token = capsys.readouterr().out.strip()
    server = _server()
    send = _sender(server)
    assert send(3, {"kind": "join"}, token=token)[0]["kind"] == "joined"
    with pytest.raises(PermissionError, match="UNAUTHENTICATED"):
        send(4, {"kind": "join"}, token=token)
    monkeypatch.delenv("TESSERA_FL_SECRET")
    with pytest.raises(ValueError, match="no secret"):
        main(["token", "--client", "3"])


def test_a_client_that_cannot_decrypt_a_share_drops_out_of_that_round_only():
    """The server cannot check encrypted shares: client 3 sends client 0 a well-formed ciphertext
    that does not decrypt, then goes silent. Client 0 drops out of round 1 (which, left with 2
    survivors of threshold 3, is abandoned) instead of quitting; in round 2 it trains again."""
    import grpc

    from tessera.federated.deployed import METHOD, ServerConfig, client_token, serve

    x, y = _data(30, seed=11)
    parts = [np.arange(0, 6), np.arange(6, 16), np.arange(16, 30)]
    config = ServerConfig(token="t", rounds=2, clients_per_round=4, quorum=3, batch_size=None,
                          secure_aggregation=True, round_timeout_s=2,
                          join_timeout_s=60)  # fmt: skip
    server, grpc_server, port = serve(_odd_model, config)
    address = f"127.0.0.1:{port}"

    def rogue() -> None:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD)

            def send(header):
                message = wire.encode({**header, "token": client_token("t", 3), "client": 3})
                return wire.decode(call(message, timeout=30))[0]

            send({"kind": "join"})
            while send({"kind": "task"})["kind"] != "keys":
                threading.Event().wait(0.01)
            c_public, s_public = SecAggClient(3).advertise_keys()
            send({"kind": "keys", "round": 1, "c": c_public.hex(), "s": s_public.hex()})
            while send({"kind": "task"})["kind"] != "shares":
                threading.Event().wait(0.01)
            garbage = bytes(12 + 16 + 88 + 16).hex()  # nonce, record, tag: the right length
            send({"kind": "shares", "round": 1, "outbox": {"0": garbage}})

    history = _round_with_client_threads(
        server, grpc_server, address, x, y, parts, extra=[threading.Thread(target=rogue)]
    )
    assert history.reported == [[], [0, 1, 2]]
