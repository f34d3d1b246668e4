"""Batch-invariant Triton kernels of a Llama-family decode/verify step, with their pure-torch references.

Each kernel gives bit-identical results for a token row whatever the number of tokens in the call and whatever
the other rows hold (see _common.py for how). The `*_ref` functions are the CPU path of the engine and the
tests' oracle. Kernels need CUDA tensors, or TRITON_INTERPRET=1 set before this package is imported.
"""
from ._common import BLOCK_M, MAX_REGISTERS, ROW_TILES, LaunchParams
from .attn import AttentionParams, attention, attention_ref
from .accept import AcceptParams, greedy_accept, greedy_accept_ref
from .gemm import BLOCK_K, LinearParams, linear, linear_ref, swiglu_linear, swiglu_linear_ref
from .norm_gemm import RMSNormLinearParams, rms_norm_ref, rmsnorm_linear, rmsnorm_linear_ref
from .rope_kv import RopeKVParams, rope_kv_write, rope_kv_write_ref, rope_tables
from .act import SwigluParams, swiglu, swiglu_ref

__all__ = [
    "BLOCK_K", "BLOCK_M", "MAX_REGISTERS", "ROW_TILES", "LaunchParams",
    "AttentionParams", "attention", "attention_ref",
    "AcceptParams", "greedy_accept", "greedy_accept_ref",
    "LinearParams", "linear", "linear_ref", "swiglu_linear", "swiglu_linear_ref",
    "RMSNormLinearParams", "rms_norm_ref", "rmsnorm_linear", "rmsnorm_linear_ref",
    "RopeKVParams", "rope_kv_write", "rope_kv_write_ref", "rope_tables",
    "SwigluParams", "swiglu", "swiglu_ref",
]
