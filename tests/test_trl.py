"""The TRL drop-in against the real trl.GRPOTrainer on a tiny Qwen2 built in code (CPU).

With the gbc options off, GBCGRPOTrainer's loss and every parameter gradient must equal
GRPOTrainer's on the same batch and weights, for each supported loss_type and beta. The batch is
built by hand so that ratios clip on both sides, one completion is fully masked and the
completions have different lengths.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import spawn_gloo, tiny_hf_model

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer  # noqa: E402

B, P, T = 4, 3, 6
MAX_LEN = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_hf_model(str(path), tie_word_embeddings=False)
    return str(path)


def reward_has_knight(completions, **kwargs):
    return [float("knight" in c) for c in completions]


def build(cls, tiny, tmp_path, peft_config=None, model_dtype=torch.float32, eval_prompts=0,
          **options):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
                max_completion_length=MAX_LEN, report_to=[], use_cpu=True, bf16=False,
                logging_steps=1, save_strategy="no", seed=0, learning_rate=1e-2)
    args.update(options)
    config = (GBCGRPOConfig if any(k.startswith("gbc_") for k in options) else trl.GRPOConfig)
    dataset = Dataset.from_dict({"prompt": ["you meet knights and knaves"] * 8})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = {} if peft_config is None else {"peft_config": peft_config}
        if eval_prompts:
            extra["eval_dataset"] = dataset.select(range(eval_prompts))
        return cls(model=AutoModelForCausalLM.from_pretrained(tiny, dtype=model_dtype),
                   reward_funcs=reward_has_knight, args=config(**args), train_dataset=dataset,
                   processing_class=AutoTokenizer.from_pretrained(tiny), **extra)


def make_inputs(trainer, seed):
    """One micro-batch as GRPOTrainer's _generate_and_score_completions lays it out."""
    g = torch.Generator().manual_seed(seed)
    V = trainer.model.config.vocab_size
    prompt_ids = torch.randint(3, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, 0] = 0                                   # left padding
    prompt_ids[0, 0] = 0
    completion_ids = torch.randint(3, V, (B, T), generator=g)
    lengths = torch.tensor([T, 4, 0, 2])                    # one fully masked completion
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), T)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "old_per_token_logps": logp + 0.4 * torch.randn(B, T, generator=g),
        "ref_per_token_logps": logp + 0.3 * torch.randn(B, T, generator=g),
        "num_items_in_batch": completion_mask.sum() * 3,    # as if the generation batch were 3x
    }


def loss_and_grads(trainer, inputs, accumulation):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = accumulation
    loss = trainer.compute_loss(trainer.model, inputs)
    # a random upstream gradient: the loss must be used linearly
    (loss * 0.7).backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                           if p.grad is not None}


def assert_same_loss_and_grads(ours, ref, inputs, accumulation):
    """Loss within 1e-5 (relative beyond 1), every parameter gradient within 1e-4 of its
    largest entry."""
    loss_ref, g_ref = loss_and_grads(ref, inputs, accumulation)
    loss_ours, g_ours = loss_and_grads(ours, inputs, accumulation)
    assert torch.isfinite(loss_ref)
    assert abs(loss_ours.item() - loss_ref.item()) <= 1e-5 * max(1.0, abs(loss_ref.item()))
    assert g_ours.keys() == g_ref.keys() and len(g_ref) > 0
    for name, gr in g_ref.items():
        scale = gr.abs().max().clamp(min=1e-6)
        err = ((g_ours[name] - gr).abs().max() / scale).item()
        assert err <= 1e-4, f"{name}: rel diff {err:.2e}"


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
CLIP_METRICS = {"grpo": "clip_ratio/region_mean", "bnpo": "clip_ratio/region_mean",
                "dr_grpo": "clip_ratio/region_mean", "dapo": "clip_ratio/region_mean",
                "luspo": "clip_ratio/region_mean", "cispo": "cispo_clip_ratio",
                "vespo": "vespo/phi_seq_mean"}


def _parity(tiny, tmp_path, seed, accumulation=2, **opts):
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", **opts)
    inputs = make_inputs(ref, seed=seed)
    assert_same_loss_and_grads(ours, ref, inputs, accumulation)
    return ours, ref


def _same_metric(ours, ref, key, tol=1e-5):
    a, b = ours._metrics["train"][key][-1], ref._metrics["train"][key][-1]
    assert abs(a - b) <= tol * max(1.0, abs(b)), (key, a, b)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_same_loss_and_gradients_as_grpo_trainer(tiny, tmp_path, loss_type, level, beta):
    # cispo's epsilon_high is the cap of the ratio (TRL recommends 5.0); 1.1 makes it bite
    eps_high = 1.1 if loss_type == "cispo" else 0.28
    ours, ref = _parity(tiny, tmp_path, seed=LOSS_TYPES.index(loss_type) * 7 + int(beta * 100),
                        loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=eps_high,
                        importance_sampling_level=level, steps_per_generation=2,
                        use_bias_correction_kl=beta != 0.0 and level == "sequence")
    # the metrics TRL reports come from the fused loss too, with TRL's names
    if loss_type in CLIP_METRICS:
        _same_metric(ours, ref, CLIP_METRICS[loss_type])
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean"):
            _same_metric(ours, ref, key)
    _same_metric(ours, ref, "entropy")
    if beta:
        _same_metric(ours, ref, "kl")


