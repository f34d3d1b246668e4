"""Why the W12 GEMV trails bf16: Nsight Compute's counters for the package's `linear` (or the norm launches: --op
norm is rmsnorm_linear, the QKV / LM head launch; --op glu rmsnorm_glu, gate_up's) on both weight formats.

Each (shape, T, format) runs once untimed (compiles), then once between cudaProfilerStart/Stop, so
`ncu --profile-from-start off` reads exactly one launch per configuration. The H200's Firecracker runtime reads
hardware counters (the device library's KINDS.md); `--clock-control none` leaves the clocks alone (METHOD.md).

OUT=... ; ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats \
  --metrics "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio$" \
  python3 scripts/gpu_ncu_w12.py [--op norm] > $OUT/ncu.txt; python3 scripts/gpu_ncu_w12.py --summary $OUT/ncu.txt
"""
from __future__ import annotations

import argparse
import re
import sys

import torch

# ncu's text report: one block per kernel launch, "  name (grid)x(block), Context 1, Stream 7, Device 0, CC 9.0",
# then "    Metric Name   Metric Unit   Metric Value" rows.
_METRICS = ("Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Registers Per Thread",
            "Achieved Occupancy", "Theoretical Occupancy", "Issue Slots Busy", "No Eligible", "Active Warps Per Scheduler",
            "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction", "Executed Instructions",
            "Block Limit Registers", "Grid Size", "Block Size")
_STALL = "smsp__average_warps_issue_stalled_"  # --metrics regex:^smsp__average_warps_issue_stalled_.*_per_issue_active


def run(shapes: list[tuple[int, int]], tokens: list[int], op: str = "linear") -> None:
    from specpilot.kernels import linear, rmsnorm_linear
    from specpilot.kernels.norm_epilogues import rmsnorm_glu
    from specpilot.weights.format import encode
    from specpilot.weights.oct import oct_layout

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for N, K in shapes:
        W = (torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        Q = oct_layout(encode(W))
        for T in tokens:
            x = torch.randn(T, K, generator=g, device=dev).to(torch.bfloat16)
            nw = (1 + 0.1 * torch.randn(K, generator=g, device=dev)).to(torch.bfloat16)
            call = {"linear": lambda w: linear(x, w), "norm": lambda w: rmsnorm_linear(x, nw, w, 1e-5),
                    "glu": lambda w: rmsnorm_glu(x, nw, w, 1e-5)}[op]
            for name, w in (("bf16", W), ("w12", Q)):
                call(w)  # compile and warm up outside the profiled range
                torch.cuda.synchronize()
                print(f"## config {op} {N}x{K} T={T} {name}", flush=True)
                torch.cuda.profiler.start()
                call(w)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
        del W, Q
        torch.cuda.empty_cache()


def summary(path: str) -> None:
    """One row per profiled launch: the configuration (from the driver's '## config' lines, in launch order) and the
    metrics above."""
    configs, rows, cur = [], [], None
    for line in open(path, errors="replace"):
        if line.startswith("## config"):
            configs.append(line[len("## config"):].strip())
        elif re.match(r"^\s{2}\S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line):
            cur = {"kernel": line.split()[0][:28]}
            rows.append(cur)
        elif cur is not None:
            parts = re.split(r"\s{2,}", line.strip())
            if len(parts) >= 2 and parts[0].startswith(_STALL):
                value = float(parts[-1].replace(",", ""))
                if value >= 0.05:
                    cur["stall " + parts[0][len(_STALL):-len("_per_issue_active.ratio")]] = f"{value:.2f}"
            elif len(parts) >= 3 and parts[0] in _METRICS and parts[0] not in cur:
                cur[parts[0]] = parts[-1] + ("" if parts[1] in ("", "inst", "register/thread") else f" {parts[1]}")
    for c, r in zip(configs, rows):
        print(f"### {c} ({r.pop('kernel')})")
        print("  " + "; ".join(f"{k}: {v}" for k, v in r.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128256x4096,14336x4096,4096x4096")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--op", choices=("linear", "norm", "glu"), default="linear")
    ap.add_argument("--summary", help="an ncu text report of this script's run: print its table")
    a = ap.parse_args()
    if a.summary:
        summary(a.summary)
        return
    run([tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")], [int(t) for t in a.tokens.split(",")],
        a.op)


if __name__ == "__main__":
    sys.exit(main())
