"""`tessera.setup`'s engines beyond the step: save / load, export, resharding, the delayed
update's learning rate, `zero.initialize`'s policies, the batch rule, and the layering.

The models, batches and the plain-PyTorch oracle are those of `test_setup.py`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _tolerance import check_close
from test_setup import (  # tests/ is on sys.path under pytest
    MODELS,
    _batch,
    _fresh,
    _make_optimizer,
    _mlp,
    _oracle,
    _params,
    _shards,
    user_loss,
)

import tessera

# ----- save / load, export, resharding, the delayed update's lr -------------------------------
ROUND_TRIP = ["single", "torch-ddp", "ddp", "local-sgd", "zero1", "zero2", "zero3"]


def _adamw_engine(ctx, strategy: str, kind: str = "mlp", **options: Any) -> Any:
    return tessera.setup(
        _fresh(kind),
        _make_optimizer("adamw"),
        strategy=strategy,
        loss_fn=MODELS[kind][1],
        grad_clip=0.5,
        ctx=ctx,
        **options,
    )


def _train(engine: Any, ctx, strategy: str, steps: range, kind: str = "mlp") -> None:
    for step in steps:
        shards = _shards(_batch(kind, step), strategy, ctx.world_size)
        engine.train_step(shards[0 if strategy == "single" else ctx.rank])
        engine.step()


def _round_trip(ctx, strategy: str, folder: Path) -> None:
    """2 AdamW steps, save, a fresh engine loads, 1 more step = 3 straight steps, bit for bit
    (local-sgd mid-period: average_every=3, so the replicas differ when saved)."""
    options = {"average_every": 3} if strategy == "local-sgd" else {}
    straight = _adamw_engine(ctx, strategy, **options)
    _train(straight, ctx, strategy, range(3))
    first = _adamw_engine(ctx, strategy, **options)
    _train(first, ctx, strategy, range(2))
    first.save(folder)
    saved = first.full_state_dict()
    payload = torch.load(folder / "engine.pt", weights_only=True)  # a plain torch.save file
    assert ("zero_shards" in payload) == strategy.startswith("zero")
    if ctx.rank == 0:
        torch.save(saved, folder / "full.pt")  # what the resharding test compares with
    resumed = _adamw_engine(ctx, strategy, **options)
    resumed.load(folder)
    _train(resumed, ctx, strategy, range(2, 3))
    ours, expected = resumed.full_state_dict(), straight.full_state_dict()
    assert ours.keys() == expected.keys()
    for key in ours:
        assert torch.equal(ours[key], expected[key]), (strategy, key)
    for engine in (straight, first, resumed):
        engine.close()


def _export(ctx, folder: Path) -> None:
    """safetensors keys and values are the full state; an `hf` export of a ZeRO-3-sharded BERT
    loads in transformers and gives the same logits."""
    from safetensors.torch import load_file
    from transformers import BertForSequenceClassification

    engine = _adamw_engine(ctx, "zero3", kind="bert")
    _train(engine, ctx, "zero3", range(1), kind="bert")
    full = engine.full_state_dict()
    engine.export(folder / "bert.safetensors")
    engine.export(folder / "bert-hf", format="hf")
    with pytest.raises(ValueError, match="format 'hf' needs a Hugging Face model"):
        _adamw_engine(ctx, "ddp").export(folder / "x", format="hf")  # every rank, no hang
    written = load_file(folder / "bert.safetensors")
    assert written.keys() == _fresh("bert").state_dict().keys()
    assert all(torch.equal(written[k], full[k]) for k in written)
    loaded = BertForSequenceClassification.from_pretrained(folder / "bert-hf").eval()
    plain = _fresh("bert").eval()
    plain.load_state_dict(full)
    batch = _batch("bert", 7)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, plain(**batch).logits)
    engine.close()


def _delayed_update_uses_the_scheduler_lr(ctx) -> None:
    """Under ZeRO-Offload's delayed update the step of iteration t runs in the background while
    the user's scheduler already sets iteration t+1's lr: the step must use its own. A slow
    CPUAdam step (it reads its lr 0.3 s late) makes a shared lr show."""
    from tessera.optim import CPUAdam
    from tessera.zero import OffloadPolicy

    used: list[float] = []
    original = CPUAdam.step

    def slow_step(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        used.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    CPUAdam.step = slow_step
    try:
        offload = OffloadPolicy(device="cpu", delayed_update=True, delayed_update_after=1)
        engine = _adamw_engine(ctx, "zero2", offload=offload)
        assert isinstance(engine.optimizer, CPUAdam)
        assert engine.zero.host_huge_pages  # as zero.initialize(offload="cpu") sets it
        scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1 / (s + 1))
        for step in range(4):
            _train(engine, ctx, "zero2", range(step, step + 1))
            scheduler.step()
        engine.close()
    finally:
        CPUAdam.step = original
    assert used == [0.01 * (1 / (s + 1)) for s in range(4)], used  # LambdaLR: base * factor


def state_worker(folder: str) -> bool:
    ctx = tessera.init()
    for strategy in ROUND_TRIP:
        _round_trip(ctx, strategy, Path(folder) / strategy)
    _export(ctx, Path(folder))
    _delayed_update_uses_the_scheduler_lr(ctx)
    return True


def reshard_worker(folder: str) -> bool:
    """Load the 2-rank ZeRO checkpoints on 1 rank: the same model, and the next AdamW step
    equals the plain loop's third (the optimizer state came through the resharding)."""
    ctx = tessera.init()
    oracle = _oracle("mlp", "ddp", 2, "adamw", 0.5, torch.float32, schedule=False)
    exact = _oracle("mlp", "ddp", 2, "adamw", 0.5, torch.float64, schedule=False)
    for strategy in ("zero2", "zero3"):
        engine = _adamw_engine(ctx, strategy)
        engine.load(Path(folder) / strategy)
        saved = torch.load(Path(folder) / strategy / "full.pt", weights_only=True)
        full = engine.full_state_dict()
        assert all(torch.equal(full[k], saved[k]) for k in saved)
        _train(engine, ctx, strategy, range(2, 3))
        check_close(_params(engine), oracle["params"][2], exact["params"][2], what=strategy)
        engine.close()
    return True


