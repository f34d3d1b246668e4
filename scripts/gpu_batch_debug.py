"""Where batched outputs part from single-request AR on the GPU (bf16, random SmolLM2-135M shapes), layer by layer.

1. paged_attention vs kernels.attn.attention on each request's contiguous keys, bitwise (engine launch params);
2. batch_forward vs fused_forward on the same rows (a prompt chunk, a verify block, an AR token), bitwise;
3. the projection kernels: one row alone vs the same row inside a T-row forward, bitwise;
4. the engines: SpecEngine AR vs the batched engine's AR on a few prompts: first differing position;
5. the split kernels alone, on identical contiguous keys (identity page table): which partials (max, sum,
   output) differ, for which splits, and whether one split per program or other pipelining changes that.
Prints one line per check; exit 1 when any differs. `--cpu` runs it under the Triton interpreter (micro shapes).

    PYTHONPATH=. python scripts/gpu_batch_debug.py [--cpu]
"""
from __future__ import annotations

import os
import sys

CPU = "--cpu" in sys.argv
if CPU:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specpilot.engines.batch import BatchConfig, RequestSpec, StepClock, build_batch_engine  # noqa: E402
from specpilot.engines.batch.model import attention_params, batch_forward  # noqa: E402
from specpilot.engines.batch.paged_attn import PagedMeta, max_tiles, paged_attention, tile_map  # noqa: E402
from specpilot.engines.build import build_engine  # noqa: E402
from specpilot.engines.config import DrafterKind, EngineConfig  # noqa: E402
from specpilot.engines.fused import fused_forward, rope_tables_for  # noqa: E402
from specpilot.engines.loader import random_model  # noqa: E402
from specpilot.engines.shapes import SMOLLM2_135M, LlamaShape  # noqa: E402
from specpilot.kernels.attn import attention  # noqa: E402
from specpilot.kernels.gemm import linear  # noqa: E402
from specpilot.kernels.norm_gemm import rmsnorm_linear  # noqa: E402

DEV = "cpu" if CPU else "cuda"
DT = torch.float32 if CPU else torch.bfloat16
SHAPE = LlamaShape(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=16, intermediate=64, rms_eps=1e-5,
                   rope_theta=10000.0, tie_embeddings=False) if CPU else SMOLLM2_135M
