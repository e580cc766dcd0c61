"""tessera.optim.CPUAdam against torch.optim.AdamW / Adam, with a float64 reference.

The kernel is built once per machine into the per-user cache (about 5 s the first time, a load
afterwards); the fallback test builds into a temporary cache with a compiler that fails.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import stat
import warnings

import pytest
import torch
from _tolerance import check_close
from torch import nn

from tessera.optim import CPUAdam, _cpu_adam_kernel, cpu_adam, native_kernel_available

# Sizes: a scalar, odd lengths that leave a vector tail, and one spanning several 16384-element
# chunks so two OpenMP threads split it (chunk boundaries are where an off-by-one would hide).
SHAPES = [(), (7,), (33, 5), (3 * 16384 + 11,)]
HYPER = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
STEPS = 6


def _params(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _grads(seed: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * seed + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _train(optimizer_factory, initial, seed, steps, dtype=torch.float32):
    params = [p.clone().to(dtype).requires_grad_() for p in initial]
    optimizer = optimizer_factory(params)
    for step in range(steps):
        for param, grad in zip(params, _grads(seed, step)):
            param.grad = grad.to(dtype)
        optimizer.step()
    return params, optimizer


def _moments(optimizer, params):
    return {
        f"{name}{i}": optimizer.state[p][name]
        for i, p in enumerate(params)
        for name in ("exp_avg", "exp_avg_sq")
    }


@pytest.fixture(scope="module")
def native():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: only the fallback can run")
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():  # torch.utils.cpp_extension builds with ninja
        pytest.skip("no ninja on this machine (pip install ninja): only the fallback can run")
    assert native_kernel_available(), _cpu_adam_kernel.load_kernel()


@pytest.mark.parametrize("adamw", [True, False])
def test_matches_torch_adam_within_its_own_rounding(native, adamw):
    """CPUAdam == AdamW (adamw=True) / Adam with L2 decay (adamw=False), 6 steps, 4 tensors.

    Tolerance: against a float64 run of torch's own single-tensor Adam(W), CPUAdam may err by at
    most 4x what torch's fused fp32 kernel errs (the suite's FACTOR: the same formula, other
    association of the same fp32 operations) + 16 ulps of the tensor's norm.
    """
    torch_class = torch.optim.AdamW if adamw else torch.optim.Adam
    initial = _params(seed=1)
    ours, ours_opt = _train(lambda ps: CPUAdam(ps, adamw=adamw, **HYPER), initial, 1, STEPS)
    assert ours_opt.uses_native_kernel
    oracle, oracle_opt = _train(lambda ps: torch_class(ps, fused=True, **HYPER), initial, 1, STEPS)
    exact, exact_opt = _train(
        lambda ps: torch_class(ps, foreach=False, **HYPER), initial, 1, STEPS, torch.float64
    )
    check_close(ours, oracle, exact, what=f"params adamw={adamw}")
    check_close(
        _moments(ours_opt, ours),
        _moments(oracle_opt, oracle),
        _moments(exact_opt, exact),
        what=f"moments adamw={adamw}",
    )
    # The acceptance figure (1e-6 relative to torch), in the norm per tensor: the max over
    # elements is a tail statistic of two roundings (see tests/_tolerance.py), the norm is stable.
    for mine, theirs in zip(ours, oracle):
        relative = ((mine - theirs).double().norm() / theirs.double().norm()).item()
        assert relative <= 1e-6, relative
    # A wrong decay mode is far outside the budget: the other torch class must NOT match.
    other = torch.optim.Adam if adamw else torch.optim.AdamW
    wrong, _ = _train(lambda ps: other(ps, fused=True, **HYPER), initial, 1, STEPS)
    with pytest.raises(AssertionError):
        check_close(wrong, oracle, exact)


def test_thread_count_does_not_change_results(native):
    """Every element is updated independently: 1 and 2 threads give bit-identical results."""
    initial = _params(seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _train(lambda ps: CPUAdam(ps, **HYPER), initial, 2, 3)
        torch.set_num_threads(2)
        two, _ = _train(lambda ps: CPUAdam(ps, **HYPER), initial, 2, 3)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_state_dict_resume_is_exact(native):
    """k steps + save + load into a fresh optimizer + k steps == 2k steps straight (torch.equal)."""
    initial, k = _params(seed=3), 3
    straight, straight_opt = _train(lambda ps: CPUAdam(ps, **HYPER), initial, 3, 2 * k)

    first, first_opt = _train(lambda ps: CPUAdam(ps, **HYPER), initial, 3, k)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "optim": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = [p.clone().requires_grad_() for p in saved["params"]]
    resumed_opt = CPUAdam(resumed, lr=1.0, betas=(0.0, 0.0), weight_decay=0.0)  # overwritten
    resumed_opt.load_state_dict(saved["optim"])
    for step in range(k, 2 * k):
        for param, grad in zip(resumed, _grads(3, step)):
            param.grad = grad
        resumed_opt.step()
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)
    mine, theirs = resumed_opt.state_dict(), straight_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for index, state in theirs["state"].items():
        for name, value in state.items():
            assert torch.equal(mine["state"][index][name], value), (index, name)


def test_bf16_copy_out_rounds_to_nearest_even(native):
    """With lr=0 the parameter is unchanged, so bf16_out must equal torch's own conversion,
    on ties (both directions), values that round up into the next binade, subnormals, inf, NaN."""
    values = torch.tensor(
        [
            1.0,
            1.00390625,
            1.01171875,
            1.0 + 2**-8 + 2**-20,
            -3.9999,
            65504.0,
            3.0e38,
            1e-40,
            -0.0,
            float("inf"),
            float("-inf"),
        ]
        + torch.randn(40_000, generator=torch.Generator().manual_seed(6)).tolist()
    )
    param = values.clone().requires_grad_()
    param.grad = torch.randn(values.shape, generator=torch.Generator().manual_seed(7))
    out = torch.empty(values.numel(), dtype=torch.bfloat16)
    CPUAdam([param], lr=0.0, weight_decay=0.0).step(bf16_out=[out])
    assert torch.equal(param.detach(), values)  # (-0.0 - 0 * x may turn into +0.0: equal)
    expected = param.detach().to(torch.bfloat16)  # torch's conversion of the updated value
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))

    nan_param = torch.tensor([float("nan"), 1.0], requires_grad=True)
    nan_param.grad = torch.ones(2)
    nan_out = torch.zeros(2, dtype=torch.bfloat16)
    CPUAdam([nan_param], lr=0.0, weight_decay=0.0).step(bf16_out=[nan_out])
    assert torch.isnan(nan_out[0]) and nan_out[1].item() == 1.0


def test_bf16_copy_out_after_a_real_step(native):
    params = [p.requires_grad_() for p in _params(seed=4)]
    for param, grad in zip(params, _grads(4, 0)):
        param.grad = grad
    outs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params]
    outs[1] = None  # skipped: its parameter is still updated
    before = params[1].detach().clone()
    CPUAdam(params, **HYPER).step(bf16_out=outs)
    assert not torch.equal(params[1].detach(), before)
    for param, out in zip(params, outs):
        if out is not None:
            assert torch.equal(out, param.detach().reshape(-1).to(torch.bfloat16))


@pytest.mark.parametrize("kernel", ["native", "fallback"])
def test_after_each_sees_a_parameter_finished_and_the_next_ones_untouched(request, kernel):
    """`after_each(position)` comes once per stepped parameter, in group order (two groups, a
    parameter without a gradient skipped), when that parameter and its bf16 copy are final and
    the parameters after it have not moved yet: what an upload of it may rely on."""
    if kernel == "native":
        request.getfixturevalue("native")
    params = [p.requires_grad_() for p in _params(seed=5)]
    for param, grad in zip(params, _grads(5, 0)):
        param.grad = grad
    params[2].grad = None
    before = [p.detach().clone() for p in params]
    outs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params]
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
    optimizer = CPUAdam(groups, **HYPER)
    if kernel == "fallback":
        optimizer._kernel = None
    seen: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []

    def after_each(position: int) -> None:
        seen.append((position, [p.detach().clone() for p in params], outs[position].clone()))

    optimizer.step(bf16_out=outs, after_each=after_each)
    assert [position for position, _, _ in seen] == [0, 1, 3]
    for position, values, out in seen:
        assert torch.equal(values[position], params[position].detach())  # final already
        assert not torch.equal(values[position], before[position])
        assert torch.equal(out, params[position].detach().reshape(-1).to(torch.bfloat16))
        for later in range(position + 1, len(params)):
            assert torch.equal(values[later], before[later])  # not stepped yet


def test_bad_input_is_a_clear_error(native):
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        with pytest.raises(TypeError, match=rf"float32 parameters only.*{dtype}"):
            CPUAdam([torch.zeros(3, dtype=dtype, requires_grad=True)])
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdam([torch.zeros(4, 3).t().requires_grad_()])
    param = torch.zeros(5, requires_grad=True)
    param.grad = torch.ones(5)
    optimizer = CPUAdam([param])
    with pytest.raises(ValueError, match=r"bf16_out\[0\] must be .*bfloat16"):
        optimizer.step(bf16_out=[torch.empty(5)])
    with pytest.raises(ValueError, match="1 entries for 1|2 entries for 1"):
        optimizer.step(bf16_out=[None, None])
    param.data = param.data.to(torch.bfloat16)  # changed after construction
    param.grad = torch.ones(5, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"parameter 0 has dtype torch.bfloat16"):
        optimizer.step()
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([param], betas=(1.0, 0.9))


_REPLACED_PARAMETER = """
import torch
from tessera.optim import CPUAdam
from tessera.optim._cpu_adam_kernel import load_kernel
param = torch.zeros(1000, requires_grad=True)
param.grad = torch.ones(1000)
optimizer = CPUAdam([param])
optimizer.step()
assert optimizer.uses_native_kernel
param.data = torch.zeros(4_000_000)  # after its state was made: 4000x the moments' size
param.grad = torch.ones(4_000_000)
try:
    optimizer.step()
