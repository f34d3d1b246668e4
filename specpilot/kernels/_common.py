"""Shared pieces of the batch-invariant Triton kernels: argument checks, launch parameters, dtype helpers.

Batch invariance (DESIGN.md, "Losslessness"): the bits of a token's output row never depend on how many
tokens the call holds or on what the other rows contain. Every kernel here gets that the same way:
- tokens are tiled by the fixed BLOCK_M below (padding rows masked to zero), never by a T-dependent size;
- every reduction runs in an order fixed by constants of the kernel (BLOCK_K, a key block, a split size),
  never by T; reductions over a tile go through `tl.dot`, whose per-element accumulation order is fixed by
  the instruction and the K loop and so does not depend on num_warps (unlike `tl.sum`, whose tree follows
  the thread layout); `tl.max` is exact in any order;
- no atomic on a value (split-K counts arrivals; its partials are added in a fixed order), no split whose
  boundaries depend on T.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Sequence

import torch

from specpilot.collector import collector_paused

BLOCK_M = 16  # token tile of every token-tiled kernel; part of the numerics, never tuned
# Token tiles of the projections: BLOCK_M rows through tensor-core dots, or one row per program through
# CUDA-core products (no 16-row MMA tile to fill at T=1). Part of the numerics: a build picks one for every T.
ROW_TILES = (BLOCK_M, 1)
# Rows of a tensor-core tile: 32 runs the same m16n8k16 dots on two 16-row slabs (test_kernel_codegen), so each row's
# bits are the 16-row tile's and the choice is T-neutral; 64 rows would compile to wgmma, another instruction.
MMA_TILE_ROWS = (BLOCK_M, 2 * BLOCK_M)
# CUDA-graph capture mode for graphs holding Triton launches: "global" aborts on the Triton launcher's driver
# queries (seen on the H200 with triton 3.6); "thread_local" only forbids unsafe calls from other threads.
CAPTURE_ERROR_MODE = "thread_local"


def capture_graph(body, warmups: int = 2, pool=None, keep_graph: bool = False):
    """(graph, body's outputs): `body` run `warmups` times on a side stream (Triton compiles, cuBLAS picks its
    kernels, the allocator warms: capture forbids all three), then captured on that same stream (keep_graph: not
    instantiated, its cudaGraph_t handed out by raw_cuda_graph(), for engines.graph_if). Always an
    explicit capture stream: torch.cuda.graph's default one is shared by the class and lives on whichever GPU
    captured first, so a second GPU's worker thread would capture (and launch Triton) on the first GPU."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    # No automatic garbage collection while capturing: a collection that frees an unreachable CUDA graph (say a
    # dropped runner's, kept in a reference cycle) destroys it mid-capture, which the driver refuses and which
    # invalidates this capture ("operation not permitted when stream is capturing (function reset)", seen on an
    # H200 in about one tuner run in three). torch.cuda.graph no longer collects on entry (force_cudagraph_gc).
    # The likely cause, read from that failure's trace; dropping a replayed graph in a cycle during a capture did
    # not reproduce it in isolation on the H200 (session 9), so no test pins it.
    with collector_paused(), torch.cuda.graph(graph, pool=pool, stream=stream,
                                              capture_error_mode=CAPTURE_ERROR_MODE):
        out = body()
    return graph, out
# Launch option of kernels whose bits two different kernels must reproduce (single-request and paged attention):
# without it the compiler contracts a*b+c into one FMA wherever the surrounding code lets it, so two kernels
# with the same arithmetic statements can round differently (seen on an H200: 1-ulp differences in a few rows).
NO_FP_FUSION = {"enable_fp_fusion": False}

