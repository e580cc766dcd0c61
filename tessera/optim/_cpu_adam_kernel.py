"""The native half of `CPUAdam`: one C++ loop, compiled on first use, called through ctypes.

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

__all__ = [
    "KERNEL_SOURCE", "LOCK_TIMEOUT_S", "AdamKernel", "check_inputs", "load_kernel",
    "wait_for_build_lock",
]  # fmt: skip

KERNEL_SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif

// bfloat16 <-> float32 by bits: bf16 is the top half of an fp32; rounding to nearest-even.
static inline float bf16_to_float(uint16_t value) {
  const uint32_t bits = uint32_t(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}
static inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (value != value) ? uint16_t(0x7FC0u) : uint16_t(rounded);  // keep NaN a NaN
}
static inline float load_moment(const float* moments, int64_t i) { return moments[i]; }
static inline float load_moment(const uint16_t* moments, int64_t i) {
  return bf16_to_float(moments[i]);
}
static inline void store_moment(float* moments, int64_t i, float value) { moments[i] = value; }
static inline void store_moment(uint16_t* moments, int64_t i, float value) {
  moments[i] = float_to_bf16(value);
}

// Stochastic rounding of the bf16 moments (Zamirai et al. 2020, "Revisiting BFloat16 Training"):
// add 16 uniformly random bits to the 16 bits that bf16 drops, then truncate. The value rounds up
// with probability (dropped bits) / 2^16, i.e. its distance to the lower bf16 neighbour over the
// ulp, so the rounded moment is unbiased: small updates to a large moment (1 - beta2 = 0.001 of
// it, far below half an ulp = 2^-9) survive on average instead of always rounding away.
// The bits come from a counter-based hash of (key, element index), with key = f(seed, step)
// from the caller: deterministic whatever the threads or chunking, nothing to store but the seed.
// Hash: lowbias32 (Wellons' hash prospector), over the index spread by the golden ratio and
// xored with the key. The high 16 bits go to exp_avg, the low 16 to exp_avg_sq.
static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
static inline uint32_t rounding_bits(uint32_t key, int64_t i) {
  return mix32((uint32_t(i) * 0x9E3779B9u) ^ key);
}
// Tensors of 2^32 elements and more: the index's high half goes into the key of the range (a
// range lies inside one 16384-element chunk, so never across a multiple of 2^32).
static inline uint32_t range_key(uint32_t key, int64_t begin) {
  return key ^ (uint32_t(uint64_t(begin) >> 32) * 0x85EBCA77u);
}
static inline uint16_t float_to_bf16_stochastic(float value, uint32_t random16) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  // No carry into the sign: the largest finite float plus 0xFFFF becomes inf's bits at most.
  const uint32_t rounded = (bits + random16) >> 16;
  return (value != value) ? uint16_t(0x7FC0u) : uint16_t(rounded);  // keep NaN a NaN
}

// Which products are fused into an add is spelled out, not left to the compiler's contraction:
// the AVX512_BF16 loop below is written with intrinsics, and an element must get the same bits
// whichever loop (or loop tail) updates it. Without hardware FMA, plain multiply and add.
#if defined(FP_FAST_FMAF)
#define TESSERA_FMA(a, b, c) std::fma((a), (b), (c))
#else
#define TESSERA_FMA(a, b, c) ((a) * (b) + (c))
#endif

// One Adam(W) step over n contiguous float32 elements, in one pass over memory.
// step_size = lr / (1 - beta1^t), inv_bias2_sqrt = 1 / sqrt(1 - beta2^t) and 1 - beta come from
// the caller, computed in double and rounded once: 1.0f - float(0.999) would be 1.3e-5 off
// 0.001 relative, a bias that compounds in the second moment. adamw != 0: decoupled decay
// p *= decay (decay = 1 - lr*wd, Loshchilov & Hutter 2019); adamw == 0: L2 decay g += wd * p
// (Kingma & Ba's Adam + L2). Moment is float, or uint16_t for moments stored as bfloat16
// (arithmetic stays fp32; 20 instead of 28 bytes move per parameter).
// bf16_out, when not null, receives the updated parameter rounded to nearest-even bfloat16.
// kStochastic (bf16 moments only): the moments are rounded stochastically with rounding_key.
template <bool kAdamW, bool kCopyOut, typename Moment, bool kStochastic = false>
static void adam_range(float* __restrict__ param, const float* __restrict__ grad,
                       Moment* __restrict__ exp_avg, Moment* __restrict__ exp_avg_sq,
                       uint16_t* __restrict__ bf16_out, int64_t begin, int64_t end,
                       float beta1, float beta2, float one_minus_beta1, float one_minus_beta2,
                       float eps, float weight_decay, float decay, float step_size,
                       float inv_bias2_sqrt, uint32_t rounding_key) {
  const uint32_t key = range_key(rounding_key, begin);
  (void)key;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float g = grad[i];
    if (kAdamW) {
      p = p * decay;
    } else {
      g = TESSERA_FMA(weight_decay, p, g);
    }
    const float m = TESSERA_FMA(beta1, load_moment(exp_avg, i), one_minus_beta1 * g);
    const float v = TESSERA_FMA(beta2, load_moment(exp_avg_sq, i), one_minus_beta2 * (g * g));
    const float denom = TESSERA_FMA(std::sqrt(v), inv_bias2_sqrt, eps);
    p = TESSERA_FMA(-step_size, m / denom, p);
    if constexpr (kStochastic) {
      const uint32_t random = rounding_bits(key, i);
      exp_avg[i] = float_to_bf16_stochastic(m, random >> 16);
      exp_avg_sq[i] = float_to_bf16_stochastic(v, random & 0xFFFFu);
    } else {
      store_moment(exp_avg, i, m);
      store_moment(exp_avg_sq, i, v);
    }
    param[i] = p;
    if (kCopyOut) bf16_out[i] = float_to_bf16(p);
  }
}

// bf16 moments on AVX-512 with GCC: the same loop with 512-bit vectors. There the widening and
// rounding of the moments add about 20 integer ops per vector, and 512 bits halve their count:
// measured here (Nov 2026, in cache, 1 thread) 2.45 instead of 2.0 Gparam/s, where the fp32 loop
// is faster at 256 bits (2.7 against 2.35); at the memory bound the compute headroom is what a
// loaded core lacks. noinline: inlined into its caller, the loop would take the caller's width.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define TESSERA_RANGE_PARAMS                                                                    \
  float *__restrict__ param, const float *__restrict__ grad, uint16_t *__restrict__ exp_avg,    \
      uint16_t *__restrict__ exp_avg_sq, uint16_t *__restrict__ bf16_out, int64_t begin,        \
      int64_t end, float beta1, float beta2, float one_minus_beta1, float one_minus_beta2,      \
      float eps, float weight_decay, float decay, float step_size, float inv_bias2_sqrt,       \
      uint32_t rounding_key
#define TESSERA_RANGE_ARGS                                                                      \
  param, grad, exp_avg, exp_avg_sq, bf16_out, begin, end, beta1, beta2, one_minus_beta1,        \
      one_minus_beta2, eps, weight_decay, decay, step_size, inv_bias2_sqrt, rounding_key

// CPUs with AVX512_BF16 (Zen 4, Sapphire Rapids) round fp32 to bf16 in one instruction, where
// the portable rounding takes about six integer ops per vector: measured here (Nov 2026, 50M, 2
// threads, all arrays on huge pages) 84.8 instead of 78.5 GB/s, the bandwidth of a copy with
// the same traffic being 92. The instruction flushes subnormals to zero and keeps a NaN's
// payload, so a vector holding either goes through float_to_bf16 instead: bit for bit the same
// results on every CPU.
__attribute__((target("avx512bf16"))) static inline __m256i round_to_bf16(__m512 values) {
  const int kNanOrSubnormal = 0x01 | 0x20 | 0x80;  // vfpclassps: quiet NaN, subnormal, signalling
  if (_mm512_fpclass_ps_mask(values, kNanOrSubnormal) == 0) {
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values));
  }
  alignas(64) float lanes[16];
  alignas(32) uint16_t rounded[16];
  _mm512_store_ps(lanes, values);
  for (int lane = 0; lane < 16; ++lane) rounded[lane] = float_to_bf16(lanes[lane]);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(rounded));
}
__attribute__((target("avx512bf16"))) static inline __m512 widen_bf16(const uint16_t* source) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
// rounding_bits and float_to_bf16_stochastic for 16 lanes (the same bits as the scalar ones).
static inline __m512i rounding_bits16(__m512i key, __m512i index) {
  __m512i x = _mm512_xor_si512(_mm512_mullo_epi32(index, _mm512_set1_epi32(0x9E3779B9u)), key);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352Du));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x846CA68Bu));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
static inline __m256i round_to_bf16_stochastic(__m512 values, __m512i random16) {
  const __m512i sum = _mm512_add_epi32(_mm512_castps_si512(values), random16);
  const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  const __m512i rounded =
      _mm512_mask_mov_epi32(_mm512_srli_epi32(sum, 16), nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}
// The adam_range loop written with 16-lane intrinsics, the same operations and the same FMAs
// (bit-identical results), the tail left to adam_range.
template <bool kAdamW, bool kCopyOut, bool kStochastic>
__attribute__((noinline, target("avx512bf16"))) static void adam_range_bf16_instructions(
    TESSERA_RANGE_PARAMS) {
  const __m512i vkey = _mm512_set1_epi32(int(range_key(rounding_key, begin)));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  const __m512 vbeta1 = _mm512_set1_ps(beta1), vbeta2 = _mm512_set1_ps(beta2);
  const __m512 vone_minus_beta1 = _mm512_set1_ps(one_minus_beta1);
  const __m512 vone_minus_beta2 = _mm512_set1_ps(one_minus_beta2);
  const __m512 veps = _mm512_set1_ps(eps), vweight_decay = _mm512_set1_ps(weight_decay);
  const __m512 vdecay = _mm512_set1_ps(decay), vstep_size = _mm512_set1_ps(step_size);
  const __m512 vinv_bias2_sqrt = _mm512_set1_ps(inv_bias2_sqrt);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 p = _mm512_loadu_ps(param + i);
    __m512 g = _mm512_loadu_ps(grad + i);
    if (kAdamW) {
      p = _mm512_mul_ps(p, vdecay);
    } else {
      g = _mm512_fmadd_ps(vweight_decay, p, g);
    }
    const __m512 m =
        _mm512_fmadd_ps(vbeta1, widen_bf16(exp_avg + i), _mm512_mul_ps(vone_minus_beta1, g));
    const __m512 v = _mm512_fmadd_ps(vbeta2, widen_bf16(exp_avg_sq + i),
                                     _mm512_mul_ps(vone_minus_beta2, _mm512_mul_ps(g, g)));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), vinv_bias2_sqrt, veps);
    p = _mm512_fnmadd_ps(vstep_size, _mm512_div_ps(m, denom), p);
    if (kStochastic) {
      const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(i))), lanes);
      const __m512i random = rounding_bits16(vkey, index);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(exp_avg + i),
                          round_to_bf16_stochastic(m, _mm512_srli_epi32(random, 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(exp_avg_sq + i),
                          round_to_bf16_stochastic(v, _mm512_and_si512(random, low16)));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(exp_avg + i), round_to_bf16(m));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(exp_avg_sq + i), round_to_bf16(v));
    }
    _mm512_storeu_ps(param + i, p);
    if (kCopyOut) _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf16_out + i), round_to_bf16(p));
  }
  begin = i;
  adam_range<kAdamW, kCopyOut, uint16_t, kStochastic>(TESSERA_RANGE_ARGS);
}
static bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
}

#pragma GCC push_options
#pragma GCC target("prefer-vector-width=512")
template <bool kAdamW, bool kCopyOut, bool kStochastic>
__attribute__((noinline)) static void adam_range_bf16_moments(TESSERA_RANGE_PARAMS) {
  if (cpu_has_avx512_bf16()) {
    adam_range_bf16_instructions<kAdamW, kCopyOut, kStochastic>(TESSERA_RANGE_ARGS);
  } else {
    adam_range<kAdamW, kCopyOut, uint16_t, kStochastic>(TESSERA_RANGE_ARGS);
  }
}
#pragma GCC pop_options
#undef TESSERA_RANGE_PARAMS
#undef TESSERA_RANGE_ARGS
#define TESSERA_BF16_RANGE(ADAMW, COPY_OUT, STOCHASTIC) \
  adam_range_bf16_moments<ADAMW, COPY_OUT, STOCHASTIC>
#else
#define TESSERA_BF16_RANGE(ADAMW, COPY_OUT, STOCHASTIC) \
  adam_range<ADAMW, COPY_OUT, uint16_t, STOCHASTIC>
#endif

extern "C" void tessera_cpu_adam(float* param, const float* grad, void* exp_avg,
                                 void* exp_avg_sq, uint16_t* bf16_out, int64_t n,
                                 float beta1, float beta2, float one_minus_beta1,
                                 float one_minus_beta2, float eps, float weight_decay,
                                 float decay, float step_size, float inv_bias2_sqrt,
                                 int adamw, int bf16_moments, int num_threads,
                                 int stochastic_rounding, uint32_t rounding_key) {
  // Chunks of 64 KiB of floats: large enough to stream, small enough to balance threads.
  const int64_t chunk = 16384;
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int threads = num_chunks > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
#define TESSERA_ADAM_RANGE(FUNCTION, MOMENT)                                                 \
  FUNCTION(param, grad, static_cast<MOMENT*>(exp_avg), static_cast<MOMENT*>(exp_avg_sq),     \
           bf16_out, begin, end, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,        \
           weight_decay, decay, step_size, inv_bias2_sqrt, rounding_key)
#define TESSERA_ADAM_MOMENTS(ADAMW, COPY_OUT)                                                \
  if (bf16_moments && stochastic_rounding)                                                   \
    TESSERA_ADAM_RANGE((TESSERA_BF16_RANGE(ADAMW, COPY_OUT, true)), uint16_t);               \
  else if (bf16_moments)                                                                     \
    TESSERA_ADAM_RANGE((TESSERA_BF16_RANGE(ADAMW, COPY_OUT, false)), uint16_t);              \
  else TESSERA_ADAM_RANGE((adam_range<ADAMW, COPY_OUT, float>), float)
    if (adamw && bf16_out) { TESSERA_ADAM_MOMENTS(true, true); }
    else if (adamw) { TESSERA_ADAM_MOMENTS(true, false); }
    else if (bf16_out) { TESSERA_ADAM_MOMENTS(false, true); }
    else { TESSERA_ADAM_MOMENTS(false, false); }
#undef TESSERA_ADAM_MOMENTS
#undef TESSERA_ADAM_RANGE
  }
}
#undef TESSERA_BF16_RANGE
#undef TESSERA_FMA

// Ask Linux to back [ptr, ptr + bytes) with 2 MiB transparent huge pages (the whole 2 MiB pages
// inside it), before its first touch. Returns 0 when advised, -1 when not (other OS, madvise
// refused, or no whole huge page inside): advice only, the memory works the same either way.
extern "C" int tessera_advise_huge_pages(void* ptr, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = uintptr_t(1) << 21;
  const uintptr_t begin = (uintptr_t(ptr) + huge - 1) & ~(huge - 1);
  const uintptr_t end = (uintptr_t(ptr) + uintptr_t(bytes)) & ~(huge - 1);
  if (end <= begin) return -1;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0 ? 0 : -1;
#else
  (void)ptr;
  (void)bytes;
  return -1;
#endif
}
"""

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
            + [ctypes.c_int] * 4
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
        layout there corrupts the heap instead of raising."""
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
    `param.numel()` elements, `param` and `grad` float32, both moments float32 or both bfloat16,
    `bf16_out` (if any) bfloat16. The kernel writes `numel` elements through each pointer."""
    numel = param.numel()
    moments = exp_avg.dtype
    expected = {
        "param": (param, (torch.float32,)),
        "grad": (grad, (torch.float32,)),
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
