"""Direct tests of public names the other test files only reached indirectly (or not at all).

`test_public_api.py` requires every name of a package's `__all__` to appear in some test; these
are the tests that make those appearances count: each fails if the name's body is replaced by
a wrong one (pipeline schedule records, chrome traces, tensor-parallel mappings and attention,
the RNN wavefront class, comm checks, the runtime context, the loss plot).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from _tolerance import check_close
from torch import nn

import tessera
from tessera.comm import set_checks
from tessera.comm.diagnostics import checks_enabled
from tessera.models import GPT, GPTConfig
from tessera.models.gpt import CausalSelfAttention
from tessera.pipeline import (
    SCHEDULES,
    Action,
    Event,
    WavefrontRNN,
    measure_layer_times,
    schedule,
    wavefront,
    write_chrome_trace,
)
from tessera.runtime import DEFAULT_TIMEOUT_S, Context
from tessera.tensor_parallel import (
    STYLES,
    ParallelCausalSelfAttention,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    parallelize,
    parallelize_gpt,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from tessera.viz import plot_loss


def test_schedules_are_lists_of_actions():
    assert SCHEDULES == ("naive", "gpipe", "1f1b", "interleaved")
    for name in SCHEDULES[:3]:  # (interleaved: v chunks, tests/test_pipeline_interleaved.py)
        stages = schedule(name, 2, 3)
        for actions in stages:  # every stage runs each micro-batch's F then its B, once
            assert all(isinstance(a, Action) for a in actions)
            assert sorted((a.kind, a.microbatch) for a in actions) == sorted(
                [("F", m) for m in range(3)] + [("B", m) for m in range(3)]
            )
            for m in range(3):
                assert actions.index(Action("F", m)) < actions.index(Action("B", m))
    # GPipe: all forwards, then all backwards; 1F1B on the last stage alternates.
    assert [str(a) for a in schedule("gpipe", 2, 3)[0]] == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert [str(a) for a in schedule("1f1b", 2, 3)[1]] == ["F0", "B0", "F1", "B1", "F2", "B2"]


def test_chrome_trace_holds_every_event_in_microseconds(tmp_path):
    events = [
        Event(stage=0, kind="F", microbatch=0, start=10.0, end=10.5),
        Event(stage=1, kind="F", microbatch=0, start=10.5, end=11.0),
        Event(stage=1, kind="send", microbatch=0, start=11.0, end=11.25),
    ]
    assert events[0].duration == 0.5
    path = write_chrome_trace(events, tmp_path / "trace.json")
    data = json.loads(path.read_text())
    trace = data["traceEvents"] if isinstance(data, dict) else data
    spans = [e for e in trace if e.get("ph") == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in spans] == [
        ("F0", 0, 0.0, 500000.0),
        ("F0", 1, 500000.0, 500000.0),
        ("send", 1, 1000000.0, 250000.0),
    ]


def test_measure_layer_times_runs_each_layer_on_the_previous_output():
    calls = []

    class Record(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.width = width

        def forward(self, x):
            calls.append((self.width, x.shape[-1]))
            return x.new_zeros(x.shape[0], self.width)

    times = measure_layer_times(nn.Sequential(Record(3), Record(5)), torch.zeros(2, 4), repeats=3)
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert calls == [(3, 4)] * 3 + [(5, 3)] * 3  # layer 2 is fed layer 1's output


def test_plot_loss_writes_a_png(tmp_path):
    records = [{"step": s, "loss": 3.0 / s} for s in range(1, 6)]
    path = plot_loss(records, tmp_path / "loss.png", title="t")
    assert path == tmp_path / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def _two_ranks() -> dict:
    ctx = tessera.init()
    found: dict = {"context": ctx}
    world, rank = ctx.world_size, ctx.rank
    # Megatron's f and g, and the split / gather pair, forward and backward.
    x = torch.arange(4.0).repeat(2, 1) + rank  # (2, 4), different per rank
    a = x.clone().requires_grad_()
    out = copy_to_tensor_parallel(a)
    (out * (rank + 1)).sum().backward()
    found["copy"] = (torch.equal(out, x), a.grad.unique().tolist())  # identity; grads summed
    b = x.clone().requires_grad_()
    out = reduce_from_tensor_parallel(b)
    (out * (rank + 1)).sum().backward()
    found["reduce"] = (out.tolist(), b.grad.unique().tolist())  # summed; grad untouched
    c = x.clone().requires_grad_()
    out = scatter_to_tensor_parallel(c)
    (out * (rank + 1)).sum().backward()
    found["scatter"] = (out.tolist(), c.grad.tolist())
    d = torch.full((2, 2), float(rank), requires_grad=True)
    out = gather_from_tensor_parallel(d)
    (out * torch.arange(4.0)).sum().backward()
    found["gather"] = (out.tolist(), d.grad.tolist())
    # A GPT's attention, heads split over the ranks, against the dense module (and float64).
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    dense, exact = copy.deepcopy(gpt.blocks[0].attn), copy.deepcopy(gpt.blocks[0].attn).double()
    parallelize_gpt(gpt)
    split = gpt.blocks[0].attn
    found["attention_type"] = (type(dense) is CausalSelfAttention, type(split).__name__)
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))
    found["attention"] = (split(x), dense(x), exact(x.double()))
    found["is_parallel"] = isinstance(split, ParallelCausalSelfAttention)
    # The wavefront's module class, against nn.LSTM.
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, num_layers=world, batch_first=True)
    reference, exact_lstm = copy.deepcopy(lstm), copy.deepcopy(lstm).double()
    split_rnn = wavefront(lstm)
    found["wavefront_type"] = isinstance(split_rnn, WavefrontRNN)
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2))
    found["wavefront"] = (split_rnn(x)[0], reference(x)[0], exact_lstm(x.double())[0])
    # set_checks: with checks on, mismatched collectives are caught; the switch is honoured.
    set_checks(False)
    found["checks_off"] = checks_enabled()
    set_checks(True)
    found["checks_on"] = checks_enabled()
    dist.barrier()
    return found


def test_mappings_attention_wavefront_checks_and_context_on_two_ranks(run_ranks):
    assert STYLES == ("column", "row", "vocab", "column_gather", "embedding")
    with pytest.raises(ValueError, match="unknown tensor-parallel style"):
        parallelize(nn.Sequential(nn.Linear(2, 2)), {"0": "diagonal"})
    results = run_ranks(_two_ranks, 2)
    for rank, found in enumerate(results):
        ctx = found["context"]
        assert isinstance(ctx, Context) and (ctx.rank, ctx.world_size) == (rank, 2)
        assert ctx.is_main == (rank == 0) and ctx.backend == "gloo"
        assert 0 < ctx.timeout_s <= DEFAULT_TIMEOUT_S
        # f: identity forward, all-reduce (sum) of the gradient: 1 + 2 = 3 on both ranks
        assert found["copy"] == (True, [3.0])
        # g: sum forward (rank 0's x + rank 1's x), the gradient passes unchanged
        row = [2 * v + 1 for v in range(4)]
        assert found["reduce"] == ([row, row], [float(rank + 1)])
        # scatter: this rank's half of the last dimension; gradient all-gathered
        half = [[float(v + rank) for v in range(2 * rank, 2 * rank + 2)]] * 2
        assert found["scatter"] == (half, [[1.0, 1.0, 2.0, 2.0]] * 2)
        # gather: both halves side by side; the gradient is this rank's slice
        assert found["gather"] == ([[0.0, 0.0, 1.0, 1.0]] * 2, [[2.0 * rank, 2.0 * rank + 1]] * 2)
        assert found["attention_type"] == (True, "ParallelCausalSelfAttention")
        assert found["is_parallel"]
        check_close(*found["attention"], what=f"rank {rank} split attention")
        assert found["wavefront_type"]
        if rank == 1:  # the last layer's rank holds the output
            check_close(*found["wavefront"], what="wavefront LSTM output")
        assert (found["checks_off"], found["checks_on"]) == (False, True)


def test_every_lazy_name_stays_what_it_names_after_its_module_is_imported():
    # `tessera.strategies.setup` was the function's module too: once anything imported that
    # module, `from tessera.strategies import setup` gave the module, not the function.
    import importlib

    import tessera.strategies as strategies

    for package, lazy in ((strategies, strategies._LAZY), (tessera, tessera._LAZY)):
        for name, where in lazy.items():
            module, attribute = where if isinstance(where, tuple) else (where, name)
            importlib.import_module(module)  # what the trainer (or a user) may import first
            value = getattr(package, name)
            if attribute is not None:  # a function or class, not one of tessera's packages
                assert not isinstance(value, type(strategies)), f"{package.__name__}.{name}"
    assert strategies.setup is tessera.setup and callable(tessera.setup)
