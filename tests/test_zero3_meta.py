"""A model built on the meta device under ZeRO-3: each rank materialises only its own shard.

One spawn of 2 ranks checks, on a model unlike tessera's GPT (a parameter used directly in
forward, BatchNorm buffers, a root unit split around the blocks):
- the materialised model equals the model built whole on the same seed, bit for bit: its first
  values equal a plain `Net()` built in this test, and after a backward and three AdamW steps
  its gradients and parameters equal those of the same ZeRO-3 run on the model built whole (the
  same computation on the same values: no tolerance is needed), also with offload="cpu"; ranks
  seeded apart still get group rank 0's values;
- storage accounting of the materialisation: every storage created while it runs is counted
  (a TorchDispatchMode sees each allocation, a weak reference to each storage says when it is
  freed, parameters grow through `resize_` of storages it saw created), and the peak of the live
  bytes stays below the model's full size and within this rank's shard plus the root unit and
  two of the largest unit (its parameters and its flat buffer);
- what cannot be materialised is refused by name: a buffer computed in `__init__`, an `init_fn`
  that replaces a parameter.
The refusals that need no process group (other strategies, modules without `reset_parameters`,
a model only partly on the meta device) run in this process; the trainer's use (the demo GPT on
zero3 gives the same losses with and without `--meta-init`) runs one rank in this process.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tessera
from tessera.zero import full_state_dict, initialize

WIDTH, BLOCKS, BATCH, SEED = 8, 3, 6, 11


class Scale(nn.Module):
    """A parameter used directly in forward, initialised by its own `reset_parameters`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.weight, 0.5, 1.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight


class Net(nn.Module):
    """Root unit: stem, norm (BatchNorm buffers) and head, around a ModuleList of blocks."""

    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), Scale(width))
            for _ in range(blocks)
        )
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(self.norm(h))


