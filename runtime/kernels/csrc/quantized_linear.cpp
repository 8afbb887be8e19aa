// depctl_native::quantized_linear: matrix products over 4-bit or 8-bit weights in groups of 32 inputs, each group with
// its own scale and offset (w = scale * q + offset, q unsigned), activations in float32 or bf16
// (runtime/kernels/quantized.py: QuantizedLinear). The same bits for a row whatever else is in the pass.
//
// Why our own: a decode step reads every weight once, so on a CPU its cost is bytes. 4-bit weights with fp16 scales
// and offsets are 5 bits a weight (a third of bf16's); PyTorch's int4 CPU product unpacks them several times slower
// than memory delivers them on AVX2, and pays for it again on every row of a verify pass (BENCHMARKS.md, "The products"). Here a
// tile's weights are unpacked once for all of its rows.
//
// 8 bits: each weight widened to a float, one fused multiply-add a row (layout and order below). 4 bits: integer dot
// products over inputs rounded to int8 per group (further down), which is what makes 4 bits pay on AVX2.
//
// 8-bit layout (`quantized.pack`): blocks of L output features (L = the vector width in floats), each block K steps
// of L bytes, step k holding input k's weight for the L outputs. Scales and offsets: [blocks, groups, L] in fp16.
// Order: output n of row m is, for each group g in order, two chains of fused multiply-adds from zero over the
// group's even and odd inputs (x[k] * q[k] with q as float), added, and folded as acc = fma(sum, scale, acc);
// acc = fma(sum_x, offset, acc), where sum_x is the row's own sum of the group's inputs. The same instructions in one
// vector lane whatever the tile, the thread or the number of rows in the pass: a row rounds alike alone, in a verify
// pass and beside other rows (tested on every row count), which is what speculation's exactness rests on.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && \
    (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
constexpr int64_t GROUP = 32;  // inputs a scale covers, as GGUF's Q4_0, Q4_1, Q8_0 and Q4_K's sub-blocks
#if defined(CPU_CAPABILITY_AVX512)
constexpr int MAX_ROWS = 4;  // (2 chains + acc) x rows x blocks + the step's weights within 32 registers
#else
constexpr int MAX_ROWS = 2;  // ... within AVX2's 16
#endif
constexpr int MAX_BLOCKS = 2;

// The L bytes at p as L floats
inline Vec widen(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float f[L];
  for (int64_t i = 0; i < L; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// L fp16 values at p as floats
inline Vec halves(const at::Half* p) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  alignas(64) float f[L];
  for (int64_t i = 0; i < L; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// What a tile reads: MB rows of x (float32, `K` apart) and their group sums (`groups` apart), NB blocks of weights
// (each `steps` steps of L bytes, from w), their scales and offsets (each `groups` x L, from s and z)
struct Operands {
  const float* x;
  const float* x_sums;
  const uint8_t* w;
  const at::Half* s;
  const at::Half* z;
  int64_t K, groups, steps;

  // the same operands from row `row` of x on
  Operands at_row(int64_t row) const {
    Operands o = *this;
    o.x += row * K;
    o.x_sums += row * groups;
    return o;
  }
};

// MB rows by NB blocks into y (`y_stride` apart), the last block's first `last` outputs
template <int MB, int NB>
void tile(const Operands& op, float* y, int64_t y_stride, int64_t last) {
  constexpr int64_t steps_per_group = GROUP;
  Vec acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = Vec(0.f);
  for (int64_t g = 0; g < op.groups; ++g) {
    Vec even[MB][NB], odd[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) even[m][b] = odd[m][b] = Vec(0.f);
    for (int64_t step = g * steps_per_group; step < (g + 1) * steps_per_group; ++step) {
      // a step is one input; steps alternate between the two chains
      Vec q[NB];
      for (int b = 0; b < NB; ++b) q[b] = widen(op.w + (b * op.steps + step) * L);
      for (int m = 0; m < MB; ++m) {
        const Vec xk(op.x[m * op.K + step]);
        for (int b = 0; b < NB; ++b) {
          if (step % 2 == 0) {
            even[m][b] = at::vec::fmadd(xk, q[b], even[m][b]);
          } else {
            odd[m][b] = at::vec::fmadd(xk, q[b], odd[m][b]);
          }
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const Vec scale = halves(op.s + (b * op.groups + g) * L), offset = halves(op.z + (b * op.groups + g) * L);
      for (int m = 0; m < MB; ++m) {
        acc[m][b] = at::vec::fmadd(even[m][b] + odd[m][b], scale, acc[m][b]);
        acc[m][b] = at::vec::fmadd(Vec(op.x_sums[m * op.groups + g]), offset, acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b) {
      float* out = y + m * y_stride + b * L;
      if (b + 1 < NB || last == L) {
        acc[m][b].store(out);
      } else {
        acc[m][b].store(out, static_cast<int>(last));
      }
    }
}

template <int NB>
void over_rows(Operands op, int64_t M, float* y, int64_t N, int64_t last) {
  int64_t m = 0;
  for (; m + MAX_ROWS <= M; m += MAX_ROWS) tile<MAX_ROWS, NB>(op.at_row(m), y + m * N, N, last);
  if constexpr (MAX_ROWS > 3) {
    if (M - m == 3) tile<3, NB>(op.at_row(m), y + m * N, N, last), m += 3;
  }
  if constexpr (MAX_ROWS > 2) {
    if (M - m == 2) tile<2, NB>(op.at_row(m), y + m * N, N, last), m += 2;
  }
  if (M - m == 1) tile<1, NB>(op.at_row(m), y + m * N, N, last);
}

// ---- 8 bits, many rows (a prompt chunk, a wide verify pass) ----
// Widening a weight costs an instruction on the multiply-add ports, paid per tile of MAX_ROWS rows above. With many
// rows, a pair of blocks is widened to floats once (`widened`) and the tiles read floats; the group's sums live in a
// small buffer between groups rather than in registers, so a tile holds more rows. The same operations in the same
// order per output as `tile`: the same bits.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int WIDE_ROWS = 6;  // 2 chains x 6 rows x 2 blocks + 2 weights + 1 input within 32 registers
#else
constexpr int WIDE_ROWS = 3;  // ... 2 x 3 x 2 + 3 within AVX2's 16
#endif
constexpr int64_t WIDE_FROM = 6;  // rows from which a pass widens its weights first (a one-row step reads bytes)

template <int MB, int NB>
void wide_tile(const Operands& op, const float* wf, float* y, int64_t y_stride, int64_t last) {
  alignas(64) float acc[MB][NB][L] = {};
  for (int64_t g = 0; g < op.groups; ++g) {
    Vec even[MB][NB], odd[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int b = 0; b < NB; ++b) even[m][b] = odd[m][b] = Vec(0.f);
    for (int64_t step = g * GROUP; step < (g + 1) * GROUP; step += 2) {
      Vec q[NB];
      for (int b = 0; b < NB; ++b) q[b] = Vec::loadu(wf + (b * op.steps + step) * L);
      for (int m = 0; m < MB; ++m) {
        const Vec xk(op.x[m * op.K + step]);
        for (int b = 0; b < NB; ++b) even[m][b] = at::vec::fmadd(xk, q[b], even[m][b]);
      }
      for (int b = 0; b < NB; ++b) q[b] = Vec::loadu(wf + (b * op.steps + step + 1) * L);
      for (int m = 0; m < MB; ++m) {
        const Vec xk(op.x[m * op.K + step + 1]);
        for (int b = 0; b < NB; ++b) odd[m][b] = at::vec::fmadd(xk, q[b], odd[m][b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const Vec scale = halves(op.s + (b * op.groups + g) * L), offset = halves(op.z + (b * op.groups + g) * L);
      for (int m = 0; m < MB; ++m) {
        Vec a = at::vec::fmadd(even[m][b] + odd[m][b], scale, Vec::loadu(acc[m][b]));
        at::vec::fmadd(Vec(op.x_sums[m * op.groups + g]), offset, a).store(acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b) {
      float* out = y + m * y_stride + b * L;
      const Vec a = Vec::loadu(acc[m][b]);
      if (b + 1 < NB || last == L) {
        a.store(out);
      } else {
        a.store(out, static_cast<int>(last));
      }
    }
}

template <int NB>
void wide_rows(Operands op, const float* wf, int64_t M, float* y, int64_t N, int64_t last) {
  int64_t m = 0;
  for (; m + WIDE_ROWS <= M; m += WIDE_ROWS) wide_tile<WIDE_ROWS, NB>(op.at_row(m), wf, y + m * N, N, last);
  if constexpr (WIDE_ROWS > 4) {
    if (M - m >= 4) wide_tile<4, NB>(op.at_row(m), wf, y + m * N, N, last), m += 4;
  }
  if (M - m >= 2) wide_tile<2, NB>(op.at_row(m), wf, y + m * N, N, last), m += 2;
  if (M - m == 1) wide_tile<1, NB>(op.at_row(m), wf, y + m * N, N, last);
}

// nb blocks of bytes (each `steps` x L, one after another from w) as floats into wf
void widened(const uint8_t* w, int64_t nb, int64_t steps, float* wf) {
  for (int64_t i = 0; i < nb * steps; ++i) widen(w + i * L).store(wf + i * L);
}

void product(const Operands& op, int64_t M, int64_t count, float* y, int64_t N) {
  // a thread's share of blocks worth at least ~64k multiply-adds: tiny products stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (op.K * L * M));
  const int64_t block_bytes = op.steps * L, block_scales = op.groups * L;
  const bool wide = M >= WIDE_FROM;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(wide ? MAX_BLOCKS * block_bytes : 0);
    for (int64_t b = begin; b < end; b += MAX_BLOCKS) {
      Operands o = op;
      o.w += b * block_bytes;
      o.s += b * block_scales;
      o.z += b * block_scales;
      const int64_t nb = std::min<int64_t>(MAX_BLOCKS, end - b);
      const int64_t last = std::min<int64_t>(L, N - (b + nb - 1) * L);
      if (wide) {
        widened(o.w, nb, op.steps, wf.data());
        if (nb == 1) {
          wide_rows<1>(o, wf.data(), M, y + b * L, N, last);
        } else {
          wide_rows<MAX_BLOCKS>(o, wf.data(), M, y + b * L, N, last);
        }
      } else if (nb == 1) {
        over_rows<1>(o, M, y + b * L, N, last);
      } else {
        over_rows<MAX_BLOCKS>(o, M, y + b * L, N, last);
      }
    }
  });
  static_assert(MAX_BLOCKS == 2, "the branches above cover tiles of 1 and 2 blocks");
}


// ---- 4 bits: integer dot products ----
// The float loops above unpack a weight into a float and spend a fused multiply-add on it per row: on AVX2 that runs
// out of instructions long before memory runs out of bytes. For 4 bits, a row's inputs are rounded to int8 per group
// of 32 (scale max|x| / 127, as llama.cpp's Q8 activations), and a group's sum of products is taken in integers,
// exact: one vpmaddubsw multiplies 32 weights by 32 inputs. In integers the order of the sum cannot matter, so every
// row's result is again independent of the pass.
//
// Layout (`quantized.pack` with 4 bits): blocks of 8 outputs; per block and group, 4 runs of 32 bytes; in run p, byte
// 4 j + i holds output j's inputs 8 p + i (low nibble) and 8 p + 4 + i (high nibble), i < 4: one 32-bit lane is four
// consecutive inputs of one output, as vpmaddubsw with a broadcast of four inputs wants. Scales and offsets:
// [blocks, groups, 8] fp16.
constexpr int64_t DOT_WIDTH = 8;
constexpr int64_t RUN = 32;  // bytes a run
constexpr int DOT_ROWS = 4;    // a tile's 4 rows x 1 block of int16 sums, its weights and inputs: no spills on AVX2
constexpr int DOT_BLOCKS = 1;  // (4 x 2 and 6 x 1 measured no faster)
constexpr int64_t DOT_PREFETCH = 8;  // groups ahead

// A row's inputs as int8 per group: q (K), the groups' scales d and sums d * sum(q)
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
};

// One group: q = round(x * 127 / max|x|) to nearest even (what cvtps2dq does under the default rounding mode), with
// the vector loops and the plain ones giving the same bytes
void quantize_group(const float* xs, int8_t* q, float& d, float& sum) {
#if defined(__GNUC__) && (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(xs + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const float top = _mm_cvtss_f32(half);
  const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i ints[4], total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    ints[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
    total = _mm256_add_epi32(total, ints[j]);
  }
  // int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back
  const __m256i words = _mm256_packs_epi32(ints[0], ints[1]), words2 = _mm256_packs_epi32(ints[2], ints[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
  d = top / 127.f;
  sum = d * static_cast<float>(_mm_cvtsi128_si32(sum4));
#else
  float top = 0.f;
  for (int64_t k = 0; k < GROUP; ++k) top = std::max(top, std::abs(xs[k]));
  const float inverse = top > 0.f ? 127.f / top : 0.f;
  int32_t total = 0;
  for (int64_t k = 0; k < GROUP; ++k) {
    q[k] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(std::nearbyint(xs[k] * inverse)), -127, 127));
    total += q[k];
  }
  d = top / 127.f;
  sum = d * static_cast<float>(total);
#endif
}

// Reused by the calling thread from pass to pass (a step makes ~100 products)
const QuantizedRows& quantize_rows(const float* x, int64_t M, int64_t K) {
  thread_local QuantizedRows r;
  const int64_t groups = K / GROUP;
  r.q.resize(M * K);
  r.d.resize(M * groups);
  r.sums.resize(M * groups);
  for (int64_t i = 0; i < M * groups; ++i) quantize_group(x + i * GROUP, r.q.data() + i * GROUP, r.d[i], r.sums[i]);
  return r;
}

#if defined(__GNUC__) && (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
// MB rows by NB blocks (each `groups` x 128 bytes from w) into y (`N` apart), the last block's first `last` outputs
template <int MB, int NB>
void dot_tile(const QuantizedRows& x, int64_t row, int64_t K, const uint8_t* w, const at::Half* s, const at::Half* z,
              int64_t groups, float* y, int64_t N, int64_t last) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MB][NB];
  #pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // per group, 8 four-input steps of at most 2 * 15 * 127 each: at most 30480, within int16
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {  // the hardware prefetcher alone left a row's product at half the memory's speed
      const char* ahead = reinterpret_cast<const char*>(w + ((b * groups + g + DOT_PREFETCH) * 4) * RUN);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    __m256i sum[MB][NB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
  #pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) sum[m][b] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int p = 0; p < 4; ++p) {
      __m256i lo[NB], hi[NB];
  #pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const __m256i packed =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((b * groups + g) * 4 + p) * RUN));
        lo[b] = _mm256_and_si256(packed, nibble);
        hi[b] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      }
  #pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x.q.data() + (row + m) * K + g * GROUP + 8 * p;
        int32_t first, second;
        std::memcpy(&first, xq, 4);
        std::memcpy(&second, xq + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(first), x1 = _mm256_set1_epi32(second);
    #pragma GCC unroll 8
        for (int b = 0; b < NB; ++b) {
          sum[m][b] = _mm256_add_epi16(sum[m][b], _mm256_maddubs_epi16(lo[b], x0));
          sum[m][b] = _mm256_add_epi16(sum[m][b], _mm256_maddubs_epi16(hi[b], x1));
        }
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + (b * groups + g) * 8)));
      const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + (b * groups + g) * 8)));
  #pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const int64_t i = (row + m) * groups + g;
        const __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m][b], ones));
        acc[m][b] = _mm256_fmadd_ps(products, _mm256_mul_ps(_mm256_set1_ps(x.d[i]), scale), acc[m][b]);
        acc[m][b] = _mm256_fmadd_ps(_mm256_set1_ps(x.sums[i]), offset, acc[m][b]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      float* out = y + m * N + b * DOT_WIDTH;
      if (b + 1 < NB || last == DOT_WIDTH) {
        _mm256_storeu_ps(out, acc[m][b]);
      } else {
        alignas(32) float tmp[DOT_WIDTH];
        _mm256_store_ps(tmp, acc[m][b]);
        std::memcpy(out, tmp, last * sizeof(float));
      }
    }
}
#else
// The same sums in plain C++: integers, then the same float steps in the same order
template <int MB, int NB>
void dot_tile(const QuantizedRows& x, int64_t row, int64_t K, const uint8_t* w, const at::Half* s, const at::Half* z,
              int64_t groups, float* y, int64_t N, int64_t last) {
  for (int m = 0; m < MB; ++m)
    for (int b = 0; b < NB; ++b)
      for (int64_t j = 0; j < (b + 1 < NB ? DOT_WIDTH : last); ++j) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t total = 0;
          for (int p = 0; p < 4; ++p)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = w[((b * groups + g) * 4 + p) * RUN + 4 * j + i];
              const int8_t* xq = x.q.data() + (row + m) * K + g * GROUP + 8 * p;
              total += (byte & 0x0F) * xq[i] + (byte >> 4) * xq[4 + i];
            }
          const int64_t i = (row + m) * groups + g;
          const float scale = static_cast<float>(s[(b * groups + g) * 8 + j]);
          const float offset = static_cast<float>(z[(b * groups + g) * 8 + j]);
          acc = std::fma(static_cast<float>(total), x.d[i] * scale, acc);
          acc = std::fma(x.sums[i], offset, acc);
        }
        y[m * N + b * DOT_WIDTH + j] = acc;
      }
}
#endif

