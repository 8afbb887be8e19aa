// depctl_native::token_attention: the attention of a compiled decode or verify pass (runtime/engine/native.py).
//
// Every token of the pass's flat stream attends its own cache row, from position 0 up to its own position, alone:
// one call of ATen's scaled_dot_product_attention per token, shaped exactly as a one-token step's call (grouped-query
// heads folded into the query length, no mask). So a token rounds the same in a plain step, in a verify pass of nine,
// and beside other rows, which is what speculation's exactness rests on; and the kernel is ATen's, not ours.
//
// It replaces a Python custom op that the compiled library called back once per layer: the callback itself (the GIL,
// boxing, a Python loop over tokens) cost more than the attention it ran. Tokens of a wider pass are spread over the
// intra-op threads, each token's call then running on one thread: the flash kernel computes a head's query block on
// one thread either way, so the bits do not depend on it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

namespace {

// query [1, heads, T, dim]; keys, values [rows, kv_heads, capacity, dim] (the cache layer, after this pass's keys
// were written); rows, positions [T] int64 (token t sits in cache row rows[t] at position positions[t]).
// Returns [1, T, heads, dim], contiguous.
at::Tensor token_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& rows, const at::Tensor& positions, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1, "token_attention: query must be [1, heads, T, dim]");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes(), "token_attention: keys and values must be "
              "[rows, kv_heads, capacity, dim] alike");
  TORCH_CHECK(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && rows.is_cpu() &&
              positions.is_cpu(), "token_attention: rows and positions must be int64 CPU tensors");
  const int64_t heads = query.size(1), tokens = query.size(2), dim = query.size(3);
  const int64_t kv_heads = keys.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(3) == dim, "token_attention: query heads do not match the cache");
  TORCH_CHECK(rows.numel() == tokens && positions.numel() == tokens, "token_attention: one row and position a token");
  const auto row_of = rows.contiguous(), position_of = positions.contiguous();
  const int64_t* row = row_of.data_ptr<int64_t>();
  const int64_t* position = position_of.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(row[t] >= 0 && row[t] < keys.size(0) && position[t] >= 0 && position[t] < keys.size(2),
                "token_attention: token ", t, " at row ", row[t], ", position ", position[t], " is outside the cache");
  }

  auto out = at::empty({1, tokens, heads, dim}, query.options());
  auto attend = [&](int64_t t) {
    auto q = query.select(2, t).reshape({1, kv_heads, heads / kv_heads, dim});  // groups folded into the length
    auto k = keys.select(0, row[t]).slice(1, 0, position[t] + 1).unsqueeze(0);  // [1, kv_heads, keys, dim]
    auto v = values.select(0, row[t]).slice(1, 0, position[t] + 1).unsqueeze(0);
    auto o = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/false,
                                              scale);
    out.select(1, t).copy_(o.reshape({1, heads, dim}));
  };
  if (tokens == 1) {
    attend(0);  // the kernel spreads the heads over the threads itself
  } else {
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      c10::InferenceMode guard;  // the caller's inference mode does not follow it onto the pool's threads
      for (int64_t t = begin; t < end; ++t) attend(t);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(depctl_native, m) {
  m.def("token_attention(Tensor query, Tensor keys, Tensor values, Tensor rows, Tensor positions, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(depctl_native, CPU, m) { m.impl("token_attention", token_attention); }
