"""fp16 whose skip decision stays on the device equals torch's GradScaler loop.

With an optimizer whose step takes `found_inf` (torch's fused AdamW here), `Engine.step` hands it
the inf/nan flag and updates the loss scale on the device (`DynamicLossScaler.update_on_device`),
as `torch.amp.GradScaler` does for fused optimizers: no host read a step. Oracle: the plain fp16
loop with `GradScaler` and the same fused AdamW, written here. The loss scale starts at 2^30, so
the first steps overflow in fp16 and are skipped (the scale halves each time) and later ones grow
it (`growth_interval=3`): both rules are exercised. Scaling by powers of two is exact, and both
sides run the same fused kernel on the same gradients, so the weights agree bit for bit, and the
scale and the count of skipped steps are the same. ddp on one rank (nothing to send, nothing
cast) equals the plain loop too. ZeRO 1-3 keep fp16 weights beside fp32 masters, not the plain
loop's: each is compared with its own host-read path (`_host_skip_adamw`, the one every optimizer
without `found_inf` takes), bit for bit, with the same scale and skips.
"""

from __future__ import annotations

import torch
from torch import nn

import tessera
from tessera.optim import DynamicLossScaler

STEPS, INIT_SCALE, GROWTH_INTERVAL = 24, 2.0**30, 3


class _Classifier(nn.Module):
    """A user's model tessera never built."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32))
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(16, 12, generator=generator), torch.randint(5, (16,), generator=generator)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _plain() -> tuple[dict[str, torch.Tensor], float, int]:
    torch.manual_seed(0)
    model = _Classifier()
    optimizer = _adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    x, y = _data()
    skipped = 0
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict(), scaler.get_scale(), skipped


def _host_skip_adamw(params) -> torch.optim.Optimizer:
    """Fused AdamW declared unable to take `found_inf`: tessera then reads the flag on the host
    and skips the step itself (the path every other optimizer takes)."""
    optimizer = _adamw(params)
    optimizer._step_supports_amp_scaling = False  # (fused=True set it on the instance)
    return optimizer


def _tessera(strategy: str, optimizer=_adamw) -> tuple[dict[str, torch.Tensor], float, int, bool]:
    torch.manual_seed(0)
    engine = tessera.setup(
        _Classifier(), optimizer, strategy=strategy, loss_fn=nn.functional.cross_entropy,
        precision="fp16",
        loss_scaler=DynamicLossScaler(INIT_SCALE, growth_interval=GROWTH_INTERVAL),
    )  # fmt: skip
    batch = _data()
    for _ in range(STEPS):
        engine.train_step(batch)
        engine.step()
    on_device = engine.loss_scaler._device is not None
    return engine.full_state_dict(), engine.loss_scale, engine.skipped_steps, on_device


def _runs() -> dict[str, tuple]:
    tessera.init()
    runs = {"plain": _plain(), "single": _tessera("single")}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        runs[strategy] = _tessera(strategy)
        runs[f"{strategy} host"] = _tessera(strategy, _host_skip_adamw)
    return runs


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp16_skipped_on_the_device_equals_grad_scaler(run_ranks):
    """single and ddp against GradScaler's loop; every strategy against its own host-read path
    (ZeRO: fp16 weights, not the plain loop's); the device path keeps the scale on the device."""
    runs = run_ranks(_runs, 1)[0]
    plain, scale, skipped = runs["plain"]
    assert skipped > 0 and scale > INIT_SCALE / 2**skipped  # both rules ran: backoff and growth
    for name in ("single", "ddp", "zero1", "zero2", "zero3"):
        assert runs[name][1:] == (scale, skipped, True), name
        if name != "single":
            assert runs[f"{name} host"][1:] == (scale, skipped, False), name
            assert _same(runs[name][0], runs[f"{name} host"][0]), name
    assert _same(runs["single"][0], plain)
    assert _same(runs["ddp"][0], plain)
