"""ZeRO stages 1-3 against one process on the whole batch; memory; bad input; partitioning."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from _tolerance import BF16_ULP, FP32_ULP, check_close
from torch import nn

import tessera
from tessera.models import GPT, MLP, GPTConfig, MLPConfig
from tessera.zero import (
    STAGES,
    ZeroOptimizer,
    ZeroStage1,
    ZeroStage2,
    ZeroStage3,
    estimate_memory,
    full_state_dict,
    initialize,
    measure_memory,
)
from tessera.zero.partition import FlatLayout, padded_numel, shard_pieces, shard_range

STEPS = 3
STAGE_CLASSES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp_odd":  # prime widths: no parameter size divides by 2, 3 or 4 ranks
        return MLP(MLPConfig(in_features=7, hidden=(13, 11), out_features=5))
    # GPT's head is tied to its token embedding. No biases with AdamW: an attention key bias has
    # a true gradient of exactly zero, which Adam turns into full-size updates of noise
    # (DESIGN.md, Testing); the "gpt_bias" case runs SGD with momentum instead.
    bias = kind == "gpt_bias"
    return GPT(GPTConfig(vocab_size=19, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=bias))


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp_odd":
        return torch.randn(12, 7, generator=g), torch.randint(0, 5, (12,), generator=g)
    idx = torch.randint(0, 19, (12, 9), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2) if out.dim() == 3 else out, y.flatten())


def _optimizer(kind: str) -> tuple[type[torch.optim.Optimizer], dict]:
    if kind == "gpt_bias":
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}


def _max_norm(kind: str) -> float:
    """Clip (it acts) with SGD, which is linear in the gradient; AdamW is scale-invariant."""
    return 0.5 if kind == "gpt_bias" else 1e6


def _batch64(kind: str, step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(kind, step)
    return (x.to(dtype) if x.is_floating_point() else x), y


def _reference(kind: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The oracle: one process, the whole batch, plain PyTorch (float64: the exact answer)."""
    model = _model(kind).to(dtype)
    cls, kwargs = _optimizer(kind)
    opt = cls(model.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = _batch64(kind, step, dtype)
        _loss(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), _max_norm(kind))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference_bf16(kind: str) -> dict[str, torch.Tensor]:
    """The mixed-precision oracle: bf16 weights compute the whole batch, fp32 masters step."""
    masters = _model(kind)
    compute = _model(kind).to(torch.bfloat16)
    cls, kwargs = _optimizer(kind)
    opt = cls(masters.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = _batch(kind, step)
        out = compute(x.to(torch.bfloat16) if x.is_floating_point() else x).float()
        _loss(out, y).backward()
        for master, low in zip(masters.parameters(), compute.parameters()):
            master.grad = low.grad.float()
            low.grad = None
        nn.utils.clip_grad_norm_(masters.parameters(), _max_norm(kind))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, low in zip(masters.parameters(), compute.parameters()):
                low.copy_(master)
    return {k: v.detach().clone() for k, v in masters.state_dict().items()}


def _train_zero(kind: str, stage: int, mixed_precision: str | None = None):
    ctx = tessera.init()
    cls, kwargs = _optimizer(kind)
    model, opt = initialize(
        _model(kind), cls, stage=stage, mixed_precision=mixed_precision, **kwargs
    )
    for step in range(STEPS):
        x, y = (t.tensor_split(ctx.world_size)[ctx.rank] for t in _batch(kind, step))
        opt.zero_grad()
        _loss(model(x), y).backward()
        if stage:
            opt.clip_grad_norm(_max_norm(kind))  # the norm is global: summed over the shards
        else:
            nn.utils.clip_grad_norm_(model.parameters(), _max_norm(kind))  # DDP: full gradients
        opt.step()
    return model, opt


def _without_scores(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the query and key projections from qkv weights; value rows stay checked.

    Softmax ignores a per-query shift of the scores, and at initialization attention is near
    uniform, so the true gradients of the query and key rows are 1e-8..3e-5 here (values:
    1e-5..5e-3). Adam divides by their RMS and turns float32 rounding noise in them into
    full-size updates, so two correct implementations differ there by far more than their
    rounding (DESIGN.md, Testing); the cases with biases run SGD, which checks them all."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("attn.qkv.weight"):
            tensor = tensor[2 * (tensor.shape[0] // 3) :]
        out[name] = tensor
    return out


def _equivalence(cases: list[tuple[str, int, str | None]]) -> list[tuple[dict, dict, dict]]:
    """Per case: (tessera's final state, the float32 oracle's, the float64 reference's)."""
    found = []
    for kind, stage, mixed_precision in cases:
        model, opt = _train_zero(kind, stage, mixed_precision)
        ours = full_state_dict(model)
        if stage:
            opt.remove_hooks()
        oracle = _reference_bf16(kind) if mixed_precision else _reference(kind)
        exact = _reference(kind, torch.float64)
        found.append(tuple(_without_scores(s) for s in (ours, oracle, exact)))
    return found if torch.distributed.get_rank() == 0 else []


def _memory() -> dict:
    """Measured bytes per rank for each stage against the estimate (fp32 AdamW: 4 + 4 + 8)."""
    ctx = tessera.init()
    found = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=19, block_size=8, n_layer=2, n_head=2, n_embd=32))
        num_params = sum(p.numel() for p in model.parameters())
        model, opt = initialize(model, torch.optim.AdamW, stage=stage, lr=1e-3)
        x, y = _batch("gpt", 0)
        _loss(
            model(x.tensor_split(ctx.world_size)[ctx.rank]),
            y.tensor_split(ctx.world_size)[ctx.rank],
        ).backward()
        opt.step()
        opt.zero_grad()  # DDP keeps its gradient buckets; stages 2 and 3 their shard
        measured = measure_memory(model, opt)
        if stage:
            opt.remove_hooks()
        estimate = estimate_memory(
            num_params, ctx.world_size, stage, param_bytes=4, grad_bytes=4, optimizer_bytes=8
        )
        found[stage] = (measured, estimate)
    return found


def _bad_inputs() -> list[str]:
    ctx = tessera.init()
    attempts = [
        lambda: initialize(nn.Linear(3, 3), torch.optim.SGD, stage=4, lr=0.1),
        lambda: initialize(nn.Linear(3, 3), nn.Linear, stage=1),
        lambda: initialize(nn.Linear(3, 3), torch.optim.AdamW, stage=1, lr=0.1, momentun=0.9),
        lambda: initialize(nn.Linear(3, 3 + ctx.rank), torch.optim.SGD, stage=2, lr=0.1),
        lambda: initialize(nn.Linear(3, 3), torch.optim.SGD, stage=1, mixed_precision="fp8"),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return messages


def _one_adamw_step(dtype: torch.dtype) -> nn.Module:
    reference = _model("mlp_odd").to(dtype)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x, y = _batch64("mlp_odd", 0, dtype)
    _loss(reference(x), y).backward()
    ref_opt.step()
    return reference


def _features() -> dict:
    """Micro-batch accumulation without no_sync (every stage), stage 3 under no_grad.

    Each check returns (tessera, float32 oracle, float64 reference) for `check_close`."""
    ctx = tessera.init()
    found: dict = {}
    oracle, exact = _one_adamw_step(torch.float32), _one_adamw_step(torch.float64)
    x, y = _batch("mlp_odd", 0)
    mine = [t.tensor_split(ctx.world_size)[ctx.rank] for t in (x, y)]
    for stage in (1, 2, 3):
        model, opt = initialize(_model("mlp_odd"), torch.optim.AdamW, stage=stage, lr=1e-2)
        for part_x, part_y in zip(*(t.tensor_split(2) for t in mine)):
            (_loss(model(part_x), part_y) / 2).backward()  # two micro-batches, one step
        opt.step()
        found[f"accumulate{stage}"] = (
            full_state_dict(model),
            oracle.state_dict(),
            exact.state_dict(),
        )
        with torch.no_grad():  # stage 3 gathers and frees per layer without a backward
            found[f"no_grad{stage}"] = (model(x), oracle(x), exact(x.double()))
        opt.remove_hooks()
    return found


def _gpt2(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype)


def _huggingface_gpt2_stage3() -> tuple[dict, dict, dict] | None:
    """A transformers GPT-2 (tuple outputs, tied head, Conv1D layers) under ZeRO-3."""
    try:
        from transformers import GPT2Config
    except ImportError:
        return None
    ctx = tessera.init()
    config = GPT2Config(
        vocab_size=19, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model, opt = initialize(_gpt2(config), torch.optim.SGD, stage=3, lr=0.1, momentum=0.9)
    references = [_gpt2(config, dtype) for dtype in (torch.float32, torch.float64)]
    ref_opts = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in references]
    for step in range(STEPS):  # SGD: GPT-2's key biases have a zero true gradient
        x, y = _batch("gpt", step)
        opt.zero_grad()
        mine = [t.tensor_split(ctx.world_size)[ctx.rank] for t in (x, y)]
        _loss(model(mine[0]).logits, mine[1]).backward()
        opt.step()
        for reference, ref_opt in zip(references, ref_opts):
            _loss(reference(x).logits, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    floating = [
        {k: v for k, v in r.state_dict().items() if v.is_floating_point()} for r in references
    ]
    full = full_state_dict(model)
    opt.remove_hooks()
    return {k: full[k] for k in floating[0]}, floating[0], floating[1]


TWO_RANK_CASES = [(k, s, None) for s in (1, 2, 3) for k in ("gpt_bias", "mlp_odd")]
TWO_RANK_CASES += [("gpt", 0, None)] + [("gpt_bias", s, "bf16") for s in (1, 2, 3)]


def _collectives_issued() -> dict[int, list[tuple[str, str]]]:
    """(kind, algorithm) of every collective one step of each stage issued (issue 11)."""
    from tessera import comm

    ctx = tessera.init()
    issued = {}
    for stage in (1, 2, 3):
        model, opt = initialize(_model("mlp_odd"), torch.optim.SGD, stage=stage, lr=0.1)
        last = comm.history()[-1].seq  # the history keeps 64 records: select by number
        x, y = (t.tensor_split(ctx.world_size)[ctx.rank] for t in _batch("mlp_odd", 0))
        _loss(model(x), y).backward()
        opt.step()
        opt.remove_hooks()
        issued[stage] = sorted({(r.kind, r.algorithm) for r in comm.history() if r.seq > last})
    return issued


def _two_ranks() -> dict:
    found = {"states": _equivalence(TWO_RANK_CASES), "memory": _memory(), "bad": _bad_inputs()}
    found["issued"] = _collectives_issued()
    return {**found, "features": _features(), "huggingface": _huggingface_gpt2_stage3()}


EVERY_WORLD = [(kind, stage, None) for stage in (1, 2, 3) for kind in ("gpt", "mlp_odd")]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_stages_equal_one_process_on_the_whole_batch(run_ranks, world):
    if world == 2:
        found = run_ranks(_two_ranks, 2)[0]
        states, cases = found["states"], TWO_RANK_CASES
    else:
        states, cases = run_ranks(_equivalence, world, EVERY_WORLD)[0], EVERY_WORLD
    assert len(states) == len(cases)
    for case, (ours, oracle, exact) in zip(cases, states):
        # bf16 cases: the oracle computes in bf16 too (fp32 masters), so its own distance to
        # the float64 reference measures bf16 rounding (2^-8 per operation), not float32's.
        ulp = BF16_ULP if case[2] == "bf16" else FP32_ULP
        check_close(ours, oracle, exact, ulp=ulp, what=str(case))
    if world == 2:
        for stage, (measured, estimate) in found["memory"].items():
            for key in ("params", "gradients", "optimizer", "total"):
                # Not rounding: bytes. Padding to a multiple of the world size and Adam's
                # step counters are what the paper's formula leaves out, under 5% here.
                assert measured[key] == pytest.approx(estimate[key], rel=0.05), (stage, key)
        # one host: all-gathers (every stage) and reduce-scatters (2, 3) through shared memory;
        # stage 1 all-reduces its gradients in place (tessera/zero/optimizer.py says why)
        issued = found["issued"]
        assert issued[1] == [("all_gather", "shm"), ("all_reduce", "shm")], issued
        for stage in (2, 3):
            assert issued[stage] == [("all_gather", "shm"), ("reduce_scatter", "shm")], issued
        bad = found["bad"]
        assert "stage must be 0, 1, 2 or 3, got 4" in bad[0]
        assert "must be a torch.optim.Optimizer subclass" in bad[1]
        assert "AdamW has no option 'momentun'" in bad[2]
        assert "models differ across ranks: 'bias' is ((3,)" in bad[3]
        assert "mixed_precision must be None or 'bf16', got 'fp8'" in bad[4]
        features = found["features"]
        for stage in (1, 2, 3):  # stage 1 refused accumulation before issue 10, finding 4
            check_close(*features[f"accumulate{stage}"], what=f"accumulate, stage {stage}")
            check_close(*features[f"no_grad{stage}"], what=f"no_grad forward, stage {stage}")
        if found["huggingface"] is not None:
            check_close(*found["huggingface"], what="transformers GPT-2, stage 3")


def _oracle_gradients(kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Gradient of the whole batch's mean loss, one process, keyed by parameter name."""
    model = _model(kind).to(dtype)
    x, y = _batch64(kind, 0, dtype)
    _loss(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _oracle_sgd_step(kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One plain SGD step (no momentum, no weight decay): weights - 0.1 * gradient."""
    model = _model(kind).to(dtype)
    grads = _oracle_gradients(kind, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.sub_(0.1 * grads[name])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _my_slices(opt, grads: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """This rank's slice of each flat bucket, cut from full gradients `grads` by the layout."""
    slices = []
    for flat in opt.flats:
        pieces = [grads[name].reshape(-1) for name in flat.layout.names]
        full = torch.cat(pieces)
        padded = torch.cat([full, full.new_zeros(flat.flat_param.numel() - full.numel())])
        slices.append(padded[flat.lo : flat.hi])
    return slices


def _gradients_and_one_sgd_step() -> dict:
    """Gradients right after backward and one SGD step without momentum, per stage: a gradient
    off by a constant factor, hidden by AdamW's scale invariance, shows here."""
    ctx = tessera.init()
    found = {}
    for kind in ("mlp_odd", "gpt_bias"):
        oracle = [_oracle_gradients(kind, d) for d in (torch.float32, torch.float64)]
        stepped = [_oracle_sgd_step(kind, d) for d in (torch.float32, torch.float64)]
        for stage in (0, 1, 2, 3):
            if stage == 0:
                model, opt = initialize(_model(kind), torch.optim.SGD, stage=stage, lr=0.1)
            else:  # the stage classes themselves, as initialize would build them
                model = _model(kind)
                opt = STAGE_CLASSES[stage](model, partial(torch.optim.SGD, lr=0.1))
                found[(kind, stage, "class")] = (
                    isinstance(opt, ZeroOptimizer) and STAGES[stage] is STAGE_CLASSES[stage]
                )
            x, y = (t.tensor_split(ctx.world_size)[ctx.rank] for t in _batch(kind, 0))
            opt.zero_grad()
            _loss(model(x), y).backward()
            if stage == 0:  # DDP: every rank holds the full averaged gradient
                ours = {n: p.grad.clone() for n, p in model.module.named_parameters()}
                found[(kind, stage, "grad")] = (ours, *oracle)
            else:
                expected = [_my_slices(opt, grads) for grads in oracle]
                ours = [g.clone() for g in opt.gradient_slices()]
                found[(kind, stage, "grad")] = (ours, *expected)
            opt.step()
            if stage:
                full = opt.full_parameters()  # the masters, gathered: tied weights once
                found[(kind, stage, "sgd")] = tuple(
                    {k: state[k] for k in full} for state in (full, *stepped)
                )
                opt.remove_hooks()
            else:
                found[(kind, stage, "sgd")] = (full_state_dict(model), *stepped)
                model.reducer.remove_hooks()
    return found, _unused_branch_messages()


class _SometimesBranch(nn.Module):
    """Its last layer is used on some steps only (units: the layers of a ModuleList)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)])

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        x = self.layers[0](x)
        return self.layers[1](x) + self.layers[2](x) if use_branch else self.layers[1](x)


def _unused_branch_messages() -> list[str]:
    """ZeRO has no find_unused_parameters: a parameter without gradient must be an error
    naming it on the step it happens, never a silent stale or dropped gradient."""
    tessera.init()
    messages = []
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model, opt = initialize(_SometimesBranch(), torch.optim.SGD, stage=stage, lr=0.1)
        try:
            for use_branch in (True, False):
                opt.zero_grad()
                model(torch.ones(3, 4), use_branch).sum().backward()
                opt.step()
            messages.append("no error")
        except RuntimeError as exc:
            messages.append(str(exc))
        opt.remove_hooks()
    return messages


def test_gradients_and_one_sgd_step_equal_the_whole_batch(run_ranks):
    # three ranks: no parameter size divides by 3 in mlp_odd, so every flat is padded
    for rank, (found, unused) in enumerate(run_ranks(_gradients_and_one_sgd_step, 3)):
        for message in unused:
            assert "received no gradient in this backward: layers.2.bias, layers.2.weight" in (
                message
            ), message
            assert "requires_grad=False" in message, message  # ZeRO has no unused mode
        for case, value in found.items():
            if case[2] == "class":
                assert value is True, case
            else:
                check_close(*value, what=f"rank {rank} {case}")


def test_partition_is_balanced_and_covers_every_element_once():
    rng = random.Random(0)
    assert padded_numel(10, 4) == 12 and padded_numel(0, 3) == 0
    assert shard_range(10, 4, 3) == (9, 12)
    for _ in range(200):
        shapes = tuple(tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 3))) for _ in range(5))
        layout = FlatLayout(tuple(f"p{i}" for i in range(5)), shapes)
        world = rng.randint(1, 7)
        covered: dict[str, list[int]] = {}
        sizes = set()
        for rank in range(world):
            lo, hi = shard_range(layout.numel, world, rank)
            sizes.add(hi - lo)
            for piece in shard_pieces(layout, world, rank):
                assert 0 <= piece.shard_lo < hi - lo
                covered.setdefault(piece.name, []).extend(range(piece.param_lo, piece.param_hi))
        assert len(sizes) == 1  # every rank holds the same number of elements
        for name, shape in zip(layout.names, shapes):
            assert sorted(covered.get(name, [])) == list(range(torch.Size(shape).numel()))


def test_estimate_follows_the_paper():
    # Figure 1 of the ZeRO paper: Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    gb = [estimate_memory(7_500_000_000, 64, s)["total"] / 1e9 for s in range(4)]
    # the paper prints one decimal: 0.05 GB is half its last digit
    assert gb == pytest.approx([120.0, 31.4, 16.6, 1.875], abs=0.05)
    one = estimate_memory(10, 3, 2, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert one == {"params": 40, "gradients": 16, "optimizer": 32, "total": 88}
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        estimate_memory(10, 2, 5)
