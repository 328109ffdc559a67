"""gbc's head inside AReaL 1.0.4's FSDP PPO actor (docs/areal.md).

:class:`GBCFSDPPPOActor` is AReaL's ``FSDPPPOActor`` with one change: the model runs to its
final norm, and the lm_head's forward computes, from the hidden states and the head's weight,
the log-probs (and entropy) of the packed micro-batch's rolled labels with gbc's fused pass
(:func:`gbc_kernels.fused_linear_logprobs`), chunk by chunk: no ``[N, V]`` logits. AReaL's
own code does everything else — micro-batching and packing, Ulysses sequence parallelism, its
loss functions (``grpo_loss_fn`` and what it calls, with every ``PPOActorConfig`` option), its
token-mean scaling, its metrics — on those log-probs, so the update and the ``compute_logp``
passes (old policy, proximal policy, reference) equal AReaL's on the same batch.

The method options (``GBC_AREAL_OPTIONS``, :func:`gbc_kernels.integrations.areal.enable`)
act on the advantages AReaL's loss receives (:mod:`.losses`); Lopti runs two of AReaL's
``train_batch`` updates per minibatch (:meth:`GBCFSDPPPOActor.train_batch`); NTHR keeps its
inputs in the actor's ``compute_logp`` pass and scores the batch in ``compute_advantages``
(:meth:`GBCFSDPPPOActor.compute_advantages`); critical-token KL weights come from the
reference engine's ``compute_logp``. Under ``support=replay`` the step scores over the
rollout's kept set: by default one set per rollout, built by the actor's ``compute_logp`` pass
(``sampler_truncation``, ``return_support_ids``: the ids kept on the engine, each token's row
tagged in the trajectories as ``gbc_support_row``, which AReaL's own batch code carries to
every minibatch and micro-batch as it carries the targets) and replayed as ``support_ids`` by
every later pass (the update's micro-batches, Lopti's second phase, the reference's pass). AReaL's
trainer runs the reference's ``compute_logp`` before the actor's: a reference pass on
trajectories without rows has the actor of its process run its building pass on that batch
first (same weights: nothing updates the actor between the two calls) and keep the result, which
the actor's own ``compute_logp`` on that batch then returns without a second pass
(:meth:`GBCFSDPPPOActor._gbc_build_ahead`). With ``support_set=per_pass``, each pass rebuilds
the set from its own logits. The actor's
``compute_logp`` also keeps the kept mass with which ``compute_advantages`` moves SGLang's
full-vocabulary behaviour log-probs onto the set.
"""

from __future__ import annotations

import itertools
import os
import weakref

import torch
from areal.engine.fsdp_engine import FSDPPPOActor

from gbc_kernels import fused_linear_logprobs, methods
from gbc_kernels.integrations import hf

from .losses import (KL_WEIGHT_KEY, LOG_KEPT_MASS_KEY, NTHR_ROW_KEY, NTHR_SCALE_KEY,
                     OPTIONS_ENV, SAMPLER_ENV, SUPPORT_ROW_KEY, check_engine, check_options,
                     corrects_behaviour, is_reference, lopti_train_stats, method_loss_fn,
                     options_from_env, sampler_from_env, silent_stats, trains)

_ROW_BITS = 32          # NTHR_ROW_KEY, SUPPORT_ROW_KEY: pass id << 32 | the row in that pass
_ROW_MASK = (1 << _ROW_BITS) - 1
# support_set=rollout: the kept ids of the last building pass of each actor in this process,
# {pass id: int32 [n, K], -1 padded}, so that a reference engine run after the actor's pass
# (a loop of the user's) replays the actor's set; pass ids unique in the process
_SUPPORT_TABLES = {}
_SUPPORT_PASSES = itertools.count(1)
# ... the building actors initialized (not destroyed) in this process, {id: weakref}: a
# reference pass on trajectories without rows has the one there build the set first
_BUILDERS = {}


