"""The native half of `CPUAdam`: one C++ loop, compiled on first use, called through ctypes.

The loop's source is `KERNEL_SOURCE` (`_cpu_adam_source`); this module builds, loads and calls it.

Why this shape. An Adam step reads the parameter, gradient and both moments and writes three of
them back: 28 bytes per fp32 parameter, about 1 flop per byte, so on a CPU it is bound by memory
bandwidth, not arithmetic. The fast version therefore makes ONE pass over memory (torch's
`foreach` path makes about ten, one per elementwise op) with wide vector loads and all cores:
ZeRO-Offload's CPU Adam (Ren et al., USENIX ATC 2021) does the same with hand-written AVX
intrinsics. Here the loop is plain C++ that g++ vectorises itself (`-O3` with the widest ISA this
CPU and torch agree on: AVX-512 or AVX2 + FMA), split over threads with OpenMP, so the source stays
short and portable and a machine without AVX still builds a correct (slower) kernel. On
AVX-512 CPUs it uses 256-bit vectors (see `_ISA_FLAGS` for the measurement).

The source includes no torch header: it takes raw pointers, so it compiles in about a second
(a `torch/extension.h` module takes a minute on a loaded machine) and nothing depends on torch's
C++ ABI. `torch.utils.cpp_extension.load` still does the building (ninja, versioning, a file lock
so ranks that start together build once) into a per-user cache, keyed by ISA so a home directory
shared between different machines never loads a kernel with instructions the CPU lacks.

Any failure to build or load (no compiler, no ninja, a read-only cache) returns None: `CPUAdam`
then runs torch's fused AdamW kernel instead and warns once. That includes a build lock held too
long: torch's lock (`lock` in the build folder) is a plain file that a process killed while
compiling leaves behind, and torch waits for it to go away forever. So the lock is waited for
here first, at most `TESSERA_KERNEL_LOCK_TIMEOUT_S` seconds (default `LOCK_TIMEOUT_S`); then
the fallback runs and its warning names the file to delete. (Between that wait and torch's own
check another process may take the lock; if that one is killed too, torch waits again: only a
second crash within the same second hangs.)
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from tessera.optim._cpu_adam_source import KERNEL_SOURCE

__all__ = [
    "KERNEL_SOURCE", "LOCK_TIMEOUT_S", "AdamKernel", "check_inputs", "load_kernel",
    "wait_for_build_lock",
]  # fmt: skip

# AVX-512 instructions, but 256-bit vectors: measured here (Nov 2026, 50M parameters, 1 thread)
# the 512-bit build ran at 0.95 Gparam/s and the 256-bit one at 1.16 (torch fused: 1.17); the
# 512-bit divide and square root cost more than the wider loads save in a memory-bound loop.
# -fno-math-errno lets sqrt vectorise (errno is a side effect); no -ffast-math: it would let the
# compiler reassociate and use approximate reciprocals, changing results beyond fp32 rounding.
_BASE_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-std=c++17"]
_ISA_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-mprefer-vector-width=256",
    ],
    "AVX2": ["-mavx2", "-mfma"],
}


LOCK_TIMEOUT_S = 300.0
"""Default bound on the wait for another process's kernel build (its lock file); a build takes
seconds, so a lock held this long is most likely a killed build's."""


def _lock_timeout_s() -> float:
    """`TESSERA_KERNEL_LOCK_TIMEOUT_S` if set (a number >= 0), else `LOCK_TIMEOUT_S`."""
    text = os.environ.get("TESSERA_KERNEL_LOCK_TIMEOUT_S")
    if text is None:
        return LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0.0:
        raise ValueError(f"TESSERA_KERNEL_LOCK_TIMEOUT_S must be a number >= 0, got {text!r}")
    return value


def wait_for_build_lock(lock: Path, timeout_s: float) -> None:
    """Return once `lock` (torch's build lock) does not exist; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while lock.exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the kernel build lock {lock} has been held for more than {timeout_s:g} s "
                "(TESSERA_KERNEL_LOCK_TIMEOUT_S); if no build is running, a killed one left it: "
                "delete the file"
            )
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _isa() -> str:
    """The widest vector ISA both this CPU and torch's own kernels use ("AVX512", "AVX2", ...)."""
    return torch.backends.cpu.get_cpu_capability().upper()


def _cache_dir(isa: str) -> Path:
    """Per-user build cache: $TESSERA_CACHE_DIR, else $XDG_CACHE_HOME/tessera, else ~/.cache."""
    root = os.environ.get("TESSERA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "tessera"
    )
    torch_version = torch.__version__.replace("+", "_")
    return Path(root) / "cpu_adam" / f"{isa.lower()}-torch{torch_version}"


