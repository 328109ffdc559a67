"""gbc on verl 0.9.1's FSDP engine (``FSDPEngineWithLMHead``): the lm_head's forward replaced
by gbc's loss or log-prob pass (docs/verl.md), under Ulysses sequence parallelism too; the rest
is :mod:`.engine`'s."""

from __future__ import annotations

import contextlib

import torch

import gbc_kernels as gbc
from gbc_kernels import methods
from gbc_kernels.integrations import hf
from gbc_kernels.integrations.releases import no_hub_kernels
from gbc_kernels.integrations.verl.engine import (
    BATCH_SELECTING_MODES, CERTAINTY_KEY, ENV_ON, KL_WEIGHT_KEY, LOG_KEPT_MASS_KEY, NTHR_ROW_KEY,
    SUPPORT_REF_KEY, EngineMethods, _flag, _is_ppo_loss, _rng_state, _Rows, _temperature)
from gbc_kernels.sequence_parallel import check_heads, owned_sum, whole_loss


def _check_supported(engine, micro_batch):
    """verl options the engine cannot honour: refused, never silently changed."""
    if _flag(micro_batch, "use_fused_kernels"):
        raise ValueError("use_fused_kernels: gbc's engine replaces verl's fused kernel; set "
                         "actor_rollout_ref.model.use_fused_kernels=False")
    if getattr(engine, "use_ulysses_sp", False) and not _flag(micro_batch,
                                                             "use_remove_padding", True):
        raise ValueError("use_remove_padding: verl's Ulysses sequence parallelism "
                         "(ulysses_sequence_parallel_size > 1) slices the packed stream; set "
                         "actor_rollout_ref.model.use_remove_padding=True")
    if _flag(micro_batch, "distillation_use_topk"):
        raise ValueError("distillation: gbc's engine computes the policy loss only; unset "
                         f"{ENV_ON} for distillation runs")


def _check_ulysses_loss(engine, loss_function):
    """Under Ulysses SP each rank's loss sees its own tokens: Clip-Cov / KL-Cov, which pick
    tokens from the whole batch (at random, by rank), are refused in verl's words."""
    if not getattr(engine, "use_ulysses_sp", False):
        return
    mode = getattr(loss_function.keywords["config"].policy_loss, "loss_mode", "vanilla")
    if mode in BATCH_SELECTING_MODES:
        raise ValueError(f"policy_loss.loss_mode: {mode!r} selects tokens from the whole batch "
                         "(Clip-Cov at random, KL-Cov by covariance rank), which gbc's loss "
                         "under Ulysses sequence parallelism (ulysses_sequence_parallel_size "
                         "> 1) does not reproduce; choose another loss_mode, set "
                         f"ulysses_sequence_parallel_size=1, or unset {ENV_ON} for verl's step")


def _check_ulysses_heads(engine):
    """verl's Ulysses attention scatters the heads over the SP group: a size that does not
    divide them is refused before the model is built."""
    sp = int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1)
    if sp > 1:
        check_heads(engine.model_config.hf_config, sp, "ulysses_sequence_parallel_size")


class _RankRows:
    """This rank's response rows of a micro-batch (:class:`_Rows`): ``hidden [B, T]`` (rows of
    the rank's flattened hidden states), ``valid`` (the positions this rank holds), ``targets``;
    under Ulysses SP (``group``) the rank holds ``n`` consecutive positions of verl's padded
    packed stream, rank ``r`` positions ``r * n`` to ``(r + 1) * n``."""

    def __init__(self, rows, n_local: int, group=None):
        self.rows, self.group, self.targets = rows, group, rows.targets
        if group is None:
            self.hidden, self.valid = rows.hidden, rows.valid
        else:
            import torch.distributed as dist

            start = dist.get_rank(group) * n_local
            self.hidden, self.valid = rows.sequence_slice(start, start + n_local)

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """``values [B, T, ...]`` at this rank's positions -> every position's, summed over the
        SP group (each position has one owner; the others give 0). No autograd."""
        if self.group is None:
            return values
        return owned_sum(values, self.valid, self.group)


def _whole_ids(rows, ids: torch.Tensor) -> torch.Tensor:
    """The kept ids a pass built ``[B, T, K]`` at this rank's positions -> the whole
    micro-batch's on every rank of the Ulysses SP group (each position's from its owner,
    ``-1`` padded to the group's widest ``K``)."""
    if rows.group is None:
        return ids
    import torch.distributed as dist

    k = torch.tensor([ids.shape[-1]], dtype=torch.long, device=ids.device)
    dist.all_reduce(k, op=dist.ReduceOp.MAX, group=rows.group)
    ids = torch.nn.functional.pad(ids, (0, int(k) - ids.shape[-1]), value=-1)
    return rows.whole(ids + 1) - 1


