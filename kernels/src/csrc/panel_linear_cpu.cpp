// Weight matmuls on AVX-512 CPUs, y = x W^T (+ bias), over a weight packed once into panels of
// 16 output features, k-major, so that a panel streams through one 64-byte vector per step:
// float32 weights one input feature a step, bfloat16 ones two (the pair of features k, k + 1
// of each output side by side: the layout of AVX512-BF16's vdpbf16ps, and on CPUs without it
// each half widens to float32 with one shift or one mask). Two panels and up to 12 rows of x
// make one register tile (24 float32 accumulators): each vector of weights loaded serves every
// row, so a decode step reads each weight once, at whatever row count, and the products keep
// pace with the weight stream. Each tile asks for its weights 2 KB ahead, and the rows run in
// passes of even sizes. At the row counts of decoding this is what bounds a step, and there it
// is faster than MKL's packed sgemm, which spends more per added row; at prompt row counts
// about as fast (the measurements: docs/design/kernels.md). bfloat16 weights are half the
// bytes to stream, with float32 products and sums either way.
#include "aten.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: one AVX-512 vector
constexpr int kRows = 12;        // rows of x per register tile
// How far ahead in its panels a tile asks for weights: 2 KB, 32 steps of one 64-byte vector.
// Without it the tile did not read ahead while its FMAs were busy: at 8-32 rows a matmul took
// about as long as its weight stream plus its products, one after the other.
constexpr int64_t kPrefetch = 32;

// float32 [N, K] -> [P, K, 16]; bfloat16 [N, K] (K even) -> [P, K / 2, 32], lane 2n + t of
// step j holding W[16p + n, 2j + t]. P = N / 16 rounded up to an even count, the padding zero.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    weight.scalar_type() == at::kBFloat16),
              "pack_linear_weight: a float32 or bfloat16 [out_features, in_features] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = ((n + 2 * kPanel - 1) / (2 * kPanel)) * 2;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  if (weight.scalar_type() == at::kFloat) {
    return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
  }
  TORCH_CHECK(k % 2 == 0, "pack_linear_weight: a bfloat16 weight of an even in_features");
  return padded.view({panels, kPanel, k / 2, 2})
      .permute({0, 2, 1, 3})
      .contiguous()
      .view({panels, k / 2, 2 * kPanel});
}

#if defined(__AVX512F__)

inline __mmask16 low_mask(int valid) {
  return valid >= 16 ? 0xFFFF : valid <= 0 ? 0 : static_cast<__mmask16>((1u << valid) - 1);
}

inline void store(float* out, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(out, mask, v); }

// Rounded to nearest even, NaN kept quiet, as c10::BFloat16 rounds.
inline void store(c10::BFloat16* out, __mmask16 mask, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(rounded));
}

// A pair of panels' 32 bias values (zeros without a bias), the columns >= valid zero too.
struct PairBias {
  __mmask16 lo, hi;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();

  PairBias(const float* bias, int valid) : lo(low_mask(valid)), hi(low_mask(valid - 16)) {
    if (bias != nullptr) {
      b0 = _mm512_maskz_loadu_ps(lo, bias);
      b1 = _mm512_maskz_loadu_ps(hi, bias + kPanel);
    }
  }
};

// Runs a tile over k_total input features: `step(j, a0, a1)` adds step j's products to the
// rows' accumulators; then stores rows x 32 columns (+ bias), columns >= valid left alone.
template <int R, typename T, typename Step>
inline void run_tile(int64_t steps, const float* bias, int valid, T* out, int64_t ld_out,
                     Step&& step) {
  const PairBias pb(bias, valid);
  const __mmask16 lo = pb.lo, hi = pb.hi;
  const __m512 b0 = pb.b0, b1 = pb.b1;
  __m512 a0[R], a1[R];
  for (int m = 0; m < R; ++m) {
    a0[m] = b0;
    a1[m] = b1;
  }
  for (int64_t j = 0; j < steps; ++j) step(j, a0, a1);
  for (int m = 0; m < R; ++m) {
    store(out + m * ld_out, lo, a0[m]);
    store(out + m * ld_out + kPanel, hi, a1[m]);
  }
}

