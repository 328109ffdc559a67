"""gbc inside verl's FSDP actor engine (verl 0.9.1): the loss and the log-prob passes from the
hidden states, without the ``[N, V]`` logits (docs/math.md §12, "verl's engine").

verl's engine workers run every actor and reference pass through
``FSDPEngineWithLMHead.forward_step``: the model's forward builds the logits of every packed
token, then verl's ``ppo_loss`` reads log-probs (and entropy) from them. The engine here keeps
everything of verl's step — its inputs (``prepare_model_inputs``: packed sequences or padding,
per-sample temperature), FSDP / FSDP2 and its hooks, autocast, gradient accumulation over
micro-batches, ``global_batch_info`` — and replaces only what the lm_head does during that one
forward:

* training micro-batch (``loss_function`` is verl's ``ppo_loss``): the hidden rows that predict
  response tokens go through :func:`gbc_kernels.fused_linear_policy_loss`, with the actor config
  mapped by :func:`gbc_kernels.integrations.verl.policy_loss_config` (every verl loss mode, KL
  and entropy terms) and the gbc options on top; three matmuls per chunk, no logits. verl's
  metrics come from verl's own ``ppo_loss`` run on gbc's per-token log-probs and entropy
  (detached), so they are verl's by construction.
* forward-only passes (``compute_log_prob`` for the old policy, the reference): log-probs (and
  entropy, ``sum_pi_squared`` when asked) of the response tokens from
  :func:`gbc_kernels.fused_linear_logprobs`; prompt positions hold 0 (verl reads the response
  part only, through ``no_padding_2_padding``).
* Lopti: ``train_batch`` runs its two updates (two forward/backward sweeps, two optimizer
  steps) on each mini-batch.

Anything else (SFT or distillation losses, the value model) runs verl's own step.

Switch it on in every Ray worker with one line of the launch command::

    +ray_kwargs.ray_init.runtime_env.env_vars.GBC_VERL_ENGINE=1

(installing gbc registers :mod:`gbc_kernels.integrations.verl_plugin` as a ``verl.plugins`` entry
point, which verl imports in every process; with the variable set it calls :func:`enable`).
gbc options come in the same way, ``GBC_VERL_OPTIONS=ar_alpha=0.3,lopti_eta=0.5``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Optional

import torch

import gbc_kernels as gbc
from gbc_kernels.integrations import hf
from gbc_kernels.integrations import verl as gv

ENV_ON = "GBC_VERL_ENGINE"
ENV_OPTIONS = "GBC_VERL_OPTIONS"

# the gbc options the engine takes on top of verl's config (everything else is verl's)
OPTION_TYPES = {"ar_alpha": float, "lopti_eta": float, "lopti_order": str, "backend": str}
LOPTI_ORDERS = ("low-first", "high-first")


@dataclasses.dataclass
class EngineOptions:
    """gbc's options in verl's engine (read from ``GBC_VERL_OPTIONS`` by :func:`enable`)."""

    ar_alpha: float = 0.0
    lopti_eta: Optional[float] = None
    lopti_order: str = "low-first"
    backend: str = "auto"

    def __post_init__(self):
        gbc.PolicyLossConfig(ar_alpha=self.ar_alpha, lopti_eta=self.lopti_eta)   # validates
        if self.lopti_order not in LOPTI_ORDERS:
            raise ValueError(f"lopti_order: expected one of {LOPTI_ORDERS}, got "
                             f"{self.lopti_order!r}")
        from gbc_kernels import _validate
        _validate.check_backend(self.backend)

    @classmethod
    def parse(cls, text: Optional[str]) -> "EngineOptions":
        """``"ar_alpha=0.3,lopti_eta=0.5"`` (the form a Ray env var carries) -> options."""
        kw = {}
        for item in (text or "").split(","):
            item = item.strip()
            if not item:
                continue
            if "=" not in item:
                raise ValueError(f"{ENV_OPTIONS}: expected name=value items separated by ',', "
                                 f"got {item!r}")
            name, value = (x.strip() for x in item.split("=", 1))
            if name not in OPTION_TYPES:
                raise ValueError(f"{ENV_OPTIONS}: unknown option {name!r} (expected one of "
                                 f"{sorted(OPTION_TYPES)})")
            try:
                kw[name] = OPTION_TYPES[name](value)
            except ValueError:
                raise ValueError(f"{ENV_OPTIONS}: {name} expects a "
                                 f"{OPTION_TYPES[name].__name__}, got {value!r}") from None
        return cls(**kw)


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
        self.T = T
        if use_remove_padding:
            self.hidden = self.packed
        else:       # verl pads every sequence to the micro-batch's longest one
            L = int(self.offsets.diff().max())
            t = torch.arange(T, device=plens.device)
            pos = plens[:, None] - 1 + t[None]
            b = torch.arange(plens.shape[0], device=plens.device)[:, None]
            self.hidden = torch.where(self.valid, b * L + pos, torch.zeros_like(pos))
        # the token each row predicts: the next packed token (verl's input_ids_rmpad_rolled)
        self.targets = ids.values()[torch.where(self.valid, self.packed + 1,
                                                torch.zeros_like(self.packed))]

    def nested(self, values: torch.Tensor) -> torch.Tensor:
        """``values [B, T]`` at the response positions of verl's packed layout, 0 elsewhere, as
        the nested tensor verl's ``prepare_model_outputs`` returns."""
        flat = torch.zeros(self.nnz, dtype=values.dtype, device=values.device)
        flat[self.packed[self.valid]] = values[self.valid]
        return torch.nested.nested_tensor_from_jagged(flat, self.offsets)


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


