"""The Triton kernels compile ahead of time for sm_80 and sm_90 without a GPU, with no spills."""

from __future__ import annotations

import os
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
    lines = [l for l in r.stdout.splitlines() if " sm_" in l and not l.startswith("kernel ")]
    kernels = {l.split()[0] for l in lines}
    assert kernels == {"row_stats_kernel", "logit_grad_kernel", "policy_token_kernel"}
    assert all(int(l.split()[-3]) == 0 for l in lines), "local memory (spills) reported"
    assert r.stdout.strip().endswith("0 failure(s)")
