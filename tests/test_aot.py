"""The Triton kernels compile ahead of time for sm_80 and sm_90 without a GPU, with no spills."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_aot_compiles_every_variant_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "gbc_kernels.aot", "--arch", "sm_80,sm_90"],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = []
    for line in r.stdout.splitlines():
        m = re.match(r"(\w+)\s+(.*?)\s+sm_(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+(\S+)$",
                     line)
        if m:
            rows.append(m.groups())
    kernels = {k for k, *_ in rows}
    assert kernels == {"row_stats_kernel", "logit_grad_kernel", "policy_token_kernel",
                       "policy_rows_kernel", "scale_unless_one_kernel"}
    assert all(int(local) == 0 for *_, local, _, _ in rows), "local memory (spills) reported"
    assert r.stdout.strip().endswith("0 failure(s)")
    # the run-time specialisations are both reported; with V (and the row stride) divisible by
    # 16 the row kernels load 16 bytes per thread, as the launcher's hints allow
    for k, div_label, odd_label in (("row_stats_kernel", "V%16=0", "V odd"),
                                    ("logit_grad_kernel", "V%16=0", "V odd"),
                                    ("policy_rows_kernel", "V%16=0", "V odd"),
                                    ("scale_unless_one_kernel", "n%16=0", "n odd")):
        div = [w for name, label, *_, w in rows if name == k and div_label in label]
        odd = [w for name, label, *_, w in rows if name == k and odd_label in label]
        assert div and odd and len(div) == len(odd)
        assert all(w == "16B" for w in div), div