class AdamKernel:
    """The loaded C function with its argument types declared (ctypes releases the GIL)."""

    def __init__(self, library_path: str, isa: str) -> None:
        self.isa = isa
        self.library_path = library_path
        function = ctypes.CDLL(library_path).tessera_cpu_adam
        function.restype = None
        function.argtypes = (
            [ctypes.c_void_p] * 5
            + [ctypes.c_int64]
            + [ctypes.c_float] * 9
            + [ctypes.c_int] * 5
            + [ctypes.c_uint32]
        )
        self._function = function
        advise = ctypes.CDLL(library_path).tessera_advise_huge_pages
        advise.restype = ctypes.c_int
        advise.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self._advise_huge_pages = advise

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Zeros of `shape`, on transparent huge pages where Linux grants them.

        Why: the step streams 7 arrays; with 4 KiB pages the hardware prefetchers stop at every
        page boundary and the TLB misses every 4 KiB of each stream. Measured here (Nov 2026, 50M
        parameters, interleaved): the same step with the two moments on 2 MiB pages ran 8-13%
        faster than on 4 KiB pages. The advice must come before the first touch, so the tensor
        is allocated empty (untouched), advised, then zeroed. Small tensors (< 4 MiB) hold no
        whole huge page worth the split of the mapping and are left alone.
        """
        tensor = torch.empty(tuple(shape), dtype=dtype)
        num_bytes = tensor.numel() * tensor.element_size()
        if num_bytes >= 4 << 20:
            self._advise_huge_pages(tensor.data_ptr(), num_bytes)
        return tensor.zero_()

    def __call__(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        bf16_out: torch.Tensor | None,
        *,
        beta1: float,
        beta2: float,
        one_minus_beta1: float,
        one_minus_beta2: float,
        eps: float,
        weight_decay: float,
        decay: float,
        step_size: float,
        inv_bias2_sqrt: float,
        adamw: bool,
        rounding_key: int | None = None,
    ) -> None:
        """Update `param`, `exp_avg`, `exp_avg_sq` in place (contiguous, same numel; the moments
        both float32 or both bfloat16). `rounding_key` (a uint32, bf16 moments only): round the
        moments stochastically with the bits of this key; None: to nearest-even.

        Every tensor is checked first (`check_inputs`): C gets raw pointers, and a wrong size or
        layout there corrupts the heap instead of raising.

        Why so many parameters: they are the C function's own, one by one (keywords here), so
        that the call below is checked against its signature by name; `CPUAdam` makes the only
        call."""
        check_inputs(param, grad, exp_avg, exp_avg_sq, bf16_out)
        self._function(
            param.data_ptr(),
            grad.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            bf16_out.data_ptr() if bf16_out is not None else None,
            param.numel(),
            beta1,
            beta2,
            one_minus_beta1,
            one_minus_beta2,
            eps,
            weight_decay,
            decay,
            step_size,
            inv_bias2_sqrt,
            int(adamw),
            int(exp_avg.dtype == torch.bfloat16),
            int(grad.dtype == torch.bfloat16),
            torch.get_num_threads(),
            int(rounding_key is not None),
            rounding_key or 0,
        )


def check_inputs(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    bf16_out: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the kernel may touch these tensors: all contiguous CPU tensors of
    `param.numel()` elements, `param` float32, `grad` float32 or bfloat16 (widened as it is
    read), both moments float32 or both bfloat16,
    `bf16_out` (if any) bfloat16. The kernel writes `numel` elements through each pointer."""
    numel = param.numel()
    moments = exp_avg.dtype
    expected = {
        "param": (param, (torch.float32,)),
        "grad": (grad, (torch.float32, torch.bfloat16)),
        "exp_avg": (exp_avg, (torch.float32, torch.bfloat16)),
        "exp_avg_sq": (exp_avg_sq, (moments,)),
    }
    if bf16_out is not None:
        expected["bf16_out"] = (bf16_out, (torch.bfloat16,))
    for name, (tensor, dtypes) in expected.items():
        if (
            tensor.numel() != numel
            or tensor.dtype not in dtypes
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
        ):
            raise ValueError(
                f"CPU Adam kernel: {name} must be a contiguous CPU tensor of {numel} elements "
                f"(the parameter's) and dtype {' or '.join(map(str, dtypes))}; got "
                f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
                f"{'' if tensor.is_contiguous() else ', not contiguous'}"
            )


@functools.cache
def load_kernel() -> AdamKernel | Exception:
    """Build (first time) and load the kernel; the exception instead if that fails.

    Cached per process, so a failing build is tried, and reported, once.
    """
    try:
        from torch.utils import cpp_extension

        isa = _isa()
        build_dir = _cache_dir(isa)
        build_dir.mkdir(parents=True, exist_ok=True)
        source = build_dir / "tessera_cpu_adam.cpp"
        if not source.exists() or source.read_text() != KERNEL_SOURCE:
            # Write atomically: another rank may be reading (and hashing) the file right now.
            with tempfile.NamedTemporaryFile("w", dir=build_dir, delete=False, suffix=".tmp") as f:
                f.write(KERNEL_SOURCE)
            os.replace(f.name, source)
        wait_for_build_lock(build_dir / "lock", _lock_timeout_s())  # torch's would never end
        with warnings.catch_warnings():  # its compiler-ABI notes: CPUAdam warns once itself
            warnings.simplefilter("ignore")
            library_path = cpp_extension.load(
                name=f"tessera_cpu_adam_{isa.lower()}",
                sources=[str(source)],
                extra_cflags=_BASE_FLAGS + _ISA_FLAGS.get(isa, []),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        return AdamKernel(str(library_path), isa)
    except Exception as error:  # noqa: BLE001 - any build/load failure means "use the fallback"
        return error
