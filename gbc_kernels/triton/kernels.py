"""Triton kernels of the GPU backend (raw ``@triton.jit`` functions; launchers in launch.py).

Per chunk of rows, after cuBLAS has written the chunk's logits into a reused buffer:

1. ``row_stats_kernel``   one program per row, over the vocabulary in tiles of ``BLOCK_V``:
   online max / sum-exp, the target's logit, and (flags) the entropy and ``sum_v p_v^2`` with
   the online rescaling ``s' = a s, t' = a (t - dm s), q' = a^2 q`` (``a = exp(m - m')``).
2. ``policy_token_kernel`` element-wise over tokens: the per-token loss of docs/math.md §1-§3
   (ratio, clips, AR, Lopti phase, token_scale, KL estimators with weights, entropy bonus,
   aggregation weight) -> ``g = w dl/dlogp``, ``gH = w dl/dH``, ``w l`` and the metric
   inputs. The PyTorch copy is ``gbc_kernels/_loss_math.py``, the C++ copy
   ``csrc/policy_math.h``.
3. ``logit_grad_kernel``  one program per row: ``dL/dlogits`` written in place into the buffer.

``policy_rows_kernel`` does all three for the token-local loss in one launch, one program per
row: the row is read by the statistics sweep, and read again and written by the gradient sweep
while much of it is still in L2 (the composition above reads it twice from memory). The three
separate kernels remain for what needs the statistics of other rows first (the objectives of
§10, vocab parallel, the log-prob and statistics entry points).

All math is float32 whatever the storage dtype; row offsets are int64 (rows x V may pass 2^31).
"""

import triton
import triton.language as tl


@triton.jit
def _row_sums(base, V, inv_temp, BLOCK_V: tl.constexpr, WANT_ENTROPY: tl.constexpr,
              WANT_SUM_P2: tl.constexpr):
    # one sweep over a row: the running max m, s = sum e, t = sum e (z - m), q = sum e^2 with
    # e = exp(z - m), each rescaled when the max grows
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)
    q = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        a = tl.exp(m - m_new)
        dm = m_new - m
        e = tl.where(valid, tl.exp(z - m_new), 0.0)
        if WANT_ENTROPY:
            # sum e (z - m): rescale the old part to the new max, then add the tile
            t = tl.where(m == float("-inf"), 0.0, a * (t - dm * s))
            t += tl.sum(e * tl.where(valid, z - m_new, 0.0), axis=0)
        if WANT_SUM_P2:
            q = q * a * a + tl.sum(e * e, axis=0)
        s = s * a + tl.sum(e, axis=0)
        m = m_new
    return m, s, t, q


@triton.jit
def _grad_tile(base, cols, valid, y, inv_temp, lse, g, gh, H, inv_cap,
               HAS_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr):
    # dL/dlogits of one tile, written in place over the logits it reads
    x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32)
    lq = x * inv_temp - lse
    p = tl.exp(lq)
    if HAS_ENTROPY:
        grad = -p * (g + gh * (lq + H))
    else:
        grad = -p * g
    # the one-hot term is folded in before rounding to the storage dtype (y = -1: none)
    grad = tl.where(cols == y, grad + g, grad) * inv_temp
    if SOFTCAP:
        # the buffer holds s = c tanh(x / c): the gradient in x is that in s times
        # 1 - (s / c)^2 (inv_cap = 1 / c)
        t = x * inv_cap
        grad = grad * (1.0 - t * t)
    tl.store(base + cols, grad.to(base.dtype.element_ty), mask=valid)


