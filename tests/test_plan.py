"""`tessera plan` and the planner's pieces: the CLI's JSON and plot, models, clusters, bad input.

In-process and cheap: the command runs through `tessera.cli.main` (no subprocess), the cluster
`this-machine` is read from a cache file written here (measuring it spawns ranks:
`tessera plan --cluster this-machine` does that once per machine, outside the tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.cli import main
from tessera.models import GPT, GPTConfig
from tessera.plan import (
    PRESETS,
    Cluster,
    Estimate,
    ModelSpec,
    Strategy,
    estimate,
    from_module,
    parse_count,
    plan,
    preset,
    this_machine,
)
from tessera.plan.formulas import gpt_params
from tessera.zero import estimate_memory

GPT3 = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--vocab", "51200"]


ADAMW = {"adamw_s_per_param": 2e-9, "adamw_s_per_tensor": 3e-5,
         "pipeline_message_s": 1e-3, "pipeline_step_s": 5e-3}  # fmt: skip
"""A calibration's AdamW step costs (`plan.cluster.adamw_cost`) and pipeline costs
(`plan.pipeline_cost`), for the caches written here."""


def test_plan_json_schema_best_first_and_fits_consistent(capsys):
    code = main(["plan", *GPT3, "--cluster", "a100-80g-dgx", "--devices", "64",
                 "--batch", "256", "--tokens", "300B", "--json"])  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == pytest.approx(gpt_params(96, 12288, 51200, 2048))
    assert data["flops_per_iteration"] > 0
    rows = data["strategies"]
    keys = {"name", "dp", "tp", "pp", "zero", "offload", "microbatches", "fits", "memory_bytes",
            "step_s", "tokens_per_s", "days"}  # fmt: skip
    assert all(keys <= set(row) for row in rows)
    assert {row["dp"] * row["tp"] * row["pp"] for row in rows} == {64}
    for row in rows:  # fits is the memory against the device's, the parts add up
        assert row["fits"] == (row["memory_bytes"] <= 80e9)
        assert sum(row["memory"].values()) == pytest.approx(row["memory_bytes"])
        assert row["days"] == pytest.approx(300e9 / row["tokens_per_s"] / 86400)
        assert row["tokens_per_s"] == pytest.approx(256 * 2048 / row["step_s"])
    fitting = [row for row in rows if row["fits"]]
    assert fitting and rows[: len(fitting)] == fitting  # fitting ones first
    times = [row["step_s"] for row in fitting]
    assert times == sorted(times)  # best first
    assert any(row["pp"] > 1 and row["tp"] > 1 for row in rows)  # the mixes are there
    assert not rows[-1]["fits"]  # 175B on plain data parallelism: 2.8 TB per device


def test_plan_plot_and_table(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code = main(["plan", "--params", "1.5B", "--devices", "4", "--device-memory", "16GB",
                 "--peak-flops", "100T", "--intra", "100GB/s", "--inter", "10GB/s",
                 "--batch", "8", "--plot", str(png), "--top", "6"])  # fmt: skip
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "zero3 dp=4" in out and "tessera plan" in out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--layers", "4"], "--hidden"),
        (["--params", "1B", "--devices", "4"], "--device-memory"),
        (["--params", "1B", "--cluster", "tpu-pod"], "--cluster"),
        (["--params", "lots", "--cluster", "a100-80g-dgx"], "--params"),
        (["--params", "1B", "--cluster", "a100-80g-dgx", "--batch", "3"], "--batch"),
    ],
)
def test_plan_bad_input_names_the_flag(argv, flag, capsys):
    assert main(["plan", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_estimate_memory_is_zero_and_korthikanti():
    model = ModelSpec.gpt(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200)
    cluster = preset("a100-80g-dgx", 8)
    e = estimate(Strategy(dp=8, zero=3), model, cluster, batch=8, microbatch=1)
    assert isinstance(e, Estimate)
    zero = estimate_memory(round(model.params), 8, 3)
    assert (e.params, e.grads, e.optimizer) == (
        zero["params"],
        zero["gradients"],
        zero["optimizer"],
    )
    assert e.activations == 2048 * 2304 * (34 + 5 * 24 * 2048 / 2304) * 24
    # offload: the optimizer state leaves the device and its traffic is priced
    off = estimate(Strategy(dp=8, zero=2, offload="cpu"), model, cluster, batch=8, microbatch=1)
    assert off.optimizer == 0 and off.offload_s > 0
    # a pipeline keeps min(p, m) micro-batches in flight under 1F1B, m under GPipe
    one = estimate(Strategy(dp=1, pp=4, microbatches=8), model, cluster, batch=8, microbatch=1)
    gpipe = estimate(
        Strategy(dp=1, pp=4, microbatches=8, schedule="gpipe"),
        model,
        cluster,
        batch=8,
        microbatch=1,
    )
    assert gpipe.activations == 2 * one.activations
    assert one.bubble_s == pytest.approx(3 / 8 * one.compute_s)


def test_models_counted_and_parsed():
    config = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)
    gpt = from_module(GPT(config))
    assert (gpt.layers, gpt.hidden, gpt.heads, gpt.seq, gpt.vocab) == (2, 32, 2, 32, 65)
    assert gpt.params == sum(p.numel() for p in GPT(config).parameters())
    mlp = from_module(nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 1)), seq=1)
    assert mlp.params == 10 * 20 + 20 + 20 + 1 and not mlp.is_transformer
    assert mlp.flops_per_token() == 6 * mlp.params  # documented: 6 x params per token
    assert [parse_count(x) for x in ("7.5B", "312T", "80GB", "600GB/s", 12)] == [
        7.5e9, 312e12, 80e9, 600e9, 12.0
    ]  # fmt: skip
    # a bare parameter count plans model states only: no tensor or pipeline split
    found = plan(ModelSpec(params=1e9), preset("h100-80g-dgx"), batch=8)
    assert {(e.strategy.tp, e.strategy.pp) for e in found} == {(1, 1)}
    assert all(e.activations == 0 for e in found)


def test_presets_and_this_machine_from_its_cache(tmp_path):
    assert set(PRESETS) == {"a100-80g-dgx", "h100-80g-dgx"}
    dgx = preset("a100-80g-dgx", 16)
    assert (dgx.nodes, dgx.peak_flops, dgx.memory_bytes) == (2, 312e12, 80e9)
    with pytest.raises(ValueError, match="whole number of nodes"):
        Cluster(devices=12, per_node=8, memory_bytes=1, peak_flops=1, intra_bandwidth=1,
                inter_bandwidth=1)  # fmt: skip
    cost = {"alpha": 1e-4, "beta": 1e-9, "gamma": 2e-10, "mu": 1e-10, "sigma": 3e-5,
            "alpha_native": 5e-5, "cores": 2}  # fmt: skip
    cache = Path(tmp_path / "machine.json")
    cache.write_text(json.dumps({"matmul_flops": 2e10, **ADAMW, "cost": cost, "ranks": 2}))
    here = this_machine(cache=cache)
    assert here.peak_flops == 2e10 * min(1, (os.cpu_count() or 1) / 2) and here.devices == 2
    crowded = cache.with_name("four.json")  # 4 ranks on this host's cores take turns
    crowded.write_text(json.dumps({"matmul_flops": 2e10, **ADAMW, "cost": cost, "ranks": 4}))
    four = this_machine(cache=crowded, ranks=4)
    assert four.peak_flops == 2e10 * min(1, (os.cpu_count() or 1) / 4) and four.devices == 4
    assert here.link(intra=True).alpha == 1e-4  # the fitted constants, as fitted
    assert here.intra_bandwidth == pytest.approx(1e9)
    assert (here.pipeline_message_s, here.pipeline_step_s) == (1e-3, 5e-3)  # as measured


def test_train_reports_mfu_from_equation_3(tmp_path, monkeypatch):
    """One in-process rank: metrics.jsonl and the summary carry MFU = tokens/s x FLOPs/token /
    peak, FLOPs per token written here from Narayanan et al. eq. (3) without recomputation."""
    from tessera.train import build_config, latest_checkpoint, load_checkpoint, run_training
    from tessera.train import mfu as mfu_module
    from tessera.train.metrics import read_metrics

    monkeypatch.setattr(mfu_module, "device_peak_flops", lambda device, world: (1e9, "test"))
    model = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32}
    config = build_config(
        {
            "model": model,
            "batch_size": 4,
            "corpus_bytes": 20_000,
            "sample_tokens": 0,
            "progress": False,
            "steps": 2,
            "log_every": 1,
            "strategy": "single",
            "nproc": 1,
            "out": str(tmp_path / "run"),
        }  # fmt: skip
    )
    summary = run_training(config)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    weights = load_checkpoint(latest_checkpoint(tmp_path / "run"))["engine"]["model"]
    V = next(w.shape[0] for k, w in weights.items() if k.endswith("wte.weight"))
    s, h, l = 32, 32, 1  # noqa: E741
    per_token = 72 * s * l * h**2 * (1 + s / (6 * h) + V / (12 * h * l)) / s
    assert len(records) == 2
    for record in records:
        assert record["mfu"] == pytest.approx(record["tokens_per_s"] * per_token / 1e9)
    assert summary["mfu"] == pytest.approx(statistics.median(r["mfu"] for r in records))
    assert summary["mfu_peak"] == "test"


def test_mfu_of_a_user_model_is_six_flops_per_parameter_per_token():
    from tessera.train.mfu import ModelFlops

    model = nn.Linear(10, 10)
    flops = ModelFlops(6.0 * 110, torch.device("cpu"), 2, peak=(1e3, "test"))
    assert ModelFlops.for_run(model, torch.device("cpu"), 2).flops_per_token == 6 * 110
    assert flops.mfu(tokens_per_s=10) == pytest.approx(10 * 660 / 2e3)


def test_readme_plan_example_predicts_about_34_days(capsys):
    """The README's GPT-3 command: at the 140 TFLOP/s Megatron-LM measured end to end, its best
    strategy trains 300B tokens in Narayanan et al.'s 34 days (8TP/(nX), Eq. 3's small terms
    add 3%), and it is a strategy tessera runs: its row carries the command."""
    from test_readme_commands import PLAN_COMMAND, readme

    argv = readme(PLAN_COMMAND)[3:]  # after `python -m tessera`
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["strategies"][0]
    assert best["fits"] and best["command"] and not best["not_runnable"]
    assert best["days"] == pytest.approx(34, rel=0.05)


def test_compare_pairs_each_trainer_strategy_with_the_planners_and_reports_the_worst():
    """`tessera compare` (a benchmark: no run here): its runs and its table's errors."""
    from tessera.train.compare import Comparison, markdown, runs_for

    runs = runs_for(4, microbatches=4)
    labels = [label for label, _, _ in runs]
    assert labels[:5] == ["ddp", "zero1", "zero2", "zero3", "zero2 offload cpu"]
    assert {"pipeline gpipe", "pipeline 1f1b", "tensor", "hybrid dp=2 pp=2"} <= set(labels)
    for _, layer, strategy in runs:  # the planner's split is the trainer's
        assert strategy.dp * strategy.tp * strategy.pp == 4
        if layer["strategy"] == "pipeline":
            assert (strategy.schedule, strategy.microbatches) == (layer["schedule"], 4)
    assert "hybrid dp=1 pp=2" not in [label for label, _, _ in runs_for(2, 4)]
    user = [s.tp * s.pp for _, _, s in runs_for(2, 4, model_parallel=False)]
    assert user == [1] * 5  # a user's model without --split / --tp-plan: data parallel only
    results = [
        Comparison("a", 0.2, 0.25, 100.0, 110.0, 100.0),
        Comparison("b", 0.4, 0.3, float("nan"), float("nan"), 50.0),
    ]
    assert results[0].step_error == pytest.approx(0.25)
    table = markdown(results, 4)
    assert "Worst step-time error -25% (b)" in table
    assert "worst model-state error +0.0% (a)" in table and "n/a" in table


