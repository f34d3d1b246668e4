"""Captured CUDA graphs that run only while a device flag is set: CUDA graph conditional (IF) nodes around them.

The device loop queues its next chunk before it reads the current one (overlap); when the current one stops the
request, the queued chunk only costs time (on the H200 a whole chain step: 2% of the overlapped chain's decode
time in session 34, the short requests weighing most). Its replay here first reads the loop's `live` flag on the
device and skips the chunk's body when it is 0. AR decoding chains several steps a graph (engines.graphs): there
each step after the first runs behind a guard that also clears the flag when the step before it produced a stop
token, so the steps past an EOS are skipped as the engine's are.

torch 2.11's CUDAGraph cannot capture into a conditional node (that API came later), so the parent graph is built
with the CUDA driver API through ctypes: a one-thread kernel (compiled once by NVRTC) updates the flag and sets the
node's handle from it, and the IF node's body holds the captured graph as a child graph. The captured torch graphs
must be kept (CUDAGraph(keep_graph=True)): their memory pools back the bodies' tensors.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from functools import cache
from typing import NamedTuple

import torch

_SETTER_SRC = rb"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);
extern "C" __global__ void set_if_live(cudaGraphConditionalHandle handle, long long *live, const long long *token,
                                       const long long *stop_ids, int n_stop) {
    long long l = *live;
    if (token != 0) {  // the step before the guarded body: a stop token ends the run
        for (int i = 0; l != 0 && i < n_stop; i++) {
            if (*token == stop_ids[i]) l = 0;
        }
        *live = l;
    }
    cudaGraphSetConditional(handle, l != 0);
}
"""
_NODE_CONDITIONAL, _COND_IF = 13, 0  # CUgraphNodeType, CUgraphConditionalNodeType


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("params", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _ConditionalParams(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [("handle", ctypes.c_ulonglong), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("graphs_out", ctypes.POINTER(ctypes.c_void_p)), ("ctx", ctypes.c_void_p)]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams: 256 bytes, the union at byte 16
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("conditional", _ConditionalParams),
                ("pad", ctypes.c_char * (232 - ctypes.sizeof(_ConditionalParams))), ("reserved2", ctypes.c_longlong)]


class _Driver:
    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.nvrtc = _load_nvrtc()

    def check(self, res: int, what: str) -> None:
        if res != 0:
            msg = ctypes.c_char_p()
            self.cu.cuGetErrorString(res, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA driver error {res} ({(msg.value or b'?').decode()})")

    def setter(self) -> ctypes.c_void_p:
        """The flag -> handle kernel, PTX from NVRTC for this device, loaded into the current context."""
        nv, prog = self.nvrtc, ctypes.c_void_p()

        def nv_check(res: int, what: str) -> None:
            if res != 0:
                raise RuntimeError(f"NVRTC {what}: error {res}")
        nv_check(nv.nvrtcCreateProgram(ctypes.byref(prog), _SETTER_SRC, b"graph_if.cu", 0, None, None), "create")
        major, minor = torch.cuda.get_device_capability()
        opts = (ctypes.c_char_p * 1)(f"--gpu-architecture=compute_{major}{minor}".encode())
        res = nv.nvrtcCompileProgram(prog, 1, opts)
        if res != 0:
            size = ctypes.c_size_t()
            nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the conditional setter: {log.value.decode()}")
        size = ctypes.c_size_t()
        nv_check(nv.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
        ptx = ctypes.create_string_buffer(size.value)
        nv_check(nv.nvrtcGetPTX(prog, ptx), "PTX")
        nv.nvrtcDestroyProgram(ctypes.byref(prog))
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(module), ptx), "cuModuleLoadData")
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(func), module, b"set_if_live"), "cuModuleGetFunction")
        return func


def _load_nvrtc() -> ctypes.CDLL:
    """NVRTC from the system or from the pip packages torch's CUDA wheels install (nvidia/*/lib)."""
    names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for p in sys.path:
        names += sorted(glob.glob(os.path.join(p, "nvidia", "**", "libnvrtc.so*"), recursive=True))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("NVRTC (libnvrtc.so) not found: needed to compile the conditional setter")


@cache
def _driver_for(device_index: int) -> tuple[_Driver, ctypes.c_void_p]:
    with torch.cuda.device(device_index):
        torch.cuda.init()
        drv = _Driver()
        return drv, drv.setter()


