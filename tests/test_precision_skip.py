"""fp16: an inf in one rank's gradients makes every rank skip the step, asserted within seconds.

Each rank holds its own gradients (DDP after its reduction, ZeRO's reduced slices, a pipeline
stage's, a tensor-parallel shard's, local SGD's unreduced ones); an inf is written into one rank's
only. Every rank must then skip: parameters and optimizer state unchanged, one skipped step, the
scale halved. A rank that steps while another skips leaves the two waiting on different
collectives, which would end only at the spawn's deadline. So each rank reports what it saw
through a file (no collective) right after its step, with the collectives' timeout short, and the
ranks stop at the first strategy where the reports disagree: a wrong decision fails an assertion
naming the rank and the strategy.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tessera

ROWS, POISONED, WORLD = 8, 1, 2
TIMEOUT_S = 30.0
"""Bound of each collective (and of the ranks' rendezvous, so not tighter: a loaded CI machine
starts ranks seconds apart): a rank that stepped alone and waits on a peer that skipped raises
after it. Most wrong decisions need no wait at all: ddp, first, has no collective in its step,
so the ranks report at once and stop there."""

STRATEGIES: dict[str, dict[str, Any]] = {  # the ones whose step has no collective first
    "ddp": {},
    "torch-ddp": {},
    "pipeline": {"microbatches": 2},
    "tensor": {"plan": {"0": "column", "2": "row"}},
    "zero3": {},
    "hybrid": {"dp": 2, "microbatches": 2},
    "zero1": {},
    "zero2": {},
    "local-sgd": {"average_every": 1},  # each rank its own gradients; then the average
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 5, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def _local_state(engine: Any) -> list[torch.Tensor]:
    """What this rank steps, read without a collective: the tensors its optimizer steps (ZeRO's
    master shards, a stage's parameters) and their optimizer state."""
    optimizer = engine.optimizer
    tensors = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
    for state in optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _exchange(folder: Path, name: str, rank: int, report: dict[str, Any]) -> list[dict]:
    """Every rank's report of `name`, through files (a peer stuck in a collective writes its own
    once that collective times out)."""
    (folder / f"{name}-{rank}.json.tmp").write_text(json.dumps(report))
    (folder / f"{name}-{rank}.json.tmp").replace(folder / f"{name}-{rank}.json")
    deadline = time.monotonic() + 3 * TIMEOUT_S
    reports = []
    for other in range(WORLD):
        path = folder / f"{name}-{other}.json"
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        reports.append(json.loads(path.read_text()) if path.exists() else {"missing": other})
    return reports


def _one_rank_inf(folder: str) -> dict[str, list[dict]]:
    ctx = tessera.init()
    inputs, targets = _batch()
    rows = slice(ctx.rank * ROWS // WORLD, (ctx.rank + 1) * ROWS // WORLD)
    seen: dict[str, list[dict]] = {}
    for strategy, options in STRATEGIES.items():
        engine = tessera.setup(
            _mlp(), lambda p: torch.optim.AdamW(p, lr=1e-2), strategy=strategy,
            loss_fn=F.cross_entropy, precision="fp16", ctx=ctx, **options,
        )  # fmt: skip
        engine.train_step((inputs[rows], targets[rows]))
        engine.step()  # a clean first step: the optimizer state exists
        before, local, scale = engine.full_state_dict(), _local_state(engine), engine.loss_scale
        engine.train_step((inputs[rows], targets[rows]))
        if ctx.rank == POISONED:  # this rank's own gradients only
            grad = next(g for g in engine.local_gradients() if g is not None)
            grad.view(-1)[0] = math.inf
        report: dict[str, Any] = {"rank": ctx.rank}
        try:
            engine.step()
        except Exception as error:  # noqa: BLE001 - reported, so the test names it
            report["error"] = f"{type(error).__name__}: {error}"
        after = _local_state(engine)
        report["skipped"] = engine.skipped_steps
        report["scale_ratio"] = engine.loss_scale / scale
        report["unchanged"] = all(torch.equal(a, b) for a, b in zip(local, after))
        seen[strategy] = _exchange(Path(folder), strategy, ctx.rank, report)
        views = [{k: v for k, v in r.items() if k != "rank"} for r in seen[strategy]]
        if any("error" in v or v != views[0] for v in views):
            return seen  # the ranks disagree: no collective may follow (a peer may be stuck)
        # every rank skipped alike: the whole model (gathered) is unchanged too
        state = engine.full_state_dict()
        report["whole_unchanged"] = all(torch.equal(state[k], before[k]) for k in before)
        seen[strategy].append(report)
        engine.close()
    return seen


def test_an_inf_on_one_rank_makes_every_rank_skip(tmp_path):
    """Every strategy whose ranks hold different gradients: each rank skipped once, halved its
    scale and left its parameters and optimizer state as they were; then the whole model."""
    seen = tessera.launch(_one_rank_inf, WORLD, str(tmp_path), timeout_s=TIMEOUT_S,
                          deadline_s=120.0)[0]  # fmt: skip
    for strategy in STRATEGIES:
        assert strategy in seen, f"stopped before {strategy}: {seen}"
        for report in seen[strategy]:
            want = {"skipped": 1, "scale_ratio": 0.5, "unchanged": True}
            got = {k: report.get(k) for k in want}
            assert "error" not in report and got == want, (strategy, report)
        assert seen[strategy][-1]["whole_unchanged"], strategy