def test_compare_prices_compute_at_the_rate_a_rank_achieves_with_the_planners_flops():
    """`tessera compare` measures the rate of a rank's own step (no communication) and counts
    its FLOPs as the planner does, so a one-rank, communication-free plan takes the measured
    time: what the comparison then tests is the planner's communication and bubbles."""
    from tessera.plan.cluster import PRESETS, Cluster
    from tessera.plan.model import from_module
    from tessera.plan.search import Strategy, estimate
    from tessera.train.compare import achieved_rate, iteration_flops
    from tessera.train.config_build import build_config
    from tessera.train.workload import build_workload

    config = {
        "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
        "batch_size": 8,
        "corpus_bytes": 50_000,
        "nproc": 1,
    }
    model = from_module(build_workload(build_config(config)).model_fn(), seq=None)
    cluster = Cluster(name="one", devices=1, **PRESETS["a100-80g-dgx"])
    plan = estimate(
        Strategy(dp=1), model, cluster, batch=8, microbatch=8, compute_flops=1e9, precision="fp32"
    )
    assert plan.compute_s == pytest.approx(iteration_flops(model, 8) / 1e9, rel=1e-12)
    # plus the device's own AdamW step, memory-bound: 28 bytes a parameter at the A100's 2 TB/s
    adam_s = model.params * 28 / PRESETS["a100-80g-dgx"]["reduce_bytes_per_s"]
    assert plan.optimizer_s == pytest.approx(adam_s, rel=1e-12)
    assert plan.step_s == pytest.approx(plan.compute_s + adam_s, rel=1e-12)
    rate = achieved_rate(config, model, 1, repeats=2)  # one rank: its step on the whole batch
    assert 1e6 < rate < 1e13, rate  # FLOP/s a CPU core reaches on a real step


