"""``gbc_support="replay"`` with one kept set per rollout (``gbc_support_set``, issue 66): the
set is built once, by the pass that first scores the rollout with the sampling policy's weights
(TRL's old-policy pass; without one, gbc's own policy pass or the update), travels in TRL's
batch (``gbc_support_ids``, through its shuffle and split), and every later pass — the
reference, the update, Lopti's second phase, a second iteration — scores exactly that set.

The stock trainer it is checked against (:class:`RolloutKeptSetGRPOTrainer`) builds the set
with ``gbc_reference.kept_set`` (float64) from the sampling policy's logits at the rollout and
scores every pass over it (the target forced in); the rollout runs through TRL's own
``_generate_and_score_completions`` with the stand-in vLLM of tests/test_trl_support.py.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

import gbc_reference as ref  # noqa: E402
from gbc_kernels import methods  # noqa: E402
from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer  # noqa: E402
from test_trl_support import (B, CLIPS, PROMPT, SAMPLING, _loss_and_grads,  # noqa: E402,F401
                              _same, _truncation, build, drifted, rollout, stand_in_vllm, tiny)

ORACLE_KEY = "oracle_keep"        # the stock trainer's set [B, T, V] bool, in TRL's batch


def _moved(model, scale, seed):
    """Every parameter of ``model`` moved in place by seeded noise (the same in both trainers):
    a later pass's weights, or a reference that is not the sampling policy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.detach().std().clamp(min=1e-3) * torch.randn(p.shape, generator=g))


class RolloutKeptSetGRPOTrainer(trl.GRPOTrainer):
    """The stock ``GRPOTrainer`` whose per-token log-probs (old, reference, the loss's) are the
    log-softmax over ONE set per rollout: ``gbc_reference.kept_set`` (float64, ``ties="first"``)
    of the sampling policy's logits at the rollout temperature, built by the rollout's first
    pass (a policy forward of its own where that first pass is the reference's) or, where the
    rollout ran none, by the first update of the micro-batch; carried in TRL's batch
    (:data:`ORACLE_KEY`), the target always a member. ``passes``: per pass, the share of
    response tokens forced in, and whether the model's own set differs from the scored one."""

    def _generate_and_score_completions(self, inputs):
        self._keep, self._in_rollout, self.passes = None, True, []
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._in_rollout = False
        if self._keep is not None:
            out[ORACLE_KEY] = self._keep
        self._keep = None
        return out

    def _compute_loss(self, model, inputs):
        self._keep = inputs.get(ORACLE_KEY)
        try:
            loss = super()._compute_loss(model, inputs)
            inputs[ORACLE_KEY] = self._keep     # built by this update if the batch had none
            return loss
        finally:
            self._keep = None

    def _logits(self, model, input_ids, attention_mask, T):
        inner = self.accelerator.unwrap_model(model)
        h = inner.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return inner.lm_head(h[:, -T - 1:-1]).float() / self.temperature

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        T = logits_to_keep
        z = self._logits(model, input_ids, attention_mask, T)
        y = input_ids[:, -T:]
        own = ref.kept_set(z.detach().double(), ties="first", **_truncation(self._settings))
        if self._keep is None:       # the first scoring with the sampling weights builds it
            self._keep = own if model is self.model else ref.kept_set(
                self._logits(self.model, input_ids, attention_mask, T).detach().double(),
                ties="first", **_truncation(self._settings))
        keep = self._keep
        mask = attention_mask[:, -T:].bool()
        self.passes.append(dict(
            forced=(~keep.gather(-1, y[..., None]).squeeze(-1))[mask].float().mean().item(),
            own_differs=bool((own != keep)[mask].any())))
        keep = keep.scatter(-1, y[..., None], True)
        lq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
        logp = lq.gather(-1, y[..., None]).squeeze(-1)
        entropy = None
        if compute_entropy:
            entropy = -torch.where(keep, lq.exp() * lq.masked_fill(~keep, 0.0), 0.0).sum(-1)
        return logp, entropy, None


def _as_mask(compact, T, V):
    """The batch's kept ids (compact, ``[B, T + M]``) -> the kept set ``[B, T, V]`` bool."""
    assert compact.dtype == torch.int32 and compact.dim() == 2 and compact.shape[1] >= T
    ids = methods.expand_support_ids(compact, T)
    keep = torch.zeros(*ids.shape[:-1], V + 1, dtype=torch.bool)
    return keep.scatter(-1, ids.long().clamp(min=-1) % (V + 1), True)[..., :V]


