"""A captured CUDA graph that runs only where a device flag is set: a CUDA graph conditional (IF) node around it.

The device loop queues its next chunk before it reads the current one (overlap); when the current one stops the
request, the queued chunk only costs time (on the H200 a whole chain step: 2% of the overlapped chain's decode
time in session 34, the short requests weighing most). Its replay here first reads the loop's `live` flag on the
device and skips the chunk's body when it is 0.

torch 2.11's CUDAGraph cannot capture into a conditional node (that API came later), so the parent graph is built
with the CUDA driver API through ctypes: a one-thread kernel (compiled once by NVRTC) sets the node's handle from
the flag, and the IF node's body holds the captured graph as a child graph. The captured torch graph must be kept
(CUDAGraph(keep_graph=True)): its memory pool backs the body's tensors.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from functools import cache

import torch

_SETTER_SRC = rb"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);
extern "C" __global__ void set_if_nonzero(cudaGraphConditionalHandle handle, const long long *flag) {
    cudaGraphSetConditional(handle, *flag != 0);
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
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(func), module, b"set_if_nonzero"), "cuModuleGetFunction")
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


class GuardedGraph:
    """Replays `graph` (captured with keep_graph=True, not instantiated) only where flag (one int64 on the device)
    is nonzero when the replay reaches the device."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", flag: torch.Tensor):
        if flag.dtype != torch.int64 or flag.numel() != 1 or not flag.is_cuda:
            raise ValueError("flag: one int64 on a CUDA device")
        drv, setter = _driver_for(flag.device.index)
        cu, chk = drv.cu, drv.check
        self.graph, self.flag, self._drv = graph, flag, drv  # the body's memory pool lives with `graph`
        ctx, parent = ctypes.c_void_p(), ctypes.c_void_p()
        chk(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        chk(cu.cuGraphCreate(ctypes.byref(parent), 0), "cuGraphCreate")
        self._parent = parent
        handle = ctypes.c_ulonglong()
        chk(cu.cuGraphConditionalHandleCreate(ctypes.byref(handle), parent, ctx, 0, 0), "conditional handle")
        self._args = (ctypes.c_ulonglong(handle.value), ctypes.c_void_p(flag.data_ptr()))
        arg_ptrs = (ctypes.c_void_p * 2)(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in self._args))
        kp = _KernelParams(func=setter, params=ctypes.cast(arg_ptrs, ctypes.POINTER(ctypes.c_void_p)))
        kp.grid[:], kp.block[:] = (1, 1, 1), (1, 1, 1)
        set_node = ctypes.c_void_p()
        chk(cu.cuGraphAddKernelNode_v2(ctypes.byref(set_node), parent, None, ctypes.c_size_t(0), ctypes.byref(kp)),
            "setter node")
        np_ = _NodeParams(type=_NODE_CONDITIONAL)
        np_.conditional = _ConditionalParams(handle=handle.value, type=_COND_IF, size=1, ctx=ctx)
        if_node = ctypes.c_void_p()
        chk(cu.cuGraphAddNode(ctypes.byref(if_node), parent, ctypes.byref(set_node), ctypes.c_size_t(1),
                              ctypes.byref(np_)), "IF node")
        body, child = ctypes.c_void_p(np_.conditional.graphs_out[0]), ctypes.c_void_p()
        chk(cu.cuGraphAddChildGraphNode(ctypes.byref(child), body, None, ctypes.c_size_t(0),
                                        ctypes.c_void_p(graph.raw_cuda_graph())), "child graph node")
        self._exec = ctypes.c_void_p()
        chk(cu.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), parent, ctypes.c_ulonglong(0)),
            "instantiate")

    def replay(self) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._drv.check(self._drv.cu.cuGraphLaunch(self._exec, stream), "cuGraphLaunch")

    def __del__(self):
        drv = getattr(self, "_drv", None)
        if drv is not None and getattr(self, "_exec", None) is not None:
            drv.cu.cuGraphExecDestroy(self._exec)
            drv.cu.cuGraphDestroy(self._parent)
