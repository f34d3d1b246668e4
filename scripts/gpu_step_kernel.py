"""The persistent decode step on the GPU: the launches' bits, and its time against the launches' graph.

python3 scripts/gpu_step_kernel.py OUT_DIR [--shape smollm2] [--context 1024] [--variants 132:4:1,132:8:1,...]

Random weights (step time does not depend on their values). For T = 1 and 16 after a `--context`-token prefill:
(1) bit equality of logits, argmax and the KV cache between fused_forward (the launches) and the persistent step
in one grid-synchronised launch and in one launch per stage; (2) the pure GPU time of a CUDA graph of each (median
of replays, CUDA events) for variants programs:num_warps:prefetch. Prints a table last; JSON in OUT_DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_profile import SHAPES, events_ms  # noqa: E402

from specpilot.engines.fused import (PERSISTENT_BLOCK_N, fused_forward, persistent_order,  # noqa: E402
                                     rope_tables_for)
from specpilot.engines.loader import random_model  # noqa: E402
from specpilot.kernels._common import capture_graph  # noqa: E402
from specpilot.kernels.step_kernel import persistent_step  # noqa: E402


def e2e_diff(sh, tokens: int = 256) -> dict:
    """Generates with both step kernels (gpu_profile.py's prompt), finds the first differing token, then replays the
    launches' sequence up to that step and compares every layer's output, the new KV row per layer and the logits
    of one T=1 step through each path."""
    from specpilot.engines.build import build_engine
    from specpilot.engines.config import DrafterKind, EngineConfig
    from specpilot.engines.fused import persistent_forward
    dev = torch.device("cuda")
    model = random_model(sh, torch.bfloat16, dev, seed=0)
    prompt = torch.randint(3, sh.vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist() * 3
    outs, caches = {}, {}
    for sk in ("launches", "persistent"):
        eng = build_engine(EngineConfig(drafter=DrafterKind.NONE, kernel_backend="triton", max_seq_len=2048,
                                        step_kernel=sk), model, frozenset(), "cuda")
        outs[sk] = eng.generate(prompt, tokens).tokens
        caches[sk] = eng.target.kv.clone()
        del eng
    diffs = [i for i, (x, y) in enumerate(zip(outs["launches"], outs["persistent"])) if x != y]
    res = {"differing_tokens": diffs}
    # each engine's KV cache against one prefill of its own token sequence (batch invariance says: equal)
    for sk, toks in outs.items():
        seq = prompt + toks[:-1]
        n = len(seq)
        t = rope_tables_for(model, 2048 + 128, dev)
        kv = torch.zeros_like(caches[sk])
        p = torch.arange(n, device=dev)
        fused_forward(model, t, torch.tensor(seq, device=dev), p, p, torch.zeros(1, dtype=torch.long, device=dev),
                      torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev)), kv[0], kv[1], want_logits=False)
        bad = (kv[:, :, :, :n] != caches[sk][:, :, :, :n]).flatten(0, 2).any(-1).any(0).nonzero().flatten().tolist()
        res[f"kv_positions_differing_from_prefill_{sk}"] = bad[:20]
        res[f"kv_positions_differing_count_{sk}"] = len(bad)
    if not diffs:
        return res
    i = diffs[0]
    seq = prompt + outs["launches"][:i]  # the state before the differing step: its input is seq[-1]
    tables = rope_tables_for(model, 2048 + 128, dev, persistent=True)
    kv = torch.zeros(2, sh.layers, sh.kv_heads, 2048 + 64, sh.head_dim, dtype=torch.bfloat16, device=dev)
    n = len(seq) - 1
    ids = torch.tensor(seq[:n], device=dev)
    pos = torch.arange(n, device=dev)
    fused_forward(model, tables, ids, pos, pos, torch.zeros(1, dtype=torch.long, device=dev),
                  torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev)), kv[0], kv[1], want_logits=False)
    ids, pos = torch.tensor(seq[n:], device=dev), torch.tensor([n], device=dev)
    anc = torch.ones(1, 1, dtype=torch.bool, device=dev)
    layers = tuple(range(sh.layers))
    kv_a, kv_b = kv.clone(), kv.clone()
    la, aa, fa = fused_forward(model, tables, ids, pos, pos, pos, anc, kv_a[0], kv_a[1], capture=layers)
    lb, ab, fb = persistent_forward(model, tables, ids, pos, pos, pos, anc, kv_b, 132, capture=layers)
    fa = torch.cat(fa, dim=-1).view(1, sh.layers, -1)
    fb = fb.view(1, sh.layers, -1)
    layer_diff = [float((fa[0, j].float() - fb[0, j].float()).abs().max()) for j in range(sh.layers)]
    kv_diff = [float((kv_a[:, j, :, n].float() - kv_b[:, j, :, n].float()).abs().max()) for j in range(sh.layers)]
    res.update(step=i, position=n, argmax=(int(aa[0]), int(ab[0])), logit_max_diff=float((la - lb).abs().max()),
               first_layer_out_diff=next((j for j, d in enumerate(layer_diff) if d), None),
               first_layer_kv_diff=next((j for j, d in enumerate(kv_diff) if d), None), layer_out_diff=layer_diff,
               kv_diff=kv_diff, top2_launches=la[0].float().topk(2).values.tolist())
    return res


def position_sweep(sh, lo: int, hi: int) -> dict:
    """One T=1 step at every position lo..hi-1 from a state prefilled by the launches (random tokens): positions
    where the persistent step's logits or new KV row differ from the launches', with the first differing layer."""
    from specpilot.engines.fused import persistent_forward
    dev = torch.device("cuda")
    model = random_model(sh, torch.bfloat16, dev, seed=0)
    tables = rope_tables_for(model, 2048 + 128, dev, persistent=True)
    kv = torch.zeros(2, sh.layers, sh.kv_heads, 2048 + 64, sh.head_dim, dtype=torch.bfloat16, device=dev)
    seq = torch.randint(3, sh.vocab, (hi + 1,), generator=torch.Generator().manual_seed(1)).to(dev)
    p = torch.arange(hi, device=dev)
    fused_forward(model, tables, seq[:hi], p, p, torch.zeros(1, dtype=torch.long, device=dev),
                  torch.tril(torch.ones(hi, hi, dtype=torch.bool, device=dev)), kv[0], kv[1], want_logits=False)
    layers = tuple(range(sh.layers))
    anc = torch.ones(1, 1, dtype=torch.bool, device=dev)
    bad = []
    for n in range(lo, hi):
        pos = torch.tensor([n], device=dev)
        kv_a, kv_b = kv.clone(), kv.clone()
        la, _, fa = fused_forward(model, tables, seq[n:n + 1], pos, pos, pos, anc, kv_a[0], kv_a[1], capture=layers)
        lb, _, fb = persistent_forward(model, tables, seq[n:n + 1], pos, pos, pos, anc, kv_b, 132, capture=layers)
        if not torch.equal(la, lb) or not torch.equal(kv_a, kv_b):
            fa = torch.cat(fa, dim=-1).view(sh.layers, -1)
            fb = fb.view(sh.layers, -1)
            kvd = [bool((kv_a[:, j, :, n] != kv_b[:, j, :, n]).any()) for j in range(sh.layers)]
            outd = [bool((fa[j] != fb[j]).any()) for j in range(sh.layers)]
            bad.append({"position": n, "first_kv_layer": kvd.index(True) if True in kvd else None,
                        "first_out_layer": outd.index(True) if True in outd else None,
                        "k_differs": bool((kv_a[0, :, :, n] != kv_b[0, :, :, n]).any()),
                        "v_differs": bool((kv_a[1, :, :, n] != kv_b[1, :, :, n]).any())})
    return {"lo": lo, "hi": hi, "mismatches": len(bad), "first": bad[:10]}


def stage_trace(sh, ctx: int) -> dict:
    """Per stage kind: median over layers of (wait, work, publish) in us, the programs' max, from %globaltimer
    stamps of one T=1 step after a ctx-token prefill."""
    import numpy as np
    from specpilot.engines.fused import persistent_order
    dev = torch.device("cuda")
    model = random_model(sh, torch.bfloat16, dev, seed=0)
    tables = rope_tables_for(model, 2048 + 128, dev, persistent=True)
    kv = torch.zeros(2, sh.layers, sh.kv_heads, 2048 + 64, sh.head_dim, dtype=torch.bfloat16, device=dev)
    seq = torch.randint(3, sh.vocab, (ctx + 1,), generator=torch.Generator().manual_seed(1)).to(dev)
    p = torch.arange(ctx, device=dev)
    fused_forward(model, tables, seq[:ctx], p, p, torch.zeros(1, dtype=torch.long, device=dev),
                  torch.tril(torch.ones(ctx, ctx, dtype=torch.bool, device=dev)), kv[0], kv[1], want_logits=False)
    pos = torch.tensor([ctx], device=dev)
    block_k, att = persistent_order(model, tables, 1)
    n_st = 5 * sh.layers + 2
    tr = torch.zeros(132, n_st, 3, dtype=torch.int64, device=dev)
    for _ in range(3):
        x = torch.nn.functional.embedding(seq[ctx:], model.embed_tokens.weight)
        persistent_step(x, tables.stacked, kv[0], kv[1], tables.cos, tables.sin, pos, pos, pos,
                        torch.ones(1, 1, dtype=torch.bool, device=dev), block_k=block_k, block_n=PERSISTENT_BLOCK_N,
                        attention=att, programs=132, trace=tr)
    torch.cuda.synchronize()
    t = tr.cpu().numpy().astype(np.float64)
    t0 = t[:, 0, 0].min()
    res = {"step_us": (t[:, :, 2].max() - t0) / 1e3, "kinds": {}}
    names = ["qkv", "attention", "o_proj", "gate_up", "down"]
    for k, name in enumerate(names):
        ss = [s for s in range(n_st - 2) if s % 5 == k and s >= 5]
        # stage span: from the last program's publish of the previous stage to the last publish of this one
        span = [t[:, s, 2].max() - t[:, s - 1, 2].max() for s in ss]
        wait = [np.median(t[:, s, 1] - t[:, s, 0]) for s in ss]
        work = [np.median(t[:, s, 2] - t[:, s, 1]) for s in ss]
        res["kinds"][name] = {"span_us": float(np.median(span)) / 1e3, "median_wait_us": float(np.median(wait)) / 1e3,
                              "median_work_us": float(np.median(work)) / 1e3}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default="132:4:1,132:4:0,66:4:1,132:8:1",
                    help="programs:num_warps:prefetch[:num_stages] per timed variant")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30, help="repeated bit checks of the grid-synchronised step")
    ap.add_argument("--trace", action="store_true", help="only: where one step's time goes, per stage kind")
    ap.add_argument("--sweep", default="", help="only: LO:HI one-step bit checks at every position in LO..HI-1")
    ap.add_argument("--e2e-diff", action="store_true", help="only: locate where 256 AR tokens of the two differ")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sh = SHAPES[a.shape]
    if a.trace:
        res = stage_trace(sh, a.context)
        json.dump(res, open(os.path.join(a.out, "trace.json"), "w"), indent=1)
        print(json.dumps(res, indent=1))
        return
    if a.sweep:
        res = position_sweep(sh, *map(int, a.sweep.split(":")))
        json.dump(res, open(os.path.join(a.out, "sweep.json"), "w"), indent=1)
        print(json.dumps(res))
        return
    if a.e2e_diff:
        res = e2e_diff(sh)
        json.dump(res, open(os.path.join(a.out, "e2e_diff.json"), "w"), indent=1)
        print(json.dumps({k: v for k, v in res.items() if k not in ("layer_out_diff", "kv_diff")}))
        print("layer out diff", [f"{d:.3g}" for d in res.get("layer_out_diff", [])])
        print("kv diff", [f"{d:.3g}" for d in res.get("kv_diff", [])])
        return
    dev = torch.device("cuda")
    model = random_model(sh, torch.bfloat16, dev, seed=0)
    tables = rope_tables_for(model, 4096 + 128, dev, persistent=True)
    S = 4096 + 64
    kv = torch.zeros(2, sh.layers, sh.kv_heads, S, sh.head_dim, dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    ctx = a.context
    ids = torch.randint(0, sh.vocab, (ctx,), generator=g).to(dev)
    pos = torch.arange(ctx, device=dev)
    fused_forward(model, tables, ids, pos, pos, torch.zeros(1, dtype=torch.long, device=dev),
                  torch.tril(torch.ones(ctx, ctx, dtype=torch.bool, device=dev)), kv[0], kv[1], want_logits=False)
    torch.cuda.synchronize()
    rows, report = [], {"shape": a.shape, "context": ctx, "checks": [], "timings": []}
    for T in (1, 16):
        ids = torch.randint(0, sh.vocab, (T,), generator=g).to(dev)
        pos = torch.arange(ctx, ctx + T, device=dev)
        base = torch.tensor([ctx], device=dev)
        anc = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))
        block_k, att = persistent_order(model, tables, T)

        def launches(kv_=kv, want=True):
            return fused_forward(model, tables, ids, pos, pos, base, anc, kv_[0], kv_[1], want_logits=want)[:2]

        def persistent(kv_=kv, programs=132, warps=4, pf=True, sync=True, want=True, stages=2):
            x = torch.nn.functional.embedding(ids, model.embed_tokens.weight)
            return persistent_step(x, tables.stacked, kv_[0], kv_[1], tables.cos, tables.sin, pos, pos, base, anc,
                                   block_k=block_k, block_n=PERSISTENT_BLOCK_N, attention=att, programs=programs,
                                   store_logits=want, num_warps=warps, num_stages=stages, grid_sync=sync,
                                   prefetch=pf)[:2]
        kv_ref = kv.clone()
        want_l, want_a = launches(kv_ref)
        for label, fn in (("grid_sync", lambda k: persistent(k)), ("per_stage", lambda k: persistent(k, sync=False)),
                          ("grid_sync_8w", lambda k: persistent(k, warps=8))):
            kv_got = kv.clone()
            got_l, got_a = fn(kv_got)
            torch.cuda.synchronize()
            ok = dict(T=T, variant=label, logits=bool(torch.equal(got_l.view(torch.int32), want_l.view(torch.int32))),
                      argmax=bool(torch.equal(got_a, want_a)), kv=bool(torch.equal(kv_got.view(torch.int16),
                                                                                  kv_ref.view(torch.int16))),
                      max_abs_logit_diff=float((got_l - want_l).abs().max()))
            report["checks"].append(ok)
            print("check", ok, flush=True)
        # races would show as run-to-run differences: repeat the grid-synchronised step from the same cache
        diffs = 0
        for _ in range(a.repeats):
            kv_got = kv.clone()
            got_l, _ = persistent(kv_got)
            diffs += int(not torch.equal(got_l.view(torch.int32), want_l.view(torch.int32)))
        report["checks"].append({"T": T, "variant": f"repeat x{a.repeats}", "logits": diffs == 0, "argmax": True,
                                 "kv": True, "runs_differing": diffs})
        print(f"T={T}: {diffs} of {a.repeats} repeated persistent steps differ from the launches", flush=True)
        # graphs: the hot path (argmax only), writing scratch slots of a copy of the cache
        kv_t = kv.clone()
        variants = [("launches", lambda: launches(kv_t, want=False))]
        for v in a.variants.split(","):
            p, w, pf, st = (int(t) for t in (v + ":2").split(":")[:4])
            variants.append((f"persistent {p}p {w}w pf{pf} {st}st",
                             lambda p=p, w=w, pf=pf, st=st: persistent(kv_t, programs=p, warps=w, pf=bool(pf),
                                                                       want=False, stages=st)))
        for label, body in variants:
            try:
                graph, _ = capture_graph(body, warmups=3)
                ms = events_ms(graph.replay, a.reps)
            except Exception as e:  # a variant that does not compile or capture is reported, not fatal
                print(f"{label} T={T}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                ms = float("nan")
            report["timings"].append({"T": T, "variant": label, "graph_ms": ms})
            rows.append((T, label, ms))
            print(f"T={T} {label}: {ms:.4f} ms", flush=True)
    with open(os.path.join(a.out, "step_kernel.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{a.shape}, context {ctx}: graph GPU time per step (ms)")
    print("| T | variant | ms |\n|---|---|---|")
    for T, label, ms in rows:
        print(f"| {T} | {label} | {ms:.4f} |")
    bad = [c for c in report["checks"] if not (c["logits"] and c["argmax"] and c["kv"])]
    print("bit-equal to the launches:", "yes" if not bad else f"NO: {bad}")


if __name__ == "__main__":
    main()