except ValueError as error:
    print("refused:", error)
kernel, n = load_kernel(), 40_000
p, g = torch.zeros(n), torch.ones(n)
wrong = {
    "exp_avg too small": (p, g, torch.zeros(n // 2), torch.zeros(n)),
    "moments of two dtypes": (p, g, torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)),
    "strided grad": (p, torch.ones(2 * n)[::2], torch.zeros(n), torch.zeros(n)),
    "fp16 grad": (p, g.half(), torch.zeros(n), torch.zeros(n)),
}
scalars = dict(beta1=0.9, beta2=0.99, one_minus_beta1=0.1, one_minus_beta2=0.01, eps=1e-8,
               weight_decay=0.0, decay=1.0, step_size=0.1, inv_bias2_sqrt=1.0, adamw=True)
for name, args in wrong.items():
    try:
        kernel(*args, None, **scalars)
    except ValueError as error:
        print("kernel refused", name, "|", error)
"""


def test_a_replaced_parameter_or_mismatched_state_is_refused_before_the_native_call(native):
    """Finding 9 of issue 24: `param.data = bigger` after a step gave the kernel moments 4000x
    too small (heap corruption, `free(): invalid next size`, or SIGSEGV). Run in a subprocess:
    on a regression the process crashes instead of failing one assertion."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _REPLACED_PARAMETER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert (
        "refused: CPUAdam: parameter 0 has shape (4000000,) but its state 'exp_avg' has "
        "shape (1000,)" in done.stdout
    ), done.stdout
    for name in ("exp_avg too small", "moments of two dtypes", "strided grad", "fp16 grad"):
        assert f"kernel refused {name} | CPU Adam kernel:" in done.stdout, (name, done.stdout)


