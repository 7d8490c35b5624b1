// Weight-only quantized matmuls for the CPU: ``out = x @ W.T`` with W kept in quantized groups
// and de-quantized in registers, a few output features and input rows at a time, so that a
// weight byte is read from memory once per call whatever the batch. At decode batches a matmul
// is bound by the bytes of its weight, which is what keeping them quantized saves (llama.cpp's
// idea, over the group layouts of pagedllm/models/quantized.py).
//
// W[n, k] = scale[n, k / G] * q[n, k] + min[n, k / G] (no min: 0), q read from
//   bits 8: int8 [N, K], one value a byte;
//   bits 4: uint8 [N, K / 2], a group of 32 values in 16 bytes, byte i holding value i in its
//           low nibble and value i + 16 in its high one (GGUF's Q4_0 and Q4_1 order).
// scale and min are float16 [N, K / G]; G is 16 or 32 (32 for bits 4).
// The products are summed in float32; x is float32 or, on the VNNI path, bfloat16 as well (the
// op converts other dtypes, and the output back to x's).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using namespace pagedllm_vec;

// kWidth bytes from p widened to 32-bit lanes (zero- or sign-extended), as floats after
// ``(lane >> shift) & mask``. x86 has single instructions for the widening, which the generic
// vector code below does not reach (GCC scalarizes it).
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline vfloat from_bytes(const uint8_t* p, int shift) {
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vfloat)_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(wide, shift),
                                                      _mm512_set1_epi32(15)));
}
inline vfloat from_signed_bytes(const uint8_t* p) {
  return (vfloat)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__)
inline vfloat from_bytes(const uint8_t* p, int shift) {
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (vfloat)_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(wide, shift),
                                                      _mm256_set1_epi32(15)));
}
inline vfloat from_signed_bytes(const uint8_t* p) {
  return (vfloat)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
typedef uint8_t vbyte __attribute__((vector_size(kWidth)));
typedef int8_t vsbyte __attribute__((vector_size(kWidth)));
inline vfloat from_bytes(const uint8_t* p, int shift) {
  vbyte bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  const vuint wide = __builtin_convertvector(bytes, vuint);
  return __builtin_convertvector((wide >> shift) & 15u, vfloat);
}
inline vfloat from_signed_bytes(const uint8_t* p) {
  vsbyte bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(__builtin_convertvector(bytes, vint), vfloat);
}
#endif

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return float(h);
#endif
}

struct Weight {
  const uint8_t* q;
  const at::Half* scale;
  const at::Half* min;  // null: no minimums
  int64_t q_row;        // bytes per output feature
  int64_t groups;       // groups per output feature
  int group;
};

// Output rows per tile (x rows sharing each de-quantized weight vector) and output features
// per tile; acc is MT x NT vectors, which the register file holds.
constexpr int kTileRows = kWidth == 16 ? 4 : 2;
constexpr int kTileCols = 4;

// out[m, n] for MT rows from x and NT features from n0; HAS_MIN picks the affine form.
template <int BITS, int MT, int NT, bool HAS_MIN>
void tile(const float* x, int64_t x_stride, const Weight& w, int64_t n0, int64_t K, float* out,
          int64_t out_stride) {
  vfloat acc[MT][NT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) acc[i][j] = vfloat{};

  // One de-quantized vector of each feature, multiplied into every row at x offset k.
  auto accumulate = [&](const vfloat (&wv)[NT], int64_t k) {
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const vfloat xv = load(x + i * x_stride + k);
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) acc[i][j] += wv[j] * xv;
    }
  };

  const int G = w.group;
  for (int64_t g = 0; g < w.groups; ++g) {
    vfloat sv[NT], mv[NT];
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) {
      const int64_t at = (n0 + j) * w.groups + g;
      sv[j] = splat(half_to_float(w.scale[at]));
      mv[j] = HAS_MIN ? splat(half_to_float(w.min[at])) : vfloat{};
    }
    const int64_t k0 = g * G;
    if constexpr (BITS == 4) {
      // 16 bytes: values c .. c + kWidth from the low nibbles, 16 + c .. from the high ones.
      for (int c = 0; c < 16; c += kWidth) {
        vfloat lo[NT], hi[NT];
#pragma GCC unroll 8
        for (int j = 0; j < NT; ++j) {
          const uint8_t* p = w.q + (n0 + j) * w.q_row + g * 16 + c;
          lo[j] = from_bytes(p, 0) * sv[j] + mv[j];
          hi[j] = from_bytes(p, 4) * sv[j] + mv[j];
        }
        accumulate(lo, k0 + c);
        accumulate(hi, k0 + 16 + c);
      }
    } else {
      for (int c = 0; c < G; c += kWidth) {
        vfloat wv[NT];
#pragma GCC unroll 8
        for (int j = 0; j < NT; ++j) {
          const uint8_t* p = w.q + (n0 + j) * w.q_row + k0 + c;
          wv[j] = from_signed_bytes(p) * sv[j] + mv[j];
        }
        accumulate(wv, k0 + c);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) out[i * out_stride + n0 + j] = sum(acc[i][j]);
}

