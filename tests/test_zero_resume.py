"""ZeRO checkpoints resume bit for bit with AdamW; aborted saves and padding-only shards load.

k steps + `save_shard` + `load_shards` into a fresh optimizer + k steps must equal 2k steps
straight: every flat's master, every optimizer state tensor (Adam's `step` included) compared
with `torch.equal`, since both runs perform the same float operations in the same order.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.zero import full_state_dict, load_shards, save_shard
from tessera.zero.api import STAGES

K = 3
"""Steps before and after the checkpoint."""


class Scale(nn.Module):
    """A unit with one weight of one element: on two ranks, rank 1's shard is only padding."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class RawLinear(nn.Module):
    """A linear layer whose parameters are used directly in forward (no nn.Linear child)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight, self.bias))


def _model() -> nn.Module:
    # Stage 3 makes one flat per child (four here); stages 1/2 one per parameter (tiny buckets).
    torch.manual_seed(0)
    return nn.Sequential(RawLinear(5, 7), Scale(), RawLinear(7, 6), nn.Linear(6, 3))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    return x.tensor_split(world)[rank], y.tensor_split(world)[rank]


def _zero(stage: int) -> tuple[nn.Module, object]:
    model = _model()
    make = lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)  # noqa: E731
    kwargs = {"bucket_cap_mb": 1e-6} if stage < 3 else {}
    optimizer = STAGES[stage](model, make, **kwargs)
    model._tessera_zero = optimizer  # full_state_dict finds the shards here
    return model, optimizer


def _train(model: nn.Module, optimizer, steps: range) -> None:
    ctx = tessera.init()
    for step in steps:
        x, y = _batch(step, ctx.rank, ctx.world_size)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _state(model: nn.Module, optimizer) -> dict:
    """Everything a resumed run must reproduce: this rank's masters and inner optimizer state."""
    inner = optimizer.optimizer.state_dict()
    return {
        "full": full_state_dict(model),
        "masters": [flat.master.detach().clone() for flat in optimizer.flats],
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in inner["state"].items()},
        "groups": inner["param_groups"],
    }


def _resume_every_stage(folder: str) -> dict:
    ctx = tessera.init()
    torch.set_num_threads(1)
    out = {}
    for stage in (1, 2, 3):
        model, optimizer = _zero(stage)
        _train(model, optimizer, range(2 * K))
        straight = _state(model, optimizer)
        optimizer.remove_hooks()

        model, optimizer = _zero(stage)
        _train(model, optimizer, range(K))
        save_shard(f"{folder}/stage{stage}", optimizer)
        optimizer.remove_hooks()

        model, optimizer = _zero(stage)
        load_shards(optimizer, f"{folder}/stage{stage}")
        _train(model, optimizer, range(K, 2 * K))
        resumed = _state(model, optimizer)
        optimizer.remove_hooks()
        out[stage] = {"flats": len(optimizer.flats), "straight": straight, "resumed": resumed}
    dist.barrier()
    return {"rank": ctx.rank, **out}


def _assert_equal_states(straight: dict, resumed: dict, where: str) -> None:
    assert straight["full"].keys() == resumed["full"].keys()
    for key, value in straight["full"].items():
        assert torch.equal(resumed["full"][key], value), f"{where}: parameter {key}"
    for index, (a, b) in enumerate(zip(straight["masters"], resumed["masters"], strict=True)):
        assert torch.equal(a, b), f"{where}: master of flat {index}"
    assert straight["state"].keys() == resumed["state"].keys(), where
    for index, kinds in straight["state"].items():
        assert kinds.keys() == resumed["state"][index].keys(), f"{where}: flat {index}"
        for kind, value in kinds.items():
            assert torch.equal(resumed["state"][index][kind], value), f"{where}: {kind}/{index}"
    assert straight["groups"] == resumed["groups"], where


def test_every_zero_stage_resumes_adamw_bit_for_bit(run_ranks, tmp_path):
    results = run_ranks(_resume_every_stage, 2, str(tmp_path))
    for result in results:
        for stage in (1, 2, 3):
            found = result[stage]
            assert found["flats"] >= 4, "the model must span several flat shards"
            where = f"stage {stage} rank {result['rank']}"
            # Adam's bias correction reads `step`: each flat must count 2k, once per step.
            steps = [float(s["step"]) for s in found["resumed"]["state"].values()]
            assert steps == [2.0 * K] * found["flats"], f"{where}: step counts {steps}"
            _assert_equal_states(found["straight"], found["resumed"], where)


def _save_then_reshard(folder: str) -> dict:
    """On two ranks: k steps and a save. On one rank (a second spawn): load and compare."""
    tessera.init()
    torch.set_num_threads(1)
    model, optimizer = _zero(2)
    _train(model, optimizer, range(K))
    save_shard(folder, optimizer)
    return {"full": full_state_dict(model), "state": _full_optimizer_state(optimizer)}