// The rows left after whole tiles: one tile of exactly M - m rows
template <int MB, int NB>
void dot_rest(const QuantizedRows& x, int64_t m, int64_t M, int64_t K, const uint8_t* w, const at::Half* s,
              const at::Half* z, int64_t groups, float* y, int64_t N, int64_t last) {
  if constexpr (MB > 0) {
    if (M - m == MB) return dot_tile<MB, NB>(x, m, K, w, s, z, groups, y + m * N, N, last);
    dot_rest<MB - 1, NB>(x, m, M, K, w, s, z, groups, y, N, last);
  }
}

template <int NB>
void dot_rows(const QuantizedRows& x, int64_t M, int64_t K, const uint8_t* w, const at::Half* s, const at::Half* z,
              int64_t groups, float* y, int64_t N, int64_t last) {
  int64_t m = 0;
  for (; m + DOT_ROWS <= M; m += DOT_ROWS) dot_tile<DOT_ROWS, NB>(x, m, K, w, s, z, groups, y + m * N, N, last);
  dot_rest<DOT_ROWS - 1, NB>(x, m, M, K, w, s, z, groups, y, N, last);
}

void dot_product(const float* xf, int64_t M, int64_t K, const uint8_t* w, const at::Half* s, const at::Half* z,
                 int64_t count, float* y, int64_t N) {
  const int64_t groups = K / GROUP;
  const QuantizedRows& x = quantize_rows(xf, M, K);
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / (K * DOT_WIDTH * M));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += DOT_BLOCKS) {
      const int64_t nb = std::min<int64_t>(DOT_BLOCKS, end - b);
      const int64_t last = std::min<int64_t>(DOT_WIDTH, N - (b + nb - 1) * DOT_WIDTH);
      const uint8_t* wb = w + b * groups * 4 * RUN;
      const at::Half *sb = s + b * groups * DOT_WIDTH, *zb = z + b * groups * DOT_WIDTH;
      if constexpr (DOT_BLOCKS > 1) {
        if (nb < DOT_BLOCKS) {
          dot_rows<1>(x, M, K, wb, sb, zb, groups, y + b * DOT_WIDTH, N, last);
          continue;
        }
      }
      dot_rows<DOT_BLOCKS>(x, M, K, wb, sb, zb, groups, y + b * DOT_WIDTH, N, last);
    }
  });
}

