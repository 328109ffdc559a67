"""NTHR from OpenRLHF 0.11.2's own actor pass: the experience maker's no-grad ``Actor.forward``
(the pass that gives ``action_log_probs``) keeps NTHR's inputs, and ``nthr_pass`` scores the
replay buffer from them with no actor forward. Against today's pass (``nthr_pass``'s own
forward over the buffer, used where nothing was kept): the same log-probs, scales and update,
padded and packed, on one process and with groups split over two data-parallel ranks.

The flow is OpenRLHF's: samples as its samples generator makes them (one unpadded sequence
each, ``action_mask`` over ``sequences[1:]``), its ``Experience.concat_experiences`` into the
experience maker's micro-batches (``rollout.micro_batch_size``, right padding with the pad
id), the patched ``Actor.forward`` as ``PolicyModelActor.forward`` calls it, advantages set,
its ``NaiveReplayBuffer.append``, ``nthr_pass``, then ``training_step`` on the buffer's
micro-batches (``train.micro_batch_size``). A counter on the decoder counts actor forwards.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import test_openrlhf as T_
from test_openrlhf import ORL
from test_openrlhf_packing import _packed_trainer

from gbc_kernels import methods  # noqa: E402
from gbc_kernels.integrations import openrlhf as gorl  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import make_experience_batch  # noqa: E402

PAD = 5                                  # OpenRLHF pads the micro-batches with the pad id
N = 4                                    # rollout.n_samples_per_prompt


def samples(seed=3, count=8):
    """Unpadded samples as OpenRLHF's generator makes them: prompt + response, attention ones,
    ``action_mask`` over ``sequences[1:]`` marking the response; one empty response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        p = int(torch.randint(2, 6, (1,), generator=g))
        r = 0 if i == 2 else int(torch.randint(1, 9, (1,), generator=g))
        seq = torch.randint(6, T_.V, (p + r,), generator=g)
        am = torch.zeros(p + r - 1, dtype=torch.bool)
        am[p - 1:] = True
        out.append(ORL.Experience(sequences=seq[None], attention_mask=torch.ones(1, p + r,
                                  dtype=torch.long), action_mask=am[None], index=[i], info={}))
    return out


# each group mixed: correct (advantage > 0) and incorrect responses
ADV = [1.0, -1.0, -0.5, 0.7, -0.3, 0.4, -0.8, 0.2]


def _count_forwards(actor):
    n = [0]
    actor.model.model.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    return n


def flow(packing, rollout_mb, train_mb, keep, nthr_mb=None, rows=None, strategy=None,
         ring=None):
    """OpenRLHF's experience maker, replay buffer, ``nthr_pass`` and training steps. ``keep``:
    NTHR on during the experience maker's pass (else on only from the buffer's append: its
    pass keeps nothing, as where the old log-probs come from elsewhere); ``nthr_mb``: the
    buffer's micro-batch during ``nthr_pass`` (default ``train_mb``); ``rows``: this rank's
    samples; ``ring``: the ring-attention group (``ds.ring_attn_size`` 2). Returns the pass's
    log-probs, each sample's scales, NTHR's metrics, the forwards
    ``nthr_pass`` ran and the parameters after the steps."""
    args = T_._margs()
    args.rollout.n_samples_per_prompt = N
    t = _packed_trainer(args, packing)
    if strategy is not None:
        t.strategy.ds_device_mesh = strategy
    if ring is not None:
        args.ds = SimpleNamespace(ring_attn_size=2, packing_samples=True, tensor_parallel_size=1)
        t.strategy.ring_attn_group, t.strategy.accumulated_gradient = ring, 1
    forwards = _count_forwards(t.actor)
    gorl.disable()
    T_._enable(nthr_beta=0.0, **({"nthr": True} if keep else {}))
    every = samples()
    mine = [every[i] for i in (rows if rows is not None else range(len(every)))]
    batches = [ORL.Experience.concat_experiences(mine[i:i + rollout_mb], PAD)
               for i in range(0, len(mine), rollout_mb)]
    logps = []
    for exp in batches:                  # PolicyModelActor.forward, one micro-batch a call
        t.actor.eval()
        with torch.no_grad():
            lp = t.actor(exp.sequences, exp.action_mask, exp.attention_mask,
                         ring_attn_group=ring)
        t.actor.train()
        logps.append(lp)
        exp.action_log_probs = lp
        adv = torch.tensor([ADV[i] for i in exp.index])[:, None]
        exp.advantages = adv * exp.action_mask
    if not keep:
        gorl.disable()
        T_._enable(nthr=True, nthr_beta=0.0)
    buf = T_._buffer(batches[0], nthr_mb or train_mb)
    for exp in batches[1:]:
        buf.append(exp)
    t.replay_buffer = buf
    forwards[0] = 0
    metrics = gorl.nthr_pass(t)
    n_forwards = forwards[0]
    scales = [it.info[gorl.SCALE_KEY].clone() for it in buf.items]
    buf.sample_batch_size = train_mb
    for step, i in enumerate(range(0, len(buf.items), train_mb)):
        batch = make_experience_batch(buf.items[i:i + train_mb])
        gorl.training_step(t, batch, 0.05, step,
                           ORL.get_loss_batch_info(None, batch.action_mask))
    gorl.disable()
    return SimpleNamespace(logps=logps, scales=scales, metrics=metrics, forwards=n_forwards,
                           params=T_._params(t.actor.model))