@pytest.mark.parametrize("loss_type, opts", [
    pytest.param("dapo", dict(delta=1.1), id="delta"),
    pytest.param("grpo", dict(delta=1.1, importance_sampling_level="sequence"), id="delta-gspo"),
    pytest.param("bnpo", dict(top_entropy_quantile=0.4), id="entropy-quantile"),
    pytest.param("grpo", dict(top_entropy_quantile=0.3, entropy_coef=0.02),
                 id="entropy-quantile-bonus"),
    pytest.param("dapo", dict(off_policy_mask_threshold=0.0, beta=0.04), id="off-policy"),
    pytest.param("grpo", dict(off_policy_mask_threshold=0.01,
                              importance_sampling_level="sequence"), id="off-policy-gspo"),
    pytest.param("sapo", dict(sapo_temperature_pos=0.6, sapo_temperature_neg=1.4),
                 id="sapo-temperatures"),
    pytest.param("vespo", dict(vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5,
                               vespo_lambda_neg=1.0, beta=0.04), id="vespo-parameters"),
    pytest.param("luspo", dict(importance_sampling_level="sequence", beta=0.04,
                               top_entropy_quantile=0.5), id="luspo-quantile-kl"),
] + [pytest.param(lt, dict(entropy_coef=0.01, beta=0.04), id=f"entropy-{lt}")
     for lt in LOSS_TYPES])
def test_objective_options_match_grpo_trainer(tiny, tmp_path, loss_type, opts):
    ours, ref = _parity(tiny, tmp_path, seed=len(str(opts)), loss_type=loss_type,
                        epsilon_high=1.1 if loss_type == "cispo" else 0.28, **opts)
    if opts.get("entropy_coef"):
        _same_metric(ours, ref, "policy_loss")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_completions_masked_like_grpo_trainer(tiny, tmp_path, loss_type):
    """Every completion masked (mask_truncated_completions with nothing finished): a zero loss
    and zero gradients for every parameter, as GRPOTrainer gives (so the step leaves the model
    as it was), with KL and the entropy bonus on."""
    opts = dict(loss_type=loss_type, beta=0.04, entropy_coef=0.01)
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", **opts)
    inputs = make_inputs(ref, seed=2)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    loss_ref, g_ref = loss_and_grads(ref, inputs, 1)
    loss_ours, g_ours = loss_and_grads(ours, inputs, 1)
    assert loss_ref.item() == 0.0 and loss_ours.item() == 0.0
    assert g_ours.keys() == g_ref.keys()
    assert all(torch.count_nonzero(g) == 0 for g in g_ours.values())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_off_policy_mask_with_unscored_sampler_tokens(tiny, tmp_path, level):
    """vLLM's sampling log-probs reach the loss with NaN where a token could not be scored (TRL
    builds them so); the off-policy mask counts those tokens as no drift, in TRL and here."""
    opts = dict(loss_type="dapo", off_policy_mask_threshold=0.0, beta=0.04,
                importance_sampling_level=level)
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", **opts)
    inputs = make_inputs(ref, seed=13)
    g = torch.Generator().manual_seed(3)
    old = inputs["old_per_token_logps"]
    sampling = (old + 0.3 * torch.randn(old.shape, generator=g)).clamp(max=0)
    sampling[0, 1] = sampling[1, 0] = float("nan")       # masked-in tokens vLLM did not score
    assert inputs["completion_mask"][0, 1] and inputs["completion_mask"][1, 0]
    inputs["sampling_per_token_logps"] = sampling
    assert_same_loss_and_grads(ours, ref, inputs, 1)


@pytest.mark.parametrize("loss_type,model", [("dapo", "tiny"), ("grpo", "tiny"),
                                              ("dapo", "tiny_gemma")])
def test_cast_lm_head_to_fp32_matches_grpo_trainer(request, tmp_path, loss_type, model):
    """TRL's cast_lm_head_to_fp32 (ScaleRL) on a bf16 model: the lm_head computes in float32
    from the bf16 hidden states; the fused loss takes the float32 head the same way. Also on a
    Gemma-2 (tied embeddings, which TRL casts with the head, and final-logit soft-capping)."""
    tiny = request.getfixturevalue(model)
    opts = dict(loss_type=loss_type, beta=0.04, cast_lm_head_to_fp32=True,
                model_dtype=torch.bfloat16)
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", **opts)
    for t in (ref, ours):
        assert t.model.lm_head.weight.dtype == torch.float32
        assert t.model.model.norm.weight.dtype == torch.bfloat16
    inputs = make_inputs(ref, seed=11)
    loss_ref, g_ref = loss_and_grads(ref, inputs, 1)
    loss_ours, g_ours = loss_and_grads(ours, inputs, 1)
    assert torch.isfinite(loss_ref)
    assert abs(loss_ours.item() - loss_ref.item()) <= 1e-4 * max(1.0, abs(loss_ref.item()))
    assert g_ours.keys() == g_ref.keys()
    for name, gr in g_ref.items():
        assert g_ours[name].dtype == gr.dtype, name
        scale = gr.float().abs().max().clamp(min=1e-6)
        err = ((g_ours[name].float() - gr.float()).abs().max() / scale).item()
        # bf16 decoder gradients: one bf16 rounding of the hidden-state gradient apart at most
        assert err <= (1e-4 if gr.dtype == torch.float32 else 8e-3), f"{name}: {err:.2e}"


