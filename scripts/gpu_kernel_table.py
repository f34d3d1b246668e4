"""Per-kernel time vs ceilings on the GPU for the testbed and Llama-3-8B shapes (fused kernels vs torch refs)."""
import json
import sys

from specpilot.engines.shapes import LLAMA3_8B, SMOLLM2_135M
from specpilot.kernels.bench import bench_kernels, format_table

rows = []
for name, shape in (("smollm2-135m", SMOLLM2_135M), ("llama3-8b", LLAMA3_8B)):
    r = bench_kernels(shape, tokens_list=(1, 16))
    for x in r:
        x["model"] = name
    rows += r
    print(name)
    print(format_table(r), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