def test_save_load_export_reshard_and_the_delayed_update_lr(run_ranks, tmp_path):
    assert run_ranks(state_worker, 2, str(tmp_path), deadline_s=600) == [True, True]
    assert run_ranks(reshard_worker, 1, str(tmp_path)) == [True]


def test_setup_refuses_options_and_arguments_before_building_anything():
    def adamw(params):
        return torch.optim.AdamW(params)

    model = _mlp()
    assert not dist.is_initialized()
    with pytest.raises(
        TypeError,
        match=r"strategy 'ddp' has no option 'bucket_cap'; its options are: bucket_cap_mb, "
        r"algorithm",
    ):
        tessera.setup(model, adamw, strategy="ddp", bucket_cap=1)
    with pytest.raises(TypeError, match=r"strategy 'single' has no option 'x'; .* none"):
        tessera.setup(model, adamw, strategy="single", x=1)
    with pytest.raises(ValueError, match="offload device must be 'cpu' or 'nvme'"):
        tessera.setup(model, adamw, strategy="zero2", offload="gpu")
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        tessera.setup(model, adamw, strategy="zero4")
    with pytest.raises(TypeError, match="optimizer must be a factory"):
        tessera.setup(model, torch.optim.AdamW(model.parameters()), strategy="ddp")
    assert not dist.is_initialized()  # all refused before tessera.init


def test_zero_initialize_takes_bucket_cap_mb_and_the_same_offload_translation(run_ranks):
    assert run_ranks(_initialize_worker, 1) == [True]


def _initialize_worker() -> bool:
    from tessera.strategies import gather_batch
    from tessera.zero import ZeroPolicy, initialize, shard

    tessera.init()
    _, default = initialize(_mlp(), torch.optim.AdamW, stage=1)
    _, small = initialize(_mlp(), torch.optim.AdamW, stage=1, bucket_cap_mb=1e-4)
    assert len(default.reducer.buckets) == 1 < len(small.reducer.buckets)
    _, offloaded = initialize(_mlp(), torch.optim.AdamW, stage=2, offload="cpu")
    assert offloaded.host_huge_pages
    sharded = shard(_mlp(), torch.optim.AdamW, stage=1, policy=ZeroPolicy(bucket_cap_mb=1e-4))
    assert len(sharded.reducer.buckets) == len(small.reducer.buckets)
    batch = {"x": torch.arange(4.0)}
    assert gather_batch(batch)["x"] is batch["x"]  # one rank: the batch itself
    return True


