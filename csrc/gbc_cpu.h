// The CPU kernels' entry points (csrc/gbc_cpu.cpp), bound to Python in csrc/bindings.cpp.
// Two translation units so that the kernels compile without the Python headers and the two
// compile side by side (ninja).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace gbc {

// Per row of z = logits * inv_temp: {lse, max, z[target], entropy, sum p^2}.
std::vector<at::Tensor> row_stats(at::Tensor logits, at::Tensor targets, double inv_temp,
                                  bool want_entropy, bool want_sum_p2,
                                  c10::optional<at::Tensor> inv_temp_rows);

// Overwrites logits with dL/dlogits; returns them.
at::Tensor logit_grad_(at::Tensor logits, at::Tensor targets, double inv_temp, at::Tensor lse,
                       c10::optional<at::Tensor> entropy, at::Tensor g_logp,
                       c10::optional<at::Tensor> g_entropy, double inv_cap,
                       c10::optional<at::Tensor> inv_temp_rows);

// The fused per-row statistics, policy loss and (with need_grad) logit gradient.
std::vector<at::Tensor> policy_rows_(at::Tensor logits, at::Tensor targets, double inv_temp,
                                     at::Tensor w, at::Tensor adv,
                                     c10::optional<at::Tensor> old_logp,
                                     c10::optional<at::Tensor> ref_logp,
                                     c10::optional<at::Tensor> token_scale,
                                     c10::optional<at::Tensor> kl_weight,
                                     double eps_low, double eps_high, double clip_c,
                                     double kl_coef, int64_t kl_estimator, double entropy_coef,
                                     double ar_alpha, int64_t phase, double eta,
                                     bool kl_ratio, bool need_grad, double inv_cap);

}  // namespace gbc
