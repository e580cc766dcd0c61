"""`CPUAdam`: Adam / AdamW over fp32 host tensors in one fused, vectorised, multi-threaded pass.

This is the optimizer step of ZeRO-Offload (Ren et al., USENIX ATC 2021): with the master weights
and both moments in host memory, the step is a stream over 28 bytes per parameter (read p, g, m, v;
write p, m, v) and its speed is the host's memory bandwidth. `torch.optim.AdamW(foreach=True)`
makes about ten passes over that memory; the kernel of `tessera.optim._cpu_adam_kernel` makes one.

Semantics are torch's, so `CPUAdam` is a drop-in for `torch.optim.AdamW` (`adamw=True`, decoupled
weight decay, Loshchilov & Hutter 2019) or `torch.optim.Adam` with L2 decay (`adamw=False`): the
same hyper-parameters, bias correction and state (`step`, `exp_avg`, `exp_avg_sq` per parameter,
`step` a float32 scalar tensor), so a state dict moves between them either way: `load_state_dict`
takes a `torch.optim.Adam(W)` state dict (its `decoupled_weight_decay` flag becomes `adamw`;
CPUAdam's own options missing from it keep this optimizer's values) and refuses one with
`amsgrad` or `maximize` set; `state_dict()` carries torch's `decoupled_weight_decay`, `amsgrad`
and `maximize` flags for torch to read. The results differ from torch's fused kernel by fp32
rounding only (other association of the same formula).

Where the kernel cannot be built (no compiler, no ninja, ...), every step runs torch's own fused
AdamW/Adam CPU kernel on the same state instead, with one warning per process: training goes on,
slower, never stops on a build problem.

`bf16_moments=True` stores the moments in bfloat16; `moments_rounding="stochastic"` rounds them
stochastically instead of to nearest, in the same pass (`tessera.optim.stochastic_rounding`).

`step(bf16_out=[...])` also writes each updated parameter, rounded to bfloat16, into a given
tensor in the same pass (the copy a mixed-precision model computes with), saving a second pass.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim.adam import adam as torch_adam_functional

from tessera.optim._cpu_adam_kernel import AdamKernel, load_kernel
from tessera.optim.stochastic_rounding import parameter_seed, step_key, stochastic_round_to_bf16

__all__ = ["CPUAdam", "MOMENTS_ROUNDING", "adam_groups", "host_zeros", "native_kernel_available"]

MOMENTS_ROUNDING = ("nearest", "stochastic")


def native_kernel_available() -> bool:
    """True when the compiled kernel loads here (building it on first call)."""
    return isinstance(load_kernel(), AdamKernel)


_warned_fallback = False


def _plain_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(tuple(shape), dtype=dtype)


def host_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in host memory for `CPUAdam` to step, on 2 MiB transparent huge pages where the
    native helper loads and Linux grants them (tensors of 4 MiB and more), else plain zeros.

    The step streams parameters, gradients and both moments; on 4 KiB pages each stream stalls
    at every page boundary (see `AdamKernel.zeros`), so the buffers a caller allocates for it
    (ZeRO-Offload's fp32 master and gradient partitions) go on huge pages like the moments.
    Values and layout are those of `torch.zeros`: only the page size differs.
    """
    kernel = load_kernel()
    return (kernel.zeros if isinstance(kernel, AdamKernel) else _plain_zeros)(shape, dtype)