@pytest.fixture
def held():
    """The bytes each ``NTHRBatch`` holds when it is scored."""
    seen, result = [], methods.NTHRBatch.result

    def recorded(self, *args, **kwargs):
        seen.append(self.nbytes())
        return result(self, *args, **kwargs)

    methods.NTHRBatch.result = recorded
    yield seen
    methods.NTHRBatch.result = result
    gorl.disable()


def _same(a, b):
    assert len(a.logps) == len(b.logps)
    for x, y in zip(a.logps, b.logps):
        assert torch.equal(x, y)
    assert len(a.scales) == len(b.scales)
    for x, y in zip(a.scales, b.scales):
        assert torch.equal(x, y)
    for x, y in zip(a.params, b.params):
        assert torch.equal(x, y)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_kept_pass_equals_todays_pass_with_no_forward(packing, held):
    """The experience maker's micro-batches are the training ones (rollout.micro_batch_size =
    train.micro_batch_size): NTHR from the kept pass runs no forward and gives exactly today's
    scales and update; the pass's log-probs are those of the pass that keeps nothing; what is
    kept is less than what today's pass holds."""
    kept = flow(packing, 2, 2, keep=True)
    today = flow(packing, 2, 2, keep=False)
    assert kept.forwards == 0 and today.forwards == 4
    _same(kept, today)
    assert any((s != 1).any() for s in kept.scales)
    assert kept.metrics["gbc/nthr_second_forward"] == 0.0
    assert today.metrics["gbc/nthr_second_forward"] == 1.0
    assert "gbc/nthr_kept_mb" not in today.metrics
    assert kept.metrics["gbc/nthr_selected_frac"] == today.metrics["gbc/nthr_selected_frac"] > 0
    kept_bytes, today_bytes = held
    assert kept.metrics["gbc/nthr_kept_mb"] * 2 ** 20 <= kept_bytes < today_bytes


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_kept_pass_other_micro_batches(packing, held):
    """rollout.micro_batch_size 4, train.micro_batch_size 2: the kept scales are exactly those
    of today's pass run over the experience maker's micro-batches, and the update equals that
    one's; against today's pass over the training micro-batches (other matmul shapes) they
    agree to float rounding."""
    kept = flow(packing, 4, 2, keep=True)
    today = flow(packing, 4, 2, keep=False, nthr_mb=4)
    assert kept.forwards == 0 and today.forwards == 2
    _same(kept, today)
    other = flow(packing, 4, 2, keep=False)
    for x, y in zip(kept.scales, other.scales):
        assert torch.allclose(x, y, atol=1e-5)


def test_unmatched_sample_runs_todays_pass(held):
    """A sample whose pass kept nothing (here: dropped from one sample) makes nthr_pass run its
    own pass over the whole buffer, and say so."""
    args = T_._margs()
    args.rollout.n_samples_per_prompt = N
    t = _packed_trainer(args, False)
    forwards = _count_forwards(t.actor)
    T_._enable(nthr=True, nthr_beta=0.0)
    batches = [ORL.Experience.concat_experiences(samples()[i:i + 4], PAD) for i in (0, 4)]
    for exp in batches:
        with torch.no_grad():
            exp.action_log_probs = t.actor(exp.sequences, exp.action_mask, exp.attention_mask)
        exp.advantages = torch.tensor([ADV[i] for i in exp.index])[:, None] * exp.action_mask
    buf = T_._buffer(batches[0], 2)
    buf.append(batches[1])
    assert all(getattr(it, gorl.KEPT_ATTR, None) is not None for it in buf.items)
    delattr(buf.items[5], gorl.KEPT_ATTR)
    t.replay_buffer = buf
    forwards[0] = 0
    assert gorl.nthr_pass(t)["gbc/nthr_second_forward"] == 1.0 and forwards[0] == 4


