// cache_attention on the CPU, in C++: the same computation as runtime.attention.cache_attention (the
// Python custom op a compiled decode step calls once per layer), without its Python overhead.
//
// Write k, v (B, Hkv, T, D) into layer `layer` of the cache buffers (L, B, Hkv, S_max, D) at slots
// prefix_lens[b] + t, then attend: query t of q (B, Hq, T, D) sees slots [0, prefix_lens[b] + t] of
// its row (within `window`, 0 = none), or, with a block mask (B, T, T) (a tree step), the row's
// cached slots and the new tokens its block-mask row allows. The attention is ATen's SDPA over the
// used slots, with grouped-query heads folded into the query axis (as runtime.attention.sdpa_gqa):
// the same inputs to the same kernel as the Python op, so the same numbers.
// Built into the same extension as cpu_blockq.cpp (its op namespace, SPECDEC_OPS).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, int64_t layer, const at::Tensor& prefix_lens, int64_t window,
                           const c10::optional<at::Tensor>& block_mask) {
  TORCH_CHECK(q.device().is_cpu() && prefix_lens.device().is_cpu(), "cache_attention: CPU tensors only");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  const at::Tensor lens = prefix_lens.to(at::kLong).contiguous();
  const int64_t* pre = lens.data_ptr<int64_t>();
  int64_t longest = 0;
  bool uniform = true;
  for (int64_t b = 0; b < B; ++b) {
    longest = std::max(longest, pre[b]);
    uniform = uniform && pre[b] == pre[0];
  }
  at::Tensor kl = k_cache.select(0, layer), vl = v_cache.select(0, layer);  // (B, Hkv, S_max, D)
  for (int64_t b = 0; b < B; ++b) {
    kl.select(0, b).narrow(1, pre[b], T).copy_(k.select(0, b));
    vl.select(0, b).narrow(1, pre[b], T).copy_(v.select(0, b));
  }
  const int64_t S = longest + T;
  const at::Tensor keys = kl.narrow(2, 0, S), values = vl.narrow(2, 0, S);  // (B, Hkv, S, D)
  c10::optional<at::Tensor> mask;  // (B, T, S) bool, true = may attend
  if (block_mask.has_value()) {
    TORCH_CHECK(window == 0 || S <= window, "cache_attention: a block-mask step over ", S,
                " slots needs the sliding window applied by position: run it eagerly");
    const at::Tensor bm = block_mask->to(at::kBool).contiguous();
    const bool* bp = bm.data_ptr<bool>();
    at::Tensor m = at::empty({B, T, S}, q.options().dtype(at::kBool));
    bool* mp = m.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t rel = s - pre[b];
          mp[(b * T + t) * S + s] = rel < 0 || (rel < T && bp[(b * T + t) * T + rel]);
        }
    mask = m;
  } else if (!(T == 1 && uniform && (window == 0 || S <= window))) {
    at::Tensor m = at::empty({B, T, S}, q.options().dtype(at::kBool));
    bool* mp = m.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = pre[b] + t;
        for (int64_t s = 0; s < S; ++s) mp[(b * T + t) * S + s] = s <= slot && (window == 0 || s > slot - window);
      }
    mask = m;
  }
  if (Hq == Hkv) {
    c10::optional<at::Tensor> m4;
    if (mask.has_value()) m4 = mask->unsqueeze(1);
    return at::scaled_dot_product_attention(q, keys, values, m4).contiguous();
  }
  const int64_t G = Hq / Hkv;  // query head h reads KV head h / G
  const at::Tensor qf = q.reshape({B, Hkv, G * T, D});
  c10::optional<at::Tensor> mf;
  if (mask.has_value()) mf = mask->unsqueeze(1).unsqueeze(1).expand({B, 1, G, T, S}).reshape({B, 1, G * T, S});
  return at::scaled_dot_product_attention(qf, keys, values, mf).reshape({B, Hq, T, D}).contiguous();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(SPECDEC_OPS, m) {
  m.def("cache_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
        "Tensor prefix_lens, int window, Tensor? block_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { m.impl("cache_attention", &cache_attention); }
