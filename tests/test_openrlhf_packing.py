"""OpenRLHF 0.11.2's packed samples (``ds.packing_samples``) and ring attention
(``ds.ring_attn_size > 1``) through gbc's fused loss, its no-grad passes and the methods,
against OpenRLHF's own packed ``Actor.forward`` and ``PolicyLoss``.

flash-attn and ring-flash-attention have no CPU build: ``tests/standins/varlen_attention.py``
runs their packed (varlen) attention on ``scaled_dot_product_attention`` (one causal block per
packed sequence), flash-attn's padding helpers and its autograd ``all_gather``, and
``tests/standins/ring_flash_attn`` the ring attention (K/V gathered over the gloo group, causal
at the tokens' global positions). The tiny Qwen2 of ``test_openrlhf.py`` runs them as its
attention implementation, in OpenRLHF's path and gbc's alike. Ring attention runs in two gloo
processes; its oracle is OpenRLHF's own ring step (every rank's loss from the gathered
log-probs, DeepSpeed's gradient average over the ranks).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from test_openrlhf import (ORL, CASES, _check, _grads, make_args, make_experience,  # noqa: F401
                           openrlhf_loss, tiny_model)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "standins"))
import varlen_attention as va  # noqa: E402

sys.path.remove(os.path.join(HERE, "standins"))

import gbc_kernels as gbc  # noqa: E402
from gbc_kernels import methods  # noqa: E402
from gbc_kernels.integrations import openrlhf as gorl  # noqa: E402

va.patch_openrlhf()


def packed_actor(seed=0, temperature=1.0, packing=True):
    """OpenRLHF's Actor on the tiny Qwen2 with the varlen stand-in as its attention."""
    model = tiny_model(seed)
    model.config._attn_implementation = va.ATTN_IMPLEMENTATION
    actor = ORL.Actor(model, temperature=temperature)
    actor.packing_samples = packing
    return actor


def _both(args, kl_ctl=0.05, lbi=None, temperature=1.0, seed=1, exp=None, **kw):
    exp = make_experience(seed) if exp is None else exp
    lbi = lbi if lbi is not None else ORL.get_loss_batch_info(None, exp.action_mask)
    out = {}
    for which in ("openrlhf", "gbc"):
        actor = packed_actor(temperature=temperature)
        if which == "openrlhf":
            loss, metrics = openrlhf_loss(actor, exp, args, kl_ctl, lbi)
        else:
            loss, metrics = gorl.fused_actor_loss(actor, exp, args, kl_ctl, lbi, **kw)
        loss.backward()
        out[which] = (float(loss.detach()), metrics, _grads(actor.model))
    return out


@pytest.mark.parametrize("opts", CASES)
def test_packed_loss_equals_openrlhf(opts):
    """Loss, every parameter gradient and OpenRLHF's metrics on packed samples: OpenRLHF's
    packed ``Actor.forward`` + ``PolicyLoss`` against gbc's packed fused loss."""
    _check(_both(make_args(**opts)))


def test_packed_global_normalisers_and_temperature():
    lbi = dict(dp_size=2, batch_num_tokens=torch.tensor(30.0), global_batch_size=torch.tensor(7.0))
    _check(_both(make_args(kl="k3", entropy_coef=0.02), lbi=lbi, temperature=0.7))