// Rows m0 .. m0 + rows (fewer than kTileRows) of one feature tile: the instantiation for rows.
template <int BITS, int NT, bool HAS_MIN>
void tile_rows(int rows, const float* x, int64_t x_stride, const Weight& w, int64_t n0, int64_t K,
               float* out, int64_t out_stride) {
  switch (rows) {
    case 1: return tile<BITS, 1, NT, HAS_MIN>(x, x_stride, w, n0, K, out, out_stride);
    case 2: return tile<BITS, 2, NT, HAS_MIN>(x, x_stride, w, n0, K, out, out_stride);
    case 3: return tile<BITS, 3, NT, HAS_MIN>(x, x_stride, w, n0, K, out, out_stride);
    default: return tile<BITS, 4, NT, HAS_MIN>(x, x_stride, w, n0, K, out, out_stride);
  }
}

template <int BITS, bool HAS_MIN>
void matmul(const at::Tensor& x, const Weight& w, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  // Feature tiles per task: about 64k multiply-adds, so that a short matmul runs inline.
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * M * kTileCols));
  at::parallel_for(0, col_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileCols;
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = int(std::min<int64_t>(kTileRows, M - m0));
        const float* xr = xp + m0 * K;
        float* orow = op + m0 * N;
        if (n0 + kTileCols <= N) {
          tile_rows<BITS, kTileCols, HAS_MIN>(rows, xr, K, w, n0, K, orow, N);
        } else {
          for (int64_t n = n0; n < N; ++n) tile_rows<BITS, 1, HAS_MIN>(rows, xr, K, w, n, K, orow, N);
        }
      }
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define PAGEDLLM_QUANT_VNNI 1
// With VNNI the rows are quantized too, to int8 in groups of 32 (llama.cpp's Q8 activations),
// and each group's products are summed by vpdpbusd, 4 byte pairs a lane: a 32-value group of a
// weight row costs a handful of instructions instead of de-quantizing it into floats. The
// weight's bytes are the unsigned operand: 4-bit values as they are, int8 values offset by 128
// (the offset taken back through the minimum, -128 * scale). Minimums multiply the row's sums,
// spread over the lanes of its 16-value halves so that the lanes' total adds them.
// Scratch arrays of one call in one allocation (a decode step makes 121 calls on SmolLM2, and
// each allocation cost about as much as a small matmul's products).
struct Scratch {
  at::Tensor storage;
  uint8_t* next;

  explicit Scratch(int64_t bytes)
      : storage(at::empty({bytes}, at::kByte)), next(storage.data_ptr<uint8_t>()) {}
  template <typename T>
  T* take(int64_t count) {  // 64-byte aligned within the storage
    T* out = reinterpret_cast<T*>(next);
    next += (count * int64_t(sizeof(T)) + 63) / 64 * 64;
    return out;
  }
};

struct QuantizedRows {
  int8_t* q;       // [M, K]
  float* scale;    // [M, K / 32]
  float* quarter;  // [M, K / 16]: the sum of each 16 de-quantized values, over 4
};

// Bytes of the row arrays for M rows of K values: both layouts, with room for alignment.
int64_t rows_bytes(int64_t M, int64_t K) { return 2 * M * K + 4 * M * K / 2 + 6 * 64; }

