"""``gbc_support`` in ``GBCGRPOTrainer`` (issue 61): the sampler's kept set rebuilt from
``GRPOConfig``'s ``top_k`` / ``top_p`` / ``min_p`` at the rollout temperature (vLLM's rule).

vLLM does not run on a CPU, so TRL's ``VLLMGeneration`` is replaced by a stand-in with its
signature (:class:`StandInVLLM`): each token is drawn from the tiny model's softmax at the
rollout temperature renormalised over vLLM's kept set (``gbc_reference.kept_set``), and its
log-prob recorded as vLLM's ``processed_logprobs`` are (float32, normalised over the kept set).
The trainers are built with ``use_vllm=True`` through TRL's own constructor and run TRL's own
rollout (``_generate_and_score_completions``: the old-policy pass, the ratio of every
``vllm_importance_sampling_mode``, the reference pass) and loss.

Each mode is checked against the stock ``trl.GRPOTrainer`` given the corrected log-probs by
hand: ``kept_mass`` against TRL's own step whose sampler log-probs are moved by ``log m``
computed by ``gbc_reference`` over the reference kept set (``truncation_support_ids``);
``replay`` with ``gbc_support_set="per_pass"`` against TRL's own step whose per-token
log-probs (old, reference, the loss's) are the log-softmax over the reference kept set rebuilt
from each pass's own logits (one set per rollout, the default: tests/test_trl_support_set.py).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_hf_model

trl = pytest.importorskip("trl")
import trl.trainer.grpo_trainer as grpo_module  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import gbc_reference as ref  # noqa: E402
from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer  # noqa: E402

B, MAX_LEN = 4, 8
PROMPT = "you meet knights and knaves"
SAMPLING = dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02)


def _truncation(cfg):
    """GRPOConfig's settings as gbc_reference.kept_set takes them (vLLM's: 0 / None = off)."""
    return dict(top_k=cfg.get("top_k") or None, top_p=cfg.get("top_p", 1.0),
                min_p=cfg.get("min_p") or 0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Qwen2 with its lm_head scaled up: logits of O(1), so that top-k, top-p and
    min-p each remove a real share of the mass (the randomly initialised head is nearly
    uniform)."""
    path = tmp_path_factory.mktemp("tiny_qwen2_support")
    tiny_hf_model(str(path), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(str(path))
    return str(path)


class StandInVLLM:
    """TRL's ``VLLMGeneration`` (colocate, ``processed_logprobs``) on a CPU: TRL's sampling
    settings applied to ``sampler`` (default: the trainer's own policy, as vLLM holds it after
    ``sync_weights``), one completion per prompt entry, stopping after EOS."""

    server_logprobs_mode = "processed_logprobs"

    def __init__(self, model, accelerator, processing_class, mode="colocate", temperature=1.0,
                 top_p=1.0, top_k=0, min_p=0.0, max_completion_length=16,
                 generation_kwargs=None, **kwargs):
        self.model, self.mode, self.temperature = model, mode, temperature
        self.settings = dict(top_k=top_k if top_k and top_k > 0 else None, top_p=top_p,
                             min_p=min_p or 0.0)
        self.max_len, self.eos = max_completion_length, processing_class.eos_token_id
        self.sampler = None           # another model to sample from (a drifted engine)
        self.correct = None           # moves the recorded log-probs (the stock trainer's)
        self.calls = 0
        self.vllm_client = SimpleNamespace(get_server_info=lambda: {
            "model_config": {"logprobs_mode": StandInVLLM.server_logprobs_mode}})

    def sync_weights(self):
        pass

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        g = torch.Generator().manual_seed(1000 + self.calls)
        self.calls += 1
        model = self.sampler if self.sampler is not None else self.model
        completions, logps = [], []
        for p in prompts:
            ids, comp, lps = list(p), [], []
            for _ in range(self.max_len):
                z = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / self.temperature
                keep = ref.kept_set(z, **self.settings)
                lq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
                y = int(torch.multinomial(lq.exp(), 1, generator=g))
                comp.append(y)
                lps.append(float(lq[y]))
                ids.append(y)
                if y == self.eos:
                    break
            completions.append(comp)
            logps.append(lps)
        if self.correct is not None:
            logps = self.correct(prompts, completions, logps)
        return (prompts, completions, [[[x] for x in s] for s in logps],
                [[[t] for t in c] for c in completions])


@pytest.fixture(autouse=True)
def stand_in_vllm(monkeypatch):
    monkeypatch.setattr(grpo_module, "VLLMGeneration", StandInVLLM)
    monkeypatch.setattr(StandInVLLM, "server_logprobs_mode", "processed_logprobs")


def reward_has_knight(completions, **kwargs):
    return [float("knight" in c) + 0.1 * len(c) for c in completions]


def build(cls, tiny, tmp_path, **options):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
                max_completion_length=MAX_LEN, report_to=[], use_cpu=True, bf16=False,
                logging_steps=1, save_strategy="no", seed=0, learning_rate=1e-2,
                use_vllm=True)
    args.update(options)
    config = GBCGRPOConfig if any(k.startswith("gbc_") for k in options) else trl.GRPOConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model=AutoModelForCausalLM.from_pretrained(tiny),
                   reward_funcs=reward_has_knight, args=config(**args),
                   train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 8}),
                   processing_class=AutoTokenizer.from_pretrained(tiny))