// Past the end of the weight these ask for memory never read: prefetches do not fault.
inline void prefetch(const void* p0, const void* p1) {
  _mm_prefetch(static_cast<const char*>(p0) + kPrefetch * 64, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(p1) + kPrefetch * 64, _MM_HINT_T0);
}

// float32 weights, float32 rows x ([R, k_total], row-major).
template <int R>
void tile_f32(const float* x, int64_t k_total, const void* weight, const float* bias, int valid,
              void* out, int64_t ld_out) {
  const float* panel = static_cast<const float*>(weight);
  const float* next = panel + k_total * kPanel;
  run_tile<R>(k_total, bias, valid, static_cast<float*>(out), ld_out,
              [&](int64_t k, __m512* a0, __m512* a1) {
                prefetch(panel + k * kPanel, next + k * kPanel);
                const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
                const __m512 w1 = _mm512_loadu_ps(next + k * kPanel);
                for (int m = 0; m < R; ++m) {
                  const __m512 v = _mm512_set1_ps(x[m * k_total + k]);
                  a0[m] = _mm512_fmadd_ps(v, w0, a0[m]);
                  a1[m] = _mm512_fmadd_ps(v, w1, a1[m]);
                }
              });
}

#if defined(__AVX512BF16__)
// bfloat16 weights and rows: each step one vdpbf16ps a row and panel over a pair of features.
template <int R>
void tile_bf16(const void* xv, int64_t k_total, const void* weight, const float* bias,
               int valid, void* out, int64_t ld_out) {
  const int32_t* x = static_cast<const int32_t*>(xv);  // pairs of bfloat16 features
  const int64_t steps = k_total / 2;
  const __m512i* panel = static_cast<const __m512i*>(weight);
  const __m512i* next = panel + steps;
  run_tile<R>(steps, bias, valid, static_cast<c10::BFloat16*>(out), ld_out,
              [&](int64_t j, __m512* a0, __m512* a1) {
                prefetch(panel + j, next + j);
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j);
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(next + j);
                for (int m = 0; m < R; ++m) {
                  const __m512bh v = (__m512bh)_mm512_set1_epi32(x[m * steps + j]);
                  a0[m] = _mm512_dpbf16_ps(a0[m], v, w0);
                  a1[m] = _mm512_dpbf16_ps(a1[m], v, w1);
                }
              });
}
#else
// bfloat16 weights, the rows widened to float32: each half of a pair widens with a shift (the
// even feature) or a mask (the odd one), the odd product added first as vdpbf16ps adds it.
template <int R>
void tile_bf16(const void* xv, int64_t k_total, const void* weight, const float* bias,
               int valid, void* out, int64_t ld_out) {
  const float* x = static_cast<const float*>(xv);
  const int64_t steps = k_total / 2;
  const __m512i* panel = static_cast<const __m512i*>(weight);
  const __m512i* next = panel + steps;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  run_tile<R>(steps, bias, valid, static_cast<c10::BFloat16*>(out), ld_out,
              [&](int64_t j, __m512* a0, __m512* a1) {
                prefetch(panel + j, next + j);
                const __m512i p0 = _mm512_loadu_si512(panel + j);
                const __m512i p1 = _mm512_loadu_si512(next + j);
                const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
                const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(p0, high));
                const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
                const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(p1, high));
                for (int m = 0; m < R; ++m) {
                  const float* row = x + m * k_total + 2 * j;
                  const __m512 ve = _mm512_set1_ps(row[0]), vo = _mm512_set1_ps(row[1]);
                  a0[m] = _mm512_fmadd_ps(ve, e0, _mm512_fmadd_ps(vo, o0, a0[m]));
                  a1[m] = _mm512_fmadd_ps(ve, e1, _mm512_fmadd_ps(vo, o1, a1[m]));
                }
              });
}
#endif

