"""Chunked PyTorch backend: runs anywhere PyTorch runs. Two float32 scratch buffers of the
chunk's size, reused across chunks (never [N, V])."""

from __future__ import annotations

import torch

from .base import Backend, RowStats, Workspace


class TorchBackend(Backend):
    name = "torch"
    buffers_per_chunk = 3   # the chunk's logits, z (float32), p (float32)

    def row_stats(self, logits, targets, inv_temp, want_entropy, want_sum_p2, ws: Workspace):
        rows, V = logits.shape
        ct = torch.promote_types(logits.dtype, torch.float32)
        zmax = logits.amax(dim=-1).to(ct) * inv_temp    # a float, or per row: [rows]
        # z - max(z): shifting first makes the entropy (lse - max) - sum p (z - max) a sum of
        # small terms instead of a difference of two large ones
        zs = ws.get("z", rows, V, logits, ct)
        # copy first: torch.mul(bf16, float, out=fp32) rounds the product to bf16
        zs.copy_(logits).mul_(_col(inv_temp)).sub_(zmax.unsqueeze(1))
        p = torch.exp(zs, out=ws.get("p", rows, V, logits, ct))
        sumexp = p.sum(dim=-1)
        lse_s = torch.log(sumexp)
        inside = targets >= 0                   # -1: the target is not in this vocabulary slice
        target_z = torch.where(inside, zs.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
                               + zmax, 0.0)
        entropy = sum_p2 = None
        if want_entropy or want_sum_p2:
            # torch.sum's cascaded float32 sums, in the z buffer (no longer read): a BLAS dot
            # over a 150k-250k row keeps a few running sums and loses ~1e-3 of the entropy
            p.div_(sumexp.unsqueeze(1))
            if want_entropy:
                entropy = lse_s - zs.mul_(p).sum(dim=-1)
            if want_sum_p2:
                sum_p2 = torch.mul(p, p, out=zs).sum(dim=-1)
        return RowStats(lse_s + zmax, zmax, target_z, entropy, sum_p2)

    def logit_grad_(self, logits, targets, inv_temp, lse, entropy, g_logp, g_entropy,
                    ws: Workspace, softcap=None):
        rows, V = logits.shape
        # work in place when the buffer is float32 (float64), else in a float32 scratch buffer
        ct = torch.promote_types(logits.dtype, torch.float32)
        cap = None
        if softcap is not None:         # ds/dx = 1 - (s / c)^2 of the capped logits s
            cap = ws.get("cap", rows, V, logits, ct).copy_(logits)
            cap.div_(softcap).square_().neg_().add_(1.0)
        work = logits if logits.dtype == ct else ws.get("z", rows, V, logits, ct)
        logq = (work if work is logits else work.copy_(logits)).mul_(_col(inv_temp))
        logq.sub_(lse.unsqueeze(1))
        p = torch.exp(logq, out=ws.get("p", rows, V, logits, ct))
        if g_entropy is not None:
            # dH/dz_v = -p_v (log p_v + H)
            grad = logq.add_(entropy.unsqueeze(1)).mul_(g_entropy.unsqueeze(1))
            grad.add_(g_logp.unsqueeze(1)).mul_(p).neg_()
        else:
            grad = torch.mul(p, g_logp.unsqueeze(1), out=logq).neg_()
        onehot = torch.where(targets >= 0, g_logp, 0.0).to(grad.dtype)   # -1: not in the slice
        grad.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), onehot.unsqueeze(1))
        if cap is not None:
            grad.mul_(cap)
        if isinstance(inv_temp, torch.Tensor) or inv_temp != 1.0:
            grad.mul_(_col(inv_temp))
        if grad is not logits:
            logits.copy_(grad)
        return logits


def _col(inv_temp):
    """A per-row inverse temperature ``[rows]`` as a column ``[rows, 1]``; a float as it is."""
    return inv_temp.unsqueeze(1) if isinstance(inv_temp, torch.Tensor) else inv_temp
