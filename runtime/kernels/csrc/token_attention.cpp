// depctl_native::token_attention: the attention of a compiled decode or verify pass (runtime/kernels/native.py).
//
// Every token of the pass's flat stream attends its own cache row, from position 0 up to its own position, alone.
// A token's attention is one work item per kv head: its grouped query heads against the row's keys (one read of each
// key for the whole group), a softmax in float, the weighted sum of the row's values. The same code computes a token
// whatever else is in the pass, on whichever thread, so a token rounds the same in a plain step, in a verify pass of
// nine and beside other rows: what speculation's exactness rests on.
//
// Why not ATen's scaled_dot_product_attention once per token: its CPU flash kernel is built for long query blocks;
// for one query token its set-up (buffers, an sgemm on tiny matrices) costs several times the arithmetic. The loops here use ATen's vector types (at::vec, built for this CPU's
// instruction set as inductor builds its own kernels) and its exp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Unroll.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

// ---- scores in blocks of 16 keys (AVX-512) ----
// The loops above reduce each key's vector of partial products to its score on its own: a horizontal sum per key
// and query head, most of a verify pass's attention. Here
// 16 keys' vectors are summed together by one fixed tree of shuffles and adds (`sum_lanes`: 15 adds for 16 keys
// instead of 60), and a bf16 cache is multiplied by AVX-512 BF16's dot product of pairs (vdpbf16ps) without converting
// a key. A key's score is still a function of the query and that key alone (its own lanes, in a fixed order; the
// block's other keys, or the zeros standing in for missing ones, never enter it), so a token's attention does not
// depend on the pass, the thread or its length beyond the keys it sees.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define DEPCTL_TREE_SCORES 1
#define DEPCTL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
constexpr int64_t TREE_MAX_DIM = 256;  // a query's chunks stay in registers up to this head size

// lane i of the result = the sum of a[i]'s 16 lanes: 256-bit halves, then 128-bit quarters, pairs, single lanes
DEPCTL_BF16_TARGET inline __m512 sum_lanes(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // quarters 0-1 of b[i]: a[2i]'s halves added; 2-3: a[2i + 1]'s
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // quarter k of c[i]: a[4i + k]'s four partial sums
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // quarter k of d[i]: two partials of a[8i + k], two of a[8i + 4 + k]
    d[i] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[2 * i]), _mm512_castps_pd(c[2 * i + 1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[2 * i]), _mm512_castps_pd(c[2 * i + 1]))));
  // lane 4k + m: the sum of a[4m + k]; back to lane i for a[i]
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

DEPCTL_BF16_TARGET inline void store_scores(float* to, __m512 sums, float scale, int64_t n) {
  const __m512 scaled = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
  if (n == 16) {
    _mm512_storeu_ps(to, scaled);
  } else {
    _mm512_mask_storeu_ps(to, static_cast<__mmask16>((1u << n) - 1), scaled);
  }
}

// How a chunk of a query and of a key multiply into 16 float32 lanes: float32, 16 values a fused multiply-add; bf16
// (AVX-512 BF16), 32 values a dot product of pairs (vdpbf16ps), the key never converted
struct Float32Chunk {
  using T = float;
  static constexpr int64_t width = 16;
  DEPCTL_BF16_TARGET static __m512i load(const T* p, uint32_t mask) {
    return _mm512_castps_si512(_mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), p));
  }
  DEPCTL_BF16_TARGET static __m512 multiply_add(__m512 sum, __m512i q, __m512i k) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(q), _mm512_castsi512_ps(k), sum);
  }
};
struct Bf16Chunk {
  using T = uint16_t;
  static constexpr int64_t width = 32;
  DEPCTL_BF16_TARGET static __m512i load(const T* p, uint32_t mask) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>(mask), p);
  }
  DEPCTL_BF16_TARGET static __m512 multiply_add(__m512 sum, __m512i q, __m512i k) {
    return _mm512_dpbf16_ps(sum, (__m512bh)q, (__m512bh)k);
  }
};

// scores[g, j] = scale * q_g . k_j, 16 keys at a time: each key's lanes accumulate chunk by chunk in order, then
// `sum_lanes` adds each key's lanes
template <typename Chunk, int G>
DEPCTL_BF16_TARGET void tree_scores_of(const typename Chunk::T* query, int64_t query_stride, float scale,
                                       const typename Chunk::T* keys, int64_t key_stride, int64_t length, int64_t dim,
                                       float* scores) {
  constexpr int64_t width = Chunk::width;
  const int64_t chunks = (dim + width - 1) / width;
  const uint32_t all = width == 32 ? ~0u : (1u << width) - 1;
  const uint32_t tail = dim % width ? (1u << (dim % width)) - 1 : all;
  for (int g = 0; g < G; ++g) {
    const typename Chunk::T* qg = query + g * query_stride;
    for (int64_t j = 0; j < length; j += 16) {
      const int64_t n = std::min<int64_t>(16, length - j);
      __m512 sum[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) sum[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t mask = c + 1 < chunks ? all : tail;
        const __m512i qc = Chunk::load(qg + width * c, mask);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          if (i < n) sum[i] = Chunk::multiply_add(sum[i], qc, Chunk::load(keys + (j + i) * key_stride + width * c, mask));
      }
      store_scores(scores + g * length + j, sum_lanes(sum), scale, n);
    }
  }
}

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");
  return has;
}
bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return has;
}
#endif