def test_strided_moments_from_torch_are_made_contiguous(native):
    """torch's Adam keeps a transposed parameter's moments transposed; loaded into CPUAdam (whose
    parameters are contiguous) they are copied contiguous, not read in the wrong order."""
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(6, 4, generator=generator)
    grads = [torch.randn(6, 4, generator=generator) for _ in range(2)]
    strided = weight.t().contiguous().t().requires_grad_()  # same values, column-major
    torch_opt = torch.optim.AdamW([strided], **HYPER)
    strided.grad = grads[0].t().contiguous().t()
    torch_opt.step()
    assert not torch_opt.state[strided]["exp_avg"].is_contiguous()
    ours = strided.detach().contiguous().requires_grad_()
    cpu = CPUAdam([ours], **HYPER)
    saved = copy.deepcopy(torch_opt.state_dict())  # (state_dict() shares the step tensor)
    cpu.load_state_dict(copy.deepcopy(saved))
    plain = strided.detach().contiguous().requires_grad_()
    plain_opt = CPUAdam([plain], **HYPER)
    saved["state"][0] = {k: v.contiguous() for k, v in saved["state"][0].items()}
    plain_opt.load_state_dict(saved)
    for param, optimizer in ((ours, cpu), (plain, plain_opt)):
        param.grad = grads[1].clone()
        optimizer.step()
    assert torch.equal(ours, plain)


_LOCK_PLANTED = """
import time, warnings
import torch
from tessera.optim import CPUAdam, _cpu_adam_kernel as k
lock = k._cache_dir(k._isa()) / "lock"
lock.parent.mkdir(parents=True)
lock.touch()  # what a process killed while compiling leaves
param = torch.ones(5, requires_grad=True)
param.grad = torch.ones(5)
# What the build imports first (setuptools under it: seconds on a loaded machine), outside the
# timed part: what is timed is each optimizer's construction and step.
from torch.utils import cpp_extension  # noqa: F401
seconds = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        start = time.monotonic()
        optimizer = CPUAdam([param], lr=0.1, weight_decay=0.0)
        optimizer.step()
        seconds.append(time.monotonic() - start)
print("first", seconds[0])
print("second", seconds[1])
print("native", optimizer.uses_native_kernel)
print("warnings", len([w for w in caught if "CPUAdam" in str(w.message)]))
print("message", " ".join(str(w.message) for w in caught))
print("value", param.detach().tolist())
"""


def test_a_stale_build_lock_falls_back_after_a_bounded_wait(tmp_path):
    """Finding 10 of issue 24: a lock file left by a killed build made every CPUAdam(...) hang
    forever in torch's FileBaton.wait. Planted in an empty cache, with a 0.5 s bound: the
    fallback runs, with one warning naming the lock. In a subprocess, so a hang is a timeout."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "TESSERA_CACHE_DIR": str(tmp_path / "cache"),
        "TESSERA_KERNEL_LOCK_TIMEOUT_S": "0.5",
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LOCK_PLANTED], env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("CPUAdam waited for a stale build lock for 60 s")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    # the 0.5 s bound waited once (the first optimizer), not again by the second
    assert float(lines["first"]) >= 0.5, lines
    assert float(lines["second"]) < 0.5, lines
    assert lines["native"] == "False"
    assert lines["warnings"] == "1", lines
    assert "has been held for more than 0.5 s" in lines["message"], lines["message"]
    assert "lock" in lines["message"] and "delete the file" in lines["message"]
    # Two fresh optimizers' first steps of lr 0.1 with gradient 1: 1 - 0.1 - 0.1 (first Adam
    # steps are lr * sign(grad)), the fallback's torch kernel working.
    values = [float(v) for v in lines["value"].strip("[]").split(",")]
    # float32: two rounded steps of ~0.1 and their sum, each within an ulp of 0.8 (2^-24)
    assert all(abs(v - 0.8) <= 4 * torch.finfo(torch.float32).eps for v in values), values
    with pytest.raises(ValueError, match="TESSERA_KERNEL_LOCK_TIMEOUT_S must be a number"):
        os.environ["TESSERA_KERNEL_LOCK_TIMEOUT_S"] = "soon"
        try:
            _cpu_adam_kernel._lock_timeout_s()
        finally:
            del os.environ["TESSERA_KERNEL_LOCK_TIMEOUT_S"]


def _continue(optimizer, params, seed, start, stop):
    for step in range(start, stop):
        for param, grad in zip(params, _grads(seed, step)):
            param.grad = grad.to(param.dtype)
        optimizer.step()
    return params


@pytest.mark.parametrize("adamw", [True, False])
def test_state_dicts_move_between_torch_adam_and_cpu_adam_both_ways(native, adamw):
    """Finding 11 of issue 24: an AdamW state dict loaded into CPUAdam failed at step() with
    KeyError 'bf16_moments'. k steps of one + load into the other + k steps == 2k steps of
    torch's AdamW (Adam), within the rounding budget of a float64 reference. The optimizer
    loading is built with other hyper-parameters (and the other decay mode): the state dict's
    win, as in torch."""
    torch_class = torch.optim.AdamW if adamw else torch.optim.Adam
    initial, k, seed = _params(seed=8), 2, 8
    oracle, _ = _train(lambda ps: torch_class(ps, fused=True, **HYPER), initial, seed, 2 * k)
    exact, _ = _train(
        lambda ps: torch_class(ps, foreach=False, **HYPER), initial, seed, 2 * k, torch.float64
    )
    other = dict(lr=1.0, betas=(0.0, 0.0), eps=1.0, weight_decay=0.0)
    # torch -> CPUAdam
    first, first_opt = _train(lambda ps: torch_class(ps, fused=True, **HYPER), initial, seed, k)
    ours = CPUAdam(first, adamw=not adamw, **other)
    ours.load_state_dict(copy.deepcopy(first_opt.state_dict()))
    assert ours.param_groups[0]["adamw"] is adamw and ours.param_groups[0]["lr"] == HYPER["lr"]
    assert not ours.param_groups[0]["bf16_moments"]
    check_close(_continue(ours, first, seed, k, 2 * k), oracle, exact, what="torch -> CPUAdam")
    # CPUAdam -> torch
    second, second_opt = _train(lambda ps: CPUAdam(ps, adamw=adamw, **HYPER), initial, seed, k)
    theirs = torch_class(second, fused=True, **other)
    theirs.load_state_dict(copy.deepcopy(second_opt.state_dict()))
    check_close(_continue(theirs, second, seed, k, 2 * k), oracle, exact, what="CPUAdam -> torch")
    # And what CPUAdam does not implement is refused by name, not ignored.
    for flag in ("amsgrad", "maximize"):
        flagged = torch_class(first, **HYPER, **{flag: True}).state_dict()
        with pytest.raises(ValueError, match=rf"{flag}=True, which CPUAdam does not implement"):
            CPUAdam(first, **HYPER).load_state_dict(flagged)


@pytest.fixture
def failing_compiler(tmp_path, monkeypatch):
    """A compiler that answers --version but refuses to compile, and an empty build cache."""
    compiler = tmp_path / "broken-c++"
    compiler.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in *.cpp) echo "broken: refusing $a" >&2; exit 1;; '
        "esac; done\n"
        f'exec {shutil.which("g++") or shutil.which("c++") or "false"} "$@"\n'
    )
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_adam, "_warned_fallback", False)
    _cpu_adam_kernel.load_kernel.cache_clear()
    yield
    _cpu_adam_kernel.load_kernel.cache_clear()  # the next test loads the real kernel again


@pytest.mark.parametrize("adamw", [True, False])
def test_failed_build_falls_back_with_one_warning(failing_compiler, adamw):
    torch_class = torch.optim.AdamW if adamw else torch.optim.Adam
    initial = _params(seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, ours_opt = _train(lambda ps: CPUAdam(ps, adamw=adamw, **HYPER), initial, 5, 3)
        again, _ = _train(lambda ps: CPUAdam(ps, adamw=adamw, **HYPER), initial, 5, 3)
    ours_warnings = [w for w in caught if "CPUAdam" in str(w.message)]
    assert len(ours_warnings) == 1, [str(w.message) for w in caught]
    from torch.utils.cpp_extension import is_ninja_available

    if is_ninja_available():  # else the build stops earlier, for want of ninja
        assert "broken: refusing" in str(ours_warnings[0].message)
    assert not ours_opt.uses_native_kernel
    oracle, oracle_opt = _train(lambda ps: torch_class(ps, fused=True, **HYPER), initial, 5, 3)
    for a, b, c in zip(ours, again, oracle):  # the same torch kernel: bit-identical
        assert torch.equal(a, c) and torch.equal(b, c)
    for name, value in _moments(oracle_opt, oracle).items():
        assert torch.equal(_moments(ours_opt, ours)[name], value), name
    state = copy.deepcopy(ours_opt.state_dict())
    assert state["state"][0]["step"].item() == 3.0


TESTED_FLOOR = (2, 11)
"""The oldest torch the suite has been run on (README, "Older torch"): a CUDA 13 image's."""