def test_adaptive_entropy_matches_grpo_trainer(tiny, tmp_path):
    """TRL's controller: no bonus until a window's entropy is measured, then the coefficient
    moves by entropy_coef_delta toward the target; the same losses and gradients each time."""
    opts = dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05,
                entropy_target=10.0, entropy_coef_delta=0.01)
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", **opts)
    for seed in (1, 2):       # first window: _last_world_entropy = inf, no bonus; then a bonus
        inputs = make_inputs(ref, seed=seed)
        assert_same_loss_and_grads(ours, ref, inputs, accumulation=1)
        assert ours.entropy_coef == pytest.approx(ref.entropy_coef)
        assert ours._last_world_entropy == pytest.approx(ref._last_world_entropy, rel=1e-5)
    assert ours.entropy_coef > 0.05         # the entropy was below the target: it grew


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_train_with_gradient_accumulation(tiny, tmp_path, loss_type):
    """Two optimizer steps with gradient accumulation 2 (four micro-batches): the same
    parameters as GRPOTrainer's."""
    final = {}
    for cls in (trl.GRPOTrainer, GBCGRPOTrainer):
        trainer = build(cls, tiny, tmp_path / cls.__name__, loss_type=loss_type, beta=0.04,
                        per_device_train_batch_size=2, num_generations=4,
                        gradient_accumulation_steps=2, max_steps=2, optim="sgd",
                        learning_rate=0.5, epsilon_high=1.1 if loss_type == "cispo" else 0.28,
                        importance_sampling_level="sequence" if loss_type == "luspo"
                        else "token")
        trainer.train()
        final[cls] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    start = dict(AutoModelForCausalLM.from_pretrained(tiny).named_parameters())
    moved = 0
    for name, p in final[trl.GRPOTrainer].items():
        assert torch.allclose(final[GBCGRPOTrainer][name], p, rtol=1e-4, atol=1e-6), name
        moved += not torch.equal(p, start[name])
    assert moved > 0


@pytest.mark.parametrize("seq_level", [False, True])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_vllm_importance_sampling_ratio_matches(tiny, tmp_path, loss_type, seq_level):
    """TRL multiplies the per-token loss by vLLM's IS ratio (vespo: folds it into phi); the
    ratio is per token ([B, T], token_* modes) or per sequence ([B, 1], sequence_* modes). vLLM
    is not installed here, so both trainers get the flags after construction."""
    opts = dict(loss_type=loss_type, beta=0.04,
                epsilon_high=1.1 if loss_type == "cispo" else 0.28)
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", **opts)
    for t in (ref, ours):
        t.use_vllm, t.vllm_importance_sampling_correction = True, True
    inputs = make_inputs(ref, seed=11)
    shape = (B, 1) if seq_level else (B, T)
    ratio = 0.5 + torch.rand(shape, generator=torch.Generator().manual_seed(3))
    if not seq_level:       # as TRL builds it: exp of a masked difference, 1 off the mask
        ratio = torch.where(inputs["completion_mask"].bool(), ratio, torch.ones_like(ratio))
    inputs["importance_sampling_ratio"] = ratio
    assert_same_loss_and_grads(ours, ref, inputs, accumulation=1)


def test_entropy_bonus_matches_for_bnpo(tiny, tmp_path):
    opts = dict(loss_type="bnpo", beta=0.04, entropy_coef=0.01)
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", **opts)
    inputs = make_inputs(ref, seed=5)
    assert_same_loss_and_grads(ours, ref, inputs, accumulation=1)


def test_gbc_options_change_the_loss(tiny, tmp_path):
    """A check that the options reach the kernel: AR with alpha=1 scales each token's advantage
    by p_old, so the loss differs from TRL's on the same batch."""
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", loss_type="bnpo")
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", loss_type="bnpo", gbc_ar_alpha=1.0)
    inputs = make_inputs(ref, seed=7)
    loss_ref, _ = loss_and_grads(ref, inputs, accumulation=1)
    loss_ours, _ = loss_and_grads(ours, inputs, accumulation=1)
    assert abs(loss_ours.item() - loss_ref.item()) > 1e-3


def test_three_steps_with_every_method_on(tiny, tmp_path):
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, loss_type="dapo", beta=0.04, max_steps=3,
                    gbc_ar_alpha=0.3, gbc_lopti_eta=0.5, gbc_nthr=True,
                    gbc_critical_kl_exponent=2.0, temperature=1.3,
                    num_iterations=2)    # TRL computes old log-probs; NTHR reuses them
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    steps = []
    trainer.create_optimizer()
    trainer.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    trainer.train()
    assert trainer.state.global_step == 3
    assert len(steps) == 6                       # Lopti: two optimizer steps per training step
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    logged = {k for row in trainer.state.log_history for k in row}
    for key in ("gbc/nthr_selected", "gbc/grad_share_low_low", "gbc/grad_share_low_high",
                "gbc/grad_share_low",
                "gbc/ar_weight_mean_low", "kl", "clip_ratio/region_mean"):
        assert key in logged, key
    for row in trainer.state.log_history:
        if "loss" in row:
            assert row["loss"] == row["loss"]    # not NaN


@pytest.mark.parametrize("opts,want", [
    ({}, set()),
    (dict(gbc_ar_alpha=0.3), {"gbc/ar_weight_mean"}),
    (dict(gbc_lopti_eta=0.5), {"gbc/grad_share_low", "gbc/low_frac_low", "gbc/low_frac_high",
                               "gbc/grad_share_low_low", "gbc/grad_share_low_high"}),
], ids=["off", "ar", "lopti"])
def test_method_metrics_logged_only_when_the_method_runs(tiny, tmp_path, opts, want):
    """issue 65, 10: AR's weight mean and Lopti's token share and gradient split are logged
    when that method runs, never with it off (a reader would take them for on)."""
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, loss_type="grpo", max_steps=1, **opts)
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    methods = {k for k in logged if k.startswith(("gbc/ar_weight_mean", "gbc/low_frac",
                                                  "gbc/grad_share_low"))}
    assert methods == want, methods


