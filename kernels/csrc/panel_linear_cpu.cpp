// Float32 weight matmuls on AVX-512 CPUs, y = x W^T (+ bias), over a weight packed once into
// panels of 16 output features: panel p holds W[16p .. 16p + 15, k] for every k, k-major, so a
// panel streams through one 64-byte vector per input feature. Two panels and up to 12 rows of
// x make one register tile (24 accumulators): each vector of weights loaded serves every row,
// so a decode step reads each weight once, at whatever row count, and the products keep pace
// with the weight stream. Each tile asks for its weights 2 KB ahead, and the rows run in passes
// of even sizes. At the row counts of decoding this is what bounds a step: SmolLM2's 120 layer
// matmuls at 1 / 8 / 16 rows took 15-17 / 20-23 / 30 ms against MKL's packed sgemm's 18-19 / 27
// / 32 on a 2-core AVX-512 Xeon before the prefetch, which took another 10-15 % off at 4-128
// rows (8 / 16 / 32 rows: 25.6 / 33.9 / 46.0 ms -> 22.1 / 28.6 / 40.2 in alternation, a slower
// hour); at 256 rows (prompts) within 10 % of MKL.
#include "aten.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: one AVX-512 vector
constexpr int kRows = 12;        // rows of x per register tile
// How far ahead in its panels a tile asks for weights, in input features (32 x 64 bytes =
// 2 KB). Without it the tile did not read ahead while its FMAs were busy: at 8-32 rows a
// matmul took about as long as its weight stream plus its products, one after the other.
constexpr int64_t kPrefetch = 32;

// [N, K] -> [P, K, 16], P = N / 16 rounded up to an even count, the padding zero.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_weight: a float32 [out_features, in_features] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = ((n + 2 * kPanel - 1) / (2 * kPanel)) * 2;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

#if defined(__AVX512F__)

// rows x (2 panels): out[m, 0..31] = x[m, :] . panels (+ bias), columns >= valid left alone.
template <int R>
void tile(const float* x, int64_t k_total, const float* panel, const float* bias, int valid,
          float* out, int64_t ld_out) {
  const float* next = panel + k_total * kPanel;
  const __mmask16 lo = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 hi =
      valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(lo, bias);
    b1 = _mm512_maskz_loadu_ps(hi, bias + kPanel);
  }
  __m512 a0[R], a1[R];
  for (int m = 0; m < R; ++m) {
    a0[m] = b0;
    a1[m] = b1;
  }
  for (int64_t k = 0; k < k_total; ++k) {
    // Past the end of the weight this asks for memory never read: prefetches do not fault.
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetch) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next + (k + kPrefetch) * kPanel), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(next + k * kPanel);
    for (int m = 0; m < R; ++m) {
      const __m512 v = _mm512_set1_ps(x[m * k_total + k]);
      a0[m] = _mm512_fmadd_ps(v, w0, a0[m]);
      a1[m] = _mm512_fmadd_ps(v, w1, a1[m]);
    }
  }
  for (int m = 0; m < R; ++m) {
    _mm512_mask_storeu_ps(out + m * ld_out, lo, a0[m]);
    _mm512_mask_storeu_ps(out + m * ld_out + kPanel, hi, a1[m]);
  }
}

using Tile = void (*)(const float*, int64_t, const float*, const float*, int, float*, int64_t);

template <int... R>
constexpr std::array<Tile, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1>...};
}

constexpr auto kTiles = tiles(std::make_integer_sequence<int, kRows>{});

#endif

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "panel_linear: float32 input and weight");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(0) % 2 == 0,
              "panel_linear: a weight from pack_linear_weight");
  const int64_t k_total = packed.size(1);
  TORCH_CHECK(x.size(-1) == k_total, "panel_linear: input of ", x.size(-1),
              " features for a weight of ", k_total);
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kPanel &&
                  out_features > (packed.size(0) - 2) * kPanel,
              "panel_linear: out_features does not fit the packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == out_features && bias->is_contiguous() &&
                                    bias->scalar_type() == at::kFloat),
              "panel_linear: a float32 bias of out_features values");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty(shape, x.options());
  const at::Tensor rows_in = x.reshape({-1, k_total}).contiguous();
  const int64_t rows = rows_in.size(0);
  if (rows == 0) return out;
#if defined(__AVX512F__)
  const float* xs = rows_in.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t pairs = packed.size(0) / 2;
  const int64_t passes = (rows + kRows - 1) / kRows;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col = p * 2 * kPanel;
      const int valid = static_cast<int>(std::min<int64_t>(2 * kPanel, out_features - col));
      const float* panel = w + p * 2 * k_total * kPanel;
      // The rows in as few passes as tiles allow, of even sizes (16 rows as 8 + 8, not
      // 12 + 4): a pass's products cost its rows, and only the first reads from memory.
      for (int64_t m = 0, pass = 0; pass < passes; ++pass) {
        const int64_t r = (rows - m) / (passes - pass);
        kTiles[r - 1](xs + m * k_total, k_total, panel, b == nullptr ? nullptr : b + col, valid,
                      o + m * out_features + col, out_features);
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