def test_the_declared_torch_range_starts_at_the_tested_version():
    """Finding 22 of issue 24: pyproject allowed torch>=2.5, but the fallback passes
    `decoupled_weight_decay=` to `torch.optim.adam.adam`, which older torch lacks. The declared
    floor is the oldest version the suite has passed on (issue 30: 2.11, so that a CUDA image's
    torch is kept when tessera installs), at most the version CI pins (constraints.txt)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]  # (no tomllib: Python 3.10 is supported)
    (declared,) = re.findall(r'^\s*"(torch\b[^"]*)"', (root / "pyproject.toml").read_text(), re.M)
    floor = re.fullmatch(r"torch>=(\d+)\.(\d+)(\.\d+)?", declared.replace(" ", ""))
    assert floor, declared
    floor_version = tuple(int(part) for part in floor.groups()[:2])
    assert floor_version == TESTED_FLOOR, declared
    pinned = re.search(r"^torch==(\d+)\.(\d+)", (root / "constraints.txt").read_text(), re.M)
    assert pinned and tuple(int(part) for part in pinned.groups()) >= floor_version, pinned
    installed = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert installed >= floor_version, torch.__version__


# --- ZeRO-Offload: tessera.zero.initialize(..., offload="cpu") -----------------------------------


def _offload_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 11), torch.nn.Linear(11, 3)
    )


def _offload_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(50 + step)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)


OFFLOAD_STEPS, OFFLOAD_HYPER = 3, dict(lr=1e-2, weight_decay=0.1)


def _offload_ranks():
    """Each stage with offload="cpu" (AdamW in, CPUAdam inside) and without (CPUAdam named)."""
    import tessera
    from tessera.zero import full_state_dict, initialize

    ctx = tessera.init()
    torch.set_num_threads(1)
    out = {}
    for stage in (1, 2, 3):
        for mode, optimizer_class in (("cpu", torch.optim.AdamW), (None, CPUAdam)):
            model, optimizer = initialize(
                _offload_model(), optimizer_class, stage=stage, offload=mode, **OFFLOAD_HYPER
            )
            for step in range(OFFLOAD_STEPS):
                x, y = _offload_batch(step)
                rows = slice(4 * ctx.rank, 4 * ctx.rank + 4)  # this rank's half of the batch
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                optimizer.step()
            inner = optimizer.optimizer  # the step each rank runs on its slice
            out[(stage, mode)] = (full_state_dict(model), (type(inner), inner.uses_native_kernel))
    return out


def _offload_oracle(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain single-process AdamW on the whole batch (written here, not through tessera)."""
    model = _offload_model().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **OFFLOAD_HYPER)
    for step in range(OFFLOAD_STEPS):
        x, y = _offload_batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_zero_offload_cpu_equals_no_offload_and_one_process(native, run_ranks):
    results = run_ranks(_offload_ranks, 2)[0]
    oracle, reference = _offload_oracle(torch.float32), _offload_oracle(torch.float64)
    for stage in (1, 2, 3):
        offloaded, inner = results[(stage, "cpu")]
        plain, _ = results[(stage, None)]
        assert inner == (CPUAdam, True), inner
        for name, value in plain.items():  # the same CPUAdam on the same slices: bit-identical
            assert torch.equal(offloaded[name], value), (stage, name)
        # Against one process: two ranks average their half-batch gradients (another reduction
        # order), hence the suite's derived tolerance (tests/_tolerance.py).
        check_close(offloaded, oracle, reference, what=f"stage {stage} offload=cpu")