// In: float or c10::BFloat16 (read through vec.h's load, widened without a converted copy).
template <typename In>
QuantizedRows quantize_rows(const at::Tensor& x, Scratch& scratch) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / 32;
  QuantizedRows r{scratch.take<int8_t>(M * K), scratch.take<float>(M * groups),
                  scratch.take<float>(M * K / 16)};
  const In* xp = x.data_ptr<In>();
  int8_t* qp = r.q;
  float* sp = r.scale;
  float* hp = r.quarter;
  at::parallel_for(0, M * groups, std::max<int64_t>(1, 2048 / 32), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const In* src = xp + i * 32;  // rows are contiguous: group i of the whole matrix
      const __m512 a = (__m512)load(src), c = (__m512)load(src + 16);
      const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(a)),
                                  _mm512_reduce_max_ps(_mm512_abs_ps(c)));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
      const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qp + i * 32), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qp + i * 32 + 16), _mm512_cvtsepi32_epi8(qc));
      sp[i] = d;
      hp[2 * i] = d * float(_mm512_reduce_add_epi32(qa)) / 4.f;
      hp[2 * i + 1] = d * float(_mm512_reduce_add_epi32(qc)) / 4.f;
    }
  });
  return r;
}

inline __m256 halves(float low, float high) {
  return _mm256_set_m128(_mm_set1_ps(high), _mm_set1_ps(low));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// A group's scale and effective minimum, from float16 (converted where used: a buffer of
// converted scales per tile cost as much as the products at a few rows).
template <int BITS, bool HAS_MIN>
inline void group_scale(const Weight& w, int64_t at, float& scale, float& min) {
  scale = half_to_float(w.scale[at]);
  min = (HAS_MIN ? half_to_float(w.min[at]) : 0.f) - (BITS == 8 ? 128.f * scale : 0.f);
}

template <int BITS, int MT, int NT, bool HALVES, bool HAS_MIN, typename Out>
void tile_vnni(const QuantizedRows& x, int64_t m0, const Weight& w, int64_t n0, int64_t K,
               Out* out, int64_t out_stride) {
  const int8_t* xq = x.q + m0 * K;
  const float* xs = x.scale + m0 * (K / 32);
  const float* xh = x.quarter + m0 * (K / 16);
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; ++c) {
    __m256i wv[NT];
    __m256 sv[NT], mv[NT];
    for (int j = 0; j < NT; ++j) {
      const uint8_t* p = w.q + (n0 + j) * w.q_row;
      // Rows are read as NT streams at once; fetching ahead keeps their lines in flight.
      _mm_prefetch(reinterpret_cast<const char*>(p + (c + 8) * BITS * 4), _MM_HINT_T0);
      if constexpr (BITS == 4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c * 16));
        const __m128i low = _mm_and_si128(b, _mm_set1_epi8(15));
        const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        wv[j] = _mm256_set_m128i(high, low);
      } else {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 32));
        wv[j] = _mm256_xor_si256(b, _mm256_set1_epi8(char(0x80)));
      }
      const int64_t row_groups = (n0 + j) * w.groups;
      if constexpr (HALVES) {  // groups of 16: two per 32 values
        float s0, m0_, s1, m1;
        group_scale<BITS, HAS_MIN>(w, row_groups + 2 * c, s0, m0_);
        group_scale<BITS, HAS_MIN>(w, row_groups + 2 * c + 1, s1, m1);
        sv[j] = halves(s0, s1);
        mv[j] = halves(m0_, m1);
      } else {
        float sg, mg;
        group_scale<BITS, HAS_MIN>(w, row_groups + c, sg, mg);
        sv[j] = _mm256_set1_ps(sg);
        mv[j] = _mm256_set1_ps(mg);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + c * 32));
      const __m256 d = _mm256_broadcast_ss(xs + i * (K / 32) + c);
      const __m256 h = halves(xh[i * (K / 16) + 2 * c], xh[i * (K / 16) + 2 * c + 1]);
      for (int j = 0; j < NT; ++j) {
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[j], q);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv[j], d), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(mv[j], h, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[i * out_stride + n0 + j] = Out(hsum8(acc[i][j]));
}

