"""The sampler's support (issue 60): the replayed step against the plain step, and against the
two ways SkyRL 0.4 replays it, on the same inputs.

Providers (forward + backward of the GRPO loss, PPO clip + k3 KL, through the log-probs):

* ``plain``: gbc's fused loss over the whole vocabulary (today's step);
* ``support``: gbc's fused loss with ``support_ids`` (k ids a token);
* ``full_logits``: what SkyRL's FSDP path does — the ``[N, V]`` logits, the k columns gathered,
  ``logsumexp`` over them, autograd;
* ``pair_projection``: what SkyRL's Megatron path does — each (token, id) pair projected from
  the hidden state and its weight row (``N·k·H`` gathered rows), autograd.
* ``trunc_k20``, ``trunc_p095``, ``trunc_k20_p095`` (issue 61): gbc's fused loss with the kept
  set rebuilt in the row pass (``sampler_truncation``: top_k 20; top_p 0.95 without a top-k
  bound, the histogram select; both), at the rollout temperature 1;
* ``kept_mass_old``, ``plain_old``: the ``support=kept_mass`` old-policy pass (``token_stats``
  with ``sampler_truncation=top_p 0.95``, ``over_support=False``, ``return_log_kept_mass``)
  against the plain ``token_stats`` pass (ratios of those two are to ``plain_old``).

* ``step_plain``, ``step_rebuilt``, ``step_once`` (issue 66): a whole step of three passes —
  the old-policy pass, the reference pass (no grad) and the update — plain, with the kept set
  (top_k 20 + top_p 0.95) rebuilt in every pass (``sampler_truncation``), and built once in
  the old pass (``return_support_ids``) and replayed by the other two (``support_ids``, the
  support route); ratios to ``step_plain``;
* ``support_whole`` (issue 66): ``support`` with the support route off
  (``GBC_SUPPORT_ROUTE_FRACTION=0``): every chunk projected through the whole head and its
  members read from it (the replay before the route); ``support_route``: the route always
  taken (``GBC_SUPPORT_ROUTE_FRACTION=1``), to find its break-even.

``--sets`` shapes the kept sets (issue 66): ``indep`` (``k`` uniform ids a token, the target
first: ``|U|`` of a chunk near ``min(V, rows·k)``), ``overlap`` (``k`` ids a token drawn from a
Zipf(1.1) law over the vocabulary, as consecutive tokens' candidates share the frequent ids),
``topp`` (top-p sized: half the tokens the target alone, the others ``1 + Geometric`` ids of mean
16 from the same Zipf law: mean ~8.5, median 1–2; ``k`` is then the row width). The support
providers print the sets' mean size, the singletons' share and the mean ``|U| / V`` of their
chunks.

``--logit-std`` scales the hidden states so that the logits have that standard deviation (3.0:
peaked rows, as a trained model's; the truncated sets' mean size is printed with the rows).

Each provider runs in a fresh process (peak RSS clean); rounds alternate the providers, the
median is reported, and the ratios are to ``plain`` of the same run.

    python benchmarks/bench_support.py [--N 2048 --H 1024 --V 32768 --ks 20,512 --rounds 3]
    python benchmarks/bench_support.py --device cuda --dtype bfloat16 --N 8192 --H 3584 \
        --V 151936 --ks 20,512                  # a GPU (benchmarks/gpu_session.sh)

On CUDA the time is CUDA-event-synchronised and the peak is ``torch.cuda.max_memory_allocated``
beyond the inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import gbc_kernels as gbc

HERE = os.path.dirname(os.path.abspath(__file__))


TRUNC = {"trunc_k20": dict(top_k=20), "trunc_p095": dict(top_p=0.95),
         "trunc_k20_p095": dict(top_k=20, top_p=0.95)}


SETS = ("indep", "overlap", "topp")


def _zipf(n, V, g):
    """``n`` ids drawn from a Zipf(1.1) law over ``[0, V)`` (id 0 the most frequent)."""
    w = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(w, n, replacement=True, generator=g)


def kept_sets(B, T, V, k, sets, g):
    """``(targets, ids)`` ``[B, T]``, ``[B, T, k]``: the kept sets of ``--sets`` (module
    docstring), the target first, ``-1`` padded."""
    if sets == "indep":
        ids = torch.randint(0, V, (B, T, k), generator=g)
        return ids[..., 0].clone(), ids
    ids = _zipf(B * T * k, V, g).view(B, T, k)
    if sets == "topp":
        p = torch.rand(B, T, generator=g)
        size = 1 + torch.where(p < 0.5, 0, torch.distributions.Geometric(probs=1 / 16)
                               .sample((B, T)).long() + 1)
        ids = torch.where(torch.arange(k) < size.clamp(max=k).unsqueeze(-1), ids, -1)
    return ids[..., 0].clone(), ids


def setup(N, H, V, k, seed=0, device="cpu", dtype=torch.float32, logit_std=0.5,
          sets="indep"):
    g = torch.Generator().manual_seed(seed)
    B, T = max(1, N // 512), min(N, 512)
    hidden = (torch.randn(B, T, H, generator=g) * logit_std).to(device, dtype) \
        .requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(device, dtype).requires_grad_(True)
    targets, ids = kept_sets(B, T, V, k, sets, g)    # the sampled token is in its support
    old = -torch.rand(B, T, generator=g) * 2
    c = dict(targets=targets, ids=ids, mask=torch.ones(B, T, dtype=torch.bool),
             adv=torch.randn(B, generator=g), old=old,
             ref=(old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0))
    return dict(hidden=hidden, weight=weight, **{n: t.to(device) for n, t in c.items()})


def loss_from_logp(c, logp):
    ratio = torch.exp(logp - c["old"])
    adv = c["adv"][:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    d = c["ref"] - logp
    kl = torch.exp(d) - d - 1
    return (pg + 0.04 * kl).mean()


def run(provider, c):
    cfg = gbc.PolicyLossConfig(kl_coef=0.04, epsilon_high=0.28)
    if provider in TRUNC:
        loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"],
                                               c["mask"], c["adv"], c["old"], c["ref"],
                                               config=cfg, sampler_truncation=gbc.SamplerTruncation(
                                                   **TRUNC[provider]))
    elif provider in ("plain_old", "kept_mass_old"):
        kw = (dict(sampler_truncation=gbc.SamplerTruncation(top_p=0.95), over_support=False,
                   return_log_kept_mass=True) if provider == "kept_mass_old" else {})
        return gbc.token_stats(c["hidden"], c["weight"], c["targets"], **kw).logp.sum()
    elif provider in ("step_rebuilt", "step_once", "step_plain"):
        # a whole recompute step: the old-policy pass, the reference pass and the update
        # (three passes of the same weights here: the cost, not the policies, is measured)
        tr = gbc.SamplerTruncation(top_k=20, top_p=0.95)
        h, w, y = c["hidden"], c["weight"], c["targets"]
        if provider == "step_plain":
            gbc.token_stats(h.detach(), w.detach(), y)
            gbc.token_stats(h.detach(), w.detach(), y)
            kw = {}
        elif provider == "step_rebuilt":        # each pass rebuilds the set from its model
            gbc.token_stats(h.detach(), w.detach(), y, sampler_truncation=tr)
            gbc.token_stats(h.detach(), w.detach(), y, sampler_truncation=tr)
            kw = dict(sampler_truncation=tr)
        else:                                   # built once, replayed on the support route
            ids = gbc.token_stats(h.detach(), w.detach(), y, sampler_truncation=tr,
                                  return_support_ids=True).support_ids
            gbc.token_stats(h.detach(), w.detach(), y, support_ids=ids)
            kw = dict(support_ids=ids)
        loss, _ = gbc.fused_linear_policy_loss(h, w, y, c["mask"], c["adv"], c["old"],
                                               c["ref"], config=cfg, **kw)
    elif provider in ("plain", "support", "support_whole", "support_route"):
        sup = c["ids"] if provider != "plain" else None
        loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"],
                                               c["mask"], c["adv"], c["old"], c["ref"],
                                               config=cfg, support_ids=sup)
    elif provider == "full_logits":
        z = (c["hidden"] @ c["weight"].T).float()                           # [B, T, V]
        zs = z.gather(-1, c["ids"])
        logp = z.gather(-1, c["targets"].unsqueeze(-1)).squeeze(-1) - zs.logsumexp(-1)
        loss = loss_from_logp(c, logp)
    elif provider == "pair_projection":
        rows = c["weight"][c["ids"]]                                        # [B, T, k, H]
        zs = torch.einsum("btkh,bth->btk", rows, c["hidden"]).float()
        logp = zs[..., 0] - zs.logsumexp(-1)                                # id 0: the target
        loss = loss_from_logp(c, logp)
    else:
        raise ValueError(provider)
    loss.backward()
    return loss


def set_size(provider, c):
    """The mean size of the rebuilt sets (a provider of TRUNC), from the reference's rule on
    one chunk of rows."""
    import gbc_reference as ref

    h = c["hidden"].detach().reshape(-1, c["hidden"].shape[-1])[:64].float()
    l = h @ c["weight"].detach().float().T
    return float(ref.kept_set(l, **TRUNC[provider]).sum(-1).double().mean())


ROUTE = {"support_whole": "0", "support_route": "1"}     # GBC_SUPPORT_ROUTE_FRACTION


def _watch_chunks():
    """The support route's chunks: ``[(|U| or None when not routed, V)]``."""
    import gbc_kernels.support as S

    seen, orig = [], S.SupportBackend.chunk_view

    def watched(self, targets, vocab):
        view = orig(self, targets, vocab)
        u = int(torch.unique(targets[:, 2:][targets[:, 2:] >= 0]).numel())
        seen.append((u, vocab, view is not None))
        return view

    S.SupportBackend.chunk_view = watched
    return seen


