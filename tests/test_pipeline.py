"""Pipelines: schedules as data (no processes), every schedule and the RNN wavefront equal to
one process."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera
from tessera.models import GPT, GPTConfig
from tessera.pipeline import (
    Action,
    Event,
    Pipeline,
    bubble_fraction,
    idle_fraction,
    max_in_flight,
    measure_layer_times,
    measured_idle_fraction,
    schedule,
    simulate,
    wavefront,
    write_chrome_trace,
)
from tessera.pipeline.deferred import WeightGradDeferral
from tessera.pipeline.gpt import gpt_as_sequential, gpt_state_from_sequential
from tessera.pipeline.messages import (
    decode_specs,
    encode_specs,
    floating,
    meta_length,
    pack,
    parts,
    unpack,
)
from tessera.pipeline.partition import (
    balance_by_cost,
    check_balance,
    parameter_costs,
    stage_bounds,
)
from tessera.pipeline.stage import shared_parameters
from tessera.viz.timeline import pipeline_timeline

_F32_EPS = torch.finfo(torch.float32).eps


def _assert_near_float64(got, oracle, ref64, what, reduction_length):
    """`got` (fp32, summed in another order) is as close to the float64 reference as the fp32
    one-process oracle is, within a factor 4 (two reorderings, micro-batch split and cross-stage
    sum, each at most doubling the rounding error), plus a floor of one rounding per reduced
    term (`reduction_length` terms of magnitude up to max|ref64|) for elements the oracle
    happened to get exact. Works on tensors and Python floats."""
    got, oracle, ref64 = (torch.as_tensor(t).detach().double() for t in (got, oracle, ref64))
    err = (got - ref64).abs().max().item()
    oracle_err = (oracle - ref64).abs().max().item()
    floor = reduction_length * _F32_EPS * ref64.abs().max().item()
    assert err <= 4 * oracle_err + floor, f"{what}: error {err:.3g}, oracle's {oracle_err:.3g}"


WAIT_S = 60.0
"""Bound of every wait between ranks here: a hang reports within a minute."""

# ---------------------------------------------------------------- pure parts, no processes


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 4), (4, 16)])
def test_schedule_runs_every_microbatch_forward_before_backward(name, p, m):
    stages = schedule(name, p, m)
    assert len(stages) == p
    for actions in stages:
        assert sorted(str(a) for a in actions) == sorted(
            [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
        )
        position = {str(a): k for k, a in enumerate(actions)}
        assert all(position[f"F{i}"] < position[f"B{i}"] for i in range(m))
        # forwards and backwards each run in micro-batch order on every stage
        assert [a.microbatch for a in actions if a.kind == "F"] == list(range(m))
        assert [a.microbatch for a in actions if a.kind == "B"] == list(range(m))
    simulate(stages)  # raises if the stages' orders can deadlock


@pytest.mark.parametrize("p,m", [(2, 4), (3, 8), (4, 16), (4, 3)])
def test_1f1b_holds_at_most_p_microbatches_gpipe_all(p, m):
    one_f_one_b, gpipe = schedule("1f1b", p, m), schedule("gpipe", p, m)
    for s in range(p):
        assert max_in_flight(one_f_one_b[s]) == min(p - s, m)
        assert max_in_flight(gpipe[s]) == m


def test_1f1b_stage_order_is_warmup_steady_cooldown():
    stages = [[str(a) for a in s] for s in schedule("1f1b", 3, 4)]
    assert stages[0] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert stages[1] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert stages[2] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_bubble_closed_forms_match_formulas_and_the_simulated_timeline():
    # FORMULAS.md test vector: p = 4, m = 16.
    assert bubble_fraction("gpipe", 4, 16) == pytest.approx(0.157895, abs=1e-6)
    assert bubble_fraction("1f1b", 4, 16) == pytest.approx(0.1875)
    assert bubble_fraction("naive", 4, 16) == pytest.approx(0.75)
    for name in ("naive", "gpipe", "1f1b"):
        for p, m in [(2, 4), (3, 7), (4, 16)]:
            timeline = simulate(schedule(name, p, m), forward_time=1.0, backward_time=2.0)
            span = max(end for stage in timeline for _, _, end in stage)
            for stage in timeline:
                busy = sum(end - start for _, start, end in stage)
                assert 1 - busy / span == pytest.approx(idle_fraction(name, p, m))


def test_partition_balances_cost_and_checks_coverage():
    assert balance_by_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_by_cost([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [1, 8]
    # costs 1..6 in 3 stages: the best largest stage is 9 ([1 2 3 | 4 5 | 6] has 9 = 4 + 5)
    counts = balance_by_cost([1, 2, 3, 4, 5, 6], 3)
    bounds = [sum(counts[:k]) for k in range(4)]
    assert max(sum(range(1 + a, 1 + b)) for a, b in zip(bounds, bounds[1:])) == 9
    with pytest.raises(ValueError, match="covers 3 layers"):
        check_balance([1, 2], 4, 2)
    with pytest.raises(ValueError, match="at least one layer"):
        check_balance([0, 4], 4, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        schedule("gpipe", 2, 0)


def test_stage_cutting_helpers_without_processes():
    model = _two_tied_groups_model()
    # a: 8x8; LayerNorm 2x8, gate 8x8+8, b 8x8; linear 8x8+8; a and b again (tied: in each)
    assert parameter_costs(model) == [64, 16 + 72 + 64, 72, 128]
    bounds = stage_bounds([2, 1, 1])
    assert bounds == [(0, 2), (2, 3), (3, 4)]
    # positions in model.parameters(): a is 0, b is 1; a on stages 0 and 2, b on stages 0 and 2
    assert shared_parameters(model, bounds) == [(0, [0, 2]), (1, [0, 2])]
    assert shared_parameters(model, stage_bounds([1, 1, 1, 1])) == [(0, [0, 3]), (1, [1, 3])]
    assert shared_parameters(model, stage_bounds([4])) == []  # one stage: nothing to exchange
    # the metadata message: each tensor's dtype and micro-batch 0's shape, every micro-batch's
    # size; a tensor whose dim 0 is not the micro-batch's keeps its shape in every micro-batch
    out = (torch.zeros(3, 5, 2, dtype=torch.float64), torch.ones(4, 4, dtype=torch.bool))
    meta = encode_specs(out, [3, 2, 2])
    assert meta.numel() == meta_length(3)
    specs, sizes = decode_specs(meta)
    assert sizes == [3, 2, 2]
    assert [(s.dtype, s.shape_for(2)) for s in specs] == [
        (torch.float64, (2, 5, 2)),
        (torch.bool, (4, 4)),
    ]
    with pytest.raises(ValueError, match="cannot be sent"):
        encode_specs([torch.zeros(2, dtype=torch.complex64)], [2])
    # a tuple travels as one message of aligned bytes; one tensor as itself
    tensors = (torch.randn(3, 5), torch.tensor([[1, 0, 1]], dtype=torch.bool), torch.arange(3))
    back = unpack(pack(tensors), parts(tensors))
    assert [t.dtype for t in floating(tensors)] == [torch.float32]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, tensors))
    assert pack(tensors[:1]) is tensors[0] or torch.equal(pack(tensors[:1]), tensors[0])


def test_simulate_times_a_schedule_and_refuses_a_deadlocking_one():
    f0, b0 = Action("F", 0), Action("B", 0)
    # 2 stages, 1 micro-batch: F on 0 then 1, B on 1 then 0 (forward 1, backward 2)
    timeline = simulate([[f0, b0], [f0, b0]], forward_time=1.0, backward_time=2.0)
    assert [[(str(a), t0, t1) for a, t0, t1 in stage] for stage in timeline] == [
        [("F0", 0.0, 1.0), ("B0", 4.0, 6.0)],
        [("F0", 1.0, 2.0), ("B0", 2.0, 4.0)],
    ]
    with pytest.raises(ValueError, match="deadlocks"):  # stage 0 runs B0 before its own F0
        simulate([[b0, f0], [f0, b0]])


def test_measured_idle_fraction_and_chrome_trace_of_hand_made_events(tmp_path):
    events = [
        Event(0, "F", 0, 10.0, 11.0),
        Event(1, "recv", 0, 10.0, 11.0),  # a wait: not busy
        Event(1, "F", 0, 11.0, 12.0),
        Event(1, "B", 0, 12.0, 13.0),
        Event(0, "B", 0, 13.0, 14.0),
        Event(0, "W", -1, 14.0, 15.0),
    ]
    # span 10..15 = 5 s; stage 0 busy 3 s, stage 1 busy 2 s
    assert measured_idle_fraction(events) == pytest.approx([0.4, 0.6])
    assert measured_idle_fraction([]) == []
    trace = json.loads(write_chrome_trace(events, tmp_path / "t.json").read_text())
    spans = [
        (e["name"], e["tid"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"
    ]
    assert spans == [
        ("F0", 0, 0.0, 1e6),
        ("recv", 1, 0.0, 1e6),
        ("F0", 1, 1e6, 1e6),
        ("B0", 1, 2e6, 1e6),
        ("B0", 0, 3e6, 1e6),
        ("W", 0, 4e6, 1e6),
    ]
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert threads == {0: "stage 0", 1: "stage 1"}


class _Sleep(nn.Module):
    def __init__(self, seconds: float, width: int) -> None:
        super().__init__()
        self.seconds, self.width = seconds, width

    def forward(self, x):
        assert x.shape[-1] == self.width  # fed the previous layer's output
        time.sleep(self.seconds)
        return x


def test_measure_layer_times_runs_each_layer_on_the_previous_output():
    model = nn.Sequential(nn.Linear(4, 6), _Sleep(0.02, 6), _Sleep(0.0, 6))
    times = measure_layer_times(model, torch.randn(3, 4), repeats=3)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert times[1] >= 0.02  # a lower bound (sleep never returns early), not a speed claim


@pytest.mark.parametrize("defer", [True, False])
def test_one_stage_pipeline_is_gradient_accumulation_without_processes(defer):
    model = _mlp()
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()  # float64: the yardstick of both float32 results
    # a world of one: no messages
    pipe = Pipeline(model, num_microbatches=3, schedule="gpipe", defer_weight_grads=defer)
    x, y = torch.randn(7, 12), torch.randn(7, 3)
    loss = pipe.train_step(x, y, F.mse_loss)
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    exact_loss = F.mse_loss(exact(x.double()), y.double())
    exact_loss.backward()
    check_close([loss], [ref_loss.item()], [exact_loss.item()], what="one-stage loss")
    grads = [[p.grad for p in m.parameters()] for m in (model, reference, exact)]
    check_close(*grads, what="one-stage gradients, summed over 3 micro-batches")
    assert [e.kind for e in pipe.timeline] == ["F"] * 3 + ["B"] * 3 + ["W"] * defer
    if defer:  # the W pass computed every linear weight's gradient: B left them alone
        assert pipe.deferral.peak_bytes > 0 and not pipe.deferral.pending()
    with pytest.raises(ValueError, match="gives 2 stages, but the pipeline has 1 ranks"):
        Pipeline(_mlp(), num_microbatches=1, split=["7"])
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        Pipeline(_mlp(), num_microbatches=2, schedule="zero-bubble")


def test_deferred_weight_gradients_equal_autograd_for_shared_frozen_and_stale_cases():
    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    frozen = nn.Linear(6, 4)
    frozen.bias.requires_grad_(False)
    reference = copy.deepcopy(nn.ModuleList([shared, frozen]))
    exact = copy.deepcopy(reference).double()
    deferral = WeightGradDeferral(list(shared.parameters()) + list(frozen.parameters()))
    x = torch.randn(5, 3, 6)
    with deferral.capturing():  # a stale stash from a step that failed half-way
        frozen(shared(x)).sum().backward()
    deferral.clear()
    for part in x.split([2, 3]):  # two micro-batches; `shared` runs twice in each
        with deferral.capturing():
            out = frozen(torch.tanh(shared(shared(part))))
        out.square().sum().backward()
        assert shared.weight.grad is None  # B left the weight gradients to the W pass
    pending = {id(p) for p in (shared.weight, shared.bias, frozen.weight)}  # not the frozen bias
    assert {id(p) for p in deferral.pending()} == pending and frozen.weight.grad is None
    deferral.weight_pass()
    ref_shared, ref_frozen = reference
    ref_frozen(torch.tanh(ref_shared(ref_shared(x)))).square().sum().backward()
    exact_shared, exact_frozen = exact
    exact_frozen(torch.tanh(exact_shared(exact_shared(x.double())))).square().sum().backward()
    for got, want, best in zip([shared, frozen], [ref_shared, ref_frozen], exact):
        for p, q, r in zip(got.parameters(), want.parameters(), best.parameters()):
            if q.grad is None:
                assert p.grad is None
            else:
                check_close(p.grad, q.grad, r.grad, what="deferred weight gradient")
    assert frozen.bias.grad is None and not deferral.pending()


# ---------------------------------------------------------------- on processes


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(5)]
    return nn.Sequential(*layers, nn.Linear(12, 3))


def _check_mlp(name: str, num_microbatches: int, batch: int, balance=None, defer=True) -> list:
    model = _mlp()
    reference, reference64 = copy.deepcopy(model), copy.deepcopy(model).double()
    position = {id(p): k for k, p in enumerate(model.parameters())}
    pipe = Pipeline(
        model,
        num_microbatches=num_microbatches,
        schedule=name,
        balance=balance,
        defer_weight_grads=defer,
    )
    optimizer = torch.optim.AdamW(pipe.module.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer64 = torch.optim.AdamW(reference64.parameters(), lr=1e-2)
    reduction = batch * 12  # a weight gradient sums batch rows; a forward sums 12 features
    torch.manual_seed(1)
    for step in range(3):
        x, y = torch.randn(batch, 12), torch.randn(batch, 3)
        loss = pipe.train_step(x, y, F.mse_loss)
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        loss64 = F.mse_loss(reference64(x.double()), y.double())
        loss64.backward()
        # micro-batch losses weighted by size and summed in another order: float32 rounding
        _assert_near_float64(loss, ref_loss.item(), loss64.item(), f"loss {step}", reduction)
        if step == 0:  # gradients directly: AdamW would hide a constant factor
            oracle, oracle64 = list(reference.parameters()), list(reference64.parameters())
            for p in pipe.module.parameters():
                k = position[id(p)]
                _assert_near_float64(
                    p.grad, oracle[k].grad, oracle64[k].grad, f"gradient {k}", reduction
                )
        for opt in (optimizer, ref_optimizer, optimizer64):
            opt.step()
            opt.zero_grad()
    full = pipe.full_state_dict()
    assert full.keys() == reference.state_dict().keys()
    state64 = reference64.state_dict()
    for key, value in reference.state_dict().items():
        _assert_near_float64(full[key], value, state64[key], key, reduction)
    return pipe.gather_timeline()


def _check_gpt(name: str, num_microbatches: int, defer: bool = True) -> None:
    config = GPTConfig(vocab_size=12, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    gpt = GPT(config)
    reference, reference64 = copy.deepcopy(gpt), copy.deepcopy(gpt).double()
    pipe = Pipeline(
        gpt_as_sequential(gpt),
        num_microbatches=num_microbatches,
        schedule=name,
        defer_weight_grads=defer,
    )
    # SGD with momentum: attention key biases have a true gradient of zero (DESIGN.md, Testing)
    optimizers = [
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for m in (pipe.module, reference, reference64)
    ]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch.manual_seed(2)
    for _ in range(3):
        x, y = torch.randint(0, 12, (4, 8)), torch.randint(0, 12, (4, 8))
        pipe.train_step(x, y, loss_fn)
        loss_fn(reference(x), y).backward()
        loss_fn(reference64(x), y).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    full = gpt_state_from_sequential(pipe.full_state_dict(), config.n_layer)
    assert full.keys() == reference.state_dict().keys()
    state64 = reference64.state_dict()
    for key, value in reference.state_dict().items():
        # the tied wte/lm_head: first and last stage summed their gradients, so both equal one
        # process's single matrix; a weight gradient sums 4 x 8 tokens
        _assert_near_float64(full[key], value, state64[key], key, 4 * 8)


def _check_wavefront(world_size: int) -> None:
    for rnn_type, with_hx in [(nn.LSTM, False), (nn.GRU, False), (nn.LSTM, True), (nn.GRU, True)]:
        torch.manual_seed(0)
        rnn = rnn_type(5, 7, num_layers=world_size, batch_first=True)
        reference = copy.deepcopy(rnn)
        split = wavefront(rnn)
        x = torch.randn(3, 6, 5, requires_grad=True)  # (B, T, I), the same on every rank
        x_ref = x.detach().clone().requires_grad_()
        hx = hx_ref = None
        if with_hx:  # a non-zero initial state, (L, B, H) each, with its own gradient
            n_states = 2 if rnn_type is nn.LSTM else 1
            parts = [torch.randn(world_size, 3, 7, requires_grad=True) for _ in range(n_states)]
            ref_parts = [h.detach().clone().requires_grad_() for h in parts]
            hx, hx_ref = (tuple(parts), tuple(ref_parts)) if n_states == 2 else (*parts, *ref_parts)
        out, state = split(x, hx)
        ref_out, ref_state = reference(x_ref, hx_ref)
        out.square().sum().backward()
        ref_out.square().sum().backward()
        # float64 reference: the same RNN, input and initial state in double
        reference64 = copy.deepcopy(reference).double()
        x64 = x.detach().double().requires_grad_()
        hx64 = None
        if with_hx:
            parts64 = [h.detach().double().requires_grad_() for h in parts]
            hx64 = tuple(parts64) if len(parts64) == 2 else parts64[0]
        out64, state64 = reference64(x64, hx64)
        out64.square().sum().backward()
        # cell-by-cell vs fused layers, float32 rounding only; the longest reduction is the
        # backward through 6 steps of gate sums over 4 x 7 hidden units
        length = 6 * 4 * 7
        _assert_near_float64(out, ref_out, out64, "wavefront output", length)
        _assert_near_float64(x.grad, x_ref.grad, x64.grad, "input gradient", length)
        if with_hx:  # the initial state's gradient, every layer's, as the unsplit RNN gives it
            for got, want, want64 in zip(parts, ref_parts, parts64):
                assert got.grad is not None, "no gradient reached the initial state"
                _assert_near_float64(got.grad, want.grad, want64.grad, "hx gradient", length)
        finals = state if rnn_type is nn.LSTM else (state,)
        ref_finals = ref_state if rnn_type is nn.LSTM else (ref_state,)
        finals64 = state64 if rnn_type is nn.LSTM else (state64,)
        for got, want, want64 in zip(finals, ref_finals, finals64):
            _assert_near_float64(got, want, want64, "final state", length)
        layer = split.layer
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            got = getattr(rnn, f"{name}_l{layer}").grad  # the user's own parameter got it
            want = getattr(reference, f"{name}_l{layer}").grad
            want64 = getattr(reference64, f"{name}_l{layer}").grad
            _assert_near_float64(got, want, want64, f"{name}_l{layer} gradient", length * 3)
        events = split.gather_timeline()  # LSTM/GRU steps: layer k step t waits for k-1 step t
        end = {(e.stage, e.kind, e.microbatch): e.end for e in events}
        assert len(events) == 2 * 6 * world_size  # forward and backward of 6 steps per layer
        for e in events:
            if e.kind == "F" and e.stage > 0:
                assert e.start >= end[(e.stage - 1, "F", e.microbatch)]
            if e.kind == "B" and e.stage < world_size - 1:
                assert e.start >= end[(e.stage + 1, "B", e.microbatch)]
    with pytest.raises(ValueError, match="layers need"):
        wavefront(nn.LSTM(4, 4, num_layers=world_size + 1))
    with pytest.raises(ValueError, match="initial state of shape"):
        wavefront(nn.GRU(4, 4, num_layers=world_size))(torch.randn(2, 3, 4), torch.zeros(1, 3, 4))


def pipeline_worker(out_dir: str) -> list:
    ctx = tessera.init(timeout_s=WAIT_S)
    _check_wavefront(ctx.world_size)
    idle = []
    for name in ("naive", "gpipe", "1f1b"):
        for m in (1, 3, 4):
            events = _check_mlp(name, m, batch=7)  # 7 = uneven micro-batches for m = 3, 4
        idle.append(measured_idle_fraction(events))
        _check_gpt(name, 2)
        _check_mlp(name, 3, batch=7, defer=False)  # weight gradients inside B, as autograd does
        _check_gpt(name, 2, defer=False)
    assert {e.kind for e in events} >= {"F", "B", "W", "send", "recv"}
    assert len([e for e in events if e.kind == "F"]) == 4 * ctx.world_size
    if ctx.world_size == 2:
        _check_mlp("1f1b", 2, batch=4, balance=[1, 5])
        with pytest.raises(ValueError, match="larger than the batch"):
            pipe = Pipeline(_mlp(), num_microbatches=5)
            pipe.train_step(torch.randn(4, 12), torch.randn(4, 3), F.mse_loss)
        with pytest.raises(ValueError, match="covers 5 layers"):
            Pipeline(_mlp(), num_microbatches=2, balance=[2, 3])
        if ctx.rank == 0:
            pipeline_timeline(events, f"{out_dir}/timeline.png")
            pipeline_timeline(events, f"{out_dir}/timeline.json")
    return idle


def test_pipeline_schedules_on_two_stages_equal_one_process(run_ranks, tmp_path):
    idle = run_ranks(pipeline_worker, 2, str(tmp_path), deadline_s=120)
    assert all(0 <= f < 1 for rank in idle for fractions in rank for f in fractions)
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    trace = json.loads((tmp_path / "timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"F0", "B3", "thread_name"} <= names


@pytest.mark.slow
def test_pipeline_schedules_on_three_stages_equal_one_process(run_ranks, tmp_path):
    run_ranks(pipeline_worker, 3, str(tmp_path), deadline_s=150)


# ------------------------------------- tied parameters over several stage sets, gradient clipping


class _TiedIn(nn.Module):
    """Stage 0: a unit with one weight, used directly (no nn.Linear)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight))