#if defined(PAGEDLLM_AMX)
// AMX tiles for prompt-sized row counts: the packed bfloat16 panel is already the B operand's
// layout (16 steps of a pair of features x 16 outputs, 64 bytes a step), so a tile of 16 steps
// loads straight from it; x's rows are the A operand, 16 rows x 32 features a tile. Per pair of
// panels and block of 16 rows: two accumulators (one per panel), one A tile, two B tiles.
constexpr int64_t kAmxRows = 16;      // rows of an A or C tile
constexpr int64_t kAmxFeatures = 32;  // bfloat16 features of an A tile row: 64 bytes
// Below this row count the vdpbf16ps tiles stream the weights as fast and waste no products
// on rows padded to 16.
constexpr int64_t kAmxMinRows = 32;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the AMX tile state only when asked (else its first tile instruction
// dies of SIGILL); asked once, the answer kept.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {  // 0, 1: C (float32); 2: A; 3, 4: B; all 16 rows x 64 bytes
    config.rows[t] = kAmxRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// One pair of panels over a block of 16 rows of x (bfloat16, row-major, k_total a multiple of
// 32); the float32 sums land in `sums` [16, 32] for the caller to finish.
inline void amx_block(const c10::BFloat16* x, int64_t k_total, const char* pair, float* sums) {
  const int64_t x_stride = k_total * 2;
  const char* panel0 = pair;
  const char* panel1 = pair + k_total * kPanel * 2;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < k_total; k += kAmxFeatures) {
    const int64_t step = k / 2;  // 16 steps of 64 bytes from here
    _tile_loadd(2, x + k, x_stride);
    _tile_loadd(3, panel0 + step * 64, 64);
    _tile_loadd(4, panel1 + step * 64, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, sums, 2 * kPanel * sizeof(float));
  _tile_stored(1, sums + kPanel, 2 * kPanel * sizeof(float));
}

// The whole matmul in AMX tiles: x's rows padded with zeros to whole blocks of 16, each thread
// configuring its own tiles (the configuration is per thread), the sums finished with the bias
// and rounded to bfloat16 by the same store as the other tiles.
void amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                const float* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), k_total = x.size(1);
  const int64_t blocks = (rows + kAmxRows - 1) / kAmxRows;
  at::Tensor padded = x;
  if (blocks * kAmxRows != rows) {
    padded = at::zeros({blocks * kAmxRows, k_total}, x.options());
    padded.narrow(0, 0, rows).copy_(x);
  }
  const auto* xs = padded.data_ptr<c10::BFloat16>();
  const auto* w = static_cast<const char*>(packed.data_ptr());
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t pairs = packed.size(0) / 2;
  const int64_t pair_bytes = 2 * k_total * kPanel * 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float sums[kAmxRows * 2 * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * 2 * kPanel;
      const int valid = static_cast<int>(std::min<int64_t>(2 * kPanel, out_features - col));
      const PairBias pb(bias == nullptr ? nullptr : bias + col, valid);
      for (int64_t block = 0; block < blocks; ++block) {
        amx_block(xs + block * kAmxRows * k_total, k_total, w + p * pair_bytes, sums);
        const int64_t first = block * kAmxRows;
        const int64_t count = std::min<int64_t>(kAmxRows, rows - first);
        for (int64_t m = 0; m < count; ++m) {
          c10::BFloat16* row = o + (first + m) * out_features + col;
          const float* sum = sums + m * 2 * kPanel;
          store(row, pb.lo, _mm512_add_ps(_mm512_load_ps(sum), pb.b0));
          store(row + kPanel, pb.hi, _mm512_add_ps(_mm512_load_ps(sum + kPanel), pb.b1));
        }
      }
    }
    _tile_release();
  });
}
#endif