// scores[g, j] = scale * q_g . k_j through the blocks of 16 keys where this build and CPU have them (float32 with
// AVX-512, bf16 with AVX-512 BF16; heads up to TREE_MAX_DIM); false: the caller's loops compute them
template <typename T, int G>
bool tree_scores(const T* query, int64_t query_stride, float scale, const T* keys, int64_t key_stride, int64_t length,
                 int64_t dim, float* scores) {
#ifdef DEPCTL_TREE_SCORES
  if (dim <= TREE_MAX_DIM) {
    if constexpr (std::is_same_v<T, float>) {
      if (cpu_has_avx512()) {
        tree_scores_of<Float32Chunk, G>(query, query_stride, scale, keys, key_stride, length, dim, scores);
        return true;
      }
    } else if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (cpu_has_bf16_dot()) {
        tree_scores_of<Bf16Chunk, G>(reinterpret_cast<const uint16_t*>(query), query_stride, scale,
                                     reinterpret_cast<const uint16_t*>(keys), key_stride, length, dim, scores);
        return true;
      }
    }
  }
#endif
  return false;
}

// One token's attention for `G` query heads of one kv head (the first at `query`, the next `query_stride` on) against
// keys 0..length-1 of one cache row's head; out: G x dim, `out_stride` apart. G is a template parameter so that the
// group's running sums live in registers: each key and value vector is read once for the whole group.
template <typename T, int G>
void attend(const T* query, int64_t query_stride, float scale, const T* keys, const T* values, int64_t key_stride,
            int64_t length, int64_t dim, T* out, int64_t out_stride) {
  thread_local std::vector<float> buffer;  // no allocation a call once a thread has seen its longest row
  const int64_t lanes = Vec::size(), full = dim - dim % lanes;
  buffer.resize(G * (dim + length));
  float* q = buffer.data();     // [G, dim], scaled, in float
  float* scores = q + G * dim;  // [G, length]
  const auto each_head = [](const auto& f) { c10::ForcedUnroll<G>{}(f); };  // unrolled: the sums stay in registers
  // scores[g, j] = q_g . k_j
  if (!tree_scores<T, G>(query, query_stride, scale, keys, key_stride, length, dim, scores)) {
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = static_cast<float>(query[g * query_stride + d]) * scale;
  for (int64_t j = 0; j < length; ++j) {
    const T* k = keys + j * key_stride;
    Vec sum[G];
    each_head([&](auto g) { sum[g] = Vec(0.f); });
    for (int64_t d = 0; d < full; d += lanes) {
      const Vec kd = load_float(k + d);
      each_head([&](auto g) { sum[g] = at::vec::fmadd(Vec::loadu(q + g * dim + d), kd, sum[g]); });
    }
    each_head([&](auto g) {
      float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum[g]);
      for (int64_t d = full; d < dim; ++d) total += q[g * dim + d] * static_cast<float>(k[d]);
      scores[g * length + j] = total;
    });
  }
  }
  // softmax over each head's scores, in place
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * length;
    const float max = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, s, length);
    at::vec::map([max](Vec x) { return (x - Vec(max)).exp_u20(); }, s, s, length);
    const float inverse = 1.f / at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, s, length);
    at::vec::map([inverse](Vec x) { return x * Vec(inverse); }, s, s, length);
  }
  // out_g = sum_j p[g, j] v_j, W vectors of dimensions at a time (the group's W x G sums in registers: all of a
  // 64-wide head in one sweep of the values with AVX-512); each lane sums over j in order whatever W is
  const auto store = [&](const Vec& sum, int g, int64_t d) {
    float lane[Vec::size()];
    sum.store(lane);
    for (int64_t i = 0; i < lanes; ++i) out[g * out_stride + d + i] = static_cast<T>(lane[i]);
  };
  const auto weigh = [&](auto width, int64_t d) {
    constexpr int W = decltype(width)::value;
    const auto each_vector = [](const auto& f) { c10::ForcedUnroll<W>{}(f); };
    Vec sum[G][W];
    each_head([&](auto g) { each_vector([&](auto w) { sum[g][w] = Vec(0.f); }); });
    for (int64_t j = 0; j < length; ++j) {
      const T* v = values + j * key_stride + d;
      Vec vj[W];
      each_vector([&](auto w) { vj[w] = load_float(v + w * lanes); });
      each_head([&](auto g) {
        const Vec p(scores[g * length + j]);
        each_vector([&](auto w) { sum[g][w] = at::vec::fmadd(p, vj[w], sum[g][w]); });
      });
    }
    each_head([&](auto g) { each_vector([&](auto w) { store(sum[g][w], g, d + w * lanes); }); });
  };
  constexpr int WIDE = Vec::size() >= 16 && G <= 6 ? 4 : 2;  // G * W + W + 1 vectors within the register file
  int64_t d = 0;
  for (; d + WIDE * lanes <= full; d += WIDE * lanes) weigh(std::integral_constant<int, WIDE>{}, d);
  for (; d < full; d += lanes) weigh(std::integral_constant<int, 1>{}, d);
  for (d = full; d < dim; ++d) {
    for (int g = 0; g < G; ++g) {
      float total = 0.f;
      for (int64_t j = 0; j < length; ++j) total += scores[g * length + j] * static_cast<float>(values[j * key_stride + d]);
      out[g * out_stride + d] = static_cast<T>(total);
    }
  }
}

