// depctl_native::blocked_linear: a float32 or bf16 target's matrix products, the same bits for a row whatever else is
// in the pass (runtime/kernels/surgery.py: BlockedLinear). float32 below; bf16 further down, through AVX-512 BF16's pair
// dot products or, where the CPU has them, AMX tiles (`blocked_kernel` says which runs here).
//
// Why our own: a decode step reads every weight once, so on a CPU its cost is the weights' bytes over memory
// bandwidth. oneDNN's float32 linear, the fastest library product that is row-invariant (from two rows on), reads
// weights well below the memory's bandwidth for one row; these loops come closer, and are faster than oneDNN's from
// one row to a prompt chunk (benchmarks/int4_kernels.py measures both).
//
// The layout: the weight [N, K] is stored in blocks of L output features (L = the vector width: 16 floats with
// AVX-512, 8 with AVX2), each block [K, L], so that one vector load reads weight k of L consecutive outputs
// (`pack_blocked`; the last block zero-padded). A tile of MB rows by NB blocks keeps its MB x NB sums in registers:
// each weight vector is read once for the tile's rows, each row's input broadcast once for the tile's blocks.
//
// Exactness: output n of row m is sum_k x[m, k] * w[n, k] accumulated in k order from zero, one fused multiply-add a
// term, in one vector lane: the same instructions whatever the tile, the thread, or the number of rows in the pass.
// So a row rounds the same alone, in a verify pass of nine and beside other rows, by construction (tested on every
// row count), which is what speculation's exactness rests on.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Unroll.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DEPCTL_BF16_KERNEL 1
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
constexpr int MAX_ROWS = 6;    // rows a tile: 6 x 4 sums + 4 weight vectors fit AVX-512's 32 registers
constexpr int MAX_BLOCKS = 4;  // blocks a tile

constexpr int64_t FLOAT_PREFETCH = 32;  // inputs ahead, each a block's L weights
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// Software prefetch of the weights in the vector loops' tiles of 2+ rows: on an Intel Xeon it made a float32 verify
// pass of 9 tokens 15% cheaper, while on an AMD EPYC (Zen) it made every tile of 2+ rows slower than one row's, whose
// loop has none (the hardware prefetcher keeps up there). Chosen once a process by vendor; `blocked_weight_prefetch`
// lets a benchmark set it. It changes no result: the same instructions sum every output.
int default_prefetch() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();  // a static initializer may run before the one that fills in what __builtin_cpu_is reads
  return __builtin_cpu_is("amd") ? 0 : 1;
#else
  return 1;
#endif
}
std::atomic<int> weight_prefetch{default_prefetch()};

