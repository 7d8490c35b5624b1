// Paged decode attention for the CPU: one query per sequence against its cached KV, read in
// place through the block table (no gather), softmax in float32.
//
// Layout as in pagedllm/kernels/reference.py: caches [num_blocks, block_size, num_kv_heads,
// head_dim], block_tables [num_seqs, max_blocks] int32, q [num_seqs, num_heads, head_dim].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                      float scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // A work item is a sequence and a range of its KV heads. Whole sequences read each token's
  // K/V row (all heads) in one sweep, which the memory system serves best; small batches are
  // split by KV head as well so that every thread has work.
  const int64_t chunks = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_chunk = num_kv_heads / chunks;

  at::parallel_for(0, num_seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = heads_per_chunk * group;  // query heads of one item
    std::vector<float> query(width * head_dim), acc(width * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / chunks, first_kv_head = item % chunks * heads_per_chunk;
      const int64_t first_head = first_kv_head * group;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = std::max<int64_t>(len - first, 0);
      const int32_t* table = tables + seq * table_stride;
      for (int64_t h = 0; h < width; ++h) {
        const T* src = q_ptr + seq * q_seq_stride + (first_head + h) * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) query[h * head_dim + d] = float(src[d]) * scale;
      }
      scores.resize(std::max<int64_t>(width * n, 1));
      for (int64_t t = first; t < len; ++t) {
        const T* row = k_ptr + int64_t(table[t / block_size]) * block_stride +
                       (t % block_size) * token_stride + first_kv_head * head_dim;
        for (int64_t h = 0; h < width; ++h) {
          const T* key = row + (h / group) * head_dim;
          const float* qh = query.data() + h * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * float(key[d]);
          scores[h * n + (t - first)] = dot;
        }
      }
      for (int64_t h = 0; h < width; ++h) {
        float* weights = scores.data() + h * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) top = std::max(top, weights[i]);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          weights[i] = std::exp(weights[i] - top);
          total += weights[i];
        }
        const float inv = n > 0 ? 1.f / total : 0.f;
        for (int64_t i = 0; i < n; ++i) weights[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const T* row = v_ptr + int64_t(table[t / block_size]) * block_stride +
                       (t % block_size) * token_stride + first_kv_head * head_dim;
        for (int64_t h = 0; h < width; ++h) {
          const T* value = row + (h / group) * head_dim;
          const float p = scores[h * n + (t - first)];
          float* ah = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * float(value[d]);
        }
      }
      T* dst = out_ptr + (seq * num_heads + first_head) * head_dim;
      for (int64_t i = 0; i < width * head_dim; ++i) dst[i] = T(acc[i]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == q.size(0),
              "block_tables must be int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0),
              "seq_lens must be int64 [num_seqs]");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_attention<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, out,
                               static_cast<float>(scale), window);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> Tensor",
      &paged_decode_attention);
}