template <int BITS, int NT, bool HALVES, bool HAS_MIN, typename Out>
void tile_vnni_rows(int rows, const QuantizedRows& x, int64_t m0, const Weight& w, int64_t n0,
                    int64_t K, Out* out, int64_t out_stride) {
  switch (rows) {
    case 1: return tile_vnni<BITS, 1, NT, HALVES, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
    case 2: return tile_vnni<BITS, 2, NT, HALVES, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
    case 3: return tile_vnni<BITS, 3, NT, HALVES, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
    default: return tile_vnni<BITS, 4, NT, HALVES, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
  }
}

// Groups of 32 with K a multiple of 64: two groups a step in 512-bit registers, which halves
// the instructions per product of the 256-bit tiles above (a single stream is bound by them,
// not by memory). A 4-bit weight's 32 bytes for two groups, their low nibbles then their high
// nibbles side by side, hold 16-value quarters 0, 2, 1, 3 of the 64 values; int8 weights are
// shuffled into the same order, and the rows are permuted into it once per call. A lane's group
// is then (lane / 4) % 2, so a pair of float16 scales spreads over the lanes with one byte
// shuffle. Minimums (and int8's -128 * scale) multiply each group's row sum after the products,
// 16 groups a vector.
struct Rows64 {
  int8_t* q;      // [M, K]: each 64 values' quarters in the order 0, 2, 1, 3
  float* lane_d;  // [M, K / 64, 16]: each lane's row scale
  float* sums;    // [M, K / 32]: each group's sum of de-quantized row values
};

constexpr int kQuarterOrder[4] = {0, 2, 1, 3};

Rows64 to_rows64(const QuantizedRows& r, int64_t M, int64_t K, Scratch& scratch) {
  Rows64 out{scratch.take<int8_t>(M * K), scratch.take<float>(M * K / 4),
             scratch.take<float>(M * K / 32)};
  const int8_t* q = r.q;
  const float* scale = r.scale;
  const float* quarter = r.quarter;
  int8_t* q64 = out.q;
  float* lane_d = out.lane_d;
  float* sums = out.sums;
  for (int64_t b = 0; b < M * K / 64; ++b) {  // rows are contiguous: block b of the matrix
    for (int part = 0; part < 4; ++part)
      std::memcpy(q64 + b * 64 + part * 16, q + b * 64 + kQuarterOrder[part] * 16, 16);
    for (int lane = 0; lane < 16; ++lane) lane_d[b * 16 + lane] = scale[b * 2 + (lane / 4) % 2];
  }
  for (int64_t g = 0; g < M * K / 32; ++g) sums[g] = 4.f * (quarter[2 * g] + quarter[2 * g + 1]);
  return out;
}

template <int BITS, int MT, int NT, bool HAS_MIN, typename Out>
void tile_vnni64(const Rows64& x, int64_t m0, const Weight& w, int64_t n0, int64_t K,
                 Out* out, int64_t out_stride) {
  const int64_t blocks = K / 64, groups = K / 32;
  const int8_t* xq = x.q + m0 * K;
  const float* xd = x.lane_d + m0 * blocks * 16;
  const float* xsum = x.sums + m0 * groups;
  // float16 elements 0-3 and 8-11 take the first scale of a pair, 4-7 and 12-15 the second.
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                          0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3);
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i wv[NT];
    __m512 sv[NT];
    for (int j = 0; j < NT; ++j) {
      const uint8_t* p = w.q + (n0 + j) * w.q_row;
      _mm_prefetch(reinterpret_cast<const char*>(p + (b + 4) * BITS * 8), _MM_HINT_T0);
      if constexpr (BITS == 4) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * 32));
        const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
        wv[j] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      } else {
        const __m512i bytes = _mm512_loadu_si512(p + b * 64);
        wv[j] = _mm512_xor_si512(_mm512_shuffle_i64x2(bytes, bytes, _MM_SHUFFLE(3, 1, 2, 0)),
                                 _mm512_set1_epi8(char(0x80)));
      }
      int32_t pair;
      std::memcpy(&pair, w.scale + (n0 + j) * groups + 2 * b, sizeof(pair));
      sv[j] = _mm512_cvtph_ps(_mm256_shuffle_epi8(_mm256_set1_epi32(pair), spread));
    }
    for (int i = 0; i < MT; ++i) {
      const __m512i q = _mm512_loadu_si512(xq + i * K + b * 64);
      const __m512 d = _mm512_loadu_ps(xd + (i * blocks + b) * 16);
      for (int j = 0; j < NT; ++j) {
        const __m512i prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], q);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), _mm512_mul_ps(sv[j], d), acc[i][j]);
      }
    }
  }
  if constexpr (HAS_MIN || BITS == 8) {
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 mask = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      __m512 xs[MT];
      for (int i = 0; i < MT; ++i) xs[i] = _mm512_maskz_loadu_ps(mask, xsum + i * groups + g);
      for (int j = 0; j < NT; ++j) {
        const int64_t at = (n0 + j) * groups + g;
        __m512 eff = _mm512_setzero_ps();
        if constexpr (HAS_MIN) eff = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.min + at));
        if constexpr (BITS == 8) {
          const __m512 sg = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.scale + at));
          eff = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), sg, eff);
        }
        for (int i = 0; i < MT; ++i) acc[i][j] = _mm512_fmadd_ps(eff, xs[i], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[i * out_stride + n0 + j] = Out(_mm512_reduce_add_ps(acc[i][j]));
}