def test_zero_offload_bad_input():
    from tessera.optim.offload import host_optimizer

    model = _offload_model()
    with pytest.raises(ValueError, match="nvme_dir is required"):  # test_offload.py: the rest
        host_optimizer("nvme", 2, model, torch.optim.AdamW, {})
    with pytest.raises(ValueError, match="offload must be one of"):
        host_optimizer("gpu", 2, model, torch.optim.AdamW, {})
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        host_optimizer("cpu", 0, model, torch.optim.AdamW, {})
    with pytest.raises(ValueError, match="not SGD"):
        host_optimizer("cpu", 1, model, torch.optim.SGD, {"lr": 0.1})
    with pytest.raises(ValueError, match="amsgrad"):
        host_optimizer("cpu", 1, model, torch.optim.AdamW, {"amsgrad": True})
    assert host_optimizer("cpu", 1, model, torch.optim.Adam, {"lr": 0.1, "fused": True}) == (
        CPUAdam,
        {"lr": 0.1, "weight_decay": 0.0, "adamw": False},
    )
    assert host_optimizer(None, 0, model, torch.optim.SGD, {"lr": 1}) == (
        torch.optim.SGD,
        {"lr": 1},
    )


# --- bf16 moments -----------------------------------------------------------------------------


def test_bf16_moments_first_step_is_the_rounded_fp32_moment(native):
    """From zero state, m = (1 - b1) g and v = (1 - b2) g^2 in fp32, then rounded to nearest-even
    bf16: exactly torch's own `.to(torch.bfloat16)` of the same fp32 products."""
    params = [p.requires_grad_() for p in _params(seed=8)]
    grads = _grads(8, 0)
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer = CPUAdam(params, bf16_moments=True, **HYPER)
    optimizer.step()
    beta1, beta2 = HYPER["betas"]
    for param, grad in zip(params, grads):
        state = optimizer.state[param]
        assert state["exp_avg"].dtype == torch.bfloat16 == state["exp_avg_sq"].dtype
        expected_m = (grad * torch.tensor(1 - beta1, dtype=torch.float32)).to(torch.bfloat16)
        expected_v = ((grad * grad) * torch.tensor(1 - beta2, dtype=torch.float32)).to(
            torch.bfloat16
        )
        assert torch.equal(state["exp_avg"], expected_m)
        assert torch.equal(state["exp_avg_sq"], expected_v)


def test_bf16_moments_round_subnormals_and_nans_like_torch(native):
    """Each 16-lane vector holds one special lane: a subnormal second moment (g = 1e-19), a
    subnormal first moment (g = 3e-38), a subnormal parameter copied out, a NaN gradient of
    either sign. Rounding must stay torch's nearest-even, bit for bit, on every other lane and
    the special ones (NaN: any NaN). On CPUs with AVX512_BF16 the kernel rounds in hardware,
    which flushes subnormals to zero: such vectors must take the portable rounding."""
    generator = torch.Generator().manual_seed(12)
    grad = torch.randn(64, generator=generator)
    grad[3], grad[17], grad[40], grad[55] = 1e-19, 3e-38, float("nan"), -float("nan")
    values = torch.randn(64, generator=generator)
    values[29] = 1e-40
    param = values.clone().requires_grad_()
    param.grad = grad
    out = torch.empty(64, dtype=torch.bfloat16)
    hyper = dict(HYPER, lr=0.0, weight_decay=0.0)
    optimizer = CPUAdam([param], bf16_moments=True, **hyper)
    optimizer.step(bf16_out=[out])
    beta1, beta2 = HYPER["betas"]
    state = optimizer.state[param]
    expected = {
        "exp_avg": (grad * torch.tensor(1 - beta1)).to(torch.bfloat16),
        "exp_avg_sq": ((grad * grad) * torch.tensor(1 - beta2)).to(torch.bfloat16),
        "out": param.detach().to(torch.bfloat16),
    }
    assert expected["exp_avg_sq"][3] != 0 and expected["exp_avg"][17] != 0  # really subnormal
    assert expected["out"][29] != 0
    for name, got in (("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])) + (
        ("out", out),
    ):
        want = expected[name]
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), name
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), name


@pytest.mark.parametrize("bf16_moments", [True, False])
@pytest.mark.parametrize("adamw", [True, False])
def test_vector_loop_and_tail_give_the_same_bits(native, adamw, bf16_moments):
    """An element gets the same bits whether a 16-lane vector loop (intrinsics on AVX512_BF16
    CPUs for bf16 moments) or the scalar tail updates it: 48 elements as one tensor against 48
    one-element tensors, 4 steps. (Otherwise results would depend on tensor sizes and chunking:
    NVMeAdam's chunks, a resharded ZeRO partition.)"""
    generator = torch.Generator().manual_seed(13)
    values = torch.randn(48, generator=generator)
    whole = values.clone().requires_grad_()
    singles = [values[i : i + 1].clone().requires_grad_() for i in range(48)]
    kwargs = dict(HYPER, adamw=adamw, bf16_moments=bf16_moments)
    whole_opt, singles_opt = CPUAdam([whole], **kwargs), CPUAdam(singles, **kwargs)
    for _ in range(4):
        grad = torch.randn(48, generator=generator)
        whole.grad = grad.clone()
        for i, param in enumerate(singles):
            param.grad = grad[i : i + 1].clone()
        whole_opt.step()
        singles_opt.step()
    assert torch.equal(whole.detach(), torch.cat([p.detach() for p in singles]))
    for name in ("exp_avg", "exp_avg_sq"):
        joined = torch.cat([singles_opt.state[p][name] for p in singles])
        assert torch.equal(whole_opt.state[whole][name], joined), name


