"""Lopti's two updates per RL step (docs/math.md §3), for a plain training loop."""

from __future__ import annotations

from typing import Callable, Optional

ORDERS = {"low-first": ("low", "high"), "high-first": ("high", "low")}


def lopti_phases(compute_loss: Callable, optimizer, order: str = "low-first",
                 before_step: Optional[Callable] = None) -> list:
    """Run the two Lopti updates over the same batch: for each phase, ``optimizer.zero_grad()``,
    ``compute_loss(phase).backward()``, ``before_step()`` (e.g. gradient clipping), then
    ``optimizer.step()``.

    ``compute_loss(phase)`` returns the loss or ``(loss, metrics)``; it must recompute the policy's
    forward so that phase 2 sees the parameters after phase 1 (``old_logp`` is not refreshed:
    the ratio carries phase 1's drift and the clip acts on it). ``order="high-first"`` is the
    paper's failing ablation, offered for experiments. Returns the list of what compute_loss
    returned, one per phase.
    """
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {tuple(ORDERS)}, got {order!r}")
    results = []
    for phase in ORDERS[order]:
        optimizer.zero_grad(set_to_none=True)
        out = compute_loss(phase)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        results.append(out)
    return results


def lopti_grad_share_low(results, order: str = "low-first") -> Optional[float]:
    """The step's ``grad_share_low`` over both Lopti updates, from what :func:`lopti_phases`
    returned (``(loss, metrics)`` per phase): the low phase's ``grad_norm_sum`` over both
    phases' (within one phase the share is 0 or 1 by construction). None when the metrics carry
    no ``grad_norm_sum`` (the loss given per-token log-probs). Reads two device values."""
    norms = {}
    for phase, out in zip(ORDERS[order], results):
        metrics = out[1] if isinstance(out, tuple) else {}
        if "grad_norm_sum" not in metrics:
            return None
        norms[phase] = float(metrics["grad_norm_sum"])
    total = norms["low"] + norms["high"]
    return norms["low"] / total if total > 0 else 0.0
