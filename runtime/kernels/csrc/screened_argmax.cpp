// depctl_native::screened_argmax: a float32 output layer's greedy choice, reading its weights mostly in bfloat16
// (runtime/model/head.py).
//
// A float32 decode step of SmolLM2 reads 540 MB, 113 MB of it the output layer (49152 x 576). Greedy decoding needs
// only the argmax of the logits, and the argmax is decided by a handful of tokens. So the caller computes every logit
// in bfloat16 first (half the bytes), and this op, per token of the pass:
//
//   1. bounds each bf16 logit's distance from the float32 one: |f_i - a_i| <= B_i, from the rounding of the hidden
//      state and of weight row i to bf16 (||bf16(h) - h|| ||bf16(w_i)|| + ||h|| ||bf16(w_i) - w_i||), the float32
//      accumulation of either sum (gamma ||h|| ||w_i||, gamma = 2Ku / (1 - 2Ku)), the bf16 rounding of the result
//      (2^-8 |a_i| / (1 - 2^-8)), times 1.5, plus 1e-6: each term is a worst case, for any summation order;
//   2. keeps the candidates, the tokens with a_i + B_i >= max_j (a_j - B_j): any other token's float32 logit is
//      below that of the token attaining the max, so it cannot be the argmax, nor tie with it;
//   3. computes the candidates' float32 logits from the plain weight rows and returns the first largest.
//
// Read in that order, every step would read each row's bounds (8 bytes) beside its 2-byte logit. So the bounds are read
// only where they can matter: the largest bf16 logit a_j gives a floor
// (a_j - B_j <= the floor of step 2); a row whose a_i + (the largest possible B_i) is below it cannot be a candidate,
// so one scan of the bf16 logits against that cut keeps a few dozen rows, and steps 1-3 run exactly over those.
//
// On SmolLM2 a token has 1 to 20 candidates (median 1). The result is the argmax of float32 logits computed by step
// 3's dot product, which is the same code for every token on any thread and whatever else is in the pass: a verify
// pass and the one-token steps it checks choose alike. (It may differ from the argmax of the full float32 product
// where two logits are within float32 rounding of each other, as two GEMM libraries do; plain and speculative
// decoding both choose through this op.) A row with a non-finite hidden state or bf16 logit skips the screen: every
// token is a candidate, and a NaN logit wins, as torch.argmax has it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// h . w over n floats in one fixed order: lane-wise fused multiply-adds, then the lanes summed in order.
float dot(const float* h, const float* w, int64_t n) {
  const int64_t lanes = Vec::size(), full = n - n % lanes;
  Vec acc(0.f);
  for (int64_t k = 0; k < full; k += lanes) acc = at::vec::fmadd(Vec::loadu(h + k), Vec::loadu(w + k), acc);
  float lane[Vec::size()];
  acc.store(lane);
  float sum = 0.f;
  for (int64_t l = 0; l < lanes; ++l) sum += lane[l];
  for (int64_t k = full; k < n; ++k) sum += h[k] * w[k];
  return sum;
}

// A token's screen: its hidden state's norms give the bound's coefficients, B_i = c_norm |w_i| + c_err |bf16(w_i) -
// w_i| + c_out |a_i| + c_abs (|w_i| the larger of the float32 and bf16 rows' norms, precomputed with the errors).
struct Screen {
  float c_norm, c_err, c_out, c_abs;
  bool finite;

  Screen(const float* h, int64_t dim) {
    double h2 = 0, hb2 = 0, d2 = 0;
    finite = true;
    for (int64_t k = 0; k < dim; ++k) {
      const double x = h[k], xb = static_cast<float>(c10::BFloat16(h[k]));  // round to nearest even, as .to(bf16)
      h2 += x * x, hb2 += xb * xb, d2 += (xb - x) * (xb - x);
      finite = finite && std::isfinite(h[k]);
    }
    const double u = std::ldexp(1.0, -24), gamma = 2 * dim * u / (1 - 2 * dim * u);
    const double hn = std::sqrt(h2), hbn = std::sqrt(hb2), dn = std::sqrt(d2);
    const double half_ulp = std::ldexp(1.0, -8);  // bf16 keeps 8 significant bits: rounding moves a by <= 2^-8 |acc|
    c_norm = static_cast<float>(1.5 * (dn + gamma * (hn + hbn)));
    c_err = static_cast<float>(1.5 * hn);
    c_out = static_cast<float>(1.5 * half_ulp / (1 - half_ulp));
    c_abs = 1e-6f;
  }

