"""The planner's price of a pipeline's messages where the cluster measured them (this machine),
against a count of the messages the schedules send, and the paper-facing modes left as they were.

The oracle for the count is `tessera.pipeline.schedule.schedule`, the action lists the runner
executes: every forward of a virtual stage but the last sends one activation, every backward of a
virtual stage but the first one gradient. Counted action by action here, not from the planner's
closed form, so a term priced per step instead of per micro-batch, per pipeline instead of per
stage boundary, or forward only, disagrees.
"""

from __future__ import annotations

import itertools

import pytest

from tessera.pipeline.schedule import schedule
from tessera.plan.cluster import Cluster, preset
from tessera.plan.model import ModelSpec
from tessera.plan.search import Strategy, estimate, pipeline_messages

GPT = ModelSpec.gpt(layers=8, hidden=64, heads=4, seq=32, vocab=100)
BATCH, MICRO = 64, 2


def _cluster(message_s: float | None, step_s: float = 0.0) -> Cluster:
    """Four CPU processes on two cores, links 1 GB/s with 1 ms latency, as `this_machine`
    builds one (overlap off, shared cores), the pipeline costs as given."""
    return Cluster(
        name="test", devices=4, per_node=4, memory_bytes=1e12, peak_flops=1e10,
        intra_bandwidth=1e9, inter_bandwidth=1e9, intra_latency=1e-3, inter_latency=1e-3,
        overlap=False, shared_cores=2, pipeline_message_s=message_s, pipeline_step_s=step_s,
    )  # fmt: skip


def _sent_per_rank(p: int, m: int, v: int, name: str) -> float:
    """Messages the schedule's ranks send in one step, over its p ranks."""
    sent = 0
    for stage, actions in enumerate(schedule(name, p, m, v)):
        for action in actions:
            virtual = action.chunk * p + stage
            sent += action.kind == "F" and virtual < p * v - 1
            sent += action.kind == "B" and virtual > 0
    return sent / p


PIPELINES = [  # (dp, tp, pp, schedule, v) that 4 devices allow, m from the batch
    (1, 1, 2, "1f1b", 1), (1, 1, 2, "gpipe", 1), (1, 1, 2, "interleaved", 2),
    (1, 1, 4, "1f1b", 1), (1, 1, 4, "interleaved", 2), (2, 1, 2, "1f1b", 1),
    (2, 1, 2, "interleaved", 2), (1, 2, 2, "gpipe", 1),
]  # fmt: skip


@pytest.mark.parametrize(("dp", "tp", "pp", "name", "v"), PIPELINES)
def test_each_message_the_schedule_sends_is_priced_once(dp, tp, pp, name, v):
    """Raising the measured cost of a message by d adds d per message a rank sends (the
    schedule's count), and the per-step cost once; the bytes are priced at the link's
    bandwidth per message, 4 b s h / t of them (fp32)."""
    m = BATCH // (dp * MICRO)
    s = Strategy(dp, tp, pp, microbatches=m, schedule=name, chunks=v)
    sent = _sent_per_rank(pp, m, v, name)
    assert pipeline_messages(s) == pytest.approx(sent, rel=1e-12)
    common = {"batch": BATCH, "microbatch": MICRO, "precision": "fp32"}
    low = estimate(s, GPT, _cluster(1e-3), **common)
    high = estimate(s, GPT, _cluster(4e-3, step_s=0.05), **common)
    assert high.comm_s - low.comm_s == pytest.approx(sent * 3e-3 + 0.05, rel=1e-9)
    assert (high.compute_s, high.bubble_s) == (low.compute_s, low.bubble_s)
    assert high.step_s - low.step_s == pytest.approx(sent * 3e-3 + 0.05, rel=1e-9)
    if dp == tp == 1:  # nothing else communicates: the messages are all of comm
        message_bytes = 4 * MICRO * GPT.seq * GPT.hidden
        assert low.comm_s == pytest.approx(sent * (1e-3 + message_bytes / 1e9), rel=1e-9)


