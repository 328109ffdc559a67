"""What gbc's engines inside verl 0.9.1 share (docs/verl.md, docs/megatron.md): the options
and the support plan of the rollout config (defined in :mod:`.options`, shared with
:mod:`.trainer`, importable from here), :class:`EngineMethods` (the
fused loss's inputs, verl's metrics, Lopti's two updates, NTHR's inputs), verl's worker patches
(NTHR's pass before the update, the rollout's settings handed to the engines) and the engine
registry (:func:`enable` / :func:`disable`, run by the ``verl.plugins`` entry point under
``GBC_VERL_ENGINE=1``; they also install and undo the trainer's hooks of :mod:`.trainer`). The
engines: :mod:`.fsdp` and :mod:`.megatron`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch

from gbc_kernels import methods
from gbc_kernels.integrations import patching
from gbc_kernels.integrations.releases import TESTED, check_release
from gbc_kernels.integrations import verl as gv
from gbc_kernels.integrations.verl.options import (  # noqa: F401 (names of this module)
    ENV_ON, ENV_OPTIONS, EngineOptions, OPTION_NAMES, SCALE_KEY, KL_WEIGHT_KEY, CERTAINTY_KEY,
    NTHR_ROW_KEY, BATCH_SELECTING_MODES, CRITICAL_KL_FIELDS, REFERENCE_PASS_FIELDS,
    LOG_KEPT_MASS_KEY, ROLLOUT, VLLM_LOGPROBS_MODE, DEFAULT_TIES, SUPPORT_IDS_KEY,
    SUPPORT_REF_KEY, SupportPlan, _cfg, support_plan, padded_support_ids, _check_nthr, _OPTIONS,
    _PATCHES, _on_import)


def _stable_id(uid) -> int:
    """A group id (verl's ``uid``, a string) as an int64 that every process agrees on."""
    import hashlib

    digest = hashlib.blake2b(str(uid).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def _row_keys(data) -> list:
    """One key per sample of a batch: its group id (``uid``), prompt length and token ids. Two
    samples share a key only when they are the same sequence (then their forwards are equal), so
    the key finds a sample's row in another batch of the same samples in any order (verl's
    ``balance_batch``, its data-parallel split)."""
    import hashlib

    from verl.utils import tensordict_utils as tu

    uids, ids = tu.get(data, "uid"), data["input_ids"]
    offsets, values = ids.offsets().tolist(), ids.values().cpu().numpy()
    plens = _lengths(data)[0].tolist()
    return [hashlib.blake2b(f"{u}|{p}|".encode() + values[a:b].tobytes(),
                            digest_size=16).digest()
            for u, p, a, b in zip(uids, plens, offsets[:-1], offsets[1:])]


def _temperatures(data) -> set:
    t = _temperature(data)
    return set(t.unique().tolist()) if isinstance(t, torch.Tensor) else {float(t)}


_every_rank = methods.every_rank      # the ranks take the same branch


def _check_method_fields(opts, cfg, micro_batch):
    """NTHR and critical KL read fields their no-grad passes put in the batch: refused, with
    what is missing, rather than run as plain GRPO."""
    if opts.nthr and SCALE_KEY not in micro_batch:
        raise ValueError(f"nthr: the update batch has no {SCALE_KEY!r} field; it comes from the "
                         "old-policy pass gbc's worker hook runs before the update "
                         "(GBCEngineMixin.gbc_nthr_pass, installed by enable())")
    if opts.critical_kl_exponent is not None:
        opts.check_loss(cfg.kl_coef, "actor.use_kl_loss=True and kl_loss_coef")
        if KL_WEIGHT_KEY not in micro_batch:
            raise ValueError(f"critical_kl_exponent: the update batch has no {KL_WEIGHT_KEY!r} "
                             "field; it comes from the reference pass of verl's trainer as "
                             "gbc patches it (GBC_VERL_ENGINE must be set in the trainer's "
                             "process too: pass it through ray_kwargs.ray_init.runtime_env)")


def _is_ppo_loss(loss_function) -> bool:
    from verl.workers.utils.losses import ppo_loss
    return isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss


def _flag(micro_batch, key, default=False):
    from verl.utils import tensordict_utils as tu
    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def _lengths(micro_batch):
    """(prompt lengths, response lengths, T) as verl's ``no_padding_2_padding`` reads them."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if prompts.is_nested:
        plens, rlens = prompts.offsets().diff(), responses.offsets().diff()
        T = _flag(micro_batch, "max_response_len", -1)
        T = int(rlens.max()) if T is None or T < 0 else int(T)
    else:
        am = micro_batch["attention_mask"]
        plens = am[:, :prompts.shape[1]].sum(1)
        rlens = am[:, prompts.shape[1]:].sum(1)
        T = responses.shape[1]
    return plens.long(), rlens.long(), T


class _Rows:
    """Where the response tokens of a micro-batch sit: ``packed [B, T]`` (verl's packed layout,
    the positions of its nested outputs), ``hidden [B, T]`` (the rows of the model's flattened
    hidden states: packed, or ``b * L + position`` without remove-padding), ``valid``."""

    def __init__(self, micro_batch, use_remove_padding: bool):
        plens, rlens, T = _lengths(micro_batch)
        ids = micro_batch["input_ids"]
        self.offsets = ids.offsets()
        self.nnz = int(self.offsets[-1])
        self.packed, self.valid = gv.response_rows(plens, rlens, T)
        if use_remove_padding:
            self.hidden = self.packed
        else:       # verl pads every sequence to the micro-batch's longest one
            L = int(self.offsets.diff().max())
            starts = torch.arange(plens.shape[0], device=plens.device) * L
            self.hidden = gv.response_rows(plens, rlens, T, starts)[0]
        # the token each row predicts: the next packed token (verl's input_ids_rmpad_rolled)
        self.targets = ids.values()[torch.where(self.valid, self.packed + 1,
                                                torch.zeros_like(self.packed))]

    def sequence_slice(self, start: int, stop: int):
        """``(rows [B, T], owned [B, T])`` of a Ulysses rank whose hidden states are positions
        ``start:stop`` of the (padded) packed stream: each response position's row of the rank's
        own hidden states (0 where it is not the rank's), and which positions are its own."""
        owned = self.valid & (self.packed >= start) & (self.packed < stop)
        return torch.where(owned, self.packed - start, torch.zeros_like(self.packed)), owned

    def nested(self, values: torch.Tensor) -> torch.Tensor:
        """``values [B, T]`` at the response positions of verl's packed layout, 0 elsewhere, as
        the nested tensor verl's ``prepare_model_outputs`` returns."""
        flat = torch.zeros(self.nnz, dtype=values.dtype, device=values.device)
        flat[self.packed[self.valid]] = values[self.valid]
        return torch.nested.nested_tensor_from_jagged(flat, self.offsets)


def support_ids_of(micro_batch, T: int) -> Optional[torch.Tensor]:
    """The old-policy pass's kept ids of ``micro_batch`` (its ``gbc_support_ids``) on the
    response grid ``[B, T, K]`` of the targets (int32, ``-1`` padded), or None when the batch
    has none. verl carries them as the legacy trainer's compact ``[B, 1 + T' + M]`` tensor
    (``methods.compact_support_ids``; a padded ``[B, T', K]`` one is read too), or nested
    per sequence as the worker returned them (``[B, j, K]``, the whole sequence like
    ``log_probs``: the v1 trainer's transfer queue; or its response part ``[B, r, K]``); each
    layout is read at the positions verl's ``no_padding_2_padding`` reads the log-probs."""
    if SUPPORT_IDS_KEY not in micro_batch.keys():
        return None
    ids = micro_batch[SUPPORT_IDS_KEY]
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_nested:
        ids = methods.expand_support_ids(ids)      # the legacy trainer's compact form
    if not isinstance(ids, torch.Tensor) or ids.dim() != 3 or ids.is_floating_point():
        raise ValueError(f"{SUPPORT_IDS_KEY}: expected the old-policy pass's kept ids, an "
                         f"integer tensor [B, T, K] (padded or nested per sequence), got "
                         f"{type(ids).__name__} {getattr(ids, 'dtype', '')}")
    plens, rlens, _ = _lengths(micro_batch)
    B = plens.numel()
    if not ids.is_nested:
        got = ids[:, :T]
        if got.shape[1] < T:
            got = torch.nn.functional.pad(got, (0, 0, 0, T - got.shape[1]), value=-1)
        return got.to(torch.int32)
    values, offsets = ids.values(), ids.offsets().to(plens.device)
    if offsets.numel() == B + 1 and torch.equal(offsets, micro_batch["input_ids"].offsets()
                                                .to(plens.device)):
        pos, valid = gv.response_rows(plens, rlens, T)                   # the whole sequence
    elif offsets.numel() == B + 1 and torch.equal(offsets.diff(), rlens):
        t = torch.arange(T, device=plens.device)                          # the responses only
        valid = t[None] < rlens[:, None]
        pos = torch.where(valid, offsets[:-1, None] + t[None], torch.zeros_like(valid,
                                                                               dtype=torch.long))
    else:
        raise ValueError(f"{SUPPORT_IDS_KEY}: nested kept ids whose lengths are neither the "
                         f"sequences' (input_ids) nor the responses'; the batch's rows and its "
                         f"kept ids no longer match")
    got = values[pos.to(values.device)]
    return torch.where(valid.to(got.device)[..., None], got, -1).to(torch.int32)


def _temperature(micro_batch):
    """verl's temperature as gbc takes it: a float, or the micro-batch's per-sample ``[B]``
    tensor (a leading part of ``[B, T]``: gbc broadcasts it over the tokens)."""
    t = micro_batch["temperature"]
    if isinstance(t, torch.Tensor):
        t = t.float().reshape(-1)
        return float(t) if t.numel() == 1 else t
    return float(t)


def _rng_state():
    """(CPU generator state, {cuda device: state}) of the default generators."""
    cuda = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = {torch.cuda.current_device(): torch.cuda.get_rng_state()}
    return torch.get_rng_state(), cuda


class EngineMethods:
    """What gbc adds to any of verl's engines with an lm_head: its options, the fused loss's
    inputs from a training micro-batch, verl's metrics, and Lopti's two updates."""

    gbc_options: EngineOptions = EngineOptions()
    _gbc_phase: Optional[str] = None
    _gbc_update_metrics: dict = {}    # NTHR's, logged with the update's micro-batches
    _gbc_pass_metrics: dict = {}      # where NTHR's inputs came from, logged alike
    # NTHR from the old-log-prob pass: whether the engine's forward-only step can keep NTHR's
    # inputs, the batch it is filling during that pass, and what it kept (until the update)
    _gbc_keeps_nthr = False
    _gbc_keeping: Optional[methods.NTHRBatch] = None
    _gbc_nthr_kept = None
    # the sampler's kept set (support=replay|kept_mass): the rollout config, handed over by
    # verl's ActorRolloutRefWorker.init_model as gbc wraps it, this engine's role there, and
    # the plan (with the options it was made for)
    _gbc_rollout = None
    _gbc_support_role: Optional[str] = None
    _gbc_support: tuple = (None, None)
    # one kept set per rollout: the ids each micro-batch of the pass in progress built
    # ([n, K] rows of [B, T] grids, flattened), joined when the pass ends (None: no pass)
    _gbc_ids_built: Optional[list] = None

    def gbc_attach_rollout(self, rollout, role: str = "actor") -> Optional[SupportPlan]:
        """The rollout's sampling settings (verl's ``actor_rollout_ref.rollout``) for
        ``support`` (:func:`support_plan`, refused by name here), on this engine of the
        worker's ``role`` (``"actor"``: its forward-only pass with entropy is the old-policy
        pass; ``"ref"``)."""
        opts = self.gbc_options
        # the actor's old-policy pass rebuilds the set in both modes, the reference's under
        # replay only
        rebuilds = role == "actor" or opts.support == "replay"
        plan = support_plan(opts, rollout, self._gbc_tensor_parallel(role) if rebuilds else ())
        _check_nthr(opts, plan)
        self._gbc_rollout, self._gbc_support_role = rollout, role
        self._gbc_support = (opts, plan)
        return plan

    def _gbc_tensor_parallel(self, role) -> list:
        """``(verl's option, size)`` of the vocab parallelism this engine scores under."""
        return []

    def _gbc_plan(self) -> Optional[SupportPlan]:
        """The support plan of a step; ``support`` set on an engine that never got the
        rollout's settings is refused."""
        opts = self.gbc_options
        if opts.support is None:
            return None
        if self._gbc_support_role is None:
            raise ValueError(f"{ENV_OPTIONS}: support={opts.support}: this engine has not got "
                             f"the rollout's sampling settings; gbc reads {ROLLOUT} when "
                             f"verl's ActorRolloutRefWorker.init_model builds its engines "
                             f"(GBC_VERL_ENGINE set in every worker), or call "
                             f"engine.gbc_attach_rollout(rollout_config)")
        if self._gbc_support[0] is not opts:       # the options changed since: planned again
            self.gbc_attach_rollout(self._gbc_rollout, self._gbc_support_role)
        return self._gbc_support[1]

    def _gbc_old_pass(self, micro_batch) -> bool:
        """verl's old-policy pass (``compute_log_prob`` with entropy, on the actor): the
        reference passes ask for no entropy (v0's and v1's trainers alike)."""
        return self._gbc_support_role == "actor" and bool(_flag(micro_batch,
                                                               "calculate_entropy"))

    def _gbc_scored(self, plan, micro_batch, T: int, what: str, device=None) -> dict:
        """The support keywords of a pass that scores the set (the update, the reference
        pass): under one kept set per rollout the micro-batch's ``gbc_support_ids`` on its
        ``[B, T]`` response grid (refused when it has none), else :meth:`SupportPlan.
        scored_kwargs`'s."""
        if plan is None:
            return {}
        ids = support_ids_of(micro_batch, T) if plan.one_set else None
        if ids is not None and device is not None:
            ids = ids.to(device)
        return plan.scored_kwargs(ids, what)

    # -- one kept set per rollout: the ids the old-policy pass built -------------------------
    def _gbc_keep_ids(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A micro-batch's built ids ``[B, T, K]`` (the whole micro-batch's, the same on every
        rank that returns its outputs) kept until the pass ends; returns ``[B, T]`` int64,
        each valid position's row among the pass's kept ids plus 1 (0 elsewhere): the
        per-token output verl's own reordering carries, joined by :meth:`_gbc_join_ids`."""
        B, T, K = ids.shape
        built = self._gbc_ids_built
        if built is None:
            raise RuntimeError("one kept set per rollout: built ids outside a pass")
        start = sum(x.shape[0] for x in built)
        built.append(ids.reshape(B * T, K).to(torch.int32))
        row = start + 1 + torch.arange(B * T, device=ids.device).view(B, T)
        return torch.where(valid.to(ids.device), row, torch.zeros_like(row))

    def _gbc_join_ids(self, output, built: list):
        """The pass's model output with ``gbc_support_ids`` in place of the per-token rows
        :meth:`_gbc_keep_ids` returned: nested per sequence ``[B, j, K]`` like ``log_probs``,
        ``-1`` padded, ``K`` the widest set over every rank of the worker (verl concatenates
        the ranks' outputs), ``-1`` at the positions no response token reads."""
        import torch.distributed as dist

        K = max([x.shape[1] for x in built] + [1])
        if dist.is_available() and dist.is_initialized():
            k = torch.tensor([K], dtype=torch.long,
                             device=built[0].device if built else self._gbc_device())
            dist.all_reduce(k, op=dist.ReduceOp.MAX)
            K = int(k)
        model_output = (output or {}).get("model_output") if isinstance(output, dict) else None
        if not model_output or SUPPORT_REF_KEY not in model_output:
            return output
        rows = model_output.pop(SUPPORT_REF_KEY)
        device = rows.values().device
        table = methods.join_support_ids(
            [torch.full((1, K), -1, dtype=torch.int32, device=device)]
            + [x.to(device) for x in built])
        ids = table[rows.values().long()]
        model_output[SUPPORT_IDS_KEY] = torch.nested.nested_tensor_from_jagged(ids,
                                                                              rows.offsets())
        return output

    def _gbc_device(self):
        from verl.utils.device import get_device_id, get_device_name

        name = get_device_name()
        return torch.device(name if name == "cpu" else f"{name}:{get_device_id()}")

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """verl's, with the kept ids of an old-policy pass under one kept set per rollout
        joined into its output (``gbc_support_ids``, :meth:`_gbc_join_ids`)."""
        plan = self._gbc_plan() if self.gbc_options.support is not None else None
        building = (plan is not None and plan.one_set and forward_only
                    and loss_function is None and self._gbc_old_pass(data))
        if not building:
            return super().forward_backward_batch(data, loss_function, forward_only)
        self._gbc_ids_built = []
        try:
            output = super().forward_backward_batch(data, loss_function, forward_only)
            built = self._gbc_ids_built
        finally:
            self._gbc_ids_built = None
        return self._gbc_join_ids(output, built)

    def _gbc_loss_inputs(self, micro_batch, loss_function, valid) -> dict:
        """The fused loss's keyword arguments for a training ``micro_batch`` beside the hidden
        states, the weight and the targets (per-token fields ``[B, T]``, like ``advantages``)."""
        actor_config = loss_function.keywords["config"]
        opts = self.gbc_options
        fields = ["response_mask", "old_log_probs", "advantages"] + [
            k for k in ("rollout_is_weights", "ref_log_prob", SCALE_KEY, KL_WEIGHT_KEY)
            if k in micro_batch]
        data = micro_batch.select(*fields).to_padded_tensor()
        mask = data["response_mask"].bool() & valid
        cfg = gv.policy_loss_config(actor_config, response_length=mask.shape[1],
                                    **opts.loss_options())
        _check_method_fields(opts, cfg, micro_batch)
        plan = self._gbc_plan()
        support = self._gbc_scored(plan, micro_batch, mask.shape[1], "the actor update",
                                   mask.device)
        if _flag(micro_batch, "calculate_entropy") and not cfg.wants_entropy:
            cfg = dataclasses.replace(cfg, return_entropy=True)
        info = {k: _flag(micro_batch, k, None) for k in
                ("dp_size", "batch_num_tokens", "global_batch_size")}
        return dict(
            mask=mask, advantages=data["advantages"], old_logp=data["old_log_probs"],
            ref_logp=data["ref_log_prob"] if cfg.kl_coef else None, config=cfg,
            phase=self._gbc_phase, token_scale=data.get(SCALE_KEY, None) if opts.nthr else None,
            kl_weight=(data.get(KL_WEIGHT_KEY, None)
                       if opts.critical_kl_exponent is not None else None),
            is_ratio=data.get("rollout_is_weights", None), temperature=_temperature(micro_batch),
            backend=opts.backend, **gv.batch_normalisers(actor_config, mask, info), **support)

    def _gbc_metrics(self, loss_function, micro_batch, model_output, rng, gbc_metrics) -> dict:
        """verl's metrics of a training micro-batch (:meth:`_verl_metrics`), gbc's metrics of
        the methods that run (:func:`gbc_kernels.integrations.verl.method_metric_names`: AR's
        with ``ar_alpha``, Lopti's with ``lopti_eta``) and NTHR's."""
        metrics = self._verl_metrics(loss_function, micro_batch, model_output, rng)
        for name in gv.method_metric_names(self.gbc_options, gbc_metrics):
            metrics[f"actor/gbc_{name}"] = float(gbc_metrics[name])
        metrics.update(self._gbc_update_metrics)
        metrics.update(self._gbc_pass_metrics)
        return metrics

    def _verl_metrics(self, loss_function, micro_batch, model_output, rng):
        """verl's own ``ppo_loss`` on gbc's detached per-token values: its metrics as its step
        logs them, its random draws (Clip-Cov's) from ``rng``, the state gbc's loss drew from."""
        with torch.no_grad(), torch.random.fork_rng(devices=list(rng[1])):
            torch.set_rng_state(rng[0])
            for device, state in rng[1].items():
                torch.cuda.set_rng_state(state, device)
            _, metrics = loss_function(model_output=model_output, data=micro_batch,
                                       dp_group=self.get_data_parallel_group())
        return metrics

    # -- NTHR: its inputs kept from verl's old-log-prob pass ----------------------------------
    def gbc_nthr_keep_begin(self, data) -> bool:
        """Before verl's forward-only pass over ``data`` on the policy NTHR scores (its
        ``compute_log_prob``): the engine's step keeps each micro-batch's response rows (hidden
        states, targets, log-probs) and, once, the head's rows of the batch's token ids. False
        when this engine cannot (the update then runs its own pass)."""
        self._gbc_nthr_kept = None
        if not self._gbc_keeps_nthr:
            return False
        responses = data["responses"]
        data[NTHR_ROW_KEY] = torch.arange(len(data), device=responses.device)
        self._gbc_keeping = methods.NTHRBatch(
            responses.values() if responses.is_nested else responses,
            methods.data_parallel_group(self.get_data_parallel_group()),
            self.gbc_options.backend, self.gbc_options.logits_dtype)
        return True

    def gbc_nthr_keep_end(self, data, completed: bool = True):
        """After that pass: what was kept is held with each row's key (:func:`_row_keys`) until
        the update; on the CPU when the engine offloads its parameters."""
        batch, self._gbc_keeping = self._gbc_keeping, None
        if NTHR_ROW_KEY in data.keys():
            del data[NTHR_ROW_KEY]
        if not completed or batch is None:
            return
        device = batch.rows[0][1].device if batch.rows else None
        if getattr(self, "is_param_offload_enabled", False):
            batch.to("cpu")
        self._gbc_nthr_kept = dict(batch=batch, keys=_row_keys(data), device=device,
                                   temperatures=set(batch.temperatures), nbytes=batch.nbytes())

    def gbc_nthr_from_kept(self, data) -> bool:
        """NTHR's token scales of the update batch ``data`` from what the old-log-prob pass
        kept, into ``data["gbc_token_scale"]``: True; False (on every rank alike, nothing
        changed) when some row of ``data`` was not kept, its temperature differs, or nothing
        was kept (verl skipped that pass) -- the caller then runs :meth:`gbc_nthr_pass`."""
        kept, self._gbc_nthr_kept = self._gbc_nthr_kept, None
        if kept is None:        # alike on every rank: verl runs that pass on all or on none
            return False
        batch, found, head = kept["batch"], False, self._gbc_holds_head()
        where = {k: i for i, k in enumerate(kept["keys"])}
        source = [where.get(k) for k in _row_keys(data)]
        if not head:            # a stage without the head keeps nothing and gets no scales
            found = None not in source
        elif _temperatures(data) == kept["temperatures"]:
            # every row's key was kept, and its hidden states (the pass ran gbc's step on it)
            found = None not in source and batch.take(torch.tensor(source, dtype=torch.long))
        if not _every_rank(found, self._gbc_nthr_agree_group()):
            return False
        if not head:
            return True
        self._gbc_nthr_score(data, batch.to(kept["device"]))
        self._gbc_pass_metrics = {**self._gbc_pass_metrics,
                                  "actor/gbc_nthr_kept_mb": kept["nbytes"] / 2 ** 20}
        return True

    def _gbc_holds_head(self) -> bool:
        """Whether this rank computes the head (and so keeps NTHR's inputs and gets its
        scales); a pipeline stage before the last does not."""
        return True

    def _gbc_nthr_agree_group(self):
        """The ranks that decide together whether the update runs NTHR's own pass (its
        forward and scoring are collectives over them)."""
        return methods.data_parallel_group(self.get_data_parallel_group())

    # -- NTHR: one no-grad old-policy pass over the rank's update batch ----------------------
    @torch.no_grad()
    def gbc_nthr_pass(self, data, defaults=None):
        """NTHR's token scales of the rank's share of an actor update from the policy before its
        first optimizer step, into ``data["gbc_token_scale"]`` (``[B, T]``); groups: verl's
        ``uid`` (docs/verl.md). ``defaults``: the micro-batching keys the worker gives its
        forward-only passes. Call it in ``eval_mode`` (the worker hook does). The engine's
        ``_gbc_nthr_forward(view, batch)`` runs the forward (False: this rank holds no head,
        a pipeline stage before the last, and gets no scales)."""
        from verl.utils import tensordict_utils as tu

        uids = tu.get(data, "uid")
        if uids is None:
            raise ValueError("nthr: the update batch has no 'uid' field (verl's group ids, "
                             "which its trainer sets for GRPO-style advantages)")
        view = data.copy()
        for key, val in (defaults or {}).items():
            if key not in view.keys() and val is not None:
                tu.assign_non_tensor(view, **{key: val})
        view[NTHR_ROW_KEY] = torch.arange(len(uids), device=data["advantages"].device)
        responses = data["responses"]
        batch = methods.NTHRBatch(responses.values() if responses.is_nested else responses,
                                  methods.data_parallel_group(self.get_data_parallel_group()),
                                  self.gbc_options.backend, self.gbc_options.logits_dtype)
        if not self._gbc_nthr_forward(view, batch):
            return None
        return self._gbc_nthr_score(data, batch)

    @torch.no_grad()
    def _gbc_nthr_score(self, data, batch):
        """NTHR's scales of ``data`` (its rows numbered as ``batch``'s) into
        ``data["gbc_token_scale"]``, its metrics into the update's."""
        from verl.utils import tensordict_utils as tu

        gids = torch.tensor([_stable_id(u) for u in tu.get(data, "uid")], dtype=torch.long)
        res, metrics = batch.result(data["response_mask"], gids, data["advantages"],
                                    self.gbc_options)
        data[SCALE_KEY] = res.scale.to(data["advantages"].device)
        self._gbc_update_metrics = {f"actor/gbc_{k}": float(v) for k, v in metrics.items()}
        return res

    # the parameters change: what the old-log-prob pass kept no longer describes them
    def optimizer_step(self):
        self._gbc_nthr_kept = None
        return super().optimizer_step()

    def load_checkpoint(self, *args, **kwargs):
        self._gbc_nthr_kept = None
        return super().load_checkpoint(*args, **kwargs)

    def _gbc_nthr_forward(self, view, batch) -> bool:
        raise NotImplementedError

    def train_batch(self, data, loss_function):
        opts = self.gbc_options
        if opts.lopti_eta is None or not _is_ppo_loss(loss_function):
            return super().train_batch(data, loss_function)
        # Lopti: two updates of the mini-batch, low-probability tokens first (by default)
        from verl.workers.engine import base as verl_base
        verl_base.maybe_fix_3d_position_ids(data)
        def update(phase):     # old_log_probs: the rollout's, fixed for both updates
            self._gbc_phase = phase
            self.optimizer_zero_grad()
            out = self.forward_backward_batch(data, loss_function, forward_only=False)
            return out, self.optimizer_step()

        try:
            outputs = methods.each_phase(opts, update)
        finally:
            self._gbc_phase = None
        (first, gn1), (second, gn2) = outputs
        if self.is_mp_src_rank_with_outputs():
            first["metrics"]["grad_norm"] = gn1
            first["metrics"]["gbc_grad_norm_second_phase"] = gn2
        # the step's grad_share_low (one meaning, docs/methods.md): the low phase's summed
        # logit-gradient norm over both phases' (each phase alone reports 1 or 0); on every
        # rank that has the loss's metrics (each context- or tensor-parallel rank alike)
        norms = {}
        for phase, out in zip(opts.phases, (first, second)):
            v = ((out or {}).get("metrics") or {}).get("actor/gbc_grad_norm_sum")
            if v is not None:
                norms[phase] = float(sum(v) if isinstance(v, list) else v)
        if len(norms) == 2:
            first["metrics"]["actor/gbc_grad_share_low"] = methods.share_low(
                norms["low"], norms["high"])
        return first


def _nthr_before_update(original):
    """verl's ``TrainingWorker.train_mini_batch`` with gbc's NTHR pass first: the rank's whole
    update batch (every mini-batch and epoch), before the first optimizer step."""

    @functools.wraps(original)
    def train_mini_batch(self, data):
        engine = getattr(self, "engine", None)
        if isinstance(engine, EngineMethods):
            engine._gbc_update_metrics = {}     # a metric describes its own update only
            engine._gbc_pass_metrics = {}
        if (isinstance(engine, EngineMethods) and engine.gbc_options.nthr
                and _is_ppo_loss(getattr(self, "loss_fn", None))):
            from verl.utils import tensordict_utils as tu

            ec = self.engine_config
            defaults = dict(
                use_remove_padding=self.model_config.get("use_remove_padding", False),
                use_dynamic_bsz=ec.use_dynamic_bsz,
                max_token_len_per_gpu=ec.infer_max_token_len_per_gpu,
                micro_batch_size_per_gpu=(ec.infer_micro_batch_size_per_gpu
                                          or ec.micro_batch_size_per_gpu),
                use_fused_kernels=ec.use_fused_kernels)
            kept = engine.gbc_nthr_from_kept(data)
            if not kept:                 # verl ran no old-log-prob pass on this policy
                offload = tu.get(data, key="disable_auto_offload", default=False)
                with engine.eval_mode(disable_auto_offload=offload):
                    engine.gbc_nthr_pass(data, defaults)
            engine._gbc_pass_metrics = {**engine._gbc_pass_metrics,
                                        "actor/gbc_nthr_second_forward": float(not kept)}
        return original(self, data)

    return train_mini_batch


def _nthr_keep_on_infer(original):
    """verl's ``TrainingWorker.infer_batch`` that, on the actor with NTHR on, keeps NTHR's inputs
    from its old-log-prob pass (``compute_log_prob``: no loss, the policy itself, not the
    reference through a disabled adapter) for the update that follows."""

    @functools.wraps(original)
    def infer_batch(self, data):
        from verl.utils import tensordict_utils as tu

        engine = getattr(self, "engine", None)
        if not (isinstance(engine, EngineMethods) and engine.gbc_options.nthr
                and _is_ppo_loss(getattr(self, "loss_fn", None))
                and not tu.get(data, key="compute_loss", default=True)
                and not tu.get(data, key="no_lora_adapter", default=False)
                and tu.get(data, key=CERTAINTY_KEY, default=None) is None
                and "responses" in data.keys() and tu.get(data, key="uid") is not None):
            return original(self, data)
        if not engine.gbc_nthr_keep_begin(data):
            return original(self, data)
        completed = False
        try:
            out = original(self, data)
            completed = True
        finally:
            engine.gbc_nthr_keep_end(data, completed)
        return out

    return infer_batch


# the one-per-step metrics gbc's Lopti update adds beside verl's grad_norm (which verl's
# worker pops as a scalar): a one-element list each, as verl's micro-batch metrics are lists
STEP_METRICS = ("gbc_grad_norm_second_phase", "actor/gbc_grad_share_low")


def _step_metrics_as_lists(original):
    """verl's ``TrainingWorker._postprocess_output`` with gbc's one-per-step metrics
    (:data:`STEP_METRICS`) as one-element lists first: verl gathers every metric over the
    data-parallel ranks and its ``train_mini_batch`` flattens each gathered value as a list of
    lists, which a scalar is not (a Lopti update ended in a ``TypeError`` there)."""

    @functools.wraps(original)
    def _postprocess_output(self, output, **kwargs):
        metrics = output.get("metrics") if isinstance(output, dict) else None
        if isinstance(metrics, dict):
            for key in STEP_METRICS:
                if key in metrics and not isinstance(metrics[key], list):
                    metrics[key] = [metrics[key]]
        return original(self, output, **kwargs)

    return _postprocess_output


# ------------------------------------------------------ the sampler's kept set: verl's worker
def _support_on_init(original):
    """verl's ``ActorRolloutRefWorker.init_model`` that hands gbc's engines (the actor's, the
    reference's) the rollout's sampling settings (``self.config.rollout``) for ``support``:
    refused at start-up by :func:`support_plan` where they cannot be replayed. The worker sees
    the rollout config only: whether verl's rollout correction runs (``kept_mass`` needs it:
    ``calculate_log_probs``, ``algorithm.rollout_correction``) is the trainer's start-up check
    (:func:`.trainer.check_trainer`)."""

    @functools.wraps(original)
    def init_model(self, *args, **kwargs):
        opts = _OPTIONS.get("current") or EngineOptions()
        if opts.support is not None or opts.support_ties is not None:
            support_plan(opts, self.config.rollout)       # refused before the models are built
        out = original(self, *args, **kwargs)
        for role in ("actor", "ref"):
            engine = getattr(getattr(self, role, None), "engine", None)
            if isinstance(engine, EngineMethods):
                engine.gbc_attach_rollout(self.config.rollout, role)
        return out

    return init_model


def engine_class(base, mixin=None):
    """gbc's engine on top of verl's engine class ``base``: ``mixin`` first (default: the
    mixin :data:`ENGINES` gives for ``base``)."""
    if mixin is None:
        mixin = next(_load(m) for _, b, m in ENGINES if issubclass(base, _load(b)))
    return type(f"GBC{base.__name__}", (mixin, base), {"__module__": mixin.__module__})


# verl's engines gbc replaces: (its registry's backends, "module:class" of verl's engine,
# "module:class" of gbc's mixin for it)
ENGINES = [
    (("fsdp", "fsdp2"), "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead",
     "gbc_kernels.integrations.verl.fsdp:GBCEngineMixin"),
    (("megatron",), "verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead",
     "gbc_kernels.integrations.verl.megatron:GBCMegatronMixin"),
]
_ENABLED = {}           # verl's engine class -> gbc's
_PatchOnImport = patching._PatchOnImport

# where verl 0.9.1 defines the worker gbc wraps (imported by verl's own processes; on import
# when it is not loaded yet); the trainers': .trainer
WORKER_MODULE = "verl.workers.engine_workers"


def _patch_worker(module):
    cls = module.TrainingWorker
    _PATCHES.set(cls, "train_mini_batch", _nthr_before_update(cls.train_mini_batch))
    _PATCHES.set(cls, "infer_batch", _nthr_keep_on_infer(cls.infer_batch))
    if hasattr(cls, "_postprocess_output"):
        _PATCHES.set(cls, "_postprocess_output", _step_metrics_as_lists(cls._postprocess_output))
    hybrid = module.ActorRolloutRefWorker
    _PATCHES.set(hybrid, "init_model", _support_on_init(hybrid.init_model))


def _load(path):
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _registry_tables():
    """(backend table of verl's ``language_model`` registry, verl's engine class, gbc's mixin)
    for each engine of :data:`ENGINES`."""
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.get("language_model", {})
    for backends, base, mixin in ENGINES:
        for backend in backends:
            if backend in table:
                yield table[backend], _load(base), _load(mixin)


# the verl releases gbc's engine and patches are tested on (major.minor)
VERL_VERSIONS = TESTED["verl"]


def check_verl_version(version: Optional[str] = None) -> str:
    """verl's version (default: the imported verl's), refused by name unless
    :data:`VERL_VERSIONS` (:func:`gbc_kernels.integrations.releases.check_release`)."""
    if version is None:
        import verl
        version = getattr(verl, "__version__", None) or "unknown"
    return check_release("verl", str(version),
                         why="gbc replaces verl's engine classes and wraps its worker's and "
                             "trainer's functions, which change between releases",
                         off=f"unset {ENV_ON} to run verl's own step")


def enable(options: Optional[EngineOptions] = None):
    """Make verl's engine registry hand out gbc's engine for ``language_model`` (FSDP, FSDP2,
    Megatron) and patch verl's worker (NTHR's pass; the rollout's sampling settings handed to
    the engines) and trainers (the critical-KL reference pass; ``support``'s start-up check,
    old-policy pass and rollout correction: :mod:`.trainer`), each acting only when its options
    are on; verl's v1 trainer refuses critical-token KL. A verl release outside
    :data:`VERL_VERSIONS` is refused. Idempotent; returns the options."""
    check_verl_version()
    if options is None:
        options = EngineOptions.parse(os.environ.get(ENV_OPTIONS))
    _OPTIONS["current"] = options
    _OPTIONS.pop("plan", None)        # checked again by the trainer's start
    for table, base, mixin in _registry_tables():
        for key, cls in list(table.items()):
            if issubclass(cls, mixin):
                cls.gbc_options = options
            elif issubclass(cls, base):
                sub = _ENABLED.get(cls) or engine_class(cls, mixin)
                sub.gbc_options = options
                _ENABLED[cls] = table[key] = sub
    _on_import(WORKER_MODULE, _patch_worker)
    from gbc_kernels.integrations.verl import trainer
    trainer.patch_trainers()
    return options


def disable():
    """Put verl's own engine classes back in its registry, and its worker's and trainer's
    functions."""
    originals = {sub: base for base, sub in _ENABLED.items()}
    for table, _, _ in _registry_tables():
        for key, cls in list(table.items()):
            table[key] = originals.get(cls, cls)
    _PATCHES.undo()
    _OPTIONS.pop("current", None)
    _OPTIONS.pop("plan", None)


# the trainer's hooks live in .trainer; their names stay importable from here, where they were
# (looked up in .trainer: patch them there)
TRAINER_NAMES = frozenset({
    "TRAINER_MODULE", "V1_TRAINER_MODULE", "CORRECTION_MODULE", "trainer_support_plan",
    "check_trainer", "compute_ref_log_prob", "compute_old_log_prob", "v1_log_kept_mass",
    "patch_trainers", "_trainer_plan", "_kept_mass_of", "_rollout_correction", "_v1_advantage",
    "_checked_init", "_patch_trainer", "_patch_correction", "_patch_v1_trainer", "_UNCHECKED",
    "_V1_BATCH"})


def __getattr__(name):
    if name in TRAINER_NAMES:
        from gbc_kernels.integrations.verl import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
