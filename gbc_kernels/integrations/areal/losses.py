"""AReaL 1.0.4's PPO actor options, as gbc's AReaL engine takes them (docs/areal.md).

AReaL's own loss functions (``areal.trainer.ppo.actor.grpo_loss_fn`` and what it calls) run
unchanged on gbc's log-probs, so every ``PPOActorConfig`` loss option is AReaL's by
construction. The method options (:class:`gbc_kernels.methods.MethodOptions`, the text of
``GBC_AREAL_OPTIONS``) act on the advantages that loss receives, the way the method layer
defines them for every objective (``methods.loss_advantages``: AR's weight
``alpha p_old + 1 - alpha`` with ``p_old = exp(prox_logp)``, the policy the ratio is taken
against); what cannot run inside AReaL's flow yet is refused by name here, before anything
is built.
"""

from __future__ import annotations

import functools
import os

from gbc_kernels import methods

ENV = "GBC_AREAL"                      # set by enable(): gbc's engine is switched on
OPTIONS_ENV = "GBC_AREAL_OPTIONS"      # the method options, "ar_alpha=0.3,logits_dtype=float32"

# the method options gbc's AReaL engine refuses, and why (docs/areal.md, "What is refused")
REFUSED_METHODS = {
    "lopti_eta": "Lopti's two optimizer steps per batch are not wired into AReaL's ppo_update "
                 "yet (its minibatch loop calls train_batch once per minibatch)",
    "nthr": "NTHR's token scales need the old-policy pass's hidden states per prompt group "
            "inside AReaL's compute_logp; not wired yet",
    "critical_kl_exponent": "AReaL puts the KL penalty in the reward (kl_ctl * "
                            "kl_estimator(old_logp, ref_logp) in compute_advantages), not in "
                            "the loss; the certainty weights of the reference pass do not "
                            "reach it yet",
}


def options_from_env() -> methods.MethodOptions:
    """The method options of ``GBC_AREAL_OPTIONS`` (none set: every method off)."""
    return methods.MethodOptions.parse(os.environ.get(OPTIONS_ENV, ""), OPTIONS_ENV)


def _cfg(config, name, default=None):
    return getattr(config, name, default)


def check_options(config, options: methods.MethodOptions) -> None:
    """Refuse, naming the option, what gbc's AReaL engine cannot run under AReaL's actor
    ``config`` (a ``PPOActorConfig``, a ``TrainEngineConfig`` for the reference engine, or
    None: the options alone):
    the methods of :data:`REFUSED_METHODS`, AR where its weight is not defined per token, and
    AReaL's tree training."""
    for name, why in REFUSED_METHODS.items():
        value = getattr(options, name)
        if value not in (None, False):
            raise ValueError(f"{OPTIONS_ENV}: {name}={value} is refused in AReaL: {why}")
    if _cfg(config, "enable_tree_training", False):
        raise ValueError("enable_tree_training: gbc's AReaL engine computes the log-probs of "
                         "AReaL's packed rows; tree training's trie-packed logits "
                         "(gather_packed_tree_*) are not supported (set it to false, or leave "
                         "gbc off)")
    if _cfg(config, "is_critic", False):
        raise ValueError("is_critic: gbc's AReaL engine is the actor's (and the reference's); "
                         "the critic has no lm_head")
    if options.ar_alpha:
        level = _cfg(config, "importance_sampling_level", "token")
        if level != "token":
            raise ValueError(f"{OPTIONS_ENV}: ar_alpha={options.ar_alpha} with "
                             f"importance_sampling_level={level!r}: AReaL's sequence-level "
                             "losses replace each token's advantage by its sequence's mean, "
                             "so AR's per-token weight would be averaged away (use "
                             "importance_sampling_level='token')")
        if _cfg(config, "use_decoupled_loss", False) and \
                _cfg(config, "prox_logp_method", "recompute") == "loglinear":
            raise ValueError(f"{OPTIONS_ENV}: ar_alpha={options.ar_alpha} with "
                             "prox_logp_method='loglinear': the proximal policy is then "
                             "interpolated from the current one inside the loss, so AR's "
                             "p_old is not fixed before the update (use 'recompute')")


def check_engine(engine) -> None:
    """Refuse the parallel layouts gbc's head does not run in (called at ``initialize``, when
    AReaL's process groups exist): tensor parallelism (a vocabulary-sharded lm_head)."""
    tp = getattr(getattr(engine, "parallel_helper", None), "tp_size", 1)
    if tp > 1:
        raise ValueError(f"backend: tensor parallelism (tp={tp}) shards AReaL's lm_head over "
                         "the vocabulary (a DTensor with Shard(0)); gbc's AReaL engine runs "
                         "with data and Ulysses sequence parallelism only (fsdp:dNcM)")
    check_options(engine.config, getattr(engine, "gbc_options", methods.MethodOptions()))


def method_loss_fn(loss_fn, options: methods.MethodOptions):
    """AReaL's ``loss_fn(logprobs, entropy, input_data, **kw)`` with the method options applied
    to ``input_data["advantages"]`` (AR: times ``alpha exp(prox_logp) + 1 - alpha``); the same
    function when no method acts on the advantages."""
    if not options.ar_alpha:
        return loss_fn

    @functools.wraps(loss_fn)
    def with_methods(logprobs, entropy, input_data, **kwargs):
        if "advantages" not in input_data:
            return loss_fn(logprobs, entropy, input_data, **kwargs)
        base = input_data.get("prox_logp")
        if base is None:
            raise ValueError(f"{OPTIONS_ENV}: ar_alpha needs the proximal log-probs "
                             "(prox_logp) in AReaL's batch; it has none")
        data = dict(input_data)
        data["advantages"] = methods.loss_advantages(input_data["advantages"],
                                                     base.float(), options)
        return loss_fn(logprobs, entropy, data, **kwargs)

    return with_methods