def _same_step(ours, stock, ours_in, stock_in):
    """tests/test_trl_support.py's tolerances: the loss within 1e-5 (relative beyond 1), each
    gradient within 1e-4 of its largest entry. Returns our update's metrics."""
    loss_s, g_s = _loss_and_grads(stock, stock_in)
    loss_o, g_o = _loss_and_grads(ours, ours_in)
    assert torch.isfinite(loss_s)
    assert abs(loss_o.item() - loss_s.item()) <= 1e-5 * max(1.0, abs(loss_s.item()))
    assert g_o.keys() == g_s.keys() and len(g_s) > 0
    for name, gs in g_s.items():
        err = ((g_o[name] - gs).abs().max() / gs.abs().max().clamp(min=1e-6)).item()
        assert err <= 1e-4, f"{name}: rel diff {err:.2e}"
    return ours._metrics["train"]["gbc/support_forced_frac"][-1], stock.passes[-1]


# which pass builds the set: TRL's old-policy pass (vLLM's importance sampling on); gbc's own
# policy pass (no old-policy pass, TRL's reference pass needs the set); the update (neither)
BUILDERS = {"old_pass": dict(beta=0.04, vllm_importance_sampling_mode="token_truncate", **CLIPS),
            "gbc_pass": dict(beta=0.04, vllm_importance_sampling_correction=False),
            "update": dict(beta=0.0, vllm_importance_sampling_correction=False)}


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_one_set_per_rollout_matches_stock_trl_over_the_sampling_policys_set(tiny, tmp_path,
                                                                            builder):
    """The default ``gbc_support_set`` ("rollout"): TRL's rollout and two updates equal the
    stock GRPOTrainer's that score every pass over the set built from the sampling policy
    (:class:`RolloutKeptSetGRPOTrainer`): the built ids (``gbc_support_ids``) are that set; the
    reference (moved away from the policy: its own set differs) scores it; the update at the
    rollout weights and again after the policy moved (a later iteration) score it, and their
    ``support_forced_frac`` is the building pass's share, unchanged by the move."""
    opts = dict(SAMPLING, loss_type="grpo", entropy_coef=0.01, **BUILDERS[builder])
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", gbc_support="replay", **opts)
    stock = build(RolloutKeptSetGRPOTrainer, tiny, tmp_path / "stock", **opts)
    stock._settings = SAMPLING
    for t in (ours, stock):
        t.vllm_generation.sampler = drifted(tiny)
        if t.ref_model is not None:
            _moved(t.ref_model, 0.3, seed=11)
    out_o, out_s = rollout(ours), rollout(stock)
    assert torch.equal(out_o["completion_ids"], out_s["completion_ids"])
    mask = out_s["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert (key in out_o) == (key in out_s), key
        if key in out_s:
            _same(out_o[key][mask], out_s[key][mask], 2e-5, key)
    if "ref_per_token_logps" in out_s:      # the reference's own set is not the sampler's
        assert stock.passes[-1]["own_differs"]
    if "importance_sampling_ratio" in out_s:
        _same(out_o["importance_sampling_ratio"], out_s["importance_sampling_ratio"], 5e-5,
              "importance_sampling_ratio")
    assert ("gbc_support_ids" in out_o) == (builder != "update")
    forced_0, _ = _same_step(ours, stock, out_o, out_s)
    built = stock.passes[0]["forced"]      # the building pass's (the update's: the last)
    assert built > 0                   # the drifted engine sampled outside the policy's set
    V, T = ours.model.config.vocab_size, mask.shape[1]
    ids = out_o["gbc_support_ids"]         # the update that built them put them in the batch
    assert ids.shape[0] == mask.shape[0]
    assert torch.equal(_as_mask(ids, T, V)[mask], out_s[ORACLE_KEY][mask])
    for t in (ours, stock):                 # a later pass: the policy has moved
        _moved(t.model, 0.3, seed=12)
    forced_1, scored = _same_step(ours, stock, out_o, out_s)
    assert scored["own_differs"]            # the moved policy's own set is another
    assert forced_0 == pytest.approx(built, abs=1e-6)
    assert forced_1 == pytest.approx(built, abs=1e-6)


def _forced_per_step(tiny, tmp_path, support_set, **options):
    """Trains with the drifted engine; returns the logged rows of ``gbc/support_forced_frac*``
    (one per optimizer step)."""
    t = build(GBCGRPOTrainer, tiny, tmp_path / support_set, gbc_support="replay",
              gbc_support_set=support_set, loss_type="dapo", **SAMPLING, **options)
    t.vllm_generation.sampler = drifted(tiny)
    t.train()
    return [{k: v for k, v in row.items() if k.startswith("gbc/support_forced_frac")}
            for row in t.state.log_history if any(k.startswith("gbc/support_forced") for k in row)]


def test_lopti_second_phase_scores_the_rollout_set(tiny, tmp_path, record_property):
    """Lopti's second phase replays the micro-batch's ids: its forced share is the first
    phase's (the building pass's set, the target outside it only where the engine sampled
    outside the policy's set); ``per_pass`` rebuilds the set from the policy the first update
    moved, and its forced share grows. Both printed (docs/trl.md quotes them)."""
    opts = dict(gbc_lopti_eta=0.5, max_steps=1)
    rows = {s: _forced_per_step(tiny, tmp_path, s, **opts)[0] for s in ("rollout", "per_pass")}
    (first, second) = ("gbc/support_forced_frac_low", "gbc/support_forced_frac_high")
    once, per = rows["rollout"], rows["per_pass"]
    line = (f"support_forced_frac, Lopti first / second phase: rollout {once[first]:.3f} / "
            f"{once[second]:.3f}, per_pass {per[first]:.3f} / {per[second]:.3f}")
    print(line)
    record_property("forced_lopti", line)
    assert once[first] == pytest.approx(per[first], abs=1e-6) and once[first] > 0
    assert once[second] == pytest.approx(once[first], abs=1e-6)
    assert per[second] > per[first] + 0.1


def test_second_iteration_scores_the_rollout_set(tiny, tmp_path, record_property):
    """``num_iterations=2`` (TRL's old-policy pass builds; the second iteration's batch is the
    first's, after an optimizer step): the second update's forced share is the first's under
    one set per rollout, and moves under ``per_pass``."""
    opts = dict(num_iterations=2, max_steps=2)
    rows = {s: _forced_per_step(tiny, tmp_path, s, **opts) for s in ("rollout", "per_pass")}
    key = "gbc/support_forced_frac"
    once, per = [r[key] for r in rows["rollout"]], [r[key] for r in rows["per_pass"]]
    line = (f"support_forced_frac, iterations 1 / 2: rollout {once[0]:.3f} / {once[1]:.3f}, "
            f"per_pass {per[0]:.3f} / {per[1]:.3f}")
    print(line)
    record_property("forced_iterations", line)
    assert len(once) == len(per) == 2 and once[0] > 0
    assert once[1] == pytest.approx(once[0], abs=1e-6)
    assert abs(per[1] - per[0]) > 0.05


def test_ids_travel_through_trls_shuffle_and_split(tiny, tmp_path):
    """TRL's ``_prepare_inputs`` shuffles the generation batch and splits it into
    ``steps_per_generation`` micro-batches: each micro-batch's ``gbc_support_ids`` are the
    sampling policy's kept set (float64) of its own rows."""
    t = build(GBCGRPOTrainer, tiny, tmp_path, gbc_support="replay", **SAMPLING,
              per_device_train_batch_size=2, steps_per_generation=2, num_generations=4)
    t.model.train()
    t._step, t._buffered_inputs = 0, None
    torch.manual_seed(3)
    t._prepare_inputs([{"prompt": PROMPT}] * 4)
    parts = t._buffered_inputs
    assert len(parts) == 2
    inner = t.model
    for part in parts:
        ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
        att = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
        T = part["completion_ids"].size(1)
        with torch.no_grad():
            h = inner.model(input_ids=ids, attention_mask=att).last_hidden_state
            z = inner.lm_head(h[:, -T - 1:-1]).double() / SAMPLING["temperature"]
        keep = ref.kept_set(z, ties="first", **_truncation(SAMPLING))
        mask = part["completion_mask"].bool()
        assert part["gbc_support_ids"].shape[0] == mask.shape[0]
        got = _as_mask(part["gbc_support_ids"], T, inner.config.vocab_size)
        assert torch.equal(got[mask], keep[mask])


@pytest.mark.parametrize("builder", ["old_pass", "gbc_pass"])
def test_critical_kl_weights_over_the_rollout_set(tiny, tmp_path, builder):
    """Critical-token KL: the reference's weights ``J**gamma`` from its certainty over the
    sampler's set (``max_prob`` normalised by ``log |S + {y}|``, float64), whichever pass built
    the set (gbc's own: the reference pass ran again, its weights are the ones kept)."""
    gamma = 2.0
    opts = dict(SAMPLING, loss_type="grpo", **BUILDERS[builder])
    t = build(GBCGRPOTrainer, tiny, tmp_path, gbc_support="replay",
              gbc_critical_kl_exponent=gamma, **opts)
    t.vllm_generation.sampler = drifted(tiny)
    _moved(t.ref_model, 0.3, seed=11)
    out = rollout(t)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    T, y = out["completion_ids"].size(1), out["completion_ids"]
    mask = out["completion_mask"].bool()
    with torch.no_grad():
        h = t.ref_model.model(input_ids=ids, attention_mask=att).last_hidden_state
        z = t.ref_model.lm_head(h[:, -T - 1:-1]).double()
    keep = _as_mask(out["gbc_support_ids"], T, z.shape[-1]).scatter(-1, y[..., None], True)
    lq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    size = keep.sum(-1)
    j = torch.where(size > 1, 1.0 + lq.max(-1).values / size.clamp(min=2).double().log(), 1.0)
    _same(out["gbc_kl_weight"][mask].double(), (j ** gamma)[mask], 2e-5, "kl_weight")


def test_peft_reference_scores_the_policys_set(tiny, tmp_path):
    """A LoRA policy whose reference is its base (TRL disables the adapter for its reference
    pass) and no old-policy pass: gbc's own pass of the policy, adapter on, builds the set, and
    the reference pass runs again over it with the adapter off; ``ref_per_token_logps`` are the
    base model's log-probs over the LoRA policy's set (float64), not over the base's own."""
    peft = pytest.importorskip("peft")
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_trl_support import reward_has_knight

    torch.manual_seed(3)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "up_proj"])
    args = GBCGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=B,
                         num_generations=B, max_completion_length=8, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", seed=0, use_vllm=True,
                         loss_type="grpo", beta=0.04, vllm_importance_sampling_correction=False,
                         gbc_support="replay", **SAMPLING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = GBCGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny),
                           reward_funcs=reward_has_knight, args=args, peft_config=lora,
                           train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 8}),
                           processing_class=AutoTokenizer.from_pretrained(tiny))
    assert t.ref_model is None
    out = rollout(t)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    T, y = out["completion_ids"].size(1), out["completion_ids"]
    mask = out["completion_mask"].bool()

    def logits():
        h = t.model(input_ids=ids, attention_mask=att, output_hidden_states=True,
                    logits_to_keep=T + 1).hidden_states[-1][:, -T - 1:-1].double()
        w = t.model.get_output_embeddings().weight.double()
        return h @ w.T / SAMPLING["temperature"]

    with torch.no_grad():
        z_policy = logits()
        with t.model.disable_adapter():
            z_base = logits()
    keep = ref.kept_set(z_policy, ties="first", **_truncation(SAMPLING))
    own = ref.kept_set(z_base, ties="first", **_truncation(SAMPLING))
    assert (own != keep)[mask].any()          # the base's own set is another
    assert torch.equal(_as_mask(out["gbc_support_ids"], T, z_base.shape[-1])[mask], keep[mask])

    def over(k):
        k = k.scatter(-1, y[..., None], True)
        lq = torch.log_softmax(z_base.masked_fill(~k, float("-inf")), -1)
        return lq.gather(-1, y[..., None]).squeeze(-1)

    _same(out["ref_per_token_logps"][mask].double(), over(keep)[mask], 2e-5, "ref over S")
    assert (out["ref_per_token_logps"][mask].double() - over(own)[mask]).abs().max() > 1e-3


def _config(**kw):
    return GBCGRPOConfig(output_dir="/tmp/gbc_trl_support_set", report_to=[], use_cpu=True,
                         use_vllm=True, top_p=0.9, **kw)


@pytest.mark.parametrize("options, match", [
    (dict(gbc_support="replay", gbc_support_set="per-pass"),
     r"gbc_support_set: .*expected one of \('rollout', 'per_pass'\)"),
    (dict(gbc_support="replay", gbc_support_set="once"), r"gbc_support_set: .*'once'"),
    (dict(gbc_support="kept_mass", gbc_support_set="rollout"),
     r"gbc_support_set: .*kept_mass's later passes score the whole vocabulary"),
    (dict(gbc_support_set="per_pass"), r"gbc_support_set: .*set support=replay"),
])
def test_bad_support_set_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        _config(**options)


def test_support_set_values_accepted():
    from gbc_kernels.integrations.trl import method_options

    for value, once in ((None, True), ("rollout", True), ("per_pass", False)):
        opts = method_options(_config(gbc_support="replay", gbc_support_set=value))
        assert opts.one_set_per_rollout is once