def one(provider, N, H, V, k, reps, device="cpu", dtype=torch.float32, logit_std=0.5,
        sets="indep"):
    if provider in ROUTE:
        os.environ["GBC_SUPPORT_ROUTE_FRACTION"] = ROUTE[provider]
    chunks = _watch_chunks() if provider.startswith("support") else None
    c = setup(N, H, V, k, device=device, dtype=dtype, logit_std=logit_std, sets=sets)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(provider, c)                          # warm-up (its peak counts)
    times = []
    for _ in range(reps):
        for t in (c["hidden"], c["weight"]):
            t.grad = None
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(provider, c)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    else:
        peak = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    out = {"time": statistics.median(times), "peak_mib": peak}
    if provider in TRUNC:
        out["set_size"] = set_size(provider, c)
    if chunks:
        ids, y = c["ids"], c["targets"].unsqueeze(-1)
        distinct = ((ids >= 0) & (ids != y)).sum(-1) + 1       # (no repeats in a Zipf draw
        out["set_size"] = float(distinct.double().mean())      #  counted: an upper bound)
        out["singletons"] = float((distinct == 1).double().mean())
        out["u_frac"] = statistics.mean(u / v for u, v, _ in chunks)
        out["routed"] = sum(r for _, _, r in chunks) / len(chunks)
    return out