def rollout(trainer, n=B):
    trainer.model.train()
    return trainer._generate_and_score_completions([{"prompt": PROMPT}] * n)


def drifted(tiny, scale=0.15, seed=5):
    """The tiny model with its head moved: an engine whose log-probs are not the policy's, so
    that the ratios spread and the clips bite (loaded afresh: a deep copy of the trainer's
    model would keep running the original through TRL's patched forward)."""
    other = AutoModelForCausalLM.from_pretrained(tiny)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = other.lm_head.weight
        w.add_(scale * w.std() * torch.randn(w.shape, generator=g))
    return other


def _reference_log_kept_mass(model, prompt, completion, temperature, settings):
    """``log m = LSE_S - LSE_V`` of each completion token under ``model`` (float64), ``S`` the
    reference kept set rebuilt from its logits (``gbc_reference.truncation_support_ids``)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:-1].double()
    w = model.lm_head.weight.detach().double()
    y = torch.tensor(completion)
    support = ref.truncation_support_ids(h, w, y, temperature=temperature, **settings)
    return ref.fused_linear_logprobs(h, w, y, temperature=temperature, support_ids=support,
                                     return_log_kept_mass=True)[-1]


def moved_by_reference_kept_mass(policy, temperature, settings):
    """The stock trainer's sampler log-probs moved by hand: ``q + log m`` (vLLM's processed
    log-prob plus the old policy's log kept mass, gbc_reference)."""
    def correct(prompts, completions, logps):
        return [[lp + float(lk) for lp, lk in zip(s, _reference_log_kept_mass(
            policy, p, c, temperature, settings))] for p, c, s in zip(prompts, completions, logps)]
    return correct


