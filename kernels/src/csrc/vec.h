// Vectors of kWidth floats for the CPU kernels, written with GCC/Clang vector extensions (the
// compiler picks AVX2, AVX-512 or NEON), and the loads, stores and exp they share.
#pragma once

#include "aten.h"

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedllm_vec {

#if defined(__AVX512F__)
constexpr int kWidth = 16;
#else
constexpr int kWidth = 8;
#endif
typedef float vfloat __attribute__((vector_size(kWidth * 4)));
typedef uint32_t vuint __attribute__((vector_size(kWidth * 4)));
typedef int32_t vint __attribute__((vector_size(kWidth * 4)));
typedef uint16_t vhalf __attribute__((vector_size(kWidth * 2)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat load(const c10::BFloat16* p) {
  vhalf bits;
  std::memcpy(&bits, p, sizeof bits);
  vuint wide = __builtin_convertvector(bits, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline vfloat load(const c10::Half* p) {
  float tmp[kWidth];
  for (int i = 0; i < kWidth; ++i) tmp[i] = float(p[i]);
  return load(tmp);
}

// 8-bit floats (the KV cache's fp8_e4m3 and fp8_e5m2) widened exactly: a normal value's
// exponent rebased and its mantissa moved up; a subnormal (exponent field 0) is its mantissa
// times 2^(1 - BIAS - MANT). Never a float32 subnormal, which would cost a microcode assist.
// The formats' NaN and infinity codes are never written (writes saturate) and read as finite.
typedef uint8_t vbyte __attribute__((vector_size(kWidth)));
typedef int8_t vchar __attribute__((vector_size(kWidth)));

// kWidth bytes widened to 32-bit lanes, with the sign (int8) or without (fp8 codes). Written
// with explicit instructions: GCC scalarized the generic byte-vector conversion, which made an
// 8-bit cache read three times slower than a bfloat16 one.
template <bool SIGNED>
inline vint widen_bytes(const void* p) {
  vint out;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i wide = SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  std::memcpy(&out, &wide, sizeof out);
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  const __m256i wide = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  std::memcpy(&out, &wide, sizeof out);
#else
  if constexpr (SIGNED) {
    vchar bytes;
    std::memcpy(&bytes, p, sizeof bytes);
    out = __builtin_convertvector(bytes, vint);
  } else {
    vbyte bytes;
    std::memcpy(&bytes, p, sizeof bytes);
    out = __builtin_convertvector(bytes, vint);
  }
#endif
  return out;
}

template <int MANT, int BIAS>
inline vfloat load_fp8(const void* p) {
  const vint w = widen_bytes<false>(p);
  const vint magnitude = w & 0x7F;
  const vint normal_bits = (magnitude << (23 - MANT)) + ((127 - BIAS) << 23);
  vfloat normal;
  std::memcpy(&normal, &normal_bits, sizeof normal);
  const vfloat subnormal =
      __builtin_convertvector(magnitude, vfloat) * (1.0f / float(1u << (BIAS + MANT - 1)));
  const vfloat v = magnitude < (1 << MANT) ? subnormal : normal;
  vint bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits |= (w & 0x80) << 24;
  vfloat out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline vfloat load(const c10::Float8_e4m3fn* p) { return load_fp8<3, 7>(p); }
inline vfloat load(const c10::Float8_e5m2* p) { return load_fp8<2, 15>(p); }

// int8_per_token_head: a row of the cache is head_dim int8 values, then their float16 scale.
constexpr int64_t kScaleBytes = 2;

inline vfloat load(const int8_t* p) { return __builtin_convertvector(widen_bytes<true>(p), vfloat); }

// The factor a cache row of dim values scales by: its float16 scale for int8 rows, else 1.
template <typename C>
inline float row_scale(const C* row, int64_t dim) {
  if constexpr (std::is_same_v<C, int8_t>) {
    uint16_t bits;
    std::memcpy(&bits, row + dim, sizeof bits);
#if defined(__F16C__)
    return _cvtsh_ss(bits);
#else
    return float(c10::Half(bits, c10::Half::from_bits()));
#endif
  } else {
    return 1.0f;
  }
}

// A row of dim floats as an int8 cache row holds it (kernels/src/reference.py's to_cache): the
// largest magnitude over 127 rounded to float16 is the scale, each value divided by it in
// float32 and rounded to nearest even.
inline void quantize_row(const float* x, int64_t dim, int8_t* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
  const c10::Half scale(amax / 127.0f);
  const float s = float(scale);
  for (int64_t i = 0; i < dim; ++i) {
    const float q = s > 0.f ? std::nearbyint(x[i] / s) : 0.f;
    out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(out + dim, &scale, sizeof scale);
}

// A float as an 8-bit cache holds it: saturated at the format's largest finite value, then
// rounded to nearest even (c10's conversion, which torch's casts use).
template <typename C>
inline C to_cache(float x) {
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>) {
    const float limit = std::is_same_v<C, c10::Float8_e4m3fn> ? 448.0f : 57344.0f;
    return C(x != x ? x : x > limit ? limit : x < -limit ? -limit : x);
  } else {
    return C(x);
  }
}

inline float sum(vfloat v) {
  float s = 0.f;
  for (int i = 0; i < kWidth; ++i) s += v[i];
  return s;
}

inline vfloat splat(float x) { return vfloat{} + x; }

// exp for the softmax (arguments <= 0 there), kWidth at a time: Cephes' expf polynomial.
inline vfloat exp_approx(vfloat x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vfloat n = (x * 1.44269504088896341f + magic) - magic;
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Stores kWidth floats as T; bfloat16 rounds to nearest even as c10::BFloat16 does.
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline void store(c10::BFloat16* p, vfloat v) {
  vuint bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vuint rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const vuint quiet_nan = vuint{} + 0x7FC0u;
  const vuint half = v != v ? quiet_nan : rounded;  // NaN compares unequal to itself
  const vhalf narrow = __builtin_convertvector(half, vhalf);
  std::memcpy(p, &narrow, sizeof narrow);
}

inline void store(c10::Half* p, vfloat v) {
  for (int i = 0; i < kWidth; ++i) p[i] = c10::Half(v[i]);
}

// v rounded to T and back: what an operation computed in float and stored as T leaves.
template <typename T>
inline vfloat round_to(vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[kWidth];
    store(tmp, v);
    return load(tmp);
  }
}

}  // namespace pagedllm_vec