class _NormThenTied(nn.Module):
    """Stage 1: a ModuleDict whose children are called one by one, then a weight used directly."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({"norm": nn.LayerNorm(8), "gate": nn.Linear(8, 8)})
        self.weight = weight

    def forward(self, x):
        x = self.parts["norm"](x)
        return torch.tanh(F.linear(x, self.weight)) * torch.sigmoid(self.parts["gate"](x))


class _Twice(nn.Module):
    """Stage 2: one linear module called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(torch.tanh(self.linear(x))))


class _TiedOut(nn.Module):
    """Stage 3: reuses stage 0's weight (transposed) and stage 1's: two tied groups, {0, 3} and
    {1, 3}, so stage 3 holds two tied parameters where stages 0 and 1 hold one each."""

    def __init__(self, first: nn.Parameter, second: nn.Parameter) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return x @ self.first + F.linear(x, self.second)


def _two_tied_groups_model() -> nn.Sequential:
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(8, 8) / 3)
    b = nn.Parameter(torch.randn(8, 8) / 3)
    return nn.Sequential(_TiedIn(a), _NormThenTied(b), _Twice(), _TiedOut(a, b))


def _oracle_grads(model: nn.Sequential, x, y) -> list[torch.Tensor]:
    """Plain PyTorch: the whole batch through the unsplit model; gradients in parameter order."""
    model.zero_grad()
    F.mse_loss(model(x.to(model[0].weight.dtype)), y.to(model[0].weight.dtype)).backward()
    return [p.grad.clone() for p in model.parameters()]


