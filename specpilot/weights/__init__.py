"""Lossless weight formats. W12: bf16 weights in about 12 bits (sign+mantissa byte, 4-bit exponent code, escapes).

format.py: the W12Tensor arrays, encode / decode / concat_rows and stats; pack.py: the packed-directory layout
(pack_model, load_w12 with its round-trip check, verify); model.py: the fused per-layer W12 weights the engine's
Triton forward reads (decoded inside the projection kernels: specpilot.kernels.w12_tile); oct.py: the packed-register
kernel layout derived from a W12 tensor, which the projection kernels read (notes/w12-oct-plan.md); cli.py:
`specpilot weights pack|verify`.
"""
from specpilot.weights.format import (ESCAPE, W12Error, W12Stats, W12Tensor, bitwise_equal, concat_rows, decode,
                                      encode, sha256_bf16, sum_stats)
from specpilot.weights.model import W12Layer, W12Weights
from specpilot.weights.pack import (MANIFEST_NAME, TensorEntry, VerifyReport, VerifyRow, W12Manifest, load_w12,
                                    pack_model, verify)

__all__ = [
    "ESCAPE", "W12Error", "W12Stats", "W12Tensor", "bitwise_equal", "concat_rows", "decode", "encode", "sha256_bf16",
    "sum_stats", "W12Layer", "W12Weights",
    "MANIFEST_NAME", "TensorEntry", "VerifyReport", "VerifyRow", "W12Manifest", "load_w12", "pack_model", "verify",
]