@pytest.mark.parametrize("methods", [False, True], ids=["trl-options", "every-method"])
def test_evaluation_before_and_during_training(tiny, tmp_path, methods):
    """TRL's own regression case: evaluation before the first step (eval_on_start, while the
    accumulation count is still unset) and every 2 steps, one generation per eval prompt,
    num_iterations=2, gradient accumulation 2; with the gbc methods off and on (NTHR and
    critical KL are train-time only; the eval loss is that of the current Lopti phase)."""
    gbc_opts = dict(gbc_ar_alpha=0.3, gbc_lopti_eta=0.5, gbc_nthr=True,
                    gbc_critical_kl_exponent=2.0) if methods else {}
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, loss_type="grpo", beta=0.04, max_steps=4,
                    per_device_eval_batch_size=B, num_generations_eval=1,
                    eval_strategy="steps", eval_steps=2, eval_on_start=True, num_iterations=2,
                    gradient_accumulation_steps=2, eval_prompts=4, **gbc_opts)
    trainer.train()
    evals = [row for row in trainer.state.log_history if "eval_loss" in row]
    assert len(evals) == 3                          # on start, after steps 2 and 4
    for row in evals:
        assert row["eval_loss"] == row["eval_loss"] and "eval_kl" in row
    assert trainer.state.global_step == 4


def test_lopti_with_gradient_accumulation_equals_one_big_micro_batch(tiny, tmp_path):
    """Lopti over an accumulation window of 2 micro-batches of 2 equals Lopti on one
    micro-batch of 4 (dapo normalises by the window's token count): the low phase accumulates
    over the window, one optimizer step, the high phase over the same window, one step."""
    final, steps = {}, {}
    for ga in (1, 2):
        trainer = build(GBCGRPOTrainer, tiny, tmp_path / f"ga{ga}", loss_type="dapo", beta=0.04,
                        per_device_train_batch_size=4 // ga, gradient_accumulation_steps=ga,
                        steps_per_generation=ga, num_generations=4, max_steps=2, optim="sgd",
                        learning_rate=0.5, gbc_lopti_eta=0.5, gbc_ar_alpha=0.3)
        count = []
        trainer.create_optimizer()
        trainer.optimizer.register_step_post_hook(lambda *a: count.append(1))
        trainer.train()
        steps[ga] = len(count)
        final[ga] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        logged = {k for row in trainer.state.log_history for k in row}
        assert {"gbc/grad_share_low", "gbc/grad_share_low_low"} <= logged
    assert steps == {1: 4, 2: 4}                  # two optimizer steps per training step
    start = dict(AutoModelForCausalLM.from_pretrained(tiny).named_parameters())
    moved = 0
    for name, p in final[1].items():
        assert torch.allclose(final[2][name], p, rtol=1e-4, atol=1e-6), name
        moved += not torch.equal(p, start[name])
    assert moved > 0


@pytest.mark.parametrize("options, name", [
    (dict(gbc_critical_kl_exponent=150.0, beta=0.0), "gbc_critical_kl_exponent"),
    (dict(gbc_lopti_eta=0.5, gbc_lopti_order="sideways"), "gbc_lopti_order"),
    (dict(gbc_critical_kl_exponent=150.0, beta=0.04, gbc_critical_kl_certainty="vibes"),
     "gbc_critical_kl_certainty"),
    (dict(gbc_backend="cuda"), "gbc_backend"),
    (dict(gbc_ar_alpha=1.5), "gbc_ar_alpha"),
    (dict(gbc_lopti_eta=0.0), "gbc_lopti_eta"),
    (dict(gbc_nthr=True, gbc_nthr_eta=-1.0), "gbc_nthr_eta"),
    (dict(beta=0.04, gbc_critical_kl_exponent=-3.0), "gbc_critical_kl_exponent"),
    (dict(gbc_critical_kl_temperature=0.0), "gbc_critical_kl_temperature"),
])
def test_bad_gbc_option_raises(tiny, tmp_path, options, name):
    with pytest.raises(ValueError, match=name):
        build(GBCGRPOTrainer, tiny, tmp_path, **options)


def test_nthr_needs_whole_groups_per_process(tiny, tmp_path):
    # One process cannot split a group, so emulate a rank's share of a 2-process run: TRL checks
    # the global batch, a rank holding 3 completions of groups of 2 must be refused.
    args = GBCGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                         num_generations=2, report_to=[], use_cpu=True, gbc_nthr=True)
    args.per_device_train_batch_size = 3
    with pytest.raises(ValueError, match="gbc_nthr.*multiple of num_generations"):
        GBCGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny),
                       reward_funcs=reward_has_knight, args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
                       processing_class=AutoTokenizer.from_pretrained(tiny))