def tied_groups_worker() -> list[dict]:
    """4 stages, tied groups {0, 3} and {1, 3}, two schedules (with and without the W pass)."""
    tessera.init(timeout_s=WAIT_S)
    return [_check_tied_groups("1f1b", True), _check_tied_groups("gpipe", False)]


def _check_tied_groups(schedule_name: str, defer: bool) -> dict:
    """Gradients, clipping and one SGD step against a single-process oracle (fp32) and a
    float64 reference, all computed here; returns this stage's parameters by position."""
    model = _two_tied_groups_model()
    oracle, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    position = {id(p): k for k, p in enumerate(model.parameters())}
    # a short deadline: a tied exchange whose partners disagree fails in seconds, not minutes
    pipe = Pipeline(
        model,
        num_microbatches=3,
        schedule=schedule_name,
        balance=[1, 1, 1, 1],
        timeout_s=10,
        defer_weight_grads=defer,
    )
    full_state = model.state_dict()  # (tied parameters under each of their names)
    for key, value in pipe.module.state_dict().items():
        assert torch.equal(value, full_state[pipe.full_key(key)]), key
    assert pipe.full_key("0.weight").startswith(f"{pipe.stage_index}.")
    torch.manual_seed(1)
    x, y = torch.randn(7, 8), torch.randn(7, 8)  # 7 rows: uneven micro-batches (3, 2, 2)
    pipe.train_step(x, y, F.mse_loss)
    want32, want64 = _oracle_grads(oracle, x, y), _oracle_grads(ref64, x, y)
    mine = list(pipe.module.parameters())
    for p in mine:
        k = position[id(p)]
        # reductions: 7 rows x 8 features per weight gradient, plus the tied sum over stages
        _assert_near_float64(p.grad, want32[k], want64[k], f"gradient {k}", 7 * 8 + 2)

    # clipping: the norm over all stages (tied weights once) must equal torch's on one process
    norm64 = torch.cat([g.flatten() for g in want64]).norm().item()
    max_norm = 0.25 * norm64  # small enough to act
    norm = pipe.clip_grad_norm(max_norm)
    oracle_norm = nn.utils.clip_grad_norm_(oracle.parameters(), max_norm).item()
    n_params = sum(p.numel() for p in oracle.parameters())
    # the norm sums every squared gradient element: reduction length n_params
    assert abs(norm - norm64) <= 4 * abs(oracle_norm - norm64) + n_params * _F32_EPS * norm64, (
        norm,
        oracle_norm,
        norm64,
    )
    scale64 = max_norm / (norm64 + 1e-6)
    for p in mine:
        k = position[id(p)]
        want = list(oracle.parameters())[k].grad
        _assert_near_float64(p.grad, want, want64[k] * scale64, f"clipped {k}", 7 * 8 + 2)

    # one SGD step without momentum: a wrong gradient factor would show in the parameters
    torch.optim.SGD(pipe.module.parameters(), lr=0.5).step()
    torch.optim.SGD(oracle.parameters(), lr=0.5).step()
    with torch.no_grad():
        for q, g in zip(ref64.parameters(), want64):
            q -= 0.5 * g * scale64
    oracle_params, ref_params = list(oracle.parameters()), list(ref64.parameters())
    for p in mine:
        k = position[id(p)]
        _assert_near_float64(p, oracle_params[k], ref_params[k], f"stepped {k}", 7 * 8 + 2)
    return {position[id(p)]: p.detach().clone() for p in mine}


def test_two_tied_groups_on_different_stage_sets_equal_one_process(run_ranks):
    for stages in zip(*run_ranks(tied_groups_worker, 4, deadline_s=120)):  # per configuration
        holders = {0: [0, 3], 1: [1, 3]}  # parameter positions 0 (a) and 1 (b)
        for position, ranks in holders.items():
            assert all(position in stages[r] for r in ranks)
            # each holder added the same parts in the same order: bitwise equal copies
            assert torch.equal(stages[ranks[0]][position], stages[ranks[1]][position])