def _set_rng_state(state):
    torch.set_rng_state(state[0])
    for device, s in state[1].items():
        torch.cuda.set_rng_state(s, device)


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


class GBCEngineMixin:
    """The gbc forward step on top of one of verl's FSDP engines with an lm_head."""

    gbc_options: EngineOptions = EngineOptions()
    _gbc_phase: Optional[str] = None

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
        inner = hf._unwrap(self.module)
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
        actor_config = loss_function.keywords["config"]
        opts = self.gbc_options
        token_out = {}
        rng = _rng_state()          # verl's metrics draw (Clip-Cov) from the loss's state

        def head_fn(hidden2d, rows, inner):
            h, head = self._head_rows(hidden2d, rows, inner)
            fields = ["response_mask", "old_log_probs", "advantages"] + [
                k for k in ("rollout_is_weights", "ref_log_prob") if k in micro_batch]
            data = micro_batch.select(*fields).to_padded_tensor()
            mask = data["response_mask"].bool() & rows.valid
            cfg = gv.policy_loss_config(actor_config, response_length=mask.shape[1],
                                        ar_alpha=opts.ar_alpha, lopti_eta=opts.lopti_eta)
            if _flag(micro_batch, "calculate_entropy") and not cfg.wants_entropy:
                cfg = dataclasses.replace(cfg, return_entropy=True)
            info = {k: _flag(micro_batch, k, None) for k in
                    ("dp_size", "batch_num_tokens", "global_batch_size")}
            norms = gv.batch_normalisers(actor_config, mask, info)
            with torch.autocast(device_type=h.device.type, enabled=False):
                loss, metrics = gbc.fused_linear_policy_loss(
                    h, head.weight, rows.targets, mask, data["advantages"],
                    old_logp=data["old_log_probs"],
                    ref_logp=data["ref_log_prob"] if cfg.kl_coef else None, bias=head.bias,
                    config=cfg, phase=self._gbc_phase,
                    is_ratio=data.get("rollout_is_weights", None),
                    temperature=_temperature(micro_batch), backend=opts.backend,
                    token_out=token_out, **norms)
            return loss, metrics, cfg

        micro_batch, rows, (loss, gbc_metrics, cfg), zero = self._gbc_forward(micro_batch,
                                                                              head_fn)
        loss = loss + zero
        model_output = {"log_probs": rows.nested(token_out["logp"])}
        if "entropy" in token_out:
            model_output["entropy"] = rows.nested(token_out["entropy"])
        metrics = self._verl_metrics(loss_function, micro_batch, model_output, rng)
        for name in ("ar_weight_mean", "low_frac", "cov_frac", "grad_share_low"):
            if name in gbc_metrics:
                metrics[f"actor/gbc_{name}"] = float(gbc_metrics[name])
        return loss, {"model_output": model_output, "loss": loss.detach().item(),
                      "metrics": metrics}

    def _verl_metrics(self, loss_function, micro_batch, model_output, rng):
        """verl's own ``ppo_loss`` on gbc's detached per-token values: its metrics, exactly as
        its step would log them. Its random draws (Clip-Cov's) start from ``rng``, the state
        gbc's loss drew from, and do not advance the generator."""
        with torch.no_grad(), torch.random.fork_rng(devices=list(rng[1])):
            _set_rng_state(rng)
            _, metrics = loss_function(model_output=model_output, data=micro_batch,
                                       dp_group=self.get_data_parallel_group())
        return metrics

    # -- forward only: log-probs, entropy, sum of squared probabilities ---------------------
    def _gbc_infer_step(self, micro_batch):
        want_entropy = bool(_flag(micro_batch, "calculate_entropy"))
        want_p2 = bool(_flag(micro_batch, "calculate_sum_pi_squared"))

        def head_fn(hidden2d, rows, inner):
            h, head = self._head_rows(hidden2d, rows, inner)
            # padding positions read row 0 with target 0: computed, then dropped by nested()
            with torch.autocast(device_type=h.device.type, enabled=False):
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
        return torch.tensor(1.0), {"model_output": model_output, "loss": 1.0, "metrics": {}}

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

    def train_batch(self, data, loss_function):
        opts = self.gbc_options
        if opts.lopti_eta is None or not _is_ppo_loss(loss_function):
            return super().train_batch(data, loss_function)
        # Lopti: two updates of the mini-batch, low-probability tokens first (by default)
        from verl.workers.engine import base as verl_base
        verl_base.maybe_fix_3d_position_ids(data)
        phases = ("low", "high") if opts.lopti_order == "low-first" else ("high", "low")
        outputs = []
        try:
            for phase in phases:
                self._gbc_phase = phase
                self.optimizer_zero_grad()
                out = self.forward_backward_batch(data, loss_function, forward_only=False)
                outputs.append((out, self.optimizer_step()))
        finally:
            self._gbc_phase = None
        (first, gn1), (_, gn2) = outputs
        if self.is_mp_src_rank_with_outputs():
            first["metrics"]["grad_norm"] = gn1
            first["metrics"]["gbc_grad_norm_second_phase"] = gn2
        return first