@pytest.fixture(scope="module")
def tiny_gemma(tiny, tmp_path_factory):
    """A tiny Gemma-2 (final-logit soft-capping at 3: the cap bites) with the tiny tokenizer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(1)
    cfg = Gemma2Config(vocab_size=len(AutoTokenizer.from_pretrained(tiny)), hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=2,
                       bos_token_id=1, final_logit_softcapping=3.0)
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():                       # logits well past the cap
        model.lm_head.weight.mul_(40.0)
    return _save_with_tokenizer(model, tiny, tmp_path_factory.mktemp("tiny_gemma2"))


def _save_with_tokenizer(model, tiny, path):
    """A model built in code, saved like a checkpoint with the tiny model's tokenizer."""
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("loss_type, beta", [("dapo", 0.04), ("grpo", 0.0)])
def test_softcapped_gemma2_matches_grpo_trainer(tiny_gemma, tmp_path, loss_type, beta):
    _parity(tiny_gemma, tmp_path, seed=13, loss_type=loss_type, beta=beta, temperature=0.9)


def test_softcapped_gemma2_trains_with_every_method(tiny_gemma, tmp_path):
    trainer = build(GBCGRPOTrainer, tiny_gemma, tmp_path, loss_type="dapo", beta=0.04,
                    max_steps=3, gbc_ar_alpha=0.3, gbc_lopti_eta=0.5, gbc_nthr=True,
                    gbc_critical_kl_exponent=2.0, num_iterations=2)
    trainer.train()
    assert trainer.state.global_step == 3
    for row in trainer.state.log_history:
        if "loss" in row:
            assert row["loss"] == row["loss"]


@pytest.fixture(scope="module")
def tiny_moe(tiny, tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts, 2 per token) with the tiny tokenizer; TRL turns its router
    auxiliary loss on by default (the config's router_aux_loss_coef)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(vocab_size=len(AutoTokenizer.from_pretrained(tiny)), hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=256, pad_token_id=0,
                         eos_token_id=2, router_aux_loss_coef=0.5)
    return _save_with_tokenizer(Qwen3MoeForCausalLM(cfg), tiny,
                                tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_moe_router_aux_loss_matches_grpo_trainer(tiny_moe, tmp_path, loss_type):
    ours, ref = _parity(tiny_moe, tmp_path, seed=17, loss_type=loss_type, beta=0.04)
    assert ours.aux_loss_enabled and ref.aux_loss_enabled
    _same_metric(ours, ref, "aux_loss")


def test_moe_trains_with_every_method(tiny_moe, tmp_path):
    trainer = build(GBCGRPOTrainer, tiny_moe, tmp_path, loss_type="dapo", beta=0.04,
                    max_steps=3, gbc_ar_alpha=0.3, gbc_lopti_eta=0.5, gbc_nthr=True,
                    gbc_critical_kl_exponent=2.0, num_iterations=2)
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    assert "aux_loss" in logged and trainer.state.global_step == 3


def _lora(**kw):
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    cfg = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"],
               init_lora_weights=False)       # B != 0: the adapter changes the loss
    cfg.update(kw)
    return peft.LoraConfig(**cfg)


@pytest.mark.parametrize("opts", [
    pytest.param(dict(loss_type="dapo"), id="lora"),
    pytest.param(dict(loss_type="grpo", beta=0.04), id="lora-beta"),
    pytest.param(dict(loss_type="dapo", beta=0.04, modules_to_save=["lm_head"]),
                 id="lora-lm_head-modules_to_save"),
])
def test_peft_lora_matches_grpo_trainer(tiny, tmp_path, opts):
    """LoRA adapters (and a trainable copy of the lm_head): the same loss and adapter
    gradients as GRPOTrainer; with beta, TRL's reference is the base model (adapter disabled)."""
    opts = dict(opts)
    lora = dict(modules_to_save=opts.pop("modules_to_save", None))
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", peft_config=_lora(**lora), **opts)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", peft_config=_lora(**lora), **opts)
    inputs = make_inputs(ref, seed=19)
    assert_same_loss_and_grads(ours, ref, inputs, accumulation=1)
    trained = {n for n, p in ours.model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trained)
    if lora["modules_to_save"]:
        assert any("modules_to_save" in n and "lm_head" in n for n in trained)


def test_peft_prompt_tuning_matches_grpo_trainer(tiny, tmp_path):
    """A prompt-learning adapter (virtual tokens prepended by the PeftModel's forward): the loss
    inside the forward sees the same positions as TRL's logits."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(6)
    pc = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", peft_config=pc, loss_type="dapo")
    torch.manual_seed(6)
    pc = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", peft_config=pc, loss_type="dapo")
    assert_same_loss_and_grads(ours, ref, make_inputs(ref, seed=29), accumulation=1)


def test_ready_peft_model_matches_grpo_trainer(tiny, tmp_path):
    """A PeftModel built by the user (not peft_config=): the same loss and adapter gradients."""
    peft = pytest.importorskip("peft")
    trainers = []
    for cls in (trl.GRPOTrainer, GBCGRPOTrainer):
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
                                    _lora())
        args = trl.GRPOConfig(output_dir=str(tmp_path / cls.__name__),
                              per_device_train_batch_size=B, num_generations=B,
                              max_completion_length=MAX_LEN, report_to=[], use_cpu=True,
                              loss_type="dapo", beta=0.04, bf16=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainers.append(cls(model=model, reward_funcs=reward_has_knight, args=args,
                                train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
                                processing_class=AutoTokenizer.from_pretrained(tiny)))
    ref, ours = trainers
    assert_same_loss_and_grads(ours, ref, make_inputs(ref, seed=23), accumulation=1)


def test_peft_lora_on_the_lm_head_folds_the_adapter(tiny):
    """LoRA on the lm_head itself (which TRL refuses): hf.lm_head folds the adapter, and the
    fused loss's gradients reach lora_A and lora_B as full logits would send them."""
    peft = pytest.importorskip("peft")
    import gbc_kernels as gbc
    from gbc_kernels.integrations import hf

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64),
                                _lora(target_modules=["q_proj", "lm_head"]))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, model.config.vocab_size, (3, 7), generator=g)
    attn = torch.ones_like(ids)
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    grads = []
    for fused in (True, False):
        model.zero_grad()
        if fused:
            head = hf.lm_head(model)
            h = hf.completion_hidden(model, ids, attn, completion_len=4)
            loss, _ = gbc.fused_linear_policy_loss(h, head.weight, ids[:, -4:], mask, adv,
                                                   bias=head.bias, backend="torch")
        else:
            logits = model(input_ids=ids, attention_mask=attn).logits[:, -5:-1].double()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -4:, None])[..., 0]
            loss = -(adv[:, None] * torch.exp(logp - logp.detach())).mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert any("lm_head.lora_B" in n for n in grads[0])
    assert grads[0].keys() == grads[1].keys()
    for n in grads[1]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-8, atol=1e-12), n


