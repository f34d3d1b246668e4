"""Issue #4's SmolLM2 bar (AR step <= 0.4 ms; 0.609 ms at context 1024 on the H200) is a count of dependent links:
six launches a layer (qkv, attention split, combine, o_proj, gate_up, down), each ~2.5 us at best in a PDL chain
(session 27). Measured here before building it: a layer in three links, by exact integer reductions.

o_proj and down are split along K (a head's 64 columns; a program's 16 intermediate rows), each program's fp32 partial
is scaled by 2^32 to an int64 and added with an integer atomic into the layer's output accumulator. Integer sums are
exact, so the result does not depend on the order the programs arrive in nor on how many rows a launch holds: the
reduction stays deterministic and batch-invariant with no separate combine. The consumer rounds the sum as the model
does (o_proj's output to bf16, then the residual add to bf16) and takes the norm in its prologue. Per layer:
  K1 qkv      norm(h) @ Wqkv, K/V written to the cache; h = r + bf16(acc_mlp) is rebuilt by every program;
  K2 attn_o   one 64-key split a program; the head's last program to arrive (a counter) combines the splits and
              adds o_h @ Wo[:, head] into acc_attn;
  K3 mlp      h' = h + bf16(acc_attn); norm; 16 rows of gate/up a program, SwiGLU, their down partial into acc_mlp.
Each kernel loads its weights before the PDL wait. Variants: rows a program and split width; the stream published
by each producer's last program (a counter; what the engine's kernels read today) instead of rebuilt by every
consumer; attention's cached keys (and one Wo tile, into L2) loaded before the wait; each link alone.
Random SmolLM2 weights, one token at `--context` cached keys (rotary left out: an epilogue of K1's rows, no link), 30
layers in one CUDA graph; the result is checked against torch (fp32 sums; close, not bitwise) and two replays
against each other (bitwise). The engine's captured step at 30 and 2 layers (the same table, same context) gives
today's cost a layer and the head's, measured in the same call.

python3 scripts/gpu_three_link_probe.py OUT.json [--context 1024] [--rows 8:16:64,8:32:64] [--table shipped.json]
TRITON_INTERPRET=1 python3 scripts/gpu_three_link_probe.py - --cpu --layers 2 --context 100   (the check, no timing)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import triton
import triton.language as tl

from specpilot.kernels.bench import time_graph  # (importing specpilot.kernels fixes the interpreter: --cpu)

H, NH, NKV, D, I, EPS = 576, 9, 3, 64, 1536, 1e-5  # SmolLM2-135M
CH = 64  # K chunk of every sum: H = 9 chunks
# 2^32: partials as int64 fixed point, exact for |sum| < 2^31 (a layer's o_proj / down outputs stay far below; an
# engine build would check the bound, or scale per model)
FX = 4294967296.0


@triton.jit
def _rebuild_h(r_ptr, acc_ptr, C: tl.constexpr):
    """Chunk C (64 elements) of bf16(r + bf16(acc * 2^-32)): the residual add as the model rounds it."""
    ks = C * 64 + tl.arange(0, 64)
    part = (tl.load(acc_ptr + ks, cache_modifier=".cg").to(tl.float32) * (1.0 / 4294967296.0)).to(tl.bfloat16)
    h = (tl.load(r_ptr + ks, cache_modifier=".cg").to(tl.float32) + part.to(tl.float32)).to(tl.bfloat16)
    return h


@triton.jit
def _stream(r_ptr, acc_ptr, C: tl.constexpr, LAST: tl.constexpr):
    """Chunk C of the layer input: published by the producer's last program (LAST), or rebuilt here."""
    if LAST:
        return tl.load(r_ptr + C * 64 + tl.arange(0, 64), cache_modifier=".cg")
    else:
        return _rebuild_h(r_ptr, acc_ptr, C)