// `groups` query heads of one kv head, in blocks of up to 8 (a block's sums in registers)
template <typename T>
void attend_group(const T* query, int64_t query_stride, float scale, const T* keys, const T* values,
                  int64_t key_stride, int64_t length, int64_t groups, int64_t dim, T* out, int64_t out_stride) {
  for (int64_t first = 0; first < groups; first += 8) {
    const T* q = query + first * query_stride;
    T* o = out + first * out_stride;
    const auto call = [&](auto block) {
      attend<T, decltype(block)::value>(q, query_stride, scale, keys, values, key_stride, length, dim, o, out_stride);
    };
    switch (std::min<int64_t>(groups - first, 8)) {
      case 1: call(std::integral_constant<int, 1>{}); break;
      case 2: call(std::integral_constant<int, 2>{}); break;
      case 3: call(std::integral_constant<int, 3>{}); break;
      case 4: call(std::integral_constant<int, 4>{}); break;
      case 5: call(std::integral_constant<int, 5>{}); break;
      case 6: call(std::integral_constant<int, 6>{}); break;
      case 7: call(std::integral_constant<int, 7>{}); break;
      default: call(std::integral_constant<int, 8>{}); break;
    }
  }
}

// query [1, heads, T, dim]; keys, values [rows, kv_heads, capacity, dim] (the cache layer, after this pass's keys
// were written); rows, positions [T] int64 (token t sits in cache row rows[t] at position positions[t]).
// Returns [1, T, heads, dim], contiguous.
at::Tensor token_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& rows, const at::Tensor& positions, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1, "token_attention: query must be [1, heads, T, dim]");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.strides() == values.strides(),
              "token_attention: keys and values must be [rows, kv_heads, capacity, dim] alike");
  TORCH_CHECK(keys.stride(3) == 1 && keys.scalar_type() == query.scalar_type() &&
              values.scalar_type() == query.scalar_type(),
              "token_attention: the cache must be contiguous in its last dimension and of the query's dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && rows.is_cpu() &&
              positions.is_cpu(), "token_attention: rows and positions must be int64 CPU tensors");
  const int64_t heads = query.size(1), tokens = query.size(2), dim = query.size(3);
  const int64_t kv_heads = keys.size(1), groups = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(3) == dim, "token_attention: query heads do not match the cache");
  TORCH_CHECK(rows.numel() == tokens && positions.numel() == tokens, "token_attention: one row and position a token");
  const auto row_of = rows.contiguous(), position_of = positions.contiguous();
  const int64_t* row = row_of.data_ptr<int64_t>();
  const int64_t* position = position_of.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(row[t] >= 0 && row[t] < keys.size(0) && position[t] >= 0 && position[t] < keys.size(2),
                "token_attention: token ", t, " at row ", row[t], ", position ", position[t], " is outside the cache");
    work += (position[t] + 1) * heads * dim;
  }

  const auto q = query.stride(3) == 1 ? query : query.contiguous();
  auto out = at::empty({1, tokens, heads, dim}, query.options());
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* qs = q.data_ptr<scalar_t>();
    const int64_t head_step = q.stride(1), token_step = q.stride(2);
    const scalar_t* ks = keys.data_ptr<scalar_t>();
    const scalar_t* vs = values.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    const int64_t row_stride = keys.stride(0), head_stride = keys.stride(1), key_stride = keys.stride(2);
    // one item per (token, kv head); a pass too small to be worth a second thread runs on this one
    const int64_t items = tokens * kv_heads, grain = work < (1 << 17) ? items : 1;
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / kv_heads, h = i % kv_heads;
        const int64_t offset = row[t] * row_stride + h * head_stride;
        attend_group<scalar_t>(qs + t * token_step + h * groups * head_step, head_step, static_cast<float>(scale),
                         ks + offset, vs + offset, key_stride, position[t] + 1, groups, dim,
                         os + (t * heads + h * groups) * dim, dim);
      }
    });
  };
  switch (query.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "token_attention: float32, bfloat16 or float16 only, not ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(depctl_native, m) {
  m.def("token_attention(Tensor query, Tensor keys, Tensor values, Tensor rows, Tensor positions, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(depctl_native, CPU, m) { m.impl("token_attention", token_attention); }