  float bound(float a, float norm, float error) const { return c_norm * norm + c_err * error + c_out * std::fabs(a) + c_abs; }

  // The least bf16 logit a row can have and still reach `floor` (a_i + B_i >= floor), whatever its norms (at most
  // `max_norm`, `max_error`): rows below it are dropped from their bf16 logit alone, without reading their bounds.
  float cut(float floor, float max_norm, float max_error) const {
    const double rest = static_cast<double>(floor) - (double(c_norm) * max_norm + double(c_err) * max_error + c_abs);
    const double at = rest < 0 ? rest / (1 - double(c_out)) : rest / (1 + double(c_out));
    return std::nextafter(static_cast<float>(at - std::fabs(at) * 1e-6), -std::numeric_limits<float>::infinity());
  }
};

// The best of some rows: the largest value, the first index among equals; a NaN beats any number.
struct Best {
  float value = 0.f;
  int64_t index = -1;

  void offer(float f, int64_t i) {
    if (index < 0 || better(f, i, value, index)) value = f, index = i;
  }
  static bool better(float f, int64_t i, float g, int64_t j) {
    if (std::isnan(f) != std::isnan(g)) return std::isnan(f);
    if (!std::isnan(f) && f != g) return f > g;
    return i < j;
  }
};

constexpr int64_t kChunk = 4096;  // rows of the output layer a work item scans

// The largest bf16 logit of rows [lo, hi) (first index among equals; a NaN wins).
Best largest(const c10::BFloat16* approx, int64_t lo, int64_t hi) {
  const int64_t lanes = Vec::size();
  Best best;
  int64_t i = lo;
  if (hi - lo >= lanes) {
    Vec top(-std::numeric_limits<float>::infinity()), nan(0.f);
    for (; i + lanes <= hi; i += lanes) {
      Vec a;
      at::vec::load_to_float<c10::BFloat16>(approx + i, a);
      top = at::vec::maximum(top, a);
    }
    float lane[Vec::size()];
    top.store(lane);
    float value = lane[0];
    for (int64_t l = 1; l < lanes; ++l) value = std::isnan(value) || std::isnan(lane[l]) ? NAN : std::max(value, lane[l]);
    for (int64_t j = lo; j < i && best.index < 0; j += lanes) {  // its first row (the vectors held the value only)
      Vec a;
      at::vec::load_to_float<c10::BFloat16>(approx + j, a);
      const int other = (std::isnan(value) ? a.isnan() == Vec(0.f) : a != Vec(value)).zero_mask();  // lanes equal
      if (other) best.offer(value, j + __builtin_ctz(other));
    }
  }
  for (; i < hi; ++i) best.offer(static_cast<float>(approx[i]), i);
  return best;
}

// Rows of [lo, hi) whose bf16 logit is at least `cut`.
void above(const c10::BFloat16* approx, int64_t lo, int64_t hi, float cut, std::vector<int64_t>& out) {
  const int64_t lanes = Vec::size();
  int64_t i = lo;
  for (; i + lanes <= hi; i += lanes) {
    Vec a;
    at::vec::load_to_float<c10::BFloat16>(approx + i, a);
    for (int keep = (a < Vec(cut)).zero_mask(); keep; keep &= keep - 1) out.push_back(i + __builtin_ctz(keep));
  }
  for (; i < hi; ++i)
    if (static_cast<float>(approx[i]) >= cut) out.push_back(i);
}