@triton.jit
def _wait_then_input(r_ptr, acc_ptr, NC: tl.constexpr, PDL: tl.constexpr, LAST: tl.constexpr):
    """The PDL wait (the weights are already loaded), the release of the next launch, then the layer input."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    hs = ()
    for c in tl.static_range(NC):
        hs = hs + (_stream(r_ptr, acc_ptr, c, LAST),)
    return hs


@triton.jit
def _publish(cnt_ptr, arrivals, r_ptr, acc_ptr, out_ptr, NC: tl.constexpr):
    """The last of `arrivals` programs to arrive (each after its atomics) stores out = bf16(r + bf16(acc)) and zeroes
    acc for the next layer: the stream the engine's kernels read today, at the cost of one serial tail."""
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
        tl.store(cnt_ptr, 0)
        for c in tl.static_range(NC):
            ks = c * 64 + tl.arange(0, 64)
            tl.store(out_ptr + ks, _rebuild_h(r_ptr, acc_ptr, c))
            tl.store(acc_ptr + ks, tl.zeros([64], tl.int64))


@triton.jit
def _normed(hs, g_ptr, eps, NC: tl.constexpr):
    ss = 0.0
    for c in tl.static_range(NC):
        hf = hs[c].to(tl.float32)
        ss += tl.sum(hf * hf, axis=0)
    inv = 1.0 / tl.sqrt(ss / (NC * 64) + eps)
    xs = ()
    for c in tl.static_range(NC):  # LlamaRMSNorm: weight * bf16(h * rsqrt)
        g = tl.load(g_ptr + c * 64 + tl.arange(0, 64))
        xs = xs + (((hs[c].to(tl.float32) * inv).to(tl.bfloat16).to(tl.float32) * g.to(tl.float32)).to(tl.bfloat16),)
    return xs


