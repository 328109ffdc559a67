"""Host synchronisations of one training step of the fused loss: at most 2 (forward + backward),
and on the CUDA route exactly 1.

On a GPU every read of a device value by the host (``.item()``, ``bool(t)``, ``.tolist()``,
``nonzero()`` and the other data-dependent shapes, ``.cpu()``) stalls the CPU until the GPU has
drained its queue: the GPU then idles while Python prepares the next launches. The forward makes
one: the row count (the value checks' flags travel with it). The backward's test of the
upstream gradient against 1 is a host comparison on CPU (free there) and a device-side test on
CUDA (``scale_unless_one_kernel``), so a CUDA step has one sync. This test counts them on CPU
tensors, where the same calls happen: the aten operators that read device values, seen by a
TorchDispatchMode, plus the Tensor methods that copy to the host without one (``tolist``,
``cpu``, ``numpy``); the CUDA route's backward is run on CPU tensors through the Triton
interpreter. benchmarks/profile_gpu.py counts them on a GPU with PyTorch's own sync debug mode.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gbc_kernels as gbc
from conftest import leaves, make_batch

# aten operators whose result depends on device values read by the host
SYNCING = {"_local_scalar_dense", "nonzero", "unique_consecutive", "_unique2", "unique_dim",
           "masked_select", "repeat_interleave", "is_nonzero", "equal", "allclose"}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count_syncs(monkeypatch):
    counter = SyncCounter()

    def wrap(method):
        orig = getattr(torch.Tensor, method)

        def counted(self, *a, **k):
            counter.seen.append(method)
            return orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, method, counted)
    for method in ("tolist", "cpu", "numpy"):
        wrap(method)
    return counter


def step(batch, cfg, backend, upstream=None):
    loss, metrics = gbc.fused_linear_policy_loss(
        batch["hidden"], batch["weight"], batch["targets"], batch["mask"], batch["advantages"],
        batch["old_logp"], batch["ref_logp"], bias=batch["bias"],
        kl_weight=batch.get("kl_weight"), config=cfg, backend=backend)
    if upstream is None:
        loss.backward()
    else:
        (loss * upstream).backward()
    return metrics


BACKENDS = ["torch"] + (["cpu"] if gbc.backends.cpu_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("cfg", [
    dict(kl_coef=0.04),
    dict(kl_coef=0.04, loss_agg="seq-mean-token-mean", ar_alpha=0.3, entropy_coef=0.01),
    dict(kl_coef=0.0, epsilon_high=0.28, loss_agg="seq-mean-token-sum-norm", clip_ratio_c=3.0,
         max_len=20),
], ids=["ppo_k3", "ar_klweight_entropy", "dapo_dual"])
def test_fused_step_syncs_at_most_twice(count_syncs, backend, padded, cfg):
    batch = make_batch(B=3, T=20, H=16, V=101, seed=5, empty_row=padded)
    batch.update(leaves(batch))
    if cfg.get("ar_alpha"):                 # critical-token KL weights and token scales given
        batch["kl_weight"] = torch.rand(3, 20)
    if not padded:
        batch["mask"] = torch.ones_like(batch["mask"])
    cfg = gbc.PolicyLossConfig(**cfg)
    step(batch, cfg, backend)                       # warm-up (lazy imports, extension load)
    for leaf in (batch["hidden"], batch["weight"]):
        leaf.grad = None
    count_syncs.seen.clear()
    with count_syncs:
        metrics = step(batch, cfg, backend, upstream=torch.tensor(0.5))
    assert len(count_syncs.seen) <= 2, count_syncs.seen
    assert count_syncs.seen.count("tolist") == 1, count_syncs.seen   # the forward's transfer
    # the step computed something (the count is not that of a no-op)
    assert batch["hidden"].grad is not None and batch["hidden"].grad.abs().sum() > 0
    assert torch.isfinite(metrics["ratio_mean"])


def test_counter_sees_syncs(count_syncs):
    """The counter is not blind: each kind of host read is counted."""
    t = torch.arange(6.0)
    with count_syncs:
        float(t.sum())
        t.nonzero()
        t.tolist()
        bool(t.any())
        t[t > 2]
    assert count_syncs.seen.count("_local_scalar_dense") == 2
    assert "nonzero" in count_syncs.seen and "tolist" in count_syncs.seen


def test_bad_value_still_named_without_extra_sync():
    """Deferred checks still fail before any kernel, naming the argument and the index."""
    batch = make_batch(B=2, T=6, H=8, V=37, seed=1, empty_row=False)
    batch["mask"][:] = True
    batch["old_logp"][1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"old_logp: expected finite values.*\[1, 2\]"):
        step(batch, gbc.PolicyLossConfig(), "torch")
    batch = make_batch(B=2, T=6, H=8, V=37, seed=1, empty_row=False)
    batch["mask"][:] = True
    batch["targets"][0, 3] = 37
    with pytest.raises(ValueError, match=r"targets: expected token ids in \[0, 37\).*\[0, 3\]"):
        step(batch, gbc.PolicyLossConfig(), "torch")


@pytest.mark.skipif(not gbc.backends.triton_usable(torch.device("cpu")),
                    reason="needs triton (its interpreter runs the scale kernel on CPU tensors)")
@pytest.mark.parametrize("upstream", [None, 0.5], ids=["unit", "scaled"])
def test_gpu_route_backward_has_no_sync(count_syncs, monkeypatch, upstream):
    """On CUDA the backward tests the upstream gradient on the device: the step's only host
    transfer is the forward's. Simulated here by sending CPU tensors down the CUDA route (the
    Triton scale kernel, run by the interpreter)."""
    from gbc_kernels import _fused
    monkeypatch.setattr(_fused, "_scale_on_device", lambda t: True)
    batch = make_batch(B=2, T=12, H=16, V=101, seed=3, empty_row=True)
    batch.update(leaves(batch))
    cfg = gbc.PolicyLossConfig(kl_coef=0.04)
    step(batch, cfg, "torch")                       # warm-up: the kernel is traced once
    ref = [leaf.grad.clone() for leaf in (batch["hidden"], batch["weight"])]
    for leaf in (batch["hidden"], batch["weight"]):
        leaf.grad = None
    count_syncs.seen.clear()
    with count_syncs:
        step(batch, cfg, "torch", None if upstream is None else torch.tensor(upstream))
    assert count_syncs.seen == ["tolist"], count_syncs.seen
    scale = 1.0 if upstream is None else upstream
    for leaf, r in zip((batch["hidden"], batch["weight"]), ref):
        torch.testing.assert_close(leaf.grad, r * scale, rtol=1e-6, atol=0)


@pytest.mark.skipif(not gbc.backends.triton_usable(torch.device("cpu")),
                    reason="needs triton (its interpreter runs the kernel on CPU tensors)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1.0, 0.37, -2.5])
def test_scale_unless_one_kernel(monkeypatch, dtype, g):
    """x *= g in place, over a grid-stride loop (2 programs, 4 blocks and a ragged tail); g == 1
    leaves every bit as it was."""
    from gbc_kernels.triton import launch
    monkeypatch.setattr(launch, "SCALE_PROGRAMS", 2)
    n = 3 * launch.SCALE_BLOCK + 37
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    x[5] = float("inf")
    before = x.clone()
    out = launch.launch_scale_unless_one_(x, torch.tensor(g, dtype=torch.float64))
    assert out.data_ptr() == x.data_ptr()
    if g == 1.0:
        assert torch.equal(x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           before.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    else:
        # float32 arithmetic, one rounding to the storage dtype (bf16: within one unit in the
        # last place, as Triton's interpreter may round toward zero where a GPU rounds to even)
        want = (before.float() * torch.tensor(g, dtype=torch.float32)).to(dtype)
        torch.testing.assert_close(x, want, rtol=2 ** -7 if dtype == torch.bfloat16 else 0,
                                   atol=0)
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        launch.launch_scale_unless_one_(torch.zeros(4, 4).t(), torch.tensor(2.0))