def _build(meta: bool, seed: int = SEED, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    if not meta:
        return Net(**kwargs)
    with torch.device("meta"):
        return Net(**kwargs)


def _run(meta: bool, **options: Any) -> dict[str, Any]:
    """ZeRO-3 over 2 ranks: first values, gradients of the first backward, values after AdamW."""
    model, opt = initialize(_build(meta), torch.optim.AdamW, stage=3, lr=1e-2, **options)
    first = full_state_dict(model)
    data = torch.Generator().manual_seed(5)
    rank, grads = dist.get_rank(), None
    for _ in range(3):
        x, y = torch.randn(BATCH, 4, generator=data), torch.randn(BATCH, 3, generator=data)
        rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if grads is None:
            grads = [g.clone() for g in opt.gradient_slices()]
        opt.step()
    return {"first": first, "grads": grads, "last": full_state_dict(model)}


class _LiveStorages(TorchDispatchMode):
    """Counts the live bytes of every storage created under it, after each operation."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = tensor.untyped_storage()
                known = self.storages.get(id(storage))
                if known is None or known() is not storage:  # an id may be reused once freed
                    self.storages[id(storage)] = weakref.ref(storage)
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        seen: set[int] = set()
        total = 0
        for ref in self.storages.values():
            storage = ref()
            if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total


def _materialisation_peak() -> dict[str, Any]:
    """Peak live bytes while ZeRO-3 materialises a meta Net of 12 blocks of width 32 (`walk`),
    and over its whole set-up (`setup`, ending with `end` bytes live: ZeRO's own state)."""
    from tessera.zero import stage3

    walk, setup = _LiveStorages(), _LiveStorages()
    original = stage3.materialize_shards

    def counted(*args: Any, **kwargs: Any) -> Any:
        with walk:
            return original(*args, **kwargs)

    stage3.materialize_shards = counted
    try:
        model = _build(True, width=32, blocks=12)
        with setup:
            model, opt = initialize(model, torch.optim.AdamW, stage=3, lr=1e-2)
    finally:
        stage3.materialize_shards = original
    unit = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks")) * 4
    full = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"walk": walk.peak, "setup": setup.peak, "end": setup.live(), "full": full,
            "unit": unit, "root": root, "buffers": buffers,
            "held": opt.memory_usage()}  # fmt: skip


class Masked(nn.Linear):
    """A causal mask computed in `__init__`: lost on the meta device, not set by reset."""

    def __init__(self) -> None:
        super().__init__(4, 3)
        self.register_buffer("mask", torch.ones(3, 3).tril(), persistent=False)


def _refusal(build: Any, **kwargs: Any) -> str:
    with torch.device("meta"):
        model = build()
    try:
        initialize(model, torch.optim.AdamW, stage=3, lr=1e-2, **kwargs)
    except ValueError as error:
        return str(error)
    return "accepted"


class Forgetful(nn.Module):
    """`reset_parameters` that leaves its parameter unwritten."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def reset_parameters(self) -> None:
        pass


def _replace_weight(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.weight = nn.Parameter(torch.zeros_like(module.weight, device="cpu"))


def _rank() -> dict[str, Any]:
    tessera.init()
    whole, meta = _run(meta=False), _run(meta=True)
    offloaded = [_run(meta, offload="cpu")["last"] for meta in (False, True)]
    torch.manual_seed(SEED)
    plain = Net().state_dict()
    # Seeded apart: every rank's shard still comes from group rank 0's values.
    apart, _ = initialize(_build(True, SEED + dist.get_rank()), torch.optim.SGD, stage=3, lr=0.1)
    apart = full_state_dict(apart)
    return {
        "rank_0_values": all(torch.equal(apart[k], v) for k, v in plain.items()),
        "first_is_plain": {k: torch.equal(meta["first"][k], v) for k, v in plain.items()},
        "first": all(torch.equal(meta["first"][k], v) for k, v in whole["first"].items()),
        "grads": all(map(torch.equal, meta["grads"], whole["grads"])),
        "last": {k: torch.equal(meta["last"][k], v) for k, v in whole["last"].items()},
        "offload": all(torch.equal(offloaded[1][k], v) for k, v in offloaded[0].items()),
        "memory": _materialisation_peak(),
        "mask": _refusal(Masked),
        "replaced": _refusal(lambda: nn.Sequential(nn.Linear(2, 2)), init_fn=_replace_weight),
        "unwritten": _refusal(lambda: nn.Sequential(nn.Linear(2, 3), Forgetful())),
    }


def test_a_meta_model_equals_the_model_built_whole_and_never_is_whole_on_a_rank(run_ranks):
    for result in run_ranks(_rank, 2):
        assert all(result["first_is_plain"].values()), result["first_is_plain"]
        assert result["first"] and result["grads"] and result["rank_0_values"]
        assert all(result["last"].values()) and result["offload"], result["last"]
        m = result["memory"]
        # In flight beside this rank's slices (a half, plus padding), the root unit and the
        # buffers: one block's parameters, its flat buffer and the previous one's (the stream
        # holds the last broadcast's tensor until its next task). The model is 12 blocks.
        in_flight = m["root"] + 3 * m["unit"] + m["buffers"] + 64
        assert m["walk"] <= m["full"] // 2 + in_flight < m["full"], m
        # After set-up this rank holds its shard of the parameters and of the gradient; set-up
        # never held more than that and the units in flight (a gradient buffer or a copy of
        # the whole model would add the model's size).
        assert m["held"]["params"] <= m["full"] // 2 + 64, m
        assert m["setup"] <= m["end"] + in_flight, m
        assert "buffer mask of" in result["mask"] and "init_fn" in result["mask"]
        assert "init_fn replaced parameter 0.weight" in result["replaced"]
        assert (
            "parameter 1.weight of a meta-device model is not set by reset_para"
            in (result["unwritten"])
        )


class Gate(nn.Module):
    """Holds a parameter and has no `reset_parameters`."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))


def test_what_cannot_take_a_meta_model_says_so_before_anything_is_built():
    with torch.device("meta"):
        model = Net()
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    for strategy in ("single", "torch-ddp", "ddp", "local-sgd", "zero1", "zero2", "pipeline",
                     "tensor", "hybrid"):  # fmt: skip
        with pytest.raises(ValueError, match=f"strategy '{strategy}' cannot take a model on the "
                           "meta device .* only ZeRO-3"):  # fmt: skip
            tessera.setup(model, adamw, strategy=strategy)
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=f"ZeRO stage {stage}.* cannot take a model on the"):
            initialize(model, torch.optim.AdamW, stage=stage, lr=1e-3)
    with torch.device("meta"):
        gated = nn.Sequential(nn.Linear(3, 3), Gate())
    with pytest.raises(ValueError, match=r"these modules have none: 1 \(Gate: weight\)"):
        initialize(gated, torch.optim.AdamW, stage=3, device="cpu", lr=1e-3)
    gated[1].weight = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"only partly on the meta device \(1.weight is not\)"):
        initialize(gated, torch.optim.AdamW, stage=3, device="cpu", lr=1e-3)
    with pytest.raises(ValueError, match="init_fn must be a function of one module"):
        tessera.setup(model, adamw, strategy="zero3", init_fn=3)


