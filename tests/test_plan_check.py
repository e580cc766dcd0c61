"""Every row `tessera plan --cluster this-machine` prints for the demo GPT is a run that
`tessera compare` accepts, and that run is the row's printed `tessera train` command
(benchmarks/plan_check.py times them; here nothing runs: no timing, a calibration cache
written by the test).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tessera.cli import _flag_layer, _parser, main
from tessera.plan.cli import plan_rows
from tessera.plan.model import from_module
from tessera.plan.search import Strategy
from tessera.train.compare import check_runs, compare_runs, plan_run
from tessera.train.config_build import build_config
from tessera.train.significance import faster_p
from tessera.train.workload import build_workload

SAME = ("strategy", "nproc", "dp", "tp", "pp", "zero", "offload", "nvme_dir", "schedule",
        "microbatches", "virtual_stages", "grad_accum", "batch_size", "step_batch_size",
        "activation_checkpointing", "mixed_precision", "optimizer")  # fmt: skip
"""What a run's config must share with the command's: the strategy and everything it runs."""


ADAMW = {"adamw_s_per_param": 2e-9, "adamw_s_per_tensor": 3e-5,
         "pipeline_message_s": 1e-3, "pipeline_step_s": 5e-3}  # fmt: skip
"""A calibration's AdamW step costs (`plan.cluster.adamw_cost`) and pipeline costs
(`plan.pipeline_cost`), for the caches written here."""


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """`this-machine` read from a cache written here (2 cores, one rank's matmul 20 GFLOP/s)."""
    import tessera.plan.cluster as cluster_module

    cache = tmp_path / "machine.json"
    cost = {"alpha": 1e-4, "beta": 1e-9, "gamma": 2e-10, "mu": 1e-10, "sigma": 3e-5,
            "alpha_native": 5e-5, "cores": 2}  # fmt: skip
    monkeypatch.setattr(cluster_module, "CACHE_FILE", cache)

    def write(ranks: int) -> None:
        cache.write_text(json.dumps({"matmul_flops": 2e10, **ADAMW, "cost": cost, "ranks": ranks}))

    return write


def _demo_shape() -> list[str]:
    """The demo GPT's shape and its corpus's vocabulary, as `tessera plan` flags."""
    model = from_module(build_workload(build_config({"nproc": 1})).model_fn())
    shape = {"layers": model.layers, "hidden": model.hidden, "heads": model.heads,
             "seq": model.seq, "vocab": model.vocab}  # fmt: skip
    return [part for key, value in shape.items() for part in (f"--{key}", str(value))]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("microbatch", [1, 8])
def test_every_plan_row_for_the_demo_gpt_is_a_run_tessera_compare_accepts(
    ranks, microbatch, calibrated, capsys
):
    calibrated(ranks)
    argv = ["plan", "--cluster", "this-machine", "--devices", str(ranks), *_demo_shape(),
            "--batch", "32", "--microbatch", str(microbatch), "--precision", "fp32"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["strategies"]
    _, _, estimates, commands = plan_rows(_parser().parse_args(argv))
    assert [e.strategy.name for e in estimates] == [row["name"] for row in printed]
    assert len({row["name"] for row in printed}) == len(printed)  # compare's labels are unique
    runs = [plan_run(e.strategy, 32) for e in estimates]
    common = {"nproc": ranks, "steps": 5, "log_every": 1, "progress": False}
    check_runs(common, runs, ranks)  # compare's own check: each config valid on `ranks` ranks
    for (label, layer, strategy), e, command, row in zip(
        runs, estimates, commands, printed, strict=True
    ):
        assert label == row["name"] and strategy == e.strategy
        assert command.text == row["command"]
        args = _parser().parse_args(shlex.split(command.text)[1:])
        by_command = build_config(_flag_layer(args))
        by_compare = build_config(common, layer)
        for key in SAME:
            assert getattr(by_compare, key) == getattr(by_command, key), (label, key)
        assert by_compare.model == by_command.model
        assert by_command.step_batch_size == 32  # the planned batch, however accumulated


def test_compare_refuses_a_run_the_trainer_cannot_run_before_anything_runs(calibrated, tmp_path):
    """A run whose config is invalid on these ranks is named up front (`check_runs`), as
    `tessera compare` refuses its bad flags, before any process starts or the machine is
    measured."""
    calibrated(2)
    out = tmp_path / "runs"
    good = plan_run(Strategy(dp=2, microbatches=2), 32)
    bad = ("four stages", {"strategy": "hybrid", "dp": 2, "tp": 1, "pp": 2}, Strategy(dp=2, pp=2))
    with pytest.raises(ValueError, match="four stages: dp x tp x pp = 2 x 1 x 2"):
        compare_runs({}, nproc=2, steps=2, out=out, runs=[good, bad], recalibrate=False)
    assert not out.exists()  # no run folder


@pytest.mark.parametrize("probe_each_run", [True, False])
def test_compare_of_plan_rows_prices_each_at_its_planned_batch_and_probes_as_asked(
    probe_each_run, calibrated, tmp_path, monkeypatch
):
    """`compare_runs(runs=...)` on plan rows, the runs and probes stood in for (nothing spawns):
    each run gets its row's config, each prediction is the planner's estimate of the row's
    strategy at the planned batch (an accumulating row's batch_size x grad_accum, not its
    batch_size) and at the probed rate; `probe_each_run=False` probes once per micro-batch."""
    import tessera.train.compare as compare
    from tessera.plan.cluster import this_machine
    from tessera.plan.search import estimate

    calibrated(2)
    probes: list[int] = []
    configs = []

    def rate(config, model, nproc, rows=None, tensor_parallel=False):
        probes.append(rows)
        return 1e9 * rows  # a rate of its own per micro-batch, to see which one priced a run

    def run(config):
        configs.append(config)
        lines = [json.dumps({"step": k, "step_s": 0.5}) for k in (1, 2, 3)]
        path = Path(config.out)
        path.mkdir(parents=True)
        (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    monkeypatch.setattr(compare, "achieved_rate", rate)
    monkeypatch.setattr(compare, "run_training", run)
    strategies = [Strategy(dp=2, microbatches=2), Strategy(dp=2, zero=1, microbatches=2),
                  Strategy(dp=1, pp=2, microbatches=2)]  # fmt: skip
    runs = [plan_run(s, 32) for s in strategies]
    results = compare_runs({}, nproc=2, steps=3, out=tmp_path / "out", skip=1, runs=runs,
                           recalibrate=False, repeats=2, probe_each_run=probe_each_run)  # fmt: skip
    assert [c.step_batch_size for c in configs] == [32] * 6
    assert [(c.strategy, c.grad_accum) for c in configs[:3]] == [
        ("ddp", 2), ("zero1", 2), ("pipeline", 1)
    ]
    # micro-batches: 32 / (2 x 2) = 8 rows for the data-parallel rows, 32 / 2 = 16 for the pipeline
    assert probes == ([8, 16] if not probe_each_run else [8, 8, 8, 8, 16, 16] * 2)
    model = from_module(build_workload(configs[0]).model_fn())
    cluster = this_machine(ranks=2)
    for result, s, micro in zip(results, strategies, (8, 8, 16), strict=True):
        planned = estimate(s, model, cluster, batch=32, microbatch=micro,
                           compute_flops=1e9 * micro, precision="fp32")  # fmt: skip
        assert result.predicted_step_s == pytest.approx(planned.step_s, rel=1e-12)
        assert result.measured_step_s == 0.5


@pytest.mark.parametrize(
    ("fast", "slow", "p"),
    [
        ([1, 2, 3], [4, 5, 6], 1 / 20),  # every split of 6 into 3 + 3: C(6, 3) = 20
        ([1, 2, 4], [3, 5, 6], 2 / 20),  # 8 of 9 pairs won: that split and the one above
        ([1, 2, 3, 4], [5, 6, 7, 8], 1 / 70),  # C(8, 4) = 70
        ([4, 5, 6], [1, 2, 3], 1.0),  # slower in every pair: every split wins at least as many
        ([1, 2], [1, 2], 5 / 6),  # ties count half: 2 of 4 pairs; of the 6 splits by
        # position only [2, 2] against [1, 1] wins fewer (0)
    ],
)
def test_faster_p_is_the_exact_one_sided_mann_whitney_p_value(fast, slow, p):
    """Textbook values of the exact test (Mann and Whitney 1947), counted by hand."""
    assert faster_p(fast, slow) == pytest.approx(p, rel=1e-12)


def test_faster_p_refuses_an_empty_group():
    with pytest.raises(ValueError, match="at least one time in each group"):
        faster_p([], [1.0])
