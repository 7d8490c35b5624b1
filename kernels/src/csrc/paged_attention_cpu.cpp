// Paged decode attention for the CPU: one query per sequence against its cached KV, read in
// place through the block table (no gather), softmax in float32.
//
// Layout as in pagedllm/kernels/reference.py: caches [num_blocks, block_size, num_kv_heads,
// head_dim], block_tables [num_seqs, max_blocks] int32, q [num_seqs, num_heads, head_dim].
// The caches hold q's dtype or 8-bit floats, widened in registers as each row is read.
//
// A work item is one KV head of one sequence. Its keys are walked block by block (no division
// per key), the next block's rows prefetched. The common head sizes (64, 128) take a path
// written with GCC/Clang vector extensions (the compiler picks AVX2, AVX-512 or NEON): a tile
// of up to four query heads of the KV head's group shares each K and V row it loads, with the
// query and output rows in registers, and the softmax uses a vectorized polynomial exp. Other
// head sizes take plain loops.
#include "vec.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace pagedllm_vec;

// The sums of G <= 4 vectors, into sums[g * stride]: a tree of shuffles (an AVX-512 vector's
// halves added, then horizontal adds of all G at once), not a chain of kWidth scalar adds per
// vector, which cost more than the dot products themselves.
template <int G>
inline void store_sums(const vfloat* acc, float* sums, int64_t stride) {
#if defined(__AVX__)
  __m256 half[4];
  for (int g = 0; g < G; ++g) {
#if defined(__AVX512F__)
    const __m512 a = (__m512)acc[g];
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    half[g] = _mm256_add_ps(_mm512_castps512_ps256(a), high);
#else
    half[g] = (__m256)acc[g];
#endif
  }
  const __m256 zero = _mm256_setzero_ps();
  const __m256 ab = _mm256_hadd_ps(half[0], G > 1 ? half[1] : zero);
  const __m256 cd = _mm256_hadd_ps(G > 2 ? half[2] : zero, G > 3 ? half[3] : zero);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  float four[4];
  _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  for (int g = 0; g < G; ++g) sums[g * stride] = four[g];
#else
  for (int g = 0; g < G; ++g) sums[g * stride] = sum(acc[g]);
#endif
}

// ``n`` rounded up to whole vectors: rows of scores are this long.
inline int64_t padded(int64_t n) { return (n + kWidth - 1) / kWidth * kWidth; }

// Softmax of each of ``heads`` rows of ``n`` scores, in place. Rows are ``stride`` apart and
// have room up to padded(n).
void softmax_rows(float* scores, int64_t heads, int64_t n, int64_t stride) {
  const int64_t end = padded(n);
  for (int64_t h = 0; h < heads; ++h) {
    float* w = scores + h * stride;
    for (int64_t i = n; i < end; ++i) w[i] = -std::numeric_limits<float>::infinity();
    vfloat top = splat(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < end; i += kWidth) {
      const vfloat x = load(w + i);
      top = x > top ? x : top;
    }
    float m = top[0];
    for (int i = 1; i < kWidth; ++i) m = std::max(m, top[i]);
    vfloat total = {};
    for (int64_t i = 0; i < end; i += kWidth) {
      vfloat e = exp_approx(load(w + i) - m);
      e = load(w + i) == splat(-std::numeric_limits<float>::infinity()) ? splat(0.f) : e;
      total += e;
      std::memcpy(w + i, &e, sizeof e);
    }
    const float inv = n > 0 ? 1.f / sum(total) : 0.f;
    for (int64_t i = 0; i < end; i += kWidth) {
      const vfloat x = load(w + i) * inv;
      std::memcpy(w + i, &x, sizeof x);
    }
  }
}

struct Job {
  int64_t first, len, block_size, token_stride, block_stride;
  const int32_t* table;

  int64_t keys() const { return std::max<int64_t>(len - first, 0); }