std::tuple<at::Tensor, at::Tensor> screened_argmax(const at::Tensor& approx, const at::Tensor& hidden,
                                                   const at::Tensor& weight, const at::Tensor& norms,
                                                   const at::Tensor& errors, double max_norm, double max_error) {
  // approx: [T, V] bf16 logits; hidden: [T, dim] float32; weight: [V, dim] float32; norms, errors: [V] float32 and
  // their maxima
  TORCH_CHECK(approx.dim() == 2 && hidden.dim() == 2 && weight.dim() == 2, "screened_argmax: 2-d inputs");
  TORCH_CHECK(approx.scalar_type() == at::kBFloat16, "screened_argmax: bf16 logits, not ", approx.scalar_type());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  norms.scalar_type() == at::kFloat && errors.scalar_type() == at::kFloat,
              "screened_argmax: float32 hidden states, weights and bounds");
  const int64_t tokens = hidden.size(0), dim = hidden.size(1), vocab = weight.size(0);
  TORCH_CHECK(weight.size(1) == dim, "screened_argmax: weight rows of ", weight.size(1), ", hidden states of ", dim);
  TORCH_CHECK(approx.size(0) == tokens && approx.size(1) == vocab, "screened_argmax: logits ", approx.sizes(),
              " for ", tokens, " tokens and ", vocab, " rows");
  TORCH_CHECK(norms.numel() == vocab && errors.numel() == vocab, "screened_argmax: one bound a row");
  const auto a = approx.contiguous(), h = hidden.contiguous(), w = weight.contiguous();
  const auto n = norms.contiguous(), e = errors.contiguous();
  const c10::BFloat16* as = a.data_ptr<c10::BFloat16>();
  const float *hs = h.data_ptr<float>(), *ws = w.data_ptr<float>(), *ns = n.data_ptr<float>(), *es = e.data_ptr<float>();

  // Work items are (token, chunk of rows), so that one token's scans use every thread; chunks combine exactly, so
  // a token's choice does not depend on how its rows were split.
  const int64_t chunks = std::max<int64_t>(1, (vocab + kChunk - 1) / kChunk), items = tokens * chunks;
  const auto chunk_of = [&](int64_t item) { return std::pair(item % chunks * kChunk, std::min(vocab, (item % chunks + 1) * kChunk)); };
  std::vector<Screen> screens;
  screens.reserve(tokens);
  for (int64_t t = 0; t < tokens; ++t) screens.emplace_back(hs + t * dim, dim);

  // 1. each token's largest bf16 logit a_j: a_j - B_j is a floor that the best float32 logit reaches
  std::vector<Best> tops(items);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [lo, hi] = chunk_of(item);
      tops[item] = largest(as + item / chunks * vocab, lo, hi);
    }
  });
  std::vector<float> cuts(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    Best top;
    for (int64_t c = 0; c < chunks; ++c) top.offer(tops[t * chunks + c].value, tops[t * chunks + c].index);
    Screen& screen = screens[t];
    const int64_t j = top.index;
    screen.finite = screen.finite && std::isfinite(top.value);  // a NaN or infinite logit: every row a candidate
    cuts[t] = screen.finite ? screen.cut(top.value - screen.bound(top.value, ns[j], es[j]), max_norm, max_error)
                            : -std::numeric_limits<float>::infinity();
  }
  // 2. the rows that can reach that floor, from their bf16 logits alone
  std::vector<std::vector<int64_t>> near(items);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [lo, hi] = chunk_of(item);
      const int64_t t = item / chunks;
      if (screens[t].finite) {
        above(as + t * vocab, lo, hi, cuts[t], near[item]);
      } else {
        for (int64_t i = lo; i < hi; ++i) near[item].push_back(i);
      }
    }
  });
  // 3. among them, the exact floor max (a_i - B_i), the candidates a_i + B_i >= floor, their float32 logits
  auto choice = at::empty({tokens}, hidden.options().dtype(at::kLong));
  auto count = at::empty({tokens}, hidden.options().dtype(at::kLong));
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Screen& screen = screens[t];
      const c10::BFloat16* row = as + t * vocab;
      float floor = -std::numeric_limits<float>::infinity();
      if (screen.finite) {
        for (int64_t c = 0; c < chunks; ++c)
          for (int64_t i : near[t * chunks + c]) {
            const float a = static_cast<float>(row[i]);
            floor = std::max(floor, a - screen.bound(a, ns[i], es[i]));
          }
      }
      Best best;
      int64_t computed = 0;
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t i : near[t * chunks + c]) {
          const float a = static_cast<float>(row[i]);
          if (screen.finite && a + screen.bound(a, ns[i], es[i]) < floor) continue;
          best.offer(dot(hs + t * dim, ws + i * dim, dim), i);
          ++computed;
        }
      choice.data_ptr<int64_t>()[t] = best.index;
      count.data_ptr<int64_t>()[t] = computed;
    }
  });
  return {choice, count};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depctl_native, m) {
  m.def("screened_argmax(Tensor approx, Tensor hidden, Tensor weight, Tensor norms, Tensor errors, float max_norm, "
        "float max_error) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(depctl_native, CPU, m) { m.impl("screened_argmax", screened_argmax); }