def test_bf16_moments_stay_within_their_rounding_of_fp32(native):
    """6 steps with bf16 moments against fp32 CPUAdam, within a bound derived from bf16 rounding.

    Each stored moment carries a relative rounding error <= 2^-9 (half a bf16 ulp); the running
    averages weigh those errors by beta^k, so m is off by at most 2^-9 / (1 - beta1) = 5 * 2^-9
    relative and v by 2^-9 / (1 - beta2) = 20 * 2^-9, sqrt(v) by half that: an update
    m_hat / sqrt(v_hat) is off by at most 15 * 2^-9 of its size. Its size is at most `c` below
    (Cauchy-Schwarz over the two averages' weights, with bias correction), times lr. Over STEPS
    steps the error per element is <= STEPS * lr * c * 15 * 2^-9; in the norm, x sqrt(numel).
    """
    beta1, beta2 = HYPER["betas"]
    c = max(
        (1 - beta1)
        / (1 - beta2) ** 0.5
        / (1 - beta1**2 / beta2) ** 0.5
        * (1 - beta2**t) ** 0.5
        / (1 - beta1**t)
        for t in range(1, STEPS + 1)
    )
    initial = _params(seed=9)
    ours, _ = _train(lambda ps: CPUAdam(ps, bf16_moments=True, **HYPER), initial, 9, STEPS)
    full, _ = _train(lambda ps: CPUAdam(ps, **HYPER), initial, 9, STEPS)
    for mine, theirs in zip(ours, full):
        bound = STEPS * HYPER["lr"] * c * 15 * 2**-9 * theirs.numel() ** 0.5
        distance = (mine - theirs).double().norm().item()
        assert distance <= bound, (distance, bound)
        assert distance > 0 or theirs.numel() == 1  # the moments really are rounded


def test_bf16_moments_resume_is_exact(native):
    initial, k = _params(seed=10), 2
    factory = lambda ps: CPUAdam(ps, bf16_moments=True, **HYPER)  # noqa: E731
    straight, _ = _train(factory, initial, 10, 2 * k)
    first, first_opt = _train(factory, initial, 10, k)
    resumed = [p.detach().clone().requires_grad_() for p in first]
    resumed_opt = factory(resumed)
    resumed_opt.load_state_dict(copy.deepcopy(first_opt.state_dict()))
    for step in range(k, 2 * k):
        for param, grad in zip(resumed, _grads(10, step)):
            param.grad = grad
        resumed_opt.step()
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)
    assert resumed_opt.state[resumed[0]]["exp_avg"].dtype == torch.bfloat16


# --- memory layout ------------------------------------------------------------------------------


def _huge_page_advised_bytes(tensor: torch.Tensor) -> int:
    """How many of `tensor`'s bytes lie in mappings flagged `hg` (madvise(MADV_HUGEPAGE)) in
    /proc/self/smaps. The flag, not AnonHugePages, so the check does not depend on whether the
    kernel had a free 2 MiB page to give at that moment."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    advised, overlap = 0, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                overlap = max(0, min(high, end) - max(low, begin))
            elif head == "VmFlags:" and "hg" in line.split()[1:]:
                advised += overlap
    return advised


def test_moments_are_advised_onto_huge_pages(native):
    """The moments are advised onto 2 MiB pages before their first touch (the measured 8-13% of
    the benchmark): all their whole 2 MiB pages, i.e. all but less than 4 MiB of head and tail.
    The parameter, allocated plainly by the caller, is the control and must have none."""
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("no transparent huge pages on this system")
    param = torch.zeros(4 << 20, requires_grad=True)  # 16 MiB: several whole huge pages
    param.grad = torch.ones_like(param)
    optimizer = CPUAdam([param], bf16_moments=False)
    optimizer.step()
    assert _huge_page_advised_bytes(param) == 0
    for name in ("exp_avg", "exp_avg_sq"):
        assert _huge_page_advised_bytes(optimizer.state[param][name]) > (16 - 4) << 20, name


# --- bf16 moments, stochastic rounding ----------------------------------------------------------

STOCHASTIC = dict(bf16_moments=True, moments_rounding="stochastic")


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each fp32 `x` in magnitude (float64): truncation of
    the low 16 bits, and that plus one bf16 ulp. Equal when x is a bf16 value."""
    bits = x.view(torch.int32)
    low = (bits & ~0xFFFF).view(torch.float32).double()
    high = ((bits & ~0xFFFF) + 0x10000).view(torch.float32).double()
    exact = (bits & 0xFFFF) == 0
    return low, torch.where(exact, low, high)


def _unbiasedness_values() -> torch.Tensor:
    """fp32 values at chosen fractions of a bf16 ulp (0, 1/8, 0.3, 1/2, 0.7, 0.9), both signs,
    in two binades, so ties, exact values, and either rounding direction are all covered."""
    fractions = torch.tensor([0.0, 0.125, 0.3, 0.5, 0.7, 0.9], dtype=torch.float64)
    values = [
        sign * base * (1 + (3 + fractions) * 2**-7) for base in (1.0, 3e-4) for sign in (1, -1)
    ]
    return torch.cat(values).float()