// run(std::true_type or std::false_type): this process's prefetch choice, as a constant for the tile templates
template <typename Run>
void with_prefetch(const Run& run) {
  if (weight_prefetch.load(std::memory_order_relaxed)) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

// MB rows (x, `x_stride` apart) by NB blocks (starting at `w`, K * L floats apart) into y (`y_stride` apart); the
// last of the NB blocks holds `last` valid outputs (L for a full one).
template <int MB, int NB, bool PF>
void tile(const float* x, int64_t x_stride, const float* w, int64_t K, float* y, int64_t y_stride, int64_t last) {
  Vec sum[MB][NB];
  c10::ForcedUnroll<MB>{}([&](auto m) { c10::ForcedUnroll<NB>{}([&](auto b) { sum[m][b] = Vec(0.f); }); });
  for (int64_t k = 0; k < K; ++k) {
    Vec wk[NB];
    if constexpr (PF && MB > 1) {  // a tile of one row keeps up with the weights without it (and paid ~2% for it)
      if (k + FLOAT_PREFETCH < K)
        c10::ForcedUnroll<NB>{}([&](auto b) { prefetch(w + (b * K + k + FLOAT_PREFETCH) * L); });
    }
    c10::ForcedUnroll<NB>{}([&](auto b) { wk[b] = Vec::loadu(w + (b * K + k) * L); });
    c10::ForcedUnroll<MB>{}([&](auto m) {
      const Vec xk(x[m * x_stride + k]);
      c10::ForcedUnroll<NB>{}([&](auto b) { sum[m][b] = at::vec::fmadd(xk, wk[b], sum[m][b]); });
    });
  }
  c10::ForcedUnroll<MB>{}([&](auto m) {
    c10::ForcedUnroll<NB>{}([&](auto b) {
      float* out = y + m * y_stride + b * L;
      if (b + 1 < NB || last == L) {
        sum[m][b].store(out);
      } else {
        sum[m][b].store(out, static_cast<int>(last));
      }
    });
  });
}

// Rows 0..M-1 in tiles of MAX_ROWS, then one tile of the remainder: run(rows as a constant, first row)
template <typename Run>
void over_rows(int64_t M, const Run& run) {
  int64_t m = 0;
  for (; m + MAX_ROWS <= M; m += MAX_ROWS) run(std::integral_constant<int, MAX_ROWS>{}, m);
  switch (M - m) {
    case 1: run(std::integral_constant<int, 1>{}, m); break;
    case 2: run(std::integral_constant<int, 2>{}, m); break;
    case 3: run(std::integral_constant<int, 3>{}, m); break;
    case 4: run(std::integral_constant<int, 4>{}, m); break;
    case 5: run(std::integral_constant<int, 5>{}, m); break;
    default: break;
  }
  static_assert(MAX_ROWS == 6, "the switch above covers remainders up to MAX_ROWS - 1");
}

// Blocks 0..count-1 of `width` outputs (N in all) over torch's threads, each thread's share in tiles of up to
// MAX_BLOCKS: run(blocks as a constant, first block, valid outputs of the tile's last block)
template <typename Run>
void over_blocks(int64_t count, int64_t width, int64_t N, int64_t grain, const Run& run) {
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += MAX_BLOCKS) {
      const int64_t nb = std::min<int64_t>(MAX_BLOCKS, end - b);
      const int64_t last = std::min<int64_t>(width, N - (b + nb - 1) * width);
      switch (nb) {
        case 1: run(std::integral_constant<int, 1>{}, b, last); break;
        case 2: run(std::integral_constant<int, 2>{}, b, last); break;
        case 3: run(std::integral_constant<int, 3>{}, b, last); break;
        default: run(std::integral_constant<int, MAX_BLOCKS>{}, b, last); break;
      }
    }
  });
  static_assert(MAX_BLOCKS == 4, "the switch above covers tiles of 1 to MAX_BLOCKS blocks");
}

// All M rows against NB blocks
template <int NB>
void blocks(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N, int64_t last) {
  if constexpr (L == 8 && NB > 2) {
    // AVX2 has 16 vector registers: a tile of 6 rows by 4 blocks would spill its 24 sums, so a pass of whole tiles
    // of rows (a prompt chunk, a wide verify pass) runs the blocks in halves, each half's weights staying in cache
    // across the row tiles. Below that the weights' bytes cost more than the spills (benchmarks/int4_kernels.py).
    if (M >= MAX_ROWS) {
      constexpr int HALF = NB / 2;
      blocks<HALF>(x, M, w, K, y, N, L);
      blocks<NB - HALF>(x, M, w + HALF * K * L, K, y + HALF * L, N, last);
      return;
    }
  }
  with_prefetch([&](auto pf) {
    over_rows(M, [&](auto rows, int64_t m) {
      tile<decltype(rows)::value, NB, decltype(pf)::value>(x + m * K, K, w, K, y + m * N, N, last);
    });
  });
}


#ifdef DEPCTL_BF16_KERNEL
// bfloat16: weights and inputs in pairs along the inner dimension, through AVX-512 BF16's dot product of pairs
// (vdpbf16ps: sum += x[2k] * w[2k] + x[2k+1] * w[2k+1], in float32), so the weights are read as bf16 (half float32's
// bytes) and never converted. The layout: blocks of 16 outputs, each [K / 2, 16, 2]: one 64-byte load reads the pair
// of weights k, k+1 of 16 outputs. Output n of row m is that pair-wise chain in k order from zero, rounded once to
// bf16 at the end: again the same instructions whatever the tile, thread or row count. Compiled for AVX-512 BF16
// (target attribute) and called only where the CPU has it (`blocked_supports`). Loops, not ForcedUnroll's lambdas:
// a lambda would not inherit the target.
#define DEPCTL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
constexpr int64_t BL = 16;

