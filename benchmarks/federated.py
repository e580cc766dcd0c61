"""Federated learning on scikit-learn's digits: rounds to 90% accuracy, round time, DP cost.

The task of issue 14 (McMahan et al. 2017's setting, scaled to digits): 1797 8x8 digits, 80/20
split, 100 clients, 10 per round, an MLP 64-64-10, SGD lr 0.1, B = 10. Measured:

- rounds to 90% test accuracy for FedSGD, FedAvg and FedProx (mu 0.01) on shards (2 per client)
  with E = 1 and 5, and FedAvg on Dirichlet 0.1 / 0.5 (a cap of `--max-rounds`);
- time per round: tessera's `simulate` against a plain one-process PyTorch FedAvg loop written
  here (load_state_dict, torch.optim.SGD, average the state dicts), and plain against secure
  aggregation (10% dropout) over the complete graph (Bonawitz et al. 2017) and SecAgg+'s
  `SECAGG_PLUS_K` neighbours (Bell et al. 2020), interleaved A B A B, medians, with this
  process's CPU time per round and the X25519 floor of each;
- deployed mode: `tessera fl` round time over loopback with 10 client processes, plain and
  secure (this process serves);
- accuracy after `--dp-rounds` rounds with DP at epsilon 1, 4, 8 (delta 1e-3 < 1/100 clients,
  noise multiplier found by bisection on the RDP accountant, clip 1.0), against no DP;
- Flower (`flwr[simulation]`, Ray) on the same FedAvg task, side by side in the same run
  (`flower_fedavg.py` in a subprocess, between the repeats of the tessera timings): its round
  time, start-up and rounds to 90%. It needs the `bench-fl` extra (`make bench-fl` makes a venv
  with it and runs this script); without flwr the Flower rows say so.

FedSGD against FedAvg: FedSGD takes one server step of lr per round; FedAvg's clients take
E * ceil(n_k / B) local steps each (the `local steps` column), so on this task (about 14 samples
per client) a FedAvg round is worth at most a few FedSGD rounds. The extra FedSGD rows with larger
server learning rates (McMahan et al. tune lr per method) show the ratio is not a weak baseline.

Writes results/federated.{json,md,png}. `--round-time-only` re-measures only the simulated round
times (and the deployed ones with `--deployed-rounds N`) and re-renders the rest from the last
full run's results/federated.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tessera.federated import DPConfig, RDPAccountant, SecAggConfig, partition, simulate

HERE = Path(__file__).parent
SECAGG_PLUS_K = 4
"""SecAgg+ neighbours for 10 clients per round: shares 3-of-5 (a client and its 4 neighbours);
removing fewer than 4 clients cannot disconnect the Harary graph (see secure_aggregation)."""
SECURE = "secure (10% dropout)"
SECURE_PLUS = f"secure SecAgg+ k={SECAGG_PLUS_K} (10% dropout)"
PLAIN = "plain (10% dropout)"


def _digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _rounds_to(accuracy: list[float], target: float = 0.9) -> int | None:
    return next((r for r, a in enumerate(accuracy) if a >= target), None)


def _plain_loop_round_s(train, parts, rounds: int, seed: int = 0) -> list[float]:
    """FedAvg the plain way: a model per client round, SGD, average of state dicts."""
    x, y = train
    global_model, local = _model(), _model()
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        chosen = rng.choice(len(parts), 10, replace=False)
        total = {k: torch.zeros_like(v) for k, v in global_model.state_dict().items()}
        count = sum(len(parts[c]) for c in chosen)
        for c in chosen:
            local.load_state_dict(global_model.state_dict())
            optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
            idx = torch.as_tensor(parts[c])[torch.randperm(len(parts[c]))]
            for s in range(0, len(idx), 10):
                optimizer.zero_grad()
                F.cross_entropy(local(x[idx[s : s + 10]]), y[idx[s : s + 10]]).backward()
                optimizer.step()
            for k, v in local.state_dict().items():
                total[k] += v * (len(parts[c]) / count)
        global_model.load_state_dict(total)
        times.append(time.perf_counter() - start)
    return times


def _deployed_round_ms(train, parts, rounds: int, secure: bool) -> float:
    """Median round time of `tessera fl` over loopback: this process serves, 10 client
    processes (`python -m tessera.federated client`) each hold one client's data."""
    import os
    import subprocess
    import sys
    import tempfile

    from tessera.federated.deployed import ServerConfig, client_token, serve

    config = ServerConfig(
        token="bench",
        rounds=rounds,
        clients_per_round=10,
        quorum=9,
        secure_aggregation=secure,
        round_timeout_s=60,
        join_timeout_s=300,
    )
    server, grpc_server, port = serve(_model, config)
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}",
        "OMP_NUM_THREADS": "1",
    }
    processes = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for k in range(10):
                path = Path(tmp) / f"client{k}.pt"
                torch.save((train[0][parts[k]], train[1][parts[k]]), path)
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tessera.federated",
                            "client",
                            "--server",
                            f"127.0.0.1:{port}",
                            "--data",
                            str(path),
                            "--client",
                            str(k),
                            "--model",
                            "federated:_model",
                        ],
                        env={**env, "TESSERA_FL_TOKEN": client_token("bench", k)},
                        stdout=subprocess.DEVNULL,
                    )
                )
            history = server.run()
        finally:
            for process in processes:
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
            grpc_server.stop(0)
    return 1000 * statistics.median(history.round_s[1:])