@triton.jit
def _qkv_kernel(w_ptr, g_ptr, r_ptr, accm_ptr, hres_ptr, acca_ptr, q_ptr, kc_ptr, vc_ptr, pos, eps, ctx_max,
                NQ: tl.constexpr, NK: tl.constexpr, D: tl.constexpr, NC: tl.constexpr, BN: tl.constexpr,
                PDL: tl.constexpr, LAST: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    ks = tl.arange(0, 64)
    ws = ()
    for c in tl.static_range(NC):
        ws = ws + (tl.load(w_ptr + rows[:, None] * (NC * 64) + c * 64 + ks[None, :]),)
    hs = _wait_then_input(r_ptr, accm_ptr, NC, PDL, LAST)
    if (pid == 0) & (not LAST):  # the layer's residual for K3; acc_attn's zeros for K2 (its reader K3 has finished)
        for c in tl.static_range(NC):
            tl.store(hres_ptr + c * 64 + ks, hs[c])
            tl.store(acca_ptr + c * 64 + ks, tl.zeros([64], tl.int64))
    xs = _normed(hs, g_ptr, eps, NC)
    acc = tl.zeros([BN], tl.float32)
    for c in tl.static_range(NC):
        acc += tl.sum(ws[c].to(tl.float32) * xs[c].to(tl.float32)[None, :], axis=1)
    y = acc.to(tl.bfloat16)
    tl.store(q_ptr + rows, y, mask=rows < NQ)
    kv = tl.where(rows >= NQ, rows - NQ, 0)
    slot = (kv % NK) // D * ctx_max * D + pos * D + kv % D
    tl.store(kc_ptr + slot, y, mask=(rows >= NQ) & (rows < NQ + NK))
    tl.store(vc_ptr + slot, y, mask=rows >= NQ + NK)


@triton.jit
def _attn_o_kernel(q_ptr, kc_ptr, vc_ptr, pm_ptr, pl_ptr, pacc_ptr, cnt_ptr, wo_ptr, acca_ptr, accm_ptr, hin_ptr,
                   hmid_ptr, pos, scale, ctx_max, n_splits, H: tl.constexpr, NH: tl.constexpr, GROUP: tl.constexpr,
                   D: tl.constexpr, BK: tl.constexpr, SMAX: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr,
                   LAST: tl.constexpr, EARLY: tl.constexpr):
    head = tl.program_id(0)
    split = tl.program_id(1)
    d = tl.arange(0, D)
    keys = split * BK + tl.arange(0, BK)
    base = (head // GROUP) * ctx_max * D
    kv_off = base + keys[:, None] * D + d[None, :]
    if EARLY:  # before the wait: the cached keys (all but the new one, K1's) and one Wo tile of the head into L2
        k = tl.load(kc_ptr + kv_off, mask=(keys < pos)[:, None], other=0.0)
        v = tl.load(vc_ptr + kv_off, mask=(keys < pos)[:, None], other=0.0)
        wr = (split % (H // RB)) * RB + tl.arange(0, RB)
        wo = tl.load(wo_ptr + wr[:, None] * H + head * D + d[None, :]).to(tl.float32)
        warm = tl.sum(tl.sum(wo, axis=1), axis=0)
        tl.store(pm_ptr + head * SMAX + split, warm, mask=pos < 0)  # never stored: keeps the load
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if (head == 0) & (split == 0) & (not LAST):  # acc_mlp's zeros for K3 (its reader K1 has finished)
        for c in tl.static_range(H // 64):
            tl.store(accm_ptr + c * 64 + tl.arange(0, 64), tl.zeros([64], tl.int64))
    live = keys <= pos
    q = tl.load(q_ptr + head * D + d).to(tl.float32)
    if EARLY:  # the new key and value row, in the split that holds it
        mine = (keys == pos)[:, None]
        k = tl.where(mine, tl.load(kc_ptr + kv_off, mask=mine, other=0.0), k)
        v = tl.where(mine, tl.load(vc_ptr + kv_off, mask=mine, other=0.0), v)
    else:
        k = tl.load(kc_ptr + kv_off, mask=live[:, None], other=0.0)
        v = tl.load(vc_ptr + kv_off, mask=live[:, None], other=0.0)
    s = tl.where(live, tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale, float("-inf"))
    m = tl.max(s, axis=0)
    p = tl.exp(s - m)
    slot = head * SMAX + split
    tl.store(pm_ptr + slot, m)
    tl.store(pl_ptr + slot, tl.sum(p, axis=0))
    tl.store(pacc_ptr + slot * D + d, tl.sum(p[:, None] * v.to(tl.float32), axis=0))
    tl.debug_barrier()  # every thread's partials precede the arrival
    if tl.atomic_add(cnt_ptr + head, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
        tl.store(cnt_ptr + head, 0)  # the head's other programs have all arrived: ready for the next layer
        ss = tl.arange(0, SMAX)
        sl = ss < n_splits
        ms = tl.load(pm_ptr + head * SMAX + ss, mask=sl, other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(pl_ptr + head * SMAX + ss, mask=sl, other=0.0, cache_modifier=".cg")
        accs = tl.load(pacc_ptr + (head * SMAX + ss)[:, None] * D + d[None, :], mask=sl[:, None], other=0.0,
                       cache_modifier=".cg")
        wgt = tl.exp(ms - tl.max(ms, axis=0))
        o = (tl.sum(wgt[:, None] * accs, axis=0) / tl.sum(wgt * ls, axis=0)).to(tl.bfloat16).to(tl.float32)
        for c in tl.static_range(H // RB):
            r = c * RB + tl.arange(0, RB)
            w = tl.load(wo_ptr + r[:, None] * H + head * D + d[None, :])
            part = tl.sum(w.to(tl.float32) * o[None, :], axis=1)
            tl.atomic_add(acca_ptr + r, (part * 4294967296.0).to(tl.int64), sem="relaxed", scope="gpu")
        if LAST:  # the last head publishes the attention block's output stream
            _publish(cnt_ptr + NH, NH, hin_ptr, acca_ptr, hmid_ptr, H // 64)


@triton.jit
def _mlp_kernel(wg_ptr, wu_ptr, wdt_ptr, g_ptr, hres_ptr, acca_ptr, r_ptr, accm_ptr, cnt_ptr, eps,
                NC: tl.constexpr, IB: tl.constexpr, PDL: tl.constexpr, LAST: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * IB + tl.arange(0, IB)
    ks = tl.arange(0, 64)
    wg, wu, wd = (), (), ()
    for c in tl.static_range(NC):
        off = rows[:, None] * (NC * 64) + c * 64 + ks[None, :]
        wg = wg + (tl.load(wg_ptr + off),)
        wu = wu + (tl.load(wu_ptr + off),)
        wd = wd + (tl.load(wdt_ptr + off),)
    hs = _wait_then_input(hres_ptr, acca_ptr, NC, PDL, LAST)
    if (pid == 0) & (not LAST):  # the residual the next layer's K1 adds acc_mlp to
        for c in tl.static_range(NC):
            tl.store(r_ptr + c * 64 + ks, hs[c])
    xs = _normed(hs, g_ptr, eps, NC)
    gate = tl.zeros([IB], tl.float32)
    up = tl.zeros([IB], tl.float32)
    for c in tl.static_range(NC):
        x = xs[c].to(tl.float32)[None, :]
        gate += tl.sum(wg[c].to(tl.float32) * x, axis=1)
        up += tl.sum(wu[c].to(tl.float32) * x, axis=1)
    gf = gate.to(tl.bfloat16).to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(tl.bfloat16).to(tl.float32)
    a = (act * up.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    for c in tl.static_range(NC):
        part = tl.sum(wd[c].to(tl.float32) * a[:, None], axis=0)
        tl.atomic_add(accm_ptr + c * 64 + ks, (part * 4294967296.0).to(tl.int64), sem="relaxed", scope="gpu")
    if LAST:
        _publish(cnt_ptr, tl.num_programs(0), hres_ptr, accm_ptr, r_ptr, NC)


@dataclasses.dataclass
class ThreeLinkStep:
    """Random SmolLM2 layers, their KV cache (keys 0..context-1 filled) and the step's buffers."""
    layers: int
    context: int
    device: torch.device
    rows_qkv: int = 8
    rows_mlp: int = 16
    split_keys: int = 64
    pdl: bool = True
    last: bool = False  # the producers' last programs publish the bf16 stream (the engine's interface) instead
    early: bool = False  # attention loads its cached keys and warms a Wo tile before the PDL wait
    links: tuple[str, ...] = ("qkv", "attn_o", "mlp")  # a subset times one link's share (the others skipped)

    def __post_init__(self):
        dev, L, bf = self.device, self.layers, torch.bfloat16
        g = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(bf).to(dev)
        self.wqkv = rnd(L, (NH + 2 * NKV) * D, H, scale=H ** -0.5)
        self.wo = rnd(L, H, NH * D, scale=(NH * D) ** -0.5)
        self.wg, self.wu = rnd(L, I, H, scale=H ** -0.5), rnd(L, I, H, scale=H ** -0.5)
        self.wdt = rnd(L, I, H, scale=I ** -0.5)  # down_proj.weight transposed: a program's rows are contiguous
        self.g1, self.g2 = 1 + rnd(L, H, scale=0.1), 1 + rnd(L, H, scale=0.1)
        self.ctx_max = self.context + 64
        self.kc = torch.zeros(L, NKV, self.ctx_max, D, dtype=bf, device=dev)
        self.vc = torch.zeros_like(self.kc)
        self.kc[:, :, :self.context] = rnd(L, NKV, self.context, D)
        self.vc[:, :, :self.context] = rnd(L, NKV, self.context, D)
        self.x0 = rnd(H)
        self.splits = triton.cdiv(self.context + 1, self.split_keys)
        self.smax = triton.next_power_of_2(self.splits)
        z = dict(device=dev)
        self.r, self.hres, self.hmid, self.q = (torch.empty(n, dtype=bf, **z) for n in (H, H, H, NH * D))
        self.acca, self.accm = torch.zeros(H, dtype=torch.int64, **z), torch.zeros(H, dtype=torch.int64, **z)
        self.pm, self.pl = torch.empty(NH * self.smax, **z), torch.empty(NH * self.smax, **z)
        self.pacc = torch.empty(NH * self.smax * D, **z)
        self.cnt = torch.zeros(NH + 1, dtype=torch.int32, **z)  # a head's splits; the heads (LAST)
        self.cnt_mlp = torch.zeros(1, dtype=torch.int32, **z)

    def weight_bytes(self) -> int:
        return sum(t.numel() * 2 for t in (self.wqkv, self.wo, self.wg, self.wu, self.wdt))

    def run(self) -> None:
        self.r.copy_(self.x0)
        self.accm.zero_()
        kw = {"launch_pdl": True} if self.pdl else {}
        pos, nqkv = self.context, (NH + 2 * NKV) * D
        for layer in range(self.layers):
            self._launch_layer(layer, pos, nqkv, kw)

    def _launch_layer(self, layer: int, pos: int, nqkv: int, kw: dict) -> None:
        if "qkv" in self.links:
            _qkv_kernel[(nqkv // self.rows_qkv,)](
                self.wqkv[layer], self.g1[layer], self.r, self.accm, self.hres, self.acca, self.q, self.kc[layer],
                self.vc[layer], pos, EPS, self.ctx_max, NQ=NH * D, NK=NKV * D, D=D, NC=H // CH, BN=self.rows_qkv,
                PDL=self.pdl, LAST=self.last, num_warps=4, **kw)
        if "attn_o" in self.links:
            _attn_o_kernel[(NH, self.splits)](
                self.q, self.kc[layer], self.vc[layer], self.pm, self.pl, self.pacc, self.cnt, self.wo[layer],
                self.acca, self.accm, self.r, self.hmid, pos, D ** -0.5, self.ctx_max, self.splits, H=H, NH=NH,
                GROUP=NH // NKV, D=D, BK=self.split_keys, SMAX=self.smax, RB=64, PDL=self.pdl, LAST=self.last,
                EARLY=self.early, num_warps=4, **kw)
        if "mlp" in self.links:
            _mlp_kernel[(I // self.rows_mlp,)](
                self.wg[layer], self.wu[layer], self.wdt[layer], self.g2[layer], self.hmid if self.last else self.hres,
                self.acca, self.r, self.accm, self.cnt_mlp, EPS, NC=H // CH, IB=self.rows_mlp, PDL=self.pdl,
                LAST=self.last, num_warps=8, **kw)

    def output(self) -> torch.Tensor:
        """The last layer's output h (bf16), as the next layer's K1 would read it."""
        if self.last:
            return self.r.clone()
        part = (self.accm.double() / FX).float().to(torch.bfloat16)
        return (self.r.float() + part.float()).to(torch.bfloat16)

    def reference(self) -> torch.Tensor:
        """The same layers in torch with the model's roundings (fp32 sums in torch's order)."""
        from specpilot.kernels.rmsnorm import rms_norm_ref as norm
        h, pos = self.x0, self.context
        kc, vc = self.kc.clone(), self.vc.clone()
        for layer in range(self.layers):
            qkv = (self.wqkv[layer].float() @ norm(h, self.g1[layer], EPS).float()).to(torch.bfloat16)
            q = qkv[:NH * D].view(NH, D).float()
            kc[layer, :, pos] = qkv[NH * D:(NH + NKV) * D].view(NKV, D)
            vc[layer, :, pos] = qkv[(NH + NKV) * D:].view(NKV, D)
            k = kc[layer, :, :pos + 1].float().repeat_interleave(NH // NKV, 0)
            v = vc[layer, :, :pos + 1].float().repeat_interleave(NH // NKV, 0)
            att = torch.softmax((k @ q[:, :, None])[..., 0] * D ** -0.5, -1)
            o = (att[:, None, :] @ v)[:, 0].reshape(-1).to(torch.bfloat16)
            h = (h.float() + (self.wo[layer].float() @ o.float()).to(torch.bfloat16).float()).to(torch.bfloat16)
            x = norm(h, self.g2[layer], EPS).float()
            gate = (self.wg[layer].float() @ x).to(torch.bfloat16)
            up = (self.wu[layer].float() @ x).to(torch.bfloat16)
            a = (torch.nn.functional.silu(gate.float()).to(torch.bfloat16).float() * up.float()).to(torch.bfloat16)
            h = (h.float() + (self.wdt[layer].float().T @ a.float()).to(torch.bfloat16).float()).to(torch.bfloat16)
        return h


def check(step: ThreeLinkStep) -> dict:
    step.run()
    first = step.output()
    step.run()
    again = step.output()
    ref = step.reference()
    err = ((first.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return {"replays_equal": bool(torch.equal(first, again)), "max_rel_err_vs_torch": err}


def engine_ms(context: int, layers: int, table, reps: int) -> float:
    """The engine's captured one-token step at SmolLM2's shapes with `layers` layers (step_gate's timer)."""
    from specpilot.engines.shapes import SMOLLM2_135M
    from specpilot.stages.step_gate import step_timer
    shape = dataclasses.replace(SMOLLM2_135M, layers=layers)
    return step_timer(shape, torch.device("cuda"), torch.bfloat16, context, reps, rounds=3)([(table, 1)])[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rows", default="8:16:64,8:32:64,16:16:64,8:16:128",
                    help="qkv rows : mlp rows a program : keys an attention split, comma-separated")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--table", help="the engine's kernel table (a pair list / summary.json) for its baseline")
    ap.add_argument("--cpu", action="store_true", help="interpreter check: no PDL, no timing")
    a = ap.parse_args()
    if a.cpu:
        res = check(ThreeLinkStep(a.layers, a.context, torch.device("cpu"), pdl=False))
        print(res)
        sys.exit(0 if res["replays_equal"] and res["max_rel_err_vs_torch"] < 0.05 else 1)
    dev, rows = torch.device("cuda"), []
    for spec in a.rows.split(","):
        rq, rm, bk = (int(x) for x in spec.split(":"))
        for pdl in (True, False):
            step = ThreeLinkStep(a.layers, a.context, dev, rq, rm, bk, pdl)
            res = check(step)
            ms = time_graph([step.run], a.reps)
            rows.append({"variant": f"3 links, qkv {rq} rows, mlp {rm} rows, {bk}-key splits, pdl {pdl}", "ms": ms,
                         "us_per_layer": ms * 1e3 / a.layers, **res})
            del step
    from gpu_profile import hbm_read_gbs  # scripts/ is the script's own folder
    floor_us = ThreeLinkStep(1, 64, dev).weight_bytes() / hbm_read_gbs() / 1e3
    from specpilot.kernels.table import read_pairs
    table = read_pairs(a.table) if a.table else ()
    e30, e2 = engine_ms(a.context, a.layers, table, a.reps), engine_ms(a.context, 2, table, a.reps)
    per = (e30 - e2) / (a.layers - 2)
    head = e2 - 2 * per
    rows.append({"variant": f"engine, {a.layers} layers", "ms": e30, "us_per_layer": per * 1e3})
    rows.append({"variant": "engine, 2 layers", "ms": e2, "head_and_rest_ms": head})
    if a.out != "-":
        json.dump({"context": a.context, "layers": a.layers, "rows": rows, "floor_us_per_layer": floor_us},
                  open(a.out, "w"), indent=1)
    print(f"| SmolLM2 x{a.layers}, context {a.context} | ms | us a layer | replays equal | rel err vs torch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ms']:.4f} | {r.get('us_per_layer', float('nan')):.2f} | "
              f"{r.get('replays_equal', '')} | {r.get('max_rel_err_vs_torch', float('nan')):.2g} |")
    best = min(r["ms"] for r in rows if r["variant"].startswith("3 links") and r["replays_equal"])
    print(f"engine head + the rest (2-layer step - 2 layers): {head:.4f} ms; weight floor a layer {floor_us:.2f} us; "
          f"predicted step with the best three-link layers: {best + head:.4f} ms (engine today {e30:.4f})")


if __name__ == "__main__":
    main()