def _gathered(rank: int) -> Any:
    from tessera.strategies import gather_batch

    ctx = tessera.init()
    mine = {"ids": torch.full((2, 3), ctx.rank), "mask": torch.ones(2, 3)}
    pair = (torch.full((2,), float(ctx.rank)), torch.full((2, 1), ctx.rank))
    return gather_batch(mine), gather_batch(pair)


def test_batch_rule_microbatches_gather_and_policies(run_ranks):
    from tessera.checkpoint import EXPORT_FORMATS, export_model
    from tessera.data_parallel import DDPPolicy, LocalSGDPolicy
    from tessera.strategies import (
        NoOptions,
        OptimizerFactory,
        compute_loss,
        make_policy,
        split_microbatches,
    )
    from tessera.zero import OffloadPolicy, ZeroPolicy

    model = _mlp()
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    assert torch.equal(compute_loss(model, (x, y), user_loss), user_loss(model(x), y))
    labelled = lambda **batch: {"loss": batch["x"].sum()}  # noqa: E731  a dict output
    assert compute_loss(labelled, {"x": x}, None) == x.sum()
    with pytest.raises(TypeError, match="dict of tensors or an \\(inputs, targets\\) pair"):
        compute_loss(model, x, user_loss)
    parts = split_microbatches({"x": x, "n": 3, "y": y}, 2)
    assert [p["x"].shape[0] for p in parts] == [2, 2] and parts[1]["n"] == 3
    assert torch.equal(torch.cat([p["y"] for p in parts]), y)
    assert torch.equal(split_microbatches((x, y), 4)[3][0], x[3:])
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        split_microbatches((x, y), 3)
    (d0, p0), (d1, p1) = run_ranks(_gathered, 2, 0)
    assert torch.equal(d0["ids"], torch.tensor([[0] * 3] * 2 + [[1] * 3] * 2)) and d0 == d0
    assert torch.equal(p1[0], torch.tensor([0.0, 0.0, 1.0, 1.0])) and p1[1].shape == (4, 1)
    assert make_policy("ddp", {"bucket_cap_mb": 1.0}) == DDPPolicy(bucket_cap_mb=1.0)
    assert make_policy("single", {}) == NoOptions()
    assert ZeroPolicy(offload="cpu").offload == OffloadPolicy(device="cpu")
    for bad, message in (
        (lambda: DDPPolicy(bucket_cap_mb=0), "bucket_cap_mb must be positive"),
        (lambda: DDPPolicy(algorithm="warp"), "unknown algorithm 'warp'"),
        (lambda: LocalSGDPolicy(average_every=0), "average_every must be at least 1"),
        (lambda: ZeroPolicy(mixed_precision="fp16"), "mixed_precision must be None or 'bf16'"),
        (lambda: OffloadPolicy(device="cpu", moments="fp8"), "moments must be one of"),
        (lambda: OffloadPolicy(device="nvme", delayed_update=True), "needs offload='cpu'"),
    ):
        with pytest.raises(ValueError, match=message):
            bad()
    factory: OptimizerFactory = torch.optim.SGD
    assert isinstance(factory(model.parameters(), lr=0.1), torch.optim.Optimizer)
    assert EXPORT_FORMATS == ("safetensors", "hf")
    with pytest.raises(ValueError, match="Sequential is not one \\(use format safetensors\\)"):
        export_model(model, model.state_dict(), "unused", "hf")


LIBRARIES = ("data_parallel", "zero", "pipeline", "tensor_parallel", "comm", "memory", "optim")
BELOW_LIBRARIES = ("checkpoint", "runtime", "models", "data")


