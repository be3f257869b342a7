// Attention over the static KV cache on the CPU, in C++.
//
// cache_attention: the compiled decode step's per-layer op (runtime.attention.cache_attention, the
// Python custom op, without its Python overhead). Write k, v (B, Hkv, T, D) into layer `layer` of the
// cache buffers (L, B, Hkv, S_max, D) at slots prefix_lens[b] + t (or, with a block table, of the
// paged pools (L, NB, Hkv, bs, D): runtime.paged_cache), then attend: query t of q
// (B, Hq, T, D) sees slots [0, prefix_lens[b] + t] of its row (within `window`, 0 = none), or, with a
// block mask (B, T, T) (a tree step), the row's cached slots and the new tokens its block-mask row
// allows. `invariant` picks the attention: false = ATen's SDPA over the used slots (grouped-query
// heads folded into the query axis, as runtime.attention.sdpa_gqa), true = attention_rows below.
//
// attention_rows: row-invariant attention (runtime.invariant): every query on its own, over the
// keys it may see in slot order, in one fixed float32 arithmetic (cpu_attention_rows.h), so its
// output does not depend on how many queries share the call (a decode step, a verification block,
// a tree), on other rows, or on padding slots.
// Built into the same extension as cpu_blockq.cpp (its op namespace, SPECDEC_OPS).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#define SPECDEC_ATTN_NS attn_generic
#include "cpu_attention_rows.h"
#undef SPECDEC_ATTN_NS

// cpu_attention_isa.cpp
void specdec_convert_kv_avx512(const AttnProblem& p, float* kt, float* vf, int64_t u0, int64_t u1);
void specdec_attention_rows_avx512(const AttnProblem& p, const float* kt, const float* vf, int64_t w0, int64_t w1);
void specdec_convert_kv_avx2(const AttnProblem& p, float* kt, float* vf, int64_t u0, int64_t u1);
void specdec_attention_rows_avx2(const AttnProblem& p, const float* kt, const float* vf, int64_t w0, int64_t w1);

