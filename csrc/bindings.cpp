// Python bindings of the CPU kernels (csrc/gbc_cpu.cpp) as gbc_kernels._C.
// torch/csrc/utils/pybind.h brings pybind11 and torch's at::Tensor casters, the one part of
// <torch/extension.h> a binding needs (that header, the whole C++ frontend, more than doubled
// the compile time).

#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include "gbc_cpu.h"

using gbc::logit_grad_;
using gbc::policy_rows_;
using gbc::row_stats;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gbc_kernels CPU kernels: streaming row statistics and in-place logit gradients";
  m.def("row_stats", &row_stats, "per-row max, LSE, target logit, entropy, sum p^2",
        py::arg("logits"), py::arg("targets"), py::arg("inv_temp"), py::arg("want_entropy"),
        py::arg("want_sum_p2"), py::arg("inv_temp_rows") = py::none());
  m.def("logit_grad_", &logit_grad_, "overwrite logits with dL/dlogits", py::arg("logits"),
        py::arg("targets"), py::arg("inv_temp"), py::arg("lse"), py::arg("entropy"),
        py::arg("g_logp"), py::arg("g_entropy"), py::arg("inv_cap") = 0.0,
        py::arg("inv_temp_rows") = py::none());
  m.def("policy_rows_", &policy_rows_, "fused per-row statistics, policy loss and logit gradient",
        py::arg("logits"), py::arg("targets"), py::arg("inv_temp"), py::arg("w"), py::arg("adv"),
        py::arg("old_logp"), py::arg("ref_logp"), py::arg("token_scale"), py::arg("kl_weight"),
        py::arg("eps_low"), py::arg("eps_high"), py::arg("clip_c"), py::arg("kl_coef"),
        py::arg("kl_estimator"), py::arg("entropy_coef"), py::arg("ar_alpha"), py::arg("phase"),
        py::arg("eta"), py::arg("kl_ratio"), py::arg("need_grad"), py::arg("inv_cap") = 0.0);
  m.def("num_threads", []() { return at::get_num_threads(); });
}
