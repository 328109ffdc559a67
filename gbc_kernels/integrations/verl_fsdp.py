"""gbc on verl 0.9.1's FSDP engine (``FSDPEngineWithLMHead``): the lm_head's forward replaced
by gbc's loss or log-prob pass (docs/verl.md). What is not FSDP-specific — options, the loss's
inputs, verl's metrics, Lopti, the patches and the registry — is in
:mod:`gbc_kernels.integrations.verl_engine`."""

from __future__ import annotations

import contextlib

import torch

import gbc_kernels as gbc
from gbc_kernels import methods
from gbc_kernels.integrations import hf
from gbc_kernels.integrations.verl_engine import (
    CERTAINTY_KEY, ENV_ON, KL_WEIGHT_KEY, SCALE_KEY, EngineMethods, _flag, _is_ppo_loss,
    _rng_state, _Rows, _stable_id, _temperature)


def _check_supported(engine, micro_batch):
    """verl options the engine cannot honour: refused, never silently changed."""
    if _flag(micro_batch, "use_fused_kernels"):
        raise ValueError("use_fused_kernels: gbc's engine replaces verl's fused kernel; set "
                         "actor_rollout_ref.model.use_fused_kernels=False")
    if getattr(engine, "use_ulysses_sp", False):
        raise ValueError("ulysses_sequence_parallel_size: gbc's engine needs every response "
                         "row of a micro-batch on one rank; set it to 1 (or unset "
                         f"{ENV_ON} to run verl's own step)")
    if _flag(micro_batch, "distillation_use_topk"):
        raise ValueError("distillation: gbc's engine computes the policy loss only; unset "
                         f"{ENV_ON} for distillation runs")