def test_achieved_rate_takes_the_slowest_rank_of_each_repeat():
    """A synchronous step lasts as long as its slowest rank: repeat by repeat, not rank by rank
    (the mean of each rank's median would be 1.0 here, the step takes 5.0 twice of three)."""
    from tessera.train.compare import slowest_median

    assert slowest_median([[1.0, 5.0, 1.0], [5.0, 1.0, 1.0]]) == 5.0
    assert slowest_median([[2.0, 3.0, 4.0]]) == 3.0
    with pytest.raises(ValueError):  # ranks that timed different numbers of repeats
        slowest_median([[1.0, 2.0], [1.0]])


def test_compare_repeats_round_robin_and_reports_the_medians(tmp_path, monkeypatch):
    """`compare_runs(repeats=2)`: each strategy runs twice (a folder per repeat), and the table
    holds the median of the runs' measured step times (two: their mean) and of the predictions;
    model states are measured at the end of a step and match ZeRO-2's split to the byte, but for
    rounding and padding."""
    import tessera.plan.cluster as cluster_module
    from tessera.train.compare import compare_runs
    from tessera.train.metrics import read_metrics

    cost = {"alpha": 1e-4, "beta": 1e-9, "gamma": 2e-10, "mu": 1e-10, "sigma": 3e-5,
            "alpha_native": 5e-5, "cores": 2}  # fmt: skip
    cache = tmp_path / "machine.json"
    cache.write_text(json.dumps({"matmul_flops": 2e10, **ADAMW, "cost": cost, "ranks": 2}))
    monkeypatch.setattr(cluster_module, "CACHE_FILE", cache)
    base = {
        "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
        "batch_size": 8,
        "corpus_bytes": 50_000,
    }
    results = compare_runs(
        base, nproc=2, steps=3, out=tmp_path, skip=1, only=["zero2"], recalibrate=False,
        repeats=2,
    )  # fmt: skip
    assert [r.label for r in results] == ["zero2"]
    folder = tmp_path / "zero2"
    runs = [read_metrics(folder / run / "metrics.jsonl") for run in ("repeat-1", "repeat-2")]
    medians = [statistics.median(r["step_s"] for r in records[1:]) for records in runs]
    assert results[0].measured_step_s == pytest.approx(statistics.fmean(medians), rel=1e-12)
    assert results[0].predicted_step_s > 0
    # equal but for metrics.jsonl's rounding to 0.001 MB and a shard's padding (one element of
    # gradient and Adam state, 4 + 8 bytes, per rank)
    gap = abs(results[0].predicted_state_bytes - results[0].measured_state_bytes)
    assert gap <= 0.0005 * 2**20 + 12 * 2, results[0]
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved[0]["label"] == "zero2"
    assert saved[0]["measured_step_s"] == results[0].measured_step_s