# Arrival counters per device, shared by every launch that counts arrivals (split-K, gemm.split_k_combine): each
# leaves them at 0, and launches on one stream never overlap on them (a PDL launch touches them only after its
# wait). Concurrent streams must not run such launches.
ARRIVAL_COUNTERS = 1 << 18
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed arrival counters, made on first use (warm-up runs before any graph capture)."""
    if device not in _ARRIVALS:
        _ARRIVALS[device] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return _ARRIVALS[device]


ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_POW2_WARPS = (1, 2, 4, 8, 16)
# Register caps a thread (ptxas maxnreg) the projections may launch with; None: ptxas's own count. A cap only moves
# registers (spilling a few bytes at most), never an instruction's arithmetic: T-neutral. At 4 warps, 168 registers
# fit 3 programs an SM and 128 fit 4 where the W12 decode otherwise takes 180-184 (2): session 30 measured the 8B
# QKV norm launch 34.0 -> 25.6 us with 168 on an H200.
MAX_REGISTERS = (None, 168, 128)


def register_cap(max_registers: int | None) -> dict[str, int]:
    """The launch option of a max_registers setting ({} for None)."""
    return {} if max_registers is None else {"maxnreg": max_registers}
# K per rounding step of the interpreter's float tl.dot (fix 3 of _fix_interpreter): an MMA's K (m16n8k16).
DOT_K_STEP = 16


@dataclasses.dataclass(frozen=True)
class LaunchParams:
    """Base of each kernel's launch parameters (a later kernel tuner searches these).

    T_NEUTRAL names the fields that change no bit of any output: a tuner may pick them per (shape, T).
    Every other field sets a reduction order: it may be tuned per model shape but must then hold for every T
    of that shape, and changing it changes the engine's numerics (its AR output may then differ from stock).
    """

    T_NEUTRAL: ClassVar[tuple[str, ...]] = ()
    SEARCH_SPACE: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def as_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def t_neutral(self) -> tuple[str, ...]:
        """T_NEUTRAL for this setting. With one row per program (row_tile=1) a K chunk is reduced by tl.sum, whose
        tree follows the tile's thread layout: the tile width and the warps then set the numerics too."""
        if getattr(self, "row_tile", BLOCK_M) == 1:
            return tuple(f for f in self.T_NEUTRAL if f not in ("block_n", "num_warps"))
        return self.T_NEUTRAL

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "num_warps" and v not in _POW2_WARPS + ((None,) if f.default is None else ()):
                raise ValueError(f"num_warps={v} must be one of {_POW2_WARPS}")
            if f.name == "num_stages" and v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"num_stages={v} must be a positive int (or None: a default)")
            if f.name == "max_registers" and v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                                                or not 32 <= v <= 255):
                raise ValueError(f"max_registers={v!r} must be None or an int in 32..255")
            if f.name == "row_tile" and v not in ROW_TILES:
                raise ValueError(f"row_tile={v!r} must be one of {ROW_TILES}")
            if f.name == "tile_rows" and v not in MMA_TILE_ROWS:
                raise ValueError(f"tile_rows={v!r} must be one of {MMA_TILE_ROWS}")
            if f.name.startswith("block_") and v is not None and (not isinstance(v, int) or v < 16 or v & (v - 1)):
                raise ValueError(f"{f.name}={v} must be a power of two >= 16")
        if getattr(self, "row_tile", BLOCK_M) == 1 and getattr(self, "tile_rows", BLOCK_M) != BLOCK_M:
            raise ValueError("tile_rows sets the rows of a tensor-core tile: row_tile=1 (one row a program) takes the "
                             "default")

    def program_rows(self) -> int:
        """Token rows a program owns (the kernels' BLOCK_M): one with row_tile=1, else tile_rows (default 16)."""
        return 1 if getattr(self, "row_tile", BLOCK_M) == 1 else getattr(self, "tile_rows", BLOCK_M)