def _full_optimizer_state(optimizer) -> dict:
    """kind -> parameter name -> the whole state tensor, gathered from every rank's slice."""
    out: dict = {}
    world = dist.get_world_size()
    for index, flat in enumerate(optimizer.flats):
        for kind, value in optimizer.optimizer.state[flat.master].items():
            if kind == "step":
                out.setdefault("step", {})[index] = value.clone()
                continue
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value.contiguous())
            full = torch.cat(parts)
            offsets = flat.layout.offsets
            for position, name in enumerate(flat.layout.names):
                piece = full[offsets[position] : offsets[position + 1]]
                out.setdefault(kind, {})[name] = piece.reshape(flat.layout.shapes[position])
    return out


def _load_on_one_rank(folder: str) -> dict:
    tessera.init()
    model, optimizer = _zero(2)
    load_shards(optimizer, folder)
    loaded = {"full": full_state_dict(model), "state": _full_optimizer_state(optimizer)}
    _train(model, optimizer, range(K, 2 * K))
    steps = [float(optimizer.optimizer.state[flat.master]["step"]) for flat in optimizer.flats]
    return {**loaded, "steps_at_end": steps, "final": full_state_dict(model)}


def _plain_adamw(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The oracle: 2k steps of plain PyTorch AdamW on the whole batch, in `dtype`."""
    model = _model().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    for step in range(2 * K):
        x, y = _batch(step, 0, 1)
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(dtype)), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_resharding_two_ranks_to_one_loads_every_state_exactly_and_continues(run_ranks, tmp_path):
    # Loading moves values without arithmetic, so the reshard itself is exact (torch.equal);
    # only later steps may differ from a two-rank run, by reduction order.
    saved = run_ranks(_save_then_reshard, 2, str(tmp_path / "ck"))[0]
    loaded = run_ranks(_load_on_one_rank, 1, str(tmp_path / "ck"))[0]
    for key, value in saved["full"].items():
        assert torch.equal(loaded["full"][key], value), key
    for kind in ("exp_avg", "exp_avg_sq"):
        assert saved["state"][kind].keys() == loaded["state"][kind].keys()
        for name, value in saved["state"][kind].items():
            assert torch.equal(loaded["state"][kind][name], value), f"{kind} {name}"
    steps = [float(s) for s in loaded["state"]["step"].values()]
    assert steps == [float(K)] * len(steps)
    # Each later step counts once per flat (a shared step tensor would count once per flat).
    assert loaded["steps_at_end"] == [2.0 * K] * len(steps)
    # The continued run: k steps on two ranks, k on one. It differs from one process only by
    # float32 rounding (means of half batches averaged vs one mean). Both are measured against
    # a float64 run: tessera's error may be at most C = 4 times the plain fp32 loop's (two
    # rounding paths of the same size, with margin), plus one ulp of the magnitude per step.
    ref64, oracle = _plain_adamw(torch.float64), _plain_adamw(torch.float32)
    for key, exact in ref64.items():
        ours = (loaded["final"][key].double() - exact).abs().max()
        theirs = (oracle[key].double() - exact).abs().max()
        ulps = 2 * K * torch.finfo(torch.float32).eps * exact.abs().max()
        assert ours <= 4 * theirs + ulps, f"{key}: {ours:.3g} vs plain fp32 {theirs:.3g}"


def _aborted_save(folder: str) -> None:
    ctx = tessera.init()
    model, optimizer = _zero(1)
    _train(model, optimizer, range(1))
    if ctx.rank == 2:  # the others write (or wait) meanwhile, then the launcher stops them
        time.sleep(0.5)
        raise RuntimeError("rank 2 dies before writing its shard")
    save_shard(folder, optimizer)


def _save_and_load(folder: str) -> dict:
    tessera.init()
    model, optimizer = _zero(1)
    _train(model, optimizer, range(2))
    saved = full_state_dict(model)
    save_shard(folder, optimizer)
    fresh, loader = _zero(1)
    load_shards(loader, folder)
    return {"saved": saved, "loaded": full_state_dict(fresh)}


def test_aborted_save_leaves_nothing_that_breaks_the_next_save(run_ranks, tmp_path):
    folder = tmp_path / "ck"
    with pytest.raises(Exception, match="rank 2 dies"):  # noqa: B017 - RankFailedError
        run_ranks(_aborted_save, 3, str(folder), deadline_s=60)
    # The folder holds no shard of the failed save: a save on another world size lands whole.
    assert not folder.exists() or not list(folder.glob("rank-*"))
    result = run_ranks(_save_and_load, 2, str(folder))[0]
    for key, value in result["saved"].items():
        assert torch.equal(result["loaded"][key], value), key
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank-00000-of-00002.pt",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.pt",
        "rank-00001-of-00002.safetensors",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # the partial folder is gone