def test_bubble_on_shared_cores_lends_an_idle_stages_core():
    """Processes on shared cores: a waiting stage's core goes to the busy ones. Written out here:
    p = 4 stages, m = 4, 2 cores: the 7 slots of a sweep have 1,2,3,4,3,2,1 stages busy, each
    slot max(1, k/2) times slower than alone (1,1,1.5,2,1.5,1,1: 9), against 4 slots at the
    all-busy rate (2 each: 8): 9/8 = 1 + 0.125. With a core per stage it is (p - 1)/m."""
    from tessera.plan.formulas import bubble_fraction_on_shared_cores as shared

    assert shared(4, 4, replicas=1, cores=2) == pytest.approx(0.125)
    # two pipelines of 2 stages on 2 cores: slots of 2,4,4,4,2 busy ranks, 1,2,2,2,1 = 8 = 4 x 2
    assert shared(2, 4, replicas=2, cores=2) == pytest.approx(0.0)
    for p, m, replicas in ((2, 4, 1), (4, 16, 2), (8, 8, 1)):
        assert shared(p, m, replicas, cores=p * replicas) == pytest.approx((p - 1) / m)
    with pytest.raises(ValueError, match="at least 1"):
        shared(4, 4, replicas=1, cores=0)
    # the planner uses it where the cluster says its devices share cores, and only there
    model = ModelSpec.gpt(layers=4, hidden=128, heads=4, seq=128, vocab=65)
    dedicated = Cluster(name="four", devices=4, per_node=4, memory_bytes=1e9, peak_flops=1e10,
                        intra_bandwidth=1e9, inter_bandwidth=1e9)  # fmt: skip
    crowded = dataclasses.replace(dedicated, shared_cores=2)
    pipeline = Strategy(dp=1, pp=4, microbatches=4, schedule="gpipe")
    alone = estimate(pipeline, model, dedicated, batch=32, microbatch=8)
    shared_run = estimate(pipeline, model, crowded, batch=32, microbatch=8)
    assert alone.bubble_s == pytest.approx(0.75 * alone.compute_s)
    assert shared_run.bubble_s == pytest.approx(0.125 * shared_run.compute_s)
    data_parallel = estimate(Strategy(dp=4), model, crowded, batch=32, microbatch=8)
    assert data_parallel.bubble_s == 0