  // Calls ``f(i, row)`` for each key: its index from ``first`` and its ``dim`` elements in
  // ``cache`` (already offset to one KV head), block by block, with the next block's rows
  // prefetched while this one is read.
  template <typename T, typename F>
  void for_each_key(const T* cache, int64_t dim, F&& f) const {
    constexpr int64_t scale_bytes = std::is_same_v<T, int8_t> ? kScaleBytes : 0;
    const int64_t last = (len - 1) / block_size;
    for (int64_t b = first / block_size; b * block_size < len; ++b) {
      const T* base = cache + int64_t(table[b]) * block_stride;
      if (b < last) {
        const char* next = reinterpret_cast<const char*>(cache + int64_t(table[b + 1]) * block_stride);
        for (int64_t r = 0; r < block_size; ++r)
          for (int64_t byte = 0; byte < dim * int64_t(sizeof(T)) + scale_bytes; byte += 64)
            __builtin_prefetch(next + r * token_stride * int64_t(sizeof(T)) + byte);
      }
      const int64_t start = std::max(first, b * block_size);
      const int64_t stop = std::min(len, (b + 1) * block_size);
      for (int64_t t = start; t < stop; ++t)
        f(t - first, base + (t - b * block_size) * token_stride);
    }
  }
};

// G query heads of one KV head (``k``/``v`` point at that head's slot in the caches), head
// dimension V * kWidth: scores -> softmax -> weighted values into ``out`` (float).
template <typename T, int G, int V>
void attend_tile(const float* query, const T* k, const T* v, const Job& job, float* scores,
                 float* out) {
  const int64_t n = job.keys(), stride = padded(n);
  vfloat q[G][V];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) q[g][i] = load(query + (g * V + i) * kWidth);
  job.for_each_key(k, V * kWidth, [&](int64_t j, const T* key) {
    vfloat acc[G] = {};
    for (int i = 0; i < V; ++i) {
      const vfloat kv = load(key + i * kWidth);
      for (int g = 0; g < G; ++g) acc[g] += q[g][i] * kv;
    }
    if constexpr (std::is_same_v<T, int8_t>) {
      const float scale = row_scale(key, V * kWidth);
      for (int g = 0; g < G; ++g) acc[g] *= scale;
    }
    store_sums<G>(acc, scores + j, stride);
  });
  softmax_rows(scores, G, n, stride);
  vfloat o[G][V] = {};
  job.for_each_key(v, V * kWidth, [&](int64_t j, const T* value) {
    float p[G];
    const float scale = row_scale(value, V * kWidth);
    for (int g = 0; g < G; ++g) p[g] = scores[g * stride + j] * scale;
    for (int i = 0; i < V; ++i) {
      const vfloat vv = load(value + i * kWidth);
      for (int g = 0; g < G; ++g) o[g][i] += p[g] * vv;
    }
  });
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) std::memcpy(out + (g * V + i) * kWidth, &o[g][i], sizeof(vfloat));
}

template <typename T, int V>
void attend_group(const float* query, const T* k, const T* v, const Job& job, int64_t group,
                  float* scores, float* out) {
  constexpr int64_t dim = V * kWidth;
  for (int64_t g = 0; g < group;) {
    const int64_t left = group - g;
    const float* qg = query + g * dim;
    float* og = out + g * dim;
    if (left >= 4) {
      attend_tile<T, 4, V>(qg, k, v, job, scores, og);
      g += 4;
    } else if (left == 3) {
      attend_tile<T, 3, V>(qg, k, v, job, scores, og);
      g += 3;
    } else if (left == 2) {
      attend_tile<T, 2, V>(qg, k, v, job, scores, og);
      g += 2;
    } else {
      attend_tile<T, 1, V>(qg, k, v, job, scores, og);
      g += 1;
    }
  }
}

// Any head size: plain loops.
template <typename T>
void attend_group_plain(const float* query, const T* k, const T* v, const Job& job,
                        int64_t group, int64_t dim, float* scores, float* out) {
  const int64_t n = job.keys(), stride = padded(n);
  job.for_each_key(k, dim, [&](int64_t j, const T* key) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qh = query + g * dim;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qh[d] * float(key[d]);
      scores[g * stride + j] = dot * row_scale(key, dim);
    }
  });
  softmax_rows(scores, group, n, stride);
  std::fill(out, out + group * dim, 0.f);
  job.for_each_key(v, dim, [&](int64_t j, const T* value) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * stride + j] * row_scale(value, dim);
      for (int64_t d = 0; d < dim; ++d) out[g * dim + d] += p * float(value[d]);
    }
  });
}