def _ulysses_loss(share: torch.Tensor, group, size: int) -> torch.Tensor:
    """verl's Ulysses step computes the whole micro-batch's loss on every SP rank, and its
    gather's backward scales each rank's slice of the log-probs by the SP size; gbc's loss is
    the rank's share (the shares sum to the whole). Returned: the whole loss's value, with the
    gradient of ``size * share``, so every rank's gradients equal those of verl's step."""
    return whole_loss(share, group, size)


class GBCEngineMixin(EngineMethods):
    """The gbc forward step on top of one of verl's FSDP engines with an lm_head."""

    _gbc_keeps_nthr = True      # its forward-only step keeps NTHR's inputs (.engine)

    def initialize(self):
        _check_ulysses_heads(self)
        # transformers >= 5.25 kernelizes every from_pretrained model, which the kernels
        # package refuses under verl's meta-device init (ranks != 0): the model is built as
        # on 5.24, nothing kernelized (releases.no_hub_kernels, issue 65)
        with no_hub_kernels():
            return super().initialize()

    def _ulysses_group(self):
        """verl's Ulysses SP group, or None without sequence parallelism."""
        return self.ulysses_parallel_group if getattr(self, "use_ulysses_sp", False) else None

    # -- the one forward --------------------------------------------------------------------
    def _gbc_forward(self, micro_batch, head_fn):
        """verl's forward of ``micro_batch`` (its inputs, autocast, the wrapped module) with the
        lm_head's forward replaced by ``head_fn(hidden_2d, rank_rows, inner)`` (``rank_rows``:
        a :class:`_RankRows`, the rank's own slice under Ulysses SP); returns (micro_batch,
        rank_rows, what head_fn returned, a 0 tied to the stand-in output)."""
        from verl.utils.device import get_device_id, get_device_name

        micro_batch = micro_batch.to(get_device_id())
        _check_supported(self, micro_batch)
        use_rmpad = _flag(micro_batch, "use_remove_padding", True)
        model_inputs, _ = self.prepare_model_inputs(micro_batch=micro_batch)
        rows = _Rows(micro_batch, use_rmpad)
        inner = hf.unwrap(self.module)
        captured = {}

        def head_forward(hidden, *args, **kwargs):
            hidden2d = hidden.reshape(-1, hidden.shape[-1])
            captured["rows"] = _RankRows(rows, hidden2d.shape[0], self._ulysses_group())
            captured["out"] = head_fn(hidden2d, captured["rows"], inner)
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
        return micro_batch, captured["rows"], captured["out"], (logits.float() * 0).sum()

    @staticmethod
    def _head_rows(hidden2d, rows, inner):
        head = hf.lm_head(inner)         # the weight as FSDP holds it during this forward
        return hidden2d[rows.hidden].to(head.weight.dtype), head

    # -- training: the loss -----------------------------------------------------------------
    def _gbc_train_step(self, micro_batch, loss_function):
        _check_ulysses_loss(self, loss_function)
        token_out = {}
        rng = _rng_state()          # verl's metrics draw (Clip-Cov) from the loss's state

        def head_fn(hidden2d, rows, inner):
            h, head = self._head_rows(hidden2d, rows, inner)
            # the whole micro-batch's normalisers; under SP the loss sees the rank's positions
            kw = self._gbc_loss_inputs(micro_batch, loss_function, rows.rows.valid)
            if rows.group is not None:
                kw["mask"] = kw["mask"] & rows.valid
                kw["sequence_parallel"] = gbc.SequenceParallel(rows.group)
            with torch.autocast(device_type=h.device.type, enabled=False):
                return gbc.fused_linear_policy_loss(h, head.weight, rows.targets, bias=head.bias,
                                                    token_out=token_out, **kw)

        micro_batch, rows, (loss, gbc_metrics), zero = self._gbc_forward(micro_batch, head_fn)
        if rows.group is not None:
            loss = _ulysses_loss(loss, rows.group, self.ulysses_sequence_parallel_size)
        loss = loss + zero
        model_output = {k: rows.rows.nested(rows.whole(token_out[name]))
                        for k, name in (("log_probs", "logp"), ("entropy", "entropy"))
                        if name in token_out}
        metrics = self._gbc_metrics(loss_function, micro_batch, model_output, rng, gbc_metrics)
        return loss, {"model_output": model_output, "loss": loss.detach().item(),
                      "metrics": metrics}

    # -- forward only: log-probs, entropy, sum of squared probabilities ---------------------
    def _gbc_infer_step(self, micro_batch):
        certainty = _flag(micro_batch, CERTAINTY_KEY, None)
        # the old-log-prob pass with NTHR on: the response rows are kept for NTHR's scoring
        keep = self._gbc_keeping if NTHR_ROW_KEY in micro_batch.keys() else None
        # the sampler's kept set (support): the old-policy pass's (one kept set per rollout:
        # built there, its ids returned), or the reference's (that set replayed, or rebuilt)
        plan = self._gbc_plan()
        old = plan is not None and self._gbc_old_pass(micro_batch)
        support = plan.old_pass_kwargs() if old else {}
        kept_mass = support.get("return_log_kept_mass", False)
        building = support.get("return_support_ids", False)

        def head_fn(hidden2d, rows, inner):
            h, head = self._head_rows(hidden2d, rows, inner)
            kw = dict(temperature=_temperature(micro_batch), backend=self.gbc_options.backend,
                      logit_softcap=hf.logit_softcap(inner))
            scored = {} if old else self._gbc_scored(
                plan, micro_batch, rows.targets.shape[1], "the reference pass", h.device)
            # padding positions read row 0 with target 0: computed, then dropped by nested()
            with torch.autocast(device_type=h.device.type, enabled=False):
                if certainty is not None:      # the reference pass of critical-token KL
                    st = methods.reference_stats(h, head.weight, rows.targets,
                                                 methods.MethodOptions(**certainty), head.bias,
                                                 **kw, **scored)
                    return None, ({"log_probs": st.ref_logp, KL_WEIGHT_KEY: st.kl_weight},
                                  None)
                out = gbc.fused_linear_logprobs(
                    h, head.weight, rows.targets, head.bias,
                    return_entropy=bool(_flag(micro_batch, "calculate_entropy")),
                    return_sum_p2=bool(_flag(micro_batch, "calculate_sum_pi_squared")),
                    logits_dtype=self.gbc_options.logits_dtype, **kw, **support, **scored)
                if keep is not None:     # under Ulysses SP: the whole micro-batch's rows
                    keep.add(micro_batch[NTHR_ROW_KEY], rows.whole(h), rows.targets,
                             rows.rows.valid, head, kw["logit_softcap"], kw["temperature"],
                             logp=rows.whole(out[0]))
            ids = None
            if building:
                out, ids = out[:-1], _whole_ids(rows, out[-1])
            ret = dict(zip(("log_probs", "entropy", "sum_pi_squared"),
                           out[:-1] if kept_mass else out))
            if kept_mass:
                ret[LOG_KEPT_MASS_KEY] = out[-1]
            return None, (ret, ids)

        micro_batch, rows, (_, (out, ids)), _ = self._gbc_forward(micro_batch, head_fn)
        model_output = {k: rows.rows.nested(rows.whole(v)) for k, v in out.items()
                        if v is not None}
        if ids is not None:          # each token's row of the ids kept for the pass's end
            model_output[SUPPORT_REF_KEY] = rows.rows.nested(
                self._gbc_keep_ids(ids, rows.rows.valid))
        return torch.tensor(1.0), {"model_output": model_output, "loss": 1.0, "metrics": {}}

    # -- NTHR: the old-policy forward over the rank's update batch --------------------------
    def _gbc_nthr_forward(self, view, batch):
        """verl's forward-only micro-batches of ``view`` (its ``gbc_row``: the rows of the
        update batch), each micro-batch's response rows into ``batch`` (under Ulysses SP every
        rank of the group adds the whole micro-batch's rows: their hidden states summed from
        the ranks that hold them)."""
        from verl.workers.engine.utils import prepare_micro_batches

        micro_batches, _ = prepare_micro_batches(
            data=view, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True)
        for mb in micro_batches:
            def head_fn(hidden2d, rows, inner):
                h, head = self._head_rows(hidden2d, rows, inner)
                h = rows.whole(h)
                with torch.autocast(device_type=h.device.type, enabled=False):
                    batch.add(mb[NTHR_ROW_KEY], h, rows.targets, rows.rows.valid, head,
                              hf.logit_softcap(inner), _temperature(mb))
                return (None,)

            self._gbc_forward(mb, head_fn)
        return True

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