def _kernel_or_warn() -> AdamKernel | None:
    """The native kernel, or None after warning once per process why it is not used."""
    global _warned_fallback
    kernel = load_kernel()
    if isinstance(kernel, AdamKernel):
        return kernel
    if not _warned_fallback:
        _warned_fallback = True
        reason = " ".join(str(kernel).split())  # a build log: its head and tail say the most
        if len(reason) > 600:
            reason = f"{reason[:200]} ... {reason[-400:]}"
        warnings.warn(
            "tessera.optim.CPUAdam: the native CPU Adam kernel could not be built or loaded "
            f"({type(kernel).__name__}: {reason}); using torch's fused "
            "AdamW/Adam kernel instead (same results, slower).",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


class CPUAdam(torch.optim.Optimizer):
    """Adam(W) on fp32 CPU parameters with a fused native step; see the module docstring.

    `adamw=True` is `torch.optim.AdamW` (decoupled weight decay), `adamw=False` is
    `torch.optim.Adam` (L2 weight decay added to the gradient). amsgrad, maximize, capturable
    and complex parameters are not supported (a clear error says so).

    `bf16_moments=True` stores `exp_avg` and `exp_avg_sq` in bfloat16 (rounded to nearest-even
    after each fp32 update): 20 instead of 28 bytes move per parameter and step, and the state
    halves, at the cost of an 8-bit mantissa in the moments.

    `moments_rounding` (with `bf16_moments=True`): `"nearest"` (nearest-even, the default) or
    `"stochastic"`: each stored moment rounds up with probability equal to the fraction of a bf16
    ulp it drops, so it is unbiased and the small updates of a slow average are kept on average
    (see `tessera.optim.stochastic_rounding`). The bits are a hash of (`rounding_seed`, the
    parameter's position, its step, the element index): two runs with the same seed are bit for
    bit the same, and a resumed one too (each parameter's seed is in the state dict as
    `rounding_seed`, next to its `step`). The hash runs in the same fused pass: measured at
    0.91-0.96x the speed of nearest rounding (medians of four interleaved runs, BENCHMARKS.md).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        adamw: bool = True,
        bf16_moments: bool = False,
        moments_rounding: str = "nearest",
        rounding_seed: int = 0,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"CPUAdam: lr must be >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"CPUAdam: eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: betas must be in [0, 1), got {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"CPUAdam: weight_decay must be >= 0, got {weight_decay}")
        if moments_rounding not in MOMENTS_ROUNDING:
            raise ValueError(
                f"CPUAdam: moments_rounding must be one of {MOMENTS_ROUNDING}, "
                f"got {moments_rounding!r}"
            )
        if moments_rounding == "stochastic" and not bf16_moments:
            raise ValueError(
                "CPUAdam: moments_rounding='stochastic' rounds bf16 moments: it needs "
                "bf16_moments=True (fp32 moments are not rounded)"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw=adamw,
            bf16_moments=bf16_moments,
            moments_rounding=moments_rounding,
            rounding_seed=int(rounding_seed),
        )
        super().__init__(params, defaults)
        for index, group in enumerate(self.param_groups):
            for position, param in enumerate(group["params"]):
                self._check_param(param, f"param_groups[{index}]['params'][{position}]")
        self._kernel = _kernel_or_warn()

    @staticmethod
    def _check_param(param: torch.Tensor, where: str) -> None:
        if param.dtype != torch.float32:
            raise TypeError(
                f"CPUAdam updates float32 parameters only; {where} has dtype {param.dtype} "
                f"and shape {tuple(param.shape)}. Keep an fp32 master copy (e.g. "
                "tessera.zero.initialize(..., mixed_precision='bf16')) and pass that."
            )
        if param.device.type != "cpu":
            raise ValueError(f"CPUAdam runs on host memory; {where} is on {param.device}")
        if not param.is_contiguous():
            raise ValueError(f"CPUAdam needs contiguous parameters; {where} is not")

    def state_dict(self) -> dict[str, Any]:
        """torch's format; each group also says `decoupled_weight_decay` (= `adamw`) and
        `amsgrad` / `maximize` (False), so `torch.optim.Adam(W).load_state_dict` reads it right."""
        packed = super().state_dict()
        for group in packed["param_groups"]:
            group.update(decoupled_weight_decay=group["adamw"], amsgrad=False, maximize=False)
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `CPUAdam` or `torch.optim.Adam` / `AdamW` state dict (see the module doc)."""
        groups = adam_groups(state_dict["param_groups"], self.param_groups, "CPUAdam")
        super().load_state_dict({**state_dict, "param_groups": groups})

    @property
    def uses_native_kernel(self) -> bool:
        """True if steps run the compiled kernel, False if torch's fused fallback."""
        return self._kernel is not None

    def _state_of(
        self, param: torch.Tensor, group: dict[str, Any], position: int
    ) -> dict[str, torch.Tensor]:
        state = self.state[param]
        dtype = torch.bfloat16 if group["bf16_moments"] else torch.float32
        if not state:  # lazily, as torch does, so a loaded state dict is used as is
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            zeros = self._kernel.zeros if self._kernel is not None else _plain_zeros
            state["exp_avg"] = zeros(param.shape, dtype)
            state["exp_avg_sq"] = zeros(param.shape, dtype)
        for name in ("exp_avg", "exp_avg_sq"):
            if state[name].shape != param.shape:
                raise ValueError(
                    f"CPUAdam: parameter {position} has shape {tuple(param.shape)} but its state "
                    f"{name!r} has shape {tuple(state[name].shape)}: the parameter was replaced "
                    "after its state was made (`param.data = ...`) or the loaded state dict is "
                    "another model's. Build a new optimizer for the new parameter."
                )
            # load_state_dict casts moments to the parameter's dtype: bf16 values in fp32 go
            # back losslessly; fp32 moments into a bf16_moments optimizer are rounded once.
            # torch's Adam keeps a strided parameter's moments strided: made contiguous here.
            if state[name].dtype != dtype or not state[name].is_contiguous():
                state[name] = state[name].to(dtype).contiguous()
        if _stochastic(group) and "rounding_seed" not in state:  # (also: a nearest run's state)
            state["rounding_seed"] = parameter_seed(group["rounding_seed"], position)
        return state

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        bf16_out: Sequence[torch.Tensor | None] | None = None,
        grads: Sequence[torch.Tensor | None] | None = None,
        after_each: Callable[[int], None] | None = None,
    ) -> float | None:
        """One Adam(W) step for every parameter that has a gradient.

        `bf16_out`, if given, has one entry per parameter in param-group order (None to skip
        one): a bfloat16 tensor of the parameter's numel that receives the updated value.
        `grads`, if given, likewise: the gradient to step with instead of `.grad` (None: the
        `.grad`), float32 or bfloat16 of the parameter's shape. A bfloat16 gradient is widened
        as the kernel reads it (exactly: the step equals the one on its float32 copy), which
        `.grad` cannot hold for a float32 parameter: ZeRO-Offload's host partitions in the
        training dtype, stepped without a float32 copy of them.
        `after_each(position)`, if given, is called as soon as a parameter (its place in
        param-group order) and its `bf16_out` are updated, before the next one is stepped: the
        caller sends a finished parameter on while the rest step (ZeRO-Offload's uploads).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        for name, given in (("bf16_out", bf16_out), ("grads", grads)):
            if given is not None and len(given) != len(params):
                raise ValueError(
                    f"CPUAdam.step: {name} has {len(given)} entries for {len(params)} parameters"
                )
        position = 0
        for group in self.param_groups:
            for param in group["params"]:
                target = bf16_out[position] if bf16_out is not None else None
                grad = grads[position] if grads is not None else None
                grad = param.grad if grad is None else grad
                position += 1
                if grad is None:
                    continue
                # Again at every step: add_param_group or `param.data = ...` can change a
                # parameter after construction, and the kernel would misread its memory.
                self._check_param(param, f"parameter {position - 1}")
                self._check_step_inputs(param, grad, target, position - 1)
                self._update(param, grad, group, target, position - 1)
                if after_each is not None:
                    after_each(position - 1)
        return loss

    @staticmethod
    def _check_step_inputs(
        param: torch.Tensor, grad: torch.Tensor, target: torch.Tensor | None, position: int
    ) -> None:
        if grad.is_sparse:
            raise ValueError(f"CPUAdam: parameter {position} has a sparse gradient")
        if grad.dtype not in (torch.float32, torch.bfloat16) or grad.shape != param.shape:
            raise TypeError(
                f"CPUAdam: parameter {position} ({tuple(param.shape)}, float32) has a gradient "
                f"of dtype {grad.dtype} and shape {tuple(grad.shape)} (float32 or bfloat16 of "
                "the parameter's shape)"
            )
        if target is not None and (
            target.dtype != torch.bfloat16
            or target.numel() != param.numel()
            or not target.is_contiguous()
            or target.device.type != "cpu"
        ):
            raise ValueError(
                f"CPUAdam.step: bf16_out[{position}] must be a contiguous CPU bfloat16 tensor of "
                f"{param.numel()} elements, got {target.dtype} {tuple(target.shape)} on "
                f"{target.device}"
            )

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        target: torch.Tensor | None,
        position: int,
    ) -> None:
        state = self._state_of(param, group, position)
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        if self._kernel is None:
            self._fallback_update(param, grad.float(), state, group)
            if target is not None:
                target.view(-1).copy_(param.view(-1))
            return
        state["step"] += 1
        step = state["step"].item()
        key = step_key(state["rounding_seed"], int(step)) if _stochastic(group) else None
        self._kernel(
            param,
            grad.contiguous(),
            state["exp_avg"],
            state["exp_avg_sq"],
            target,
            beta1=beta1,
            beta2=beta2,
            one_minus_beta1=1.0 - beta1,
            one_minus_beta2=1.0 - beta2,
            eps=eps,
            weight_decay=weight_decay,
            decay=1.0 - lr * weight_decay,
            step_size=lr / (1.0 - beta1**step),
            inv_bias2_sqrt=1.0 / math.sqrt(1.0 - beta2**step),
            adamw=group["adamw"],
            rounding_key=key,
        )

    @staticmethod
    def _fallback_update(
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: dict[str, Any],
    ) -> None:
        """torch's fused Adam(W) CPU kernel on the same state (it increments `step` itself);
        bf16 moments are widened for it and rounded back."""
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        torch_adam_functional(
            [param],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [state["step"]],
            fused=True,
            decoupled_weight_decay=group["adamw"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        if exp_avg.data_ptr() == state["exp_avg"].data_ptr():  # fp32 moments: updated in place
            return
        if _stochastic(group):  # bf16 moments: round back, stochastically as the kernel does
            key = step_key(state["rounding_seed"], int(state["step"].item()))
            state["exp_avg"].copy_(stochastic_round_to_bf16(exp_avg, key, high_half=True))
            state["exp_avg_sq"].copy_(stochastic_round_to_bf16(exp_avg_sq, key, high_half=False))
        else:
            state["exp_avg"].copy_(exp_avg)
            state["exp_avg_sq"].copy_(exp_avg_sq)


_TORCH_ONLY = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
"""Keys of torch's Adam(W) groups that choose a torch kernel (or, the last, the decay: `adamw`)."""


