"""Every trainer strategy against an oracle written here: a plain PyTorch loop, not tessera's.

`tessera train` runs the same loop (`train_worker`: batches, schedule, clipping, optimizer,
metrics) whatever the strategy, so comparing a strategy with `single` through that loop cannot
see a bug in the loop itself: a warm-up off by one, a clip that never acts, a loss logged from
the wrong step. The oracle below builds the same GPT (same seed), takes the batch of each step,
and applies the learning-rate schedule, global-norm clipping and AdamW written out in this file
from the config's documented semantics. It runs three times: float32 (the oracle), float64
(the exact answer) and, for `--mixed-precision bf16`, with bf16 compute and fp32 masters;
tessera's final parameters and logged losses must be within `FACTOR` times the oracle's own
rounding distance of the float64 answer (`tests/_tolerance.py`).

The batch of a step comes from `tessera.data.LMBatches`; `test_batches_are_the_documented_
windows` pins that function against an independent recomputation, so a wrong batch cannot hide.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tolerance import BF16_ULP, FP32_ULP, check_close

import tessera.train.loop as loop_module
from tessera.data import CharTokenizer, LMBatches, load_corpus
from tessera.models import GPT, GPTConfig
from tessera.train import TrainConfig, build_config
from tessera.train.loop import lr_at, train_worker
from tessera.train.metrics import read_metrics

MODEL = {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 16}
BASE = {
    "model": MODEL,
    "steps": 5,
    "batch_size": 8,
    "lr": 3e-3,
    "warmup_steps": 2,  # steps 0, 1 warm up; 2 at the peak; 3 halfway down; 4 at the floor
    "decay_steps": 2,
    "weight_decay": 0.1,
    "grad_clip": 1.0,  # acts at the first steps (the oracle asserts it does)
    "corpus_bytes": 20_000,
    "sample_tokens": 0,
    "checkpoint_every": 0,
    "log_every": 1,
    "progress": False,
    "seed": 3,
}

# name -> (overrides, world size); grouped per world size into one spawn each.
RUNS: dict[str, tuple[dict[str, Any], int]] = {
    "single": ({"strategy": "single"}, 1),
    "torch-ddp": ({"strategy": "torch-ddp"}, 2),
    "ddp": ({"strategy": "ddp", "bucket_cap_mb": 0.01}, 2),
    "zero1": ({"strategy": "zero1", "bucket_cap_mb": 0.01}, 2),
    "zero2": ({"strategy": "zero2", "bucket_cap_mb": 0.01}, 2),
    "zero3": ({"strategy": "zero3"}, 2),
    "zero2-bf16": ({"strategy": "zero2", "mixed_precision": "bf16"}, 2),
    "tensor": ({"strategy": "tensor"}, 2),
    "pipeline": ({"strategy": "pipeline", "microbatches": 4}, 2),
    # dp x pp x tp meshes of 4 ranks are checked against one process in test_mesh.py; here
    # the trainer's hybrid path on 2 ranks: ZeRO-2 inside the (single) stage over dp = 2.
    "hybrid": ({"strategy": "hybrid", "dp": 2, "tp": 1, "pp": 1, "zero": 2}, 2),
}


FEW_ROUNDINGS = 8 * sys.float_info.epsilon
"""Two float64 evaluations of the schedule (ours and the loop's) differ by the order of a few
operations (a cosine, a product, a sum): a handful of float64 roundings, never more."""


# ----- the oracle ------------------------------------------------------------------------------
def expected_lr(step: int, config: TrainConfig) -> float:
    """The schedule as TrainConfig documents it, for the 0-based optimizer step `step`.

    warmup_steps: linear warm-up, the k-th step (k = step + 1) uses lr * k / warmup_steps, so the
    peak is reached at the last warm-up step. decay_steps: a cosine from lr down to lr / 10 over
    that many steps after the warm-up, then lr / 10 for ever; 0 keeps lr constant.
    """
    peak, floor = config.lr, config.lr / 10
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    decay = config.decay_steps
    if decay is None:  # unset: the demo GPT's tuned 450, a --model run's own steps after warmup
        decay = 450 if config.model_factory is None else max(0, config.steps - config.warmup_steps)
    if decay == 0:
        return peak
    done = min(step - config.warmup_steps, decay) / decay
    return floor + (peak - floor) * (1 + math.cos(math.pi * done)) / 2


class _AdamW:
    """AdamW (Loshchilov & Hutter) as the trainer configures it: betas (0.9, 0.95), eps 1e-8,
    decoupled weight decay on parameters of 2+ dims only (not biases, norms), bias-corrected
    moments."""

    def __init__(self, params: list[torch.Tensor], weight_decay: float) -> None:
        self.params, self.weight_decay, self.t = params, weight_decay, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.t += 1
        b1, b2, eps = 0.9, 0.95, 1e-8
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).add_(g * g, alpha=1 - b2)
            if p.dim() >= 2:  # biases and norm weights are not decayed
                p.mul_(1 - lr * self.weight_decay)
            m_hat, v_hat = m / (1 - b1**self.t), v / (1 - b2**self.t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + eps))


class _MomentumSGD:
    """`--optimizer sgd`: heavy-ball momentum 0.9, no weight decay, buffer starts at zero."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.buffers = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        for p, g, buf in zip(self.params, grads, self.buffers):
            buf.mul_(0.9).add_(g)
            p.sub_(lr * buf)


def _data(config: TrainConfig) -> tuple[CharTokenizer, LMBatches]:
    text = load_corpus(config.corpus, max_bytes=config.corpus_bytes)
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode_tensor(text)
    batches = LMBatches(
        tokens[: int(tokens.numel() * 0.9)],  # the trainer holds out the corpus's last tenth
        block_size=config.model.block_size,
        global_batch_size=config.batch_size,
        seed=config.seed,
    )
    return tokenizer, batches


def oracle_run(config: TrainConfig, precision: str) -> dict[str, Any]:
    """Train as the config says in a plain loop: precision "fp32", "fp64", or "bf16" (bf16
    forward and backward, fp32 master weights and optimizer, as ZeRO's mixed precision)."""
    tokenizer, batches = _data(config)
    torch.manual_seed(config.seed)
    shape = {k: getattr(config.model, k) for k in ("n_layer", "n_head", "n_embd", "block_size")}
    masters = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, dropout=0.0, **shape))
    master_dtype = torch.float64 if precision == "fp64" else torch.float32
    masters = masters.to(master_dtype)
    compute = masters
    if precision == "bf16":
        compute = GPT(masters.config).to(torch.bfloat16)
        compute.load_state_dict(masters.state_dict())
    params = list(masters.parameters())  # the tied embedding once
    optimizer = (
        _MomentumSGD(params) if config.optimizer == "sgd" else _AdamW(params, config.weight_decay)
    )
    losses, clip_coefficients, lrs = [], [], []
    for step in range(config.steps):
        x, y = batches.batch(step)  # the whole global batch: one process
        logits = compute(x).float() if precision == "bf16" else compute(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        grads = torch.autograd.grad(loss, list(compute.parameters()))
        grads = [g.to(master_dtype) for g in grads]
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()
        coefficient = min(1.0, config.grad_clip / (norm + 1e-6)) if config.grad_clip else 1.0
        grads = [g * coefficient for g in grads]
        lr = expected_lr(step, config)
        optimizer.step(grads, lr)
        if compute is not masters:
            with torch.no_grad():
                for low, master in zip(compute.parameters(), params):
                    low.copy_(master)
        losses.append(loss.item())
        clip_coefficients.append(coefficient)
        lrs.append(lr)
    state = {k: v.detach().clone() for k, v in masters.state_dict().items()}
    return {"state": state, "losses": losses, "clip": clip_coefficients, "lrs": lrs}


def _without_scores(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop query and key rows of every qkv weight and bias (the value rows stay checked).

    At initialization attention is near uniform and softmax ignores a per-query shift of the
    scores, so the true gradients of these rows are 1e-8..1e-5 (a key bias exactly 0) while
    float32 rounding of their sums is not; AdamW divides by their RMS and turns that noise into
    full-size updates, different in any two correct implementations (DESIGN.md, Testing).
    Their effect on every other parameter stays in the comparison."""
    out = {}
    for name, tensor in state.items():
        if ".attn.qkv." in name:
            tensor = tensor[2 * (tensor.shape[0] // 3) :]
        out[name] = tensor
    return out


# ----- running the strategies --------------------------------------------------------------
def _config(name: str, out: Path) -> TrainConfig:
    overrides, world = RUNS[name]
    return build_config(BASE, overrides, {"nproc": world, "out": str(out / name)})


def _run_and_gather(jobs: list[tuple[str, TrainConfig]]) -> dict[str, dict[str, torch.Tensor]]:
    """On each rank: train every job through `train_worker`; return the final full weights.

    The engine builder is wrapped so that the engine the loop built can be asked for its
    full model state afterwards (collective for the sharded strategies)."""
    built: list[Any] = []
    weights = {}
    build_engine = loop_module.build_engine
    for name, config in jobs:

        def capture(*args: Any, **kwargs: Any) -> Any:
            engine = build_engine(*args, **kwargs)
            built.append(engine)
            return engine

        loop_module.build_engine = capture  # the loop's engine, kept to read its weights
        try:
            train_worker(config, config.out, False)
        finally:
            loop_module.build_engine = build_engine
        state = built[-1].full_state_dict()
        weights[name] = {k: v.detach().float().clone() for k, v in state.items()}
    return weights


def _train_everything(tmp: Path, run_ranks: Any, names: list[str]) -> dict[str, Any]:
    by_world: dict[int, list[str]] = {}
    for name in names:
        by_world.setdefault(RUNS[name][1], []).append(name)
    found: dict[str, Any] = {}
    for world, group in sorted(by_world.items()):
        jobs = [(name, _config(name, tmp)) for name in group]
        for _, config in jobs:
            Path(config.out).mkdir(parents=True)
        if world == 1:
            from tessera.runtime.context import shutdown

            try:
                weights = _run_and_gather(jobs)
            finally:
                shutdown()
        else:
            weights = run_ranks(_run_and_gather, world, jobs)[0]
        for name, config in jobs:
            records = read_metrics(Path(config.out) / "metrics.jsonl")
            found[name] = {"state": weights[name], "records": records, "config": config}
    return found


def test_every_strategy_trains_like_the_plain_pytorch_oracle(tmp_path, run_ranks):
    found = _train_everything(tmp_path, run_ranks, list(RUNS))
    config = found["single"]["config"]
    oracle, exact = oracle_run(config, "fp32"), oracle_run(config, "fp64")
    bf16 = oracle_run(config, "bf16")
    # The run exercises what it claims: clipping acts, the schedule warms up and decays.
    assert min(oracle["clip"]) < 1.0, oracle["clip"]
    assert exact["losses"][-1] < exact["losses"][0]
    for name, run in found.items():
        records = run["records"]
        assert [r["step"] for r in records] == list(range(1, config.steps + 1)), name
        # The logged learning rate is the documented schedule (exactly: same float formula).
        assert [r["lr"] for r in records] == pytest.approx(oracle["lrs"], rel=FEW_ROUNDINGS), name
        reference = bf16 if run["config"].mixed_precision else oracle
        ulp = BF16_ULP if run["config"].mixed_precision else FP32_ULP
        losses = [r["loss"] for r in records]
        margins = check_close(
            losses, reference["losses"], exact["losses"], ulp=ulp, what=f"{name} losses"
        )
        state = {k: v for k, v in run["state"].items() if k in exact["state"]}
        assert state.keys() == exact["state"].keys(), name
        margins |= check_close(
            _without_scores(state),
            _without_scores(reference["state"]),
            _without_scores(exact["state"]),
            ulp=ulp,
            what=name,
        )
        worst = max(error / budget for error, budget in margins.values())
        print(f"{name}: worst error / budget {worst:.2f}")


def test_batches_are_the_documented_windows():
    """`LMBatches.batch(step, rank, world)` recomputed from its documented definition: the
    global batch of a step is `batch_size` windows starting at offsets drawn uniformly (with
    replacement) by a generator seeded with seed * 1_000_003 + step; rank r keeps rows
    [r b, (r + 1) b); the target is the window shifted by one token."""
    tokens = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(7))
    block, batch, seed = 10, 6, 4
    batches = LMBatches(tokens, block_size=block, global_batch_size=batch, seed=seed)
    for step in (0, 1, 17):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(tokens.numel() - block, (batch,), generator=generator).tolist()
        windows = torch.stack([tokens[s : s + block + 1] for s in starts])
        for world in (1, 2, 3):
            rows = batch // world
            for rank in range(world):
                x, y = batches.batch(step, rank, world)
                mine = windows[rank * rows : (rank + 1) * rows]
                assert torch.equal(x, mine[:, :-1]) and torch.equal(y, mine[:, 1:])


@pytest.mark.parametrize(("warmup", "decay"), [(0, 0), (1, 0), (4, 0), (0, 5), (3, 5), (10, 1)])
def test_lr_at_is_the_documented_schedule(warmup, decay):
    config = build_config({"lr": 2.0, "warmup_steps": warmup, "decay_steps": decay})
    for step in range(warmup + decay + 4):
        assert lr_at(step, config) == pytest.approx(expected_lr(step, config), rel=FEW_ROUNDINGS), (
            step
        )


def test_lr_at_boundaries_by_hand():
    """Written-out values, independent of any formula: warm-up 4, cosine over 4, lr 1."""
    config = build_config({"lr": 1.0, "warmup_steps": 4, "decay_steps": 4})
    by_hand = {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0, 4: 1.0, 6: 0.55, 8: 0.1, 50: 0.1}
    for step, lr in by_hand.items():
        assert lr_at(step, config) == pytest.approx(lr, rel=FEW_ROUNDINGS), step
    # cos(pi/4) between: 0.1 + 0.9 * (1 + 0.7071...) / 2
    assert lr_at(5, config) == pytest.approx(0.1 + 0.45 * (1 + 2**-0.5), rel=FEW_ROUNDINGS)
    constant = build_config({"lr": 1.0, "warmup_steps": 0, "decay_steps": 0})
    assert [lr_at(s, constant) for s in (0, 1, 1000)] == [1.0, 1.0, 1.0]
    one = build_config({"lr": 1.0, "warmup_steps": 1, "decay_steps": 0})
    assert lr_at(0, one) == 1.0  # one warm-up step reaches the peak at once