class GBCEngineMixin(EngineMethods):
    """The gbc forward step on top of one of verl's FSDP engines with an lm_head."""

    # -- the one forward --------------------------------------------------------------------
    def _gbc_forward(self, micro_batch, head_fn):
        """verl's forward of ``micro_batch`` (its inputs, autocast, the wrapped module) with the
        lm_head's forward replaced by ``head_fn(hidden_2d, rows)``; returns (what head_fn
        returned, a 0 tied to the stand-in output)."""
        from verl.utils.device import get_device_id, get_device_name

        micro_batch = micro_batch.to(get_device_id())
        _check_supported(self, micro_batch)
        use_rmpad = _flag(micro_batch, "use_remove_padding", True)
        model_inputs, _ = self.prepare_model_inputs(micro_batch=micro_batch)
        rows = _Rows(micro_batch, use_rmpad)
        inner = hf.unwrap(self.module)
        captured = {}

        def head_forward(hidden, *args, **kwargs):
            captured["out"] = head_fn(hidden.reshape(-1, hidden.shape[-1]), rows, inner)
            tie = captured["out"][0]
            tie = tie if isinstance(tie, torch.Tensor) and tie.requires_grad else None
            stand_in = hidden[..., :1] * 0
            return stand_in + tie.to(hidden.dtype) if tie is not None else stand_in

        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        ctx = (contextlib.nullcontext() if dtype == torch.float32
               else torch.autocast(device_type=get_device_name(), dtype=dtype))
        with ctx, hf.replaced_head_forward(inner, head_forward):
            raw = self.module(**model_inputs, use_cache=False)
        if "out" not in captured:
            raise RuntimeError("model: its forward did not call its lm_head")
        logits = raw.logits if hasattr(raw, "logits") else raw[0]
        return micro_batch, rows, captured["out"], (logits.float() * 0).sum()

    @staticmethod
    def _head_rows(hidden2d, rows, inner):
        head = hf.lm_head(inner)         # the weight as FSDP holds it during this forward
        h = hidden2d[rows.hidden]
        if h.dtype != head.weight.dtype:
            h = h.to(head.weight.dtype)
        return h, head


    # -- training: the loss -----------------------------------------------------------------
    def _gbc_train_step(self, micro_batch, loss_function):
        token_out = {}
        rng = _rng_state()          # verl's metrics draw (Clip-Cov) from the loss's state

        def head_fn(hidden2d, rows, inner):
            h, head = self._head_rows(hidden2d, rows, inner)
            kw = self._gbc_loss_inputs(micro_batch, loss_function, rows.valid)
            with torch.autocast(device_type=h.device.type, enabled=False):
                return gbc.fused_linear_policy_loss(h, head.weight, rows.targets, bias=head.bias,
                                                    token_out=token_out, **kw)

        micro_batch, rows, (loss, gbc_metrics), zero = self._gbc_forward(micro_batch, head_fn)
        loss = loss + zero
        model_output = {"log_probs": rows.nested(token_out["logp"])}
        if "entropy" in token_out:
            model_output["entropy"] = rows.nested(token_out["entropy"])
        metrics = self._gbc_metrics(loss_function, micro_batch, model_output, rng, gbc_metrics)
        return loss, {"model_output": model_output, "loss": loss.detach().item(),
                      "metrics": metrics}

    # -- forward only: log-probs, entropy, sum of squared probabilities ---------------------
    def _gbc_infer_step(self, micro_batch):
        want_entropy = bool(_flag(micro_batch, "calculate_entropy"))
        want_p2 = bool(_flag(micro_batch, "calculate_sum_pi_squared"))
        certainty = _flag(micro_batch, CERTAINTY_KEY, None)

        def head_fn(hidden2d, rows, inner):
            h, head = self._head_rows(hidden2d, rows, inner)
            # padding positions read row 0 with target 0: computed, then dropped by nested()
            with torch.autocast(device_type=h.device.type, enabled=False):
                if certainty is not None:      # the reference pass of critical-token KL
                    st = methods.reference_stats(
                        h, head.weight, rows.targets, methods.MethodOptions(**certainty),
                        head.bias, temperature=_temperature(micro_batch),
                        backend=self.gbc_options.backend, logit_softcap=hf.logit_softcap(inner))
                    return None, st.ref_logp, None, None, st.kl_weight
                out = gbc.fused_linear_logprobs(
                    h, head.weight, rows.targets, head.bias,
                    temperature=_temperature(micro_batch), return_entropy=want_entropy,
                    backend=self.gbc_options.backend, return_sum_p2=want_p2,
                    logit_softcap=hf.logit_softcap(inner))
            return (None,) + tuple(out)

        micro_batch, rows, out, _ = self._gbc_forward(micro_batch, head_fn)
        model_output = {"log_probs": rows.nested(out[1])}
        if want_entropy:
            model_output["entropy"] = rows.nested(out[2])
        if want_p2:
            model_output["sum_pi_squared"] = rows.nested(out[3])
        if certainty is not None:
            model_output[KL_WEIGHT_KEY] = rows.nested(out[4])
        return torch.tensor(1.0), {"model_output": model_output, "loss": 1.0, "metrics": {}}

    # -- NTHR: one no-grad old-policy pass over the rank's update batch ----------------------
    @torch.no_grad()
    def gbc_nthr_pass(self, data, defaults=None):
        """NTHR's token scales (docs/math.md §4) of the rank's share of an actor update, from
        the policy before the update's first optimizer step (the old policy), at the rollout
        temperature: adds ``gbc_token_scale`` ([B, T], the layout of ``advantages``) to
        ``data``. Groups are verl's ``uid``s; a group split over data-parallel ranks is scored
        with every rank's responses (``nthr_scale(data_parallel_group=...)``). ``defaults``:
        the micro-batching keys the worker injects for its forward-only passes. Call it in
        ``eval_mode`` (the worker hook does)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.engine.utils import prepare_micro_batches

        opts = self.gbc_options
        uids = tu.get(data, "uid")
        if uids is None:
            raise ValueError("nthr: the update batch has no 'uid' field (verl's group ids, "
                             "which its trainer sets for GRPO-style advantages)")
        adv, rmask = data["advantages"], data["response_mask"]
        B, T = rmask.shape
        view = data.copy()
        for key, val in (defaults or {}).items():
            if key not in view.keys() and val is not None:
                tu.assign_non_tensor(view, **{key: val})
        micro_batches, order = prepare_micro_batches(
            data=view, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True)
        if order is None:
            order, start = [], 0
            for mb in micro_batches:
                order.append(list(range(start, start + len(mb))))
                start += len(mb)
        dp_group = self._gbc_dp_group()
        responses = data["responses"]
        needed = methods.union_ids(responses.values() if responses.is_nested else responses,
                                   dp_group)
        keep = {}
        hidden, targets, logp, valid = None, torch.zeros(B, T, dtype=torch.long), None, None
        temps = set()
        for mb, idx in zip(micro_batches, order):
            temp = _temperature(mb)
            temp_values = temp.unique().tolist() if isinstance(temp, torch.Tensor) else [temp]
            temps.update(float(t) for t in temp_values)

            def head_fn(hidden2d, rows, inner):
                h, head = self._head_rows(hidden2d, rows, inner)
                cap = hf.logit_softcap(inner)
                with torch.autocast(device_type=h.device.type, enabled=False):
                    lp = gbc.fused_linear_logprobs(
                        h, head.weight, rows.targets, head.bias, temperature=temp,
                        backend=opts.backend, logit_softcap=cap)[0]
                if "w" not in keep:   # the lm_head rows NTHR's restricted logits need
                    ids = needed.to(head.weight.device)
                    keep["w"] = head.weight.detach().index_select(0, ids).clone()
                    keep["b"] = (None if head.bias is None else
                                 head.bias.detach().index_select(0, ids).clone())
                    keep["softcap"] = cap
                return None, h.detach(), rows, lp

            _, rows, (_, h, rows, lp), _ = self._gbc_forward(mb, head_fn)
            if hidden is None:
                hidden = h.new_zeros(B, T, h.shape[-1])
                logp = torch.zeros(B, T, dtype=torch.float32, device=h.device)
                valid = torch.zeros(B, T, dtype=torch.bool, device=h.device)
                targets = targets.to(h.device)
            i = torch.as_tensor(idx, dtype=torch.long, device=h.device)
            hidden[i], logp[i], valid[i] = h, lp.float(), rows.valid
            targets[i] = rows.targets
        if len(temps) > 1:
            raise ValueError(f"nthr: the rollout temperatures of the batch differ "
                             f"({sorted(temps)[:4]}); NTHR's scores use one temperature")
        device = hidden.device
        mask = rmask.to(device).bool() & valid
        compact = torch.searchsorted(needed.to(device), targets)
        compact = torch.where(mask, compact.clamp(max=needed.numel() - 1), 0)
        adv = adv.to(device).float()
        gids = torch.tensor([_stable_id(u) for u in uids], dtype=torch.long, device=device)
        res = methods.nthr_token_scale(hidden, keep["w"], compact, mask, gids, adv, opts,
                                       bias=keep["b"], temperature=temps.pop(), logp=logp,
                                       logit_softcap=keep["softcap"], backend=opts.backend,
                                       data_parallel_group=dp_group)
        data[SCALE_KEY] = res.scale.to(data["advantages"].device)
        m = methods.nthr_metrics(res, adv, mask)
        self._gbc_update_metrics = {f"actor/gbc_{k}": float(v) for k, v in m.items()}
        return res


    # -- verl's entry points ----------------------------------------------------------------
    def forward_step(self, micro_batch, loss_function, forward_only):
        if loss_function is None and forward_only:
            if _flag(micro_batch, "distillation_use_topk") or "responses" not in micro_batch:
                return super().forward_step(micro_batch, loss_function, forward_only)
            return self._gbc_infer_step(micro_batch)
        if not _is_ppo_loss(loss_function):      # SFT, distillation: verl's own step
            return super().forward_step(micro_batch, loss_function, forward_only)
        if forward_only:
            with torch.no_grad():
                return self._gbc_train_step(micro_batch, loss_function)
        return self._gbc_train_step(micro_batch, loss_function)