namespace {

// A block table (B, W) of a paged cache whose pool holds `blocks` blocks: every entry a block id.
void check_table(const at::Tensor& table, int64_t blocks, const char* op) {
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < table.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < blocks, op, ": block table entry ", tp[i], " is outside the pool's ", blocks,
                " blocks");
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("fma");
  return yes;
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// The build attention_rows runs: 2 AVX-512, 1 AVX2, 0 portable C++; the best the CPU has, or the one
// $SPECDEC_ATTENTION_ISA names ("avx512", "avx2", "generic": tests run every build on one CPU; the
// builds give the same bits).
int attention_isa() {
  const int best = has_avx512() ? 2 : has_avx2() ? 1 : 0;
  const char* env = std::getenv("SPECDEC_ATTENTION_ISA");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return best;
  const int want = std::strcmp(env, "avx512") == 0 ? 2 : std::strcmp(env, "avx2") == 0 ? 1
                   : std::strcmp(env, "generic") == 0 ? 0 : -1;
  TORCH_CHECK(want >= 0, "SPECDEC_ATTENTION_ISA=", env, " is not an attention build; use auto, avx512, avx2 or generic");
  TORCH_CHECK(want <= best, "SPECDEC_ATTENTION_ISA=", env, " asks for a build this CPU does not run");
  return want;
}

// Row-invariant attention of q (B, Hq, T, D) over keys, values (B, Hkv, S, D) (any strides with a
// contiguous last axis: views of the cache) -> (B, Hq, T, D). mask: (B, T, S) bool, true = may
// attend; without it query t of row b sees slots [0, prefix_lens[b] + t] (within `window`, 0 = none).
// With a block table (B, W) (a paged cache), keys and values are the pools (NB, Hkv, bs, D) and the
// rows' slots [0, num_keys) are read through the table: slot s of row b is position s % bs of block
// table[b, s / bs].
// check_entries: check every table entry lies in the pool.
at::Tensor attention_rows_impl(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const c10::optional<at::Tensor>& mask, const at::Tensor& prefix_lens, int64_t window,
                               const c10::optional<at::Tensor>& block_table, int64_t num_keys, bool check_entries) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "attention_rows: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(), "attention_rows: q (B, Hq, T, D), ",
              "keys and values (B, Hkv, S, D)");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "attention_rows: q, keys and values must share a dtype");
  const bool paged = block_table.has_value();
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = keys.size(1);
  const int64_t S = paged ? num_keys : keys.size(2);
  at::Tensor table;
  if (paged) {
    table = block_table->to(at::kLong).contiguous();
    TORCH_CHECK(table.dim() == 2 && table.size(0) == B && num_keys >= 0 && num_keys <= table.size(1) * keys.size(2),
                "attention_rows: a block table (B, W) covering num_keys slots");
    if (check_entries) check_table(table, keys.size(0), "attention_rows");
  } else {
    TORCH_CHECK(keys.size(0) == B, "attention_rows: mismatched shapes");
  }
  TORCH_CHECK(keys.size(3) == D && Hkv > 0 && Hq % Hkv == 0, "attention_rows: mismatched shapes");
  TORCH_CHECK(D <= attn_generic::kMaxD, "attention_rows: head dims up to ", attn_generic::kMaxD, ", got ", D);
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attention_rows: keys and values need a contiguous last axis");
  const at::Tensor lens = prefix_lens.to(at::kLong).contiguous();
  TORCH_CHECK(lens.numel() == B, "attention_rows: prefix_lens must hold one length per row");
  const int64_t* pre = lens.data_ptr<int64_t>();
  at::Tensor m;
  const bool* mp = nullptr;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 3 && m.size(0) == B && m.size(1) == T && m.size(2) == S,
                "attention_rows: mask must be (B, T, S)");
    mp = m.data_ptr<bool>();
  } else {
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(pre[b] >= 0 && pre[b] + T <= S, "attention_rows: row ", b, " needs ", pre[b] + T, " slots, has ", S);
  }
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "attention_rows: bfloat16 or float32 tensors, got ", q.scalar_type());
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  AttnProblem p{qc.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), q.scalar_type() == at::kBFloat16,
                B, Hq, Hkv, T, D, S, {keys.stride(0), keys.stride(1), keys.stride(2)},
                {values.stride(0), values.stride(1), values.stride(2)}, mp, pre, window,
                paged ? table.data_ptr<int64_t>() : nullptr, paged ? table.size(1) : 0, paged ? keys.size(2) : 0};
  const int64_t blocks = (S + 15) / 16, Dp = (D + 15) / 16 * 16;
  at::Tensor kt = at::empty({B * Hkv * blocks * D * 16}, q.options().dtype(at::kFloat));
  at::Tensor vf = at::empty({B * Hkv * blocks * 16 * Dp}, q.options().dtype(at::kFloat));
  float* ktp = kt.data_ptr<float>();
  float* vfp = vf.data_ptr<float>();
  const int isa = attention_isa();
  at::parallel_for(0, B * Hkv * blocks, 8, [&](int64_t u0, int64_t u1) {
    (isa == 2 ? specdec_convert_kv_avx512 : isa == 1 ? specdec_convert_kv_avx2 : attn_generic::convert_kv)(
        p, ktp, vfp, u0, u1);
  });
  const int64_t items = B * Hkv * ((Hq / Hkv * T + kAttnQueries - 1) / kAttnQueries);
  at::parallel_for(0, items, 1, [&](int64_t w0, int64_t w1) {
    (isa == 2 ? specdec_attention_rows_avx512 : isa == 1 ? specdec_attention_rows_avx2
                                                         : attn_generic::attention_rows_items)(p, ktp, vfp, w0, w1);
  });
  return out;
}

// The op: every block-table entry checked (cache_attention's own call skips it: paged_write checked them).
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const c10::optional<at::Tensor>& mask, const at::Tensor& prefix_lens, int64_t window,
                          const c10::optional<at::Tensor>& block_table, int64_t num_keys) {
  return attention_rows_impl(q, keys, values, mask, prefix_lens, window, block_table, num_keys, true);
}

