"""The C++ source of `CPUAdam`'s native kernel (built and loaded by `_cpu_adam_kernel`).

Two C functions: `tessera_cpu_adam`, one fused pass of Adam/AdamW over a parameter, its gradient
and both moments (fp32, or bf16 moments rounded to nearest-even or stochastically), split over
OpenMP threads and vectorised by the compiler; and `tessera_advise_huge_pages`, which asks Linux
for transparent huge pages under a buffer. It includes no torch header: it takes raw pointers
(see `_cpu_adam_kernel` for why, and for the checks made before any pointer reaches it).
"""

__all__ = ["KERNEL_SOURCE"]

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
// A gradient element as float32: float32 as it is, bfloat16 (ZeRO-Offload's partitions in the
// training dtype) widened exactly, in the same pass: 2 bytes read instead of 4, no fp32 copy.
static inline float load_grad(const float* grad, int64_t i) { return grad[i]; }
static inline float load_grad(const uint16_t* grad, int64_t i) { return bf16_to_float(grad[i]); }
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
// Grad: float, or uint16_t for a bfloat16 gradient (widened exactly: the same results).
template <bool kAdamW, bool kCopyOut, typename Moment, bool kStochastic = false,
          typename Grad = float>
static void adam_range(float* __restrict__ param, const Grad* __restrict__ grad,
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
    float g = load_grad(grad, i);
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

extern "C" void tessera_cpu_adam(float* param, const void* grad, void* exp_avg,
                                 void* exp_avg_sq, uint16_t* bf16_out, int64_t n,
                                 float beta1, float beta2, float one_minus_beta1,
                                 float one_minus_beta2, float eps, float weight_decay,
                                 float decay, float step_size, float inv_bias2_sqrt,
                                 int adamw, int bf16_moments, int grad_bf16, int num_threads,
                                 int stochastic_rounding, uint32_t rounding_key) {
  // Chunks of 64 KiB of floats: large enough to stream, small enough to balance threads.
  const int64_t chunk = 16384;
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int threads = num_chunks > 1 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
#define TESSERA_ADAM_RANGE(FUNCTION, MOMENT, GRAD)                                           \
  FUNCTION(param, static_cast<const GRAD*>(grad), static_cast<MOMENT*>(exp_avg),             \
           static_cast<MOMENT*>(exp_avg_sq), bf16_out, begin, end, beta1, beta2,             \
           one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size,            \
           inv_bias2_sqrt, rounding_key)
// A bfloat16 gradient always takes the portable loop (the AVX512_BF16 one reads float32).
#define TESSERA_ADAM_MOMENTS(ADAMW, COPY_OUT)                                                \
  if (grad_bf16 && bf16_moments && stochastic_rounding)                                      \
    TESSERA_ADAM_RANGE((adam_range<ADAMW, COPY_OUT, uint16_t, true, uint16_t>), uint16_t,    \
                       uint16_t);                                                            \
  else if (grad_bf16 && bf16_moments)                                                        \
    TESSERA_ADAM_RANGE((adam_range<ADAMW, COPY_OUT, uint16_t, false, uint16_t>), uint16_t,   \
                       uint16_t);                                                            \
  else if (grad_bf16)                                                                        \
    TESSERA_ADAM_RANGE((adam_range<ADAMW, COPY_OUT, float, false, uint16_t>), float,         \
                       uint16_t);                                                            \
  else if (bf16_moments && stochastic_rounding)                                              \
    TESSERA_ADAM_RANGE((TESSERA_BF16_RANGE(ADAMW, COPY_OUT, true)), uint16_t, float);        \
  else if (bf16_moments)                                                                     \
    TESSERA_ADAM_RANGE((TESSERA_BF16_RANGE(ADAMW, COPY_OUT, false)), uint16_t, float);       \
  else TESSERA_ADAM_RANGE((adam_range<ADAMW, COPY_OUT, float>), float, float)
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
