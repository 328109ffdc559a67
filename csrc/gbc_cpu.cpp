// gbc_kernels CPU backend: the two streaming passes over a chunk of logits.
//
//   row_stats   per row of z = logits * inv_temp: max, LSE, z[target], entropy, sum_v p_v^2
//               (inv_temp_rows: a float32 [rows] tensor of per-row inverse temperatures)
//   logit_grad_ overwrite the chunk with dL/dlogits given g = dL/dlogp and gH = dL/dH per row:
//                 dL/dz_v = g (1[v = y] - p_v) - gH p_v (log p_v + H),  dL/dlogits = inv_temp dL/dz
//
// Final-logit soft-capping (Gemma-2/3, s = c tanh(x / c)) is applied to the chunk in place by the
// driver before these passes, so they see the capped logits; the gradient pass then multiplies by
// ds/dx = 1 - (s / c)^2, read from the capped value it overwrites (inv_cap = 1 / c; 0 = off).
//
// The chunk's logits come from one BLAS call made by the Python driver (at::addmm into a reused
// buffer); these passes run over that buffer, rows in parallel (at::parallel_for, OpenMP), each
// row by one thread in a fixed order, so results do not depend on the thread count.
// -fno-trapping-math lets GCC if-convert (and so vectorise) the branch-free exp below.
// Built with -ffp-contract=off: z = x * inv_temp is rounded the same way wherever it is formed,
// so z - max(z) is exactly 0 at the max (an FMA would leave its rounding error, visible as p != 1
// when p -> 1 at large logits).
// Math is float32 for float32/bfloat16/float16 storage. The inner loops are plain float loops
// with `omp simd` reductions and a polynomial exp, compiled for AVX-512, AVX2 and baseline x86-64
// (GCC target_clones picks one at load time; no hardware probing at install time).

// Only the ATen headers used (the Tensor type and its methods, at::empty, the dtype dispatch,
// at::parallel_for), no Python: the bindings are csrc/bindings.cpp, compiled beside this file.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gbc_cpu.h"
#include "policy_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GBC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GBC_CLONES
#endif

namespace {

// exp(x) for x <= 0 (what softmax needs after subtracting the row max), |rel err| < 2 ulp on
// [-87, 0]; 0 below -87.3 where expf underflows. Cody-Waite reduction + Cephes polynomial.
// Branch-free so that the loops vectorise.
inline float exp_neg(float x) {
  const float lo = -87.33654f;
  const bool under = x < lo;
  x = x < lo ? lo : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? 0.0f : y * scale;
}

GBC_CLONES float row_max(const float* __restrict x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// s = sum e, t = sum e (z - zmax), q = sum e^2 with e = exp(z - zmax), z = x * inv_temp.
// Summed in blocks of kSumBlock elements (float32 SIMD lanes, a few terms each), the block sums
// added in double: a float32 running sum over a whole 150k-250k vocabulary row loses ~1e-5 of
// the LSE and the entropy, more than the float32 logits mode allows (docs/kernels.md,
// "Precision"). The order is fixed, so results do not depend on the thread count.
constexpr int64_t kSumBlock = 512;

GBC_CLONES void row_sums(const float* __restrict x, int64_t n, float inv_temp, float zmax,
                         bool want_tq, float* out) {
  double S = 0.0, T = 0.0, Q = 0.0;
  for (int64_t b0 = 0; b0 < n; b0 += kSumBlock) {
    const int64_t b1 = b0 + kSumBlock < n ? b0 + kSumBlock : n;
    float s = 0.f, t = 0.f, q = 0.f;
    if (want_tq) {
#pragma omp simd reduction(+ : s, t, q)
      for (int64_t i = b0; i < b1; ++i) {
        const float d = x[i] * inv_temp - zmax;
        const float e = exp_neg(d);
        s += e;
        t += e * d;
        q += e * e;
      }
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t i = b0; i < b1; ++i) s += exp_neg(x[i] * inv_temp - zmax);
    }
    S += s;
    T += t;
    Q += q;
  }
  out[0] = static_cast<float>(S);
  out[1] = static_cast<float>(T);
  out[2] = static_cast<float>(Q);
}

// x <- inv_temp * (-p (g + gH (z - lse + H))), p = exp(z - lse), z = x * inv_temp
// With soft-capping (inv_cap > 0) x holds the capped logit s and the result is multiplied by
// ds/dx = 1 - (s inv_cap)^2.
GBC_CLONES void row_grad(float* __restrict x, int64_t n, float inv_temp, float lse, float H,
                         float g, float gH, float inv_cap) {
  if (inv_cap > 0.f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float sv = x[i];
      const float lq = sv * inv_temp - lse;
      const float p = exp_neg(lq);
      const float t = sv * inv_cap;
      x[i] = -inv_temp * p * (g + gH * (lq + H)) * (1.f - t * t);
    }
    return;
  }
  if (gH != 0.f) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float lq = x[i] * inv_temp - lse;
      const float p = exp_neg(lq);
      x[i] = -inv_temp * p * (g + gH * (lq + H));
    }
  } else {
    const float c = -inv_temp * g;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = c * exp_neg(x[i] * inv_temp - lse);
  }
}

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// A row as float: the row itself for float32 storage, else converted into thread-local scratch.
template <typename T>
struct RowView {
  std::vector<float> scratch;
  float* get(T* row, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      return row;
    } else {
      scratch.resize(n);
      for (int64_t i = 0; i < n; ++i) scratch[i] = to_float(row[i]);
      return scratch.data();
    }
  }
  void put(T* row, const float* data, int64_t n) {
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t i = 0; i < n; ++i) row[i] = static_cast<T>(data[i]);
    }
  }
};