MAX_SEQ = 512 if CPU else 2048
failures: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'DIFF'} {name}{(': ' + detail) if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    return f"max |diff| {d.max().item():.3g}, {(d > 0).sum().item()} of {d.numel()} differ"


def check_attention(page: int, block_n: int, reqs: list[tuple[int, int]], seed: int = 0) -> None:
    g = torch.Generator(device=DEV).manual_seed(seed)
    kvh, h, d = SHAPE.kv_heads, SHAPE.heads, SHAPE.head_dim
    npages = sum(-(-kv // page) for kv, _ in reqs) + 3
    kc, vc = (torch.randn(kvh, npages * page, d, generator=g, device=DEV).to(DT) for _ in range(2))
    perm = torch.randperm(npages, generator=torch.Generator().manual_seed(1)).to(DEV)
    width = max(-(-kv // page) for kv, _ in reqs)
    pt, used = torch.full((len(reqs), width), -1, dtype=torch.int64, device=DEV), 0
    for i, (kv, _) in enumerate(reqs):
        n = -(-kv // page)
        pt[i, :n] = perm[used:used + n]
        used += n
    q_len = torch.tensor([r[1] for r in reqs], device=DEV)
    kv_len = torch.tensor([r[0] for r in reqs], device=DEV)
    q_start = torch.cumsum(q_len, 0) - q_len
    ntok = int(q_len.sum())
    tok_kv = torch.repeat_interleave(kv_len, q_len)
    t_req, t_row = tile_map(q_len.cpu().numpy(), h // kvh, max_tiles(ntok, h // kvh, len(reqs)))
    meta = PagedMeta(pt, q_start, q_len, kv_len, torch.from_numpy(t_req).to(DEV), torch.from_numpy(t_row).to(DEV),
                     tok_kv)
    q = torch.randn(ntok, h, d, generator=g, device=DEV).to(DT)
    from specpilot.kernels.attn import AttentionParams
    out = paged_attention(q, kc, vc, meta, params=AttentionParams(block_n=block_n, split_keys=page))
    for i, (kv, ql) in enumerate(reqs):
        keys = torch.arange(kv, device=DEV)
        slots = pt[i, keys // page] * page + keys % page
        qs = int(q_start[i])
        chain = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV))
        # base as an int over a cache just long enough; base as a device tensor over the engine's MAX_SEQ cache
        for cap, base in ((-(-kv // page) * page, kv - ql), (MAX_SEQ, torch.tensor([kv - ql], device=DEV))):
            kcc, vcc = (torch.zeros(kvh, cap, d, dtype=DT, device=DEV) for _ in range(2))
            kcc[:, :kv], vcc[:, :kv] = kc[:, slots], vc[:, slots]
            single = attention(q[qs:qs + ql].contiguous(), kcc, vcc, base, chain, block_n=block_n, split_keys=page)
            same = torch.equal(single, out[qs:qs + ql])
            where = ""
            if not same:
                bad = (single.float() != out[qs:qs + ql].float()).nonzero()[:4].tolist()  # (token, head, dim)
                where = f"{diff(single, out[qs:qs + ql])} at (token, head, dim) {bad}"
            report(f"paged attention page={page} block_n={block_n} kv={kv} q={ql} base {type(base).__name__} "
                   f"S={cap}", same, where)


def check_projections(model) -> None:
    sh = model.shape
    g = torch.Generator(device=DEV).manual_seed(2)
    layer = model.layers[0]
    for t in (2, 16, 40, 144):
        x = torch.randn(t, sh.hidden, generator=g, device=DEV).to(DT)
        w = torch.randn(3 * sh.hidden, sh.hidden, generator=g, device=DEV).to(DT) * 0.05
        full = rmsnorm_linear(x, layer.input_layernorm.weight, w, sh.rms_eps)
        rows = torch.cat([rmsnorm_linear(x[i:i + 1], layer.input_layernorm.weight, w, sh.rms_eps) for i in range(t)])
        report(f"rmsnorm_linear row alone == row in T={t}", torch.equal(full, rows), diff(full, rows))
        full = linear(x, w)
        rows = torch.cat([linear(x[i:i + 1], w) for i in range(t)])
        report(f"linear row alone == row in T={t}", torch.equal(full, rows), diff(full, rows))


def check_batch_forward(model) -> None:
    sh = model.shape
    tables = rope_tables_for(model, MAX_SEQ, DEV)
    page = attention_params(model, tables).split_keys
    n_pages = MAX_SEQ // page
    ids = torch.randint(0, sh.vocab, (MAX_SEQ,), generator=torch.Generator().manual_seed(3)).to(DEV)
    single = torch.zeros(2, sh.layers, sh.kv_heads, MAX_SEQ, sh.head_dim, dtype=DT, device=DEV)
    paged = torch.zeros(2, sh.layers, sh.kv_heads, 2 * MAX_SEQ, sh.head_dim, dtype=DT, device=DEV)
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(4)).to(DEV)
    pages = torch.stack([order, order + n_pages])  # request 0's pages (scattered), request 1's
    prompt = 3 * page + 5 if not CPU else 37
    for lo, hi in ((0, prompt), (prompt, prompt + 6), (prompt + 6, prompt + 7)):
        pos = torch.arange(lo, hi, device=DEV)
        chain = torch.tril(torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=DEV))
        ref, _, _ = fused_forward(model, tables, ids[lo:hi], pos, pos, torch.tensor([lo], device=DEV), chain,
                                  single[0], single[1])
        n = hi - lo
        both = torch.cat([ids[lo:hi], ids[:2]])
        positions = torch.cat([pos, torch.arange(2, device=DEV)])
        slots = torch.cat([pages[0, pos // page] * page + pos % page, pages[1, 0] * page + torch.arange(2, device=DEV)])
        t_req, t_row = tile_map(np.array([n, 2]), sh.heads // sh.kv_heads, max_tiles(n + 2, sh.heads // sh.kv_heads, 2))
        meta = PagedMeta(pages, torch.tensor([0, n], device=DEV), torch.tensor([n, 2], device=DEV),
                         torch.tensor([hi, 2], device=DEV), torch.from_numpy(t_req).to(DEV),
                         torch.from_numpy(t_row).to(DEV), torch.tensor([hi] * n + [2, 2], device=DEV))
        logits, argmax, _ = batch_forward(model, tables, both, positions, slots, meta, paged[0], paged[1], page,
                                       want_logits=True)
        same = torch.equal(logits[:n], ref)
        report(f"batch_forward == fused_forward rows [{lo}, {hi})", same, "" if same else diff(logits[:n], ref))
        keys = torch.arange(hi, device=DEV)
        logical = pages[0, keys // page] * page + keys % page
        bad = [(kv, layer) for kv in range(2) for layer in range(sh.layers)
               if not torch.equal(paged[kv, layer][:, logical], single[kv, layer][:, :hi])]
        report(f"  KV after rows [{lo}, {hi}): (k/v, layer) that differ", not bad, str(bad[:6]))


def check_engines(model) -> None:
    sh = model.shape
    cfg = EngineConfig(dtype="float32" if CPU else "bfloat16", max_seq_len=MAX_SEQ, kernel_backend="triton",
                       cuda_graphs=not CPU, drafter=DrafterKind.NONE)
    gen = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(3, sh.vocab, (n,), generator=gen).tolist()) for n in (40, 130, 75, 300)]
    n_new = 24 if CPU else 200
    single = build_engine(cfg, model, frozenset(), DEV)
    refs = [single.generate(list(p), n_new).tokens for p in prompts]
    for graphs in ((False, True) if not CPU else (False,)):
        batch = build_batch_engine(model, cfg.replace(cuda_graphs=graphs), BatchConfig(max_batch=4), frozenset(), DEV)
        res = batch.run([RequestSpec(f"r{i}", p, n_new) for i, p in enumerate(prompts)], StepClock())
        got = {r.id: r.tokens for r in res.requests}
        for i, ref in enumerate(refs):
            toks = got[f"r{i}"]
            first = next((j for j, (a, b) in enumerate(zip(ref, toks)) if a != b), None)
            report(f"batched AR (graphs={graphs}) == single AR, request {i} (prompt {len(prompts[i])})",
                   first is None and len(toks) == len(ref), f"first difference at token {first}")


def check_split_partials(page: int, block_n: int, kv: int, q_len: int, seed: int = 0) -> None:
    """Both split kernels on the same keys (the paged one through an identity page table): their per-split
    (m, l, acc) partials, bitwise, for several SPLITS_PER_PROGRAM and num_stages."""
    import math

    import triton

    from specpilot.engines.batch import paged_attn as pa
    from specpilot.kernels import attn as sa
    from specpilot.kernels._common import BLOCK_M, NO_FP_FUSION, dot_precision
    kvh, h, d = SHAPE.kv_heads, SHAPE.heads, SHAPE.head_dim
    g = torch.Generator(device=DEV).manual_seed(seed)
    S = -(-kv // page) * page
    kc, vc = (torch.randn(kvh, S, d, generator=g, device=DEV).to(DT) for _ in range(2))
    q = torch.randn(q_len, h, d, generator=g, device=DEV).to(DT)
    n_split, G, scale = -(-kv // page), h // kvh, sa.LOG2E / math.sqrt(d)

    def ws():
        return (torch.full((n_split * q_len * h,), 7.0, device=DEV), torch.full((n_split * q_len * h,), 7.0, device=DEV),
                torch.full((n_split * q_len * h * d,), 7.0, device=DEV))
    single = ws()
    anc = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool, device=DEV))
    k_single = sa._attn_split_kernel[(triton.cdiv(q_len * G, BLOCK_M), kvh, n_split)](
        q, kc, vc, anc.view(torch.uint8), single[0], *single, single[0], q_len, kv - q_len, S, 0, 1, 1, 0, scale, H=h, G=G, D=d,
        BASE_IS_PTR=False, DOT_PREC=dot_precision(DT), BLOCK_M=BLOCK_M, BLOCK_N=block_n, SPLIT=page, HAS_SLOTS=False,
        TILES=1, **NO_FP_FUSION, num_warps=4, num_stages=2)
    t_req, t_row = tile_map(np.array([q_len]), G, max_tiles(q_len, G, 1))
    meta = [torch.arange(n_split, device=DEV)[None], torch.from_numpy(t_req).to(DEV), torch.from_numpy(t_row).to(DEV),
            torch.tensor([0], device=DEV), torch.tensor([q_len], device=DEV), torch.tensor([kv], device=DEV)]
    for spp, stages in ((4, 2), (1, 2), (1, 1)):
        paged = ws()
        k_paged = pa._paged_split_kernel[(len(t_req), kvh, triton.cdiv(n_split, spp))](
            q, kc, vc, *meta, *paged, q_len, S, n_split, scale, H=h, G=G, D=d, DOT_PREC=dot_precision(DT),
            BLOCK_M=pa.ROW_TILE, BLOCK_N=block_n, SPLIT=page, SPLITS_PER_PROGRAM=spp, num_warps=4, num_stages=stages,
            **NO_FP_FUSION)
        parts = []
        for name, a, b, per in (("m", single[0], paged[0], 1), ("l", single[1], paged[1], 1),
                                ("acc", single[2], paged[2], d)):
            split_of = torch.arange(a.numel(), device=DEV) // (q_len * h * per)
            bad = split_of[a != b].unique().tolist()
            if bad:
                parts.append(f"{name} differs in splits {bad[:6]}")
        report(f"split partials kv={kv} q={q_len} splits/program={spp} stages={stages}", not parts, "; ".join(parts))
        dump_dots(f"kv{kv}_q{q_len}_spp{spp}_st{stages}", k_single, k_paged)


def dump_dots(tag: str, *kernels) -> None:
    """Both kernels' TTGIR into $OUT (when set), and their dot ops on stdout: which MMA each uses, and with
    what accumulator, is where their bits can part."""
    out = os.environ.get("OUT")
    for name, k in zip(("single", "paged"), kernels):
        ir = k.asm.get("ttgir", "")
        if out:
            with open(os.path.join(out, f"ttgir_{name}_{tag}.mlir"), "w") as f:
                f.write(ir)
        dots = [ln.strip()[:160] for ln in ir.splitlines() if "dot" in ln and "=" in ln]
        print(f"IR {tag} {name}: {len(dots)} dot ops", *dots, sep="\n  ")


def main() -> int:
    model = random_model(SHAPE, DT, DEV, seed=0)
    with torch.no_grad():
        from specpilot.engines.fused import ATTENTION_ORDER
        page, block_n = ATTENTION_ORDER["split_keys"], ATTENTION_ORDER["block_n"]
        check_attention(page, block_n, [(70, 1), (40, 5), (300, 16), (200, 1), (150, 6), (197, 197), (203, 6)])
        if not CPU:  # decode and verify shapes around split boundaries, several seeds
            for seed in range(3):
                check_attention(page, block_n, [(kv, q) for kv in (65, 127, 128, 129, 511, 513, 1023, 2047)
                                                for q in (1, 2, 5, 9, 17)], seed=seed)
            check_attention(page, block_n, [(q, q) for q in (16, 17, 63, 64, 65, 130)])
        if not CPU:
            for kv, ql in ((511, 17), (513, 5), (2047, 17), (197, 197)):
                check_split_partials(page, block_n, kv, ql)
        check_projections(model)
        check_batch_forward(model)
        check_engines(model)
    print(f"{len(failures)} check(s) differ" if failures else "all equal")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
