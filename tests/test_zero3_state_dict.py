"""Between steps a ZeRO-3 model's `state_dict()` refuses, naming the way that works.

A ZeRO-3 parameter's storage is freed between uses (only its shard is kept), and torch does not
check a view against its storage: `torch.save(model.state_dict())` wrote a small file of garbage
without a word, and reading a parameter's values could kill the process. `state_dict()` now
raises, naming the parameter and `engine.full_state_dict()`, whose values are a plain loop's
(checked here against one SGD step written in the test); `state_dict(keep_vars=True)` still gives
the keys (tessera's export and `full_state_dict` read only those).
"""

from __future__ import annotations

import io

import torch
from torch import nn

import tessera

WIDTH, ROWS = 6, 4


class _Scorer(nn.Module):
    """A user's model: blocks in a ModuleList of ModuleDicts (ZeRO-3 units) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"proj": nn.Linear(WIDTH, WIDTH), "norm": nn.LayerNorm(WIDTH)})
            for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block["proj"](block["norm"](x)))
        return self.head(x)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(ROWS, WIDTH, generator=generator), torch.randn(ROWS, 1, generator=generator)


def _worker() -> dict[str, object]:
    ctx = tessera.init()
    torch.manual_seed(0)
    model = _Scorer()
    oracle = _Scorer()
    oracle.load_state_dict(model.state_dict())
    engine = tessera.setup(
        model, lambda params: torch.optim.SGD(params, lr=0.5), strategy="zero3",
        loss_fn=nn.MSELoss(),
    )  # fmt: skip
    engine.train_step(_batch(ctx.rank))
    engine.step()
    found: dict[str, object] = {"keys": list(model.state_dict(keep_vars=True))}
    try:
        torch.save(model.state_dict(), io.BytesIO())
        found["refused"] = None
    except RuntimeError as exc:
        found["refused"] = str(exc)
    full = engine.full_state_dict()
    # the oracle: one SGD step on the mean loss of both ranks' batches
    losses = [nn.functional.mse_loss(oracle(x), y) for x, y in map(_batch, range(ctx.world_size))]
    (sum(losses) / len(losses)).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.5).step()
    try:  # torch's float32 tolerances: the two sides average the ranks' gradients apart
        torch.testing.assert_close(full, oracle.state_dict())
        found["full_equals_plain_loop"] = True
    except AssertionError:
        found["full_equals_plain_loop"] = False
    found["oracle_keys"] = list(oracle.state_dict())
    return found


def test_a_zero3_state_dict_between_steps_raises_and_full_state_dict_gives_the_values(run_ranks):
    for found in run_ranks(_worker, 2):
        assert found["refused"] is not None, "state_dict() handed out views of freed storage"
        assert "is sharded by ZeRO-3 between steps" in found["refused"]
        assert "engine.full_state_dict()" in found["refused"]
        assert found["refused"].split()[0] in found["oracle_keys"]  # names the parameter
        assert found["keys"] == found["oracle_keys"]
        assert found["full_equals_plain_loop"]


def _zero1_worker() -> bool:
    tessera.init()
    torch.manual_seed(0)
    model = _Scorer()
    engine = tessera.setup(
        model, lambda params: torch.optim.SGD(params, lr=0.5), strategy="zero1",
        loss_fn=nn.MSELoss(),
    )  # fmt: skip
    engine.train_step(_batch(0))
    engine.step()
    plain, full = model.state_dict(), engine.full_state_dict()
    return plain.keys() == full.keys() and all(torch.equal(plain[k], full[k]) for k in plain)


def test_state_dict_is_left_alone_where_no_storage_is_freed(run_ranks):
    """The refusal is ZeRO-3's: under ZeRO-1 the parameters are whole between steps and
    `state_dict()` gives the trained values, those of `full_state_dict()`."""
    assert run_ranks(_zero1_worker, 1) == [True]