template <int BITS, int NT, bool HAS_MIN, typename Out>
void tile_vnni64_rows(int rows, const Rows64& x, int64_t m0, const Weight& w, int64_t n0,
                      int64_t K, Out* out, int64_t out_stride) {
  switch (rows) {
    case 1: return tile_vnni64<BITS, 1, NT, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
    case 2: return tile_vnni64<BITS, 2, NT, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
    case 3: return tile_vnni64<BITS, 3, NT, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
    default: return tile_vnni64<BITS, 4, NT, HAS_MIN>(x, m0, w, n0, K, out, out_stride);
  }
}

// x float32 or bfloat16, out of the same dtype.
template <int BITS, bool HAS_MIN, typename T>
void matmul_vnni(const at::Tensor& xt, const Weight& w, at::Tensor& out) {
  const int64_t M = xt.size(0), K = xt.size(1), N = out.size(1);
  Scratch scratch(rows_bytes(M, K));
  const QuantizedRows x = quantize_rows<T>(xt, scratch);
  T* op = out.data_ptr<T>();
  constexpr int kRows = 4, kCols = 4;
  const int64_t col_tiles = (N + kCols - 1) / kCols;
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * M * kCols));
  const bool halves = w.group == 16, wide = !halves && K % 64 == 0;
  const Rows64 x64 = wide ? to_rows64(x, M, K, scratch) : Rows64{};
  // One tile: rows m0.. of features n0.. (kCols of them, or one at the matrix's edge).
  auto tile = [&](int rows, int64_t m0, int64_t n0, bool whole) {
    T* orow = op + m0 * N;
    if (wide) {
      (whole ? tile_vnni64_rows<BITS, kCols, HAS_MIN, T> : tile_vnni64_rows<BITS, 1, HAS_MIN, T>)(
          rows, x64, m0, w, n0, K, orow, N);
    } else if (halves) {
      (whole ? tile_vnni_rows<BITS, kCols, true, HAS_MIN, T> : tile_vnni_rows<BITS, 1, true, HAS_MIN, T>)(
          rows, x, m0, w, n0, K, orow, N);
    } else {
      (whole ? tile_vnni_rows<BITS, kCols, false, HAS_MIN, T>
             : tile_vnni_rows<BITS, 1, false, HAS_MIN, T>)(rows, x, m0, w, n0, K, orow, N);
    }
  };
  at::parallel_for(0, col_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kCols;
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = int(std::min<int64_t>(kRows, M - m0));
        if (n0 + kCols <= N) {
          tile(rows, m0, n0, true);
          continue;
        }
        for (int64_t n = n0; n < N; ++n) tile(rows, m0, n, false);
      }
    }
  });
}
#endif

