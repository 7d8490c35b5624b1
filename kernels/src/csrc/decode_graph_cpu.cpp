// A decode step's decoder layers as one call: every layer of a Llama-family model (norms,
// fused q/k/v, per-head q/k norms, rotary embedding, KV write, paged decode attention, output
// projection, gated MLP) run from C++ over the library's own ops, the weights in float32
// panels (panel_linear) or kept quantized (quant_linear).
// In Python the same sequence is about a dozen operator calls and as many module calls a
// layer; run from here a decode step saves more than the interpreter's own time: the
// operators themselves ran slower with Python between them (docs/design/kernels.md).
// The ops are reached through the dispatcher, so each runs exactly as it does from Python
// (same checks, same numerics): the results are the eager forward's, bit for bit.
#include "aten.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// Per layer, in this order: `norms` input and post-attention; `weights`, `scales`, `mins`,
// `biases` and `linears` (3 ints each: kind, bits, group size) qkv, o, gate/up, down;
// `qk_norms` q and k.
constexpr int64_t kNorms = 2;
constexpr int64_t kLinears = 4;
constexpr int64_t kLinearInts = 3;
constexpr int64_t kQkNorms = 2;
constexpr int64_t kPanels = 0, kQuantized = 1;  // a linear's kind

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                      const OptTensor&)>
      linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&)>(
          "pagedllm_cpu::panel_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const OptTensor&, int64_t, int64_t)>
      quant_linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const OptTensor&, int64_t, int64_t)>(
          "pagedllm_cpu::quant_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("pagedllm_cpu::rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>
      add_rms_norm = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>(
          "pagedllm_cpu::add_rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&)>
      rotary = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "pagedllm_cpu::rotary_embedding");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      op<at::Tensor(const at::Tensor&)>("pagedllm_cpu::silu_and_mul");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                const at::Tensor&)>
      write_kv = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                         const at::Tensor&)>("pagedllm_cpu::write_kv");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, int64_t)>
      attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t)>(
          "pagedllm_cpu::paged_decode_attention");
};

const Ops& ops() {
  static const Ops instance;  // looked up once, after every fragment of the library loaded
  return instance;
}

// One of a layer's projections, y = x W^T (+ bias), as PackableLinear runs it.
struct Linear {
  const at::Tensor& weight;
  const OptTensor scales, mins, bias;
  const int64_t* ints;  // kind, bits, group size
  int64_t out_features;

  at::Tensor operator()(const Ops& o, const at::Tensor& x) const {
    if (ints[0] == kPanels) return o.linear.call(x, weight, out_features, bias);
    const at::Tensor y = o.quant_linear.call(x, weight, *scales, mins, ints[1], ints[2]);
    return bias.has_value() ? y.add(*bias) : y;
  }
};

// shape: num_heads, num_kv_heads, head_dim, hidden_size, qkv out_features, gate/up
// out_features. Returns the final norm of the last layer's output, as the eager forward does;
// `x` (the embeddings) becomes the residual stream.
at::Tensor decode_layers(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList norms, at::TensorList weights,
                         const c10::List<OptTensor>& scales, const c10::List<OptTensor>& mins,
                         const c10::List<OptTensor>& biases, at::IntArrayRef linears,
                         const c10::List<OptTensor>& qk_norms, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& slots,
                         at::IntArrayRef shape, at::IntArrayRef windows, double eps, double scale,
                         const at::Tensor& final_norm) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const auto per_layer = [&](size_t size, int64_t each) {
    return static_cast<int64_t>(size) == each * layers;
  };
  TORCH_CHECK(shape.size() == 6, "decode_layers: shape is 6 sizes");
  TORCH_CHECK(per_layer(norms.size(), kNorms) && per_layer(weights.size(), kLinears) &&
                  per_layer(scales.size(), kLinears) && per_layer(mins.size(), kLinears) &&
                  per_layer(biases.size(), kLinears) &&
                  per_layer(linears.size(), kLinears * kLinearInts) &&
                  per_layer(qk_norms.size(), kQkNorms) && per_layer(v_caches.size(), 1) &&
                  per_layer(windows.size(), 1),
              "decode_layers: per-layer lists of different lengths");
  for (int64_t i = 0; i < kLinears * layers; ++i) {
    const int64_t kind = linears[kLinearInts * i];
    TORCH_CHECK(kind == kPanels || (kind == kQuantized && scales.get(i).has_value()),
                "decode_layers: a linear is in panels, or quantized with its scales");
  }
  TORCH_CHECK(x.dim() == 2 && x.size(0) == seq_lens.size(0),
              "decode_layers: one token per sequence");
  const int64_t heads = shape[0], kv_heads = shape[1], head_dim = shape[2], hidden = shape[3];
  const int64_t qkv_out = shape[4], gate_up_out = shape[5];
  const int64_t tokens = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(qkv_out == q_size + 2 * kv_size, "decode_layers: q/k/v sizes do not add up");
  const Ops& o = ops();
  at::Tensor residual = x;
  at::Tensor h;  // the last layer's MLP output
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* norm = norms.data() + kNorms * l;
    const auto linear = [&](int64_t i, int64_t out_features) {
      const int64_t at = kLinears * l + i;
      return Linear{weights[at],         scales.get(at), mins.get(at), biases.get(at),
                    linears.data() + kLinearInts * at, out_features};
    };
    at::Tensor normed;
    if (l == 0) {
      normed = o.rms_norm.call(residual, norm[0], eps);
    } else {
      o.add_rms_norm.call(h, residual, norm[0], eps);
      normed = h;
    }
    const at::Tensor qkv = linear(0, qkv_out)(o, normed);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
    const OptTensor q_norm = qk_norms.get(kQkNorms * l), k_norm = qk_norms.get(kQkNorms * l + 1);
    if (q_norm.has_value()) {
      // Heads as rows, a copy of each strided view, as the eager RMSNorm does.
      q = o.rms_norm.call(q.reshape({-1, head_dim}), *q_norm, eps).view(q.sizes());
      k = o.rms_norm.call(k.reshape({-1, head_dim}), *k_norm, eps).view(k.sizes());
    }
    o.rotary.call(q, k, cos, sin);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    o.write_kv.call(k, v, k_cache, v_cache, slots);
    const at::Tensor attended =
        o.attention.call(q, k_cache, v_cache, block_tables, seq_lens, scale, windows[l]);
    at::Tensor projected = linear(1, hidden)(o, attended.view({tokens, q_size}));
    o.add_rms_norm.call(projected, residual, norm[1], eps);
    const at::Tensor gate_up = linear(2, gate_up_out)(o, projected);
    h = linear(3, hidden)(o, o.silu_and_mul.call(gate_up));
  }
  if (layers == 0) return o.rms_norm.call(residual, final_norm, eps);
  o.add_rms_norm.call(h, residual, final_norm, eps);
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, "
      "Tensor?[] scales, Tensor?[] mins, Tensor?[] biases, int[] linears, Tensor?[] qk_norms, "
      "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor block_tables, Tensor seq_lens, "
      "Tensor slots, int[] shape, int[] windows, float eps, float scale, Tensor final_norm) -> "
      "Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
}