def _check_unbiased(samples: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """`samples` (count, k) rounded from the fp32 values `exact` (k,): each column's mean must be
    within 6 standard deviations of its value. A stochastically rounded x is low or high (its
    bf16 neighbours) with P(high) = p = (x - low) / ulp, so the mean of `count` independent ones
    has standard deviation ulp * sqrt(p (1 - p) / count) <= ulp / (2 sqrt(count)): with 4096
    samples the bound is 0.047 ulp, where rounding to nearest is off by min(p, 1 - p) ulp (0.3 for
    p = 0.3) and truncation by p ulp. Exact values must come out exactly, every time."""
    low, high = _bf16_neighbours(exact)
    ulp = (high - low).abs()
    count = samples.shape[0]
    samples = samples.double()
    assert torch.all((samples == low) | (samples == high)), f"{what}: not a neighbour"
    bound = 6 * ulp / (2 * count**0.5)
    error = (samples.mean(0) - exact.double()).abs()
    assert torch.all(error <= bound), (what, (error / ulp.clamp_min(1e-300)).tolist())
    assert torch.all(samples[:, ulp == 0] == exact.double()[ulp == 0]), what


def test_stochastic_moments_are_unbiased_over_elements_and_over_steps(native):
    """With betas (0, 0) the moments are exactly g and g*g in fp32 before rounding, so each
    stored moment is a rounding of a known value. Over elements: 4096 copies of each value in one
    step. Over steps: each value in one element, 4096 steps (the key changes with the step)."""
    values, count = _unbiasedness_values(), 4096
    hyper = dict(lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, **STOCHASTIC)
    param = torch.zeros(count * values.numel(), requires_grad=True)
    param.grad = values.repeat(count)
    optimizer = CPUAdam([param], **hyper)
    optimizer.step()
    state = optimizer.state[param]
    squares = values * values  # fp32, as the kernel computes v
    _check_unbiased(state["exp_avg"].view(count, -1), values, "exp_avg over elements")
    _check_unbiased(state["exp_avg_sq"].view(count, -1), squares, "exp_avg_sq over elements")

    small = torch.zeros(values.numel(), requires_grad=True)
    small.grad = values.clone()
    optimizer = CPUAdam([small], **hyper)
    over_steps = {"exp_avg": [], "exp_avg_sq": []}
    for _ in range(count):
        optimizer.step()
        for name, samples in over_steps.items():
            samples.append(optimizer.state[small][name].clone())
    _check_unbiased(torch.stack(over_steps["exp_avg"]), values, "exp_avg over steps")
    _check_unbiased(torch.stack(over_steps["exp_avg_sq"]), squares, "exp_avg_sq over steps")


def test_stochastic_rounding_bits_are_the_documented_hash_on_every_path(native):
    """The kernel's rounded moments (vector loop, tail, chunks split over 1 or 2 threads) are bit
    for bit `stochastic_round_to_bf16` with the parameter's key; the fallback (torch's fused
    kernel, then the torch rounding) stores the same bits; different seeds give other bits."""
    from tessera.optim.stochastic_rounding import step_key, stochastic_round_to_bf16

    grads = _grads(14, 0)
    hyper = dict(lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, **STOCHASTIC)

    def first_step(threads: int, native_kernel: bool, seed: int = 3) -> CPUAdam:
        params = [torch.zeros(g.shape, requires_grad=True) for g in grads]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer = CPUAdam(params, rounding_seed=seed, **hyper)
        if not native_kernel:
            optimizer._kernel = None  # the fallback path, without a failing build
        previous = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            optimizer.step()
        finally:
            torch.set_num_threads(previous)
        return optimizer

    runs = [first_step(1, True), first_step(2, True), first_step(2, False)]
    for run in runs:
        for param, grad in zip(run.param_groups[0]["params"], grads):
            state = run.state[param]
            key = step_key(state["rounding_seed"], 1)
            want_m = stochastic_round_to_bf16(grad, key, high_half=True)
            want_v = stochastic_round_to_bf16(grad * grad, key, high_half=False)
            assert torch.equal(state["exp_avg"].view(torch.int16), want_m.view(torch.int16))
            assert torch.equal(state["exp_avg_sq"].view(torch.int16), want_v.view(torch.int16))
    other = first_step(2, True, seed=4)
    big = other.param_groups[0]["params"][-1]
    assert not torch.equal(
        other.state[big]["exp_avg"], runs[0].state[runs[0].param_groups[0]["params"][-1]]["exp_avg"]
    )


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bf16_moments_runs_and_resumes_are_reproducible(native, rounding):
    """Two runs with the same seed are identical; k steps + state_dict round trip through
    torch.save + k steps == 2k steps straight (params and moments, torch.equal)."""
    initial, k = _params(seed=15), 3
    factory = lambda ps: CPUAdam(ps, bf16_moments=True, moments_rounding=rounding, **HYPER)  # noqa: E731
    straight, straight_opt = _train(factory, initial, 15, 2 * k)
    again, _ = _train(factory, initial, 15, 2 * k)
    first, first_opt = _train(factory, initial, 15, k)
    buffer = io.BytesIO()
    torch.save(first_opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = [p.detach().clone().requires_grad_() for p in first]
    resumed_opt = CPUAdam(resumed, bf16_moments=True)  # nearest, seed 0: overwritten by the load
    resumed_opt.load_state_dict(torch.load(buffer))
    for step in range(k, 2 * k):
        for param, grad in zip(resumed, _grads(15, step)):
            param.grad = grad
        resumed_opt.step()
    for a, b, c in zip(resumed, straight, again):
        assert torch.equal(a, b) and torch.equal(c, b)
    assert _moments(resumed_opt, resumed).keys() == _moments(straight_opt, straight).keys()
    for (name, a), b in zip(
        _moments(resumed_opt, resumed).items(), _moments(straight_opt, straight).values()
    ):
        assert torch.equal(a, b), name
    if rounding == "stochastic":  # and it is really another rounding than nearest
        nearest, _ = _train(lambda ps: CPUAdam(ps, bf16_moments=True, **HYPER), initial, 15, 2 * k)
        assert not torch.equal(nearest[-1], straight[-1])


def test_stochastic_rounding_bad_input(native, tmp_path):
    from tessera.optim.offload import host_optimizer

    param = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="needs bf16_moments=True"):
        CPUAdam([param], moments_rounding="stochastic")
    with pytest.raises(ValueError, match="moments_rounding must be one of"):
        CPUAdam([param], bf16_moments=True, moments_rounding="up")
    model = _offload_model()  # offload="nvme" keeps fp32 moments: no silent drop of the option
    with pytest.raises(ValueError, match="moments_rounding are not supported"):
        options = {"moments_rounding": "stochastic"}
        host_optimizer("nvme", 2, model, CPUAdam, options, nvme_dir=str(tmp_path))
    _, kwargs = host_optimizer(
        "nvme", 2, model, CPUAdam, {"rounding_seed": 3}, nvme_dir=str(tmp_path)
    )
    assert "rounding_seed" not in kwargs


# --- ZeRO-Offload's host buffers on huge pages ---------------------------------------------------


class _WideUnit(nn.Module):
    """One large weight used directly in forward (no nn.Linear) and a small head: a flat of
    16 MiB, shards of 8 MiB on two ranks, several whole 2 MiB pages each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.weight = nn.Parameter(torch.randn(4096, 1024) * 0.02)
        self.head = nn.Linear(4096, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.weight.t()))


def _huge_page_ranks():
    """Per stage: offload="cpu" (huge pages) against the same CPUAdam without offload (4 KiB
    pages), one step; whether parameters and the inner optimizer's state are bit-identical, and
    the advised bytes of every master and gradient slice the step reads, in both runs."""
    import tessera
    from tessera.zero import full_state_dict, initialize

    ctx = tessera.init()
    torch.set_num_threads(1)
    # The oracle runs here, not in pytest's process: its ~200 MB freed there would stay in the
    # allocator's heap and hide later tests' allocations from their RSS probes.
    oracle = (_wide_oracle(torch.float32), _wide_oracle(torch.float64)) if ctx.rank == 0 else None
    out = {}
    for stage in (1, 2, 3):
        runs = {}
        for mode, optimizer_class in (("cpu", torch.optim.AdamW), (None, CPUAdam)):
            model, optimizer = initialize(
                _WideUnit(), optimizer_class, stage=stage, offload=mode, **OFFLOAD_HYPER
            )
            x, y = _wide_batch(ctx.rank)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            advised = [
                (tensor.numel() * 4, _huge_page_advised_bytes(tensor))
                for flat, grad in zip(optimizer.flats, optimizer.gradient_slices())
                for tensor in (flat.master, grad)
            ]
            inner = optimizer.optimizer
            moments = [
                inner.state[flat.master][k]
                for flat in optimizer.flats
                for k in ("exp_avg", "exp_avg_sq")
            ]
            runs[mode] = (full_state_dict(model), moments, advised)
        (params, moments, advised), (plain_params, plain_moments, plain_advised) = runs.values()
        same = all(torch.equal(params[k], plain_params[k]) for k in plain_params) and all(
            torch.equal(a, b) for a, b in zip(moments, plain_moments)
        )
        far = None  # against one process: the suite's derived tolerance (tests/_tolerance.py)
        if oracle is not None:
            try:
                check_close(params, *oracle, what=f"stage {stage} offload=cpu, huge pages")
            except AssertionError as error:
                far = str(error)
        out[stage] = (same, advised, plain_advised, far)
    return out


def _wide_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(70 + rank)
    return torch.randn(4, 1024, generator=generator), torch.randn(4, 3, generator=generator)


def _wide_oracle(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One plain AdamW step on both ranks' batches in one process (equal halves: the mean
    of the two ranks' mean losses is the mean over the whole batch)."""
    model = _WideUnit().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **OFFLOAD_HYPER)
    batches = [_wide_batch(rank) for rank in (0, 1)]
    x, y = (torch.cat(parts).to(dtype) for parts in zip(*batches))
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_zero_offload_cpu_steps_buffers_on_huge_pages_with_unchanged_results(native, run_ranks):
    """offload="cpu" puts the fp32 master and gradient slices CPUAdam streams on huge pages
    (`host_zeros`), as CPUAdam does its moments: parameters and moments stay bit-identical to
    the same CPUAdam on torch-allocated buffers; every 8 MiB+ slice is advised but for less than
    4 MiB of head and tail, and none is without offload (the control); and both equal one plain
    AdamW step in one process (the suite's derived tolerance: another reduction order)."""
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("no transparent huge pages on this system")
    for rank_result in run_ranks(_huge_page_ranks, 2):
        for stage, (same, advised, plain_advised, far) in rank_result.items():
            assert far is None, far
            assert same, f"stage {stage}: results changed with huge pages"
            large = [(size, got) for size, got in advised if size >= 8 << 20]
            assert len(large) >= 2, (stage, advised)  # a master and a gradient slice at least
            for size, got in large:
                assert got > size - (4 << 20), (stage, size, got)
            assert all(got == 0 for _, got in plain_advised), (stage, plain_advised)


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_gradient_steps_as_its_float32_copy(moments, native, monkeypatch):
    """`step(grads=[bf16 tensor])` (ZeRO-Offload's partitions in the training dtype, which
    `.grad` cannot hold for a float32 parameter) equals the step on the float32 copy of the
    same values as `.grad`, bit for bit (widening bf16 is exact): the parameter, both moments
    and the bf16 copy written beside them, over three AdamW steps; with the native kernel
    (which reads the 2-byte values itself) and with torch's kernel it falls back to."""
    if native and not native_kernel_available():
        pytest.skip("no native kernel here (no compiler)")
    if not native:
        monkeypatch.setattr(cpu_adam, "load_kernel", lambda: RuntimeError("planted"))
    generator = torch.Generator().manual_seed(7)
    n = 50_003  # several chunks and a tail
    start = torch.randn(n, generator=generator)
    options = dict(lr=0.01, weight_decay=0.1, bf16_moments=moments == "bf16")
    as_grad, as_keyword = (start.clone().requires_grad_() for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's one warning
        first, second = CPUAdam([as_grad], **options), CPUAdam([as_keyword], **options)
    copies = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
    for _ in range(3):
        low = torch.randn(n, generator=generator).bfloat16()
        as_grad.grad = low.float()
        first.step(bf16_out=[copies[0]])
        second.step(bf16_out=[copies[1]], grads=[low])
        assert as_keyword.grad is None
    assert first.uses_native_kernel is native
    assert torch.equal(as_grad, as_keyword) and torch.equal(copies[0], copies[1])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(first.state[as_grad][key], second.state[as_keyword][key]), key
    for wrong in (torch.ones(n, dtype=torch.float16), torch.ones(n + 1, dtype=torch.bfloat16)):
        with pytest.raises(TypeError, match="float32 or bfloat16 of the parameter's shape"):
            second.step(grads=[wrong])  # refused before any pointer reaches the kernel
    with pytest.raises(ValueError, match="grads has 2 entries for 1 parameters"):
        second.step(grads=[low, low])
    assert torch.equal(as_grad, as_keyword)  # nothing was stepped by the refused calls