def test_without_a_measured_message_each_device_pays_its_sends_at_the_links_latency():
    """A GPU cluster (a preset: nothing measured) keeps the per-device count, 2 m v sends of
    α + bytes / bandwidth each, and no per-step term; the same holds for a Cluster left
    unmeasured."""
    dgx = preset("a100-80g-dgx", 8)
    assert dgx.pipeline_message_s is None and dgx.pipeline_step_s == 0.0
    for p, v in itertools.product((2, 4), (1, 2)):
        s = Strategy(1, 1, p, microbatches=8, schedule="interleaved" if v > 1 else "1f1b",
                     chunks=v)  # fmt: skip
        got = estimate(s, GPT, _cluster(None), batch=16, microbatch=MICRO, precision="fp32")
        one = 1e-3 + 4 * MICRO * GPT.seq * GPT.hidden / 1e9
        assert got.comm_s == pytest.approx(2 * 8 * v * one, rel=1e-9)


def test_an_end_to_end_rate_adds_no_pipeline_cost():
    """`achieved_flops` (Megatron's measured throughput) already holds the messages: the
    step is the FLOPs over that rate on a cluster that measured them too."""
    s = Strategy(2, 1, 2, microbatches=16)
    got = estimate(s, GPT, _cluster(5e-3, step_s=0.1), batch=BATCH, microbatch=MICRO,
                   achieved_flops=1e9)  # fmt: skip
    assert got.comm_s == 0.0 and got.step_s == pytest.approx(got.compute_s, rel=1e-12)


def test_the_stand_in_pipeline_measures_a_cost_per_message_and_per_step():
    """Two ranks through `tessera.setup(strategy="hybrid")`: both costs come back finite and
    non-negative, and a step costs something (a batch gather and a loss broadcast at least)."""
    from tessera.plan.pipeline_cost import layout, measure_pipeline

    assert layout(4) == (2, 2) and layout(2) == (1, 2) and layout(3) == (1, 3)
    found = measure_pipeline(2, beta=1e-9)
    assert set(found) == {"pipeline_message_s", "pipeline_step_s"}
    assert 0.0 <= found["pipeline_message_s"] < 1.0
    assert 0.0 < found["pipeline_step_s"] < 1.0


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_calibration_reads_a_cost_per_message_and_per_step_off_the_step_times(
    ranks, monkeypatch
):
    """Step times made here (a + b m on each rank, the last rank slowest; a data-parallel step
    d): the slope over the messages a micro-batch sends per rank (2 (p - 1) / p, counted from
    the schedule) less the stand-in's bytes at β is the message, the intercept less d the step."""
    import importlib

    from tessera.plan.pipeline_cost import layout, measure_pipeline

    launch_module = importlib.import_module("tessera.runtime.launch")

    a, b, d, beta = 0.02, 0.003, 0.004, 1e-9
    _, pp = layout(ranks)

    def launch(fn, nproc, counts, timeout_s):
        assert nproc == ranks and counts == (pp, 8 * pp)
        rows = []
        for rank in range(nproc):
            slower = 1e-4 * rank  # the slowest rank's time is the step's
            times = {m: [a + b * m + slower + 1e-5 * k for k in range(5)] for m in counts}
            rows.append({**times, "ddp": [d + slower + 1e-5 * k for k in range(5)]})
        return rows

    monkeypatch.setattr(launch_module, "launch", launch)
    found = measure_pipeline(ranks, beta=beta)
    per_rank = _sent_per_rank(pp, 1, 1, "1f1b")  # messages of one micro-batch, per rank
    assert per_rank == pytest.approx(2 * (pp - 1) / pp)
    assert found["pipeline_message_s"] == pytest.approx(b / per_rank - 1024 * beta, rel=1e-9)
    assert found["pipeline_step_s"] == pytest.approx(a - d, rel=1e-9)