// MB rows by NB blocks (block b's pair k at w + (b * stride + k) * 32) over the first `pairs` pairs
template <int MB, int NB, bool PF>
DEPCTL_BF16_TARGET void tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs,
                                  int64_t stride, uint16_t* y, int64_t y_stride, int64_t last) {
  __m512 sum[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) sum[m][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh wk[NB];
    if (PF && MB > 1 && k + FLOAT_PREFETCH < pairs)
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + (b * stride + k + FLOAT_PREFETCH) * 2 * BL), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) wk[b] = (__m512bh)_mm512_loadu_si512(w + (b * stride + k) * 2 * BL);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * k, sizeof(pair));
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) sum[m][b] = _mm512_dpbf16_ps(sum[m][b], xk, wk[b]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(sum[m][b]);
      uint16_t* to = y + m * y_stride + b * BL;
      if (b + 1 < NB || last == BL) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), out);
      } else {
        _mm256_mask_storeu_epi16(to, static_cast<__mmask16>((1u << last) - 1), out);
      }
    }
}

template <int NB>
void blocks_bf16(const uint16_t* x, int64_t x_stride, int64_t M, const uint16_t* w, int64_t pairs, int64_t stride,
                 uint16_t* y, int64_t N, int64_t last) {
  with_prefetch([&](auto pf) {
    over_rows(M, [&](auto rows, int64_t m) {
      tile_bf16<decltype(rows)::value, NB, decltype(pf)::value>(x + m * x_stride, x_stride, w, pairs, stride,
                                                                  y + m * N, N, last);
    });
  });
}

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// ---- AMX ----
// Where the CPU has AMX (Intel Xeon from Sapphire Rapids on), the same pairs go through its tile unit instead:
// TDPBF16PS multiplies a tile of up to 16 rows by 32 inputs with a tile of 16 pairs by 16 outputs (16 consecutive
// pairs of one packed block: 1 KB, contiguous, which is why a bf16 block's pairs are padded to a multiple of 16) into
// 16 x 16 float32 sums: 8192 multiply-adds an instruction where vdpbf16ps does 32, so a verify pass or a batch of
// rows costs little more than one row's read of the weights. Every sum is still one chain over the pairs in k order
// from zero (16 pairs an instruction, the tile unit treating each row of the tile alike), rounded to bf16 once: a
// row's bits do not depend on the rows beside it in the tile, the tile's height or the pass. The tile unit rounds
// its chain differently from vdpbf16ps, so a process takes one of the two for every bf16 product (`amx_enabled`),
// whatever the row count.
#define DEPCTL_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row
  uint8_t rows[16] = {};
};

bool amx_usable() {
  static const bool usable = [] {
    if (!cpu_has_bf16_dot() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
#ifdef __linux__
    // Linux hands a process the tile registers' state only on request (arch_prctl, XTILEDATA = feature 18)
    constexpr int get_permission = 0x1022, request_permission = 0x1023, xtiledata = 18;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, get_permission, &granted) == 0 && ((granted >> xtiledata) & 1)) return true;
    return syscall(SYS_arch_prctl, request_permission, xtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

std::atomic<bool> amx_refused{false};  // set only by tests, to run the vdpbf16ps loops on a CPU with AMX

bool amx_enabled() { return amx_usable() && !amx_refused.load(std::memory_order_relaxed); }

// Tiles 0..NB-1: the sums of NB blocks for the tile's rows; 4: the rows' inputs; 5-7: weights, three loads in
// flight. Rows m..: `height` rows of x (`x_stride` elements apart) against NB blocks (`stride` pairs each, from w);
// the sums of the first `valid` rows, rounded to bf16, into y (`N` apart), the last block's first `last` outputs.
constexpr int64_t PREFETCH = 32;  // pairs ahead
template <int NB>
DEPCTL_AMX_TARGET void amx_tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t stride, uint16_t* y,
                                int64_t N, int64_t valid, int64_t last) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const int64_t x_bytes = x_stride * 2;
  for (int64_t k = 0; k < stride; k += 16) {
    if (k + PREFETCH < stride) {
      for (int b = 0; b < NB; ++b) {
        const char* ahead = reinterpret_cast<const char*>(w + (b * stride + k + PREFETCH) * 2 * BL);
#pragma GCC unroll 16
        for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, x + 2 * k, x_bytes);
    _tile_loadd(5, w + k * 2 * BL, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, w + (stride + k) * 2 * BL, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(7, w + (2 * stride + k) * 2 * BL, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NB > 3) {
      _tile_loadd(5, w + (3 * stride + k) * 2 * BL, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float sums[NB][16 * 16];
  _tile_stored(0, sums[0], 64);
  if constexpr (NB > 1) _tile_stored(1, sums[1], 64);
  if constexpr (NB > 2) _tile_stored(2, sums[2], 64);
  if constexpr (NB > 3) _tile_stored(3, sums[3], 64);
  for (int64_t m = 0; m < valid; ++m)
    for (int b = 0; b < NB; ++b) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums[b] + m * 16));
      uint16_t* to = y + m * N + b * BL;
      if (b + 1 < NB || last == BL) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), out);
      } else {
        _mm256_mask_storeu_epi16(to, static_cast<__mmask16>((1u << last) - 1), out);
      }
    }
}