class KeptSetGRPOTrainer(trl.GRPOTrainer):
    """The stock ``GRPOTrainer`` whose per-token log-probs — the old-policy pass, the reference
    pass and the loss's — are the log-softmax over the reference kept set
    (``gbc_reference.kept_set`` of each pass's own logits at the rollout temperature, float64,
    the target always a member), with autograd; its entropies over the same set."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        inner = self.accelerator.unwrap_model(model)
        h = inner.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        z = inner.lm_head(h[:, -logits_to_keep - 1:-1]).float() / self.temperature
        y = input_ids[:, -logits_to_keep:]
        keep = ref.kept_set(z.detach(), ties="first", **_truncation(self._settings))
        self._forced = ~keep.gather(-1, y[..., None]).squeeze(-1)    # the target outside S
        keep = keep.scatter(-1, y[..., None], True)
        lq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
        logp = lq.gather(-1, y[..., None]).squeeze(-1)
        entropy = None
        if compute_entropy:
            entropy = -torch.where(keep, lq.exp() * lq.masked_fill(~keep, 0.0), 0.0).sum(-1)
        return logp, entropy, None


def _same(a, b, tol, what):
    assert a.shape == b.shape, what
    err = (a - b).abs().max().item()
    assert err <= tol, f"{what}: max diff {err:.2e}"


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                           if p.grad is not None}


def _same_step(ours, stock, ours_in, stock_in):
    """The loss within 1e-5 (relative beyond 1), every parameter gradient within 1e-4 of its
    largest entry (tests/test_trl.py's tolerances)."""
    loss_s, g_s = _loss_and_grads(stock, stock_in)
    loss_o, g_o = _loss_and_grads(ours, ours_in)
    assert torch.isfinite(loss_s)
    assert abs(loss_o.item() - loss_s.item()) <= 1e-5 * max(1.0, abs(loss_s.item()))
    assert g_o.keys() == g_s.keys() and len(g_s) > 0
    for name, gs in g_s.items():
        err = ((g_o[name] - gs).abs().max() / gs.abs().max().clamp(min=1e-6)).item()
        assert err <= 1e-4, f"{name}: rel diff {err:.2e}"


IS_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# bounds that bite on the drifted engine's ratios (truncate: clamped; mask: zeroed)
CLIPS = dict(vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25)


@pytest.mark.parametrize("is_mode", IS_MODES)
def test_kept_mass_matches_stock_trl_with_moved_sampler_logps(tiny, tmp_path, is_mode):
    """``gbc_support="kept_mass"``: TRL's rollout and step equal the stock GRPOTrainer's whose
    vLLM log-probs were moved by ``log m`` by hand (the reference kept set of the old policy,
    float64): the ratio of each ``vllm_importance_sampling_mode`` (its clip bites), the
    full-vocabulary old and reference log-probs, the sampler log-probs the off-policy mask
    sees, TRL's ``sampling/*`` metrics, the loss and every gradient."""
    opts = dict(SAMPLING, loss_type="grpo", beta=0.04, vllm_importance_sampling_mode=is_mode,
                off_policy_mask_threshold=0.05, **CLIPS)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", gbc_support="kept_mass", **opts)
    stock = build(trl.GRPOTrainer, tiny, tmp_path / "stock", **opts)
    for t in (ours, stock):
        t.vllm_generation.sampler = drifted(tiny)
    stock.vllm_generation.correct = moved_by_reference_kept_mass(
        stock.model, SAMPLING["temperature"], _truncation(SAMPLING))
    out_o, out_s = rollout(ours), rollout(stock)
    assert torch.equal(out_o["completion_ids"], out_s["completion_ids"])
    mask = out_s["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"):
        _same(out_o[key][mask], out_s[key][mask], 2e-5, key)
    _same(out_o["importance_sampling_ratio"], out_s["importance_sampling_ratio"], 5e-5,
          "importance_sampling_ratio")
    ratio = out_s["importance_sampling_ratio"]
    if is_mode.endswith("mask"):
        assert (ratio == 0).any() and (ratio == 0).sum() == (out_o["importance_sampling_ratio"]
                                                            == 0).sum()
    else:
        assert ((ratio == 0.8) | (ratio == 1.25)).any()
    for key in ("sampling/importance_sampling_ratio/mean",
                "sampling/sampling_logp_difference/mean"):
        a, b = ours._metrics["train"][key][-1], stock._metrics["train"][key][-1]
        assert abs(a - b) <= 5e-5, (key, a, b)
    assert "gbc/kept_mass" in ours._metrics["train"]
    _same_step(ours, stock, out_o, out_s)


@pytest.mark.parametrize("is_mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_replay_matches_stock_trl_over_the_reference_kept_set(tiny, tmp_path, is_mode,
                                                             loss_type):
    """``gbc_support="replay"``, ``gbc_support_set="per_pass"``: TRL's rollout and step equal
    the stock GRPOTrainer's whose every per-token log-prob is over the reference kept set
    rebuilt from that pass's own logits (:class:`KeptSetGRPOTrainer`): old and reference
    log-probs, the ratio against the sampler's processed log-probs (unchanged: both are over
    kept sets), the loss (with the entropy bonus, over the set) and every gradient. One set
    per rollout (the default): tests/test_trl_support_set.py."""
    opts = dict(SAMPLING, loss_type=loss_type, beta=0.04, entropy_coef=0.01,
                vllm_importance_sampling_mode=is_mode, **CLIPS)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", gbc_support="replay",
                 gbc_support_set="per_pass", **opts)
    stock = build(KeptSetGRPOTrainer, tiny, tmp_path / "stock", **opts)
    stock._settings = SAMPLING
    for t in (ours, stock):
        t.vllm_generation.sampler = drifted(tiny)
    out_o, out_s = rollout(ours), rollout(stock)
    assert torch.equal(out_o["completion_ids"], out_s["completion_ids"])
    mask = out_s["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        _same(out_o[key][mask], out_s[key][mask], 2e-5, key)
    assert torch.equal(out_o["sampling_per_token_logps"], out_s["sampling_per_token_logps"])
    _same(out_o["importance_sampling_ratio"], out_s["importance_sampling_ratio"], 5e-5,
          "importance_sampling_ratio")
    _same_step(ours, stock, out_o, out_s)
    # the drifted engine sampled some tokens outside the policy's own kept set: scored over
    # S + {y} in both, counted by gbc's support_forced_frac
    forced = stock._forced[mask].float().mean().item()
    assert forced > 0
    assert ours._metrics["train"]["gbc/support_forced_frac"][-1] == pytest.approx(forced)


MEASURED = {"top_p=0.8": dict(temperature=1.0, top_p=0.8),
            "top_k=8,top_p=0.95,min_p=0.05": dict(temperature=0.9, top_k=8, top_p=0.95,
                                                   min_p=0.05)}


@pytest.mark.parametrize("setting", sorted(MEASURED))
def test_measured_sampler_ratio_moves_from_the_kept_mass_to_one(tiny, tmp_path, setting,
                                                                record_property):
    """Rollouts drawn with the trainer's settings from the policy itself (the engine holds the
    trainer's weights): the sampler ratio ``exp(old - sampler)`` over the response tokens,
    TRL's ``importance_sampling_ratio`` (``token_mask``, no bound), is the kept mass ``m``
    without a mode (mean < 1: TRL's bias) and 1 within float32 noise with ``kept_mass`` and
    with ``replay``. The three means are printed (docs/trl.md quotes them)."""
    settings = MEASURED[setting]
    opts = dict(settings, loss_type="grpo", per_device_train_batch_size=16, num_generations=4,
                vllm_importance_sampling_mode="token_mask",
                vllm_importance_sampling_clip_max=None)
    means, worst, kept = {}, {}, None
    for mode in (None, "kept_mass", "replay"):
        gbc = {} if mode is None else {"gbc_support": mode}
        trainer = build(GBCGRPOTrainer, tiny, tmp_path / str(mode), **opts, **gbc)
        out = rollout(trainer, 16)
        mask = out["completion_mask"].bool()
        ratio = out["importance_sampling_ratio"][mask]
        direct = torch.exp(out["old_per_token_logps"] - out["sampling_per_token_logps"])[mask]
        _same(ratio, direct, 1e-6, "TRL's ratio")
        means[str(mode)] = ratio.double().mean().item()
        worst[str(mode)] = (ratio.double() - 1).abs().max().item()
        if mode is None:
            kept = torch.cat([_reference_log_kept_mass(
                trainer.model, p[pm.bool()].tolist(), c[cm.bool()].tolist(),
                settings["temperature"], _truncation(settings)).exp()
                for p, pm, c, cm in zip(out["prompt_ids"], out["prompt_mask"],
                                        out["completion_ids"], out["completion_mask"])])
            _same(ratio.double(), kept, 2e-5, "uncorrected ratio vs the kept mass")
            assert means["None"] < 1.0 - 1e-3
        else:
            _same(ratio, torch.ones_like(ratio), 2e-5, f"ratio under {mode}")
            gbc_kept = trainer._metrics["train"]["gbc/kept_mass"][-1]
            assert abs(gbc_kept - kept.mean().item()) <= 2e-5
    line = (f"[{setting}] sampler ratio mean over {mask.sum().item()} tokens: "
            f"none {means['None']:.4f}, kept_mass {means['kept_mass']:.7f} (max |r - 1| "
            f"{worst['kept_mass']:.1e}), replay {means['replay']:.7f} (max |r - 1| "
            f"{worst['replay']:.1e}); mean kept mass {kept.mean().item():.4f}")
    print(line)
    record_property("sampler_ratio_means", line)


@pytest.mark.parametrize("mode", ["kept_mass", "replay"])
def test_train_steps_with_the_support(tiny, tmp_path, mode):
    """The real switch-on path and TRL's own training loop: two steps with vLLM's correction
    (sequence_mask, TRL's default), beta, AR and critical-token KL, with (replay) Lopti over the
    kept set or (kept_mass) NTHR; the parameters move, TRL's ratio metric is 1 within float32
    noise (the engine holds the policy), ``gbc/kept_mass`` is logged."""
    extra = (dict(gbc_lopti_eta=0.5, gbc_ar_alpha=0.3, gbc_critical_kl_exponent=2.0)
             if mode == "replay" else dict(gbc_nthr=True, gbc_ar_alpha=0.3,
                                           gbc_critical_kl_exponent=2.0))
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, gbc_support=mode, loss_type="dapo",
                    beta=0.04, max_steps=2, **SAMPLING, **extra)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    rows = [row for row in trainer.state.log_history if "gbc/kept_mass" in row]
    assert rows and all(0.0 < row["gbc/kept_mass"] < 1.0 for row in rows)
    for row in rows:
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
        assert row["loss"] == row["loss"]