def _fix_interpreter() -> None:
    """Three fixes to triton 3.6's interpreter (TRITON_INTERPRET=1), which runs the kernels on CPU in the tests.

    1. It turns a scalar into a Python int with int(ndarray), and its scalars are 1-element arrays, which
       numpy >= 2.4 refuses, so `for k in range(0, K, BLOCK_K)` fails (triton-lang/triton#9171, fixed upstream
       after 3.6): install the upstream fix.
    2. It rounds fp32 -> bf16 by truncation, where the GPU (cvt.rn) and torch round to nearest even: convert
       through torch, so interpreted kernels round like compiled ones.
    3. Its `tl.dot` multiplies bf16's raw uint16 bits as integers, and for floats it calls BLAS, whose result for
       a row depends on the row's position in the tile (OpenBLAS sgemm handles rows 6..11 of 16 with another
       micro-kernel), so the interpreter could not show batch invariance. Float dots are replaced by 16-wide K
       steps in ascending k, the same for every output element: for each slice s of 16 k's,
       `acc = fp32(acc + fp32(sum over s of the exact products, in fp64, ascending k))` -- the slice sum is
       rounded to fp32 once, then added to the fp32 accumulator (one more rounding). Why per 16: the GPU's MMA
       (m16n8k16) rounds once per 16-wide K instruction, chained through the accumulator in K order, so on the GPU
       one 256-wide dot, two 128-wide and eight chained 32-wide dots over the same K give the same bits; the
       interpreter keeps that property (a kernel that runs eight 32-wide dots, such as W12 decode, equals one that
       runs one wide dot, bit for bit, on CPU). One rounding of the whole K's fp64 sum (this fix's first form)
       made the result depend on the dot's width. The exact fp32 rounding inside an MMA is only modelled, not
       reproduced: the interpreter's bits are not the GPU's. A K that is not a multiple of 16 (the interpreter
       accepts any K >= 1; a GPU 16-bit dot needs a power of two >= 16) is not refused: its last slice is
       shorter (K < 16: one slice, as before), so interpreter-only tiny shapes keep running.
    All only touch the interpreter; re-running is a no-op.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a triton without an interpreter
        return
    if getattr(interpreter, "_specpilot_fixed", False):
        return
    import numpy as np
    import triton.language as tl

    orig_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    orig_convert = interpreter._convert_float

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            f = torch.from_numpy(np.array(data).view(np.float32))
            return f.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            return (np.array(data).view(np.uint16).astype(np.uint32) << 16).view(np.uint32)
        return orig_convert(data, input_dtype, output_dtype, rounding_mode)

    orig_dot = interpreter.InterpreterBuilder.create_dot
    floats = (tl.bfloat16, tl.float16, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar not in floats or b.dtype.scalar not in floats or d.dtype.scalar != tl.float32:
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        def f64(h):
            data = h.data
            if h.dtype.scalar == tl.bfloat16:
                data = convert_float(data, tl.bfloat16, tl.float32, None).view(np.float32)
            return data.astype(np.float64)

        def slice_sums(x, y, w):
            # x [..., M, S*w], y [..., S*w, N] -> [..., M, S, N]: per w-wide k slice, the exact products summed
            # in fp64 in ascending k (explicit adds: np.add.reduce may sum pairwise along a contiguous axis)
            s = x.shape[-1] // w
            prod = (x.reshape(x.shape[:-1] + (s, w))[..., :, :, :, None]
                    * y.reshape(y.shape[:-2] + (s, w) + y.shape[-1:])[..., None, :, :, :])  # [..., M, S, w, N]
            total = prod[..., 0, :].copy()
            for j in range(1, w):
                total += prod[..., j, :]
            return total

        x, y = f64(a), f64(b)  # [..., M, K], [..., K, N]
        k_full = x.shape[-1] - x.shape[-1] % DOT_K_STEP
        parts = []
        if k_full:
            parts.append(slice_sums(x[..., :k_full], y[..., :k_full, :], DOT_K_STEP))
        if k_full < x.shape[-1]:  # a shorter last slice (K not a multiple of 16: interpreter-only shapes)
            parts.append(slice_sums(x[..., k_full:], y[..., k_full:, :], x.shape[-1] - k_full))
        sums = np.concatenate(parts, axis=-2).astype(np.float32)  # each slice sum rounded to fp32 once
        acc = np.array(d.data, dtype=np.float32)
        for i in range(sums.shape[-2]):  # ascending k: one fp32 add (rounding) per slice
            acc = acc + sums[..., i, :]
        return interpreter.TensorHandle(acc, tl.float32)

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._convert_float = convert_float
    interpreter.InterpreterBuilder.create_dot = create_dot
    interpreter._specpilot_fixed = True


_fix_interpreter()


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` was built under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_tensor(name: str, t: Any, shape: Sequence[int | None] | None = None,
                 dtypes: Iterable[torch.dtype] | torch.dtype | None = None, device: torch.device | None = None,
                 contiguous: bool = True) -> torch.Tensor:
    """Raise a ValueError naming `name` unless `t` is a tensor of that shape (None: any), dtype, device, layout."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if dtypes is not None:
        allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
        if t.dtype not in allowed:
            raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in allowed)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()} for shape {list(t.shape)}")
    return t


def check_launchable(kernel: Any, device: torch.device) -> None:
    """Compiled kernels need CUDA tensors; the interpreter takes CPU tensors too."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(f"Triton kernels need CUDA tensors, got tensors on {device}; on CPU use the *_ref "
                         "functions, or set TRITON_INTERPRET=1 before importing specpilot.kernels")


def check_int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}={v} must be in [{lo}, {'inf' if hi is None else hi}]")
    return v


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots must be exact fp32 (FMA) rather than tf32, so they match an fp32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def check_out(name: str, out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Validate a caller-provided output buffer, or allocate one."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return check_tensor(name, out, shape, dtype, device)