// The weight de-quantized to T [N, K]: for many rows a matmul is bound by compute, and a
// float GEMM (oneDNN's, through at::linear) over a de-quantized copy beats de-quantizing each
// vector once per tile of rows.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Row n in bfloat16, 16 values a step, rounded two vectors at a time by one instruction
// (vcvtne2ps2bf16, nearest even as c10::BFloat16): the generic vector code's rounding in
// integer lanes made this pass several times slower than the GEMM it feeds.
template <int BITS, bool HAS_MIN>
void dequantize_row_bf16(const Weight& w, int64_t n, int64_t K, c10::BFloat16* row) {
  const uint8_t* q = w.q + n * w.q_row;
  const at::Half* scale = w.scale + n * w.groups;
  const at::Half* min = HAS_MIN ? w.min + n * w.groups : nullptr;
  for (int64_t k = 0; k < K; k += 32) {
    __m512 lo, hi;  // values k .. k + 15 and k + 16 .. k + 31
    if constexpr (BITS == 4) {  // one group of 32: 16 bytes, value i + 16 in byte i's high nibble
      const int64_t g = k / 32;
      const __m512 s = _mm512_set1_ps(half_to_float(scale[g]));
      const __m512 m = HAS_MIN ? _mm512_set1_ps(half_to_float(min[g])) : _mm512_setzero_ps();
      const __m512i wide =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2)));
      lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15))), s, m);
      hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4)), s, m);
    } else {  // groups of 16 or 32: each half takes its own group's scale
      const int64_t g0 = k / w.group, g1 = (k + 16) / w.group;
      const __m512 s0 = _mm512_set1_ps(half_to_float(scale[g0]));
      const __m512 s1 = _mm512_set1_ps(half_to_float(scale[g1]));
      const __m512 m0 = HAS_MIN ? _mm512_set1_ps(half_to_float(min[g0])) : _mm512_setzero_ps();
      const __m512 m1 = HAS_MIN ? _mm512_set1_ps(half_to_float(min[g1])) : _mm512_setzero_ps();
      auto bytes = [&](int64_t at) {
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + at))));
      };
      lo = _mm512_fmadd_ps(bytes(k), s0, m0);
      hi = _mm512_fmadd_ps(bytes(k + 16), s1, m1);
    }
    _mm512_storeu_si512(row + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}
#endif

template <int BITS, bool HAS_MIN, typename T>
at::Tensor dequantized(const Weight& w, int64_t N, int64_t K) {
  at::Tensor out = at::empty({N, K}, c10::CppTypeToScalarType<T>::value);
  T* op = out.data_ptr<T>();
  const int G = w.group;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      T* row = op + n * K;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (K % 32 == 0) {
          dequantize_row_bf16<BITS, HAS_MIN>(w, n, K, row);
          continue;
        }
      }
#endif
      for (int64_t g = 0; g < w.groups; ++g) {
        const vfloat s = splat(half_to_float(w.scale[n * w.groups + g]));
        const vfloat m = HAS_MIN ? splat(half_to_float(w.min[n * w.groups + g])) : vfloat{};
        if constexpr (BITS == 4) {
          for (int c = 0; c < 16; c += kWidth) {
            const uint8_t* p = w.q + n * w.q_row + g * 16 + c;
            store(row + g * G + c, from_bytes(p, 0) * s + m);
            store(row + g * G + 16 + c, from_bytes(p, 4) * s + m);
          }
        } else {
          for (int c = 0; c < G; c += kWidth) {
            store(row + g * G + c, from_signed_bytes(w.q + n * w.q_row + g * G + c) * s + m);
          }
        }
      }
    }
  });
  return out;
}

// From this many rows on (prompts), a matmul runs as a GEMM over the de-quantized weight. With
// AVX-512 BF16 that GEMM is in bfloat16 (oneDNN's products at twice float32's rate), the rows
// rounded to bfloat16 as the VNNI path rounds them to int8 groups; the row count where it
// overtakes the integer products is where they measured level on an AMX Xeon (the figures:
// docs/design/kernels.md). Without it in float32, and the integer products keep up with it
// longer.
#if defined(__AVX512BF16__)
using GemmType = c10::BFloat16;
constexpr int64_t kGemmRows = 20;
#elif defined(PAGEDLLM_QUANT_VNNI)
using GemmType = float;
constexpr int64_t kGemmRows = 128;
#else
using GemmType = float;
constexpr int64_t kGemmRows = 32;
#endif