void check_chunk(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.device().is_cpu(), "logits: expected a CPU tensor, got ", logits.device());
  TORCH_CHECK(logits.dim() == 2, "logits: expected a 2-d [rows, V] tensor, got ", logits.sizes());
  TORCH_CHECK(logits.stride(1) == 1, "logits: expected unit stride over the vocabulary");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) &&
                  targets.scalar_type() == at::kLong,
              "targets: expected int64 [", logits.size(0), "], got ", targets.scalar_type(), " ",
              targets.sizes());
  auto st = logits.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "logits: expected float32, bfloat16 or float16, got ", st);
}

// Run fn(r, x) on every row r of the chunk, rows in parallel; x is the row as float (the row
// itself for float32 storage, a thread-local converted copy otherwise). With write_back, x is
// stored back into the row (rounded to the storage dtype) after fn.
template <typename F>
void for_each_row(const at::Tensor& logits, bool write_back, const F& fn) {
  const int64_t rows = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "gbc_rows", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      RowView<scalar_t> view;
      for (int64_t r = b; r < e; ++r) {
        scalar_t* row = base + r * ld;
        float* x = view.get(row, V);
        fn(r, x);
        if (write_back) view.put(row, x, V);
      }
    });
  });
}

// A per-row input as contiguous float32 [rows]; undefined when absent.
at::Tensor rows_f32(const c10::optional<at::Tensor>& t, int64_t rows, const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->dim() == 1 && t->size(0) == rows, name, ": expected [", rows, "], got ",
              t->sizes());
  return t->to(at::kFloat).contiguous();
}

}  // namespace

namespace gbc {

std::vector<at::Tensor> row_stats(at::Tensor logits, at::Tensor targets, double inv_temp,
                                  bool want_entropy, bool want_sum_p2,
                                  c10::optional<at::Tensor> inv_temp_rows) {
  check_chunk(logits, targets);
  targets = targets.contiguous();
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({rows}, f32), zmax = at::empty({rows}, f32);
  at::Tensor tz = at::empty({rows}, f32);
  at::Tensor ent = want_entropy ? at::empty({rows}, f32) : at::Tensor();
  at::Tensor sp2 = want_sum_p2 ? at::empty({rows}, f32) : at::Tensor();
  const float it = static_cast<float>(inv_temp);
  const int64_t* y = targets.data_ptr<int64_t>();
  float* lse_p = lse.data_ptr<float>();
  float* zmax_p = zmax.data_ptr<float>();
  float* tz_p = tz.data_ptr<float>();
  float* ent_p = want_entropy ? ent.data_ptr<float>() : nullptr;
  float* sp2_p = want_sum_p2 ? sp2.data_ptr<float>() : nullptr;
  at::Tensor itr_c = rows_f32(inv_temp_rows, rows, "inv_temp_rows");
  const float* itr = itr_c.defined() ? itr_c.data_ptr<float>() : nullptr;
  for_each_row(logits, false, [&](int64_t r, float* x) {
        const float it_r = itr ? itr[r] : it;     // a per-row temperature, when given
        const float m = row_max(x, V) * it_r;
        float sums[3];
        row_sums(x, V, it_r, m, want_entropy || want_sum_p2, sums);
        const float log_s = std::log(sums[0]);
        zmax_p[r] = m;
        lse_p[r] = m + log_s;
        tz_p[r] = y[r] >= 0 ? x[y[r]] * it_r : 0.f;   // -1: the target is not in this slice
        // H = log s - t / s  (shifted by the max: a sum of small terms)
        if (ent_p) ent_p[r] = log_s - sums[1] / sums[0];
        if (sp2_p) sp2_p[r] = sums[2] / (sums[0] * sums[0]);
  });
  return {lse, zmax, tz, ent, sp2};
}

}  // namespace gbc

