// The elementwise work of a decoder layer for the CPU, each a single pass over its rows: RMSNorm
// (alone, and after adding the residual), the rotary embedding of q and k in place, SiLU(gate)
// times up, and the KV write. In eager torch each is a chain of 3-10 operators with a tensor
// between each pair; at decode batches their dispatch cost is much of a layer's time outside
// the matmuls.
//
// Numerics follow Hugging Face's Llama (pagedllm/kernels/reference.py): RMSNorm computes in
// float32 and multiplies the weight after rounding to the activations' dtype; the rotary
// products and sums are rounded to the dtype as torch's separate operators would.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using namespace pagedllm_vec;

// float32, bfloat16 and float16: the dtypes a model runs in (double has no vector path here).
#define DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                      \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)        \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// Rows per task: enough elements that a thread's share outweighs waking it.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 16384 / row_elements); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              name, " must be a CPU tensor of rows [num_tokens, size] with contiguous rows");
}

// Sum of squares of a row, in float32.
template <typename T>
float sum_squares(const T* x, int64_t n) {
  vfloat acc = {};
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const vfloat v = load(x + i);
    acc += v * v;
  }
  float total = sum(acc);
  for (; i < n; ++i) total += float(x[i]) * float(x[i]);
  return total;
}

// out = weight * T(x * inv_rms): the normalized row rounded to T, then scaled in T.
template <typename T>
void scale_row(const T* x, const T* weight, float inv_rms, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const vfloat normed = round_to<T>(load(x + i) * inv_rms);
    store(out + i, load(weight + i) * normed);
  }
  for (; i < n; ++i) out[i] = T(float(weight[i]) * float(T(float(x[i]) * inv_rms)));
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x.data_ptr<T>() + r * x.stride(0);
      const float inv_rms = 1.f / std::sqrt(sum_squares(xr, n) / n + eps);
      scale_row(xr, w, inv_rms, out.data_ptr<T>() + r * out.stride(0), n);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [size] in x's dtype");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  DISPATCH_MODEL_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, weight, out, static_cast<float>(eps));
  });
  return out;
}

// residual = x + residual (rounded to T, as torch's add), then x = rms_norm(residual); in place.
template <typename T>
void add_rms_norm_rows(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                       float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x.data_ptr<T>() + r * x.stride(0);
      T* res = residual.data_ptr<T>() + r * residual.stride(0);
      int64_t i = 0;
      for (; i + kWidth <= n; i += kWidth) store(res + i, load(xr + i) + load(res + i));
      for (; i < n; ++i) res[i] = T(float(xr[i]) + float(res[i]));
      const float inv_rms = 1.f / std::sqrt(sum_squares(res, n) / n + eps);
      scale_row(res, w, inv_rms, xr, n);
    }
  });
}

void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have one shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [size] in x's dtype");
  DISPATCH_MODEL_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x, residual, weight, static_cast<float>(eps));
  });
}

// GPT-NeoX rotation of each head of one token: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
// over the two halves, with cos/sin the token's first head_dim / 2 angles.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const T* cos,
                  const T* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_stride;
    T* x2 = x1 + half;
    int64_t i = 0;
    for (; i + kWidth <= half; i += kWidth) {
      const vfloat a = load(x1 + i), b = load(x2 + i), c = load(cos + i), s = load(sin + i);
      const vfloat first = round_to<T>(a * c) - round_to<T>(b * s);
      const vfloat second = round_to<T>(b * c) + round_to<T>(a * s);
      store(x1 + i, first);
      store(x2 + i, second);
    }
    for (; i < half; ++i) {
      const float a = float(x1[i]), b = float(x2[i]), c = float(cos[i]), s = float(sin[i]);
      x1[i] = T(float(T(a * c)) - float(T(b * s)));
      x2[i] = T(float(T(b * c)) + float(T(a * s)));
    }
  }
}

void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              name, " must be a CPU tensor [num_tokens, num_heads, head_dim], head_dim contiguous");
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  const int64_t tokens = q.size(0), head_dim = q.size(2), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && k.size(0) == tokens && k.size(2) == head_dim,
              "q and k must have the same tokens and an even head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens &&
                  cos.size(1) >= half && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin must be [num_tokens, >= head_dim / 2] with contiguous rows");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share a dtype");
  DISPATCH_MODEL_TYPES(q.scalar_type(), "rotary", [&] {
    const int64_t row = (q.size(1) + k.size(1)) * head_dim;
    at::parallel_for(0, tokens, grain(row), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cos.data_ptr<scalar_t>() + t * cos.stride(0);
        const scalar_t* s = sin.data_ptr<scalar_t>() + t * sin.stride(0);
        rotate_heads(q.data_ptr<scalar_t>() + t * q.stride(0), q.size(1), q.stride(1), half, c,
                     s);
        rotate_heads(k.data_ptr<scalar_t>() + t * k.stride(0), k.size(1), k.stride(1), half, c,
                     s);
      }
    });
  });
}