def adam_groups(
    saved: Sequence[dict[str, Any]], current: Sequence[dict[str, Any]], who: str
) -> list[dict[str, Any]]:
    """`saved` param groups (CPUAdam's, NVMeAdam's or torch's Adam/AdamW's) as groups of the
    optimizer whose groups are `current`: torch's `decoupled_weight_decay` becomes `adamw`, the
    kernel choices (`foreach`, `fused`, ...) are dropped, an option `saved` lacks takes the value
    of the current group, and `amsgrad` / `maximize` set to True are refused (not implemented).
    Other keys (an LR scheduler's `initial_lr`) are kept."""
    if len(saved) != len(current):
        raise ValueError(
            f"{who}.load_state_dict: the state dict has {len(saved)} parameter groups, this "
            f"optimizer {len(current)}"
        )
    groups = []
    for index, (theirs, ours) in enumerate(zip(saved, current)):
        refused = [flag for flag in ("amsgrad", "maximize") if theirs.get(flag)]
        if refused:
            raise ValueError(
                f"{who}.load_state_dict: parameter group {index} has {', '.join(refused)}=True, "
                f"which {who} does not implement; load it into torch.optim.Adam(W) instead"
            )
        group = {k: v for k, v in theirs.items() if k not in _TORCH_ONLY + ("amsgrad", "maximize")}
        if "adamw" not in group and "decoupled_weight_decay" in theirs:
            group["adamw"] = bool(theirs["decoupled_weight_decay"])
        for key, value in ours.items():
            if key != "params":
                group.setdefault(key, value)
        groups.append(group)
    return groups


def _stochastic(group: dict[str, Any]) -> bool:
    """The group rounds bf16 moments stochastically (a group saved before the option: no)."""
    return group.get("bf16_moments", False) and group.get("moments_rounding") == "stochastic"