namespace {

// One row's gradient, the one-hot term folded in before rounding to the storage dtype.
// y = -1: the target is not in this vocabulary slice (vocab parallel): no one-hot term.
inline void grad_row(float* x, int64_t V, int64_t y, float it, float lse, float H, float g,
                     float gH, float inv_cap) {
  if (y < 0) {
    row_grad(x, V, it, lse, H, g, gH, inv_cap);
    return;
  }
  const float sy = x[y];
  row_grad(x, V, it, lse, H, g, gH, inv_cap);
  const float t = sy * inv_cap;
  x[y] += it * g * (inv_cap > 0.f ? 1.f - t * t : 1.f);
}

}  // namespace

namespace gbc {

at::Tensor logit_grad_(at::Tensor logits, at::Tensor targets, double inv_temp, at::Tensor lse,
                       c10::optional<at::Tensor> entropy, at::Tensor g_logp,
                       c10::optional<at::Tensor> g_entropy, double inv_cap,
                       c10::optional<at::Tensor> inv_temp_rows) {
  check_chunk(logits, targets);
  const int64_t rows = logits.size(0), V = logits.size(1);
  targets = targets.contiguous();
  at::Tensor lse_c = rows_f32(lse, rows, "lse"), g_c = rows_f32(g_logp, rows, "g_logp");
  const bool has_h = g_entropy.has_value() && g_entropy->defined();
  at::Tensor gh_c, ent_c;
  if (has_h) {
    TORCH_CHECK(entropy.has_value() && entropy->defined(), "entropy: required with g_entropy");
    gh_c = rows_f32(g_entropy, rows, "g_entropy");
    ent_c = rows_f32(entropy, rows, "entropy");
  }
  const float it = static_cast<float>(inv_temp);
  const int64_t* y = targets.data_ptr<int64_t>();
  const float* lse_p = lse_c.data_ptr<float>();
  const float* g_p = g_c.data_ptr<float>();
  const float* gh_p = has_h ? gh_c.data_ptr<float>() : nullptr;
  const float* ent_p = has_h ? ent_c.data_ptr<float>() : nullptr;
  at::Tensor itr_c = rows_f32(inv_temp_rows, rows, "inv_temp_rows");
  const float* itr = itr_c.defined() ? itr_c.data_ptr<float>() : nullptr;
  for_each_row(logits, true, [&](int64_t r, float* x) {
    grad_row(x, V, y[r], itr ? itr[r] : it, lse_p[r], has_h ? ent_p[r] : 0.f, g_p[r], has_h ? gh_p[r] : 0.f,
             static_cast<float>(inv_cap));
  });
  return logits;
}

// The fused loss's work on one chunk, each row kept in cache from its statistics to its
// gradient: max; sums (LSE, entropy, sum p^2); the per-token loss (policy_math.h); then
// dL/dlogits written in place. One read and one write of the chunk instead of three and one.
// Per-row inputs are float32 [rows] tensors (token_scale/kl_weight/old/ref may be undefined).
// Returns float32 [rows] tensors:
//   logp, entropy, sum_p2, g (= w dl/dlogp), wloss (= w l), ratio, adv_hat, ar, p_old, kl
std::vector<at::Tensor> policy_rows_(at::Tensor logits, at::Tensor targets, double inv_temp,
                                     at::Tensor w, at::Tensor adv,
                                     c10::optional<at::Tensor> old_logp,
                                     c10::optional<at::Tensor> ref_logp,
                                     c10::optional<at::Tensor> token_scale,
                                     c10::optional<at::Tensor> kl_weight,
                                     double eps_low, double eps_high, double clip_c,
                                     double kl_coef, int64_t kl_estimator, double entropy_coef,
                                     double ar_alpha, int64_t phase, double eta,
                                     bool kl_ratio, bool need_grad, double inv_cap) {
  check_chunk(logits, targets);
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto in_f32 = [&](const c10::optional<at::Tensor>& t, const char* name) {
    return rows_f32(t, rows, name);
  };
  targets = targets.contiguous();
  at::Tensor w_c = in_f32(w, "w"), adv_c = in_f32(adv, "adv");
  at::Tensor old_c = in_f32(old_logp, "old_logp"), ref_c = in_f32(ref_logp, "ref_logp");
  at::Tensor ts_c = in_f32(token_scale, "token_scale"), kw_c = in_f32(kl_weight, "kl_weight");
  TORCH_CHECK(kl_coef == 0.0 || ref_c.defined(), "ref_logp: required when kl_coef != 0");
  gbc::PolicyParams P{eps_low, eps_high, clip_c, kl_coef, static_cast<int>(kl_estimator),
                      entropy_coef, ar_alpha, static_cast<int>(phase), eta, kl_ratio};
  const bool want_entropy = entropy_coef != 0.0;
  auto f32 = logits.options().dtype(at::kFloat);
  std::vector<at::Tensor> out;
  for (int i = 0; i < 10; ++i) out.push_back(at::empty({rows}, f32));
  float* o[10];
  for (int i = 0; i < 10; ++i) o[i] = out[i].data_ptr<float>();
  const float it = static_cast<float>(inv_temp);
  const int64_t* y = targets.data_ptr<int64_t>();
  const float* wp = w_c.data_ptr<float>();
  const float* ap = adv_c.data_ptr<float>();
  const float* op = old_c.defined() ? old_c.data_ptr<float>() : nullptr;
  const float* rp = ref_c.defined() ? ref_c.data_ptr<float>() : nullptr;
  const float* tp = ts_c.defined() ? ts_c.data_ptr<float>() : nullptr;
  const float* kp = kw_c.defined() ? kw_c.data_ptr<float>() : nullptr;
  for_each_row(logits, need_grad, [&](int64_t r, float* x) {
        const float m = row_max(x, V) * it;
        float sums[3];
        row_sums(x, V, it, m, true, sums);
        const float log_s = std::log(sums[0]);
        const float lse = m + log_s;
        const float H = log_s - sums[1] / sums[0];
        gbc::TokenIn in;
        // z_y - LSE rounded as row_stats' (target_z - lse in float32): the log-prob of the
        // training pass is then bitwise the one fused_linear_logprobs / token_stats give
        in.logp = static_cast<double>(x[y[r]] * it - lse);
        in.entropy = H;
        in.adv = ap[r];
        in.has_old = op != nullptr;
        in.old_logp = op ? op[r] : 0.0;
        in.ref_logp = rp ? rp[r] : 0.0;
        in.token_scale = tp ? tp[r] : 1.0;
        in.kl_weight = kp ? kp[r] : 1.0;
        const gbc::TokenOut t = gbc::token_terms(P, in);
        const float g = static_cast<float>(wp[r] * t.dlogp);
        const float gH = want_entropy ? static_cast<float>(wp[r] * t.dentropy) : 0.f;
        o[0][r] = static_cast<float>(in.logp);
        o[1][r] = H;
        o[2][r] = sums[2] / (sums[0] * sums[0]);
        o[3][r] = g;
        o[4][r] = static_cast<float>(wp[r] * t.loss);
        o[5][r] = static_cast<float>(t.ratio);
        o[6][r] = static_cast<float>(t.adv_hat);
        o[7][r] = static_cast<float>(t.ar);
        o[8][r] = static_cast<float>(t.p_old);
        o[9][r] = static_cast<float>(t.kl);
        if (need_grad) {
          grad_row(x, V, y[r], it, lse, H, g, gH, static_cast<float>(inv_cap));
        }
  });
  return out;
}

}  // namespace gbc