# ------------------------------------------------------------------------------- refusals
def _config(**kw):
    return GBCGRPOConfig(output_dir="/tmp/gbc_trl_support", report_to=[], use_cpu=True, **kw)


VLLM = dict(use_vllm=True, top_p=0.9)


@pytest.mark.parametrize("options, match", [
    (dict(gbc_support="replay", top_p=0.9), r"gbc_support=replay: needs use_vllm=True"),
    (dict(gbc_support="kept_mass", use_vllm=True),
     r"gbc_support=kept_mass: the rollout samples without truncation"),
    (dict(gbc_support="kept_mass", use_vllm=True, top_k=-1, top_p=1.0, min_p=0.0),
     r"gbc_support=kept_mass: the rollout samples without truncation"),
    (dict(gbc_support="kept_mass", vllm_importance_sampling_correction=False, **VLLM),
     r"gbc_support=kept_mass: vllm_importance_sampling_correction=False"),
    (dict(gbc_support="replay", repetition_penalty=1.1, **VLLM),
     r"gbc_support=replay: repetition_penalty=1.1"),
    (dict(gbc_support="replay", vllm_structured_outputs_regex="[ab]+", **VLLM),
     r"gbc_support=replay: vllm_structured_outputs_regex"),
    (dict(gbc_support="replay", generation_kwargs={"top_k": 5}, **VLLM),
     r"generation_kwargs\['top_k'\]=5 overrides GRPOConfig's top_k=0"),
    (dict(gbc_support="replay", generation_kwargs={"temperature": 0.5}, **VLLM),
     r"generation_kwargs\['temperature'\]=0.5 overrides"),
    (dict(gbc_support="kept_mass", generation_kwargs={"min_tokens": 1}, **VLLM),
     r"generation_kwargs\['min_tokens'\]=1"),
    (dict(gbc_support="kept_mass", generation_kwargs={"presence_penalty": 0.3}, **VLLM),
     r"generation_kwargs\['presence_penalty'\]=0.3"),
    (dict(gbc_support="kept_mass", generation_kwargs={"logit_bias": {3: 1.0}}, **VLLM),
     r"generation_kwargs\['logit_bias'\]"),
    (dict(gbc_support="kept_mass", generation_kwargs={"logprobs": 5}, **VLLM),
     r"generation_kwargs\['logprobs'\]=5"),
    (dict(gbc_support="kept_mass", generation_kwargs={"my_processor_arg": 1}, **VLLM),
     r"generation_kwargs\['my_processor_arg'\]=1: not known"),
    (dict(gbc_support="replay", gbc_nthr=True, **VLLM), r"gbc_support=replay: gbc_nthr"),
    (dict(gbc_support="replay", top_p=1.5, use_vllm=True), r"gbc_support=replay: top_p"),
    (dict(gbc_support="replay", temperature=1e-6, **VLLM),
     r"gbc_support=replay: temperature=1e-06"),
    (dict(gbc_support_ties="all", **VLLM), r"gbc_support_ties=all: .*set gbc_support"),
    (dict(gbc_support="recompute", **VLLM), r"gbc_support"),
    (dict(gbc_support="replay", gbc_support_ties="last", **VLLM), r"gbc_support_ties"),
])
def test_bad_settings_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        _config(**options)