def test_peft_trains_with_every_method(tiny, tmp_path):
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, peft_config=_lora(), loss_type="dapo",
                    beta=0.04, max_steps=3, gbc_ar_alpha=0.3, gbc_lopti_eta=0.5, gbc_nthr=True,
                    gbc_critical_kl_exponent=2.0, num_iterations=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)
    assert trainer.state.global_step == 3


def _trl_ddp_worker(rank, world, tiny, out_dir, gbc_options, trl_options=None):
    """Both trainers, the same seed and data, under accelerate's multi-CPU (gloo) DDP."""
    final = {}
    for cls in (trl.GRPOTrainer, GBCGRPOTrainer):
        if gbc_options and cls is trl.GRPOTrainer:
            continue
        options = dict(loss_type="dapo", beta=0.04)
        options.update(trl_options or {})
        trainer = build(cls, tiny, f"{out_dir}/{cls.__name__}", per_device_train_batch_size=4,
                        num_generations=4, max_steps=2, optim="sgd", learning_rate=0.5,
                        **options, **gbc_options)
        assert trainer.accelerator.num_processes == world
        trainer.train()
        final[cls.__name__] = {n: p.detach().clone()
                               for n, p in trainer.model.named_parameters()}
    return final


@pytest.mark.parametrize("trl_options", [
    pytest.param({}, id="dapo"),
    pytest.param(dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01,
                      importance_sampling_level="sequence"), id="gspo-entropy-quantile"),
])
def test_under_accelerate_ddp_same_training_as_grpo_trainer(tiny, tmp_path, trl_options):
    """2 processes, 2 SGD steps, gbc options off: the same parameters as GRPOTrainer's (so the
    hidden states went through DDP's forward, the gradients were synchronised and the entropy
    quantile was taken over both processes' tokens, as TRL takes it)."""
    ranks = spawn_gloo(2, _trl_ddp_worker, tiny, str(tmp_path), {}, trl_options)
    start = AutoModelForCausalLM.from_pretrained(tiny)
    for final in ranks:
        ours, theirs = final["GBCGRPOTrainer"], final["GRPOTrainer"]
        moved = 0
        for name, p0 in start.named_parameters():
            assert torch.allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-6), name
            moved += not torch.equal(theirs[name], p0)
        assert moved > 0
    for name in ranks[0]["GBCGRPOTrainer"]:         # DDP kept the ranks in sync
        assert torch.equal(ranks[0]["GBCGRPOTrainer"][name], ranks[1]["GBCGRPOTrainer"][name])


def test_under_accelerate_ddp_every_method_on(tiny, tmp_path):
    ranks = spawn_gloo(2, _trl_ddp_worker, tiny, str(tmp_path),
                       dict(gbc_ar_alpha=0.3, gbc_lopti_eta=0.5, gbc_nthr=True,
                            gbc_critical_kl_exponent=2.0))
    for name, p in ranks[0]["GBCGRPOTrainer"].items():
        assert torch.isfinite(p).all()
        assert torch.equal(p, ranks[1]["GBCGRPOTrainer"][name]), name


def _trl_zero3_worker(rank, world, tiny, out_dir):
    from deepspeed.utils import safe_get_full_fp32_param

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    final = {}
    for cls in (trl.GRPOTrainer, GBCGRPOTrainer):
        trainer = build(cls, tiny, f"{out_dir}/{cls.__name__}", per_device_train_batch_size=4,
                        num_generations=4, max_steps=2, loss_type="dapo", beta=0.04,
                        optim="sgd", learning_rate=0.5, deepspeed=ds)
        assert trainer.accelerator.distributed_type == "DEEPSPEED"
        trainer.train()
        final[cls.__name__] = {n: safe_get_full_fp32_param(p).clone()
                               for n, p in trainer.model_wrapped.module.named_parameters()}
    return final


def test_under_deepspeed_zero3_same_training_as_grpo_trainer(tiny, tmp_path):
    """accelerate + DeepSpeed ZeRO-3 on 2 CPU processes (gloo): the lm_head exists only inside
    the forward, the loss is computed there; 2 SGD steps give GRPOTrainer's parameters."""
    pytest.importorskip("deepspeed")
    ranks = spawn_gloo(2, _trl_zero3_worker, tiny, str(tmp_path))
    start = dict(AutoModelForCausalLM.from_pretrained(tiny).named_parameters())
    for final in ranks:
        ours, theirs = final["GBCGRPOTrainer"], final["GRPOTrainer"]
        moved = 0
        for name, p in theirs.items():
            assert torch.allclose(ours[name], p, rtol=1e-4, atol=1e-6), name
            moved += not torch.equal(p, start[name])
        assert moved > 0