// The GEMM takes the weight a slice of output features at a time, each slice de-quantized just
// before its product, while it is still in cache: de-quantized whole, a large weight (SmolLM2's
// tied head, 49,152 x 576) was written out and read back from memory on every call, which cost
// several times the integer products' time.
constexpr int64_t kGemmSliceValues = int64_t{1} << 20;

template <int BITS, bool HAS_MIN>
at::Tensor gemm(const at::Tensor& x, const Weight& w, int64_t N) {
  const int64_t K = x.size(1);
  const at::Tensor rows = x.to(c10::CppTypeToScalarType<GemmType>::value);
  const int64_t slice = std::max<int64_t>(64, kGemmSliceValues / K);
  if (N <= slice) return at::linear(rows, dequantized<BITS, HAS_MIN, GemmType>(w, N, K));
  at::Tensor out = at::empty({x.size(0), N}, rows.options());  // converted by the caller
  for (int64_t n0 = 0; n0 < N; n0 += slice) {
    const int64_t n = std::min(slice, N - n0);
    const Weight part{w.q + n0 * w.q_row, w.scale + n0 * w.groups,
                      w.min == nullptr ? nullptr : w.min + n0 * w.groups, w.q_row, w.groups,
                      w.group};
    out.narrow(1, n0, n).copy_(at::linear(rows, dequantized<BITS, HAS_MIN, GemmType>(part, n, K)));
  }
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a CPU matrix [rows, in_features]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size % kWidth == 0 && (group_size == 16 || group_size == 32) &&
                  (bits == 8 || group_size == 32),
              "group_size must be 16 or 32 (32 for 4 bits), got ", group_size);
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % group_size == 0, "in_features ", K, " is not a multiple of the group size");
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 2 &&
                  qweight.size(1) == (bits == 4 ? K / 2 : K) &&
                  (qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar)),
              "qweight must be contiguous ", bits == 4 ? "uint8 [N, K/2]" : "int8 [N, K]");
  const int64_t groups = K / group_size;
  auto check_groups = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kHalf && t.dim() == 2 &&
                    t.size(0) == N && t.size(1) == groups,
                name, " must be contiguous float16 [out_features, in_features / group_size]");
  };
  check_groups(scales, "scales");
  const bool has_min = mins.has_value();
  if (has_min) check_groups(*mins, "mins");

  if (x.size(0) == 0 || N == 0) return at::empty({x.size(0), N}, x.options());
  const Weight w{static_cast<const uint8_t*>(qweight.data_ptr()),  // int8 read as bytes
                 scales.data_ptr<at::Half>(),
                 has_min ? mins->data_ptr<at::Half>() : nullptr,
                 qweight.size(1),
                 groups,
                 int(group_size)};
  at::Tensor out;
  if (x.size(0) >= kGemmRows) {
    out = bits == 4 ? (has_min ? gemm<4, true>(x, w, N) : gemm<4, false>(x, w, N))
                    : (has_min ? gemm<8, true>(x, w, N) : gemm<8, false>(x, w, N));
  } else {
#ifdef PAGEDLLM_QUANT_VNNI
    // bfloat16 rows are read and written as they are (two conversions a call fewer).
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const at::Tensor xt = (bf16 ? x : x.to(at::kFloat)).contiguous();
    out = at::empty({x.size(0), N}, xt.options());
    auto run = [&](auto dtype) {  // dtype: a value of the rows' element type
      using T = decltype(dtype);
      if (bits == 4) {
        has_min ? matmul_vnni<4, true, T>(xt, w, out) : matmul_vnni<4, false, T>(xt, w, out);
      } else {
        has_min ? matmul_vnni<8, true, T>(xt, w, out) : matmul_vnni<8, false, T>(xt, w, out);
      }
    };
    bf16 ? run(c10::BFloat16()) : run(0.f);
#else
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
    if (bits == 4) {
      has_min ? matmul<4, true>(xf, w, out) : matmul<4, false>(xf, w, out);
    } else {
      has_min ? matmul<8, true>(xf, w, out) : matmul<8, false>(xf, w, out);
    }
#endif
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
      "int group_size) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
}
