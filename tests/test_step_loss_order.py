"""The loss all-reduce of `train_step` meets an idle communication stream.

`StepLoss.mean_over` issues its all-reduce from the training thread, outside the group's ordered
stream (`tessera.comm.stream`): collectives pair across ranks by issue order, so it is safe only
if no stream work is queued or running at that moment on any rank (the stream module's promise:
"every engine waits for its stream work before its backward or step returns"). Attacked here
where work is most likely left behind: ZeRO-3's parameter prefetch, the delayed parameter update
of ZeRO-Offload (its publish on the stream), gradient accumulation and several buckets, on a
model tessera never built.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tessera

RUNS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp", "bucket_cap_mb": 0.004},
    "zero2": {"strategy": "zero2", "bucket_cap_mb": 0.004, "grad_accum": 2},
    "zero3": {"strategy": "zero3"},
    "zero2-delayed": {"strategy": "zero2", "offload": "delayed"},
    "zero3-offload-params": {"strategy": "zero3", "offload": "params"},
}


class _Blocks(nn.Module):
    """Not tessera's: three blocks in a ModuleDict (ZeRO-3's units), one used twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleDict(
            {name: nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for name in ("a", "b", "c")}
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in ("a", "b", "a", "c"):
            x = x + self.blocks[name](x)
        return self.head(x)


def _offload(kind: str) -> Any:
    from tessera.zero import OffloadPolicy

    if kind == "delayed":
        return OffloadPolicy(device="cpu", delayed_update=True, delayed_update_after=1)
    return OffloadPolicy(device="cpu", params=True)


def _stream_idle_at_each_loss() -> dict[str, list[bool]]:
    import tessera.comm.stream as streams
    from tessera.runtime.scalar import DeviceScalar

    ctx = tessera.init()
    torch.set_num_threads(1)
    running = [0]
    run_labeled = streams._run_labeled

    def counted(*args: Any) -> None:
        running[0] += 1
        try:
            run_labeled(*args)
        finally:
            running[0] -= 1

    streams._run_labeled = counted
    mean_over = DeviceScalar.mean_over.__func__
    seen: list[bool] = []

    def checked(cls: type, local: torch.Tensor, group: Any = None) -> Any:
        stream = streams.existing_stream(group)
        seen.append(stream is None or (stream._queue.empty() and running[0] == 0))
        return mean_over(cls, local, group)

    DeviceScalar.mean_over = classmethod(checked)
    found = {}
    for name, run in RUNS.items():
        options = dict(run)
        if "offload" in options:
            options["offload"] = _offload(options["offload"])
        engine = tessera.setup(
            _Blocks(), lambda p: torch.optim.AdamW(p, lr=0.01), loss_fn=F.mse_loss, ctx=ctx,
            **options,
        )  # fmt: skip
        seen.clear()
        for step in range(4):
            generator = torch.Generator().manual_seed(step * ctx.world_size + ctx.rank)
            x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 2, generator=generator)
            float(engine.train_step((x, y)))
            engine.step()
        engine.close()
        found[name] = list(seen)
    return found


def test_the_loss_all_reduce_meets_an_idle_stream(run_ranks):
    for rank in run_ranks(_stream_idle_at_each_loss, 2):
        for name, seen in rank.items():
            assert seen == [True] * 4, (name, seen)