class GBCFSDPPPOActor(FSDPPPOActor):
    """AReaL's FSDP PPO actor with gbc's head (module docstring). Reads its method options
    from ``GBC_AREAL_OPTIONS`` when built (AReaL's single controller builds it in its worker
    processes, which :meth:`as_controller` gives the options)."""

    def __init__(self, config):
        self.gbc_options = options_from_env()
        check_options(config, self.gbc_options)
        # support=replay: the rollout's kept set, from the sampling settings
        self._gbc_truncation = sampler_from_env(self.gbc_options, config)
        # ... one set per rollout (support_set, the default): the actor's compute_logp builds
        # it, every later pass (this engine's update, a reference engine's pass) replays it;
        # per_pass: each pass rebuilds it from its own logits
        self._gbc_one_set = (self._gbc_truncation is not None
                             and self.gbc_options.one_set_per_rollout)
        self._gbc_builds = self._gbc_one_set and trains(config)
        self._gbc_building = None       # the building pass's ids, per micro-batch, during it
        self._gbc_support_pass = None   # this actor's last building pass (_SUPPORT_TABLES)
        self._gbc_ahead = None          # a building pass run for a reference pass, kept
        # ... and the actor under the decoupled loss keeps its compute_logp pass's kept mass,
        # which moves the rollout's (SGLang's full-vocabulary) log-probs onto the set
        self._gbc_keep_kept_mass = (self._gbc_truncation is not None and trains(config)
                                    and corrects_behaviour(config))
        # the reference engine (AReaL's ref config, marked by enable(config)) gives
        # critical-token KL's weights in its compute_logp
        self._gbc_certainty = (self.gbc_options.critical_kl_exponent is not None
                               and is_reference(config))
        # NTHR: the actor (not the reference or a teacher engine) keeps its compute_logp
        # pass's inputs
        self._gbc_keep_nthr = self.gbc_options.nthr and trains(config)
        self._gbc_side = None           # {name: [per micro-batch tensor]} during forward_batch
        self._gbc_nthr = None           # what the last compute_logp pass kept for NTHR
        self._gbc_passes = 0
        super().__init__(config)

    # -- the passes that keep more than log-probs: critical-token KL's weights, NTHR's rows --
    def compute_logp(self, data, *args, **kwargs):
        """AReaL's ``compute_logp``. In the reference engine under critical-token KL, each
        trajectory of ``data`` also receives ``gbc_kl_weight`` (``[g, S]``, aligned as the
        log-probs): ``(1 - c) J^gamma + c`` from the same streaming pass (docs/methods.md).
        In the actor under NTHR, the pass keeps each response token's hidden state and
        log-prob and the head's rows of the batch's ids, and tags each trajectory with its
        rows (``gbc_nthr_row``): :meth:`compute_advantages` scores exactly these samples.
        In the actor under ``support=replay`` with the decoupled loss, each trajectory also
        receives ``gbc_log_kept_mass`` (``[g, S]``, aligned as the log-probs: ``LSE_S -
        LSE_V``, the log of the kept set's mass) for :meth:`compute_advantages`.
        Under one kept set per rollout (``support=replay``, ``support_set`` ``rollout``: the
        default) the actor's pass builds the set: its ids stay on the engine and each
        trajectory receives ``gbc_support_row`` (``[g, S]`` int64, aligned as the log-probs:
        pass id << 32 | 1 + the token's row of those ids), which the update's micro-batches
        (and a reference engine's pass run after this one) replay; a reference engine's pass
        refuses trajectories without them unless the actor's pass runs first
        (:meth:`_gbc_build_ahead`: AReaL's trainer runs the reference's pass before the
        actor's), whose result the actor's own ``compute_logp`` on that batch then returns
        (no second pass)."""
        if self._gbc_one_set and not self._gbc_builds and isinstance(data, list):
            missing = [i for i, t in enumerate(data) if SUPPORT_ROW_KEY not in t]
            if missing:
                self._gbc_build_ahead(data, missing[0])
        if self._gbc_builds:
            ahead, self._gbc_ahead = self._gbc_ahead, None
            if ahead is not None and not args and not kwargs and self._gbc_same(ahead, data):
                return list(ahead["logps"])
        sides = (["kl_weight"] if self._gbc_certainty else []) + \
            (["nthr"] if self._gbc_keep_nthr else []) + \
            (["log_kept_mass"] if self._gbc_keep_kept_mass else []) + \
            (["support_row"] if self._gbc_builds else [])
        if not sides or not isinstance(data, list):
            return super().compute_logp(data, *args, **kwargs)
        from areal.utils.data import concat_batch, split_batch

        self._gbc_nthr = None           # a new pass: what an earlier one kept is stale
        if "nthr" in sides:
            self._gbc_keeping = dict(heads=methods.NTHRHeadRows(self.device), hidden=[],
                                     logp=[], n=0)
        if "support_row" in sides:
            self._gbc_building = dict(pass_id=next(_SUPPORT_PASSES), parts=[], n=0)
        try:
            self._gbc_side_names = sides
            logps = super().compute_logp(data, *args, **kwargs)
            if "support_row" in sides:
                self._gbc_keep_support(self._gbc_building)
        finally:
            self._gbc_side_names = None
            self._gbc_building = None
        meta = concat_batch(data)[1]
        if "kl_weight" in sides:
            for traj, w in zip(data, split_batch(self._gbc_side_out["kl_weight"], meta)):
                traj[KL_WEIGHT_KEY] = w
        if "log_kept_mass" in sides:
            for traj, m in zip(data, split_batch(self._gbc_side_out["log_kept_mass"], meta)):
                traj[LOG_KEPT_MASS_KEY] = m
        if "support_row" in sides:
            for traj, r in zip(data, split_batch(self._gbc_side_out["support_row"], meta)):
                traj[SUPPORT_ROW_KEY] = r
        if "nthr" in sides:
            self._gbc_keep_rows(data, self._gbc_side_out["nthr"])
        self._gbc_side_out = None
        return logps

    def _gbc_build_ahead(self, data, first):
        """One set per rollout, a reference (non-building) engine's pass on trajectories
        without rows (``first``: the first such): the building actor of this process (the one
        initialized and not destroyed) runs its ``compute_logp`` on ``data`` now, which tags
        the trajectories with their rows (and the kept mass, NTHR's rows), and keeps that pass
        for its own next ``compute_logp`` (:meth:`_gbc_same`). Exact where nothing changes the
        actor's weights between the two calls, as in AReaL's trainer (``ref`` then ``teacher``
        then the actor's ``compute_logp``); an optimizer step, a version change or
        ``compute_advantages`` in between drops what was kept (the actor's pass then runs
        again, as a second call always does, building a new set that the trajectories carry
        from then on). Refused by name: no building actor in this process (none, or several), or
        its weights offloaded (AReaL's trainer offloads the actor, ``actor.offload`` or the
        actor colocated with the rollout, until after the reference's pass)."""
        live = [a for a in (r() for r in list(_BUILDERS.values())) if a is not None]
        why = (f"trajectory {first} carries no kept set ({SUPPORT_ROW_KEY}) from the actor's "
               "compute_logp pass, which builds the one set every later pass replays; this "
               "engine (the reference) has the actor's pass run first on the batch when ")
        if len(live) != 1:
            raise ValueError(f"{OPTIONS_ENV}: support_set=rollout (the default under support="
                             f"replay): {why}exactly one gbc actor (an engine with an optimizer) "
                             f"is initialized in this process, and {len(live)} are (run the "
                             "actor's compute_logp on the batch first, or set support_set="
                             "per_pass, each pass rebuilding the set from its own logits)")
        actor = live[0]
        if getattr(actor, "is_offload", False):
            raise ValueError(f"{OPTIONS_ENV}: support_set=rollout (the default under support="
                             f"replay): {why}the actor's weights are on the device, and they "
                             "are offloaded (AReaL's trainer offloads the actor until after the "
                             "reference's pass: actor.offload, or the actor colocated with the "
                             "rollout); set support_set=per_pass, each pass rebuilding the set "
                             "from its own logits, or actor.kl_ctl=0")
        logps = actor.compute_logp(data)
        actor._gbc_ahead = dict(data=list(data), logps=list(logps),
                                keys=[dict(t) for t in data], version=actor.get_version(),
                                pass_id=actor._gbc_support_pass)

    def _gbc_same(self, ahead, data):
        """Whether ``data`` is the batch of the building pass :meth:`_gbc_build_ahead` ran
        (the same trajectories, in the same order, each still holding the very values it held
        after that pass), at the same version, that pass still this actor's last."""
        return (isinstance(data, list) and len(data) == len(ahead["data"])
                and all(a is b for a, b in zip(data, ahead["data"]))
                and all(k in t and t[k] is v for t, keys in zip(data, ahead["keys"])
                        for k, v in keys.items())
                and self.get_version() == ahead["version"]
                and self._gbc_support_pass == ahead["pass_id"]
                and ahead["pass_id"] in _SUPPORT_TABLES)

    def _gbc_keep_support(self, building):
        """The building pass's kept ids, its micro-batches' parts joined (``-1``-padded to the
        widest set), as this actor's one table in :data:`_SUPPORT_TABLES` (its earlier pass's
        freed: trajectories still tagged with it are refused where replayed)."""
        if self._gbc_support_pass is not None:
            _SUPPORT_TABLES.pop(self._gbc_support_pass, None)
        parts = building["parts"]
        table = methods.join_support_ids(parts) if parts else \
            torch.full((0, 1), -1, dtype=torch.int32, device=self.device)
        _SUPPORT_TABLES[building["pass_id"]] = table
        self._gbc_support_pass = building["pass_id"]

    def _gbc_replay_ids(self, mb_item, n):
        """``support_ids`` (``[n, K]``) of this rank's ``n`` rows of the micro-batch: each
        token's row (``gbc_support_row``, packed and padded by AReaL with the targets, and
        sliced as its Ulysses labels are) looked up in the building pass's ids; a padding
        token (0) holds only ``-1``. Refused by name: no rows, or rows of a pass whose ids
        are gone (an earlier step's)."""
        mb = mb_item.padded_mb
        if SUPPORT_ROW_KEY not in mb:
            raise ValueError(f"{OPTIONS_ENV}: support_set=rollout (the default under "
                             f"support=replay): the batch carries no kept set "
                             f"({SUPPORT_ROW_KEY}) from the actor's compute_logp pass, which "
                             "builds the one set every later pass replays (run the actor's "
                             "compute_logp on the batch first, as AReaL's trainer does, or "
                             "set support_set=per_pass)")
        code = mb[SUPPORT_ROW_KEY].reshape(1, -1).long()
        if self.parallel_helper.sp_size > 1:
            from areal.models.fsdp.ulysses import ulysses_pad_and_slice_inputs

            code = ulysses_pad_and_slice_inputs(code, sp_size=self.parallel_helper.sp_size)[0]
        code = code.reshape(-1)
        if code.numel() != n:
            raise RuntimeError(f"support_set=rollout: {code.numel()} kept-set rows for {n} "
                               "tokens of the micro-batch")
        passes = torch.unique(code[code > 0] >> _ROW_BITS).tolist()
        gone = [p for p in passes if p not in _SUPPORT_TABLES]
        if gone or len(passes) > 1:
            raise ValueError(f"{OPTIONS_ENV}: support_set=rollout: the batch's kept-set rows "
                             f"({SUPPORT_ROW_KEY}) come from "
                             + (f"a building pass whose ids are gone (pass {gone[0]}: an "
                                "earlier compute_logp's; each actor keeps its last)" if gone
                                else f"{len(passes)} building passes")
                             + "; run the actor's compute_logp on the batch being trained")
        if not passes:
            return torch.full((n, 1), -1, dtype=torch.int32, device=self.device)
        table = _SUPPORT_TABLES[passes[0]].to(self.device)
        rows = (code & _ROW_MASK).to(self.device)
        ids = table[(rows - 1).clamp(min=0)]
        return torch.where((rows > 0).unsqueeze(-1), ids, torch.full_like(ids, -1))
    def _gbc_keep_rows(self, data, where):
        """NTHR's kept rows of the pass: ``where`` ``[B, S]`` holds, per response token, 1 +
        its index in the kept hidden states (0 elsewhere), rows in ``data``'s order."""
        keeping, self._gbc_keeping = self._gbc_keeping, None
        hidden = torch.cat(keeping["hidden"]) if keeping["hidden"] else None
        logp = torch.cat(keeping["logp"]) if keeping["logp"] else None
        rows = []
        for b in range(where.shape[0]):
            cols = where[b].nonzero().reshape(-1)
            at = (where[b, cols] - 1).to(self.device)
            rows.append(methods.NTHRKeptRow(cols.to(self.device, torch.int32), hidden[at],
                                            logp[at], keeping["heads"]))
        self._gbc_passes += 1
        self._gbc_nthr = dict(pass_id=self._gbc_passes, rows=rows, heads=keeping["heads"],
                              version=self.get_version())
        first = 0
        for traj in data:
            g = traj["attention_mask"].shape[0]
            traj[NTHR_ROW_KEY] = (self._gbc_passes << _ROW_BITS) + \
                torch.arange(first, first + g, dtype=torch.long)
            first += g

    def forward_batch(self, input_, output_seqlens=None, aggregate_fn=torch.cat):
        """AReaL's ``forward_batch``; with side outputs wanted (:meth:`compute_logp`), they
        are collected beside the log-probs and reordered and padded the same way (AReaL's own
        ``reorder_and_pad_outputs``), into ``self._gbc_side_out``."""
        names = getattr(self, "_gbc_side_names", None)
        if not names:
            return super().forward_batch(input_, output_seqlens, aggregate_fn)
        from areal.engine import fsdp_engine

        real, got = fsdp_engine.reorder_and_pad_outputs, {}
        self._gbc_side = {name: [] for name in names}

        def both(outputs, seqlens, mb_list, agg=torch.cat):
            for name, side in self._gbc_side.items():
                got[name] = real(side, seqlens, mb_list, torch.cat)
            return real(outputs, seqlens, mb_list, agg)

        fsdp_engine.reorder_and_pad_outputs = both
        try:
            result = super().forward_batch(input_, output_seqlens, aggregate_fn)
        finally:
            fsdp_engine.reorder_and_pad_outputs = real
            self._gbc_side = None
        self._gbc_side_out = got
        return result

    def compute_advantages(self, data, *args, **kwargs):
        """AReaL's ``compute_advantages``, then the methods that need its output:

        * critical-token KL: its per-token KL reward ``-kl_ctl * kl_estimator(old_logp,
          ref_logp)`` is multiplied by the reference pass's weights (``gbc_kl_weight`` in every
          trajectory: refused by name when a trajectory has none, never an unweighted KL);
        * ``support=replay`` (the decoupled loss): before AReaL's own code, each trajectory's
          rollout log-probs (SGLang's, over the full vocabulary) become ``logprobs -
          log_kept_mass`` (``methods.corrected_sampler_logp(..., "replay", normalised=False)``)
          on its response tokens, with the kept mass of the actor's ``compute_logp`` pass: the
          behaviour log-probs over the kept set, as every other log-prob of the step, in the
          behaviour weight (``behave_imp_weight``), the KL reward, M2PO and the metrics;
        * NTHR: the batch is scored from what the actor's last ``compute_logp`` kept for
          these very trajectories (:meth:`_gbc_nthr_rows` refuses any other), its groups
          AReaL's trajectories (one prompt's answers each) and its correct answers those
          whose advantages AReaL just computed average above 0; the token scales go into the
          batch as ``gbc_nthr_scale`` for the loss, and ``nthr_selected_frac`` /
          ``nthr_eta_mean`` into AReaL's ``ppo_actor`` statistics."""
        self._gbc_ahead = None          # a kept building pass is not returned after this
        kl = self.gbc_options.critical_kl_exponent is not None
        nthr = self.gbc_options.nthr
        replay = self._gbc_keep_kept_mass
        if not kl and not nthr and not replay:
            return super().compute_advantages(data, *args, **kwargs)
        missing = [i for i, t in enumerate(data) if KL_WEIGHT_KEY not in t] if kl else []
        if missing:
            raise ValueError(f"{OPTIONS_ENV}: critical_kl_exponent: trajectory {missing[0]} "
                             "has no certainty weights from the reference engine's "
                             "compute_logp (AReaL's trainer runs it when actor.kl_ctl > 0 "
                             "and a ref config is set; enable(config) marks that engine)")
        missing = [i for i, t in enumerate(data) if LOG_KEPT_MASS_KEY not in t] if replay \
            else []
        if missing:
            raise ValueError(f"{OPTIONS_ENV}: support=replay: trajectory {missing[0]} has no "
                             f"kept mass ({LOG_KEPT_MASS_KEY}) from this actor's compute_logp "
                             "pass, which moves SGLang's full-vocabulary rollout log-probs "
                             "onto the kept set (run the actor's compute_logp on the batch "
                             "first, as AReaL's trainer does under use_decoupled_loss)")
        kept = self._gbc_nthr_rows(data) if nthr else None
        actor = self.actor
        real_fn, real_est = actor._compute_advantages, actor.kl_estimator

        def with_methods(batch):
            if replay:
                self._gbc_behaviour_onto_set(batch)
            if kl:
                w = batch[KL_WEIGHT_KEY].float()
                actor.kl_estimator = lambda logp, base: real_est(logp, base) * w.to(logp.device)
            try:
                out = real_fn(batch)
            finally:
                actor.kl_estimator = real_est
            if nthr:
                out = self._gbc_nthr_score(out, *kept)
            out.pop(LOG_KEPT_MASS_KEY, None)
            return out

        actor._compute_advantages = with_methods
        try:
            return super().compute_advantages(data, *args, **kwargs)
        finally:
            del actor._compute_advantages
            self._gbc_nthr = None       # scored once: the kept rows are freed

    @staticmethod
    def _gbc_behaviour_onto_set(batch):
        """``batch["logprobs"]`` (the rollout's, aligned with ``input_ids``: row ``t`` the
        log-prob of token ``t``) minus the kept mass of the pass that scored token ``t``
        (``gbc_log_kept_mass`` is aligned as the pass's rolled log-probs, row ``t`` for token
        ``t + 1``), on the response tokens (``loss_mask``) only."""
        lk = torch.roll(batch[LOG_KEPT_MASS_KEY].float(), shifts=1, dims=-1)
        lp = batch["logprobs"]
        lk = (lk * batch["loss_mask"].to(lk.dtype)).to(lp.device)
        batch["logprobs"] = methods.corrected_sampler_logp(lp, lk, "replay", normalised=False)

    def _gbc_nthr_rows(self, data):
        """``(rows, group_ids)``: the kept row of every row of ``data`` (its trajectories, in
        order) and its group (its trajectory's index). Refused by name: no kept pass, a
        trajectory without rows from it (another batch, an earlier pass), parameters changed
        since, or trajectories of one answer each (no group to compare within)."""
        store = self._gbc_nthr
        if store is None:
            raise ValueError(f"{OPTIONS_ENV}: nthr=true: this actor kept no compute_logp pass "
                             "to score (NTHR takes the hidden states of AReaL's actor "
                             "compute_logp, run on the same trajectories before "
                             "compute_advantages; recompute_logprob=true)")
        codes = []
        for i, traj in enumerate(data):
            code = traj.get(NTHR_ROW_KEY)
            if code is None or bool(((code >> _ROW_BITS) != store["pass_id"]).any()):
                raise ValueError(f"{OPTIONS_ENV}: nthr=true: trajectory {i} was not in this "
                                 "actor's last compute_logp pass; NTHR scores only the samples "
                                 "whose hidden states that pass kept (run compute_logp on the "
                                 "batch being trained)")
            codes.append(code.reshape(-1))
        if self.get_version() != store["version"]:
            raise ValueError(f"{OPTIONS_ENV}: nthr=true: the parameters changed (version "
                             f"{store['version']} -> {self.get_version()}) since the "
                             "compute_logp pass NTHR would score")
        sizes = [int(traj["attention_mask"].shape[0]) for traj in data]
        if max(sizes) < 2:
            raise ValueError(f"{OPTIONS_ENV}: nthr=true: every trajectory holds one answer, so "
                             "NTHR has no group to compare within; AReaL gives a prompt's "
                             "answers as one trajectory when gconfig.n_samples > 1 "
                             "(GroupedRolloutWorkflow)")
        rows = [store["rows"][int(r)] for r in torch.cat(codes) & ((1 << _ROW_BITS) - 1)]
        groups = torch.repeat_interleave(torch.arange(len(data)), torch.tensor(sizes))
        return rows, groups

    def _gbc_nthr_score(self, out, rows, groups):
        """NTHR's token scales of AReaL's ``_compute_advantages`` output ``out`` (rolled
        ``loss_mask`` and ``advantages``), into ``out[gbc_nthr_scale]``."""
        from areal.utils import stats_tracker

        mask, adv = out["loss_mask"].bool(), out["advantages"]
        targets = torch.roll(out["input_ids"].long(), shifts=-1, dims=-1)
        batch = methods.NTHRBatch(targets[mask], None,
                                  logits_dtype=self.gbc_options.logits_dtype)
        batch.add_kept(rows, list(targets), self._gbc_nthr["heads"], device=self.device)
        result, metrics = batch.result(mask, groups, adv, self.gbc_options)
        out[NTHR_SCALE_KEY] = result.scale.to(adv.device, torch.float32)
        out.pop(NTHR_ROW_KEY, None)
        with stats_tracker.scope("ppo_actor"):
            stats_tracker.scalar(**{k: float(v) for k, v in metrics.items()})
        return out

    @classmethod
    def as_controller(cls, config, scheduler):
        """AReaL's controller for this class, with this process's ``GBC_AREAL_OPTIONS`` put
        into every scheduling spec's ``env_vars``: the worker processes that build the engine
        read the options the controller was switched on with. What travels in the
        trajectories between passes (critical-token KL's weights, NTHR's rows, the decoupled
        loss's kept mass, one kept set per rollout's rows) is refused by name."""
        options = options_from_env()
        check_options(config, options)
        sampler_from_env(options, config)
        kept = options.support == "replay" and trains(config) and corrects_behaviour(config)
        for name, what in (("critical_kl_exponent", "the certainty weights travel"),
                           ("nthr", "NTHR's rows are tagged"),
                           ("support", "under use_decoupled_loss the kept mass that moves "
                                       "the rollout's log-probs travels")):
            value = getattr(options, name)
            if value not in (None, False) and (name != "support" or kept):
                raise ValueError(f"{OPTIONS_ENV}: {name}={value}: {what} in "
                                 "the trajectories, which AReaL's single controller serialises "
                                 "to its workers; run under AReaL's SPMD launcher")
        if options.one_set_per_rollout:
            raise ValueError(f"{OPTIONS_ENV}: support_set=rollout (the default under "
                             "support=replay): each token's row of the kept ids its building "
                             "pass keeps on the engine travels in the trajectories, which "
                             "AReaL's single controller serialises to its workers (the update "
                             "may land on a worker that holds no such ids); run under AReaL's "
                             "SPMD launcher, or set support_set=per_pass")
        env = {OPTIONS_ENV: os.environ.get(OPTIONS_ENV, "")}
        if options.support is not None:
            env[SAMPLER_ENV] = os.environ.get(SAMPLER_ENV, "")
        for spec in getattr(config, "scheduling_spec", ()) or ():
            spec.env_vars = {**(spec.env_vars or {}), **env}
        return super().as_controller(config, scheduler)

    def initialize(self, *args, **kwargs):
        check_engine(self)
        out = super().initialize(*args, **kwargs)
        if self._gbc_builds:            # a reference pass before its own has it build the set
            _BUILDERS[id(self)] = weakref.ref(self)
        tr = self._gbc_truncation
        if tr is not None and tr.top_k is not None and tr.top_p >= 1.0 and tr.min_p <= 0.0:
            vocab = hf.lm_head(hf.unwrap(self.model)).weight.shape[0]
            if tr.top_k >= vocab:
                raise ValueError(f"{OPTIONS_ENV}: support=replay: gconfig.top_k={tr.top_k} >= "
                                 f"the model's vocabulary ({vocab}) with top_p 1: the rollout "
                                 "kept every token and there is nothing to replay (unset "
                                 "support, or sample with top_k < V / top_p < 1)")
        return out

    def destroy(self, *args, **kwargs):
        _BUILDERS.pop(id(self), None)
        self._gbc_ahead = None
        return super().destroy(*args, **kwargs)

    # -- Lopti: two updates per AReaL minibatch ----------------------------------------------
    def train_batch(self, input_, loss_fn, loss_weight_fn):
        """AReaL's ``train_batch`` (one optimizer step on ``input_``, a minibatch of AReaL's
        ``ppo_update``); under Lopti, one per phase (low then high by default), each on the
        same minibatch with the same proximal log-probs (the split stays fixed, the second
        update's ratio carries the first's drift). AReaL's metrics of the minibatch are logged
        once, from the unsplit loss at the first update's parameters (the batch's terms, as
        without Lopti); the statistics returned: :func:`.losses.lopti_train_stats`."""
        self._gbc_ahead = None          # the weights move: a kept building pass is stale
        phases = self.gbc_options.phases
        if phases == (None,) or not isinstance(input_, dict) or "advantages" not in input_:
            return super().train_batch(input_, loss_fn, loss_weight_fn)
        stats = []
        for i, phase in enumerate(phases):
            self._gbc_phase = (phase, i == 0)
            try:
                stats.append(super().train_batch(dict(input_), loss_fn, loss_weight_fn))
            finally:
                self._gbc_phase = None
        return lopti_train_stats(phases, stats)

    # -- AReaL's loop over micro-batches, with gbc's head --------------------------------------
    def forward_backward_batch(self, mb_list, process_output_fn, forward_only=False):
        """AReaL's ``FSDPEngine.forward_backward_batch`` (tree training refused at
        :meth:`initialize`), the model's forward run with the lm_head's forward replaced by
        gbc's fused log-prob pass over this rank's rows; ``process_output_fn`` receives
        ``[N, 1]`` zeros tied to that pass in place of the logits, and the log-probs come from
        :meth:`_gbc_rows`."""
        from areal.utils.perf_tracer import trace_scope

        for mb_item in mb_list:
            inputs, ctx = self._prepare_mb_inputs(mb_item)
            labels = inputs.get("rolled_input_ids",
                                torch.roll(inputs["input_ids"], shifts=-1, dims=-1))
            labels = labels.reshape(-1)
            inner = hf.unwrap(self.model)
            captured = {}

            side = self._gbc_side or {}
            build = "support_row" in side
            # support=replay: rebuilt (per_pass, or the building pass) or replayed (one set)
            if self._gbc_truncation is None:
                support = {}
            elif build or not self._gbc_one_set:
                support = dict(sampler_truncation=self._gbc_truncation)
            else:
                support = dict(support_ids=self._gbc_replay_ids(mb_item, labels.numel()))
            forced = bool(support) and not forward_only     # the update logs the forced share

            def head_forward(hidden, *args, **kwargs):
                head = hf.lm_head(inner)          # as FSDP2 holds it during this forward
                h = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype)
                if "nthr" in side:                # NTHR's inputs: hidden states, head rows
                    captured["hidden"] = h.detach()
                    self._gbc_keeping["heads"].add(
                        ctx.mb_input["input_ids"], head, hf.logit_softcap(inner),
                        self.config.temperature)
                if "kl_weight" in side:           # the reference pass, with its weights
                    st = methods.reference_stats(
                        h, head.weight, labels.to(h.device), self.gbc_options, head.bias,
                        temperature=self.config.temperature,
                        logit_softcap=hf.logit_softcap(inner), **support)
                    captured["rows"] = (st.ref_logp, None)
                    captured["kl_weight"] = st.kl_weight
                    return hidden[..., :1] * 0
                kept = "log_kept_mass" in side
                logp, entropy, *more = fused_linear_logprobs(
                    h, head.weight, labels.to(h.device), head.bias,
                    temperature=self.config.temperature, return_entropy=not forward_only,
                    logit_softcap=hf.logit_softcap(inner),
                    logits_dtype=self.gbc_options.logits_dtype, return_log_kept_mass=kept,
                    return_support_forced=forced, return_support_ids=build, **support)
                captured["rows"] = (logp, entropy)
                if kept:
                    captured["log_kept_mass"] = more.pop(0)
                if forced:
                    captured["forced"] = more.pop(0)
                if build:
                    captured["support_ids"] = more.pop(0)
                stand_in = hidden[..., :1] * 0
                return stand_in + (logp.sum() * 0).to(hidden.dtype) if logp.requires_grad \
                    else stand_in

            with trace_scope("fsdp_engine.forward"), hf.replaced_head_forward(inner,
                                                                               head_forward):
                outputs = self.model(**inputs)
            if "rows" not in captured:
                raise RuntimeError("model: its forward did not call its lm_head")
            self._gbc_captured = captured["rows"]
            self._gbc_captured_side = captured
            loss = process_output_fn(outputs.logits.squeeze(0), ctx.to_dict())
            self._gbc_captured = self._gbc_captured_side = None
            if not forward_only and loss is not None:
                with trace_scope("fsdp_engine.backward"):
                    loss.backward()

    def _gbc_rows(self, ctx):
        """This micro-batch's log-probs and entropy as AReaL's ``_compute_logprobs_entropy``
        returns them: gathered over the Ulysses group, its padding and the micro-batch's
        padding removed."""
        logp, entropy = self._gbc_captured
        return self._gbc_trim(logp, ctx), self._gbc_trim(entropy, ctx)

    def _gbc_trim(self, t, ctx):
        """A per-token tensor of this rank's rows (``[n]``, or ``[n, H]``) as AReaL trims its
        log-probs: gathered over the Ulysses group (AReaL's own gather for ``[n]``), the
        Ulysses padding and the micro-batch's padding removed."""
        if t is None:
            return None
        if self.parallel_helper.sp_size > 1:
            if t.dim() == 1:
                t = self._sp_all_gather(t)
            else:                       # hidden states: no gradient, along the tokens
                import torch.distributed as dist

                parts = [torch.empty_like(t) for _ in range(self.parallel_helper.sp_size)]
                dist.all_gather(parts, t.contiguous(), group=self.sp_group)
                t = torch.cat(parts)
            if ctx.ulysses_pad_size > 0:
                t = t[:-ctx.ulysses_pad_size]
        if ctx.pad_length > 0:
            t = t[:-ctx.pad_length]
        return t

    def _compute_logprobs_and_loss(self, logits, ctx, loss_fn, loss_weight_fn,
                                   total_loss_weight, loss_multiplier=1.0):
        """AReaL's (same scaling: the micro-batch's loss weight over the batch's, times
        ``loss_multiplier``), on gbc's log-probs; the loss function gets no per-token min/max
        logits (``vocab_min_logits`` / ``vocab_max_logits``: None, so AReaL logs neither)."""
        local_weight = loss_weight_fn(ctx.mb_input)
        if local_weight == 0:
            return logits.mean() * 0.0
        logp, entropy = self._gbc_rows(ctx)
        kw = dict(vocab_min_logits=None, vocab_max_logits=None)
        phase, log = getattr(self, "_gbc_phase", None) or (None, True)
        if phase is None:
            loss = method_loss_fn(loss_fn, self.gbc_options)(logp, entropy, ctx.mb_input, **kw)
        else:
            if log:         # AReaL's metrics: the batch's terms, once per minibatch
                with torch.no_grad():
                    method_loss_fn(loss_fn, self.gbc_options)(logp.detach(), entropy,
                                                              ctx.mb_input, **kw)
            with silent_stats():
                loss = method_loss_fn(loss_fn, self.gbc_options, phase)(
                    logp, entropy, ctx.mb_input, **kw)
        # the stand-in keeps FSDP2's hooks on the forward's output in the backward graph
        loss = loss + logits.float().sum() * 0
        forced = self._gbc_captured_side.get("forced")
        if forced is not None:
            self._gbc_log_forced(self._gbc_trim(forced.float(), ctx), ctx.mb_input)
        return loss * (local_weight / total_loss_weight * loss_multiplier)

    @staticmethod
    def _gbc_log_forced(forced, mb):
        """``support=replay``: the share of the micro-batch's loss tokens whose target was
        outside the set the update scored (forced in), into AReaL's statistics of the update
        as ``gbc_support_forced_frac`` (over both updates under Lopti). With one set per
        rollout, the targets outside the building pass's set (the engine's numerics): the same
        in every minibatch and phase; with ``per_pass``, also those the moved policy's own set
        left out."""
        from areal.utils import stats_tracker

        mask = mb["loss_mask"].reshape(-1).bool().to(forced.device)
        stats_tracker.denominator(gbc_support_tokens=mask)
        stats_tracker.stat(gbc_support_forced_frac=forced.reshape(-1).float(),
                           denominator="gbc_support_tokens")

    def _compute_forward_result(self, logits, ctx):
        """``compute_logp``'s rows: gbc's log-probs of the micro-batch; with side outputs
        wanted (:meth:`compute_logp`), critical-token KL's weights trimmed the same way, and
        NTHR's kept tokens (:meth:`_gbc_keep_micro_batch`), collected aside."""
        logp = self._gbc_rows(ctx)[0]
        side = self._gbc_side
        if side is not None and "kl_weight" in side:
            side["kl_weight"].append(self._gbc_trim(self._gbc_captured_side["kl_weight"], ctx))
        if side is not None and "log_kept_mass" in side:
            side["log_kept_mass"].append(
                self._gbc_trim(self._gbc_captured_side["log_kept_mass"], ctx))
        if side is not None and "nthr" in side:
            side["nthr"].append(self._gbc_keep_micro_batch(ctx, logp))
        if side is not None and "support_row" in side:
            side["support_row"].append(self._gbc_keep_ids(ctx, logp))
        return logp

    def _gbc_keep_ids(self, ctx, logp):
        """The building pass's kept ids of this micro-batch (gathered over the Ulysses group,
        each rank's set first padded to the group's widest), kept for the table; returns
        ``[n]`` int64: each token's ``pass id << 32 | 1 + its row`` in the table."""
        ids = self._gbc_captured_side["support_ids"]
        if self.parallel_helper.sp_size > 1:
            import torch.distributed as dist

            k = torch.tensor([ids.shape[-1]], device=ids.device)
            dist.all_reduce(k, op=dist.ReduceOp.MAX, group=self.sp_group)
            ids = torch.nn.functional.pad(ids, (0, int(k) - ids.shape[-1]), value=-1)
        ids = self._gbc_trim(ids, ctx)
        building = self._gbc_building
        n = ids.shape[0]
        building["parts"].append(ids)
        first = building["n"] + 1
        building["n"] += n
        rows = torch.arange(first, first + n, dtype=torch.long, device=logp.device)
        return (building["pass_id"] << _ROW_BITS) + rows

    def _gbc_keep_micro_batch(self, ctx, logp):
        """Keep NTHR's inputs of this micro-batch's response tokens (those AReaL's
        ``compute_advantages`` puts in its rolled ``loss_mask``): hidden state and log-prob.
        Returns ``[n]``: 1 + each kept token's index in what the pass keeps, 0 elsewhere."""
        mb = ctx.mb_input
        if "loss_mask" not in mb:
            raise ValueError(f"{OPTIONS_ENV}: nthr=true: the batch has no loss_mask (NTHR "
                             "scores the response tokens AReaL's loss_mask marks)")
        mask, cu = mb["loss_mask"].reshape(-1), mb["cu_seqlens"].long()
        if mask.numel() != logp.numel():
            raise RuntimeError(f"nthr: the micro-batch's loss_mask has {mask.numel()} tokens "
                               f"and its log-probs {logp.numel()}")
        # AReaL's roll of each row by one (its last token takes its row's first)
        rolled = torch.roll(mask, -1)
        rolled[cu[1:] - 1] = mask[cu[:-1]]
        keep = rolled.bool().to(logp.device)
        hidden = self._gbc_trim(self._gbc_captured_side["hidden"], ctx)
        keeping = self._gbc_keeping
        n = int(keep.sum())
        where = torch.zeros(logp.numel(), dtype=torch.long, device=logp.device)
        where[keep] = torch.arange(keeping["n"] + 1, keeping["n"] + 1 + n, device=logp.device)
        keeping["hidden"].append(hidden[keep])
        keeping["logp"].append(logp[keep].float())
        keeping["n"] += n
        return where