// One thread's blocks [begin, end), for every row: x holds `rows` rows (a multiple of 16, or fewer than 16: one tile
// that high), of which the first M are real
DEPCTL_AMX_TARGET void amx_blocks(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t M, const uint16_t* w,
                                  int64_t stride, uint16_t* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t height = std::min<int64_t>(rows, 16);
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 5 ? height : 16;  // sums and inputs: the tile's rows; weights: 16 pairs
    config.colsb[t] = 64;                  // 16 floats, 32 bf16 inputs, 16 pairs of bf16
  }
  _tile_loadconfig(&config);
  for (int64_t b = begin; b < end; b += MAX_BLOCKS) {
    const int64_t nb = std::min<int64_t>(MAX_BLOCKS, end - b);
    const int64_t last = std::min<int64_t>(BL, N - (b + nb - 1) * BL);
    for (int64_t m = 0; m < rows; m += 16) {  // the blocks' weights stay in cache for the next 16 rows
      const uint16_t* xm = x + m * x_stride;
      const uint16_t* wb = w + b * stride * 2 * BL;
      uint16_t* ym = y + m * N + b * BL;
      const int64_t valid = std::min<int64_t>(16, M - m);
      switch (nb) {
        case 1: amx_tile<1>(xm, x_stride, wb, stride, ym, N, valid, last); break;
        case 2: amx_tile<2>(xm, x_stride, wb, stride, ym, N, valid, last); break;
        case 3: amx_tile<3>(xm, x_stride, wb, stride, ym, N, valid, last); break;
        default: amx_tile<4>(xm, x_stride, wb, stride, ym, N, valid, last); break;
      }
    }
  }
  _tile_release();
}

at::Tensor blocked_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), pairs = (K + 1) / 2, stride = packed.size(1), count = packed.size(0);
  TORCH_CHECK(stride == (pairs + 15) / 16 * 16, "blocked_linear: x has ", K, " features, the weight was packed for ",
              2 * stride - 31, " to ", 2 * stride);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (2 * pairs * BL * M));
  if (amx_enabled()) {
    // the tiles read 16 pairs at a time and, past 16 rows, 16 rows at a time: where x is shorter, a zero-padded copy
    // (by hand: torch's pad costs more than a small product)
    const bool pad = K != 2 * stride || (M > 16 && M % 16 != 0);
    const int64_t rows = pad && M > 16 ? (M + 15) / 16 * 16 : M, width = 2 * stride;
    const auto xc = x.contiguous();
    const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    thread_local std::vector<uint16_t> padded;
    if (pad) {
      padded.resize(std::max<size_t>(padded.size(), rows * width));
      for (int64_t m = 0; m < M; ++m) {
        std::memcpy(padded.data() + m * width, xs + m * K, K * sizeof(uint16_t));
        std::fill_n(padded.data() + m * width + K, width - K, 0);
      }
      std::fill_n(padded.data() + M * width, (rows - M) * width, 0);
      xs = padded.data();
    }
    at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
      amx_blocks(xs, width, rows, M, ws, stride, ys, N, begin, end);
    });
    return y;
  }
  // an odd inner dimension: the input gets the zero its weights were padded with
  const auto xc = K == 2 * pairs ? x.contiguous() : at::constant_pad_nd(x, {0, 1}).contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  over_blocks(count, BL, N, grain, [&](auto nb, int64_t b, int64_t last) {
    blocks_bf16<decltype(nb)::value>(xs, 2 * pairs, M, ws + b * stride * 2 * BL, pairs, stride, ys + b * BL, N, last);
  });
  return y;
}
#else
bool cpu_has_bf16_dot() { return false; }
bool amx_usable() { return false; }
bool amx_enabled() { return false; }
std::atomic<bool> amx_refused{false};
#endif