using Tile = void (*)(const void*, int64_t, const void*, const float*, int, void*, int64_t);

template <int R>
void tile_f32_erased(const void* x, int64_t k, const void* w, const float* b, int valid,
                     void* out, int64_t ld) {
  tile_f32<R>(static_cast<const float*>(x), k, w, b, valid, out, ld);
}

template <int... R>
constexpr std::array<Tile, sizeof...(R)> f32_tiles(std::integer_sequence<int, R...>) {
  return {&tile_f32_erased<R + 1>...};
}

template <int... R>
constexpr std::array<Tile, sizeof...(R)> bf16_tiles(std::integer_sequence<int, R...>) {
  return {&tile_bf16<R + 1>...};
}

constexpr auto kF32Tiles = f32_tiles(std::make_integer_sequence<int, kRows>{});
constexpr auto kBf16Tiles = bf16_tiles(std::make_integer_sequence<int, kRows>{});

#endif

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
  const auto dtype = packed.scalar_type();
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK((dtype == at::kFloat || bf16) && x.scalar_type() == dtype,
              "panel_linear: float32 input and weight, or bfloat16 input and weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == (bf16 ? 2 : 1) * kPanel &&
                  packed.size(0) % 2 == 0,
              "panel_linear: a weight from pack_linear_weight");
  const int64_t k_total = packed.size(1) * (bf16 ? 2 : 1);
  TORCH_CHECK(x.size(-1) == k_total, "panel_linear: input of ", x.size(-1),
              " features for a weight of ", k_total);
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kPanel &&
                  out_features > (packed.size(0) - 2) * kPanel,
              "panel_linear: out_features does not fit the packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->is_contiguous() &&
                                    bias->scalar_type() == dtype),
              "panel_linear: a bias of out_features values in the weight's dtype");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty(shape, x.options());
  at::Tensor rows_in = x.reshape({-1, k_total}).contiguous();
  const int64_t rows = rows_in.size(0);
  if (rows == 0) return out;
#if defined(__AVX512F__)
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
  const float* b = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
#if defined(PAGEDLLM_AMX)
  if (bf16 && rows >= kAmxMinRows && k_total % kAmxFeatures == 0 && amx_permitted()) {
    amx_linear(rows_in, packed, out_features, b, out);
    return out;
  }
#endif
#if !defined(__AVX512BF16__)
  if (bf16) rows_in = rows_in.to(at::kFloat);  // widened once, exactly
#endif
  const auto* xs = static_cast<const char*>(rows_in.data_ptr());
  const int64_t x_row = k_total * rows_in.element_size();
  const auto* w = static_cast<const char*>(packed.data_ptr());
  auto* o = static_cast<char*>(out.data_ptr());
  const int64_t o_elem = out.element_size();
  const auto& tiles = bf16 ? kBf16Tiles : kF32Tiles;
  const int64_t pairs = packed.size(0) / 2;
  const int64_t pair_bytes = 2 * k_total * kPanel * packed.element_size();
  const int64_t passes = (rows + kRows - 1) / kRows;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * 2 * kPanel;
      const int valid = static_cast<int>(std::min<int64_t>(2 * kPanel, out_features - col));
      // The rows in as few passes as tiles allow, of even sizes (16 rows as 8 + 8, not
      // 12 + 4): a pass's products cost its rows, and only the first reads from memory.
      for (int64_t m = 0, pass = 0; pass < passes; ++pass) {
        const int64_t r = (rows - m) / (passes - pass);
        tiles[r - 1](xs + m * x_row, k_total, w + p * pair_bytes,
                     b == nullptr ? nullptr : b + col, valid,
                     o + (m * out_features + col) * o_elem, out_features);
        m += r;
      }
    }
  });
#else
  TORCH_CHECK(false, "panel_linear needs AVX-512");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.def("panel_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
}
