"""Runs a script with every Triton module load reported (kernel, specialization, whether a CUDA graph was being
captured): a load during capture is illegal (cuModuleLoadData) and invalidates the capture, so this names the
kernel whose capture-time launch differed from its warm-up.

    python3 scripts/gpu_watch_loads.py scripts/gpu_step_ab.py OUT.json --table ...
"""
from __future__ import annotations

import runpy
import sys

import torch
import triton.compiler.compiler as compiler

_init_handles = compiler.CompiledKernel._init_handles


def _watched(self) -> None:
    if self.module is None:
        capturing = torch.cuda.is_current_stream_capturing()
        attrs = getattr(self.src, "attrs", None)
        print(f"[load] {'DURING CAPTURE ' if capturing else ''}{self.metadata.name} hash={self.hash[:10]} "
              f"warps={self.metadata.num_warps} stages={self.metadata.num_stages} "
              f"consts={str(getattr(self.src, 'constants', ''))[:300]} attrs={str(attrs)[:300]}", file=sys.stderr,
              flush=True)
    return _init_handles(self)


compiler.CompiledKernel._init_handles = _watched
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