// Whether this build and CPU have the blocked product for `dtype` (float32: always; bfloat16: AVX-512 BF16)
bool blocked_supports(c10::ScalarType dtype) {
  return dtype == at::kFloat || (dtype == at::kBFloat16 && cpu_has_bf16_dot());
}

// Which loops run the blocked product for `dtype` here, for logs and `deployment get`
std::string blocked_kernel(c10::ScalarType dtype) {
  if (dtype == at::kFloat) return "fma";
  if (dtype == at::kBFloat16 && cpu_has_bf16_dot()) return amx_enabled() ? "amx-bf16" : "avx512-bf16";
  return "none";
}

// Tests only: refuse (true) or allow AMX for the bf16 product, to run both kernels on one CPU; returns the kernel now
// in use. A deployment never calls it: its products must all take one kernel.
std::string blocked_refuse_amx(bool refuse) {
  amx_refused.store(refuse);
  return blocked_kernel(at::kBFloat16);
}

// Benchmarks only: 1 or 0 turns the vector loops' weight prefetch on or off for this process, -1 leaves it; returns
// whether it is on
bool blocked_weight_prefetch(int64_t set) {
  if (set >= 0) weight_prefetch.store(set ? 1 : 0);
  return weight_prefetch.load() != 0;
}

// weight [N, K] -> float32: [ceil(N / L), K, L]; bfloat16: [ceil(N / 16), P, 16, 2], P = ceil(K / 2) rounded up to
// a multiple of 16; zero-padded
at::Tensor pack_blocked(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_blocked: an [out, in] weight");
  TORCH_CHECK(blocked_supports(weight.scalar_type()), "pack_blocked: no blocked product for ", weight.scalar_type(),
              " on this CPU (float32 everywhere; bfloat16 with AVX-512 BF16)");
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.scalar_type() == at::kFloat) {
    const int64_t count = (N + L - 1) / L;
    auto padded = at::zeros({count * L, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
    return padded.view({count, L, K}).transpose(1, 2).contiguous();
  }
  const int64_t count = (N + 15) / 16, pairs = ((K + 1) / 2 + 15) / 16 * 16;  // whole AMX tiles of pairs
  auto padded = at::zeros({count * 16, 2 * pairs}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({count, 16, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] and packed (pack_blocked) of one dtype -> [M, N]
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == packed.scalar_type(), "blocked_linear: x must be [rows, in], of the ",
              "weight's dtype (", packed.scalar_type(), "), not ", x.scalar_type());
#ifdef DEPCTL_BF16_KERNEL
  if (packed.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(cpu_has_bf16_dot() && packed.dim() == 4 && packed.is_contiguous() && packed.size(1) % 16 == 0 &&
                    packed.size(2) == BL && packed.size(3) == 2 && N > (packed.size(0) - 1) * BL &&
                    N <= packed.size(0) * BL,
                "blocked_linear: the weight must come from pack_blocked");
    return blocked_linear_bf16(x, packed, N);
  }
#endif
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == L,
              "blocked_linear: the weight must come from pack_blocked (this build's vector width is ", L, ")");
  const int64_t M = x.size(0), K = x.size(1), count = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "blocked_linear: x has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(N > (count - 1) * L && N <= count * L, "blocked_linear: ", N, " outputs do not fit ", count, " blocks");
  const auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xs = xc.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  // a thread's share of blocks worth at least ~64k multiply-adds: tiny products stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (K * L * M));
  over_blocks(count, L, N, grain, [&](auto nb, int64_t b, int64_t last) {
    blocks<decltype(nb)::value>(xs, M, ws + b * K * L, K, ys + b * L, N, last);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depctl_native, m) {
  m.def("pack_blocked(Tensor weight) -> Tensor");
  m.def("blocked_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("blocked_supports(ScalarType dtype) -> bool", blocked_supports);
  m.def("blocked_kernel(ScalarType dtype) -> str", blocked_kernel);
  m.def("blocked_refuse_amx(bool refuse) -> str", blocked_refuse_amx);
  m.def("blocked_weight_prefetch(int set) -> bool", blocked_weight_prefetch);
}

TORCH_LIBRARY_IMPL(depctl_native, CPU, m) {
  m.impl("pack_blocked", pack_blocked);
  m.impl("blocked_linear", blocked_linear);
}