def test_tensor_parallel_ranks_hold_norms_row_biases_and_positions_whole():
    """Counted here from tessera's GPT module by name: what Megatron keeps whole on every tensor
    rank (layer norms, the biases of the row-parallel projections, the position embedding);
    the planner splits the rest over t."""
    config = GPTConfig(vocab_size=96, block_size=64, n_layer=3, n_embd=48, n_head=4)
    module = GPT(config)
    whole = sum(
        p.numel()
        for name, p in module.named_parameters()
        if ".ln_" in name or name.startswith("ln_f") or name.endswith("proj.bias") or "wpe" in name
    )
    spec = from_module(module)
    assert spec.tensor_replicated_params() == whole
    cluster = Cluster(name="two", devices=2, per_node=2, memory_bytes=1e9, peak_flops=1e10,
                      intra_bandwidth=1e9, inter_bandwidth=1e9)  # fmt: skip
    tp = estimate(Strategy(dp=1, tp=2), spec, cluster, batch=4, microbatch=4, precision="fp32")
    assert tp.params == pytest.approx(4 * ((spec.params - whole) / 2 + whole))
    dp = estimate(Strategy(dp=2), spec, cluster, batch=4, microbatch=2, precision="fp32")
    assert dp.params == 4 * spec.params
    assert ModelSpec(params=1e6).tensor_replicated_params() == 0


def test_tensor_groups_tile_a_node():
    """96 heads and 24 devices allow t = 3 and 6 by divisibility alone, but a group of 6 on
    8-device nodes would straddle two of them (its all-reduces crossing InfiniBand)."""
    from tessera.plan.search import enumerate_strategies

    model = ModelSpec.gpt(layers=24, hidden=3072, heads=96, seq=2048, vocab=51200)
    found = enumerate_strategies(model, preset("a100-80g-dgx", 24), batch=48, microbatch=1)
    assert {s.tp for s in found} == {1, 2, 4, 8}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--strategies", "ddp,zero9"], "no ['zero9'] on 2 ranks"),
    ],
)
def test_compare_refuses_bad_flags_before_running(argv, message, tmp_path, capsys):
    assert main(["compare", "--cached-calibration", "--out", str(tmp_path), *argv]) != 0
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing ran


