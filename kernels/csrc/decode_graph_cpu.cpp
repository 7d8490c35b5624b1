// A decode step's decoder layers as one call: every layer of a Llama-family model (norms,
// fused q/k/v, per-head q/k norms, rotary embedding, KV write, paged decode attention, output
// projection, gated MLP) run from C++ over the library's own ops, weights packed in panels.
// In Python the same sequence is about a dozen operator calls and as many module calls a
// layer; between two matmuls that stream their weights from memory the interpreter's own
// working set is cold, and on a 30-layer model that glue took several milliseconds a step.
// The ops are reached through the dispatcher, so each runs exactly as it does from Python
// (same checks, same numerics): the results are the eager forward's, bit for bit.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// Per layer, in this order, in `weights` and `biases` and `qk_norms`.
constexpr int64_t kWeights = 6;  // input norm, qkv, o, post-attention norm, gate/up, down
constexpr int64_t kBiases = 4;   // qkv, o, gate/up, down
constexpr int64_t kQkNorms = 2;  // q, k

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                      const OptTensor&)>
      linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&)>(
          "pagedllm_cpu::panel_linear");
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

// shape: num_heads, num_kv_heads, head_dim, hidden_size, qkv out_features, gate/up
// out_features. Returns the final norm of the last layer's output, as the eager forward does;
// `x` (the embeddings) becomes the residual stream.
at::Tensor decode_layers(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, const c10::List<OptTensor>& biases,
                         const c10::List<OptTensor>& qk_norms, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& slots,
                         at::IntArrayRef shape, at::IntArrayRef windows, double eps, double scale,
                         const at::Tensor& final_norm) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(shape.size() == 6, "decode_layers: shape is 6 sizes");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * layers &&
                  static_cast<int64_t>(biases.size()) == kBiases * layers &&
                  static_cast<int64_t>(qk_norms.size()) == kQkNorms * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decode_layers: per-layer lists of different lengths");
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
    const at::Tensor* w = weights.data() + kWeights * l;
    const auto bias = [&](int64_t i) { return biases.get(kBiases * l + i); };
    at::Tensor normed;
    if (l == 0) {
      normed = o.rms_norm.call(residual, w[0], eps);
    } else {
      o.add_rms_norm.call(h, residual, w[0], eps);
      normed = h;
    }
    const at::Tensor qkv = o.linear.call(normed, w[1], qkv_out, bias(0));
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
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
    at::Tensor projected = o.linear.call(attended.view({tokens, q_size}), w[2], hidden, bias(1));
    o.add_rms_norm.call(projected, residual, w[3], eps);
    const at::Tensor gate_up = o.linear.call(projected, w[4], gate_up_out, bias(2));
    h = o.linear.call(o.silu_and_mul.call(gate_up), w[5], hidden, bias(3));
  }
  if (layers == 0) return o.rms_norm.call(residual, final_norm, eps);
  o.add_rms_norm.call(h, residual, final_norm, eps);
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, "
      "Tensor?[] qk_norms, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor block_tables, "
      "Tensor seq_lens, Tensor slots, int[] shape, int[] windows, float eps, float scale, "
      "Tensor final_norm) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
}
