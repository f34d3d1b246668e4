"""The batched Llama forward: every request's tokens in one fused forward, attention paged per request.

It IS engines.fused.fused_forward (same launches, same launch table, same LM-head argmax), run with its
attention calls routed to the paged kernel: the projections, norms, SwiGLU and rotary/KV-write kernels are
batch-invariant per row (BLOCK_M token tiles, a fixed K order), so a row's bits do not depend on how many
requests share the forward; only attention is per request. Reusing fused_forward rather than mirroring it
keeps the two identical while fused_forward evolves. fused_forward takes no attention function, so the
routing swaps the kernels package's `attention` for the duration of the call (single-threaded: nothing
else runs meanwhile; inside a CUDA graph only the launched kernels remain) and checks that every layer's
attention went through it.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from specpilot.engines.batch.paged_attn import PagedMeta, paged_attention
from specpilot.engines.fused import FusedTables, fused_forward
from specpilot.engines.llama import LlamaModel
from specpilot.kernels.attn import AttentionParams


class _Probe(Exception):
    def __init__(self, params: dict):
        self.params = params


@contextlib.contextmanager
def _attention_routed_to(fn):
    """Replaces `attention` where fused_forward resolves it (the kernels package, or fused's own namespace)."""
    import specpilot.kernels as kernels
    fused_mod = sys.modules[fused_forward.__module__]
    saved = [(m, m.attention) for m in (kernels, fused_mod) if hasattr(m, "attention")]
    for m, _ in saved:
        m.attention = fn
    try:
        yield
    finally:
        for m, orig in saved:
            m.attention = orig


def attention_params(model: LlamaModel, tables: FusedTables) -> AttentionParams:
    """The attention launch fused_forward uses for this model (its split_keys is the KV page size): read by
    letting it run to its first attention call on a one-token scratch cache."""
    sh = model.shape
    dev, dtype = tables.cos.device, next(model.parameters()).dtype
    cache = torch.zeros(sh.layers, sh.kv_heads, 16, sh.head_dim, dtype=dtype, device=dev)
    one = torch.zeros(1, dtype=torch.long, device=dev)

    def probe(q, k_cache, v_cache, base, anc, *, block_slots=None, **params):
        raise _Probe(params)

    with _attention_routed_to(probe), torch.no_grad():
        try:
            fused_forward(model, tables, one, one, one, one, None, cache, cache.clone(), want_logits=False)
        except _Probe as p:
            return AttentionParams(**p.params)
    raise RuntimeError("fused_forward made no attention call: engines/batch/model.py needs updating")


def batch_forward(model: LlamaModel, tables: FusedTables, ids: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, meta: PagedMeta, k_caches: torch.Tensor, v_caches: torch.Tensor,
                  page: int, max_kv_len: int | None = None, want_logits: bool = False, capture: tuple[int, ...] = ()):
    """ids/positions/slots [N] int64 (slot -1: a padding token that writes no KV); caches [layers, kv_heads,
    S, D] paged by `page` slots. Returns (fp32 logits [N, vocab] or None, argmax [N], the outputs of the target
    layers in `capture` as a layer-major [layers, N, hidden] stack or None: a block drafter's features,
    fused.feature_rows); padding rows are meaningless."""
    calls = []

    def paged(q, k_cache, v_cache, base, anc, *, block_slots=None, **params):
        p = AttentionParams(**params)
        if p.split_keys != page or block_slots is not None:
            raise RuntimeError(f"fused_forward's attention (split_keys={p.split_keys}, block_slots="
                               f"{block_slots is not None}) no longer matches the paged cache (page {page})")
        calls.append(1)
        return paged_attention(q, k_cache, v_cache, meta, params=p, max_kv_len=max_kv_len)

    with _attention_routed_to(paged):
        logits, argmax, captured = fused_forward(model, tables, ids, positions, slots, None, None, k_caches,
                                                 v_caches, capture, want_logits=want_logits)
    if len(calls) != model.shape.layers:
        raise RuntimeError(f"fused_forward routed {len(calls)} of {model.shape.layers} attention calls to the paged "
                           "kernel: engines/batch/model.py needs updating")
    return logits, argmax, captured
