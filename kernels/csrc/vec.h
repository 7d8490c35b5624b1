// Vectors of kWidth floats for the CPU kernels, written with GCC/Clang vector extensions (the
// compiler picks AVX2, AVX-512 or NEON), and the loads, stores and exp they share.
#pragma once

#include "aten.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

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