// Store k, v (B, Hkv, T, D) at slots prefix_lens[b] + t of a paged layer's pools kl, vl (NB, Hkv, bs, D)
// through the block table (B, W); slots whose entry is 0 (no block) are dropped.
void paged_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& kl, at::Tensor& vl, const at::Tensor& table,
                 const int64_t* pre) {
  const int64_t B = k.size(0), H = k.size(1), T = k.size(2), D = k.size(3), bs = kl.size(2), W = table.size(1);
  TORCH_CHECK(kl.is_contiguous() && vl.is_contiguous() && vl.sizes() == kl.sizes() && k.scalar_type() == kl.scalar_type() &&
                  v.scalar_type() == vl.scalar_type() && kl.size(1) == H && kl.size(3) == D && v.sizes() == k.sizes() &&
                  table.dim() == 2 && table.size(0) == B,
              "cache_attention: contiguous pools (NB, H, bs, D) of the new keys' and values' shape and dtype, a "
              "block table (B, W)");
  check_table(table, kl.size(0), "cache_attention");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  const size_t row = D * kl.element_size();
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  char* kd = static_cast<char*>(kl.data_ptr());
  char* vd = static_cast<char*>(vl.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = pre[b] + t;
      TORCH_CHECK(slot / bs < W, "cache_attention: slot ", slot, " is past the block table");
      const int64_t blk = tp[b * W + slot / bs], at = slot % bs;
      if (blk == 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t src = ((b * H + h) * T + t) * row, dst = ((blk * H + h) * bs + at) * row;
        std::memcpy(kd + dst, ks + src, row);
        std::memcpy(vd + dst, vs + src, row);
      }
    }
}

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                           at::Tensor v_cache, int64_t layer, const at::Tensor& prefix_lens, int64_t window,
                           const c10::optional<at::Tensor>& block_mask, bool invariant,
                           const c10::optional<at::Tensor>& block_table) {
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
  const int64_t S = longest + T;
  at::Tensor kl = k_cache.select(0, layer), vl = v_cache.select(0, layer);  // (B, Hkv, S_max, D) or (NB, Hkv, bs, D)
  at::Tensor keys, values;  // (B, Hkv, S, D)
  at::Tensor table;
  if (block_table.has_value()) {
    table = block_table->to(at::kLong).contiguous();
    paged_write(k, v, kl, vl, table, pre);
    if (!invariant) {  // gather the rows' used blocks for SDPA
      const int64_t bs = kl.size(2), n = (S + bs - 1) / bs;
      const at::Tensor ids = table.narrow(1, 0, n).reshape({B * n});
      keys = kl.index_select(0, ids).view({B, n, Hkv, bs, D}).transpose(1, 2).reshape({B, Hkv, n * bs, D}).narrow(2, 0, S);
      values = vl.index_select(0, ids).view({B, n, Hkv, bs, D}).transpose(1, 2).reshape({B, Hkv, n * bs, D}).narrow(2, 0, S);
    }
  } else {
    for (int64_t b = 0; b < B; ++b) {
      kl.select(0, b).narrow(1, pre[b], T).copy_(k.select(0, b));
      vl.select(0, b).narrow(1, pre[b], T).copy_(v.select(0, b));
    }
    keys = kl.narrow(2, 0, S);
    values = vl.narrow(2, 0, S);
  }
  // the invariant kernel reads the pools through the table itself
  const at::Tensor& ik = table.defined() ? kl : keys;
  const at::Tensor& iv = table.defined() ? vl : values;
  c10::optional<at::Tensor> itable;
  if (table.defined()) itable = table;
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
    if (invariant) return attention_rows_impl(q, ik, iv, mask, lens, window, itable, S, false);
  } else if (invariant) {
    return attention_rows_impl(q, ik, iv, c10::nullopt, lens, window, itable, S, false);
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
        "Tensor prefix_lens, int window, Tensor? block_mask, bool invariant=False, Tensor? block_table=None) -> Tensor");
  m.def("attention_rows(Tensor q, Tensor keys, Tensor values, Tensor? mask, Tensor prefix_lens, int window, "
        "Tensor? block_table=None, int num_keys=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(SPECDEC_OPS, CPU, m) { 
  m.impl("cache_attention", &cache_attention);
  m.impl("attention_rows", &attention_rows);
}