@triton.jit
def _token_terms(offs, ok, logp, ent, w_ptr, adv_ptr, old_ptr, ref_ptr, ts_ptr, klw_ptr,
                 gh_ptr, g_ptr, wloss_ptr, logp_ptr, ratio_ptr, advh_ptr, ar_ptr, pold_ptr,
                 kl_ptr, eps_low, eps_high, clip_c, kl_coef, entropy_coef, ar_alpha, eta,
                 HAS_OLD: tl.constexpr, HAS_TS: tl.constexpr, HAS_KLW: tl.constexpr,
                 HAS_KL: tl.constexpr, KL_EST: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                 HAS_AR: tl.constexpr, HAS_DUAL: tl.constexpr, PHASE: tl.constexpr,
                 KL_RATIO: tl.constexpr):
    # The per-token loss of docs/math.md §1-§3 at the tokens ``offs`` (a block of tokens, or
    # one row's token: the same code on a vector or a scalar). Stores the per-token outputs;
    # returns (g, gh) = (w dl/dlogp, w dl/dH) for the gradient sweep.
    # KL_EST: index in gbc_kernels.config.KL_ESTIMATORS (k1, k2, k3, low_var_kl);
    # PHASE: 0 none, 1 low, 2 high
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    a = tl.load(adv_ptr + offs, mask=ok, other=0.0)
    if HAS_OLD:
        old = tl.load(old_ptr + offs, mask=ok, other=0.0)
    else:
        old = logp
    p_old = tl.exp(old)
    if HAS_AR:
        ar = ar_alpha * p_old + (1.0 - ar_alpha)
    else:
        ar = tl.zeros_like(logp) + 1.0
    a = a * ar
    if HAS_TS:
        a = a * tl.load(ts_ptr + offs, mask=ok, other=1.0)
    if PHASE == 1:
        active = p_old < eta
    elif PHASE == 2:
        active = p_old >= eta
    else:
        active = ok
    a = tl.where(active, a, 0.0)
    ratio = tl.exp(logp - old)
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    pg1 = -a * ratio
    pg2 = -a * tl.minimum(tl.maximum(ratio, lo), hi)
    use1 = pg1 >= pg2
    in_range = (ratio >= lo) & (ratio <= hi)
    pg = tl.where(use1, pg1, pg2)
    dpg = tl.where(use1 | in_range, pg1, 0.0)
    if HAS_DUAL:
        pgd = -a * clip_c
        dual = (a < 0) & (pgd < pg)
        pg = tl.where(dual, pgd, pg)
        dpg = tl.where(dual, 0.0, dpg)
    # tl.maximum / tl.minimum drop a NaN operand: a NaN log-prob (NaN hidden states or weights)
    # would take the clipped branch and give a finite loss; carry it into the loss instead
    pg = tl.where(logp == logp, pg, logp)
    loss = pg
    dl = dpg
    if HAS_KL:
        d = tl.load(ref_ptr + offs, mask=ok, other=0.0) - logp
        if KL_EST == 0:
            kv = -d
            dk = tl.zeros_like(d) + 1.0
        elif KL_EST == 1:
            kv = 0.5 * d * d
            dk = -d
        elif KL_EST == 2:
            ed = tl.exp(d)
            kv = ed - d - 1.0
            dk = 1.0 - ed
        else:
            dc = tl.minimum(tl.maximum(d, -20.0), 20.0)
            ed = tl.exp(dc)
            raw = ed - dc - 1.0
            kv = tl.minimum(tl.maximum(raw, -10.0), 10.0)
            inside = (d >= -20.0) & (d <= 20.0) & (raw >= -10.0) & (raw <= 10.0)
            dk = tl.where(inside, 1.0 - ed, 0.0)
        if KL_RATIO:  # d(r k)/dlogp = r k + r dk
            dk = ratio * (kv + dk)
            kv = kv * ratio
        if HAS_KLW:
            klw = tl.load(klw_ptr + offs, mask=ok, other=0.0)
            kv = kv * klw
            dk = dk * klw
        loss += tl.where(active, kl_coef * kv, 0.0)
        dl += tl.where(active, kl_coef * dk, 0.0)
        tl.store(kl_ptr + offs, kv, mask=ok)
    gh = tl.zeros_like(w)
    if HAS_ENTROPY:
        dent = tl.where(active, -entropy_coef, 0.0)
        loss += dent * ent
        gh = w * dent
        tl.store(gh_ptr + offs, gh, mask=ok)
    g = w * dl
    tl.store(g_ptr + offs, g, mask=ok)
    tl.store(wloss_ptr + offs, w * loss, mask=ok)
    tl.store(logp_ptr + offs, logp, mask=ok)
    tl.store(ratio_ptr + offs, ratio, mask=ok)
    tl.store(advh_ptr + offs, a, mask=ok)
    tl.store(ar_ptr + offs, ar, mask=ok)
    tl.store(pold_ptr + offs, p_old, mask=ok)
    return g, gh