def imbalance(args):
    """Each rank's ``|U_r|`` per chunk (the route's work under vocab parallelism, R equal
    slices), over the kept sets of ``--sets``, ``--ks``: mean, and the largest rank's over the
    mean (1.0: balanced)."""
    print(f"# V={args.V}, {args.ranks} equal slices, chunks of {args.chunk} rows, sets "
          f"{args.sets}: mean |U_r| of a chunk per rank")
    for k in (int(x) for x in args.ks.split(",")):
        g = torch.Generator().manual_seed(0)
        _, ids = kept_sets(1, args.N, args.V, k, args.sets, g)
        ids = ids[0]
        width = -(-args.V // args.ranks)
        per = torch.zeros(args.ranks)
        chunks = 0
        for s in range(0, args.N, args.chunk):
            c = ids[s:s + args.chunk]
            u = torch.unique(c[c >= 0])
            per += torch.bincount(u // width, minlength=args.ranks)[:args.ranks].float()
            chunks += 1
        per /= chunks
        print(f"k={k}: " + ", ".join(f"{x:.0f}" for x in per.tolist())
              + f"  (largest / mean {float(per.max() / per.mean()):.2f})")


def id_bytes(args):
    """Bytes a token of the kept ids a trainer's batch carries between passes: ``-1``-padded
    (``4·K``, ``K`` the widest set) against ``methods.compact_support_ids`` (``4·(1 + M/T)``,
    ``M`` the longest sequence's total), for sequences of 512 tokens: the set rebuilt by
    ``token_stats(..., sampler_truncation=top_p 0.95, return_support_ids=True)`` on the random
    head at ``--logit-std`` (and under a top_k 512 bound), and the top-p-sized sets of
    ``--sets topp`` (mean ~8.5, half singletons) at ``k`` 512."""
    from gbc_kernels import methods
    print(f"# N={args.N} H={args.H} V={args.V}, sequences of 512 tokens: bytes a token of the "
          f"ids, -1 padded vs compact (methods.compact_support_ids)")
    print("| sets | mean / median / widest set | padded (B/token) | compact (B/token) |")
    print("|---|---|---|---|")
    rows = []
    for std in (float(x) for x in str(args.logit_std).split(",")):
        c = setup(args.N, args.H, args.V, 1, logit_std=std)
        for tr, name in ((gbc.SamplerTruncation(top_p=0.95), "top_p 0.95"),
                         (gbc.SamplerTruncation(top_k=512, top_p=0.95), "top_k 512, top_p 0.95")):
            ids = gbc.token_stats(c["hidden"].detach(), c["weight"].detach(), c["targets"],
                                  sampler_truncation=tr, return_support_ids=True).support_ids
            rows.append((f"{name}, random head, logit std {std}", ids))
    g = torch.Generator().manual_seed(0)
    _, ids = kept_sets(max(1, args.N // 512), min(args.N, 512), args.V, 512, "topp", g)
    rows.append(("top-p sized (--sets topp), k 512", ids))
    for name, ids in rows:
        size = (ids >= 0).sum(-1).float().view(-1)
        T = ids.shape[1]
        compact = methods.compact_support_ids(ids)
        padded_b = 4 * ids.shape[-1]
        compact_b = compact.numel() * 4 / (ids.shape[0] * T)
        print(f"| {name} | {size.mean():.1f} / {size.median():.0f} / {size.max():.0f} | "
              f"{padded_b:,} | {compact_b:,.0f} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--ks", default="20,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--providers", default="plain,support,full_logits,pair_projection")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--logit-std", default="0.5")
    ap.add_argument("--sets", default="indep", choices=SETS)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=0,
                    help="print each vocab-parallel rank's share of the route's work (the mean "
                         "|U_r| of a chunk of --chunk rows over R equal slices) and exit")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--id-bytes", action="store_true",
                    help="print the bytes a token of the kept ids, padded and compact, and exit "
                         "(--logit-std may be a comma-separated list)")
    args = ap.parse_args()
    if args.id_bytes:
        id_bytes(args)
        return
    if args.ranks:
        imbalance(args)
        return
    if args.one:
        print(json.dumps(one(args.one, args.N, args.H, args.V, args.k, 2 if args.device == "cpu"
                             else 5, args.device, getattr(torch, args.dtype),
                             float(args.logit_std),
                             args.sets)))
        return
    args.logit_std = float(args.logit_std)
    print(f"# N={args.N} H={args.H} V={args.V} {args.dtype} on {args.device}, "
          f"{torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; median of {args.rounds} rounds, each provider in a fresh "
          f"process; peak = RSS growth beyond the inputs; sets: {args.sets}")
    print("| k | provider | time (s) | × plain | peak (MiB) |")
    print("|---|---|---|---|---|")
    for k in (int(x) for x in args.ks.split(",")):
        res = {p: [] for p in args.providers.split(",")}
        for _ in range(args.rounds):
            for p in res:
                out = subprocess.run([sys.executable, __file__, "--one", p, "--N", str(args.N),
                                      "--H", str(args.H), "--V", str(args.V), "--k", str(k),
                                      "--device", args.device, "--dtype", args.dtype,
                                      "--logit-std", str(args.logit_std),
                                      "--sets", args.sets],
                                     capture_output=True, text=True, check=True)
                res[p].append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {p: statistics.median(r["time"] for r in rs) for p, rs in res.items()}
        for p, rs in res.items():
            base = med.get("plain_old" if p.endswith("_old") else
                           "step_plain" if p.startswith("step_") else "plain")
            peak = max(r["peak_mib"] for r in rs)
            ratio = f"{med[p] / base:.2f}" if base else "-"
            size = f" (mean set {rs[0]['set_size']:.1f} ids)" if "set_size" in rs[0] else ""
            if "u_frac" in rs[0]:
                size += (f" (singletons {rs[0]['singletons']:.0%}, chunk |U|/V "
                         f"{rs[0]['u_frac']:.2f}, routed {rs[0]['routed']:.0%})")
            print(f"| {k} | {p}{size} | {med[p]:.3f} | {ratio} | {peak:.0f} |", flush=True)


if __name__ == "__main__":
    main()
