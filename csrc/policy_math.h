// The per-token GRPO policy-loss math of docs/math.md §1-§3 in C++ (the PyTorch copy is
// gbc_kernels/_loss_math.py, the Triton copy gbc_kernels/triton/kernels.py; all three are
// tested against gbc_reference). Scalar, double precision: it runs once per token, next to a
// pass over the whole vocabulary, so its cost does not matter and its rounding stays small.
#pragma once

#include <cmath>

namespace gbc {

enum KlEstimator { KL_K1 = 0, KL_K2 = 1, KL_K3 = 2, KL_LOW_VAR = 3 };
enum Phase { PHASE_NONE = 0, PHASE_LOW = 1, PHASE_HIGH = 2 };

struct PolicyParams {
  double eps_low, eps_high;
  double clip_c;        // <= 0: dual clip off
  double kl_coef;
  int kl_estimator;     // KlEstimator
  double entropy_coef;
  double ar_alpha;
  int phase;            // Phase
  double eta;           // Lopti threshold (used when phase != NONE)
  bool kl_ratio;        // KL estimator multiplied by the ratio r (TRL's bias correction)
};

struct TokenIn {
  double logp, entropy;
  double adv, old_logp, ref_logp, token_scale, kl_weight;
  bool has_old;
};

struct TokenOut {
  double loss, dlogp, dentropy;     // l, dl/dlogp, dl/dH
  double ratio, adv_hat, ar, p_old, kl;
};

// KL estimator value and derivative in logp, delta = ref - logp. Clamp passes the gradient on
// the closed interval (PyTorch's convention), as do the other copies.
inline void kl_estimate(int est, double logp, double ref, double* val, double* grad) {
  const double d = ref - logp;
  switch (est) {
    case KL_K1: *val = -d; *grad = 1.0; return;
    case KL_K2: *val = 0.5 * d * d; *grad = -d; return;
    case KL_K3: {
      const double e = std::exp(d);
      *val = e - d - 1.0; *grad = 1.0 - e; return;
    }
    default: {
      const double dc = d < -20.0 ? -20.0 : (d > 20.0 ? 20.0 : d);
      const double e = std::exp(dc);
      const double raw = e - dc - 1.0;
      *val = raw < -10.0 ? -10.0 : (raw > 10.0 ? 10.0 : raw);
      const bool inside = d >= -20.0 && d <= 20.0 && raw >= -10.0 && raw <= 10.0;
      *grad = inside ? 1.0 - e : 0.0;
    }
  }
}

inline TokenOut token_terms(const PolicyParams& P, const TokenIn& in) {
  TokenOut o;
  const double old = in.has_old ? in.old_logp : in.logp;
  o.p_old = std::exp(old);
  o.ar = P.ar_alpha != 0.0 ? P.ar_alpha * o.p_old + (1.0 - P.ar_alpha) : 1.0;
  double a = in.adv * o.ar * in.token_scale;
  bool active = true;
  if (P.phase != PHASE_NONE) {
    const bool low = o.p_old < P.eta;       // strict, docs/math.md §3
    active = P.phase == PHASE_LOW ? low : !low;
  }
  if (!active) a = 0.0;
  o.adv_hat = a;
  const double r = std::exp(in.logp - old);
  o.ratio = r;
  const double lo = 1.0 - P.eps_low, hi = 1.0 + P.eps_high;
  const double rc = r < lo ? lo : (r > hi ? hi : r);
  const double pg1 = -a * r, pg2 = -a * rc;
  const bool use1 = pg1 >= pg2;
  const bool in_range = r >= lo && r <= hi;
  double pg = use1 ? pg1 : pg2;
  double dpg = (use1 || in_range) ? pg1 : 0.0;
  if (P.clip_c > 0.0) {
    const double pgd = -a * P.clip_c;
    if (a < 0.0 && pgd < pg) { pg = pgd; dpg = 0.0; }
  }
  o.loss = pg;
  o.dlogp = dpg;
  o.kl = 0.0;
  if (P.kl_coef != 0.0) {
    double kv, dk;
    kl_estimate(P.kl_estimator, in.logp, in.ref_logp, &kv, &dk);
    if (P.kl_ratio) {       // d(r k)/dlogp = r k + r dk
      dk = r * (kv + dk);
      kv *= r;
    }
    kv *= in.kl_weight;
    dk *= in.kl_weight;
    o.kl = kv;
    if (active) { o.loss += P.kl_coef * kv; o.dlogp += P.kl_coef * dk; }
  }
  o.dentropy = 0.0;
  if (P.entropy_coef != 0.0 && active) {
    o.dentropy = -P.entropy_coef;
    o.loss += o.dentropy * in.entropy;
  }
  return o;
}

}  // namespace gbc