// The block width of the packed layout for `bits` here
int64_t quantized_width(int64_t bits) { return bits == 4 ? DOT_WIDTH : L; }

// x [M, K] float32 or bf16; packed uint8 [blocks, K * bits / 8, L] (quantized.pack); scales, offsets fp16
// [blocks, K / 32, L] -> [M, N] in x's dtype
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            const at::Tensor& offsets, int64_t N, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized_linear: 4 or 8 bits, not ", bits);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantized_linear: x must be [rows, in], float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), count = packed.size(0), groups = K / GROUP;
  const int64_t width = quantized_width(bits);
  TORCH_CHECK(K % GROUP == 0, "quantized_linear: the inner dimension (", K, ") must be a multiple of ", GROUP);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == K * bits / 8 && packed.size(2) == width,
              "quantized_linear: the weight must come from quantized.pack for ", K, " inputs at ", bits,
              " bits (block width ", width, " here)");
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == count &&
                    t->size(1) == groups && t->size(2) == width,
                "quantized_linear: scales and offsets must be fp16 [", count, ", ", groups, ", ", width, "]");
  TORCH_CHECK(N > (count - 1) * width && N <= count * width, "quantized_linear: ", N, " outputs do not fit ", count,
              " blocks");
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y.to(x.scalar_type());
  const auto xf = x.to(at::kFloat).contiguous();
  if (bits == 4) {
    dot_product(xf.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                offsets.data_ptr<at::Half>(), count, y.data_ptr<float>(), N);
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
  auto sums = at::empty({M, groups}, xf.options());  // each row's group sums, in input order
  {
    const float* xs = xf.data_ptr<float>();
    float* ss = sums.data_ptr<float>();
    for (int64_t i = 0; i < M * groups; ++i) {
      float total = 0.f;
      for (int64_t k = 0; k < GROUP; ++k) total += xs[i * GROUP + k];
      ss[i] = total;
    }
  }
  const Operands op{xf.data_ptr<float>(), sums.data_ptr<float>(), packed.data_ptr<uint8_t>(),
                    scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>(), K, groups, packed.size(1)};
  product(op, M, count, y.data_ptr<float>(), N);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depctl_native, m) {
  m.def("quantized_width(int bits) -> int", quantized_width);
  m.def("quantized_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int out_features, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(depctl_native, CPU, m) { m.impl("quantized_linear", quantized_linear); }