// T: the queries' and output's dtype; C: the caches' (T, or an 8-bit float read in place).
template <typename T, typename C>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                      float scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t row = k_cache.size(3);  // head_dim, or head_dim + its scale for int8 rows
  const int64_t group = num_heads / num_kv_heads;
  const T* q_ptr = q.data_ptr<T>();
  const C* k_ptr = static_cast<const C*>(k_cache.data_ptr());
  const C* v_ptr = static_cast<const C*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  // int32 (the engine's step metadata) or int64 lengths, read once here rather than
  // converted by a tensor op per layer.
  std::vector<int64_t> lens_of(num_seqs);
  if (seq_lens.scalar_type() == at::kInt) {
    std::copy_n(seq_lens.data_ptr<int32_t>(), num_seqs, lens_of.begin());
  } else {
    std::copy_n(seq_lens.data_ptr<int64_t>(), num_seqs, lens_of.begin());
  }
  const int64_t* lens = lens_of.data();
  T* out_ptr = out.data_ptr<T>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t token_stride = num_kv_heads * row;
  const int64_t block_stride = block_size * token_stride;

  // A work item is one KV head of one sequence with its group of query heads. A task takes
  // at least kTaskKeys keys' worth of items: a parallel region costs more than a few short
  // items (a thread that another process holds its core from stalls it for a time slice).
  constexpr int64_t kTaskKeys = 2048;
  int64_t total_keys = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total_keys += lens[s];
  const int64_t items = num_seqs * num_kv_heads;
  const int64_t keys_per_item = std::max<int64_t>(1, total_keys / std::max<int64_t>(1, num_seqs));
  const int64_t grain = std::max<int64_t>(1, kTaskKeys / keys_per_item);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const Job job{window > 0 ? std::max<int64_t>(0, len - window) : 0, len, block_size,
                    token_stride, block_stride, tables + seq * table_stride};
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + seq * q_seq_stride + (kv_head * group + g) * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = float(src[d]) * scale;
      }
      scores.resize(group * padded(job.keys()));
      const C* k = k_ptr + kv_head * row;
      const C* v = v_ptr + kv_head * row;
      if constexpr (!std::is_same_v<C, double>) {
        if (head_dim == 4 * kWidth) {
          attend_group<C, 4>(query.data(), k, v, job, group, scores.data(), acc.data());
        } else if (head_dim == 8 * kWidth) {
          attend_group<C, 8>(query.data(), k, v, job, group, scores.data(), acc.data());
        } else {
          attend_group_plain<C>(query.data(), k, v, job, group, head_dim, scores.data(),
                                acc.data());
        }
      } else {
        attend_group_plain<C>(query.data(), k, v, job, group, head_dim, scores.data(),
                              acc.data());
      }
      T* dst = out_ptr + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) dst[i] = T(acc[i]);
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
  const auto cache_type = k_cache.scalar_type();
  const bool int8_rows = cache_type == at::kChar;
  const bool eight_bit =
      cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2 || int8_rows;
  TORCH_CHECK(cache_type == v_cache.scalar_type() && (q.scalar_type() == cache_type || eight_bit),
              "the caches must share a dtype: q's, an 8-bit float (float8_e4m3fn, "
              "float8_e5m2) or int8 rows with their scales");
  TORCH_CHECK(q.size(2) + (int8_rows ? kScaleBytes : 0) == k_cache.size(3) &&
                  q.size(1) % k_cache.size(2) == 0,
              "head_dim must match (int8 rows: head_dim + 2 scale bytes) and num_heads be a "
              "multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == q.size(0),
              "block_tables must be int32 [num_seqs, max_blocks]");
  TORCH_CHECK((seq_lens.scalar_type() == at::kLong || seq_lens.scalar_type() == at::kInt) &&
                  seq_lens.is_contiguous() && seq_lens.numel() == q.size(0),
              "seq_lens must be int32 or int64 [num_seqs]");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const float s = static_cast<float>(scale);
  if (!eight_bit) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
      decode_attention<scalar_t, scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, out, s,
                                           window);
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
      if (int8_rows) {
        decode_attention<scalar_t, int8_t>(q, k_cache, v_cache, block_tables, seq_lens, out, s,
                                           window);
      } else if (cache_type == at::kFloat8_e4m3fn) {
        decode_attention<scalar_t, c10::Float8_e4m3fn>(q, k_cache, v_cache, block_tables,
                                                       seq_lens, out, s, window);
      } else {
        decode_attention<scalar_t, c10::Float8_e5m2>(q, k_cache, v_cache, block_tables,
                                                     seq_lens, out, s, window);
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> Tensor",
      &paged_decode_attention);
}