def _train_config(command: str, world: int):
    """The config `tessera train` builds from a printed command: tessera's own parser, its flag
    layer and its validator (what `tessera train` runs before any rank starts)."""
    import shlex

    from tessera.cli import _flag_layer, _parser, _settle_nproc
    from tessera.train.config_build import build_config

    argv = shlex.split(command)
    assert argv[0] == "tessera"
    if argv[1] == "run":  # several nodes: the trainer's flags follow `-m tessera`
        argv = argv[argv.index("-m") + 2 :]
    else:
        argv = argv[1:]
    args = _parser().parse_args(argv)
    assert args.command == "train"
    flags = _flag_layer(args)
    _settle_nproc([flags], flags)  # (under tessera run: the processes per node torchrun started)
    config = build_config(flags)
    config.check_world_size(world)
    return config


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_plan_row_for_this_machine_is_a_train_command_that_validates(
    ranks, tmp_path, monkeypatch, capsys
):
    """`tessera plan --cluster this-machine` for the demo GPT: every row it prints carries the
    `tessera train` line that runs it, and that line parses with tessera's own parser into a
    config its validator accepts, with the planned split (dp x tp x pp, ZeRO, schedule)."""
    import tessera.plan.cluster as cluster_module

    cost = {"alpha": 1e-4, "beta": 1e-9, "gamma": 2e-10, "mu": 1e-10, "sigma": 3e-5,
            "alpha_native": 5e-5, "cores": 2}  # fmt: skip
    cache = tmp_path / "machine.json"
    cache.write_text(json.dumps({"matmul_flops": 2e10, **ADAMW, "cost": cost, "ranks": ranks}))
    monkeypatch.setattr(cluster_module, "CACHE_FILE", cache)
    gpt = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "90"]
    argv = ["plan", "--cluster", "this-machine", "--devices", str(ranks), *gpt, "--batch", "8"]
    assert main([*argv, "--precision", "fp32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["strategies"]
    assert any(row["schedule"] == "interleaved" for row in rows)  # the new schedule is planned
    for row in rows:
        config = _train_config(row["command"], ranks)
        # one optimizer step takes the planned batch (the trainer's batch_size x grad_accum)
        assert config.nproc == ranks and config.step_batch_size == 8
        mesh = {
            "tensor": (1, ranks, 1),
            "pipeline": (1, 1, ranks),
            "hybrid": (config.dp, config.tp, config.pp or ranks // (config.dp * config.tp)),
        }.get(config.strategy, (ranks, 1, 1))
        assert mesh == (row["dp"], row["tp"], row["pp"])
        if row["pp"] > 1:
            assert (config.schedule, config.microbatches) == (row["schedule"], row["microbatches"])
            assert config.zero == row["zero"]
        elif row["tp"] > 1:
            assert config.strategy == "tensor" or config.zero == row["zero"]
        else:
            strategy = f"zero{row['zero']}" if row["zero"] else "ddp"
            assert config.strategy == strategy and config.offload == row["offload"]
            assert config.grad_accum == row["microbatches"]
        assert config.activation_checkpointing == row["recompute"]
    # --all: also what tessera does not run (recomputation inside stages), marked and commandless
    assert main([*argv, "--all", "--json"]) == 0
    every = json.loads(capsys.readouterr().out)["strategies"]
    marked = [row for row in every if row["command"] is None]
    assert marked and all(row["not_runnable"] for row in marked)
    divide = [row for row in marked if "does not divide" in row["not_runnable"]]
    assert all(row["tp"] > 1 for row in divide)  # a micro-batch of 1 over the tensor ranks
    assert all(row["recompute"] or row["zero"] == 3 for row in marked if row not in divide)
    assert len(every) == len(rows) + len(marked)
    assert all(_train_config(row["command"], ranks) for row in every if row["command"])


def test_a_plan_on_several_nodes_prints_each_node_s_tessera_run_line(monkeypatch):
    from tessera.plan.commands import model_flags, train_command
    from tessera.plan.search import Strategy

    s = Strategy(dp=2, tp=8, pp=4, microbatches=8, schedule="interleaved", chunks=2)
    flags = model_flags("gpt", layers=8, hidden=64, heads=8, seq=32)
    command = train_command(s, flags, preset("a100-80g-dgx", 64), batch=128)
    assert command.text.startswith("tessera run --nnodes 8 -n 8 ")
    monkeypatch.setenv("WORLD_SIZE", "64")  # what torchrun tells each of the 8 nodes' 8 workers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("TESSERA_INIT_FILE", raising=False)
    config = _train_config(command.text, 64)
    assert (config.dp, config.tp, config.pp, config.virtual_stages) == (2, 8, 4, 2)
    assert train_command(s, None, preset("a100-80g-dgx", 64), batch=128).argv is None
    assert (
        "does not divide" in train_command(s, flags, preset("a100-80g-dgx", 64), batch=96).why_not
    )
