"""Lopti's two updates per RL step (docs/math.md §3): kept as the public names
``gbc.lopti_phases`` / ``gbc.lopti_grad_share_low``; the rules live in :mod:`gbc_kernels.methods`."""

from .methods import LOPTI_ORDERS as ORDERS, lopti_grad_share_low, run_lopti as lopti_phases

__all__ = ["ORDERS", "lopti_phases", "lopti_grad_share_low"]