@cache
def unsupported_reason() -> str | None:
    """None where guarded graphs work here, else why not (the loop then runs queued chunks in full)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        if not hasattr(torch.cuda.CUDAGraph(keep_graph=True), "raw_cuda_graph"):
            raise TypeError
    except TypeError:
        return f"torch {torch.__version__}'s CUDAGraph cannot hand out its captured graph"
    try:
        _driver_for(torch.cuda.current_device())
    except (OSError, RuntimeError, AttributeError) as e:
        return str(e)
    return None


class Guard(NamedTuple):
    """A body runs only while live (one int64 on the device) is nonzero; with token (one int64) and stop_ids (int64
    [n]), live is first cleared where token is one of them."""
    live: torch.Tensor
    token: torch.Tensor | None = None
    stop_ids: torch.Tensor | None = None

    def check(self) -> None:
        def one(name: str, t: torch.Tensor | None, single: bool = True) -> None:
            if t is None or t.dtype != torch.int64 or not t.is_cuda or t.numel() < 1 or (single and t.numel() != 1):
                raise ValueError(f"{name}: {'one int64' if single else 'int64 ids'} on a CUDA device")
        one("live", self.live)
        if (self.token is None) != (self.stop_ids is None):
            raise ValueError("a guard's token and stop_ids come together")
        if self.token is not None:
            one("token", self.token)
            one("stop_ids", self.stop_ids, single=False)


class GuardedChain:
    """Replays captured graphs (keep_graph=True, not instantiated) in order, as one graph launch: a part whose guard
    is None always runs; a guarded part runs only while its Guard's flag is set when the launch reaches it."""

    def __init__(self, parts: list[tuple["torch.cuda.CUDAGraph", Guard | None]]):
        if not parts:
            raise ValueError("a guarded chain needs at least one graph")
        for _, guard in parts:
            if guard is not None:
                guard.check()
        dev = next((g.live.device.index for _, g in parts if g is not None), torch.cuda.current_device())
        drv, setter = _driver_for(dev)
        cu, chk = drv.cu, drv.check
        self.parts, self._drv = parts, drv  # each body's memory pool lives with its graph
        ctx, parent = ctypes.c_void_p(), ctypes.c_void_p()
        chk(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        chk(cu.cuGraphCreate(ctypes.byref(parent), 0), "cuGraphCreate")
        self._parent, self._args = parent, []
        last = None  # each node depends on the one before it
        for graph, guard in parts:
            graph_at = parent
            if guard is not None:
                handle = ctypes.c_ulonglong()
                chk(cu.cuGraphConditionalHandleCreate(ctypes.byref(handle), parent, ctx, 0, 0), "conditional handle")
                ptr = lambda t: ctypes.c_void_p(0 if t is None else t.data_ptr())  # noqa: E731
                args = (ctypes.c_ulonglong(handle.value), ptr(guard.live), ptr(guard.token), ptr(guard.stop_ids),
                        ctypes.c_int(0 if guard.stop_ids is None else guard.stop_ids.numel()))
                self._args.append(args)  # the launch reads them at instantiation: kept alive with the chain
                arg_ptrs = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                                           for a in args))
                self._args.append(arg_ptrs)
                kp = _KernelParams(func=setter, params=ctypes.cast(arg_ptrs, ctypes.POINTER(ctypes.c_void_p)))
                kp.grid[:], kp.block[:] = (1, 1, 1), (1, 1, 1)
                last = self._add(lambda node, deps, n: cu.cuGraphAddKernelNode_v2(node, parent, deps, n,
                                                                                   ctypes.byref(kp)), last, "setter")
                np_ = _NodeParams(type=_NODE_CONDITIONAL)
                np_.conditional = _ConditionalParams(handle=handle.value, type=_COND_IF, size=1, ctx=ctx)
                last = self._add(lambda node, deps, n: cu.cuGraphAddNode(node, parent, deps, n, ctypes.byref(np_)),
                                 last, "IF node")
                graph_at, deps = ctypes.c_void_p(np_.conditional.graphs_out[0]), None
            else:
                deps = last
            child = self._add(lambda node, d, n: cu.cuGraphAddChildGraphNode(
                node, graph_at, d, n, ctypes.c_void_p(graph.raw_cuda_graph())), deps, "child graph node")
            last = child if guard is None else last  # a guarded body hangs inside its IF node
        self._exec = ctypes.c_void_p()
        chk(cu.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), parent, ctypes.c_ulonglong(0)),
            "instantiate")

    def _add(self, add, after: ctypes.c_void_p | None, what: str) -> ctypes.c_void_p:
        node = ctypes.c_void_p()
        deps = None if after is None else ctypes.byref(after)
        self._drv.check(add(ctypes.byref(node), deps, ctypes.c_size_t(0 if after is None else 1)), what)
        return node

    def replay(self) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._drv.check(self._drv.cu.cuGraphLaunch(self._exec, stream), "cuGraphLaunch")

    def __del__(self):
        drv = getattr(self, "_drv", None)
        if drv is not None and getattr(self, "_exec", None) is not None:
            drv.cu.cuGraphExecDestroy(self._exec)
            drv.cu.cuGraphDestroy(self._parent)


class GuardedGraph(GuardedChain):
    """Replays `graph` (captured with keep_graph=True, not instantiated) only where flag (one int64 on the device)
    is nonzero when the replay reaches the device."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", flag: torch.Tensor):
        if flag.dtype != torch.int64 or flag.numel() != 1 or not flag.is_cuda:
            raise ValueError("flag: one int64 on a CUDA device")
        super().__init__([(graph, Guard(flag))])
        self.graph, self.flag = graph, flag
