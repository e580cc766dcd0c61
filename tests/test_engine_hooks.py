"""The cross-cutting steps are the `Engine`'s: a strategy gives hooks, never its own copy.

A strategy written in this file and registered with `register_strategy` (as a user would)
provides only the hooks: which gradients this rank steps (`local_gradients`, `make_optimizer`)
and its share of the squared norm (`squared_norm_share`). `tessera.setup` then builds it whole,
in one step (accumulation, precision, loss scaler, batch keys are set when its constructor
returns), and `engine.step()` clips the global norm over both ranks, against torch's own
`clip_grad_norm_` on one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _tolerance import check_close
from torch import nn

import tessera
from tessera.optim.clip import squared_sum
from tessera.runtime import Context
from tessera.strategies import Engine, registry

LR, MAX_NORM = 0.1, 0.05  # MAX_NORM below every norm here: the scaling acts


def _model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)


class _Halves(Engine):
    """A toy sharding: every rank computes the whole gradient of the same batch and steps the
    parameters of its parity only (index % world == rank). Its hooks say so; nothing else."""

    def _mine(self) -> list[nn.Parameter]:
        world, rank = self.ctx.world_size, self.ctx.rank
        return [p for i, p in enumerate(self.module.parameters()) if i % world == rank]

    def make_optimizer(self, optimizer_factory):  # noqa: ANN001, ANN201 - the hook's signature
        return optimizer_factory(self._mine())

    def local_gradients(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self._mine()]

    def squared_norm_share(self) -> torch.Tensor:
        return squared_sum(self.local_gradients())


def _halves_ranks() -> dict:
    torch.set_num_threads(1)
    ctx = tessera.init()
    registry.register_strategy("test-halves")(_Halves)
    engine = tessera.setup(
        _model(),
        lambda params: torch.optim.SGD(params, lr=LR),
        strategy="test-halves",
        loss_fn=F.mse_loss,
        grad_clip=MAX_NORM,
        ctx=ctx,
    )
    engine.train_step(_batch())
    norm = float(engine.clip_grad_norm(float("inf")))  # the global norm, nothing scaled (inf)
    engine.step()
    mine = {id(p) for p in engine._mine()}
    params = {k: p.detach().clone() for k, p in engine.module.named_parameters() if id(p) in mine}
    return {"norm": norm, "params": params}


def _oracle(dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain PyTorch on one process: the batch's loss, torch's clip, one SGD step."""
    model = _model().to(dtype)
    x, y = _batch()
    F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
    norm = float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return norm, {k: p.detach().clone() for k, p in model.named_parameters()}


def test_a_strategy_with_only_hooks_clips_the_global_norm_over_its_ranks(run_ranks):
    results = run_ranks(_halves_ranks, 2)
    norm32, params32 = _oracle(torch.float32)
    norm64, params64 = _oracle(torch.float64)
    assert norm64 > MAX_NORM  # the clip acts
    assert results[0]["params"].keys().isdisjoint(results[1]["params"])
    ours = {**results[0]["params"], **results[1]["params"]}
    assert ours.keys() == params64.keys()
    ours = {name: ours[name] for name in params64}  # the oracle's order
    for result in results:  # every rank: the norm of the whole gradient, not of its half
        check_close([result["norm"]], [norm32], [norm64], what="norm")
    check_close(ours, params32, params64, what="params after a clipped SGD step")


def test_setup_builds_the_engine_whole_in_one_step(monkeypatch):
    """What the constructor has when it returns: accumulation, precision (the low-precision
    hook already called), the loss scaler, batch keys and the strategy's name."""
    monkeypatch.setattr(registry, "_user_strategies", {})
    seen: dict = {}

    @registry.register_strategy("test-probe")
    class Probe(Engine):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            seen["built"] = (
                self.grad_accum,
                self.precision,
                self.loss_scale,
                self.batch_keys,
                self.strategy_name,
            )

        def reduce_gradients_in(self, dtype: torch.dtype) -> None:
            seen["reduce_in"] = dtype

    ctx = Context(0, 1, 0, 1, torch.device("cpu"), "gloo", 60.0)
    scaler = tessera.optim.DynamicLossScaler(init_scale=256.0)
    engine = tessera.setup(
        _model(),
        lambda params: torch.optim.SGD(params, lr=LR),
        strategy="test-probe",
        grad_accum=2,
        precision="fp16",
        loss_scaler=scaler,
        input_keys=["x"],
        target_keys=["y"],
        loss_fn=F.mse_loss,
        ctx=ctx,
    )
    assert seen["built"] == (2, "fp16", 256.0, (("x",), ("y",)), "test-probe")
    assert seen["reduce_in"] is torch.float16 and engine.loss_scaler is scaler


def test_a_builder_function_of_the_old_signature_still_gets_every_step(monkeypatch):
    """A strategy registered before engines were built in one step: a function taking
    (model, factory, ctx, *, loss_fn, grad_clip, policy). `setup` finishes its engine as it
    once did: accumulation, precision, loss scale, batch keys and the strategy's name."""
    monkeypatch.setattr(registry, "_user_strategies", {})

    @registry.register_strategy("test-old-builder")
    def build(model, factory, ctx, *, loss_fn=None, grad_clip=0.0, policy=None):  # noqa: ANN001
        return Engine(model, factory, ctx, loss_fn=loss_fn, grad_clip=grad_clip)

    ctx = Context(0, 1, 0, 1, torch.device("cpu"), "gloo", 60.0)
    engine = tessera.setup(
        _model(), lambda params: torch.optim.SGD(params, lr=LR), strategy="test-old-builder",
        grad_accum=2, precision="bf16", input_keys=["x"], target_keys=["y"], loss_fn=F.mse_loss,
        grad_clip=0.5, ctx=ctx,
    )  # fmt: skip
    assert (engine.grad_accum, engine.precision, engine.grad_clip) == (2, "bf16", 0.5)
    assert engine.autocast_dtype is torch.bfloat16
    assert engine.batch_keys == (("x",), ("y",)) and engine.strategy_name == "test-old-builder"


def test_every_builtin_strategy_is_its_engine_class():
    """No forwarding builder: the registry names each strategy's Engine class (the old
    `build_*` names stay, as the same objects)."""
    from tessera.strategies import STRATEGIES

    for name in registry.BUILTIN_STRATEGIES:
        built = STRATEGIES[name]
        assert isinstance(built, type) and issubclass(built, Engine), name


def test_the_former_builder_names_are_the_engine_classes():
    """`build_*` (in the adapters' `__all__`, the README's examples before) keep working."""
    from tessera.strategies import ddp, pipeline, single, tensor, torch_ddp, zero

    assert single.build is Engine and torch_ddp.build is torch_ddp.TorchDDPEngine
    assert (ddp.build_ddp, ddp.build_local_sgd) == (ddp.DDPEngine, ddp.LocalSGDEngine)
    assert [zero.build_zero1, zero.build_zero2, zero.build_zero3] == [
        zero.Zero1Engine, zero.Zero2Engine, zero.Zero3Engine,
    ]  # fmt: skip
    assert [zero.Zero1Engine.stage, zero.Zero2Engine.stage, zero.Zero3Engine.stage] == [1, 2, 3]
    assert tensor.build is tensor.build_tensor is tensor.TensorEngine
    assert pipeline.build_pipeline is pipeline.build_hybrid is pipeline.PipelineEngine