def _imports(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports included
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _upper(name: str, *more: str) -> bool:
    """`name` is the trainer, the command line or one of `more` (a package and its modules)."""
    return any(
        name == top or name.startswith(top + ".") for top in ("tessera.train", "tessera.cli", *more)
    )


def test_the_strategy_libraries_import_neither_the_trainer_nor_the_strategies_layer():
    """Layers (DESIGN.md): the libraries sit below `tessera.strategies`, which sits below the
    trainer; nothing imports upward, not even inside a function. (`parameter_server`, whose
    `train.py` is the trainer's ps entry point, is not checked here yet.)"""
    root = Path(tessera.__file__).parent
    upward = {}
    for package in LIBRARIES + BELOW_LIBRARIES:
        for path in sorted((root / package).rglob("*.py")):
            bad = {name for name in _imports(path) if _upper(name, "tessera.strategies")}
            if bad:
                upward[str(path.relative_to(root))] = sorted(bad)
    assert upward == {}
    strategies = set().union(*(_imports(p) for p in (root / "strategies").glob("*.py")))
    assert not any(_upper(name) for name in strategies)


def test_a_user_strategy_takes_its_own_policy_and_a_single_engine_saves_without_a_group(
    monkeypatch, tmp_path
):
    """`register_strategy(name, policy=...)`: `setup` validates the options against the user's
    policy and hands it to the builder; the `single` engine runs, saves and loads in this very
    process (a context of one rank, no process group)."""
    from dataclasses import dataclass

    from tessera.runtime import Context
    from tessera.strategies import Engine, registry

    monkeypatch.setattr(registry, "_user_strategies", {})

    @dataclass(kw_only=True, frozen=True)
    class HalfPolicy:
        """Scale the loss by `factor`."""

        factor: float = 0.5

    @registry.register_strategy("half", policy=HalfPolicy)
    class Half(Engine):
        def backward(self, loss: torch.Tensor) -> None:
            (loss * self.policy.factor).backward()

    ctx = Context(0, 1, 0, 1, torch.device("cpu"), "gloo", 60.0)
    with pytest.raises(TypeError, match="strategy 'half' has no option 'scale'; .* factor"):
        tessera.setup(_mlp(), _make_optimizer("sgd"), strategy="half", ctx=ctx, scale=2)
    batch = _batch("mlp", 0)
    grads = {}
    for strategy, options in (("half", {"factor": 0.25}), ("single", {})):
        engine = tessera.setup(
            _fresh("mlp"), _make_optimizer("sgd"), strategy=strategy, loss_fn=user_loss, ctx=ctx,
            **options,
        )  # fmt: skip
        engine.train_step(batch)
        grads[strategy] = [p.grad.clone() for p in engine.module.parameters()]
        assert engine.policy == (HalfPolicy(factor=0.25) if options else registry.policy_class(
            "single"
        )())  # fmt: skip
    assert all(torch.equal(h, s * 0.25) for h, s in zip(grads["half"], grads["single"]))
    engine.step()
    engine.save(tmp_path / "single")
    again = tessera.setup(_fresh("mlp"), _make_optimizer("sgd"), strategy="single", ctx=ctx)
    again.load(tmp_path / "single")
    assert all(
        torch.equal(a, b) for a, b in zip(again.module.parameters(), engine.module.parameters())
    )
    assert not dist.is_initialized()


@pytest.mark.parametrize("strategy", ["single", "torch-ddp", "ddp", "local-sgd", "zero1", "zero3",
                                      "pipeline", "tensor", "hybrid"])  # fmt: skip
def test_the_trainer_translates_its_defaults_into_the_policies_defaults(strategy):
    """One default per knob: `tessera train`'s flags, left alone, give the strategy's policy as
    `tessera.setup` builds it with no option (so neither can drift from the other)."""
    from tessera.strategies import make_policy, policy_class
    from tessera.train import build_config
    from tessera.train.engine_setup import policy_options
    from tessera.zero import OffloadPolicy

    config = build_config({"strategy": strategy, "nproc": 1 if strategy == "single" else 2})
    assert make_policy(strategy, policy_options(config)) == policy_class(strategy)()
    if strategy.startswith("zero"):
        offloaded = build_config({"strategy": strategy, "nproc": 2, "offload": "cpu"})
        assert policy_options(offloaded)["offload"] == OffloadPolicy(device="cpu")