def test_other_trl_releases_refused(monkeypatch):
    """TRL 1.14 / 1.15: their vllm-serve does not set processed log-probs and their client
    cannot report the server's mode; gbc_support is read and tested against 1.16 only."""
    monkeypatch.setattr(trl, "__version__", "1.14.2")
    with pytest.raises(ValueError, match=r"gbc_support=replay: runs on TRL 1.16 only.*1.14.2"):
        _config(gbc_support="replay", **VLLM)
    _config(**VLLM)                  # without gbc_support: nothing refused


def test_neutral_generation_kwargs_accepted():
    cfg = _config(gbc_support="kept_mass", use_vllm=True, top_k=8, top_p=0.9,
                  generation_kwargs={"top_k": 8, "top_p": 0.9, "seed": 3, "stop": ["."],
                                     "repetition_penalty": 1.0, "min_tokens": 0,
                                     "logit_bias": None})
    from gbc_kernels.integrations.trl import config as trl_config

    tr = trl_config.support_truncation(cfg)
    assert (tr.top_k, tr.top_p, tr.min_p, tr.ties, tr.rule) == (8, 0.9, 0.0, "first", "vllm")
    cfg = _config(gbc_support="replay", gbc_support_ties="all", use_vllm=True, min_p=0.1)
    tr = trl_config.support_truncation(cfg)
    assert (tr.top_k, tr.top_p, tr.min_p, tr.ties) == (None, 1.0, 0.1, "all")