# ---- vision-language models ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_vlm(tiny, tmp_path_factory):
    """A tiny Qwen2-VL (one-layer vision tower, M-RoPE) with the tiny tokenizer; its four image
    token ids sit past the tokenizer's words. Returns (path, image token id, vision start id,
    vision end id)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    V = len(AutoTokenizer.from_pretrained(tiny)) + 4
    img, vid, start, end = V - 4, V - 3, V - 2, V - 1
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=img,
                        video_token_id=vid, vision_start_token_id=start, vision_end_token_id=end,
                        pad_token_id=0, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(4)
    path = _save_with_tokenizer(Qwen2VLForConditionalGeneration(cfg), tiny,
                                tmp_path_factory.mktemp("tiny_qwen2_vl"))
    return path, img, start, end


def build_vlm(cls, tiny_vlm, tmp_path, **options):
    from transformers import AutoModelForImageTextToText

    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
                max_completion_length=MAX_LEN, report_to=[], use_cpu=True, bf16=False,
                save_strategy="no", seed=0)
    args.update(options)
    config = GBCGRPOConfig if any(k.startswith("gbc_") for k in options) else trl.GRPOConfig
    dataset = Dataset.from_dict({"prompt": ["you meet knights and knaves"] * 8})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model=AutoModelForImageTextToText.from_pretrained(tiny_vlm[0],
                                                                     dtype=torch.float32),
                   reward_funcs=reward_has_knight, args=config(**args), train_dataset=dataset,
                   processing_class=AutoTokenizer.from_pretrained(tiny_vlm[0]))


def make_vlm_inputs(trainer, tiny_vlm, seed):
    """A micro-batch with one 8x8-patch image per prompt (4 image tokens after the 2x2 merge),
    as TRL lays out a vision-language batch: pixel_values, image_grid_thw, num_images and the
    multimodal token types beside the text inputs."""
    _, img, start, end = tiny_vlm
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 4]] * B)
    pixel_values = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    prompt_ids = torch.tensor([[start] + [img] * 4 + [end, 5 + i] for i in range(B)])
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.randint(3, img, (B, T), generator=g)
    lengths = torch.tensor([T, 4, 0, 2])
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    mm = torch.cat([(prompt_ids == img).long(), torch.zeros_like(completion_ids)], 1)
    media = dict(pixel_values=pixel_values, image_grid_thw=grid, num_images=[1] * B,
                 mm_token_type_ids=mm)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), T, **media)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=torch.randn(B, generator=g),
                old_per_token_logps=logp + 0.4 * torch.randn(B, T, generator=g),
                ref_per_token_logps=logp + 0.3 * torch.randn(B, T, generator=g),
                num_items_in_batch=completion_mask.sum() * 3, **media)


@pytest.mark.parametrize("loss_type,level", [("dapo", "token"), ("grpo", "sequence"),
                                             ("vespo", "token")])
def test_vision_language_model_matches_grpo_trainer(tiny_vlm, tmp_path, loss_type, level):
    """A Qwen2-VL batch with images: the images go into the model's forward with the text (the
    decoder sees their embeddings, the vision tower gets its gradients), and the loss and every
    gradient, vision tower included, equal GRPOTrainer's."""
    opts = dict(loss_type=loss_type, beta=0.04, importance_sampling_level=level)
    ref = build_vlm(trl.GRPOTrainer, tiny_vlm, tmp_path / "ref", **opts)
    ours = build_vlm(GBCGRPOTrainer, tiny_vlm, tmp_path / "ours", **opts)
    inputs = make_vlm_inputs(ref, tiny_vlm, seed=21)
    assert_same_loss_and_grads(ours, ref, inputs, accumulation=2)
    _, grads = loss_and_grads(ours, inputs, 1)
    assert any(n.startswith("model.visual.") and g.abs().sum() > 0 for n, g in grads.items())


def test_vision_language_model_nthr_and_critical_kl(tiny_vlm, tmp_path, monkeypatch):
    """NTHR's and critical KL's passes over a vision-language batch run the model with its
    images: the old-policy log-probs they compute equal TRL's, and the weights reach the loss."""
    ours = build_vlm(GBCGRPOTrainer, tiny_vlm, tmp_path, loss_type="dapo", beta=0.04,
                     gbc_nthr=True, gbc_critical_kl_exponent=2.0)
    inputs = make_vlm_inputs(ours, tiny_vlm, seed=22)
    inputs.pop("old_per_token_logps")
    inputs["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])      # one mixed group of 4
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions",
                        lambda self, batch: dict(inputs))
    ours.model.train()
    out = ours._generate_and_score_completions(None)
    mask = out["completion_mask"].bool()
    assert out["gbc_token_scale"].shape == mask.shape and out["gbc_kl_weight"].shape == mask.shape
    assert torch.isfinite(out["gbc_kl_weight"][mask]).all()
    # the passes saw the images: their log-probs are TRL's, not those of the text alone
    from gbc_kernels.integrations import hf
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    media = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    ours_lp = hf.old_policy_pass(ours.model, ids, am, out["completion_ids"], mask,
                                 completion_len=T, model_kwargs=media).old_logp
    with torch.no_grad():
        trl_lp, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, am, T,
                                                               num_images=[1] * B, **media)
        text_lp, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, am, T)
    torch.testing.assert_close(ours_lp[mask], trl_lp[mask], rtol=1e-5, atol=1e-5)
    assert (ours_lp[mask] - text_lp[mask]).abs().max() > 1e-4
    loss_and_grads(ours, out, 1)                   # the weights are accepted by the loss