def engine_class(base):
    """gbc's engine on top of verl's engine class ``base`` (an ``FSDPEngineWithLMHead``)."""
    return type(f"GBC{base.__name__}", (GBCEngineMixin, base), {"__module__": __name__})


_ENABLED = {}


def enable(options: Optional[EngineOptions] = None):
    """Make verl's engine registry hand out gbc's engine for ``language_model`` on the FSDP
    and FSDP2 backends (every device verl registered them for). Idempotent; returns the
    options in force."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if options is None:
        options = EngineOptions.parse(os.environ.get(ENV_OPTIONS))
    table = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        for key, cls in list(table.get(backend, {}).items()):
            if issubclass(cls, GBCEngineMixin):
                cls.gbc_options = options
                continue
            if not issubclass(cls, FSDPEngineWithLMHead):
                continue
            sub = _ENABLED.get(cls) or engine_class(cls)
            sub.gbc_options = options
            _ENABLED[cls] = sub
            table[backend][key] = sub
    return options


def disable():
    """Put verl's own engine classes back in its registry."""
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.get("language_model", {})
    originals = {sub: base for base, sub in _ENABLED.items()}
    for backend in ("fsdp", "fsdp2"):
        for key, cls in list(table.get(backend, {}).items()):
            if cls in originals:
                table[backend][key] = originals[cls]