def test_kept_rows_after_the_update_are_not_used(held):
    """After ppo_train (the parameters changed) what the pass kept is stale: a sample still
    holding it gets today's pass."""
    args = T_._margs()
    args.rollout.n_samples_per_prompt = N
    t = _packed_trainer(args, False)
    T_._enable(nthr=True, nthr_beta=0.0)
    exp = ORL.Experience.concat_experiences(samples()[:4], PAD)
    with torch.no_grad():
        exp.action_log_probs = t.actor(exp.sequences, exp.action_mask, exp.attention_mask)
    exp.advantages = torch.tensor(ADV[:4])[:, None] * exp.action_mask
    t.replay_buffer = T_._buffer(exp, 2)
    gorl._nthr_forget()                 # what the patched ppo_train does after its update
    assert gorl.nthr_pass(t)["gbc/nthr_second_forward"] == 1.0


def _dp_worker(rank, world, keep):
    import torch.distributed as dist

    strategy = {"dp": SimpleNamespace(get_group=lambda: dist.group.WORLD)}
    rows = [[0, 1, 4, 5], [2, 3, 6, 7]][rank]          # both groups split over the ranks
    out = flow(False, 2, 2, keep=keep, rows=rows, strategy=strategy)
    return out.scales, out.params, out.forwards, out.metrics


@pytest.mark.slow
def test_kept_pass_groups_split_over_two_ranks():
    """Two data-parallel ranks (gloo), each group's responses on both: each rank keeps its
    share from its own pass; the head's rows of every group's ids are assembled over the ranks;
    the scales and each rank's update equal today's pass, with no forward."""
    from conftest import spawn_gloo

    kept = spawn_gloo(2, _dp_worker, True)
    today = spawn_gloo(2, _dp_worker, False)
    for k, t in zip(kept, today):
        assert k[2] == 0 and t[2] == 2
        assert k[3]["gbc/nthr_second_forward"] == 0.0
        for x, y in zip(k[0], t[0]):
            assert torch.equal(x, y)
        for x, y in zip(k[1], t[1]):
            assert torch.equal(x, y)
    assert any((s != 1).any() for k in kept for s in k[0])


def _ring_worker(rank, world):
    import os
    import sys

    import torch.distributed as dist
    from openrlhf.models import ring_attn_utils

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "standins"))
    from ring_flash_attn import substitute_hf_flash_attn

    group = dist.new_group(list(range(world)))
    dp = [dist.new_group([r]) for r in range(world)][rank]
    ring_attn_utils.set_ring_attn_group(group)
    substitute_hf_flash_attn(group, 1)
    strategy = {"dp": SimpleNamespace(get_group=lambda: dp)}
    return [(out.scales, out.forwards, out.metrics["gbc/nthr_second_forward"])
            for out in (flow(True, 2, 2, keep=k, strategy=strategy, ring=group)
                        for k in (True, False))]


@pytest.mark.slow
def test_kept_pass_under_ring_attention():
    """ds.ring_attn_size 2 (2 gloo processes, each a slice of the packed stream): each ring
    rank keeps whole responses (the hidden states summed over the ring inside the forward);
    the scales equal today's pass under the ring, with no forward, and the packed pass in one
    process."""
    from conftest import spawn_gloo

    one = flow(True, 2, 2, keep=True)
    for kept, today in spawn_gloo(2, _ring_worker):
        assert kept[1] == 0 and today[1] == 4 and (kept[2], today[2]) == (0.0, 1.0)
        for x, y, z in zip(kept[0], today[0], one.scales):
            assert torch.equal(x, y)
            assert torch.allclose(x, z, atol=1e-6)


def test_head_rows_assembled_exactly():
    """NTHRHeadRows keeps each id's row once, sorted, and gives back exactly the head's rows
    (with bias); an id it never saw is refused by name."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13)
    rows = methods.NTHRHeadRows()
    rows.add(torch.tensor([[3, 7], [7, 1]]), head, None, 0.9)
    rows.add(torch.tensor([12, 3]), head, None, 0.9)
    assert rows.ids.tolist() == [1, 3, 7, 12] and rows.temperatures == {0.9}
    w, b, cap = rows.assemble(torch.tensor([1, 7, 12]))
    assert torch.equal(w, head.weight.detach()[[1, 7, 12]])
    assert torch.equal(b, head.bias.detach()[[1, 7, 12]]) and cap is None
    with pytest.raises(ValueError, match="heads: token ids \\[5\\]"):
        rows.assemble(torch.tensor([1, 5]))
    assert copy.copy(rows).nbytes() == 4 * 8 * 4 + 4 * 4