def test_on_policy_first_iteration_ratio_exactly_one(tiny, tmp_path, monkeypatch):
    """num_iterations=2, on-policy generation: TRL's old-policy pass goes through gbc's row
    passes (inside the model's forward), so the first iteration's loss reads bitwise the same
    log-probs: at epsilon 1e-7 (below one float32 ulp of 1) nothing is clipped, the ratio is
    exactly 1. Fixed-shape chunks make it independent of the BLAS (docs/math.md, Numerics)."""
    monkeypatch.setenv("GBC_BATCH_INVARIANT", "1")
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, loss_type="dapo", max_steps=1,
                    num_iterations=2, epsilon=1e-7, epsilon_high=1e-7, gbc_ar_alpha=0.0)
    trainer.train()
    row = next(r for r in trainer.state.log_history if "clip_ratio/region_mean" in r)
    assert row["clip_ratio/region_mean"] == 0.0
    assert row["gbc/ratio_mean"] == 1.0 and row["gbc/log_ratio_mean"] == 0.0


@pytest.mark.parametrize("options, said", [
    (dict(epsilon=-0.1), "epsilon: refused as gbc's epsilon_low (epsilon_low: expected a "
                         "finite float >= 0, got -0.1)"),
    (dict(epsilon=0.2, epsilon_high=-0.3), "epsilon_high: expected a finite float >= 0, got "
                                           "-0.3"),      # TRL's name is gbc's
])
def test_config_errors_name_trls_options(tiny, tmp_path, options, said):
    """A TRL option gbc's loss refuses is named as TRL spells it (gbc's config calls
    ``epsilon`` ``epsilon_low``), and the step computes nothing (no gradient)."""
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, gbc_ar_alpha=0.0, **options)
    inputs = make_inputs(trainer, 0)
    trainer.model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError) as info:
        trainer.compute_loss(trainer.model, inputs)
    assert str(info.value).startswith(said)
    assert all(p.grad is None for p in trainer.model.parameters())


@pytest.mark.parametrize("loss_type, opts", [
    ("grpo", dict(beta=0.04, entropy_coef=0.01)),
    ("dapo", dict(beta=0.04)),
], ids=["grpo-kl-entropy-bonus", "dapo-kl"])
def test_lopti_logged_terms_are_the_batchs(tiny, tmp_path, monkeypatch, loss_type, opts):
    """Issue 53, defect 1: under Lopti one training step logs TRL's terms of the batch without
    the split — ``kl``, ``entropy``, the clip ratios, ``policy_loss`` (with the entropy bonus)
    and the Trainer's ``loss`` equal GRPOTrainer's own loss on AR's advantages (every
    completion token once, TRL's normalisers) at the parameters before the first update: one
    value each, not one per phase (the old log averaged ``kl`` / ``entropy`` over two
    parameter sets, summed the phases' losses, and added the all-token entropy to one
    phase's policy loss)."""
    from gbc_kernels import methods

    ref = build(trl.GRPOTrainer, tiny, tmp_path / "ref", loss_type=loss_type, **opts)
    inputs = make_inputs(ref, seed=11)
    p_old = inputs["old_per_token_logps"].exp()[inputs["completion_mask"].bool()]
    eta = float(p_old.median())                 # both phases have tokens
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", loss_type=loss_type,
                 gbc_lopti_eta=eta, gbc_ar_alpha=0.3, **opts)
    # TRL's own loss and metrics on AR's advantages, no split, at the start parameters
    hand = dict(inputs)
    hand["advantages"] = methods.loss_advantages(
        inputs["advantages"][:, None].expand(B, T), inputs["old_per_token_logps"],
        methods.MethodOptions(ar_alpha=0.3)).float()
    ref.model.train()
    ref.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        want_loss = ref.compute_loss(ref.model, hand).item()
    want = {k: v[-1] for k, v in ref._metrics["train"].items()}
    # gbc's Lopti training step on the same micro-batch (TRL's rollout stood in: the batch
    # is already prepared), one micro-batch per window
    monkeypatch.setattr(trl.GRPOTrainer, "_prepare_inputs", lambda self, batch: batch)
    ours.create_optimizer()
    ours.current_gradient_accumulation_steps = 1
    steps = []
    ours.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    got_loss = ours.training_step(ours.model, dict(inputs)).item()
    assert len(steps) == 1          # the first phase's step (the Trainer takes the second)
    keys = ["kl", "entropy"] + [k for k in want if k.startswith(("policy_loss", "cispo", "vespo"))
                                or k.startswith("clip_ratio/") and k.endswith("_mean")]
    if "entropy_coef" in opts:
        assert "policy_loss" in keys
    for key in keys:
        values = ours._metrics["train"][key]
        assert len(values) == 1, (key, values)          # one value per step, not per phase
        assert values[0] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    # the phases' own diagnostics are still logged, per phase
    assert {"gbc/low_frac_low", "gbc/low_frac_high"} <= set(ours._metrics["train"])