def test_refused_when_the_trainer_is_built(tiny, tmp_path, monkeypatch):
    """A vLLM server whose log-probs are not the processed ones, and a user rollout_func,
    are refused by name when GBCGRPOTrainer is built."""
    monkeypatch.setattr(StandInVLLM, "server_logprobs_mode", "raw_logprobs")
    with pytest.raises(ValueError, match=r"gbc_support=kept_mass: the vLLM server returns "
                                         r"logprobs_mode='raw_logprobs'"):
        build(GBCGRPOTrainer, tiny, tmp_path / "server", gbc_support="kept_mass",
              vllm_mode="server", **SAMPLING)
    monkeypatch.setattr(StandInVLLM, "server_logprobs_mode", "processed_logprobs")
    build(GBCGRPOTrainer, tiny, tmp_path / "server-ok", gbc_support="replay",
          vllm_mode="server", **SAMPLING)
    args = GBCGRPOConfig(output_dir=str(tmp_path / "rf"), report_to=[], use_cpu=True,
                         per_device_train_batch_size=B, num_generations=B, use_vllm=True,
                         gbc_support="replay", **SAMPLING)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"gbc_support=replay: "
                                                                    r"rollout_func"):
        warnings.simplefilter("ignore")
        GBCGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny),
                       reward_funcs=reward_has_knight, args=args,
                       train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 4}),
                       processing_class=AutoTokenizer.from_pretrained(tiny),
                       rollout_func=lambda prompts, trainer: {})


def test_off_by_default_changes_nothing(tiny, tmp_path):
    """Without gbc_support the same rollout gives the stock trainer's ratio (the kept-mass
    bias included) and no gbc/kept_mass metric."""
    opts = dict(SAMPLING, loss_type="grpo", vllm_importance_sampling_mode="token_truncate",
                **CLIPS)
    ours = build(GBCGRPOTrainer, tiny, tmp_path / "ours", gbc_ar_alpha=0.0, **opts)
    stock = build(trl.GRPOTrainer, tiny, tmp_path / "stock", **opts)
    out_o, out_s = rollout(ours), rollout(stock)
    assert torch.equal(out_o["sampling_per_token_logps"], out_s["sampling_per_token_logps"])
    _same(out_o["importance_sampling_ratio"], out_s["importance_sampling_ratio"], 5e-5, "ratio")
    assert "gbc/kept_mass" not in ours._metrics["train"]