def test_the_trainer_builds_zero3_models_on_the_meta_device_with_the_same_losses(
    tmp_path, monkeypatch
):
    from tessera.train import build_config, run_training
    from tessera.train.metrics import read_metrics
    from tessera.zero import stage3

    calls = []
    original = stage3.materialize_shards
    monkeypatch.setattr(
        stage3, "materialize_shards", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    losses = {}
    for meta in (True, False):
        out = tmp_path / str(meta)
        config = {
            "model": {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 16, "dropout": 0.1},
            "batch_size": 4, "corpus_bytes": 20_000, "sample_tokens": 0, "progress": False,
            "warmup_steps": 1, "strategy": "zero3", "nproc": 1, "steps": 3, "log_every": 1,
            "meta_init": meta, "out": str(out),
        }  # fmt: skip
        run_training(build_config(config, {}))
        losses[meta] = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
        assert len(calls) == 1 and len(losses[meta]) == 3  # materialised in the meta run only
    assert losses[True] == losses[False]


class _WithInit(nn.Sequential):
    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)


def test_the_trainer_builds_on_the_meta_device_only_what_it_can_initialise(capsys):
    from types import SimpleNamespace

    from tessera.train.build_model import build_model

    def config(strategy: str = "zero3", factory: str = "mine:build", meta: bool = True) -> Any:
        return SimpleNamespace(strategy=strategy, meta_init=meta, model_factory=factory, seed=0)

    def workload(build: Any) -> Any:
        return SimpleNamespace(model_fn=build)

    cpu = torch.device("cpu")
    own = workload(lambda: _WithInit(nn.Linear(2, 2)))
    model, init_fn = build_model(own, config(), cpu)
    assert model[0].weight.is_meta and init_fn == model.init_module
    for changed in (config(strategy="ddp"), config(meta=False), config(factory="hf:GPT2Model")):
        model, init_fn = build_model(own, changed, cpu)
        assert not model[0].weight.is_meta and init_fn is None
    gated = workload(lambda: nn.Sequential(nn.Linear(3, 3), Gate()))
    model, init_fn = build_model(gated, config(), cpu, announce=True)
    assert not model[1].weight.is_meta and init_fn is None
    assert "building the model whole on every rank: a meta-device model is initialised" in (
        capsys.readouterr().err
    )


def test_a_trained_user_model_is_never_gathered_whole_at_the_end(tmp_path, monkeypatch):
    """Only the demo's text sample needs the whole model: a user model's run never gathers it."""
    from tessera.strategies.zero import ZeroEngine
    from tessera.train import build_config, run_training

    def whole(self: Any) -> None:
        raise AssertionError("the whole model was gathered")

    monkeypatch.setattr(ZeroEngine, "full_state_dict", whole)
    config = {
        "model_factory": "user_workloads:classifier", "data": "user_workloads:dicts",
        "batch_size": 8, "progress": False, "warmup_steps": 1, "strategy": "zero3", "nproc": 1,
        "steps": 2, "out": str(tmp_path / "run"),
    }  # fmt: skip
    summary = run_training(build_config(config, {}))
    assert summary is not None and not (tmp_path / "run" / "sample.txt").exists()


def test_the_preflight_of_a_meta_run_builds_no_weights():
    """zero3 with --meta-init: the launcher's check builds the model on the meta device and runs
    the item's forward on meta tensors, as no rank holds the model whole either; ddp's builds it
    on the CPU. A forward that meta tensors cannot run is checked on the CPU model instead of
    being refused, and a wrong shape is still refused (found on meta, confirmed whole)."""
    import user_workloads

    from tessera.errors import ConfigError
    from tessera.train import build_config
    from tessera.train.preflight import preflight_workload

    def check(factory: str, **extra: Any) -> list[str]:
        user_workloads.BUILT_ON.clear()
        base = {
            "model_factory": f"user_workloads:{factory}", "data": "user_workloads:pairs",
            "loss": "user_workloads:mse", "batch_size": 4, "strategy": "zero3", "nproc": 1,
        }  # fmt: skip
        checked = preflight_workload(build_config({**base, **extra}))
        assert checked is not None and checked["parameters"] == 6 * 16 + 16 + 16 * 2 + 2
        return list(user_workloads.BUILT_ON)

    assert check("recorded_mlp") == ["meta"]
    assert check("recorded_mlp", strategy="ddp") == ["cpu"]
    assert check("recorded_mlp", meta_init=False) == ["cpu"]
    assert check("value_gated_mlp") == ["meta", "cpu"]
    with pytest.raises(ConfigError, match="mat1 and mat2 shapes cannot be multiplied"):
        check("six_to_three")
    assert user_workloads.BUILT_ON == ["meta", "cpu"]
    # a factory that cannot build on the meta device fails in the ranks too: said up front
    with pytest.raises(ConfigError, match="on the meta device .*--no-meta-init builds it whole"):
        check("reads_weights_at_construction")
    assert check("reads_weights_at_construction", meta_init=False) == []