def _run_flower(python: str, rounds: int) -> dict:
    """Flower's simulation of the FedAvg task (`flower_fedavg.py`), or why it did not run."""
    probe = subprocess.run(
        [python, "-c", "import flwr, ray"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return {"error": f"flwr[simulation] not importable by {python} (the bench-fl extra)"}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
        "OMP_NUM_THREADS": "1",
    }
    start = time.perf_counter()
    done = subprocess.run(
        [python, str(HERE / "flower_fedavg.py"), "--rounds", str(rounds)],
        capture_output=True, text=True, env=env, timeout=3600, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"flower_fedavg.py failed: {done.stderr[-2000:]}"}
    result = json.loads(lines[-1])
    result["process_s"] = time.perf_counter() - start
    rounds_s = result["round_s"]
    # The first round also starts Ray's worker and loads the data there: start-up, not a round.
    result["median_round_s"] = statistics.median(rounds_s[1:])
    result["first_round_extra_s"] = rounds_s[0] - result["median_round_s"]
    return result


@contextlib.contextmanager
def _timing_secure_sum(into: list[float]):
    """Append the CPU ms of each `secure_sum` call `simulate` makes (the whole protocol, all
    clients and the server, quantisation included) to `into`, by wrapping the name simulation
    imported; everything else in a secure round is the plain round's work."""
    from tessera.federated import simulation

    original = simulation.secure_sum

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(1000 * (time.thread_time() - start))

    simulation.secure_sum = timed
    try:
        yield
    finally:
        simulation.secure_sum = original


def _key_agreement_floor_ms(clients: int, dropped: int, neighbours: int | None = None) -> dict:
    """What X25519 alone costs a simulated secure round here: every client makes two key pairs
    and agrees a share key with each of its k neighbours (k = clients - 1 for the complete
    graph); each survivor agrees a mask key with each neighbour (all finished round 1), and the
    server one per surviving neighbour of each dropped client (k, taking its neighbours alive),
    after rebuilding that client's key (one more key derivation)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    private, public = X25519PrivateKey.generate(), X25519PrivateKey.generate().public_key()
    cpu = {"timer": time.thread_time}  # CPU time, like the per-round CPU figures
    # medians, not minima: the rounds they are compared with run under the same load
    exchange = statistics.median(
        timeit.repeat(lambda: private.exchange(public), number=200, repeat=5, **cpu)
    )
    generate = statistics.median(
        timeit.repeat(X25519PrivateKey.generate, number=200, repeat=5, **cpu)
    )
    exchange, generate = exchange / 200, generate / 200
    survivors = clients - dropped
    k = clients - 1 if neighbours is None else min(neighbours, clients - 1)
    agreements = clients * k + survivors * k + dropped * min(k, survivors)
    keys = 2 * clients + dropped
    return {
        "agreements": agreements, "keys": keys, "exchange_us": 1e6 * exchange,
        "generate_us": 1e6 * generate, "ms": 1000 * (agreements * exchange + keys * generate),
    }  # fmt: skip


def _round_times(result: dict, args, train, test, common: dict) -> None:
    """Round times, interleaved A B A B: tessera, the plain loop, plain and secure (complete
    graph, SecAgg+) with 10% dropout; Flower between the first repeats (unless skipped);
    deployed rounds over loopback. Fills result's round_ms, cpu_ms_per_round, x25519 floors."""
    shard_parts = partition(train[1], 100, scheme="shards", seed=0)
    result["shard_local_steps"] = _local_steps(shard_parts, 1, 10)
    start = time.perf_counter()  # start-up: partition, two models, the round-0 evaluation
    simulate(_model, train, test, partition="shards", rounds=0, **common)
    result["tessera_startup_s"] = time.perf_counter() - start
    timing: dict[str, list[float]] = {
        k: [] for k in ("tessera", "plain loop", SECURE, SECURE_PLUS, PLAIN)
    }
    if not args.round_time_only:
        result["flower"] = {"skipped": True}
    cpu_ms: dict[str, list[float]] = {SECURE: [], SECURE_PLUS: [], PLAIN: []}
    options = {SECURE: True, SECURE_PLUS: SecAggConfig(neighbours=SECAGG_PLUS_K), PLAIN: False}
    floors: dict[str, list[dict]] = {SECURE: [], SECURE_PLUS: []}
    protocol_ms: dict[str, list[float]] = {SECURE: [], SECURE_PLUS: []}
    for repeat in range(args.timing_repeats):  # A B A B: tessera, loop, secure, SecAgg+, plain
        if repeat == 1 and args.flower_rounds and not args.round_time_only:
            result["flower"] = _run_flower(args.flower_python, args.flower_rounds)
            print({k: v for k, v in result["flower"].items() if k not in ("round_s", "accuracy")})
            if "accuracy" in result["flower"]:
                result["curves"]["Flower fedavg E=1 shards"] = result["flower"]["accuracy"]
        n = args.timing_rounds
        timing["tessera"] += simulate(_model, train, test, partition=shard_parts, rounds=n,
                                      **common).round_s  # fmt: skip
        timing["plain loop"] += _plain_loop_round_s(train, shard_parts, n)
        for name, option in options.items():
            cpu = time.thread_time()  # CPU time too: less sensitive to other jobs than wall time
            with _timing_secure_sum(protocol_ms.get(name, [])):
                timing[name] += simulate(
                    _model, train, test, partition=shard_parts, rounds=n, dropout=0.1,
                    secure_aggregation=option, **common,
                ).round_s  # fmt: skip
            cpu_ms[name].append(1000 * (time.thread_time() - cpu) / n)
        floors[SECURE].append(_key_agreement_floor_ms(10, 1))
        floors[SECURE_PLUS].append(_key_agreement_floor_ms(10, 1, SECAGG_PLUS_K))
    result["x25519_floor"] = {
        name: {k: statistics.median(f[k] for f in fs) for k in fs[0]} for name, fs in floors.items()
    }
    result["cpu_ms_per_round"] = {k: statistics.median(v) for k, v in cpu_ms.items()}
    result["secure_sum_cpu_ms"] = {k: statistics.median(v) for k, v in protocol_ms.items()}
    deployed = {k: v for k, v in result.get("round_ms", {}).items() if k.startswith("deployed")}
    result["round_ms"] = {k: 1000 * statistics.median(v) for k, v in timing.items()}
    result["round_ms"].update(deployed)  # kept from the last run unless re-measured below
    result["load_average"] = os.getloadavg()
    if args.deployed_rounds:
        for secure in (False, True):
            name = f"deployed, 10 client processes{', secure' if secure else ''}"
            result["round_ms"][name] = _deployed_round_ms(
                train, shard_parts, args.deployed_rounds, secure
            )


def _local_steps(parts, epochs: int, batch_size: int) -> float:
    """Mean local SGD steps of a FedAvg client per round: E * ceil(n_k / B)."""
    return statistics.mean(epochs * math.ceil(len(p) / batch_size) for p in parts)


def _noise_for_epsilon(epsilon: float, rounds: int, q: float, delta: float) -> float:
    low, high = 0.3, 50.0
    for _ in range(40):
        mid = (low + high) / 2
        accountant = RDPAccountant()
        accountant.step(mid, q, num_steps=rounds)
        low, high = (mid, high) if accountant.epsilon(delta) > epsilon else (low, mid)
    return high


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and write the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rounds", type=int, default=300)
    parser.add_argument("--timing-rounds", type=int, default=15, help="rounds per timed run")
    parser.add_argument(
        "--timing-repeats", type=int, default=5, help="interleaved repeats of the timed runs"
    )
    parser.add_argument("--dp-rounds", type=int, default=100)
    parser.add_argument(
        "--deployed-rounds",
        type=int,
        default=None,
        help="0: skip (default 20; 0 with --round-time-only)",
    )
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--flower-rounds", type=int, default=150, help="0: skip Flower")
    parser.add_argument(
        "--flower-python",
        default=sys.executable,
        help="a Python with flwr[simulation] and tessera (default: this one)",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the tables from results/federated.json"
    )
    parser.add_argument(
        "--round-time-only",
        action="store_true",
        help="re-measure the simulated round times only; the rest from results/federated.json",
    )
    args = parser.parse_args(argv)
    if args.render_only:
        result = json.loads((HERE / "results" / "federated.json").read_text())
        _write(result, args)
        return result
    if args.deployed_rounds is None:
        args.deployed_rounds = 0 if args.round_time_only else 20
    torch.set_num_threads(1)
    train, test = _digits()
    common = dict(num_clients=100, clients_per_round=10, batch_size=10, lr=0.1, seed=0)
    if args.round_time_only:
        result = json.loads((HERE / "results" / "federated.json").read_text())
        _round_times(result, args, train, test, common)
        _write(result, args)
        return result
    result: dict = {"machine": platform.processor() or platform.machine(), "curves": {}}

    # (partition, algorithm, E, lr, B): the grid, then rows that explain the FedSGD ratio
    runs = [("shards", a, e, 0.1, 10) for e in (1, 5) for a in ("fedsgd", "fedavg", "fedprox")]
    runs += [(f"dirichlet{alpha}", "fedavg", 1, 0.1, 10) for alpha in (0.1, 0.5)]
    runs += [("shards", "fedsgd", 1, lr, 10) for lr in (0.3, 1.0)]  # FedSGD with a tuned lr
    runs += [("shards", "fedavg", 1, 0.1, None)]  # B = all, E = 1: FedSGD's update (McMahan)
    runs += [("shards", "fedavg", 20, 0.1, 10)]  # more local work per round
    convergence = []
    for scheme, algorithm, epochs, lr, batch in [] if args.skip_convergence else runs:
        if algorithm == "fedsgd" and epochs > 1:
            continue  # FedSGD has no local epochs
        if scheme.startswith("dirichlet"):
            alpha = float(scheme.removeprefix("dirichlet"))
            parts = partition(train[1], 100, scheme="dirichlet", alpha=alpha, seed=0)
        else:
            parts = partition(train[1], 100, scheme=scheme, seed=0)
        history = simulate(
            _model, train, test, partition=parts, local_epochs=epochs, rounds=args.max_rounds,
            algorithm=algorithm, mu=0.01 if algorithm == "fedprox" else 0.0,
            **{**common, "lr": lr, "batch_size": batch},
        )  # fmt: skip
        steps = epochs * (1.0 if batch is None else _local_steps(parts, 1, batch))
        row = {
            "partition": scheme, "algorithm": algorithm, "E": epochs, "lr": lr,
            "B": "all" if batch is None else batch,
            "local_steps": 1.0 if algorithm == "fedsgd" else steps,
            "rounds_to_90": _rounds_to(history.accuracy), "final": history.accuracy[-1],
            "round_ms": 1000 * statistics.median(history.round_s),
        }  # fmt: skip
        convergence.append(row)
        name = f"{algorithm} E={epochs} {scheme}" + (f" lr {lr:g}" if lr != 0.1 else "")
        result["curves"][name + ("" if batch else " B=all")] = history.accuracy
        print(row, flush=True)
    result["convergence"] = convergence

    _round_times(result, args, train, test, common)
    print(result["round_ms"], flush=True)
    if args.skip_dp:
        result["dp"] = []
        _write(result, args)
        return result

    dp_rows = []
    for epsilon in (None, 8.0, 4.0, 1.0):
        dp = None
        if epsilon is not None:
            sigma = _noise_for_epsilon(epsilon, args.dp_rounds, 0.1, 1e-3)
            dp = DPConfig(clip=1.0, noise_multiplier=sigma, delta=1e-3)
        history = simulate(_model, train, test, partition="iid", rounds=args.dp_rounds, dp=dp,
                           **common)  # fmt: skip
        dp_rows.append({
            "epsilon": epsilon, "sigma": None if dp is None else dp.noise_multiplier,
            "spent": history.epsilon[-1] if history.epsilon else None,
            "accuracy": history.accuracy[-1],
        })  # fmt: skip
        print(dp_rows[-1], flush=True)
    result["dp"] = dp_rows
    _write(result, args)
    return result


def _ratio_rows(result: dict) -> list[str]:
    """The issue's targets beside the measured values."""
    ms, flower = result["round_ms"], result.get("flower", {})
    rows = {
        (r["algorithm"], r["E"], r["partition"], r["lr"], r.get("B", 10)): r
        for r in result["convergence"]
    }
    out = ["| target | measured | met |", "|---|---|---|"]

    def add(target: str, value: float | None, text: str, ok: bool | None) -> None:
        met = "-" if ok is None or value is None else ("yes" if ok else "no")
        out.append(f"| {target} | {text if value is not None else 'not measured'} | {met} |")

    sim = ms["tessera"] / ms["plain loop"]
    add("simulation round <= 1.5x a plain loop", sim, f"{sim:.2f}x", sim <= 1.5)
    flower_ms = 1000 * flower["median_round_s"] if "median_round_s" in flower else None
    if flower_ms:
        add("about 20x faster than Flower's simulation", 1, f"{flower_ms / ms['tessera']:.1f}x "
            f"({ms['tessera']:.1f} vs {flower_ms:.0f} ms)", None)  # fmt: skip
        deployed = ms.get("deployed, 10 client processes")
        add("deployed, 10 client processes <= Flower's simulation round", deployed,
            f"{deployed:.0f} vs {flower_ms:.0f} ms ({deployed / flower_ms:.2f}x)"
            if deployed else "", deployed is not None and deployed <= flower_ms)  # fmt: skip
    else:
        add("Flower side by side", None, "", None)
    for name, label in ((SECURE, "complete graph"), (SECURE_PLUS, f"SecAgg+ k={SECAGG_PLUS_K}")):
        if name in ms:
            secure = ms[name] / ms[PLAIN]
            add(f"secure aggregation <= 2x plain (10% dropout), {label}", secure,
                f"{secure:.2f}x", secure <= 2.0)  # fmt: skip
    sgd = rows.get(("fedsgd", 1, "shards", 0.1, 10), {}).get("rounds_to_90")
    for epochs in (1, 5):
        avg = rows.get(("fedavg", epochs, "shards", 0.1, 10), {}).get("rounds_to_90")
        value = sgd / avg if sgd and avg else None
        text = f"{sgd} / {avg} = {value:.2f}x" if value else ""
        add(f"FedSGD / FedAvg E={epochs} rounds to 90% (shards) >= 5x", value, text,
            value is not None and value >= 5)  # fmt: skip
    return out


def _fedsgd_note(result: dict) -> list[str]:
    """Why FedAvg's advantage over FedSGD is bounded here, from the measured rows."""
    rows = {
        (r["algorithm"], r["E"], r["lr"], r.get("B", 10)): r
        for r in result["convergence"]
        if r["partition"] == "shards"
    }

    def rounds(*key) -> int | None:
        return rows.get(key, {}).get("rounds_to_90")

    sgd, full_batch = rounds("fedsgd", 1, 0.1, 10), rounds("fedavg", 1, 0.1, "all")
    e1, e5, e20 = (rounds("fedavg", e, 0.1, 10) for e in (1, 5, 20))
    tuned = [(lr, rounds("fedsgd", 1, lr, 10)) for lr in (0.3, 1.0)]
    if not all([sgd, full_batch, e1, e5, e20]) or not all(r for _, r in tuned):
        return []
    steps = {e: rows[("fedavg", e, 0.1, 10)]["local_steps"] for e in (1, 5, 20)}
    return [
        "",
        f"FedSGD against FedAvg (shards): FedSGD is FedAvg with B = all and E = 1 (McMahan et al. "
        f"2017, sec. 2): the two reach 90% at rounds {sgd} and {full_batch} here. "
        f"Where FedSGD takes one step a round, a FedAvg client takes its local steps, which bound "
        f"its advantage roughly (less on non-IID shards, where local steps drift); a client "
        f"holds about 14 samples, so E = 1, B = 10 gives {steps[1]:.0f} local steps (measured "
        f"{sgd / e1:.1f}x fewer rounds), E = 5 gives {steps[5]:.0f} ({sgd / e5:.1f}x) and, beyond "
        f"the issue's grid, E = 20 gives {steps[20]:.0f} ({sgd / e20:.1f}x, {e20} rounds): the 5x "
        f"target needs more local work per round than E = 5 gives on this data, not a weaker "
        f"baseline. Tuning FedSGD's lr as McMahan et al. do makes it faster, not slower: "
        + ", ".join(f"lr {lr:g}: {r} rounds" for lr, r in tuned)
        + " (FedAvg keeps lr 0.1).",
    ]


def _security_note(n: int = 10) -> str:
    """What each graph withstands for a round of n clients (secure_aggregation's docstring)."""
    k, t_full = SECAGG_PLUS_K, n // 2 + 1
    t = (k + 1) // 2 + 1
    return (
        f"What the two withstand with {n} clients: the complete graph (threshold {t_full} of "
        f"{n}) survives {n - t_full} dropouts and hides every input from the server with up to "
        f"{t_full - 1} colluding clients; SecAgg+ with k = {k} (each client talks to {k} of "
        f"{n - 1} others, shares {t}-of-{k + 1}) survives {k + 1 - t} dropouts per "
        f"neighbourhood and hides inputs with up to {t - 1} colluders, and fewer than {k} "
        f"dropped-or-colluding clients cannot split the survivors into separately unmasked "
        f"groups (Harary graphs are k-connected). Bell et al. (CCS 2020) prove the guarantee "
        f"against constant fractions of corrupt and dropped clients for k = O(log n) with n in "
        f"the thousands, not for rounds of {n}: here k is a cost trade-off."
    )


def _write(result: dict, args) -> None:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "federated.json").write_text(json.dumps(result, indent=1))
    ms, flower = result["round_ms"], result.get("flower", {})
    load = os.getloadavg()[0]
    lines = [
        "## federated", "",
        f"scikit-learn digits, 100 clients, 10 per round, MLP 64-64-10, SGD 0.1, B = 10; "
        f"machine: {result['machine']}, 2 cores shared with other jobs (load average "
        f"{load:.1f} at the end). Rounds capped at {args.max_rounds}. `local steps`: a client's "
        f"SGD steps per round, E * ceil(n_k / B) averaged over clients (FedSGD: one server step).",
        "",
        "| partition | algorithm | E | B | lr | local steps | rounds to 90% | final accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in result["convergence"]:
        reached = row["rounds_to_90"] if row["rounds_to_90"] is not None else f">{args.max_rounds}"
        lines.append(
            f"| {row['partition']} | {row['algorithm']} | {row['E']} | {row.get('B', 10)} | "
            f"{row['lr']:g} | "
            f"{row['local_steps']:.1f} | {reached} | {row['final']:.3f} |"
        )
    if "accuracy" in flower:
        reached = _rounds_to(flower["accuracy"])
        lines.append(
            f"| shards | Flower fedavg | 1 | 10 | 0.1 | {result['shard_local_steps']:.1f}"
            f" | {reached if reached is not None else '>' + str(args.flower_rounds)} | "
            f"{flower['accuracy'][-1]:.3f} |"
        )
    lines += ["", "| round time (median ms) | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ms.items()]
    if "median_round_s" in flower:
        flower_ms = 1000 * flower["median_round_s"]
        lines.append(f"| Flower {flower['flwr']} simulation (Ray) | {flower_ms:.2f} |")
        lines += [
            "",
            f"Flower start-up: {flower['import_s']:.1f} s importing flwr, "
            f"{flower['startup_s']:.1f} s from `run_simulation` to the first round, and "
            f"{flower['first_round_extra_s']:.1f} s more in the first round (Ray's worker "
            f"starting); tessera's `simulate` starts its first round "
            f"{1000 * result['tessera_startup_s']:.0f} ms after the call.",
        ]
    elif "error" in flower:
        lines += ["", f"Flower: not run ({flower['error'][:200]})."]
    if args.round_time_only:
        load = result.get("load_average", os.getloadavg())
        lines += [
            "",
            f"Round times re-measured alone (`--round-time-only`, load average {load[0]:.1f} after "
            f"the simulated runs): the simulated rows"
            + (" and the deployed ones" if args.deployed_rounds else "")
            + "; the other tables and Flower's figures come from the last full run.",
        ]
    cpu, floors = result.get("cpu_ms_per_round"), result.get("x25519_floor")
    if floors and "agreements" in floors:  # a result from before SecAgg+ was measured
        floors = {SECURE: floors}
    if cpu and floors:
        plain_cpu = cpu[PLAIN]
        parts = []
        for name, label in (
            (SECURE, "complete graph"),
            (SECURE_PLUS, f"SecAgg+ k={SECAGG_PLUS_K}"),
        ):
            if name not in cpu:
                continue
            floor, overhead = floors[name], cpu[name] - plain_cpu
            protocol = result.get("secure_sum_cpu_ms", {}).get(name)
            text = (
                f"{label}: {cpu[name]:.1f} ms, {cpu[name] / plain_cpu:.2f}x; overhead "
                f"{overhead:.1f} ms, of which {floor['agreements']:.0f} X25519 agreements and "
                f"{floor['keys']:.0f} key generations take {floor['ms']:.1f} ms "
                f"({floor['ms'] / plain_cpu:.2f}x the plain round by itself)"
            )
            if protocol is not None:
                text += (
                    f"; the protocol (`secure_sum`, timed in the rounds) {protocol:.1f} ms, so "
                    f"{protocol - floor['ms']:.1f} ms for everything else in it (AES-GCM "
                    f"keystream masks and share encryption, pair-key hashing, Shamir sharing and "
                    f"recovery, quantisation) and {overhead - protocol:.1f} ms outside it"
                )
            parts.append(text)
        floor = floors[SECURE]
        lines += [
            "",
            f"CPU time of this process per round (thread time, evaluation included; less "
            f"sensitive to the other jobs than wall time), 10 clients with one dropout: plain "
            f"{plain_cpu:.1f} ms; " + "; ".join(parts) + f". One X25519 agreement costs "
            f"{floor['exchange_us']:.0f} us of CPU here, a key generation "
            f"{floor['generate_us']:.0f} us. " + _security_note(),
        ]
    lines += ["", *_ratio_rows(result), *_fedsgd_note(result)]
    lines += [
        "",
        f"| DP target epsilon ({args.dp_rounds} rounds, delta 1e-3) | sigma | accuracy |",
        "|---|---|---|",
    ]
    for row in result["dp"]:
        target = "none" if row["epsilon"] is None else f"{row['epsilon']:g}"
        sigma = "-" if row["sigma"] is None else f"{row['sigma']:.2f}"
        lines.append(f"| {target} | {sigma} | {row['accuracy']:.3f} |")
    lines += ["", "![accuracy curves](benchmarks/results/federated.png)"]
    (out / "federated.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # left: the shards grid and Flower; right: the other partitions and the FedSGD rows
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    left = [n for n in result["curves"] if "shards" in n and " lr " not in n and "B=all" not in n]
    for panel, ax in enumerate(axes):
        names = [n for n in result["curves"] if (n in left) == (panel == 0)]
        for index, name in enumerate(names):
            style = "--" if "Flower" in name or "fedprox" in name else "-"
            ax.plot(result["curves"][name], style, lw=1, label=name, color=f"C{index}")
    for ax, title in zip(axes, ("shards: FedSGD, FedAvg, FedProx, Flower", "other rows")):
        ax.axhline(0.9, color="grey", lw=0.5)
        ax.set(xlabel="round", title=title, xlim=(0, 160), ylim=(0, 1))
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("test accuracy (digits, 100 clients, 10 per round)")
    fig.tight_layout()
    fig.savefig(out / "federated.png", dpi=100)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
