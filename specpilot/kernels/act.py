"""SwiGLU activation of the fused gate_up projection: out = silu(gate) * up, elementwise.

Rounding follows transformers' LlamaMLP in the activation dtype: silu is evaluated in fp32 and rounded to the
dtype, then multiplied by `up` and rounded again (torch's bf16 ops do exactly that). Elementwise, so trivially
batch-invariant: every output element depends only on its own two inputs. `silu_mul` is shared with the fused
prologue of `gemm.swiglu_linear`, so the fused and the separate path give identical bits.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ._common import ACT_DTYPES, LaunchParams, check_launchable, check_out, check_tensor


@dataclasses.dataclass(frozen=True)
class SwigluParams(LaunchParams):
    """Elementwise kernel: every field is T-neutral."""

    block_i: int = 1024
    num_warps: int = 4
    T_NEUTRAL: ClassVar[tuple[str, ...]] = ("block_i", "num_warps")
    SEARCH_SPACE: ClassVar[dict[str, tuple]] = {"block_i": (256, 512, 1024, 2048), "num_warps": (2, 4, 8)}


@triton.jit
def silu_mul(g, u):
    """silu(g) * u with the dtype roundings of torch: round(round(silu_fp32(g)) * u)."""
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit(do_not_specialize=["T"])
def _swiglu_kernel(gu_ptr, out_ptr, T, I, BLOCK_I: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = cols < I
    row = t.to(tl.int64) * (2 * I)
    g = tl.load(gu_ptr + row + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row + I + cols, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * I + cols, silu_mul(g, u), mask=ok)


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain torch: gate_up [T, 2I] = [gate ; up] along the last dim -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu(gate_up: torch.Tensor, *, out: torch.Tensor | None = None, block_i: int = 1024,
           num_warps: int = 4) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] contiguous (bf16/fp16/fp32) -> [T, I] of the same dtype."""
    SwigluParams(block_i=block_i, num_warps=num_warps)
    check_tensor("gate_up", gate_up, (None, None), ACT_DTYPES)
    T, I2 = gate_up.shape
    if T < 1 or I2 < 2 or I2 % 2:
        raise ValueError(f"gate_up must be [T >= 1, 2*I] with an even last dim, got {list(gate_up.shape)}")
    check_launchable(_swiglu_kernel, gate_up.device)
    I = I2 // 2
    out = check_out("out", out, (T, I), gate_up.dtype, gate_up.device)
    _swiglu_kernel[(T, triton.cdiv(I, block_i))](gate_up, out, T, I, BLOCK_I=block_i, num_warps=num_warps)
    return out
