"""Ahead-of-time compile every Triton kernel of gbc_kernels for real GPUs, without a GPU.

    python -m gbc_kernels.aot --arch sm_80,sm_90

For each kernel, each constexpr variant the library launches, and each architecture:
``triton.compile`` to PTX and cubin, then ``cuobjdump --dump-resource-usage`` (shipped in
Triton's wheel) for registers, local memory (register spills) and shared memory. Prints one row
per (kernel, variant, arch); exits 1 when a kernel fails to compile or spills registers.

Each kernel is compiled with the specialisation Triton's launcher gives it at run time: every
pointer argument 16-byte aligned (PyTorch's allocations are), and the integer arguments that are
multiples of 16 marked divisible (``tt.divisibility = 16``), which lets the compiler vectorise
the loads. The row kernels are compiled twice: ``V%16=0`` (the row stride and V divisible, as
at the Qwen2.5 and Llama-3 vocabularies 151936 and 128256) and ``V odd`` (neither, e.g.
V = 128257), so the report describes both kinds of run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time


def _attrs(fn, sig, divisible_ints=()):
    """The run-time specialisation: 16-byte aligned pointers, ``divisible_ints`` multiples of
    16 (Triton's ``tt.divisibility`` hint), keyed by argument index as the launcher keys it."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, kind in sig.items() if kind.startswith("*") or name in divisible_ints}


def _variants():
    """(kernel, variant label, signature, constexprs, num_warps, attrs) for every launched
    variant and run-time specialisation."""
    from .triton import kernels as K
    from .triton.launch import MAX_BLOCK_V, SCALE_BLOCK, TOKEN_BLOCK, num_warps

    out = []
    for dtype, want_ent, want_p2, row_t in itertools.product(
            ("fp32", "bf16", "fp16"), (False, True), (False, True), (False, True)):
        sig = {"logits_ptr": f"*{dtype}", "stride_row": "i64", "targets_ptr": "*i64",
               "lse_ptr": "*fp32", "zmax_ptr": "*fp32", "tz_ptr": "*fp32", "ent_ptr": "*fp32",
               "sp2_ptr": "*fp32", "itemp_ptr": "*fp32", "V": "i32", "inv_temp": "fp32",
               "BLOCK_V": "constexpr", "WANT_ENTROPY": "constexpr", "WANT_SUM_P2": "constexpr",
               "ROW_TEMP": "constexpr"}
        const = {"BLOCK_V": MAX_BLOCK_V, "WANT_ENTROPY": want_ent, "WANT_SUM_P2": want_p2,
                 "ROW_TEMP": row_t}
        for spec, ints in SPECS:
            out.append((K.row_stats_kernel,
                        f"{dtype} entropy={int(want_ent)} sum_p2={int(want_p2)} "
                        f"row_temp={int(row_t)} {spec}",
                        sig, const, num_warps(MAX_BLOCK_V),
                        _attrs(K.row_stats_kernel, sig, ints)))
    for dtype, has_h, cap, row_t in itertools.product(("fp32", "bf16", "fp16"), (False, True),
                                                      (False, True), (False, True)):
        sig = {"logits_ptr": f"*{dtype}", "stride_row": "i64", "targets_ptr": "*i64",
               "lse_ptr": "*fp32", "ent_ptr": "*fp32", "g_ptr": "*fp32", "gh_ptr": "*fp32",
               "itemp_ptr": "*fp32", "V": "i32", "inv_temp": "fp32", "inv_cap": "fp32",
               "BLOCK_V": "constexpr", "HAS_ENTROPY": "constexpr", "SOFTCAP": "constexpr",
               "ROW_TEMP": "constexpr"}
        for spec, ints in SPECS:
            out.append((K.logit_grad_kernel,
                        f"{dtype} entropy={int(has_h)} softcap={int(cap)} row_temp={int(row_t)} "
                        f"{spec}", sig,
                        {"BLOCK_V": MAX_BLOCK_V, "HAS_ENTROPY": has_h, "SOFTCAP": cap,
                         "ROW_TEMP": row_t},
                        num_warps(MAX_BLOCK_V), _attrs(K.logit_grad_kernel, sig, ints)))
    ptrs = ["tz_ptr", "lse_ptr", "ent_ptr", "w_ptr", "adv_ptr", "old_ptr", "ref_ptr", "ts_ptr",
            "klw_ptr", "g_ptr", "gh_ptr", "wloss_ptr", "logp_ptr", "ratio_ptr", "advh_ptr",
            "ar_ptr", "pold_ptr", "kl_ptr"]
    sig = {p: "*fp32" for p in ptrs}
    sig.update({"n": "i32", "eps_low": "fp32", "eps_high": "fp32", "clip_c": "fp32",
                "kl_coef": "fp32", "entropy_coef": "fp32", "ar_alpha": "fp32", "eta": "fp32"})
    flags = ["BLOCK", "HAS_OLD", "HAS_TS", "HAS_KLW", "HAS_KL", "KL_EST", "HAS_ENTROPY",
             "HAS_AR", "HAS_DUAL", "PHASE", "KL_RATIO"]
    sig.update({f: "constexpr" for f in flags})
    # Every flag on and off, every KL estimator, every phase (a covering set, not all 2^k).
    base = dict(BLOCK=TOKEN_BLOCK, HAS_OLD=True, HAS_TS=False, HAS_KLW=False, HAS_KL=False,
                KL_EST=2, HAS_ENTROPY=False, HAS_AR=False, HAS_DUAL=False, PHASE=0,
                KL_RATIO=False)
    configs = [dict(base), dict(base, HAS_OLD=False)]
    configs += [dict(base, HAS_KL=True, KL_EST=k, HAS_KLW=k == 1) for k in range(4)]
    configs += [dict(base, HAS_ENTROPY=True), dict(base, HAS_AR=True, HAS_TS=True),
                dict(base, HAS_DUAL=True), dict(base, PHASE=1), dict(base, PHASE=2),
                dict(base, HAS_KL=True, KL_RATIO=True)]
    configs.append(dict(base, HAS_TS=True, HAS_KLW=True, HAS_KL=True, KL_EST=3,
                        HAS_ENTROPY=True, HAS_AR=True, HAS_DUAL=True, PHASE=1))
    label = lambda c, ref: " ".join(f"{k}={int(v)}" for k, v in c.items()
                                    if k in ref and v != ref[k]) or "default"
    for c in configs:
        out.append((K.policy_token_kernel, label(c, dict(base, BLOCK=None)), dict(sig), c, 4,
                    _attrs(K.policy_token_kernel, sig)))
    # the one-pass row kernel: the row kernels' specialisations, the token loss's flags
    rsig = {"logits_ptr": None, "stride_row": "i64", "targets_ptr": "*i64"}
    rsig.update({p: "*fp32" for p in ["ent_ptr", "sp2_ptr", "w_ptr", "adv_ptr", "old_ptr",
                                      "ref_ptr", "ts_ptr", "klw_ptr", "g_ptr", "gh_ptr",
                                      "wloss_ptr", "logp_ptr", "ratio_ptr", "advh_ptr", "ar_ptr",
                                      "pold_ptr", "kl_ptr"]})
    rsig.update({"V": "i32", "inv_temp": "fp32", "inv_cap": "fp32"})
    rsig.update({k: v for k, v in sig.items() if v == "fp32"})
    rsig.update({f: "constexpr" for f in ["BLOCK_V", "NEED_GRAD", "SOFTCAP", "WANT_ENTROPY"]
                 + flags[1:]})
    rbase = {k: v for k, v in base.items() if k != "BLOCK"}
    rbase.update(BLOCK_V=MAX_BLOCK_V, NEED_GRAD=True, SOFTCAP=False, WANT_ENTROPY=False)
    rconfigs = [dict(rbase), dict(rbase, NEED_GRAD=False), dict(rbase, SOFTCAP=True),
                dict(rbase, WANT_ENTROPY=True),
                dict(rbase, HAS_KL=True, KL_EST=3, HAS_KLW=True, KL_RATIO=True),
                dict(rbase, HAS_TS=True, HAS_KLW=True, HAS_KL=True, KL_EST=3, HAS_ENTROPY=True,
                     WANT_ENTROPY=True, HAS_AR=True, HAS_DUAL=True, PHASE=1, SOFTCAP=True)]
    for dtype, c, (spec, ints) in itertools.product(("fp32", "bf16"), rconfigs, SPECS):
        s = dict(rsig, logits_ptr=f"*{dtype}")
        out.append((K.policy_rows_kernel, f"{dtype} {label(c, rbase)} {spec}", s, c,
                    num_warps(MAX_BLOCK_V), _attrs(K.policy_rows_kernel, s, ints)))
    # the in-place scale of the backward (x *= g unless g == 1)
    for dtype, (spec, ints) in itertools.product(("fp32", "bf16"),
                                                 (("n%16=0", ("n",)), ("n odd", ()))):
        s = {"x_ptr": f"*{dtype}", "n": "i64", "g_ptr": "*fp32", "BLOCK": "constexpr"}
        out.append((K.scale_unless_one_kernel, f"{dtype} {spec}", s, {"BLOCK": SCALE_BLOCK}, 4,
                    _attrs(K.scale_unless_one_kernel, s, ints)))
    return out


# the two run-time specialisations of the row kernels: (label, integer arguments divisible by 16)
SPECS = (("V%16=0", ("stride_row", "V")), ("V odd", ()))


def _widest_load(ptx: str) -> str:
    """The widest vector load from global memory in the PTX (``ld.global.v4.b32``: 16 bytes
    per thread): how far the divisibility hints let the compiler vectorise."""
    widths = [int(v or 1) * int(b) // 8
              for v, b in re.findall(r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfu](\d+)", ptx)]
    return f"{max(widths)}B" if widths else "-"


def _cuobjdump():
    import triton.backends.nvidia as nv
    return os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")


def _resources(cubin: bytes):
    """Registers, local memory (spills), shared memory of a cubin, by
    ``cuobjdump --dump-resource-usage`` (shipped in Triton's wheel)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        r = subprocess.run([_cuobjdump(), "--dump-resource-usage", path], capture_output=True,
                           text=True)
    finally:
        os.unlink(path)
    field = lambda k: int(re.search(rf"\b{k}:(\d+)", r.stdout).group(1)) \
        if re.search(rf"\b{k}:(\d+)", r.stdout) else -1
    return field("REG"), field("LOCAL"), field("SHARED"), r.returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_80,sm_90")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gbc_kernels.aot: unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget

    from .triton.launch import COMPILE_OPTIONS   # the options the launches use
    from triton.compiler import ASTSource

    archs = [int(a.replace("sm_", "")) for a in args.arch.split(",")]
    failures = 0
    print(f"{'kernel':<22} {'variant':<58} {'arch':<6} {'regs':>5} {'local B':>8} "
          f"{'smem B':>7} {'compile s':>9} {'widest ld':>9}")
    for fn, label, sig, const, warps, attrs in _variants():
        for arch in archs:
            t0 = time.perf_counter()
            try:
                src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
                ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                    options={"num_warps": warps, **COMPILE_OPTIONS})
                dt = time.perf_counter() - t0
                regs, spill, smem, rc = _resources(ck.asm["cubin"])
                width = _widest_load(ck.asm["ptx"])
                bad = rc != 0 or regs < 0 or spill != 0
                status = "" if not bad else ("  SPILLS" if spill > 0 else "  NO RESOURCE REPORT")
            except Exception as exc:  # a compile failure is a result, reported per row
                dt, regs, spill, smem, bad = time.perf_counter() - t0, -1, -1, -1, True
                width = "-"
                status = f"  FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            failures += bad
            print(f"{fn.__name__:<22} {label[:58]:<58} sm_{arch:<3} {regs:>5} {spill:>8} "
                  f"{smem:>7} {dt:>9.2f} {width:>9}{status}", flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
