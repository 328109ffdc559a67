"""megatron-core 0.16.1 on CPU, gloo ranks: the test-only shims and a tiny ``GPTModel``.

megatron-core assumes CUDA in a few places that a CPU run reaches; these shims (installed in a
test's child process only, never by the library) let its own code run there:

* ``torch.cuda.current_device`` returns the CPU device (megatron allocates on it in its
  tensor-parallel mappings, attention buffers and RoPE);
* the RNG tracker's ``fork`` is a null context (``model_parallel_cuda_manual_seed`` needs CUDA;
  every dropout is 0, so no random stream is used);
* sequence parallelism with torch's norms: ``WrappedTorchNorm`` without its assert against
  sequence parallelism; a sequence-parallel norm's parameters see only this rank's tokens, so
  :func:`allreduce_sp_norm_grads` sums their gradients over the tensor-parallel group (what
  megatron's ``finalize_model_grads`` does for parameters marked ``sequence_parallel``).

* ``torch.cuda.synchronize`` is a no-op: megatron's pipeline point-to-point communication calls
  it after ``batch_isend_irecv`` (a guard for NCCL); gloo's ``isend``/``irecv`` run the
  pipeline schedules on the CPU as they are.

The causal mask is passed explicitly (:func:`causal_mask`): megatron's default one is built
with ``device="cuda"``.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist


def install_shims():
    """Make megatron-core's CUDA assumptions point at the CPU (this process only)."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.transformer import torch_norm

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[
            config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def init_parallel(tp: int, seed: int = 0, pp: int = 1, vpp=None, cp: int = 1):
    """megatron's process groups over the running gloo world: tensor parallel ``tp``, pipeline
    parallel ``pp`` (``vpp`` virtual stages per rank), the rest data parallel."""
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore", category=UserWarning)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             context_parallel_size=cp)
    torch.manual_seed(seed)


def packed_core_attention():
    """megatron's local ``DotProductAttention`` that also takes packed (``thd``) sequences, on
    ``scaled_dot_product_attention``: the ``[t, heads, dim]`` query, key and value of
    ``PackedSeqParams``' sequences (offsets ``cu_seqlens_q_padded``, else ``cu_seqlens_q``),
    each sequence attending causally to its own tokens only (what TE's fused attention does
    for verl's packed batches; megatron's local attention refuses ``packed_seq_params``).
    Unpacked calls go to megatron's own code."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def __init__(self, config, *args, **kwargs):    # megatron's own refuses CP > 1
            import copy

            one = copy.copy(config)
            one.context_parallel_size = 1
            super().__init__(one, *args, **kwargs)
            self.config = config

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias, packed_seq_params)
            p = packed_seq_params
            if p.qkv_format != "thd":
                raise ValueError(f"packed_seq_params.qkv_format: expected 'thd', got {p.qkv_format}")
            cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
            if cu is None:
                raise ValueError("packed_seq_params: a packed batch needs its cu_seqlens_q")
            cu = cu.to("cpu").long()
            group = p.cp_group
            if group is None:
                from megatron.core import parallel_state
                group = parallel_state.get_context_parallel_group()
            cp, r = dist.get_world_size(group), dist.get_rank(group)
            seg, pos = _cp_positions(cu, cp, r)
            if cp > 1:                      # every rank's K/V with its tokens' positions
                key = _GatherCP.apply(key.contiguous(), group)
                value = _GatherCP.apply(value.contiguous(), group)
                kseg, kpos = map(torch.cat, zip(*[_cp_positions(cu, cp, s) for s in range(cp)]))
            else:
                kseg, kpos = seg, pos
            t = query.shape[0]
            allowed = (seg[:, None] == kseg[None, :]) & (kpos[None, :] <= pos[:, None])
            rep = query.shape[1] // key.shape[1]           # grouped-query heads
            k = key.repeat_interleave(rep, dim=1)
            v = value.repeat_interleave(rep, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=allowed, scale=self.softmax_scale)        # [heads, t, dim]
            return out.transpose(0, 1).reshape(t, -1)

    return PackedDotProductAttention


class _GatherCP(torch.autograd.Function):
    """The ranks' tensors concatenated (gloo ``all_gather``); backward: the gradient summed
    over the ranks (``all_reduce``), this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * ctx.n:(r + 1) * ctx.n], None


def _cp_positions(cu, cp, rank):
    """(sequence, position in it) of each packed token context-parallel rank ``rank`` holds:
    sequence ``i`` (padded length ``cu[i+1] - cu[i]``, offsets ``cu`` of the whole batch) in
    ``2·cp`` chunks, the rank holding chunks ``rank`` and ``2·cp - 1 - rank`` (megatron's
    load-balanced layout; the whole sequence at ``cp`` 1)."""
    seg, pos = [], []
    for i in range(cu.numel() - 1):
        n = int(cu[i + 1] - cu[i])
        c = n // (2 * cp)
        idx = (torch.arange(n) if cp == 1 else
               torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]))
        seg.append(torch.full_like(idx, i))
        pos.append(idx)
    return torch.cat(seg), torch.cat(pos)


def tiny_gpt(vocab, hidden=32, layers=2, heads=4, seq=16, tp=1, sp=False, seed=0,
             position="learned_absolute", dtype=torch.float32, tied=False, vp_stage=None,
             core_attention=None):
    """A tiny ``GPTModel`` from megatron's local layer spec, initialised on the CPU from
    ``seed``: the same full weights for every tensor-parallel size (megatron initialises the
    master weight and splits it). Under pipeline parallelism (:func:`init_parallel`'s ``pp``):
    this rank's stage, ``layers / pp`` of the layers, the embedding on the first stage and the
    output layer on the last; with virtual stages (``vpp``), its chunk ``vp_stage``
    (``layers / (pp · vpp)`` layers). ``variable_seq_lengths`` and the all-to-all
    token dispatcher as verl's engine sets them (the pipeline exchanges each micro-batch's
    shape). ``core_attention``: the layers' core attention module in place of megatron's
    local one (e.g. :func:`packed_core_attention`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()

    cfg = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=2 * hidden, use_cpu_initialization=True, perform_initialization=True,
        params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=sp, bf16=False, fp16=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, init_method_std=0.05,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=dtype, variable_seq_lengths=True,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        moe_token_dispatcher_type="alltoall")
    spec = get_gpt_layer_local_spec()
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    torch.manual_seed(seed)
    model = GPTModel(cfg, spec, vocab_size=vocab,
                     max_sequence_length=seq, position_embedding_type=position,
                     share_embeddings_and_output_weights=tied, parallel_output=True,
                     pre_process=parallel_state.is_pipeline_first_stage(
                         ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                     post_process=parallel_state.is_pipeline_last_stage(
                         ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                     vp_stage=vp_stage)
    return model.to(dtype)


def causal_mask(seq: int) -> torch.Tensor:
    """megatron's causal attention mask (True = masked out), ``[1, 1, S, S]`` on the CPU."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def allreduce_sp_norm_grads(model, group):
    """Sum the gradients of sequence-parallel parameters over the tensor-parallel group."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


@contextlib.contextmanager
def capture_head_input(model):
    """Record the hidden states the model's output layer receives (``[S, B, H]``, or this
    rank's ``[S/tp, B, H]`` under sequence parallelism) without changing the forward."""
    seen = []
    handle = model.output_layer.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(args[0]), with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()