// out = silu(gate) * up of x = [gate | up]: silu rounded to T, then the product.
template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), n = out.size(1);
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x.data_ptr<T>() + r * x.stride(0);
      const T* up = gate + n;
      T* o = out.data_ptr<T>() + r * out.stride(0);
      int64_t i = 0;
      for (; i + kWidth <= n; i += kWidth) {
        const vfloat g = load(gate + i);
        const vfloat act = round_to<T>(g / (exp_approx(-g) + 1.f));
        store(o + i, act * load(up + i));
      }
      for (; i < n; ++i) {
        const float g = float(gate[i]);
        o[i] = T(float(T(g / (1.f + std::exp(-g)))) * float(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [num_tokens, 2 * size]");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  DISPATCH_MODEL_TYPES(x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x, out);
  });
  return out;
}

// Token t's key and value rows into slot slots[t] of the caches; a slot of -1 is skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slots) {
  check_heads(key, "key");
  check_heads(value, "value");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) + (k_cache.scalar_type() == at::kChar ? kScaleBytes : 0) ==
                      k_cache.size(3),
              "key and value must be [num_tokens, num_kv_heads, head_dim] of the caches (int8 "
              "rows: head_dim + 2 scale bytes)");
  const auto cache_type = k_cache.scalar_type();
  const bool int8_rows = cache_type == at::kChar;
  const bool eight_bit =
      cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2 || int8_rows;
  TORCH_CHECK(cache_type == v_cache.scalar_type() && key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == cache_type || eight_bit),
              "key and value must be in the caches' dtype, or the caches 8-bit");
  TORCH_CHECK(key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "each token's heads must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == key.size(0),
              "slots must be int64 [num_tokens]");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  if (int8_rows || (eight_bit && key.scalar_type() != cache_type)) {
    // Each (token, head) row widened to float32, then written as the cache holds it: int8
    // values with their scale, or 8-bit floats. Every 8-bit cache row is `row` bytes.
    const int64_t heads = key.size(1), dim = key.size(2), row = k_cache.size(3);
    const int64_t* slot = slots.data_ptr<int64_t>();
    DISPATCH_MODEL_TYPES(key.scalar_type(), "write_kv_8bit", [&] {
      std::vector<float> widened(dim);
      const auto write_row = [&](char* out) {
        if (int8_rows) {
          quantize_row(widened.data(), dim, reinterpret_cast<int8_t*>(out));
        } else if (cache_type == at::kFloat8_e4m3fn) {
          auto* fp8 = reinterpret_cast<c10::Float8_e4m3fn*>(out);
          for (int64_t i = 0; i < dim; ++i) fp8[i] = to_cache<c10::Float8_e4m3fn>(widened[i]);
        } else {
          auto* fp8 = reinterpret_cast<c10::Float8_e5m2*>(out);
          for (int64_t i = 0; i < dim; ++i) fp8[i] = to_cache<c10::Float8_e5m2>(widened[i]);
        }
      };
      for (const auto& [x, cache] : {std::pair{&key, &k_cache}, std::pair{&value, &v_cache}}) {
        const scalar_t* src = x->data_ptr<scalar_t>();
        auto* dst = static_cast<char*>(cache->data_ptr());
        for (int64_t t = 0; t < x->size(0); ++t) {
          if (slot[t] < 0) continue;
          TORCH_CHECK(slot[t] < capacity, "slot ", slot[t], " is outside the cache");
          for (int64_t h = 0; h < heads; ++h) {
            const scalar_t* in = src + t * x->stride(0) + h * dim;
            for (int64_t i = 0; i < dim; ++i) widened[i] = float(in[i]);
            write_row(dst + (slot[t] * heads + h) * row);
          }
        }
      }
    });
    return;
  }
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  const int64_t k_step = key.stride(0) * key.element_size();
  const int64_t v_step = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < key.size(0); ++t) {
    if (slot[t] < 0) continue;
    TORCH_CHECK(slot[t] < capacity, "slot ", slot[t], " is outside the cache");
    std::memcpy(kc + slot[t] * row_bytes, kp + t * k_step, row_bytes);
    std::memcpy(vc + slot[t] * row_bytes, vp + t * v_step, row_bytes);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        &add_rms_norm);
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()",
        &rotary_embedding);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots) -> ()",
      &write_kv);
}