@triton.jit
def row_stats_kernel(logits_ptr, stride_row, targets_ptr, lse_ptr, zmax_ptr, tz_ptr, ent_ptr,
                     sp2_ptr, itemp_ptr, V, inv_temp,
                     BLOCK_V: tl.constexpr, WANT_ENTROPY: tl.constexpr,
                     WANT_SUM_P2: tl.constexpr, ROW_TEMP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    it = inv_temp
    if ROW_TEMP:                            # a per-row temperature (float32 [rows])
        it = tl.load(itemp_ptr + row)
    m, s, t, q = _row_sums(base, V, it, BLOCK_V, WANT_ENTROPY, WANT_SUM_P2)
    log_s = tl.log(s)
    y = tl.load(targets_ptr + row)          # -1: the target is not in this vocabulary slice
    z_y = tl.load(base + y, mask=y >= 0, other=0.0).to(tl.float32) * it
    tl.store(lse_ptr + row, m + log_s)
    tl.store(zmax_ptr + row, m)
    tl.store(tz_ptr + row, z_y)
    if WANT_ENTROPY:
        tl.store(ent_ptr + row, log_s - t / s)
    if WANT_SUM_P2:
        tl.store(sp2_ptr + row, q / (s * s))


@triton.jit
def logit_grad_kernel(logits_ptr, stride_row, targets_ptr, lse_ptr, ent_ptr, g_ptr, gh_ptr,
                      itemp_ptr, V, inv_temp, inv_cap, BLOCK_V: tl.constexpr,
                      HAS_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr,
                      ROW_TEMP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    it = inv_temp
    if ROW_TEMP:
        it = tl.load(itemp_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    y = tl.load(targets_ptr + row)
    gh = 0.0
    H = 0.0
    if HAS_ENTROPY:
        gh = tl.load(gh_ptr + row)
        H = tl.load(ent_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        _grad_tile(base, cols, cols < V, y, it, lse, g, gh, H, inv_cap, HAS_ENTROPY,
                   SOFTCAP)


@triton.jit
def policy_token_kernel(
        tz_ptr, lse_ptr, ent_ptr, w_ptr, adv_ptr, old_ptr, ref_ptr, ts_ptr, klw_ptr,
        g_ptr, gh_ptr, wloss_ptr, logp_ptr, ratio_ptr, advh_ptr, ar_ptr, pold_ptr, kl_ptr,
        n, eps_low, eps_high, clip_c, kl_coef, entropy_coef, ar_alpha, eta,
        BLOCK: tl.constexpr, HAS_OLD: tl.constexpr, HAS_TS: tl.constexpr,
        HAS_KLW: tl.constexpr, HAS_KL: tl.constexpr, KL_EST: tl.constexpr,
        HAS_ENTROPY: tl.constexpr, HAS_AR: tl.constexpr, HAS_DUAL: tl.constexpr,
        PHASE: tl.constexpr, KL_RATIO: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    logp = tl.load(tz_ptr + offs, mask=ok, other=0.0) - tl.load(lse_ptr + offs, mask=ok, other=0.0)
    ent = 0.0
    if HAS_ENTROPY:
        ent = tl.load(ent_ptr + offs, mask=ok, other=0.0)
    _token_terms(offs, ok, logp, ent, w_ptr, adv_ptr, old_ptr, ref_ptr, ts_ptr, klw_ptr,
                 gh_ptr, g_ptr, wloss_ptr, logp_ptr, ratio_ptr, advh_ptr, ar_ptr, pold_ptr,
                 kl_ptr, eps_low, eps_high, clip_c, kl_coef, entropy_coef, ar_alpha, eta,
                 HAS_OLD, HAS_TS, HAS_KLW, HAS_KL, KL_EST, HAS_ENTROPY, HAS_AR, HAS_DUAL, PHASE,
                 KL_RATIO)


@triton.jit
def policy_rows_kernel(
        logits_ptr, stride_row, targets_ptr, ent_ptr, sp2_ptr, w_ptr, adv_ptr, old_ptr,
        ref_ptr, ts_ptr, klw_ptr, g_ptr, gh_ptr, wloss_ptr, logp_ptr, ratio_ptr, advh_ptr,
        ar_ptr, pold_ptr, kl_ptr, V, inv_temp, inv_cap,
        eps_low, eps_high, clip_c, kl_coef, entropy_coef, ar_alpha, eta,
        BLOCK_V: tl.constexpr, NEED_GRAD: tl.constexpr, SOFTCAP: tl.constexpr,
        WANT_ENTROPY: tl.constexpr, HAS_OLD: tl.constexpr, HAS_TS: tl.constexpr,
        HAS_KLW: tl.constexpr, HAS_KL: tl.constexpr, KL_EST: tl.constexpr,
        HAS_ENTROPY: tl.constexpr, HAS_AR: tl.constexpr, HAS_DUAL: tl.constexpr,
        PHASE: tl.constexpr, KL_RATIO: tl.constexpr):
    # One program per row, the three steps above in one: the row's statistics (first sweep),
    # its per-token loss, and its logit gradient (second sweep, in place). The second sweep
    # runs over the tiles in reverse: it starts with the tiles the first sweep read last, the
    # ones most likely still in L2.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    m, s, t, q = _row_sums(base, V, inv_temp, BLOCK_V, WANT_ENTROPY, True)
    log_s = tl.log(s)
    lse = m + log_s
    y = tl.load(targets_ptr + row)
    logp = tl.load(base + y, mask=y >= 0, other=0.0).to(tl.float32) * inv_temp - lse
    H = log_s - t / s               # the entropy (used only where WANT_ENTROPY computed t)
    if WANT_ENTROPY:
        tl.store(ent_ptr + row, H)
    tl.store(sp2_ptr + row, q / (s * s))
    g, gh = _token_terms(row, row >= 0, logp, H, w_ptr, adv_ptr, old_ptr, ref_ptr, ts_ptr,
                         klw_ptr, gh_ptr, g_ptr, wloss_ptr, logp_ptr, ratio_ptr, advh_ptr,
                         ar_ptr, pold_ptr, kl_ptr, eps_low, eps_high, clip_c, kl_coef,
                         entropy_coef, ar_alpha, eta, HAS_OLD, HAS_TS, HAS_KLW, HAS_KL, KL_EST,
                         HAS_ENTROPY, HAS_AR, HAS_DUAL, PHASE, KL_RATIO)
    if NEED_GRAD:
        last = tl.cdiv(V, BLOCK_V) - 1
        for i in range(0, last + 1):
            cols = (last - i) * BLOCK_V + tl.arange(0, BLOCK_V)
            _grad_tile(base, cols, cols < V, y, inv_temp, lse, g, gh, H, inv_cap,
                       HAS_ENTROPY, SOFTCAP)


@triton.jit
def scale_unless_one_kernel(x_ptr, n, g_ptr, BLOCK: tl.constexpr):
    # x *= g in place, read from device memory, and nothing at all when g == 1 (the unit
    # upstream gradient of loss.backward()): the backward decides without a host sync. A
    # grid-stride loop over a few waves of programs, so the g == 1 case costs one wave.
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
            valid = offs < n
            x = tl.load(x_ptr + offs, mask=valid).to(tl.float32)
            tl.store(x_ptr + offs, (x * g).to(x_ptr.dtype.element_ty), mask=valid)
