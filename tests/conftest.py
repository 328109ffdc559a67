"""Shared fixtures and helpers: backends under test, input factories, NaN poisoning."""

from __future__ import annotations

import io
import os
import queue
import socket
import sys

import pytest
import torch
import torch.utils._python_dispatch

# No GPU: the Triton kernels run under the interpreter on CPU tensors. Must be set before
# triton compiles anything (gbc_kernels imports triton lazily, on first use; importing torch
# does not import triton). With a GPU the kernels compile for it (tests/test_gpu.py).
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
import torch.distributed as dist
import torch.multiprocessing as mp


def available_backends():
    """Backends this machine can run: torch always; cpu when the extension is built; triton on
    CPU tensors when the interpreter is on (TRITON_INTERPRET=1) or on CUDA."""
    from gbc_kernels.backends import cpu_available, triton_usable

    out = ["torch"]
    if cpu_available():
        out.append("cpu")
    if triton_usable(torch.device("cpu")):
        out.append("triton")
    return out


BACKENDS = available_backends()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(autouse=True)
def no_leftover_standins():
    """SkyRL's tests put stand-ins for modules this machine lacks (``torchdata``, ``httpx``,
    megatron-bridge's names) into ``sys.modules``; none outlives its test."""
    yield
    standins = sys.modules.get("skyrl_cpu")
    if standins is not None:
        standins.remove_entrypoint_standins()
    bridge = sys.modules.get("megatron_bridge_cpu")
    if bridge is not None:
        bridge.remove()


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Fill every fresh torch.empty / empty_like float tensor with NaN (ints with a huge value),
    so that memory a kernel forgot to write poisons the result."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int64, torch.int32):
            t.fill_(2 ** 30)
        return t

    def empty(*args, **kwargs):
        return poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poison(real_empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield


@pytest.fixture
def small_chunks(monkeypatch):
    """A tiny chunk budget so that several chunks (and a ragged last one) are exercised."""
    monkeypatch.setenv("GBC_CHUNK_MB", "0.002")


def make_batch(B=4, T=9, H=16, V=37, dtype=torch.float32, seed=0, bias=True, mask_p=0.7,
               empty_row=True, adv_shape="B", logit_scale=1.0, old_spread=1.5):
    """Random GRPO batch. old_logp/ref_logp near the current policy so ratios straddle the clip
    range and p_old spans both Lopti groups."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (logit_scale / H ** 0.5)
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5 if bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < mask_p
    if empty_row and B > 1:
        mask[1] = False
        targets[1, :2] = -100          # padding ids on masked-out positions are legal
    with torch.no_grad():
        z = hidden @ weight.T + (0 if b is None else b)
        logp = torch.log_softmax(z, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    # log-probabilities: perturbed, still <= 0
    old = (logp + old_spread * 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
    refl = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn((B,) if adv_shape == "B" else (B, T), generator=g, dtype=torch.float64)
    if adv_shape == "B":   # both signs present: rows alternate +, -, +, ...
        adv = adv.abs() * torch.tensor([1.0, -1.0] * B, dtype=torch.float64)[:B]
    d = dict(hidden=hidden.to(dtype), weight=weight.to(dtype),
             bias=None if b is None else b.to(dtype), targets=targets, mask=mask,
             advantages=adv.float(), old_logp=old.float(), ref_logp=refl.float())
    return d


def leaves(batch, bias=True):
    """Fresh leaf copies of the differentiable inputs."""
    out = {k: batch[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight")}
    if bias and batch.get("bias") is not None:
        out["bias"] = batch["bias"].detach().clone().requires_grad_(True)
    return out


def as64(batch):
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in batch.items()}


def max_rel_err(a, b):
    """max |a - b| / max(|b|max, tiny): a scale-aware error for whole tensors."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def tiny_hf_model(path, tie_word_embeddings=True):
    """A tiny Qwen2 and a word-level tokenizer built in code, saved like a real checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ("a very special island is inhabited only by knights and knaves always tell the "
             "truth lie you meet inhabitants commented if then or not who knight knave answer "
             ", . : \" ' is a and").split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>"] + sorted(set(words)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<eos>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, pad_token_id=0, eos_token_id=2,
                      tie_word_embeddings=tie_word_embeddings)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


# ---- multi-process runs (gloo, CPU) ------------------------------------------------------

class VocabWatcher(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every op output whose last dimension is the vocabulary (the tests
    that no ``[N, V]`` logits are formed)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.seen = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.seen.append(tuple(t.shape))
        return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# how long a spawned run may take in all: generous, since a shared CI machine can be many
# times slower than an idle one (a rank that dies fails the run at once, whatever this is)
SPAWN_TIMEOUT_S = float(os.environ.get("GBC_TEST_SPAWN_TIMEOUT", "3600"))


# The ranks' start method. A spawned rank is a fresh interpreter that imports torch,
# transformers' model code, and the trainer (verl, megatron-core) again: 5-10 s per run, most of
# a short test. A forkserver imports them once (the preload below) and forks every rank from it,
# so each rank starts with them imported, in a process that has run nothing else (no threads, no
# process group, no test's patches: the same clean start as a spawned one). The rank takes the
# test's environment as it is at the call (a spawned one inherits it; a forked one would have
# the forkserver's).
# GBC_TEST_START_METHOD=spawn restores spawning.
_START_METHOD = os.environ.get("GBC_TEST_START_METHOD", "forkserver")
_PRELOAD = ("torch", "torch.distributed", "transformers",
            "transformers.models.qwen2.modeling_qwen2", "gbc_kernels", "gbc_reference",
            "verl", "megatron.core")


def _spawn_context():
    ctx = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        import importlib.util

        ctx.set_forkserver_preload([m for m in _PRELOAD
                                    if importlib.util.find_spec(m.split(".")[0]) is not None])
    return ctx


def spawn_gloo(world, target, *args):
    """Run ``target(rank, world, *args)`` in ``world`` spawned processes joined in a gloo
    process group; return each rank's return value, by rank. ``target`` must be a module-level
    function of a test module (the children import it).

    The ranks meet through a file in a fresh temporary folder, not a TCP port: a port picked
    free here can be taken by another test run on the machine before the ranks bind it (and
    two runs' ranks could then join one group). A rank that dies fails the run at once; a live
    one is waited for up to ``GBC_TEST_SPAWN_TIMEOUT`` seconds (default 3600)."""
    import tempfile
    import time

    ctx = _spawn_context()
    q = ctx.Queue()
    folder = tempfile.mkdtemp(prefix="gbc_gloo_")
    store, port = os.path.join(folder, "store"), _free_port()
    env = dict(os.environ)        # a forked rank has the forkserver's environment: give it ours
    procs = [ctx.Process(target=_init_and_run, args=(r, world, port, store, target, args, q, env))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + SPAWN_TIMEOUT_S
        while len(got) < world and time.monotonic() < deadline:
            try:
                got.update([q.get(timeout=1)])
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"spawn_gloo: a rank exited with code {dead[0]} before "
                                       "returning (its traceback is above)")
        assert len(got) == world, (f"spawn_gloo: {world - len(got)} rank(s) returned nothing in "
                                   f"{SPAWN_TIMEOUT_S:.0f} s")
        for p in procs:               # each has returned: its exit is only teardown
            p.join(timeout=max(60.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"spawn_gloo: a rank exited with {p.exitcode} after returning"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
    return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world)]


def _init_and_run(rank, world, port, store, target, args, q, env):
    os.environ.clear()
    os.environ.update(env)
    # MASTER_ADDR / MASTER_PORT for code under test that reads them; the group meets by file
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)      # a forked rank imported torch before OMP_NUM_THREADS was set
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        buf = io.BytesIO()        # plain bytes: no shared-memory handles outliving the process
        torch.save(target(rank, world, *args), buf)
        q.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def megatron_cpu():
    """tests/standins/megatron_cpu.py (megatron-core's CPU shims), loaded by path: the standins
    folder also holds a flash-attn stand-in that verl's padding helpers must not find, so it
    never goes on ``sys.path``."""
    return _standin("megatron_cpu")


def megatron_bridge_cpu():
    """tests/standins/megatron_bridge_cpu.py (megatron-bridge's names for SkyRL's Megatron
    worker module), loaded by path as :func:`megatron_cpu`."""
    return _standin("megatron_bridge_cpu")


def _standin(name):
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "standins",
                               f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


class logits_dtypes_seen:
    """``with logits_dtypes_seen() as seen:`` — the ``logits_dtype`` of every chunk sweep gbc
    runs in the block (its loss, log-prob, statistics and NTHR-LSE sweeps all size their chunk
    buffer by ``_fused._chunk_buffer``), in order. The enumeration tests use it to show that a
    trainer's ``logits_dtype`` option reaches every pass (with float32 test models the mode
    changes no number, so a parameter difference cannot show it)."""

    def __enter__(self):
        from gbc_kernels import _fused

        self._mod, self._real, self.seen = _fused, _fused._chunk_buffer, []

        def spy(*args, **kwargs):
            self.seen.append(kwargs["logits_dtype"] if "logits_dtype" in kwargs
                             else (args[6] if len(args) > 6 else None))
            return self._real(*args, **kwargs)

        _fused._chunk_buffer = spy
        return self.seen

    def __exit__(self, *exc):
        self._mod._chunk_buffer = self._real
        return False


def assert_logits_mode_reached(seen_default, seen_float32, at_least=1):
    """Every sweep of the default run had ``logits_dtype=None`` and every sweep of the float32
    run ``torch.float32``, both with at least ``at_least`` sweeps (the same passes ran)."""
    assert len(seen_default) >= at_least and len(seen_float32) >= at_least, \
        (seen_default, seen_float32)
    assert set(seen_default) == {None}, seen_default
    assert set(seen_float32) == {torch.float32}, seen_float32
